"""The sparse write of a pull (``segments.scatter``) against the same loop without its prefetch.

    python bench/kernels.py [--size 1.0] [--runs cold-lr1e-6 dither-lr1e-5] [--repeat 9] [--threads 2]

Data: one real step's changes of each trace run (``bench/scale.py``'s
replicated model of ``--size`` GB, every tensor its own storage), written
into that model: positions sparse enough that the hardware prefetcher cannot
follow them. The shipped kernel (``kernels.diff.scatter_items``) asks for
the cache line 32 items ahead; the reference is the plain loop
(``kernels._diff.scatter_items_plain``, compiled with it) run through the
same threads and segment split. The two
alternate ``--repeat`` times; prints median wall and process CPU ms, their
spread, and shipped / reference ratios (below 1: the prefetch pays). Checks
that both leave the same bits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import scale
from deltastore import segments
from deltastore.kernels import diff as kernels
from deltastore.kernels._diff import scatter_items_plain as _plain_scatter


def _timed(fn) -> tuple[float, float]:  # noqa: ANN001
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def run(run_name: str, size: float, repeat: int) -> dict:
    src = scale.Source(run_name, size_gb=size)
    changes = src.advance(keep=True)
    names = [n for n, *_ in changes]
    tensors = [src.flat[n] for n in names]
    pos = segments.cat([p for _, p, _, _ in changes])
    bits = segments.cat([new for _, _, new, _ in changes])
    bounds = segments.bounds_of([p.numel() for _, p, _, _ in changes])
    shipped = kernels.scatter_items

    def with_kernel(k):  # noqa: ANN001, ANN202
        kernels.scatter_items = k
        try:
            segments.scatter(tensors, pos, bounds, bits)
        finally:
            kernels.scatter_items = shipped

    with_kernel(_plain_scatter)  # warm both
    with_kernel(shipped)
    rows: dict[str, list[tuple[float, float]]] = {"shipped": [], "reference": []}
    for _ in range(repeat):
        rows["reference"].append(_timed(lambda: with_kernel(_plain_scatter)))
        rows["shipped"].append(_timed(lambda: with_kernel(shipped)))
    ok = all(torch.equal(t[p], b) for t, (_, p, b, _) in zip(tensors, changes))
    return {"run": run_name, "elements": int(pos.numel()), "model_bytes": src.nbytes, "rows": rows, "exact": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="model GB (default 1.0)")
    ap.add_argument("--runs", nargs="+", default=["cold-lr1e-6", "dither-lr1e-5"])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    os.environ["DELTASTORE_THREADS"] = str(a.threads)
    torch.set_num_threads(a.threads)
    print(f"bench/kernels.py: sparse write, {a.size:g} GB, {a.threads} threads, {a.repeat} alternated repeats")
    print("| run | changed elements | shipped wall ms [spread] | reference wall ms [spread] | wall ratio | "
          "cpu ratio | bits |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in a.runs:
        got = run(r, a.size, a.repeat)
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in got["rows"].items()}
        spread = {k: (1e3 * min(w for w, _ in v), 1e3 * max(w for w, _ in v)) for k, v in got["rows"].items()}
        s, ref = med["shipped"], med["reference"]
        print(f"| {r} | {got['elements']:,} | {1e3 * s[0]:.1f} [{spread['shipped'][0]:.1f}–{spread['shipped'][1]:.1f}] "
              f"| {1e3 * ref[0]:.1f} [{spread['reference'][0]:.1f}–{spread['reference'][1]:.1f}] "
              f"| {s[0] / ref[0]:.2f} | {s[1] / ref[1]:.2f} | {'exact' if got['exact'] else 'WRONG'} |")
        if not got["exact"]:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
