"""Where a follower's delta pull spends its time: wall ms per pull in each of its main stages.

    .venv/bin/python bench/pull_stages.py [--layout whole|many] [--size 1.0] [--run dither-lr1e-5]
                                          [--steps 4] [--store DIR]

Data as in ``bench/scale.py`` (the real trace replicated to ``--size`` GB, or
the 16,384-tensor layout with ``--layout many``). A Publisher with the
defaults writes an anchor and ``--steps`` deltas (kept in ``--store`` and
reused when it already holds them); a fresh Subscriber pulls the anchor, then
each delta into a dict target, next to a dense ``copy_`` of the same tensors.
The first delta pull is a warm-up; the others are averaged.

Each stage is a library function wrapped (in every module that refers to it)
with a wall clock, so times are inclusive (a stage that calls another
contains it) and a stage run on two threads at once counts both. The wrappers
cost about a microsecond per call: the pull itself is a little slower than
without them. A function that is missing (renamed) is reported and skipped.
Every pull is checked bit-exact against the model at the end.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import scale  # noqa: E402
from _stages import instrument  # noqa: E402
import deltastore as ds  # noqa: E402

#: (module, qualified name) of the stages timed
STAGES = [
    ("deltastore.manifest", "Manifest.from_json"),
    ("deltastore.manifest", "_plain_columns"),
    ("deltastore.pull.checks", "check_target"),
    ("deltastore.pull.objects", "decode_sparse_object"),
    ("deltastore.pull.objects", "_decode_rows"),
    ("deltastore.pull.objects", "_checked_batches"),
    ("deltastore.pull.transaction", "DeltasOneByOne.run"),
    ("deltastore.codecs.auto", "AutoCodec._decode"),
    ("deltastore.codecs.ulp", "UlpCodec.decode_batch"),
    ("deltastore.codecs._common", "read_positions"),
    ("deltastore.codecs._common", "zstd_decompress"),
    ("deltastore.codecs._common", "decode_positions"),
    ("deltastore.kernels.bitstream", "StepsInPlace.run"),
    ("deltastore.pull.objects", "_check_batch"),
    ("deltastore.pull.staging", "_checked_sums"),
    ("deltastore.pull.staging", "_expect_sums"),
    ("deltastore.codecs._common", "position_stream"),
    ("deltastore.pull.apply", "write_sparse"),
    ("deltastore.pull.checks", "check_overlaps"),
    ("deltastore.pull.checks", "check_layout"),
    ("deltastore.pull.staging", "SparseOverlay.__init__"),
    ("deltastore.pull.staging", "SparseOverlay.apply"),
    ("deltastore.pull.staging", "SparseOverlay.in_place"),
    ("deltastore.tensors", "named_tensors"),
    ("deltastore.pull.reader", "VersionReader.plan_for"),
    ("deltastore.pull.reader", "VersionReader.path_layout"),
    ("deltastore.pull.objects", "object_index"),
    ("deltastore.store", "DeltaStore.get_object"),
    ("deltastore.pull.tracking", "set_version"),
    ("deltastore.pull.checked_target", "CheckedTarget.lookup"),
    ("deltastore.pull.checked_target", "CheckedTarget.remember"),
    ("deltastore.kernels.bitstream", "StepsInPlace.__init__"),
    ("deltastore.pull.objects", "_check_counts"),
    ("deltastore.store", "DeltaStore.manifest_with_digest"),
    ("deltastore.manifest", "_parse"),
    ("deltastore.manifest", "_known_layout"),
]


def build_store(args: argparse.Namespace, cfg: dict) -> None:
    last = os.path.join(args.store, "versions", f"{args.steps:012d}.json")
    if os.path.exists(last):
        return
    src = scale.build(cfg, args.run, args.layout)
    pub = ds.Publisher(args.store)
    pub.publish(src.state, step=0)
    for t in range(1, args.steps + 1):
        src.advance(keep=False)
        pub.publish(src.state, step=t)
    pub.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=["whole", "many"], default="whole")
    ap.add_argument("--size", type=float, default=1.0, help="GB of bf16 (layout 'whole')")
    ap.add_argument("--run", default="dither-lr1e-5", choices=scale._trace.RUNS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--store", default=None, help="default: a folder under /tmp named by the data")
    args = ap.parse_args(argv)
    cfg = {"size": args.size, "tensors": 16384, "tensors_mb": 200.0}
    args.store = args.store or f"/tmp/deltastore-pull-stages-{args.layout}-{args.size}-{args.run}-{args.steps}"
    build_store(args, cfg)
    spent: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    missing = instrument(STAGES, spent)
    src = scale.build(cfg, args.run, args.layout)
    sub = ds.Subscriber(args.store)
    target = {k: torch.zeros_like(v) for k, v in src.state.items()}
    scratch = {k: torch.zeros_like(v) for k, v in src.state.items()}
    sub.pull(target, step=0)
    pulls, copies = [], []
    for t in range(1, args.steps + 1):
        src.advance(keep=False)
        w = time.perf_counter()
        scale.dense_copy(scratch, src.state)
        c = time.perf_counter() - w
        if t == 2:
            spent.clear()
        w = time.perf_counter()
        sub.pull(target, step=t)
        p = time.perf_counter() - w
        print(f"step {t}: pull {1e3 * p:.0f} ms, dense copy {1e3 * c:.0f} ms ({p / c:.2f}x)"
              + (" (warm-up)" if t == 1 else ""))
        if t > 1:
            pulls.append(p)
            copies.append(c)
    if not scale.bits_equal(target, src.state):
        print("the pulled target is not bit-exact", file=sys.stderr)
        return 1
    n = max(1, len(pulls))
    print(f"\n{len(target)} tensors, {src.nbytes / 1e9:.2f} GB; mean over {len(pulls)} pulls: pull "
          f"{1e3 * sum(pulls) / n:.0f} ms, dense copy {1e3 * sum(copies) / n:.0f} ms\n")
    print("| stage (inclusive) | ms per pull |\n|---|---:|")
    for q, s in sorted(spent.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{q}` | {1e3 * s[1] / n:.1f} |")
    if missing:
        print(f"\nnot found (renamed?): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
