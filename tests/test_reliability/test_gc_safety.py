"""GC never loses a committed version: every interleaving of a publish that reuses objects with a GC pass
(tests/test_reliability/gc_interleavings.py), staged deterministically with pause hooks, on local disk and
on the SeaweedFS S3 server. The protocol is in docs/format.md ("Garbage collection and concurrent
publishers")."""

from __future__ import annotations

from .gc_interleavings import age, prepare, run_check_gc_touch, run_control, run_stat_touch_delete, run_touch_gc_commit


def test_gc_never_loses_a_committed_version(where):
    names = ("control", "check-gc-touch", "touch-gc-commit", "stat-touch-delete")
    cases = {n: prepare(where, n) for n in names}
    age(where, list(cases.values()))
    run_control(cases["control"])
    run_check_gc_touch(cases["check-gc-touch"])
    # the GC machine's clock plays no part (local disk, where the test can move the process clock)
    run_touch_gc_commit(cases["touch-gc-commit"], skews=(3600.0, -3600.0) if where.kind == "local" else ())
    run_stat_touch_delete(cases["stat-touch-delete"])
