"""Peers benchmark: deltastore beside the weight-sync formats RL frameworks ship, step by step on real traces.

    DELTASTORE_TRACES=../shared/traces .venv/bin/python bench/peers.py [--traces smollm2-135m minilm-l6]
        [--runs cold dither] [--steps N] [--threads 1 2] [--syncs ours-auto grail ...] [--size GB] [--json PATH]

Every step of every chosen trace run goes through each sync in turn, in one process: the sender encodes the
step from what it last sent (its change detection, payload, compression, integrity data and snapshot
update), the receiver applies it to its own copy of the weights, and the copy is compared with the trace's
state bit for bit (integer views). The syncs:

* ``ours-auto``: ``deltastore.Publisher`` with its default codec (``auto``) and every other default, and a
  ``Subscriber`` pulling each version into a target dict, on a local store (tmpfs when the machine has one);
* ``ours-ctx``: the same with ``codec={"id": "auto", "config": {"link_mbps": None}}`` (fewest bytes: ``ctx``);
* the peers' references (``bench/peer_formats.py``): TRL raw and gap_delta, grail sparse_codec v2, NeMo-RL
  XOR and overwrite, slime/Miles XOR and overwrite, SkyRL XOR, vLLM sparse patches.

Reported per trace run, each as the median over the steps and its spread (min-max): bytes a receiver downloads
per changed element (ours: the objects it fetched plus the version's manifest) and that over the
independent-position bound (``bench/reference_encoders.py``); encode and decode/apply throughput in MB of model
per second of process CPU time and of wall time, with 1 and 2 threads (torch threads, deltastore's kernel and
codec threads, the peers' worker pools); and the sync time of a step, encode CPU + transfer + decode CPU
(1 thread), at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s. Before the measured steps each sync runs step 1 once on a
throwaway copy (compiled kernels, pools, first-touch memory). The machine is shared: compare the syncs of one
run with each other (they are interleaved step by step, in a rotating order), not with other runs.

``--size GB``: each trace run replicated to a model of that size as ``bench/scale.py`` builds it (replicas
start at different recorded steps and keep their rows in different orders, so that no codec can match one
replica against another), to see what a version's fixed costs weigh at a real model's size. Every sync holds
the model once or twice (its sender's snapshot, its receiver's copy): pick the syncs to fit in memory.
"""

from __future__ import annotations

import os

# Passive OpenMP waits (as bench/scale.py): spinning threads would turn other load into our CPU time.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import _trace  # noqa: E402
import peer_formats  # noqa: E402
import reference_encoders as ref  # noqa: E402
import deltastore as ds  # noqa: E402

LINKS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9, "10 Gbit/s": 10e9}
OURS = {"ours-auto": "auto", "ours-ctx": {"id": "auto", "config": {"link_mbps": None}}}
SYNCS = [*OURS, *peer_formats.PEERS]
MB = 1e6


def set_threads(n: int) -> None:
    """torch's threads and deltastore's kernel and codec threads (read at each call)."""
    torch.set_num_threads(n)
    os.environ["DELTASTORE_THREADS"] = str(n)
    os.environ["DELTASTORE_CODEC_THREADS"] = str(n)


def equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(peer_formats.bits(a[k]), peer_formats.bits(b[k])) for k in a)


class PeerRun:
    """A peer reference and its receiver's copy of the weights."""

    def __init__(self, name: str, base: dict[str, torch.Tensor], threads: int, workdir: str):
        self.name = name
        self.sync = peer_formats.PEERS[name](base, threads)
        self.target = {k: v.clone() for k, v in base.items()}
        self.nbytes = 0
        self._blob = b""

    def send(self, state) -> None:
        self._blob = self.sync.send(state)

    def receive(self) -> None:
        self.sync.receive(self._blob, self.target)
        self.nbytes, self._blob = len(self._blob), b""

    def close(self) -> None:
        pass


class OursRun:
    """deltastore: a Publisher and a Subscriber on one local store; step 0 is the anchor (not measured)."""

    def __init__(self, name: str, base: dict[str, torch.Tensor], threads: int, workdir: str):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"peers-{name}-", dir=workdir)
        self.pub = ds.Publisher(self.dir, codec=OURS[name], max_workers=threads)
        self.pub.publish(base, step=0)
        self.sub = ds.Subscriber(self.dir, max_workers=threads)
        self.target = {k: torch.zeros_like(v) for k, v in base.items()}
        self.sub.pull(self.target, step=0)
        self.step, self.nbytes, self.manifest, self.kind = 0, 0, 0, ""

    def send(self, state) -> None:
        self.step += 1
        self.kind = self.pub.publish(state, step=self.step).kind

    def receive(self) -> None:
        res = self.sub.pull(self.target, step=self.step)
        self.manifest = os.path.getsize(os.path.join(self.dir, "versions", f"{self.step:012d}.json"))
        self.nbytes = res.bytes_fetched + self.manifest

    def close(self) -> None:
        self.pub.close()
        self.sub.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def open_sync(name: str, base, threads: int, workdir: str):
    return (OursRun if name in OURS else PeerRun)(name, base, threads, workdir)


def timed(fn) -> tuple[float, float]:
    """(wall s, process CPU s) of ``fn()``."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


class TraceModel:
    """The trainer's weights stepping through a trace run as recorded: step 0 is the base, :meth:`step` applies
    steps 1, 2, ... in place."""

    def __init__(self, tr):
        self.tr = tr
        self.base = {k: v.contiguous() for k, v in tr.base.items()}
        self.state = {k: v.clone() for k, v in self.base.items()}
        self.steps = tr.steps
        self.t = 0

    def warm_pair(self) -> tuple[dict, dict]:
        """(from, to) states for the warm-up: the base and a copy at step 1; the model does not move."""
        to = {k: v.clone() for k, v in self.base.items()}
        _apply(self.tr, 1, to)
        return self.base, to

    def step(self, bound: bool) -> tuple[int, float | None]:
        """Apply the next step to :attr:`state`; its changed count and (``bound``) independent-position bound."""
        self.t += 1
        bound_in = _apply(self.tr, self.t, self.state)
        changed = sum(v[0].size for v in bound_in.values())
        return changed, ref.independent_bound(bound_in) if bound else None


def _apply(tr, step: int, state: dict[str, torch.Tensor]) -> dict:
    """Apply trace step ``step`` to ``state`` in place; the bound's input for it."""
    bound_in = {}
    for n, (idx, new) in tr.changes(step).items():
        flat = state[n].view(torch.int16).reshape(-1)
        old = flat[idx]
        bound_in[n] = (idx.numpy(), new.numpy(), old.numpy(), tuple(state[n].shape), torch.bfloat16)
        flat[idx] = new
    return bound_in


class SizedModel:
    """A trace run replicated to ``size_gb`` as ``bench/scale.py`` builds it (:class:`scale.Source`: replicas
    start at different recorded steps, rows of 2-D tensors in different orders, so no codec can match one
    replica against another), stepping through the run's real changes cyclically."""

    def __init__(self, run: str, size_gb: float):
        import scale

        self.src = scale.Source(run, size_gb=size_gb)
        self.state = self.src.state
        self.base = None
        self.steps = len(self.src.cycle)

    def warm_pair(self) -> tuple[dict, dict]:
        """(from, to) for the warm-up: the model before and after one step; the measured steps start after it."""
        before = {k: v.clone() for k, v in self.state.items()}
        self.src.advance(keep=False)
        self.base = {k: v.clone() for k, v in self.state.items()}
        return before, self.base

    def step(self, bound: bool) -> tuple[int, float | None]:
        changes = self.src.advance()
        return sum(pos.numel() for _, pos, _, _ in changes), self.src.bound_bytes(changes) if bound else None


def warm_up(names, start: dict, to: dict, threads: int, workdir: str) -> None:
    """Each sync sends ``to`` from ``start`` once and applies it, on throwaway syncs (pools, first-touch memory)."""
    for name in names:
        s = open_sync(name, start, threads, workdir)
        s.send(to)
        s.receive()
        s.close()


def run_model(model, names: list[str], n_steps: int, threads: int, workdir: str, bound: bool = True) -> dict:
    """``n_steps`` steps of ``model`` through each sync in ``names``: per sync and step the wall and CPU
    seconds of the send and of the receive, the bytes received and whether the receiver is bit-exact; per step
    the changed count and (``bound``) the independent-position bound."""
    set_threads(threads)
    warm_up(names, *model.warm_pair(), threads, workdir)
    syncs = [open_sync(n, model.base, threads, workdir) for n in names]
    state = model.state
    out = {n: [] for n in names}
    meta = []
    failed: dict[str, str] = {}
    try:
        for i in range(n_steps):
            changed, bound_bytes = model.step(bound)
            step = i + 1
            meta.append({"step": step, "changed": changed, "bound": bound_bytes})
            order = syncs[i % len(syncs):] + syncs[:i % len(syncs)]
            for s in order:
                if s.name in failed:
                    continue
                row = {"step": step}
                try:
                    row["enc_wall"], row["enc_cpu"] = timed(lambda: s.send(state))
                    row["dec_wall"], row["dec_cpu"] = timed(s.receive)
                    row["exact"] = equal_bits(s.target, state)
                except peer_formats.IntegrityError as e:
                    row["exact"], row["error"] = False, str(e)
                row["bytes"] = s.nbytes
                if isinstance(s, OursRun):
                    row["manifest"] = s.manifest
                if getattr(s, "kind", "delta") not in ("", "delta"):
                    row["kind"] = s.kind
                out[s.name].append(row)
                if not row["exact"]:
                    failed[s.name] = row.get("error") or f"receiver differs from the trace after step {step}"
    finally:
        for s in syncs:
            s.close()
    return {"steps": meta, "syncs": out, "failed": failed}


# -- report ----------------------------------------------------------------------------------------------
def stat(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def fmt(s: dict | None, digits: int = 0) -> str:
    if not s:
        return "—"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def summarise(one: dict, model_bytes: int) -> dict:
    """Per sync: the figures of one trace run (1-thread result = ``one[1]``, 2-thread = ``one[2]``)."""
    meta = one[min(one)]["steps"]
    by_step = {m["step"]: m for m in meta}
    out = {}
    for name in one[min(one)]["syncs"]:
        rows1 = one[min(one)]["syncs"][name]
        fig: dict = {"exact_steps": sum(r["exact"] for r in rows1), "steps": len(meta),
                     "failed": one[min(one)]["failed"].get(name)}
        ok = [r for r in rows1 if r["exact"]]
        fig["bytes_per_changed"] = stat([r["bytes"] / by_step[r["step"]]["changed"] for r in ok])
        fig["x_bound"] = stat([r["bytes"] / by_step[r["step"]]["bound"] for r in ok if by_step[r["step"]]["bound"]])
        for threads, res in one.items():
            rows = [r for r in res["syncs"][name] if r["exact"]]
            for what in ("enc", "dec"):
                for clock in ("cpu", "wall"):
                    fig[f"{what}_{clock}_{threads}t"] = stat([model_bytes / MB / r[f"{what}_{clock}"] for r in rows
                                                             if r[f"{what}_{clock}"] > 0])
        for link, bps in LINKS.items():
            fig[f"sync_ms {link}"] = stat([1e3 * (r["enc_cpu"] + r["dec_cpu"] + 8 * r["bytes"] / bps) for r in ok])
        fig["anchors"] = sum(r.get("kind") == "anchor" for r in rows1)  # ours: steps whose version is also an anchor
        fig["manifest_share"] = stat([r["manifest"] / r["bytes"] for r in ok if "manifest" in r])
        out[name] = fig
    return out


def report(title: str, density: dict, figs: dict, threads: list[int]) -> None:
    print(f"\n## {title}\n\nchanged per step {fmt(density, 3)} %\n")
    print("| sync | bit-exact steps | B/changed el | x bound | " + " | ".join(f"sync ms @ {k}" for k in LINKS) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(LINKS))
    for name, f in figs.items():
        exact = f"{f['exact_steps']}/{f['steps']}" + (f" — {f['failed']}" if f["failed"] else "")
        if f["anchors"]:
            exact += f" ({f['anchors']} of them also wrote an anchor)"
        print(f"| {name} | {exact} | {fmt(f['bytes_per_changed'], 3)} | {fmt(f['x_bound'], 2)} | "
              + " | ".join(fmt(f[f'sync_ms {k}'], 1) for k in LINKS) + " |")
    for name, f in figs.items():
        if f["manifest_share"]:
            print(f"- {name}: its version manifest is {fmt(f['manifest_share'], 2)} of its bytes per step (the "
                  "bound counts positions and values only; each peer's bytes include its own headers)")
    cols = [(w, c, t) for w in ("enc", "dec") for t in threads for c in ("cpu", "wall")]
    print("\nMB of model per second (CPU = per second of process CPU time, all threads; wall = elapsed):\n")
    print("| sync | " + " | ".join(f"{'encode' if w == 'enc' else 'decode+apply'} {t}t {c}" for w, c, t in cols)
          + " |")
    print("|---|" + "---:|" * len(cols))
    for name, f in figs.items():
        print(f"| {name} | " + " | ".join(fmt(f.get(f"{w}_{c}_{t}t")) for w, c, t in cols) + " |")


def headline(all_figs: dict) -> None:
    """Ours against the best peer at 1 Gbit/s (1-thread CPU), per trace run."""
    key = "sync_ms 1 Gbit/s"
    print("\n## Sync time per step at 1 Gbit/s (encode CPU + transfer + decode CPU, 1 thread), medians\n")
    print("| trace run | ours-auto ms | ours-ctx ms | best peer | its ms | ours-auto / best peer | "
          "ours-auto B/changed el | best peer by bytes |")
    print("|---|---:|---:|---|---:|---:|---:|---|")
    for title, figs in all_figs.items():
        peers = {n: f for n, f in figs.items() if n not in OURS and f[key] and not f["failed"]}
        if not peers:
            continue
        best = min(peers, key=lambda n: peers[n][key]["median"])
        fewest = min(peers, key=lambda n: peers[n]["bytes_per_changed"]["median"])
        ours = {n: figs[n][key]["median"] if n in figs and figs[n][key] else float("nan") for n in OURS}
        auto_b = figs.get("ours-auto", {}).get("bytes_per_changed") or {"median": float("nan")}
        print(f"| {title} | {ours['ours-auto']:.1f} | {ours['ours-ctx']:.1f} | {best} | "
              f"{peers[best][key]['median']:.1f} | {ours['ours-auto'] / peers[best][key]['median']:.2f} | "
              f"{auto_b['median']:.3f} | {fewest} {peers[fewest]['bytes_per_changed']['median']:.3f} |")


def default_workdir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", nargs="+", default=None, help=f"trace names (default: all found: "
                    f"{', '.join(_trace.available()) or 'none'})")
    ap.add_argument("--runs", nargs="+", default=["cold", "dither"], help="run kinds (cold, dither) or run names")
    ap.add_argument("--steps", type=int, default=0, help="measure steps 1..N of each run (default: all)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--syncs", nargs="+", default=SYNCS, choices=SYNCS)
    ap.add_argument("--size", type=float, default=None, help="replicate each trace to this many GB of bf16 "
                    "as bench/scale.py does (default: the trace as recorded); each sync holds a copy or two")
    ap.add_argument("--workdir", default=default_workdir(), help="where our stores go (default /dev/shm)")
    ap.add_argument("--json", default=None, help="write every figure and the per-step measurements here")
    a = ap.parse_args(argv)
    a.traces = a.traces or _trace.available()
    if 1 not in a.threads:
        ap.error("--threads must include 1 (the sync times use the 1-thread figures)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"bench/peers.py: traces {' '.join(a.traces)}, runs {' '.join(a.runs)}, threads {a.threads}, "
          f"syncs {len(a.syncs)}, size {a.size or 'as recorded'}, os.cpu_count() {os.cpu_count()}, 1-min load "
          f"{os.getloadavg()[0]:.1f}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, deltastore "
          f"{Path(ds.__file__).parent}", flush=True)
    all_figs, raw = {}, {}
    for name in a.traces:
        runs = [r for r in _trace.runs(name) if r in a.runs or _trace.short(r) in a.runs]
        if not runs:
            print(f"trace {name}: no run among {a.runs} (have {_trace.runs(name)})", file=sys.stderr)
            return 1
        _trace.select(name)
        for run in runs:
            one = {}
            for threads in a.threads:
                t0 = time.perf_counter()
                model = SizedModel(run, a.size) if a.size else TraceModel(_trace.load(run, name))
                n_steps = min(a.steps, model.steps) if a.steps else model.steps
                one[threads] = run_model(model, a.syncs, n_steps, threads, a.workdir, bound=threads == 1)
                model_bytes = sum(t.numel() * t.element_size() for t in model.state.values())
                del model
                print(f"{name} {run}: {threads} thread(s), {n_steps} steps, {time.perf_counter() - t0:.0f} s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
            title = f"{name} {run} ({model_bytes / MB:.1f} MB of bf16, {n_steps} steps)"
            density = stat([100 * m["changed"] / (model_bytes / 2) for m in one[1]["steps"]])
            all_figs[title] = summarise(one, model_bytes)
            report(title, density, all_figs[title], a.threads)
            raw[title] = {"trace": name, "run": run, "model_bytes": model_bytes, "density_pct": density,
                          "results": {str(t): v for t, v in one.items()}}
    headline(all_figs)
    failed = [(t, n, f["failed"]) for t, figs in all_figs.items() for n, f in figs.items() if f["failed"]]
    for t, n, why in failed:
        print(f"\nNOT BIT-EXACT: {n} on {t}: {why}", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "figures": all_figs, "raw": raw, "load_average": os.getloadavg()}, f,
                      indent=1, default=float)
        print(f"\nfigures written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
