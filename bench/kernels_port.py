"""The compiled kernels (deltastore/kernels/_*.pyx) against the numba kernels they replaced, in one run.

    python bench/kernels_port.py [--size 1.0] [--runs cold-lr1e-6 dither-lr1e-5] [--repeat 7] [--threads 2]
                                 [--ctx-gb 0.1] [--numba-rev REV] [--only compare checksum ...]

The numba kernels are read from git (``--numba-rev``, default: the last commit that had
``deltastore/kernels/jit.py``) into a temporary package and need numba installed (not a dependency any
more: ``pip install numba``). Each case runs the package's own driver (``segments``, ``planes``, the codecs'
kernel modules, the drift tracker) twice per repeat, once with the numba modules swapped in for the
compiled ones and once as shipped, alternating; both results are checked equal bit for bit.

Data: one real step of each trace run on ``bench/scale.py``'s replicated model of ``--size`` GB (every
tensor its own storage). Prints, per case, the median wall and process CPU ms of each, their spread
(min-max) and new / numba ratios (below 1: the compiled kernel is faster). Numba's first calls compile
(cached in the temporary package) and are not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/scale.py

import numpy as np  # noqa: E402
import torch  # noqa: E402

import scale  # noqa: E402
from deltastore import checksum as cs  # noqa: E402
from deltastore import segments  # noqa: E402
from deltastore.publish import drift  # noqa: E402
from deltastore.codecs import _bits, _common, ctx, dense, ulp  # noqa: E402
from deltastore.segments import Change  # noqa: E402
from deltastore.kernels import bitstream, checksum, diff, merge, planes, ranks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# (module, attribute) -> which kernel module it holds; swapped as a whole
SLOTS = [(segments, "_k", "diff"), (segments, "_m", "merge"), (cs, "_k", "checksum"), (_bits, "K", "bitstream"),
         (ulp, "K", "bitstream"), (_common, "K", "bitstream"), (ctx, "R", "ranks"), (dense, "_planes", "planes")]
NEW = {"diff": diff, "merge": merge, "checksum": checksum, "bitstream": bitstream, "ranks": ranks, "planes": planes}


def numba_kernels(rev: str | None) -> dict:
    """The kernel modules as of ``rev`` (numba), imported from a temporary copy."""
    if rev is None:
        last = subprocess.run(["git", "log", "-1", "--format=%H", "--", "deltastore/kernels/jit.py"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        present = subprocess.run(["git", "cat-file", "-e", f"{last}:deltastore/kernels/jit.py"], cwd=ROOT,
                                 capture_output=True).returncode
        rev = last if present == 0 else f"{last}^"  # the commit that deleted it: its parent has it
    where = Path(tempfile.mkdtemp(prefix="numba-kernels-"))
    pkg = where / "numba_kernels"
    pkg.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:deltastore/kernels"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        if name.endswith(".py"):
            src = subprocess.run(["git", "show", f"{rev}:deltastore/kernels/{name}"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
            (pkg / name).write_bytes(src)
    sys.path.insert(0, str(where))
    mods = {k: importlib.import_module(f"numba_kernels.{k}") for k in NEW}
    mods["_where"] = where
    mods["_rev"] = rev
    return mods


@contextlib.contextmanager
def using(mods: dict) -> Iterator[None]:
    saved = [(m, a, getattr(m, a)) for m, a, _ in SLOTS]
    saved_drift = (drift.drift_merge_rows, drift.drift_merge_rows_in_place, drift.merge_runs)
    for m, a, k in SLOTS:
        setattr(m, a, mods[k])
    drift.drift_merge_rows = mods["diff"].drift_merge_rows
    drift.drift_merge_rows_in_place = mods["diff"].drift_merge_rows_in_place
    drift.merge_runs = mods["diff"].merge_runs
    try:
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)
        drift.drift_merge_rows, drift.drift_merge_rows_in_place, drift.merge_runs = saved_drift


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def same(a: object, b: object) -> bool:
    """Bit-for-bit equality of nested results (tensors and arrays by their bytes)."""
    if isinstance(a, torch.Tensor):
        a = a.contiguous().view(torch.uint8).numpy() if a.numel() else a.numpy()
    if isinstance(b, torch.Tensor):
        b = b.contiguous().view(torch.uint8).numpy() if b.numel() else b.numpy()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class Case:
    """One kernel family: ``run()`` through the package's driver; ``reset()`` (untimed) before each run."""

    def __init__(self, name: str, kernel: str, run: Callable[[], object], reset: Callable[[], None] | None = None,
                 result: Callable[[object], object] | None = None):
        self.name, self.kernel, self.run, self.reset = name, kernel, run, reset or (lambda: None)
        self.result = result or (lambda x: x)


def cases(src: scale.Source, changes: list, changes2: list, ctx_gb: float) -> list[Case]:
    names = [n for n, *_ in changes]
    model = [src.flat[n] for n in src.flat]  # the whole model, after the step
    keys = np.array([cs.tensor_key(n) for n in src.flat], np.uint64)
    before = {n: t.clone() for n, t in src.flat.items()}
    for n, p, _, old in changes:  # the model before the step: the step's old bits put back
        before[n][p] = old
    olds = [before[n] for n in src.flat]
    tensors = [src.flat[n] for n in names]
    pos = segments.cat([p for _, p, _, _ in changes])
    new = segments.cat([b for _, _, b, _ in changes])
    old = segments.cat([o for _, _, _, o in changes])
    bounds = segments.bounds_of([p.numel() for _, p, _, _ in changes])
    ckeys = np.array([cs.tensor_key(n) for n in names], np.uint64)
    target = [before[n].clone() for n in names]
    out: list[Case] = []

    def diff_run() -> object:
        fc = segments.diff_segments(olds, model, keys)
        return fc.bounds, fc.sums, segments.cat([p for p, _, _ in fc.parts])

    out.append(Case("compare (whole model)", "diff_items", diff_run))
    out.append(Case("checksum, whole model", "mix_full_items", lambda: segments.full_sums(model, keys)))
    big = max(model, key=torch.Tensor.numel)
    out.append(Case(f"checksum, one tensor ({big.numel() / 1e6:.0f} M)", "DENSE_AT",
                    lambda: cs.full_checksum("t", big)))
    out.append(Case("checksum of the changes", "mix_delta_segments",
                    lambda: segments.mix_delta(pos, old, new, bounds, ckeys)))
    out.append(Case("gather at the changes", "gather_items", lambda: segments.gather(tensors, pos, bounds)))

    def scatter_reset() -> None:
        segments.scatter(target, pos, bounds, old)

    out.append(Case("scatter the changes", "scatter_items", lambda: segments.scatter(target, pos, bounds, new),
                    scatter_reset, lambda _: [t.clone() for t in target]))

    # dense codec's planes over the whole model
    counts = np.array([t.numel() for t in model], np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    addrs = np.array([t.data_ptr() for t in model], np.uint64)
    total = int(counts.sum())
    pl = [np.empty(total, np.uint8) for _ in range(2)]
    back = [torch.empty_like(t) for t in model]
    back_addrs = np.array([t.data_ptr() for t in back], np.uint64)
    out.append(Case("planes split (dense encode)", "split_segments",
                    lambda: dense._planes.split_segments(2, True, addrs, counts, starts, pl),
                    result=lambda _: [p.copy() for p in pl]))
    planes.split_segments(2, True, addrs, counts, starts, pl)
    out.append(Case("planes join (dense decode)", "join_segments",
                    lambda: dense._planes.join_segments(2, True, pl, starts, counts, back_addrs),
                    result=lambda _: [t.clone() for t in back[:4]]))

    # ulp codec: positions as a gap stream, values as step planes, and the in-place decode
    posn = pos.numpy()
    newn, oldn = new.numpy(), old.numpy()
    out.append(Case("gap stream encode", "_gap_stream", lambda: _common.K.gap_stream_flat(posn, bounds)))
    stream = bitstream.gap_stream_flat(posn, bounds)
    numels = np.array([t.numel() for t in tensors], np.int64)
    ccounts = np.diff(bounds)
    out.append(Case("gap stream decode", "_gap_positions",
                    lambda: _common.K.gap_positions(stream, ccounts, numels)[:2]))
    out.append(Case("ulp step planes", "_max_step/_step_planes", lambda: ulp.K.step_planes(newn, oldn, True)))
    steps = bitstream.step_planes(newn, oldn, True)
    out.append(Case("ulp apply steps", "_apply_steps", lambda: ulp.K.apply_steps(oldn, steps, True)))
    gaps = np.frombuffer(stream, np.uint8)
    tptr = np.array([t.data_ptr() for t in target], np.int64)
    tlen = np.array([t.numel() for t in target], np.int64)
    state: dict = {}  # the drift case's tracker

    def in_place() -> object:
        done, sums = np.zeros(len(target), np.bool_), np.zeros(len(target), np.uint64)
        st = ulp.K.StepsInPlace(tptr, tlen, ckeys, done, sums, ccounts, gaps, steps, np.dtype(np.int16), True)
        return st.run(), sums

    out.append(Case("ulp decode in place", "_apply_gaps_at", in_place, scatter_reset))
    gap_values = np.diff(posn).astype(np.uint64)
    out.append(Case("code costs (kind_sums)", "_kind_sums", lambda: _bits.K.kind_sums(gap_values, 40, 40)))

    # ctx codec's ranks and select, per tensor, with 4 buckets (threshold path) and 16 (histogram path), on the
    # first ctx_gb of the changed tensors (a per-tensor O(model) pass: the whole model would take minutes)
    rows, room = [], ctx_gb * 1e9
    for n, p, _, _ in changes:
        if room > 0:
            rows.append((before[n].numpy().reshape(-1), p.numpy()))
            room -= 2 * before[n].numel()
    for nb, classes in ((4, [114, 118, 122]), (16, list(range(108, 123)))):
        lut = np.searchsorted(np.array(classes), np.arange(256), side="right").astype(np.int64)

        def ranks_run(lut: np.ndarray = lut, nb: int = nb) -> object:
            return [ctx.R.bucket_ranks(b, p, 0x7FFF, 7, lut, nb) for b, p in rows]

        def select_run(lut: np.ndarray = lut, nb: int = nb, got: list = ranks_run()) -> object:
            return [ctx.R.bucket_select(ctx.R.Buckets(b, 0x7FFF, 7, lut, nb), [rank[bucket == k] for k in range(nb)])
                    for (b, _), (bucket, rank, _) in zip(rows, got)]

        out.append(Case(f"ctx ranks, {nb} buckets", "_ranks3" if nb == 4 else "_ranks", ranks_run))
        out.append(Case(f"ctx select, {nb} buckets", "_select3" if nb == 4 else "_select", select_run))

    # staged deltas laid over each other (a pull of two deltas at once)
    p2 = {n: p for n, p, _, _ in changes2}
    b2 = {n: b for n, _, b, _ in changes2}
    o2 = {n: o for n, _, _, o in changes2}
    empty_p, empty_b = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int16)
    pos2 = segments.cat([p2.get(n, empty_p) for n in names])
    new2 = segments.cat([b2.get(n, empty_b) for n in names])
    old2 = segments.cat([o2.get(n, empty_b) for n in names])
    bounds2 = segments.bounds_of([p2.get(n, empty_p).numel() for n in names])
    staged = (pos, new, old, bounds)
    out.append(Case("merge staged deltas", "union_counts/merge_segments",
                    lambda: segments.merge_staged(staged, pos2, new2, old2, bounds2)))
    over = old2.clone()
    out.append(Case("overlay staged deltas", "overlay_segments",
                    lambda: segments.overlay_staged((pos, new, bounds), pos2, bounds2, over),
                    lambda: over.copy_(old2), lambda r: (r, over.clone())))

    # the drift tracker: a second version's changes merged into the first's
    ch1 = {n: Change(p, b, o) for n, p, b, o in changes}
    ch2 = {n: Change(p, b, o) for n, p, b, o in changes2}

    def drift_reset() -> None:
        t = drift.DriftTracker()
        t.commit(t.propose(ch1))
        state["tracker"] = t

    def drift_run() -> object:
        t = state["tracker"]
        t.commit(t.propose(ch2))
        return sorted((n, s.positions.numpy().tobytes(), s.anchor_bits.numpy().tobytes()) for n, s in t._drift.items())

    out.append(Case("drift merge", "drift_merge_rows(_in_place)", drift_run, drift_reset))
    return out


def run(run_name: str, size: float, repeat: int, old: dict, only: list[str] | None, ctx_gb: float) -> list[dict]:
    src = scale.Source(run_name, size_gb=size)
    changes = src.advance(keep=True)
    changes2 = src.advance(keep=True)
    for n, p, _, o in changes2:  # back to the state after the first step (the second is kept as data)
        src.flat[n][p] = o
    rows = []
    for case in cases(src, changes, changes2, ctx_gb):
        if only and not any(o in case.name or o in case.kernel for o in only):
            continue
        times: dict[str, list[tuple[float, float]]] = {"numba": [], "new": []}
        results = {}
        for kind in ("numba", "new"):  # warm-up (numba compiles or loads its cache), checked equal
            with using(old if kind == "numba" else NEW):
                case.reset()
                results[kind] = case.result(case.run())
        exact = same(results["numba"], results["new"])
        for _ in range(repeat):
            for kind in ("numba", "new"):
                with using(old if kind == "numba" else NEW):
                    case.reset()
                    w, c, _ = timed(case.run)
                times[kind].append((w, c))
        rows.append({"run": run_name, "case": case.name, "kernel": case.kernel, "exact": exact, "times": times})
        print(line(rows[-1]), flush=True)
    return rows


def _ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):8.1f} ({1e3 * min(xs):.1f}-{1e3 * max(xs):.1f})"


def line(r: dict) -> str:
    t = r["times"]
    wn, wo = [w for w, _ in t["new"]], [w for w, _ in t["numba"]]
    cn, co = [c for _, c in t["new"]], [c for _, c in t["numba"]]
    ratio_w = statistics.median(wn) / max(1e-9, statistics.median(wo))
    ratio_c = statistics.median(cn) / max(1e-9, statistics.median(co))
    return (f"{r['run']:14s} {r['case']:32s} {r['kernel']:28s} numba wall {_ms(wo)}  new wall {_ms(wn)}  "
            f"new/numba wall {ratio_w:5.2f} cpu {ratio_c:5.2f}  {'exact' if r['exact'] else 'DIFFERENT'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="model GB (default 1.0)")
    ap.add_argument("--runs", nargs="+", default=["cold-lr1e-6", "dither-lr1e-5"])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-gb", type=float, default=0.1, help="model GB the ctx ranks/select cases cover")
    ap.add_argument("--numba-rev", default=None, help="git revision with the numba kernels")
    ap.add_argument("--only", nargs="*", help="cases whose name or kernel contains one of these")
    a = ap.parse_args(argv)
    os.environ["DELTASTORE_THREADS"] = str(a.threads)
    try:
        old = numba_kernels(a.numba_rev)
    except ImportError as e:
        print(f"needs numba to run the old kernels ({e}): pip install numba", file=sys.stderr)
        return 2
    print(f"numba kernels from {old['_rev'][:12]}; numba {sys.modules['numba'].__version__}; "
          f"{a.size} GB model, {a.threads} threads, {a.repeat} repeats; ms: median (min-max)")
    rows = []
    try:
        for r in a.runs:
            rows += run(r, a.size, a.repeat, old, a.only, a.ctx_gb)
    finally:
        shutil.rmtree(old["_where"], ignore_errors=True)
    bad = [r for r in rows if not r["exact"]]
    if bad:
        print("DIFFERENT results:", ", ".join(f"{r['run']}/{r['case']}" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
