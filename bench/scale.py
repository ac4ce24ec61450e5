"""Scale benchmark: every figure of issue 11's Targets table, measured in one run.

    .venv/bin/python bench/scale.py [--size 1.0] [--runs cold-lr1e-6 dither-lr1e-5] [--repeat 3]
                                    [--tensors 16384 --tensors-mb 200] [--codecs auto ulp zstd raw]
                                    [--quick] [--json PATH] [--skip memory codecs ...]

Data: a real weight trace, chosen by ``--trace`` (``bench/_trace.py``): the shared SmolLM2 trace
(default; env ``DELTASTORE_TRACES``, default ``../shared/traces``) or ``minilm-l6`` (``bench/traces/``,
a BERT encoder). Its recorded tensors (20 for SmolLM2) are replicated, each replica a clone under new names
(``r<k>.<name>``, ``k`` zero-padded so that name order is replica order), until the
model reaches ``--size`` GB of bf16. Replica ``k`` starts at a different recorded
step (``k`` mod the cycle) and steps through the run's recorded steps 2..N
cyclically (``deltastore.chains.extend_trace`` semantics: the recorded positions
change by the recorded ulp steps), so every element keeps its real change
statistics. With more replicas than cycle steps some replicas replay the same step
at once; so that no codec can match one replica's positions against another's
(the earlier layout let zstd do it within its window: at 1 GB the cold minilm-l6
run downloaded 0.504x the bound instead of ~1.17x), the rows of every 2-D tensor
of replica ``k`` are in one of ``ROW_ORDERS`` fixed random orders (``k`` mod
``ROW_ORDERS``; order 0 is the recorded one): a row keeps its elements and their
changes, only its place moves, and replicas that replay the same step in the
same row order are at least lcm(cycle, ``ROW_ORDERS``) replicas apart in name
order. Step 1 (AdamW's first update, ~2x denser) is left out of the cycle. The "many tensors" layout cuts the recorded tensors into row blocks of
about ``--tensors-mb`` / ``--tensors`` bytes (norm vectors stay whole) and
replicates them the same way until there are ``--tensors`` tensors.

Every case runs in a fresh child process, forked from this one before any tensor
work, so that none pollutes another; the memory cases run in a new interpreter
instead (spawned), because a forked child counts as its own every page of
library code it touches that this process had resident already.
References are timed in the same child as what they are compared with, step by
step, interleaved. Each delta figure is the median over ``--repeat`` steps after
one warm-up step; anchor figures repeat the anchor ``--repeat`` times
(16k-tensor layout). Times are wall clock (what a 2-core machine waits) and
process CPU time (all threads; less disturbed by other load on shared cores):
both are printed, the verdict uses wall. Memory: VmRSS / VmHWM of the child
(the peak is reset through ``/proc/self/clear_refs`` before each measured call),
minus its own baseline after the model or target is built.

The ``--quick`` preset (tiny sizes) runs in well under a minute and is what
``tests/test_bench_scale.py`` runs (correctness only).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# GNU OpenMP threads spin while they wait (OMP_WAIT_POLICY unset). On cores shared with other work that turns
# every torch op's wall *and* CPU time into a function of the neighbours' load (measured here: the same
# 0.25 GB compare 0.2 s passive, 1.7-17 s active at load 5 on 2 cores), for reference and code alike.
# Passive waiting must be set before libgomp loads (import torch); an explicit setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import _trace  # noqa: E402
from _fresh_memory import fault_cost  # noqa: E402
from _rss import Rss, baseline  # noqa: E402
import reference_encoders as ref  # noqa: E402
import deltastore as ds  # noqa: E402
from deltastore.codecs import TensorSpec, Update, get_codec  # noqa: E402
from deltastore.tensors import DTYPES  # noqa: E402

GB = 1e9
MB = 1e6
_PUBLISHER_DEFAULTS = {k: v.default for k, v in inspect.signature(ds.Publisher).parameters.items()}
#: the Publisher's default anchor codec and object size (read from its signature: the public defaults)
DEFAULT_ANCHOR_CODEC = _PUBLISHER_DEFAULTS["anchor_codec"]
DEFAULT_MAX_OBJECT_BYTES = _PUBLISHER_DEFAULTS["max_object_bytes"]
#: Llama-style tensor counts for the projection (layers x 9 + embed, final norm, lm_head)
PROJECT = {"7B": (7.0e9, 32 * 9 + 3), "70B": (70.0e9, 80 * 9 + 3)}
PROJECT_CORES = 16


# -- data ------------------------------------------------------------------------------------------
#: replica k's 2-D tensors have their rows in order k mod ROW_ORDERS (0: as recorded); see the module docstring
ROW_ORDERS = 4


@dataclass
class Piece:
    """One published tensor: ``numel`` flat elements of trace tensor ``src`` from ``start``, replica ``replica``."""

    name: str
    replica: int
    src: str
    start: int
    numel: int
    shape: tuple[int, ...]


class Source:
    """A replicated trace model that steps through the run's real changes in place.

    ``state`` is ``{name: bf16 tensor}`` (every tensor its own storage);
    :meth:`advance` applies the next step to it in place (O(changed)) and
    returns the changes as ``[(name, positions, new bits, old bits)]``.
    """

    def __init__(self, run: str, *, size_gb: float | None = None, n_tensors: int | None = None,
                 tensors_mb: float | None = None):
        tr = _trace.load(run)
        self.run = run
        self.cycle = list(range(2, tr.steps + 1)) if tr.steps > 1 else [1]
        shapes = {n: tuple(t.shape) for n, t in tr.base.items()}
        numels = {n: t.numel() for n, t in tr.base.items()}
        self.src_numel = numels
        per: list[tuple[str, int, int, tuple[int, ...]]] = []
        if n_tensors is None:
            want = (size_gb or 1.0) * GB
            trace_bytes = 2 * sum(numels.values())
            replicas = max(1, round(want / trace_bytes))
            if want < trace_bytes:  # below one replica (--quick): the recorded tensors that fit, in order
                fit, room = [], want
                for n in tr.names:
                    if 2 * numels[n] <= room or not fit:
                        fit.append(n)
                        room -= 2 * numels[n]
            else:
                fit = tr.names
            per = [(n, 0, numels[n], shapes[n]) for n in fit]
        else:
            elems = max(1.0, (tensors_mb or 200.0) * MB / 2 / n_tensors)
            for n in tr.names:
                shp = shapes[n]
                if len(shp) < 2:
                    per.append((n, 0, numels[n], shp))
                    continue
                cols = numels[n] // shp[0]
                r = max(1, round(elems / cols))
                for r0 in range(0, shp[0], r):
                    rows = min(r, shp[0] - r0)
                    per.append((n, r0 * cols, rows * cols, (rows, *shp[1:])))
            replicas = math.ceil(n_tensors / len(per))
        whole = n_tensors is None
        digits = len(str(max(0, replicas - 1)))  # zero-padded: name order is replica order
        self.pieces = [Piece(f"r{k:0{digits}d}.{n}" if whole else f"r{k:0{digits}d}.{n}.p{start}", k, n, start,
                             numel, shape) for k in range(replicas) for n, start, numel, shape in per]
        if n_tensors is not None:
            self.pieces = self.pieces[:n_tensors]
        # Replica k starts just before cycle step k (mod the cycle), from the real trace state there.
        by_start = defaultdict(list)
        for p in self.pieces:
            by_start[self.cycle[p.replica % len(self.cycle)] - 1].append(p)
        used = {p.src for p in self.pieces}
        orders = sorted({p.replica % ROW_ORDERS for p in self.pieces})
        # row order v of each 2-D tensor: the replica's row r holds recorded row perm[r]; where[v][n] maps a
        # recorded flat position to the replica's (None: the recorded order)
        g = torch.Generator().manual_seed(1234)
        where: dict[int, dict[str, torch.Tensor | None]] = {v: {} for v in orders}
        perm: dict[int, dict[str, torch.Tensor | None]] = {v: {} for v in orders}
        for n in sorted(used):
            rows = shapes[n][0] if len(shapes[n]) >= 2 else 1
            for v in range(ROW_ORDERS):
                p = torch.randperm(rows, generator=g) if rows > 1 and v else None
                if v in where:
                    perm[v][n] = p
                    if p is None:
                        where[v][n] = None
                    else:
                        cols = numels[n] // rows
                        inv = torch.empty_like(p)
                        inv[p] = torch.arange(rows)
                        where[v][n] = (inv.view(-1, 1) * cols + torch.arange(cols).view(1, -1)).reshape(-1)
        # row order -> trace step -> {tensor: (positions, positions as numpy, ulp step as int32)}, positions sorted
        self.delta: dict[int, dict[int, dict[str, tuple]]] = {v: {} for v in orders}
        flat = {n: tr.base[n].view(torch.int16).reshape(-1).clone() for n in used}
        made = {}
        for j in range(0, tr.steps + 1):
            if j:  # walk the trace forward once: state j-1 -> j
                for n, (idx, bits) in tr.changes(j).items():
                    if n in used:
                        if j in self.cycle:
                            step = bits.to(torch.int32) - flat[n][idx].to(torch.int32)
                            for v in orders:
                                w = where[v][n]
                                if w is None:
                                    self.delta[v].setdefault(j, {})[n] = (idx, idx.numpy(), step)
                                else:
                                    at, order = torch.sort(w[idx])
                                    self.delta[v].setdefault(j, {})[n] = (at, at.numpy(), step[order])
                        flat[n][idx] = bits
            for p in by_start.get(j, ()):
                rp = perm[p.replica % ROW_ORDERS][p.src]
                src_flat = flat[p.src] if rp is None else flat[p.src].view(shapes[p.src][0], -1)[rp].reshape(-1)
                made[p.name] = src_flat[p.start:p.start + p.numel].clone().view(torch.bfloat16).reshape(p.shape)
        for v in orders:
            for j in self.cycle:
                self.delta[v].setdefault(j, {})
        self.state = {p.name: made[p.name] for p in self.pieces}
        del made, flat, tr
        self.flat = {n: t.view(torch.int16).reshape(-1) for n, t in self.state.items()}
        groups: dict[tuple[int, str], list[Piece]] = defaultdict(list)
        for p in self.pieces:
            groups[p.replica, p.src].append(p)
        self.groups = {key: (ps, np.array([p.start for p in ps] + [ps[-1].start + ps[-1].numel]))
                       for key, ps in groups.items()}
        self.t = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    @property
    def largest(self) -> int:
        return max(t.numel() * t.element_size() for t in self.state.values())

    def advance(self, keep: bool = True) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        self.t += 1
        out = []
        for (k, src), (ps, cuts) in self.groups.items():
            d = self.delta[k % ROW_ORDERS][self.cycle[(k + self.t - 1) % len(self.cycle)]].get(src)
            if d is None:
                continue
            idx, idx_np, step = d
            if len(ps) == 1 and ps[0].numel == self.src_numel[src]:
                segs = [(ps[0], idx, step)]
            else:
                at = np.searchsorted(idx_np, cuts)
                segs = [(p, idx[a:b] - p.start, step[a:b]) for p, a, b in zip(ps, at[:-1], at[1:]) if b > a]
            for p, pos, st in segs:
                flat = self.flat[p.name]
                old = flat[pos]
                new = (old.to(torch.int32) + st).clamp_(-32768, 32767).to(torch.int16)
                # a clamped step, or one replayed onto a value that makes it an Inf or NaN (a step recorded
                # across zero): keep only the elements that really change to finite values
                moved = (new != old) & ((new & 0x7F80) != 0x7F80)
                if not bool(moved.all()):
                    pos, new, old = pos[moved], new[moved], old[moved]
                flat[pos] = new
                if keep:
                    out.append((p.name, pos, new, old))
        return out

    def bound_bytes(self, changes) -> float:
        """The independent-position bound of one step's changes (``bench/reference_encoders.py``)."""
        shapes = {p.name: p.shape for p in self.pieces}
        return ref.independent_bound({n: (pos.numpy(), new.numpy(), old.numpy(), shapes[n], torch.bfloat16)
                                      for n, pos, new, old in changes})


def build(cfg: dict, run: str, layout: str) -> Source:
    if layout == "many":
        return Source(run, n_tensors=cfg["tensors"], tensors_mb=cfg["tensors_mb"])
    return Source(run, size_gb=cfg["size"])


# -- measuring -----------------------------------------------------------------------------------
def timed(fn):
    """``(result, wall s, process CPU s)`` of ``fn()``."""
    w, c = time.perf_counter(), time.process_time()
    r = fn()
    return r, time.perf_counter() - w, time.process_time() - c


def timed_into(row: dict, prefix: str, fn):
    """``fn()``, noting in ``row`` its wall s and process CPU s (``{prefix}wall``, ``{prefix}cpu``), and that CPU
    split into user and kernel time (``{prefix}user``, ``{prefix}sys``, from ``getrusage``: tick-grained).

    The kernel part is mostly first touches of fresh memory (page faults), which on a VM cost what the host
    makes them cost that day: reported apart, so a slow day shows as such."""
    w, c, u0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    r = fn()
    row[f"{prefix}wall"] = time.perf_counter() - w
    row[f"{prefix}cpu"] = time.process_time() - c
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    row[f"{prefix}user"], row[f"{prefix}sys"] = u1.ru_utime - u0.ru_utime, u1.ru_stime - u0.ru_stime
    return r


def compare(prev: dict, cur: dict) -> None:
    """The reference: a bare bit-compare of every tensor, ``torch.ne(old, new).nonzero()`` on int16 views."""
    for k, t in cur.items():
        torch.ne(prev[k].view(torch.int16).reshape(-1), t.view(torch.int16).reshape(-1)).nonzero()


def dense_copy(dst: dict, cur: dict) -> None:
    """The reference: a dense ``copy_`` of every tensor."""
    for k, t in cur.items():
        dst[k].copy_(t)


def bits_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)




def stat(xs: list[float]) -> dict:
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


# -- cases (each runs in its own child process) -------------------------------------------------
def case_publish(cfg, run, layout, store, *, mode="sync", codec="auto", with_ref=True, anchors=1,
                 save_ref=None, bound=True):
    """Anchor(s) at step 0, then ``warmup + repeat`` delta steps, each next to the bare compare."""
    src = build(cfg, run, layout)
    cur = src.state
    prev = {k: v.clone() for k, v in cur.items()} if with_ref else None
    bg = mode == "background"
    out = {"model_bytes": src.nbytes, "tensors": len(cur), "largest": src.largest, "anchor": [], "save": [],
           "steps": [], "load": [os.getloadavg()[0]]}
    pub = None
    for i in range(anchors):
        if save_ref:
            _, w, c = timed(lambda: save_file(cur, save_ref))
            out["save"].append((w, c))
        d = store if i == anchors - 1 else f"{store}.a{i}"
        pub = ds.Publisher(d, codec=codec, background=bg)
        info, w, c = timed(lambda: pub.publish(cur, step=0).result() if bg else pub.publish(cur, step=0))
        assert info.kind == "anchor", info
        out["anchor"].append((w, c, info.nbytes))
        if i < anchors - 1:
            pub.close()
            shutil.rmtree(d)
    for t in range(1, 1 + cfg["warmup"] + cfg["repeat"]):
        changes = src.advance()
        row = {"changed": sum(int(c[1].numel()) for c in changes)}
        if with_ref:
            timed_into(row, "ref_", lambda: compare(prev, cur))
        res = timed_into(row, "", lambda: pub.publish(cur, step=t))
        if bg:  # the writer's time (encode, upload, commit), off the training loop
            res, row["writer_wall"], row["writer_cpu"] = timed(lambda: (pub.flush(), res.result())[1])
        row.update(kind=res.kind, differential=res.differential, nbytes=res.nbytes, fraction=res.fraction)
        assert res.changed == row["changed"], (res.changed, row["changed"])
        if bound:
            row["bound"] = src.bound_bytes(changes)
        if with_ref:
            for name, pos, new, _old in changes:
                prev[name].view(torch.int16).reshape(-1)[pos] = new
        del changes
        out["steps"].append(row)
    pub.close()
    out["load"].append(os.getloadavg()[0])
    return out


def case_pull(cfg, run, layout, store, *, anchors=1, load_ref=None, check=True, paths=True):
    """A follower: anchor pull(s) of step 0 into a dict target, then one delta pull per step, next to a dense copy."""
    src = build(cfg, run, layout)
    cur = src.state
    sub = ds.Subscriber(store)
    target = {k: torch.empty_like(v).zero_() for k, v in cur.items()}
    scratch = {k: torch.empty_like(v).zero_() for k, v in cur.items()}
    out = {"model_bytes": src.nbytes, "tensors": len(cur), "anchor": [], "load_file": [], "steps": [],
           "load": [os.getloadavg()[0]]}
    tgt = target
    for _ in range(anchors):
        if load_ref:
            _, w, c = timed(lambda: len(load_file(load_ref)))
            out["load_file"].append((w, c))
        tgt = dict(target)  # a new identity holds no known version: the pull takes the anchor path
        res, w, c = timed(lambda: sub.pull(tgt, step=0))
        assert res.path == "anchor", res.path
        out["anchor"].append((w, c, res.bytes_fetched))
    target = tgt
    if check:
        assert bits_equal(target, cur), "anchor pull is not bit-exact"
    steps = sub.versions()
    last = _lagging_step(store, steps) if paths else None
    for t in steps[1:]:
        src.advance(keep=False)
        row = {}
        timed_into(row, "ref_", lambda: dense_copy(scratch, cur))
        res = timed_into(row, "", lambda: sub.pull(target, step=t))
        assert res.path == "delta" and res.versions_applied == [t], (res.path, res.versions_applied)
        row["bytes_fetched"] = res.bytes_fetched
        row["manifest_bytes"] = os.path.getsize(os.path.join(store, "versions", f"{t:012d}.json"))
        if check:
            assert bits_equal(target, cur), f"pull of step {t} is not bit-exact"
        out["steps"].append(row)
    if last is not None:  # after the measured steps: the lagging follower's model is not in their memory
        _multi_step(cfg, run, layout, store, last, out, check)
    sub.close()
    out["load"].append(os.getloadavg()[0])
    return out


def _lagging_step(store, steps):
    """The latest step that a follower at step 0 and a fresh follower both reach through every delta before it
    (a differential would skip them), or None."""
    sub = ds.Subscriber(store)
    held = sub.store.ref(steps[0])
    for t in reversed(steps[2:]):
        want = steps[1:steps.index(t) + 1]
        lag, fresh = sub.plan(t, held), sub.plan(t)
        if (lag.anchor is None and lag.differential is None and lag.deltas == want
                and fresh.differential is None and fresh.deltas == want):
            return t
    return None


def _multi_step(cfg, run, layout, store, last, out, check):
    """Multi-step paths to step ``last``, from the same store: a lagging follower (left at step 0) pulls every
    delta up to it at once; a fresh follower catches up from the anchor through them into a new dict. Their
    result is checked against the replicated model stepped to ``last`` anew."""
    expected = build(cfg, run, layout)
    for _ in range(last):
        expected.advance(keep=False)
    expected = expected.state
    sub_behind = ds.Subscriber(store)
    behind = sub_behind.pull(step=0).state  # a new dict at step 0, tracked: the next pull is a delta path
    res, w, c = timed(lambda: sub_behind.pull(behind, step=last, allow_anchor=False))
    assert res.path == "delta" and len(res.versions_applied) == last, (res.path, res.versions_applied)
    out["lagging"] = {"wall": w, "cpu": c, "deltas": last, "to": last}
    if check:
        assert bits_equal(behind, expected), "lagging pull is not bit-exact"
    del behind
    sub_behind.close()
    fresh = ds.Subscriber(store)
    res, w, c = timed(lambda: fresh.pull(step=last))
    assert res.path == "anchor" and len(res.versions_applied) == last + 1, (res.path, res.versions_applied)
    out["catch_up"] = {"wall": w, "cpu": c, "deltas": last, "to": last}
    if check:
        assert bits_equal(res.state, expected), "catch-up pull is not bit-exact"
    del res
    fresh.close()


def case_rss_publisher(cfg, run, store, *, mode="sync", policy=None):
    """Publisher memory beyond the model: peak during the first (anchor) publish, steady after each delta.

    Also notes the drift tracker's bytes after each delta (what of the steady figure grows along a chain).
    ``policy``: an anchor every ``policy`` versions instead of the default adaptive policy (informational
    cases only: ``every(n)`` tracks no drift).
    """
    src = build(cfg, run, "model")
    cur = src.state
    bg = mode == "background"
    base, base_anon = baseline(), baseline(anonymous=True)
    rss = Rss()
    rss.reset()
    pub = ds.Publisher(store, background=bg, **({"anchor_every": policy} if policy is not None else {}))
    r = pub.publish(cur, step=0)
    if bg:
        r.result()
        pub.flush()
    out = {"model_bytes": src.nbytes, "anchor_peak": rss.peak() - base, "after_anchor": Rss.now() - base,
           "steady": [], "peak": [], "drift": [], "hwm": rss.hwm}
    for t in range(1, 1 + cfg["warmup"] + cfg["repeat"]):
        src.advance(keep=False)
        rss.reset()
        pub.publish(cur, step=t)
        if bg:
            pub.flush()
        out["peak"].append(rss.peak() - base)
        out["steady"].append(Rss.now() - base)
        out.setdefault("steady_anon", []).append(Rss.anonymous() - base_anon)
        out["drift"].append(pub.head.drift.nbytes)  # the tracker's own count of what it holds
    out["steady_trimmed"] = baseline() - base  # what stays once freed memory goes back to the OS
    pub.close()
    return out


def case_runtime(cfg):
    """Resident memory a fresh process gains from its first publish and first pull of a tiny model (compiled
    kernels, thread pools, lazily imported modules): a fixed cost, part of every steady figure above."""
    base = baseline()
    with tempfile.TemporaryDirectory(prefix="deltastore-runtime-") as d:
        state = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "b": torch.zeros(64, dtype=torch.bfloat16)}
        with ds.Publisher(d) as pub:
            pub.publish(state, step=0)
            state["w"].view(torch.int16)[::7] += 1
            pub.publish(state, step=1)
        published = baseline()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        sub = ds.Subscriber(d)
        sub.pull(target, step=0)
        sub.pull(target, step=1)
        sub.close()
    return {"publish": published - base, "pull": baseline() - published, "import": _import_cost()}


_IMPORT_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from _rss import baseline
import torch
before = baseline()
import deltastore
print(baseline() - before)
"""


def _import_cost():
    """What ``import deltastore`` adds to a process that has imported torch: paid before any figure's baseline
    is taken, so part of none of them."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def case_fresh_memory(cfg):
    """The first-write cost of fresh pages on this machine (:func:`_fresh_memory.fault_cost`), informational
    (--quick: a little memory, a short idle)."""
    return fault_cost(16 << 20, 0.5) if cfg["quick"] else fault_cost()


def case_rss_subscriber(cfg, store):
    """Subscriber memory beyond the target: peak during an anchor pull, steady after each delta pull."""
    sub = ds.Subscriber(store)
    m = sub.manifest(0)
    target = {t.name: torch.empty(t.shape, dtype=DTYPES[t.dtype]).zero_() for t in m.tensors}
    nbytes = sum(v.numel() * v.element_size() for v in target.values())
    largest = max(v.numel() * v.element_size() for v in target.values())
    del m
    base, base_anon = baseline(), baseline(anonymous=True)
    rss = Rss()
    rss.reset()
    assert sub.pull(target, step=0).path == "anchor"
    out = {"target_bytes": nbytes, "largest": largest, "anchor_peak": rss.peak() - base,
           "after_anchor": Rss.now() - base, "steady": [], "peak": [], "hwm": rss.hwm}
    for t in sub.versions()[1:]:
        rss.reset()
        assert sub.pull(target, step=t).path == "delta"
        out["peak"].append(rss.peak() - base)
        out["steady"].append(Rss.now() - base)
        out.setdefault("steady_anon", []).append(Rss.anonymous() - base_anon)
    out["steady_trimmed"] = baseline() - base
    sub.close()
    return out


def case_dense(cfg, run):
    """The anchor codec (``dense``, the Publisher's default) alone: encode/decode throughput and size."""
    src = build(cfg, run, "model")
    codec = get_codec(DEFAULT_ANCHOR_CODEC)
    ups = [Update(TensorSpec(n, torch.bfloat16, tuple(t.shape)), t.view(torch.int16).reshape(-1))
           for n, t in src.state.items()]
    groups, size = [[]], 0
    for u in ups:  # objects as the Publisher cuts them (at most max_object_bytes each)
        if groups[-1] and size + 2 * u.count > DEFAULT_MAX_OBJECT_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += 2 * u.count
    out = {"model_bytes": src.nbytes, "encode": [], "decode": []}
    data = None
    for _ in range(cfg["repeat"]):
        data = None
        data, w, c = timed(lambda: [codec.encode(g) for g in groups])
        out["encode"].append((w, c))
    out["encoded_bytes"] = sum(len(d) for d in data)
    for _ in range(cfg["repeat"]):
        dec = None
        dec, w, c = timed(lambda: [codec.decode(d, [u.spec for u in g]) for d, g in zip(data, groups)])
        out["decode"].append((w, c))
    for g, got in zip(groups, dec):
        for u in g:
            assert torch.equal(got[u.spec.name].bits, u.bits), u.spec.name
    return out


def _child(conn, fn, args, kwargs, threads):
    try:
        torch.set_num_threads(threads)
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class Runner:
    """Runs each case in a child forked from this (tensor-free) process, or with ``fresh=True`` in a new
    interpreter (the memory cases: a forked child counts as its own every page of library code it touches
    that this process already had resident, a new process only what it maps or touches beyond its
    imports); collects results and errors."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.ctx = mp.get_context("fork")
        self.fresh_ctx = mp.get_context("spawn")
        self.errors: list[str] = []
        self.t0 = time.perf_counter()
        self.loads: list[float] = [os.getloadavg()[0]]

    def __call__(self, label, fn, *args, fresh=False, **kwargs):
        t = time.perf_counter()
        ctx = self.fresh_ctx if fresh else self.ctx
        here, there = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(there, fn, (self.cfg, *args), kwargs, self.cfg["threads"]))
        p.start()
        there.close()
        try:
            status, value = here.recv()
        except EOFError:
            status, value = "error", "child died without a result (killed: out of memory?)"
        p.join()
        self.loads.append(os.getloadavg()[0])
        if status == "ok" and p.exitcode not in (0, None):
            status, value = "error", f"exit code {p.exitcode}"
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {label}: {status} ({time.perf_counter() - t:.1f} s)",
              flush=True)
        if status != "ok":
            self.errors.append(f"{label}: {value}")
            print(value, file=sys.stderr, flush=True)
            return None
        return value


# -- figures -----------------------------------------------------------------------------------------
short = _trace.short


class Figures:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def add(self, key, label, value, target, op, *, measured="", reference="", cpu=None, spread=None, **extra):
        met = None if target is None else (value <= target if op == "<=" else value >= target)
        self.rows[key] = {"label": label, "value": float(value), "target": target, "op": op, "met": met,
                          "measured": measured, "reference": reference, "cpu": cpu, "spread": spread, **extra}

    def ratio(self, key, label, steps, target, *, wall="wall", cpu="cpu", ref_wall="ref_wall", ref_cpu="ref_cpu",
              unit="ms", **extra):
        mw, rw = stat([s[wall] for s in steps]), stat([s[ref_wall] for s in steps])
        mc, rc = stat([s[cpu] for s in steps]), stat([s[ref_cpu] for s in steps])
        per = [s[wall] / s[ref_wall] for s in steps]
        scale = 1e3 if unit == "ms" else 1.0
        if all("sys" in s and "ref_sys" in s for s in steps):  # what of the CPU was the kernel's (page faults)
            extra["sys_ms"] = 1e3 * statistics.median(s["sys"] for s in steps)
            extra["ref_sys_ms"] = 1e3 * statistics.median(s["ref_sys"] for s in steps)
            extra["user_ratio"] = (statistics.median(s["user"] for s in steps)
                                   / max(statistics.median(s["ref_user"] for s in steps), 1e-6))
        self.add(key, label, mw["median"] / rw["median"], target, "<=", cpu=mc["median"] / rc["median"],
                 spread=[min(per), max(per)],
                 measured=f"{scale * mw['median']:.1f} {unit} (cpu {scale * mc['median']:.1f})",
                 reference=f"{scale * rw['median']:.1f} {unit} (cpu {scale * rc['median']:.1f})",
                 wall_s=mw, ref_wall_s=rw, cpu_s=mc, ref_cpu_s=rc, **extra)


def pairs(xs, i):
    return [x[i] for x in xs]


def analyse(cfg, res) -> tuple[Figures, dict]:
    f = Figures()
    extra: dict = {"throughput": {}, "projection": {}, "anchors": {}, "densities": {}}
    for run in cfg["runs"]:
        r = short(run)
        pub, pull = res.get(("publish", run)), res.get(("pull", run))
        if pub:
            steps = pub["steps"][cfg["warmup"]:]
            dens = statistics.median(s["fraction"] for s in steps)
            extra["densities"][r] = dens
            kinds = f"{sum(s['differential'] for s in steps)} with a differential, " \
                    f"{sum(s['kind'] == 'anchor' for s in steps)} anchors"
            f.ratio(f"publish_sync.{r}", f"publish() delta, sync, {pub['model_bytes'] / GB:.2f} GB, {r} "
                    f"{100 * dens:.2f} %", steps, 2.0, note=kinds)
            a = pub["anchor"][0]
            extra["anchors"][f"publish.{r}"] = {"wall": a[0], "cpu": a[1], "bytes": a[2],
                                               "save_file_wall": pub["save"][0][0] if pub["save"] else None}
        if pull:
            steps = pull["steps"][cfg["warmup"]:]
            dens = extra["densities"].get(r, 0.0)
            target = 0.3 if dens < 0.01 else 1.0
            f.ratio(f"pull.{r}", f"follower pull() of one delta, dict target, {r}", steps, target)
            extra.setdefault("paths", {})[r] = _paths(pull)
            a = pull["anchor"][0]
            extra["anchors"][f"pull.{r}"] = {"wall": a[0], "cpu": a[1], "bytes": a[2],
                                            "load_file_wall": pull["load_file"][0][0] if pull["load_file"] else None}
            if pub:
                got = sum(s["bytes_fetched"] for s in steps)
                man = sum(s["manifest_bytes"] for s in steps)
                bound = sum(s["bound"] for s in pub["steps"][cfg["warmup"]:])
                changed = sum(s["changed"] for s in pub["steps"][cfg["warmup"]:])
                per = [p["bytes_fetched"] / q["bound"] for p, q in zip(steps, pub["steps"][cfg["warmup"]:])]
                f.add(f"download_vs_bound.{r}", f"follower download per step / independent-position bound, {r}",
                      got / bound, 0.75, "<=", spread=[min(per), max(per)],
                      measured=f"{got / changed:.3f} B/changed el ({got / len(steps) / MB:.2f} MB/step)",
                      reference=f"{bound / changed:.3f} B/changed el",
                      with_manifest=(got + man) / bound, manifest_bytes_per_step=man / len(steps))
        bg = res.get(("background", run))
        if bg:
            steps = bg["steps"][cfg["warmup"]:]
            f.ratio(f"publish_background.{r}", f"publish() blocking, background=True, {r}", steps, 1.1,
                    writer_wall_s=stat([s["writer_wall"] for s in steps]))
        for mode, target in (("sync", 1.05), ("background", 1.15)):
            m = res.get(("rss_pub", mode, run))
            if not m:
                continue
            mb = m["model_bytes"]
            steady = max(m["steady"][cfg["warmup"]:])
            f.add(f"publisher_rss_{mode}.{r}", f"publisher extra RSS, steady, {mode}, {r} (x model)", steady / mb,
                  target, "<=", measured=f"{steady / MB:.0f} MB (max after a delta)", reference=f"{mb / MB:.0f} MB",
                  peak_during_delta=max(m["peak"][cfg["warmup"]:]) / mb, after_anchor=m["after_anchor"] / mb,
                  anonymous=max(m.get("steady_anon", [0])[cfg["warmup"]:] or [0]) / mb,
                  trimmed=m["steady_trimmed"] / mb, drift_tracker=max(m.get("drift", [0])[cfg["warmup"]:] or [0]) / mb)
            if mode == "sync":
                f.add(f"publisher_rss_anchor_peak.{r}", f"publisher extra RSS, peak during an anchor, {r} (x model)",
                      m["anchor_peak"] / mb, 1.3, "<=", measured=f"{m['anchor_peak'] / MB:.0f} MB",
                      reference=f"{mb / MB:.0f} MB")
            else:
                extra.setdefault("rss", {})[f"publisher_background_anchor_peak.{r}"] = m["anchor_peak"] / mb
        m = res.get(("rss_pub", "every", run))
        if m:
            mb = m["model_bytes"]
            extra.setdefault("rss", {})[f"publisher_sync_every10.{r}"] = {
                "steady": max(m["steady"][cfg["warmup"]:]) / mb, "trimmed": m["steady_trimmed"] / mb}
        s = res.get(("rss_sub", run))
        if s:
            tb, big = s["target_bytes"], s["largest"]
            steady = max(s["steady"][cfg["warmup"]:])
            f.add(f"subscriber_rss_steady.{r}", f"subscriber extra RSS, steady, {r} (x target)", steady / tb, 0.05,
                  "<=", measured=f"{steady / MB:.1f} MB (max after a delta)", reference=f"{tb / MB:.0f} MB",
                  peak_during_delta=max(s["peak"][cfg["warmup"]:]) / tb, trimmed=s["steady_trimmed"] / tb,
                  anonymous=max(s.get("steady_anon", [0])[cfg["warmup"]:] or [0]) / tb)
            f.add(f"subscriber_rss_anchor_peak.{r}",
                  f"subscriber extra RSS, anchor pull, {r} ((peak - largest tensor) x target)",
                  max(s["anchor_peak"] - big, 0) / tb, 0.3, "<=",
                  measured=f"{s['anchor_peak'] / MB:.0f} MB peak", reference=f"{tb / MB:.0f} MB, largest "
                  f"{big / MB:.1f} MB", peak_x_target=s["anchor_peak"] / tb)
    for k in ("runtime", "fresh_memory"):
        if res.get(k):
            extra[k] = res[k]
    mp_, ml = res.get(("publish", "many")), res.get(("pull", "many"))
    if mp_:
        steps = mp_["steps"][cfg["warmup"]:]
        f.ratio("many_delta_publish", f"{mp_['tensors']} tensors, {mp_['model_bytes'] / MB:.0f} MB: delta publish "
                f"vs compare", steps, 3.0)
        rows = [{"wall": a[0], "cpu": a[1], "ref_wall": s[0], "ref_cpu": s[1]} for a, s in
                zip(mp_["anchor"], mp_["save"])]
        f.ratio("many_anchor_publish", "same layout: anchor publish vs safetensors save_file", rows, 1.5)
    if ml:
        f.ratio("many_delta_pull", "same layout: delta pull vs dense copy", ml["steps"][cfg["warmup"]:], 2.0)
        rows = [{"wall": a[0], "cpu": a[1], "ref_wall": s[0], "ref_cpu": s[1]} for a, s in
                zip(ml["anchor"], ml["load_file"])]
        # the first anchor lands in a zeroed target (its undo journal notes "zeros"), the later ones in a live
        # target whose old bits the journal saves first (all-or-nothing): both kinds are in the median
        split = {"fresh_target": rows[0]["wall"] / rows[0]["ref_wall"]} if rows else {}
        if len(rows) > 1:
            split["live_target"] = statistics.median(r["wall"] / r["ref_wall"] for r in rows[1:])
        f.ratio("many_anchor_pull", "same layout: anchor pull vs safetensors load_file", rows, 1.5, **split)
        extra.setdefault("paths", {})[f"{ml['tensors']} tensors"] = _paths(ml)
    d = res.get("dense")
    if d:
        mbytes = d["model_bytes"]
        enc, dec = stat(pairs(d["encode"], 0)), stat(pairs(d["decode"], 0))
        encc, decc = stat(pairs(d["encode"], 1)), stat(pairs(d["decode"], 1))
        f.add("dense_encode_gbps", "anchor encode (dense), GB/s of model", mbytes / GB / enc["median"], 1.0, ">=",
              measured=f"{enc['median']:.2f} s for {mbytes / GB:.2f} GB", cpu=mbytes / GB / encc["median"],
              spread=[mbytes / GB / enc["max"], mbytes / GB / enc["min"]])
        f.add("dense_decode_gbps", "anchor decode (dense), GB/s of model", mbytes / GB / dec["median"], 2.0, ">=",
              measured=f"{dec['median']:.2f} s", cpu=mbytes / GB / decc["median"],
              spread=[mbytes / GB / dec["max"], mbytes / GB / dec["min"]])
        f.add("dense_size_pct", "anchor size (dense), % of raw bf16", 100 * d["encoded_bytes"] / mbytes, 68.0, "<=",
              measured=f"{d['encoded_bytes'] / MB:.0f} MB", reference=f"{mbytes / MB:.0f} MB")
    # model MB/s per core (model bytes / process CPU seconds), per codec, publish and pull
    for run in cfg["runs"]:
        r = short(run)
        for codec in cfg["codecs"]:
            key = ("publish", run) if codec == "auto" else ("codec_publish", codec, run)
            pk = ("pull", run) if codec == "auto" else ("codec_pull", codec, run)
            p, q = res.get(key), res.get(pk)
            row = {}
            if p:
                st = p["steps"][cfg["warmup"]:]
                cpu, wall = statistics.median(s["cpu"] for s in st), statistics.median(s["wall"] for s in st)
                row.update(publish_mbps_core=p["model_bytes"] / MB / cpu, publish_mbps=p["model_bytes"] / MB / wall,
                           bytes_per_changed=sum(s["nbytes"] for s in st) / sum(s["changed"] for s in st))
            if q:
                st = q["steps"][cfg["warmup"]:]
                cpu, wall = statistics.median(s["cpu"] for s in st), statistics.median(s["wall"] for s in st)
                row.update(pull_mbps_core=q["model_bytes"] / MB / cpu, pull_mbps=q["model_bytes"] / MB / wall)
                if p:  # what the follower downloads (objects), per changed element of the same steps
                    row["download_per_changed"] = (sum(s["bytes_fetched"] for s in st)
                                                   / sum(s["changed"] for s in p["steps"][cfg["warmup"]:]))
            if row:
                extra["throughput"][f"{codec}.{r}"] = row
    extra["projection"] = projection(cfg, res)
    return f, extra


def _paths(pull: dict) -> dict:
    """The multi-step pulls of one ``case_pull`` against the single steps they replace (same child, same store)."""
    lag, up = pull.get("lagging"), pull.get("catch_up")
    if not lag:
        return {}
    one = sum(s["wall"] for s in pull["steps"][:lag["to"]])  # each of those deltas pulled on its own
    anchor = pull["anchor"][-1][0]
    out = {}
    if lag:
        out["lagging"] = {**lag, "vs_single_steps": lag["wall"] / one}
    if up:
        out["catch_up"] = {**up, "vs_single_steps": up["wall"] / (anchor + one)}
    return out


def projection(cfg, res) -> dict:
    """CPU seconds per step = a x elements + b x tensors, fitted from the 1 GB and 16k-tensor layouts (same run)."""
    out = {}
    many_run = res.get("many_run")
    for what, key, mkey in (("publish", "publish", ("publish", "many")), ("pull", "pull", ("pull", "many")),
                            ("compare", "publish", ("publish", "many")), ("dense copy", "pull", ("pull", "many"))):
        cpu_key = "ref_cpu" if what in ("compare", "dense copy") else "cpu"
        m = res.get(mkey)
        b = 0.0
        if m and res.get((key, many_run)):
            big = res[(key, many_run)]
            c1 = statistics.median(s[cpu_key] for s in big["steps"][cfg["warmup"]:])
            c2 = statistics.median(s[cpu_key] for s in m["steps"][cfg["warmup"]:])
            n1, t1, n2, t2 = big["model_bytes"] / 2, big["tensors"], m["model_bytes"] / 2, m["tensors"]
            det = n1 * t2 - n2 * t1
            if det:
                b = max(0.0, (n1 * c2 - n2 * c1) / det)
        for run in cfg["runs"]:
            big = res.get((key, run))
            if not big:
                continue
            c1 = statistics.median(s[cpu_key] for s in big["steps"][cfg["warmup"]:])
            n1, t1 = big["model_bytes"] / 2, big["tensors"]
            a = max(0.0, (c1 - b * t1) / n1)
            for model, (n, tensors) in PROJECT.items():
                cpu = a * n + b * tensors
                out[f"{what}.{short(run)}.{model}"] = {"cpu_s": cpu, "wall_s_16_cores": cpu / PROJECT_CORES,
                                                       "ns_per_element": a * 1e9, "us_per_tensor": b * 1e6}
    return out


def report(cfg, figs: Figures, extra: dict, loads: list[float]) -> None:
    print(f"\n## Targets (issue 11), {cfg['threads']} torch threads, os.cpu_count() {os.cpu_count()}, "
          f"1-min load average between cases {min(loads):.1f}-{max(loads):.1f}\n")
    print("| figure | measured | reference | value (wall) [per-step spread] | cpu | target | |")
    print("|---|---|---|---:|---:|---:|---|")
    for key, r in figs.rows.items():
        spread = f" [{r['spread'][0]:.2f}–{r['spread'][1]:.2f}]" if r.get("spread") else ""
        cpu = f"{r['cpu']:.2f}" if r.get("cpu") is not None else ""
        verdict = "met" if r["met"] else "**missed**"
        print(f"| {r['label']} | {r['measured']} | {r['reference']} | {r['value']:.3f}{spread} | {cpu} | "
              f"{r['op']} {r['target']} | {verdict} |")
    notes = [(k, r) for k, r in figs.rows.items() if r.get("note") or r.get("with_manifest")]
    for k, r in notes:
        if r.get("note"):
            print(f"- {k}: measured steps: {r['note']}")
        if r.get("with_manifest"):
            print(f"- {k}: with the manifest ({r['manifest_bytes_per_step'] / 1e3:.0f} kB/step) "
                  f"{r['with_manifest']:.3f}x the bound")
    for k, r in figs.rows.items():
        if "sys_ms" in r:
            print(f"- {k}: of the CPU per step, {r['sys_ms']:.0f} ms in the kernel (reference "
                  f"{r['ref_sys_ms']:.0f} ms); user CPU alone {r['user_ratio']:.2f}x the reference's")
        if "live_target" in r:
            print(f"- {k}: into a zeroed target {r['fresh_target']:.2f}x, into a live target (its old bits saved "
                  f"to the undo journal first) {r['live_target']:.2f}x")
        if k.startswith("publish_background"):
            print(f"- {k}: the background writer then takes {r['writer_wall_s']['median']:.2f} s per step")
        if "peak_during_delta" in r:
            tracker = f"; of it the drift tracker {r['drift_tracker']:.3f}x" if r.get("drift_tracker") else ""
            anon = f"; of the steady figure, anonymous memory {r['anonymous']:.3f}x (the rest: file-backed " \
                "pages, the code of libraries mapped on first use)" if "anonymous" in r else ""
            print(f"- {k}: peak during a delta {r['peak_during_delta']:.3f}x; steady after malloc_trim "
                  f"{r['trimmed']:.3f}x{tracker}{anon}")
    for k, v in extra.get("rss", {}).items():
        if isinstance(v, dict):
            print(f"- {k} (anchor_policy=every(10), no drift tracking): steady {v['steady']:.3f}x; after malloc_trim "
                  f"{v['trimmed']:.3f}x")
    rt = extra.get("runtime")
    if rt:
        print(f"- fixed runtime memory of a fresh process (a tiny model's first publish / first pull): "
              f"{rt['publish'] / MB:.0f} MB / {rt['pull'] / MB:.0f} MB, part of every steady figure above; "
              f"before them, `import deltastore` itself: {rt['import'] / MB:.0f} MB "
              "(in no figure's baseline-relative count)")
    fm = extra.get("fresh_memory")
    if fm:
        reporting = {True: "on", False: "off", None: "no balloon device"}[fm["reports_free_pages"]]
        print(f"- what fresh memory costs on this machine (first write to {fm['mib']} MiB, s/GiB wall, cold after "
              f"{fm['idle_s']:.0f} s idle / warm): 4 KiB pages {fm['small']['cold_s_per_gib']:.2f} / "
              f"{fm['small']['warm_s_per_gib']:.2f}, huge pages {fm['huge']['cold_s_per_gib']:.2f} / "
              f"{fm['huge']['warm_s_per_gib']:.2f}; free page reporting to the hypervisor: {reporting}. Read the "
              f"kernel-time lines above against it (numpy advises huge pages for arrays of 4 MiB and more)")
    if extra["anchors"]:
        print("\nAnchors of the big layout (one each, informational): "
              + "; ".join(f"{k} {v['wall']:.2f} s" + (f" (save_file {v['save_file_wall']:.2f} s)"
                                                      if v.get("save_file_wall") else "")
                          + (f" (load_file {v['load_file_wall']:.2f} s)" if v.get("load_file_wall") else "")
                          for k, v in extra["anchors"].items()))
    if extra.get("paths"):
        print("\nMulti-step pulls (informational), each against the single-step pulls it replaces (anchor pull "
              "+ each delta on its own, timed above): "
              + "; ".join(f"{k}: lagging follower, {v['lagging']['deltas']} deltas at once "
                          f"{v['lagging']['wall']:.2f} s ({v['lagging']['vs_single_steps']:.2f}x), fresh follower "
                          f"catching up from the anchor through them {v['catch_up']['wall']:.2f} s "
                          f"({v['catch_up']['vs_single_steps']:.2f}x)"
                          for k, v in extra["paths"].items() if v))
    if extra["throughput"]:
        print("\n## Model MB/s per core (model bytes / process CPU s of one call; wall MB/s in brackets)\n")
        print("| codec | run | publish MB/s/core | pull MB/s/core | stored B/changed el (objects + manifest, "
              "differentials included) | follower download B/changed el |")
        print("|---|---|---:|---:|---:|---:|")
        for k, v in extra["throughput"].items():
            codec, run = k.split(".", 1)
            pub = f"{v['publish_mbps_core']:.0f} [{v['publish_mbps']:.0f}]" if "publish_mbps_core" in v else ""
            pull = f"{v['pull_mbps_core']:.0f} [{v['pull_mbps']:.0f}]" if "pull_mbps_core" in v else ""
            bpe = f"{v['bytes_per_changed']:.3f}" if "bytes_per_changed" in v else ""
            dl = f"{v['download_per_changed']:.3f}" if "download_per_changed" in v else ""
            print(f"| {codec} | {run} | {pub} | {pull} | {bpe} | {dl} |")
    if extra["projection"]:
        print(f"\n## PROJECTION (not measured): CPU s per step = a x elements + b x tensors, a and b fitted from the "
              f"big and {cfg['tensors']}-tensor layouts above; Llama-style layouts (7B: {PROJECT['7B'][1]} tensors, "
              f"70B: {PROJECT['70B'][1]}); wall = CPU / {PROJECT_CORES}, i.e. assuming perfect scaling "
              f"to {PROJECT_CORES} cores\n")
        print("| what | run | ns/element | us/tensor | 7B CPU s | 7B wall s (16 cores) | 70B CPU s | "
              "70B wall s (16 cores) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        keys = sorted({k.rsplit(".", 1)[0] for k in extra["projection"]})
        for k in keys:
            a, b = extra["projection"][k + ".7B"], extra["projection"][k + ".70B"]
            what, run = k.rsplit(".", 1)
            print(f"| {what} | {run} | {a['ns_per_element']:.2f} | {a['us_per_tensor']:.0f} | {a['cpu_s']:.1f} | "
                  f"{a['wall_s_16_cores']:.2f} | {b['cpu_s']:.1f} | {b['wall_s_16_cores']:.2f} |")


# -- main ----------------------------------------------------------------------------------------------
GROUPS = ("background", "memory", "codecs", "many", "dense")
QUICK = {"size": 0.006, "tensors": 128, "tensors_mb": 1.0, "repeat": 1}
DEFAULTS = {"size": 1.0, "tensors": 16384, "tensors_mb": 200.0, "repeat": 3}


def parse_args(argv=None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    _trace.add_trace_arg(pre)
    _trace.select(pre.parse_known_args(argv)[0].trace)  # the runs to offer are the chosen trace's
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _trace.add_trace_arg(ap)
    ap.add_argument("--size", type=float, help="model size in GB of bf16 (default 1.0; --quick 0.02)")
    ap.add_argument("--runs", nargs="+", default=_trace.RUNS, choices=_trace.RUNS)
    ap.add_argument("--repeat", type=int, help="measured steps per case, after one warm-up (default 3; --quick 2)")
    ap.add_argument("--tensors", type=int, help="tensor count of the many-tensors layout (default 16384)")
    ap.add_argument("--tensors-mb", type=float, help="total MB of the many-tensors layout (default 200)")
    ap.add_argument("--codecs", nargs="+", default=["auto", "ulp", "zstd", "raw"],
                    help="codecs for the MB/s-per-core table (auto = the default, measured by the main cases)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in every case (default 2: the 2 cores)")
    ap.add_argument("--skip", nargs="*", default=[], choices=GROUPS, help="leave out groups of cases")
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes: {QUICK}")
    ap.add_argument("--workdir", default=None, help="where the temporary stores go (default: the system temp dir)")
    ap.add_argument("--json", default=None, help="write every figure (and the raw measurements) here")
    a = ap.parse_args(argv)
    preset = QUICK if a.quick else DEFAULTS
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if not (_trace.TRACES / "weight_trace.py").exists():
        sys.exit(f"weight trace not found at {_trace.TRACES}; set DELTASTORE_TRACES")
    if _trace.trace_dir(a.trace) is None:
        sys.exit(f"trace {a.trace!r} not found (have: {', '.join(_trace.available()) or 'none'})")
    cfg = {"trace": a.trace, "size": a.size, "runs": a.runs, "repeat": a.repeat, "warmup": 1, "tensors": a.tensors,
           "tensors_mb": a.tensors_mb, "codecs": a.codecs, "threads": a.threads, "quick": a.quick}
    print(f"bench/scale.py: size {a.size} GB, runs {' '.join(a.runs)}, repeat {a.repeat} (+1 warm-up), "
          f"many-tensors {a.tensors} x {a.tensors_mb:g} MB, codecs {' '.join(a.codecs)}, threads {a.threads}, "
          f"trace {a.trace} ({_trace.trace_dir(a.trace)}), OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
          f"deltastore from {Path(ds.__file__).parent}", flush=True)
    run_case = Runner(cfg)
    res: dict = {}
    with tempfile.TemporaryDirectory(dir=a.workdir, prefix="deltastore-scale-") as work:
        for run in a.runs:
            r = short(run)
            store, sref = os.path.join(work, f"{r}-auto"), os.path.join(work, f"{r}.safetensors")
            res["publish", run] = run_case(f"publish sync {r}", case_publish, run, "model", store, save_ref=sref)
            if res["publish", run]:
                res["pull", run] = run_case(f"pull {r}", case_pull, run, "model", store, load_ref=sref)
                if "memory" not in a.skip:
                    res["rss_sub", run] = run_case(f"subscriber RSS {r}", case_rss_subscriber, store, fresh=True)
            shutil.rmtree(store, ignore_errors=True)
            if os.path.exists(sref):
                os.remove(sref)
            if "background" not in a.skip:
                res["background", run] = run_case(f"publish background {r}", case_publish, run, "model",
                                                  os.path.join(work, f"{r}-bg"), mode="background", bound=False)
                shutil.rmtree(os.path.join(work, f"{r}-bg"), ignore_errors=True)
            if "memory" not in a.skip:
                for mode in ("sync", "background"):
                    d = os.path.join(work, f"{r}-rss-{mode}")
                    res["rss_pub", mode, run] = run_case(f"publisher RSS {mode} {r}", case_rss_publisher, run, d,
                                                         mode=mode, fresh=True)
                    shutil.rmtree(d, ignore_errors=True)
                d = os.path.join(work, f"{r}-rss-every")  # informational: a policy that tracks no drift
                res["rss_pub", "every", run] = run_case(f"publisher RSS sync every(10) {r}", case_rss_publisher, run,
                                                        d, policy=10, fresh=True)
                shutil.rmtree(d, ignore_errors=True)
            if "codecs" not in a.skip:
                for codec in a.codecs:
                    if codec == "auto":
                        continue
                    d = os.path.join(work, f"{r}-{codec}")
                    res["codec_publish", codec, run] = run_case(f"publish {codec} {r}", case_publish, run, "model",
                                                                d, codec=codec, with_ref=False, bound=False)
                    if res["codec_publish", codec, run]:
                        res["codec_pull", codec, run] = run_case(f"pull {codec} {r}", case_pull, run, "model", d,
                                                                                 paths=False)
                    shutil.rmtree(d, ignore_errors=True)
        if "memory" not in a.skip:
            res["runtime"] = run_case("runtime memory of a fresh process", case_runtime, fresh=True)
            res["fresh_memory"] = run_case("what fresh memory costs here", case_fresh_memory)
        many_run = next((r for r in a.runs if short(r) == "dither"), a.runs[-1])
        res["many_run"] = many_run
        if "many" not in a.skip:
            store, sref = os.path.join(work, "many"), os.path.join(work, "many.safetensors")
            res["publish", "many"] = run_case(f"publish {a.tensors} tensors {short(many_run)}", case_publish,
                                              many_run, "many", store, anchors=a.repeat, save_ref=sref, bound=False)
            if res["publish", "many"]:
                res["pull", "many"] = run_case(f"pull {a.tensors} tensors {short(many_run)}", case_pull, many_run,
                                               "many", store, anchors=a.repeat, load_ref=sref)
            shutil.rmtree(store, ignore_errors=True)
        if "dense" not in a.skip:
            res["dense"] = run_case("dense anchor codec", case_dense, many_run)
    figs, extra = analyse(cfg, {k: v for k, v in res.items() if v is not None})
    report(cfg, figs, extra, run_case.loads)
    if run_case.errors:
        print(f"\n{len(run_case.errors)} case(s) failed:", *run_case.errors, sep="\n", file=sys.stderr)
    if a.json:
        commit = os.popen(f"git -C {Path(ds.__file__).parent} rev-parse --short HEAD 2>/dev/null").read()
        doc = {"config": cfg, "commit": commit.strip(), "figures": figs.rows, **extra, "errors": run_case.errors,
               "load_average": run_case.loads, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
               "deltastore": str(Path(ds.__file__).parent),
               "raw": {" ".join(k) if isinstance(k, tuple) else k: v for k, v in res.items()}}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1, default=float)
        print(f"\nfigures written to {a.json}")
    return 1 if run_case.errors else 0


if __name__ == "__main__":
    sys.exit(main())
