"""Issue 16's device run: every figure of its table in one command, each against a reference timed in the same run.

    PYTHONPATH=. python bench/gpu.py --json OUT.json                      # one H200: 14 GB of bf16, <= 7 min
    PYTHONPATH=. python bench/gpu.py --device cpu --size 0.05 --json X    # the CPU smoke test (tests/test_bench_gpu.py)

Options: ``--device cuda|cpu`` (default cuda; fails when CUDA is absent), ``--size GB`` (default 14 on cuda,
0.05 on cpu), ``--runs`` (trace runs, default both densities), ``--steps N`` (delta steps per run, the first
is a warm-up; default 5 on cuda, 2 on cpu), ``--budget S`` (default 400 s: the whole run stays inside 7
minutes), ``--tensors N`` (tensor count of the replicated model, default 291 = Llama-7B's),
``--codec`` (the Publisher's delta codec, default ``auto`` = the library default), ``--trace-steps K``
(use only the trace's first K steps: what ``bench/gpu_wheels.sh`` copies for the device machine),
``--vllm tiny|medium`` (size of the vLLM-style fake model), ``--profile N`` (one extra, unmeasured step per
run under cProfile: its N costliest functions, printed and kept in the JSON), ``--workdir DIR``, ``--json PATH``.

Data: the real SmolLM2 trace (env ``DELTASTORE_TRACES``, default ``../shared/traces``). Its recorded
tensors are replicated as cloned tensors under new names until the model reaches ``--size`` GB, on the
device. Replica ``r`` starts from the trace state just before cycle step ``r mod L`` (cycle = recorded
steps 2..K) and then steps through the cycle, each step moving the recorded positions by the recorded
ulp steps, so every element keeps its real change statistics. Replicas of one trace tensor are stacked
along dim 0 (``k`` replicas per tensor) so the model has about ``--tensors`` tensors like a real 7B
model (one tensor per replica would give ~15k tensors at 14 GB).

Figures (issue 16's table), per density (``cold`` ~0.2 %, ``dither`` ~2 %), medians over the measured
delta steps (step 1 is a warm-up whenever there are two or more):

* ``publish()`` blocking time with ``mirror_device=<device>``, synchronous and ``background=True``, vs
  the bare ``torch.ne(a.view(int16), b.view(int16)).nonzero()`` over every tensor on the device;
* total publish time per step (as model GB/s), host RSS and device memory beyond the model, vs the
  model's bytes (device memory from ``torch.cuda.max_memory_allocated``; skipped on cpu);
* a follower's delta pull into device targets vs a dense device-to-device ``copy_`` of the model and vs
  ``safetensors.torch.load_file(checkpoint, device=...)`` of the model's full checkpoint from local disk
  (the first run's starting state, loaded before its publishers exist so that it fits beside the model on
  an 80 GB card; page cache dropped for the file first with ``posix_fadvise``; a warm load is recorded too);
* the vLLM-style fused/sharded mapping on device parameters (``tests/test_vllm/fake_vllm_model.py`` +
  ``deltastore.integrations.vllm.mapping``): TP=1 through ``VllmApplier`` (sparse path) and a simulated
  TP=2 (two rank shards, probed separately, staged once, written per rank), bit-exact after each of 10
  versions, against a dense copy of the served parameters;
* codec encode/decode GB/s (deltastore's codecs run on the host CPU; no GPU codec kernels exist) vs
  memory bandwidth (``copy_`` on the device and on the host).

Checks (bit-exact, integer views, never allclose; a failure raises and the script exits 1): the
publisher's changed count equals the source's every step, the follower's target equals the source after
the anchor and after every delta pull, the loaded checkpoint equals the source, the background store's
last version verifies against the source (full checksums), every vLLM parameter equals a fresh load of
the same version (TP=1 and both TP=2 ranks) and keeps its ``data_ptr``.

Time: the script measures its own elapsed time; fixed phases run first, then each run gets an equal
share of what is left, and its steps stop (never below one warm-up + one measured step) when the next
would not fit. The JSON is rewritten after every phase, so a kill still leaves the finished phases.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import json
import math
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/scale.py: spinning OpenMP waits on shared cores

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # the working tree's deltastore, not an installed one

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import _trace  # noqa: E402
from _rss import Rss, baseline  # noqa: E402
import deltastore as ds  # noqa: E402
from deltastore.pull import tracking  # noqa: E402
from deltastore.codecs import TensorSpec, Update, get_codec  # noqa: E402

GB = 1e9
NEVER = 10**9  # anchor_every: measure steady-state deltas, never a re-anchor mid-run
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ANCHOR_CODEC = {"id": "dense", "config": {"planes": True}}  # the Publisher's default anchor codec
RUN_SHORT = {"cold-lr1e-6": "cold", "dither-lr1e-5": "dither"}
MEDIUM_VLLM = dict(HIDDEN=512, HEADS=8, KV_HEADS=2, HEAD=64, INTER=1408, VOCAB=16000, VOCAB_PAD=16064, LAYERS=4)


class BitMismatch(AssertionError):
    """A result that is not bit-exact (or a count that disagrees): the run fails."""


def log(msg: str) -> None:
    print(f"[gpu {time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


T0 = time.perf_counter()


# -- measuring ---------------------------------------------------------------------------------------
class Dev:
    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn):
        """``(result, wall seconds)`` of ``fn()``, the device synchronised before and after."""
        self.sync()
        t = time.perf_counter()
        r = fn()
        self.sync()
        return r, time.perf_counter() - t

    def alloc(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(BITS[t.element_size()])


def check_equal(got: dict, want: dict, what: str) -> None:
    """Raise :class:`BitMismatch` unless both dicts hold the same tensors bit for bit (integer views)."""
    if set(got) != set(want):
        raise BitMismatch(f"{what}: tensor names differ ({sorted(set(got) ^ set(want))[:5]})")
    for k, w in want.items():
        g = got[k]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            raise BitMismatch(f"{what}: {k} is {g.dtype}{tuple(g.shape)}, expected {w.dtype}{tuple(w.shape)}")
        a, b = int_view(g), int_view(w).to(g.device)
        if not torch.equal(a, b):
            raise BitMismatch(f"{what}: {k} differs in {int((a != b).sum())} of {a.numel()} elements")




def med(xs) -> float:
    return float(statistics.median(xs))


# -- the report --------------------------------------------------------------------------------------
class Report:
    def __init__(self, path: str | None, config: dict):
        self.path = path
        self.doc = {"complete": False, "config": config, "env": env_info(), "figures": {}, "skipped": {},
                    "notes": [], "raw": {}, "errors": [], "phases": {}}

    @property
    def figures(self) -> dict:
        return self.doc["figures"]

    def add(self, key: str, value, unit: str, label: str, reference: str = "") -> None:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"figure {key} is {value}")
        self.figures[key] = {"value": value, "unit": unit, "label": label, "reference": reference}

    def skip(self, key: str, why: str) -> None:
        self.doc["skipped"][key] = why

    def note(self, text: str) -> None:
        if text not in self.doc["notes"]:
            self.doc["notes"].append(text)

    def dump(self) -> None:
        self.doc["elapsed_s"] = time.perf_counter() - T0
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=1, default=str)
            os.replace(tmp, self.path)

    def table(self) -> str:
        lines = ["| figure | value | reference (same run) |", "|---|---:|---|"]
        for key, f in self.figures.items():
            v = f["value"]
            s = f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
            lines.append(f"| {f['label']} | {s} {f['unit']} | {f['reference']} |")
        for key, why in self.doc["skipped"].items():
            lines.append(f"| {key} | skipped | {why} |")
        return "\n".join(lines)


def env_info() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
            "numpy": np.__version__, "cpus": len(os.sched_getaffinity(0)), "deltastore": str(Path(ds.__file__).parent),
            "cuda_available": torch.cuda.is_available()}
    for mod in ("zstandard", "safetensors"):
        try:
            m = __import__(mod)
            info[mod] = f"{getattr(m, '__version__', '?')} ({Path(m.__file__).parent})"
        except Exception as e:  # noqa: BLE001 - recorded, the import error surfaces where it is used
            info[mod] = f"missing: {e!r}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = f"{p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs"
        info["cuda"] = torch.version.cuda
    try:
        info["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - the device copy of the tree may have no .git
        info["commit"] = None
    return info


# -- data: the replicated trace, on the device ----------------------------------------------------------
class Source:
    """The real trace replicated to ``size_gb`` on ``device``, stepping through its real changes in place.

    ``state``: ``{name: bf16 tensor}``, each tensor ``k`` stacked replicas of one recorded tensor.
    :meth:`advance` applies the next step on the device (O(changed)) and returns how many elements changed.
    """

    def __init__(self, run: str, size_gb: float, n_tensors: int, device: torch.device, trace_steps: int = 0):
        tr = _trace.load(run)
        steps = min(tr.steps, trace_steps) if trace_steps else tr.steps
        self.cycle = list(range(2, steps + 1)) if steps >= 2 else [1]
        L = len(self.cycle)
        numel = {n: tr.base[n].numel() for n in tr.names}
        shapes = {n: tuple(tr.base[n].shape) for n in tr.names}
        trace_bytes = 2 * sum(numel.values())
        want = size_gb * GB
        if want < trace_bytes:  # below one replica: the recorded tensors that fit, in order
            fit, room = [], want
            for n in tr.names:
                if 2 * numel[n] <= room or not fit:
                    fit.append(n)
                    room -= 2 * numel[n]
            R = 1
        else:
            fit, R = list(tr.names), max(1, round(want / trace_bytes))
        k = max(1, min(R, round(len(fit) * R / max(1, n_tensors))))
        self.replicas, self.stack = R, k
        need = {self.cycle[r % L] - 1 for r in range(R)}  # trace states replicas start from
        flat = {n: tr.base[n].view(torch.int16).reshape(-1).clone() for n in fit}
        starts: dict[int, dict[str, torch.Tensor]] = {}
        self.delta: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
        for j in range(0, steps + 1):
            if j:
                for n, (idx, bits) in tr.changes(j).items():
                    if n in flat:
                        if j in self.cycle:
                            step = bits.to(torch.int32) - flat[n][idx].to(torch.int32)
                            self.delta[j][n] = (idx.to(device), step.to(device))
                        flat[n][idx] = bits
            if j in need:
                starts[j] = {n: flat[n].clone().to(device) for n in fit}
        del flat, tr
        self.state: dict[str, torch.Tensor] = {}
        # per tensor: (name, source tensor, elements per replica, {phase q: replica offsets on the device})
        self.groups: list[tuple[str, str, int, dict[int, torch.Tensor]]] = []
        for src in fit:
            for g in range(math.ceil(R / k)):
                reps = list(range(g * k, min(R, (g + 1) * k)))
                name = f"g{g}.{src}"
                t = torch.cat([starts[self.cycle[r % L] - 1][src] for r in reps])
                shp = shapes[src]
                self.state[name] = t.view(torch.bfloat16).reshape((len(reps) * shp[0], *shp[1:]) if shp else (-1,))
                by_q = defaultdict(list)
                for i, r in enumerate(reps):
                    by_q[r % L].append(i * numel[src])
                offs = {q: torch.tensor(v, dtype=torch.int64, device=device) for q, v in by_q.items()}
                self.groups.append((name, src, numel[src], offs))
        del starts
        self.flat = {n: t.view(torch.int16).reshape(-1) for n, t in self.state.items()}
        self.t = 0
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def advance(self) -> int:
        self.t += 1
        L = len(self.cycle)
        total = torch.zeros((), dtype=torch.int64, device=self.device)
        for name, src, _n, offs in self.groups:
            flat = self.flat[name]
            for q, off in offs.items():
                d = self.delta[self.cycle[(q + self.t - 1) % L]].get(src)
                if d is None:
                    continue
                idx, step = d
                pos = (off[:, None] + idx[None, :]).reshape(-1)
                old = flat[pos]
                new = (old.to(torch.int32) + step.repeat(off.numel())).clamp_(-32768, 32767).to(torch.int16)
                flat[pos] = new
                total += (new != old).sum()
        return int(total)


def compare(prev: dict, cur: dict) -> None:
    """The reference: a bare bit-compare of every tensor, ``torch.ne(a.view(int16), b.view(int16)).nonzero()``."""
    for k, t in cur.items():
        torch.ne(prev[k].view(torch.int16), t.view(torch.int16)).nonzero()


def dense_copy(dst: dict, src: dict) -> None:
    for k, t in src.items():
        dst[k].copy_(t)


def drop_cache(path: str) -> bool:
    """Evict ``path`` from the page cache (fsync, then POSIX_FADV_DONTNEED); whether the call was possible."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


# -- phases ------------------------------------------------------------------------------------------
def phase_warmup(rep: Report, a, dev: Dev, work: Path) -> None:
    """Touch every path once at a tiny size (not measured): thread pools, lazy imports, CUDA context."""
    g = torch.Generator(device=dev.device).manual_seed(1)
    st = {f"w{i}": torch.randn((256, 1024), generator=g, device=dev.device).to(torch.bfloat16) for i in range(4)}
    pub = ds.Publisher(str(work / "warm-sync"), codec=a.codec, anchor_every=NEVER, mirror_device=dev.device)
    bg = ds.Publisher(str(work / "warm-bg"), codec=a.codec, anchor_every=NEVER, mirror_device=dev.device,
                      background=True)
    pub.publish(st, step=0)
    bg.publish(st, step=0).result()
    sub = ds.Subscriber(str(work / "warm-sync"))
    target = {k: torch.zeros_like(v) for k, v in st.items()}
    sub.pull(target, step=0)
    for t in (1, 2):
        for v in st.values():
            b = int_view(v)
            pos = torch.randint(0, b.numel(), (b.numel() // 100,), generator=g, device=dev.device).unique()
            b[pos] = b[pos] ^ 1
        pub.publish(st, step=t)
        bg.publish(st, step=t).result()
        sub.pull(target, step=t)
    check_equal(target, st, "warm-up pull")
    tracking.set_version(target, None)
    pub.close()
    bg.close()
    sub.close()
    for d in ("warm-sync", "warm-bg"):
        shutil.rmtree(work / d, ignore_errors=True)
    # the codec phase's codecs, on the host
    host = {k: int_view(v).cpu() for k, v in st.items()}
    codec_roundtrip([a.codec, "ulp"], host, {k: v.clone() ^ (torch.arange(v.numel()) % 97 == 0) for k, v in host.items()})


def phase_bandwidth(rep: Report, a, dev: Dev, nbytes: int) -> dict:
    """copy_ bandwidth on the device and on the host (bytes copied per second, best of a few)."""
    out = {}
    for where, d in (("device", dev.device), ("host", torch.device("cpu"))):
        if where == "device" and not dev.cuda:
            continue
        n = max(1 << 20, nbytes // 2)
        x = torch.empty(n, dtype=torch.int16, device=d).random_()
        y = torch.empty_like(x)
        best = min(Dev(str(d)).timed(lambda: y.copy_(x))[1] for _ in range(5))
        out[where] = 2 * n / best / GB
    if not dev.cuda:
        out["device"] = out["host"]
        rep.note("cpu run: the 'device' copy_ bandwidth is the host's")
    rep.add("copy_gbps_device", out["device"], "GB/s", f"copy_ bandwidth on the device ({a.device})",
            f"{nbytes / GB:.2f} GB, bytes copied per second (read + write is twice this)")
    rep.add("copy_gbps_host", out["host"], "GB/s", "copy_ bandwidth on the host", f"{nbytes / GB:.2f} GB")
    rep.doc["raw"]["bandwidth"] = out
    return out


def codec_roundtrip(codecs, old: dict, new: dict, reps: int = 1) -> dict:
    """Encode one step's changes of ``old`` -> ``new`` (flat host bit tensors) with each codec; decode; check."""
    specs = {k: TensorSpec(k, torch.bfloat16, (v.numel(),)) for k, v in old.items()}
    changes = {}
    for k in old:
        pos = torch.ne(old[k], new[k]).nonzero().squeeze(1)
        if pos.numel():
            changes[k] = pos
    out = {}
    for cid in dict.fromkeys(codecs):
        codec = get_codec(cid)
        ups = [Update(specs[k], new[k][p], p, old[k][p], old[k]) for k, p in changes.items()]
        enc, dec, data, got = [], [], b"", {}
        for _ in range(reps):
            data = None
            t = time.perf_counter()
            data = codec.encode(ups)
            enc.append(time.perf_counter() - t)
        for _ in range(reps):
            got = None
            t = time.perf_counter()
            got = codec.decode(data, [specs[k] for k in changes],
                               lambda name, p: old[name] if p is None else old[name][p])
            dec.append(time.perf_counter() - t)
        for k, p in changes.items():
            u = got[k]
            if not (torch.equal(u.positions, p) and torch.equal(u.bits, new[k][p])):
                raise BitMismatch(f"codec {cid}: decoded update of {k} differs from the encoded one")
        out[cid] = {"encode_s": min(enc), "decode_s": min(dec), "bytes": len(data),
                    "changed": sum(p.numel() for p in changes.values())}
    return out


def phase_codecs(rep: Report, a, dev: Dev, bw: dict, budget) -> None:
    """Host codecs on a replicated sample: the anchor codec once, the delta codecs per density."""
    gb = min(a.size, 1.0 if dev.cuda else 0.02)
    reps = 2 if dev.cuda else 1
    raw = rep.doc["raw"].setdefault("codecs", {})
    anchor_done = False
    for run in a.runs:
        r = RUN_SHORT.get(run, run)
        src = Source(run, gb, a.tensors, torch.device("cpu"), a.trace_steps)
        old = {k: v.clone() for k, v in src.flat.items()}
        src.advance()
        new = src.flat
        nbytes = src.nbytes
        res = codec_roundtrip([a.codec, "ulp"], old, new, reps)
        raw[r] = {"sample_bytes": nbytes, **res}
        for cid, x in res.items():
            for what in ("encode", "decode"):
                gbps = nbytes / x[f"{what}_s"] / GB
                rep.add(f"codec_{cid}_{what}_gbps.{r}", gbps, "GB/s",
                        f"{cid} {what}, {r} (model GB/s, host CPU)",
                        f"one step's {x['changed']:,} changes over a {nbytes / GB:.2f} GB sample")
                rep.add(f"codec_{cid}_{what}_vs_device_copy.{r}", gbps / bw["device"], "x",
                        f"{cid} {what} / device copy_, {r}", f"copy_ {bw['device']:.1f} GB/s")
        if not anchor_done:
            anchor_done = True
            codec = get_codec(ANCHOR_CODEC)
            groups, size = [[]], 0
            for k, v in src.flat.items():  # objects of at most 256 MB, as the Publisher cuts anchors
                if groups[-1] and size + 2 * v.numel() > 256 << 20:
                    groups.append([])
                    size = 0
                groups[-1].append(Update(TensorSpec(k, torch.bfloat16, (v.numel(),)), v))
                size += 2 * v.numel()
            enc, dec, data, got = [], [], None, None
            for _ in range(reps):
                data = None
                t = time.perf_counter()
                data = [codec.encode(g) for g in groups]
                enc.append(time.perf_counter() - t)
            for _ in range(reps):
                got = None
                t = time.perf_counter()
                got = [codec.decode(d, [u.spec for u in g]) for d, g in zip(data, groups)]
                dec.append(time.perf_counter() - t)
            for g, dg in zip(groups, got):
                for u in g:
                    if not torch.equal(dg[u.spec.name].bits, u.bits):
                        raise BitMismatch(f"anchor codec: {u.spec.name} decodes differently")
            enc_b = sum(len(d) for d in data)
            raw["dense"] = {"sample_bytes": nbytes, "encode_s": min(enc), "decode_s": min(dec), "bytes": enc_b}
            for what, s in (("encode", min(enc)), ("decode", min(dec))):
                gbps = nbytes / s / GB
                rep.add(f"codec_dense_{what}_gbps", gbps, "GB/s", f"dense (anchor codec) {what} (host CPU)",
                        f"{nbytes / GB:.2f} GB sample, {100 * enc_b / nbytes:.1f} % of raw")
                rep.add(f"codec_dense_{what}_vs_device_copy", gbps / bw["device"], "x",
                        f"dense {what} / device copy_", f"copy_ {bw['device']:.1f} GB/s")
                rep.add(f"codec_dense_{what}_vs_host_copy", gbps / bw["host"], "x",
                        f"dense {what} / host copy_", f"copy_ {bw['host']:.1f} GB/s")
        del src, old, new
        gc.collect()
        if budget.left() < 60:
            rep.note("codec phase cut short by the time budget")
            break
    rep.note("deltastore has no GPU codec kernels (deltastore/kernels is compiled C on the CPU): codec figures are "
             "host-CPU encode/decode against copy_ bandwidth")


def _fake_module(preset: str):
    path = ROOT / "tests" / "test_vllm" / "fake_vllm_model.py"
    spec = importlib.util.spec_from_file_location("_gpu_fake_vllm_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if preset == "medium":
        for k, v in MEDIUM_VLLM.items():
            setattr(mod, k, v)
    return mod


def phase_vllm(rep: Report, a, dev: Dev, work: Path) -> None:
    """The vLLM-style fused/sharded mapping on device parameters, bit-exact after each of 10 versions."""
    from deltastore.integrations.vllm import VllmApplier
    from deltastore.integrations.vllm.mapping import probe
    from deltastore.integrations.vllm.stage import stage

    fake = _fake_module(a.vllm)
    specs = fake.checkpoint_specs()
    d = dev.device

    def checkpoint(seed: int) -> dict:
        g = torch.Generator(device=d).manual_seed(seed)
        return {n: torch.randn(shape, generator=g, device=d).to(dt) for n, (dt, shape) in specs.items()}

    def perturb(ck: dict, frac: float, seed: int) -> dict:  # fake_vllm_model.perturb, on the device
        g = torch.Generator(device=d).manual_seed(seed)
        out = {}
        for n, t in ck.items():
            bits = int_view(t).to(torch.int32)
            mask = torch.rand(bits.numel(), generator=g, device=d) < frac
            step = torch.where(torch.rand(bits.numel(), generator=g, device=d) < 0.5, 1, -1).to(torch.int32)
            sign, mag = bits & 0x8000, bits & 0x7FFF
            nm = mag + step
            ok = mask & (nm >= 1) & (nm < 0x7F80)
            b = torch.where(ok, sign | nm, bits & 0xFFFF)
            b = torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16)
            out[n] = b.view(t.dtype).reshape(t.shape)
        return out

    def load(ck: dict, tp: int, rank: int):
        with torch.device(d):  # parameters made on the device (NaN-filled until loaded), as vLLM's are
            m = fake.FakeVllmModel(tp, rank)
        with torch.no_grad():
            m.load_weights(ck.items())
        return m

    def params(m) -> dict:
        return dict(m.named_parameters())

    versions = [checkpoint(11)]
    for i in range(1, 11):
        versions.append(perturb(versions[-1], 0.01, 100 + i))
    numel = sum(t.numel() for t in versions[0].values())
    uri = str(work / "vllm-store")
    with ds.Publisher(uri, anchor_every=NEVER, mirror_device=d) as pub:
        for s, ck in enumerate(versions):
            pub.publish(ck, step=s)
    raw = rep.doc["raw"]["vllm"] = {"preset": a.vllm, "checkpoint_elements": numel, "tp1": [], "tp2": []}

    # TP=1: the applier's sparse path (probe, stage through the served parameters, index_put_ in place)
    served = load(checkpoint(99), 1, 0)  # an engine started from some other checkpoint
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    ap = VllmApplier(served, None, path="sparse")
    ap.allow_cpu_sparse = not dev.cuda  # the CPU build repacks weights; the fake does not
    r, w = dev.timed(lambda: ap.pull(uri, 0))
    if r["route"] != "anchor":
        raise BitMismatch(f"vLLM TP=1: first pull took route {r['route']}")
    check_equal(params(served), params(load(versions[0], 1, 0)), "vLLM TP=1 version 0")
    raw["tp1_anchor_s"] = w
    scratch = {n: torch.empty_like(p) for n, p in served.named_parameters()}
    for s in range(1, 11):
        r, w = dev.timed(lambda: ap.pull(uri, s))
        if r["route"] != "delta":
            raise BitMismatch(f"vLLM TP=1 version {s}: route {r['route']}")
        _, wc = dev.timed(lambda: dense_copy(scratch, params(served)))
        check_equal(params(served), params(load(versions[s], 1, 0)), f"vLLM TP=1 version {s}")
        raw["tp1"].append({"step": s, "pull_s": w, "dense_copy_s": wc, "elements_written": r["elements_written"],
                           "stage_s": r["stage_s"], "apply_s": r["apply_s"]})
    if ptrs != {n: p.data_ptr() for n, p in served.named_parameters()}:
        raise BitMismatch("vLLM TP=1: a parameter's storage moved (data_ptr changed)")
    v, raw["tp1_verify_s"] = dev.timed(ap.verify_local)
    if v.get("ok") is not True:
        raise BitMismatch(f"vLLM TP=1: verify_local is {v.get('ok')}")
    rows = raw["tp1"]
    rep.add("vllm_tp1_versions_exact", len(rows), "versions", "vLLM-style TP=1: versions bit-exact (of 10)",
            "fresh load_weights of each version")
    rep.add("vllm_tp1_pull_s", med([x["pull_s"] for x in rows]), "s", "vLLM-style TP=1: pull per version",
            f"{numel:,} checkpoint elements, ~1 % change")
    rep.add("vllm_tp1_pull_vs_dense_copy", med([x["pull_s"] / x["dense_copy_s"] for x in rows]), "x",
            "vLLM-style TP=1: pull / dense copy_ of the served parameters", "copy_ on the device")
    del served, ap, scratch
    dev.free()

    # TP=2, simulated: two rank shards in one process; a delta is staged once (old bits read through both
    # ranks' maps, as the workers' all-reduce would) and each rank writes what it holds
    ranks = [load(checkpoint(98), 2, k) for k in (0, 1)]
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in ranks]
    with torch.no_grad():
        maps = [probe(m.load_weights, dict(m.named_parameters(remove_duplicate=False)), specs) for m in ranks]
    for k, pm in enumerate(maps):
        if pm.unmapped or not all(pm.blocks.get(n) for n in specs):
            raise BitMismatch(f"vLLM TP=2 rank {k}: unmapped {list(pm.unmapped)[:3]}")
    count = {n: math.prod(shape) for n, (_, shape) in specs.items()}

    def reader(name: str, positions):
        if positions is None:
            positions = torch.arange(count[name])
        h0, b0 = maps[0].gather(name, positions)
        h1, b1 = maps[1].gather(name, positions)
        both = h0 & h1
        if bool(both.any()) and not torch.equal(b0[both], b1[both]):
            raise BitMismatch(f"vLLM TP=2: the ranks' replicated copies of {name} differ")
        if not bool((h0 | h1).all()):
            raise BitMismatch(f"vLLM TP=2: positions of {name} held by no rank")
        return torch.where(h0, b0, b1)

    sub = ds.Subscriber(uri)
    current = None
    scratch = [{n: torch.empty_like(p) for n, p in m.named_parameters()} for m in ranks]
    for s in range(11):
        def step():
            for st in stage(sub.reader, current, reader if current is not None else None, s, specs=specs):
                with torch.no_grad():
                    for pm in maps:
                        if st.path == "anchor":
                            for name, bits in st.state.bits.items():
                                pm.write_full(name, bits)
                        else:
                            for name, (pos, bits, _orig) in st.changes().items():
                                pm.write(name, pos, bits)
            return st

        st, w = dev.timed(step)
        if st.path != ("anchor" if s == 0 else "delta"):
            raise BitMismatch(f"vLLM TP=2 version {s}: route {st.path}")
        current = st.ref
        _, wc = dev.timed(lambda: [dense_copy(scratch[k], params(m)) for k, m in enumerate(ranks)])
        for k, m in enumerate(ranks):
            check_equal(params(m), params(load(versions[s], 2, k)), f"vLLM TP=2 rank {k} version {s}")
        if s:
            raw["tp2"].append({"step": s, "pull_s": w, "dense_copy_s": wc, "elements": st.elements()})
    for k, m in enumerate(ranks):
        if ptrs[k] != {n: p.data_ptr() for n, p in m.named_parameters()}:
            raise BitMismatch(f"vLLM TP=2 rank {k}: a parameter's storage moved")
    sub.close()
    rows = raw["tp2"]
    rep.add("vllm_tp2_versions_exact", len(rows), "versions",
            "vLLM-style TP=2 (simulated, 2 ranks): versions bit-exact (of 10)", "fresh load_weights per rank")
    rep.add("vllm_tp2_pull_s", med([x["pull_s"] for x in rows]), "s",
            "vLLM-style TP=2: stage + both ranks' writes per version", f"{numel:,} checkpoint elements")
    rep.add("vllm_tp2_pull_vs_dense_copy", med([x["pull_s"] / x["dense_copy_s"] for x in rows]), "x",
            "vLLM-style TP=2: pull / dense copy_ of both ranks' parameters", "copy_ on the device")
    shutil.rmtree(uri, ignore_errors=True)


def profiled(fn, top: int) -> str:
    """``fn()`` under cProfile: its ``top`` functions by cumulative time, as text."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def phase_checkpoint(rep: Report, cur: dict, dev: Dev, work: Path) -> None:
    """The reload reference: the step's whole checkpoint as one safetensors file, loaded onto the device."""
    path = str(work / "step.safetensors")
    _, save_s = dev.timed(lambda: save_file(cur, path))
    size = os.path.getsize(path)
    if dev.cuda and torch.cuda.mem_get_info(dev.device)[0] < 1.05 * size:  # a card too small for a second copy
        os.remove(path)
        raise RuntimeError(f"no room on the device for the checkpoint ({size / GB:.1f} GB) beside the run's "
                           f"{torch.cuda.memory_allocated(dev.device) / GB:.1f} GB; use a larger card or --size")
    dropped = drop_cache(path)
    loaded, cold = dev.timed(lambda: load_file(path, device=str(dev.device)))
    check_equal(loaded, cur, "checkpoint loaded from disk")
    del loaded
    dev.free()
    loaded, warm = dev.timed(lambda: load_file(path, device=str(dev.device)))
    check_equal(loaded, cur, "checkpoint loaded again (page cache)")
    del loaded
    dev.free()
    os.remove(path)
    rep.doc["raw"]["checkpoint"] = {"bytes": size, "save_s": save_s, "load_cold_s": cold, "load_warm_s": warm,
                                    "page_cache_dropped": dropped}
    if not dropped:
        rep.note("posix_fadvise(DONTNEED) failed: the 'cold' checkpoint load may have read the page cache")
    rep.add("checkpoint_load_s", cold, "s", "load the model's safetensors checkpoint onto the device (disk)",
            f"{size / GB:.2f} GB file, page cache dropped first")
    rep.add("checkpoint_load_warm_s", warm, "s", "the same load again (page cache)", f"{size / GB:.2f} GB")


def phase_run(rep: Report, a, dev: Dev, work: Path, run: str, share: float, with_checkpoint: bool) -> None:
    """One density: publish (sync and background) and follow the replicated trace, step by step."""
    held: dict = {}
    try:
        _run(rep, a, dev, work, run, share, with_checkpoint, held)
    finally:  # also after a failure: a background writer or the tracking table would keep ~model bytes alive
        if "target" in held:
            tracking.set_version(held["target"], None)
        for k in ("pub", "bg", "sub"):
            if k in held:
                try:
                    held[k].close()
                except Exception as e:  # noqa: BLE001 - the phase's own error is what is reported
                    log(f"closing {k} after the run: {e!r}")
        held.clear()
        dev.free()
        for p in work.glob(f"{RUN_SHORT.get(run, run)}-*"):
            shutil.rmtree(p, ignore_errors=True)


def _run(rep: Report, a, dev: Dev, work: Path, run: str, share: float, with_checkpoint: bool, held: dict) -> None:
    r = RUN_SHORT.get(run, run)
    t_run = time.perf_counter()
    d = dev.device
    src = Source(run, a.size, a.tensors, d, a.trace_steps)
    cur = src.state
    mb = src.nbytes
    log(f"{r}: {mb / GB:.2f} GB, {len(cur)} tensors ({src.replicas} replicas, {src.stack} per tensor), "
        f"built in {time.perf_counter() - t_run:.1f} s; budget {share:.0f} s")
    raw = rep.doc["raw"].setdefault("runs", {})[r] = {
        "model_bytes": mb, "tensors": len(cur), "replicas": src.replicas, "stack": src.stack,
        "cycle": src.cycle, "steps": []}
    if with_checkpoint:  # before the publishers and the target exist: the model and one load fit an 80 GB card
        try:
            phase_checkpoint(rep, cur, dev, work)
            log(f"{r}: checkpoint reference: load {rep.doc['raw']['checkpoint']['load_cold_s']:.2f} s")
        except Exception:  # noqa: BLE001 - recorded; the run's own figures still come
            err = traceback.format_exc()
            rep.doc["errors"].append(f"checkpoint reference: {err}")
            print(f"\n*** checkpoint reference FAILED ***\n{err}", file=sys.stderr, flush=True)
        dev.free()
    prev = {k: v.clone() for k, v in cur.items()}
    dev.sync()
    base = baseline()
    rss = Rss()
    a0 = dev.alloc()
    store, store_bg = work / f"{r}-sync", work / f"{r}-bg"
    held["pub"] = pub = ds.Publisher(str(store), codec=a.codec, anchor_every=NEVER, mirror_device=d)
    rss.reset()
    info, w = dev.timed(lambda: pub.publish(cur, step=0))
    if info.kind != "anchor":
        raise BitMismatch(f"{r}: first publish is a {info.kind}")
    raw.update(anchor_publish_s=w, anchor_bytes=info.nbytes, pub_anchor_rss_peak=rss.peak() - base,
               pub_rss=Rss.now() - base, pub_dev=(dev.alloc() - a0) if dev.cuda else None)
    before, a1 = Rss.now(), dev.alloc()
    held["bg"] = bg = ds.Publisher(str(store_bg), codec=a.codec, anchor_every=NEVER, mirror_device=d,
                                    background=True)
    _, raw["bg_anchor_s"] = dev.timed(lambda: (bg.publish(cur, step=0).result(), bg.flush()))
    raw.update(bg_rss=Rss.now() - before, bg_dev=(dev.alloc() - a1) if dev.cuda else None)
    held["sub"] = sub = ds.Subscriber(str(store))
    held["target"] = target = {k: torch.zeros_like(v) for k, v in cur.items()}
    before, a2 = Rss.now(), dev.alloc()
    rss.reset()
    dev.reset_peak()
    res, raw["anchor_pull_s"] = dev.timed(lambda: sub.pull(target, step=0))
    if res.path != "anchor":
        raise BitMismatch(f"{r}: first pull took path {res.path}")
    raw.update(sub_anchor_rss_peak=rss.peak() - before, sub_anchor_dev_peak=(dev.peak() - a2) if dev.cuda else None)
    check_equal(target, cur, f"{r}: anchor pull")
    setup = time.perf_counter() - t_run
    log(f"{r}: anchors published (sync {raw['anchor_publish_s']:.1f} s, background {raw['bg_anchor_s']:.1f} s) "
        f"and pulled ({raw['anchor_pull_s']:.1f} s); setup {setup:.1f} s")
    rep.dump()

    def measured(fn, rowkey: str, row: dict):
        before, a_ = Rss.now(), dev.alloc()
        rss.reset()
        dev.reset_peak()
        out, row[f"{rowkey}_s"] = dev.timed(fn)
        row[f"{rowkey}_rss_peak"] = rss.peak() - before
        if dev.cuda:
            row[f"{rowkey}_dev_peak"] = dev.peak() - a_
        return out

    rows = raw["steps"]
    for t in range(1, a.steps + 1):
        t_step = time.perf_counter()
        changed = src.advance()
        row = {"step": t, "changed": changed}
        _, row["compare_s"] = dev.timed(lambda: compare(prev, cur))
        res = measured(lambda: pub.publish(cur, step=t), "publish", row)
        if res.kind != "delta" or res.changed != changed:
            raise BitMismatch(f"{r} step {t}: publish found {res.changed} changed ({res.kind}), the source {changed}")
        row["delta_bytes"] = res.nbytes
        fut = measured(lambda: bg.publish(cur, step=t), "bg_block", row)
        info_bg, row["bg_writer_s"] = dev.timed(lambda: (bg.flush(), fut.result())[1])
        if info_bg.changed != changed:
            raise BitMismatch(f"{r} step {t}: background publish found {info_bg.changed} changed, the source {changed}")
        _, row["dense_copy_s"] = dev.timed(lambda: dense_copy(prev, cur))  # also brings prev to this step
        res = measured(lambda: sub.pull(target, step=t), "pull", row)
        if res.path != "delta" or res.versions_applied != [t]:
            raise BitMismatch(f"{r} step {t}: pull took {res.path} {res.versions_applied}")
        row["bytes_fetched"] = res.bytes_fetched
        check_equal(target, cur, f"{r}: pull of step {t}")
        row["step_s"] = time.perf_counter() - t_step
        rows.append(row)
        log(f"{r} step {t}: {changed:,} changed ({100 * changed / (mb / 2):.3f} %), compare {row['compare_s']:.3f} s, "
            f"publish {row['publish_s']:.3f} s, background blocks {row['bg_block_s']:.3f} s "
            f"(writer {row['bg_writer_s']:.3f} s), pull {row['pull_s']:.3f} s, copy_ {row['dense_copy_s']:.4f} s")
        rep.dump()
        used = time.perf_counter() - t_run
        nxt = 1.3 * max(x["step_s"] for x in rows) + (5 if dev.cuda else 0.5)
        if t < a.steps and used + nxt > share and (t >= 2 or used + nxt > share * 1.25):
            log(f"{r}: stopping after step {t} of {a.steps} (time budget: {used:.0f} s used of {share:.0f} s)")
            break
    last = rows[-1]["step"]
    if a.profile:  # one more step, not measured: where a publish and a pull spend their time
        last += 1
        src.advance()
        raw["profile"] = {"publish": profiled(lambda: pub.publish(cur, step=last), a.profile),
                          "pull": profiled(lambda: sub.pull(target, step=last), a.profile)}
        bg.publish(cur, step=last).result()
        bg.flush()
        check_equal(target, cur, f"{r}: pull of the profiled step {last}")
        for what, text in raw["profile"].items():
            print(f"\n## {r}: profile of one {what} (cProfile, cumulative; step {last})\n{text}", flush=True)
    # the background store's last version against the source (full checksums, on the device)
    with ds.Subscriber(str(store_bg)) as check:
        check.verify(cur, step=last)
    tracking.set_version(target, None)  # the tracking table would keep the target alive
    for k in ("pub", "bg", "sub"):
        held.pop(k).close()
    if len(rows) < 2:
        rep.note(f"{r}: one step only (time budget): its figures include the warm-up step")
    m = rows[1:] if len(rows) > 1 else rows
    density = med([x["changed"] for x in m]) / (mb / 2)
    raw["density"] = density
    raw["measured_steps"] = [x["step"] for x in m]
    lab = f"{r} ({100 * density:.2f} %)"
    cmp_s = med([x["compare_s"] for x in m])
    rep.add(f"compare_s.{r}", cmp_s, "s", f"bare ne+nonzero over the model, {lab}", f"{mb / GB:.2f} GB on {a.device}")
    rep.add(f"publish_sync_vs_compare.{r}", med([x["publish_s"] / x["compare_s"] for x in m]), "x",
            f"publish() sync, mirror_device={a.device}, {lab}", "bare ne+nonzero")
    rep.add(f"publish_background_vs_compare.{r}", med([x["bg_block_s"] / x["compare_s"] for x in m]), "x",
            f"publish() blocking, background, {lab}", "bare ne+nonzero")
    rep.add(f"publish_sync_s.{r}", med([x["publish_s"] for x in m]), "s", f"publish per step, sync, {lab}",
            f"codec {a.codec}, local-disk store")
    rep.add(f"publish_background_total_s.{r}", med([x["bg_block_s"] + x["bg_writer_s"] for x in m]), "s",
            f"publish per step, background (blocking + writer), {lab}", "")
    rep.add(f"publish_model_gbps.{r}", mb / med([x["publish_s"] for x in m]) / GB, "GB/s",
            f"model bytes per second of sync publish, {lab}", f"model {mb / GB:.2f} GB")
    pub_rss = raw["pub_rss"] + med([x["publish_rss_peak"] for x in m])
    rep.add(f"publisher_rss_vs_model.{r}", max(pub_rss, 0) / mb, "x model",
            f"publisher host RSS beyond the model (after anchor + delta peak), {lab}", f"model {mb / GB:.2f} GB")
    rep.add(f"subscriber_rss_vs_model.{r}", max(med([x["pull_rss_peak"] for x in m]), 0) / mb, "x model",
            f"follower host RSS during a delta pull, {lab}", f"model {mb / GB:.2f} GB")
    if dev.cuda:
        dmem = raw["pub_dev"] + med([x["publish_dev_peak"] for x in m])
        rep.add(f"publisher_device_mem_vs_model.{r}", dmem / mb, "x model",
                f"publisher device memory beyond the model (mirror + delta peak), {lab}", "torch.cuda.max_memory_allocated")
        rep.add(f"publisher_bg_device_mem_vs_model.{r}", (raw["bg_dev"] + med([x["bg_block_dev_peak"] for x in m])) / mb,
                "x model", f"background publisher device memory beyond the model, {lab}", "")
        rep.add(f"subscriber_device_mem_vs_model.{r}", med([x["pull_dev_peak"] for x in m]) / mb, "x model",
                f"follower device memory beyond its target during a delta pull, {lab}", "")
    else:
        for k in ("publisher_device_mem_vs_model", "publisher_bg_device_mem_vs_model", "subscriber_device_mem_vs_model"):
            rep.skip(f"{k}.{r}", "device memory is not measured on cpu (torch.cuda.max_memory_allocated only)")
    pull_s = med([x["pull_s"] for x in m])
    rep.add(f"pull_s.{r}", pull_s, "s", f"follower delta pull into {a.device} targets, {lab}", "")
    rep.add(f"pull_vs_dense_copy.{r}", med([x["pull_s"] / x["dense_copy_s"] for x in m]), "x",
            f"follower pull / dense copy_ of the model, {lab}", f"copy_ on {a.device}")
    rep.add(f"dense_copy_s.{r}", med([x["dense_copy_s"] for x in m]), "s", f"dense copy_ of the model, {lab}", "")
    ck = rep.doc["raw"].get("checkpoint")
    if ck:
        rep.add(f"pull_vs_checkpoint_load.{r}", pull_s / ck["load_cold_s"], "x",
                f"follower pull / loading the model's checkpoint from disk, {lab}",
                f"load_file {ck['bytes'] / GB:.2f} GB in {ck['load_cold_s']:.2f} s")
    rep.add(f"anchor_publish_s.{r}", raw["anchor_publish_s"], "s", f"anchor publish (step 0), {lab}", "")
    rep.add(f"anchor_pull_s.{r}", raw["anchor_pull_s"], "s", f"anchor pull into zeroed targets, {lab}", "")
    held.clear()


# -- main --------------------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - T0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size", type=float, default=None, help="model GB of bf16 (default 14 on cuda, 0.05 on cpu)")
    ap.add_argument("--runs", nargs="+", default=list(_trace.RUNS))
    ap.add_argument("--steps", type=int, default=None, help="delta steps per run (default 5 on cuda, 2 on cpu)")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds for the whole run (default 400)")
    ap.add_argument("--tensors", type=int, default=291, help="about this many tensors (default 291: Llama-7B)")
    ap.add_argument("--codec", default="auto", help="the Publisher's delta codec (default auto)")
    ap.add_argument("--trace-steps", type=int, default=0, help="use only the trace's first K steps (0: all)")
    ap.add_argument("--vllm", choices=["tiny", "medium"], default=None, help="fake model size (cuda: medium)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the measured steps, one more step profiled: print its N costliest functions")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write every figure here (JSON)")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    a.size = a.size if a.size is not None else (14.0 if cuda else 0.05)
    a.steps = max(1, a.steps if a.steps is not None else (5 if cuda else 2))
    a.vllm = a.vllm or ("medium" if cuda else "tiny")
    if cuda and not torch.cuda.is_available():
        print("bench/gpu.py: --device cuda but torch sees no CUDA device (use --device cpu for the smoke test)",
              file=sys.stderr)
        return 2
    if not (_trace.TRACES / "weight_trace.py").exists():
        print(f"bench/gpu.py: weight trace not found at {_trace.TRACES}; set DELTASTORE_TRACES", file=sys.stderr)
        return 2
    dev = Dev(a.device)
    budget = Budget(a.budget)
    rep = Report(a.json, {k: v for k, v in vars(a).items()})
    log(f"device {a.device}, {a.size} GB, runs {a.runs}, steps {a.steps}, budget {a.budget:.0f} s, codec {a.codec}")
    log("env: " + ", ".join(f"{k} {v}" for k, v in rep.doc["env"].items()))
    work = Path(tempfile.mkdtemp(prefix="deltastore-gpu-", dir=a.workdir))

    def phase(name: str, fn, *args) -> bool:
        t = time.perf_counter()
        log(f"phase {name} ...")
        try:
            fn(*args)
            ok = True
        except Exception:  # noqa: BLE001 - recorded and printed; the other phases still run
            err = traceback.format_exc()
            rep.doc["errors"].append(f"{name}: {err}")
            print(f"\n*** phase {name} FAILED ***\n{err}", file=sys.stderr, flush=True)
            ok = False
        if not ok:
            dev.free()  # outside the except block: the traceback's frames (and their tensors) are gone by now
        rep.doc["phases"][name] = {"s": time.perf_counter() - t, "ok": ok}
        log(f"phase {name}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - t:.1f} s)")
        rep.dump()
        return ok

    try:
        phase("warmup", phase_warmup, rep, a, dev, work)
        bw: dict = {}
        phase("bandwidth", lambda: bw.update(phase_bandwidth(rep, a, dev, int(min(a.size, 1.0) * GB))))
        if bw:
            phase("codecs", phase_codecs, rep, a, dev, bw, budget)
        phase("vllm", phase_vllm, rep, a, dev, work)
        for i, run in enumerate(a.runs):
            share = max(0.0, (budget.left() - 10) / (len(a.runs) - i))
            phase(f"run {run}", phase_run, rep, a, dev, work, run, share, i == 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rep.doc["complete"] = True
    rep.dump()
    print("\n## bench/gpu.py figures" + (" (CPU SMOKE TEST: not GPU figures)" if not cuda else ""))
    print(rep.table())
    for n in rep.doc["notes"]:
        print(f"- {n}")
    elapsed = time.perf_counter() - T0
    if rep.doc["errors"]:
        print(f"\nRESULT FAILED: {len(rep.doc['errors'])} phase(s) failed ({elapsed:.0f} s)", flush=True)
        return 1
    print(f"\nRESULT ok: {len(rep.figures)} figures, every check bit-exact ({elapsed:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
