"""Reliability figures: every fault-injection scenario on the local backend and on SeaweedFS (S3).

    .venv/bin/python bench/faults.py                 # the figures of docs/reliability.md (~5 min)
    .venv/bin/python bench/faults.py --quick         # fewer trials (~1 min)
    .venv/bin/python bench/faults.py --only-store    # GC races, store bombs, disk errors, unreachable endpoints
    .venv/bin/python bench/faults.py --only-target --no-s3   # layout changes, aliasing, interrupts, post-commit
    .venv/bin/python bench/faults.py --only-edges    # issue 48: false claims, GC grace, S3 retry settings,
                                                     # typed edges, the LoRA follower over HTTP

Prints one row per scenario and backend: trials, faults injected, wrong versions
applied, versions lost, untyped exceptions (the last three must be 0) and the
recovery time (median / max, ms). Exits 1 if any promise was broken, and lists
each broken promise. The scenarios are those of ``tests/test_reliability``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

from test_backends.servers import Seaweed  # noqa: E402
from test_reliability import hostile  # noqa: E402
from test_reliability import scenarios as S  # noqa: E402
from test_reliability import scenarios_store as SS  # noqa: E402
from test_reliability import scenarios_target as ST  # noqa: E402
from test_reliability import scenarios_edges as SE  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer trials")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-s3", action="store_true", help="local backend only")
    ap.add_argument("--only-store", action="store_true",
                    help="only the store/backend families (GC races, bombs, disk errors, unreachable endpoints)")
    ap.add_argument("--only-target", action="store_true",
                    help="only the target/publisher families (layout changes, aliasing, interrupts, post-commit)")
    ap.add_argument("--only-edges", action="store_true",
                    help="only issue 48's families (false claims, GC grace, S3 retry settings, typed edges, LoRA)")
    args = ap.parse_args()
    general = not (args.only_store or args.only_target or args.only_edges)
    store = not (args.only_target or args.only_edges)
    target = not (args.only_store or args.only_edges)
    edges = not (args.only_store or args.only_target)
    q = args.quick
    n = {"crash": 10 if q else 50, "corrupt": 20 if q else 60, "transient": 15 if q else 50,
         "races": 5 if q else 20, "apply": 50 if q else 200, "fuzz": (150, 100, 150) if q else (500, 300, 400),
         "gc": 6 if q else 15, "unreachable": 6 if q else 12, "disk": 6 if q else 15,
         "layout": 5 if q else 20, "alias": 20 if q else 100, "interrupt": 20 if q else 100, "post": 5 if q else 20,
         "claims": 2 if q else 6, "claims_target": 5 if q else 20, "user_retries": 4 if q else 12}
    server = None
    wheres = [S.local_where()]
    if not args.no_s3:
        server = Seaweed().start()
        wheres.append(S.s3_where(server))
    rows: list[S.Stats] = []
    t0 = time.monotonic()
    try:
        for w in wheres:
            if general:
                rows.append(S.run_crash(w, n["crash"], seed=args.seed))
                rows.append(S.run_corruption(w, n["corrupt"], seed=args.seed))
                rows.append(S.run_transient_local(w, n["transient"], seed=args.seed) if w.kind == "local" else
                            S.run_transient_s3(w, server, n["transient"], seed=args.seed))
                rows.append(S.run_races(w, n["races"], seed=args.seed))
            if store:
                rows.append(SS.run_gc_reuse(w, n["gc"], seed=args.seed))
                rows.append(SS.run_store_bombs(w))
            if edges:
                rows.append(SE.run_claims_store(w, n["claims"], seed=args.seed))
                rows.append(SE.run_gc_grace(w))
        if store:
            rows.append(SS.run_disk_errors(wheres[0], n["disk"], seed=args.seed))
            rows.append(SS.run_unreachable(n["unreachable"]))
        if general:
            rows.append(S.run_apply_interrupted(n["apply"], seed=args.seed))
        if target:
            rows.append(ST.run_layout_changes(n["layout"], seed=args.seed))
            rows.append(ST.run_aliasing(n["alias"], seed=args.seed))
            rows.append(ST.run_interrupts(n["interrupt"], seed=args.seed))
            rows.append(ST.run_post_commit(n["post"], seed=args.seed))
        if edges:
            rows.append(SE.run_claims_target(n["claims_target"], seed=args.seed))
            rows.append(SE.run_user_retries(n["user_retries"]))
            rows.append(SE.run_typed_edges())
            rows.append(SE.run_lora_http())
        if general:
            rows.append(run_hostile(*n["fuzz"]))
    finally:
        if server is not None:
            server.stop()
    print()
    print("| scenario | backend | trials | faults injected | wrong versions applied | versions lost "
          "| untyped exceptions | recovery ms (median / max) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.scenario} | {r.backend} | {r.trials} | {r.faults} | {r.wrong} | {r.lost} | {r.untyped} "
              f"| {r.recovery_text()} |")
    print()
    for r in rows:
        if r.notes:
            print(f"{r.scenario} / {r.backend} ({r.seconds:.0f} s): "
                  + ", ".join(f"{k} {v}" for k, v in sorted(r.notes.items())))
    problems = [(r, p) for r in rows for p in r.problems]
    print(f"\ntotal {time.monotonic() - t0:.0f} s, peak RSS {S.max_rss_mb():.0f} MB, "
          f"{len(problems)} broken promise(s)")
    for r, p in problems:
        print(f"  [{r.scenario} / {r.backend}] {p}")
    return 1 if problems else 0


def run_hostile(n_manifests: int, n_headers: int, n_streams: int) -> S.Stats:
    stats = S.Stats("hostile input (hypothesis)", "memory")
    t0 = time.monotonic()
    before = S.max_rss_mb()
    hostile.COUNTS.clear()
    hostile.UNTYPED.clear()
    hostile.fuzz_manifests(n_manifests)
    hostile.fuzz_safetensors(n_headers)
    hostile.fuzz_streams(n_streams)
    stats.trials = sum(v for k, v in hostile.COUNTS.items() if k.endswith(" cases"))
    stats.faults = stats.trials - sum(v for k, v in hostile.COUNTS.items() if k.endswith(" accepted"))
    stats.untyped = len(hostile.UNTYPED)
    stats.problems += hostile.UNTYPED
    grown = S.max_rss_mb() - before
    if grown > 256:
        stats.problem("all", f"peak RSS grew by {grown:.0f} MB")
    for k, v in hostile.COUNTS.items():
        if not k.endswith(" cases"):
            stats.note(k, v)
    stats.note("peak RSS growth MB", int(grown))
    stats.seconds = time.monotonic() - t0
    return stats


if __name__ == "__main__":
    sys.exit(main())
