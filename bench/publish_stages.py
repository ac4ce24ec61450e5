"""Where a delta publish spends its CPU: process CPU ms per publish in each of its main stages.

    .venv/bin/python bench/publish_stages.py [--trace minilm-l6] [--size 1.0] [--run dither-lr1e-5]
                                             [--steps 4] [--threads 1] [--codec auto]

Data as in ``bench/scale.py`` (the real trace replicated to ``--size`` GB). A
Publisher (default settings, ``--codec``) writes an anchor and ``--steps``
deltas to a local store (tmpfs when there is one); the first delta is a
warm-up, the others are averaged. ``--threads`` sets the kernel, codec and
upload threads (default 1: then a stage's CPU is its own, not another
thread's).

Each stage is a library function wrapped (in every module that refers to it)
with process CPU time and wall clocks, so times are inclusive (a stage that
calls another contains it). A function that is missing (renamed) is reported
and skipped. The last state is checked bit-exact through a Subscriber.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import _trace  # noqa: E402
import scale  # noqa: E402
from _stages import instrument  # noqa: E402

#: (module, qualified name) of the stages timed
STAGES = [
    ("deltastore.publish.publisher", "Publisher._publish"),
    ("deltastore.publish.mirror", "Mirror.diff"),
    ("deltastore.segments", "diff_segments"),
    ("deltastore.publish.version", "write_version"),
    ("deltastore.publish.drift", "DriftTracker.propose"),
    ("deltastore.publish.drift", "DriftTracker.commit"),
    ("deltastore.publish.chain", "ChainHead.decide"),
    ("deltastore.publish.chain", "ChainHead.advance"),
    ("deltastore.publish.objects", "ObjectPlanner.sparse_jobs"),
    ("deltastore.publish.mirror", "Diff.batch"),
    ("deltastore.publish.mirror", "Diff.counts"),
    ("deltastore.publish.mirror", "Diff.part_breaks"),
    ("deltastore.publish.upload", "store_jobs"),
    ("deltastore.codecs.base", "encode_batched"),
    ("deltastore.codecs.auto", "AutoCodec.encode_batch"),
    ("deltastore.codecs.auto", "AutoCodec._choose"),
    ("deltastore.codecs.ulp", "UlpCodec.encode_batch"),
    ("deltastore.codecs.ulp", "UlpCodec._pack"),
    ("deltastore.codecs.ctx", "CtxCodec.encode"),
    ("deltastore.kernels.bitstream", "gap_stream_flat"),
    ("deltastore.kernels.bitstream", "step_planes"),
    ("deltastore.codecs._common", "zstd_compress"),
    ("deltastore.codecs._common", "pack_meta"),
    ("deltastore.store", "DeltaStore.put_object"),
    ("deltastore.manifest", "sha256_digest"),
    ("deltastore.publish.mirror", "Mirror.advance"),
    ("deltastore.publish.version", "new_checksums"),
    ("deltastore.publish.commit", "tensor_record"),
    ("deltastore.publish.commit", "version_manifest"),
    ("deltastore.publish.commit", "commit_manifest"),
    ("deltastore.store", "DeltaStore.commit"),
    ("deltastore._memory", "release_memory"),
    ("deltastore.tensors", "named_tensors"),
    ("deltastore.publish.publisher", "Publisher._normalise"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _trace.add_trace_arg(ap)
    ap.add_argument("--size", type=float, default=1.0, help="GB of bf16")
    ap.add_argument("--run", default="dither", help="run name or kind (cold, dither)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--codec", default="auto", help='codec name, or "ctx-auto" for auto with link_mbps=None')
    ap.add_argument("--workdir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    args = ap.parse_args(argv)
    _trace.select(args.trace)
    run = next((r for r in _trace.RUNS if r == args.run or _trace.short(r) == args.run), None)
    if run is None:
        ap.error(f"no run {args.run!r} in {_trace.RUNS}")
    for var in ("DELTASTORE_THREADS", "DELTASTORE_CODEC_THREADS"):
        os.environ[var] = str(args.threads)
    torch.set_num_threads(args.threads)
    import deltastore as ds

    codec = {"id": "auto", "config": {"link_mbps": None}} if args.codec == "ctx-auto" else args.codec
    spent: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    missing = instrument(STAGES, spent)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    src = scale.build({"size": args.size}, run, "model")
    store = tempfile.mkdtemp(prefix="deltastore-publish-stages-", dir=args.workdir)
    try:
        pub = ds.Publisher(store, codec=codec, max_workers=args.threads)
        pub.publish(src.state, step=0)
        rows, per_step = [], []
        for t in range(1, args.steps + 1):
            changed = sum(int(c[1].numel()) for c in src.advance())
            spent.clear()
            c, w = time.process_time(), time.perf_counter()
            info = pub.publish(src.state, step=t)
            c, w = time.process_time() - c, time.perf_counter() - w
            per_step.append((t, info.differential, {q: v[0] for q, v in spent.items()}))
            assert info.changed == changed, (info.changed, changed)
            print(f"step {t}: {info.kind}, {changed} changed ({100 * changed / (src.nbytes / 2):.2f} %), "
                  f"{info.nbytes} B, CPU {1e3 * c:.0f} ms, wall {1e3 * w:.0f} ms, "
                  f"{src.nbytes / 1e6 / c:.0f} MB/CPU-s, {1e9 * c / changed:.1f} ns CPU per change"
                  + (" (warm-up)" if t == 1 else ""), flush=True)
            if t > 1:
                rows.append((c, w, changed))
                for q, v in spent.items():
                    total = totals[q]
                    for i in range(3):
                        total[i] += v[i]
        pub.close()
        sub = ds.Subscriber(store)
        got = sub.pull(step=args.steps).state
        if not scale.bits_equal(got, src.state):
            print("the pulled state is not bit-exact", file=sys.stderr)
            return 1
        sub.close()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    n = max(1, len(rows))
    cpu, wall, ch = (sum(r[i] for r in rows) / n for i in range(3))
    print(f"\n{len(src.state)} tensors, {src.nbytes / 1e9:.2f} GB, {args.threads} thread(s), codec {args.codec}; "
          f"mean over {len(rows)} publishes: CPU {1e3 * cpu:.0f} ms ({src.nbytes / 1e6 / cpu:.0f} MB/CPU-s, "
          f"{1e9 * cpu / ch:.1f} ns per change), wall {1e3 * wall:.0f} ms\n")
    print("| stage (inclusive) | CPU ms per publish | wall ms | calls | CPU ns per change |\n|---|---:|---:|---:|---:|")
    for q, (c, w, k) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"| `{q}` | {1e3 * c / n:.1f} | {1e3 * w / n:.1f} | {k / n:.0f} | {1e9 * c / n / ch:.1f} |")
    print("\nCPU ms per stage, step by step (D: the version also wrote a differential):\n")
    print("| stage | " + " | ".join(f"{t}{' D' if d else ''}" for t, d, _ in per_step) + " |")
    print("|---|" + "---:|" * len(per_step))
    for q, _ in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"| `{q}` | " + " | ".join(f"{1e3 * sp.get(q, 0):.1f}" for _, _, sp in per_step) + " |")
    if missing:
        print(f"\nnot found (renamed?): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
