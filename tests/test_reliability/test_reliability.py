"""Reliability: no wrong weights, no lost versions, typed errors only, under injected faults.

The scenarios live in :mod:`.scenarios` (shared with ``bench/faults.py``, which runs more
trials and prints the figures of ``docs/reliability.md``). Each runs on the local backend and
on SeaweedFS's S3 API (``where`` fixture).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deltastore.backends.local import LocalBackend
from deltastore.errors import KeyExistsError
from deltastore.testing.faults import Fault, FaultyBackend, RetryingBackend

from . import hostile
from .scenarios import (run_apply_interrupted, run_corruption, run_crash, run_races,
                        run_transient_local, run_transient_s3)


def _ok(stats):
    assert stats.trials > 0
    assert (stats.wrong, stats.lost, stats.untyped) == (0, 0, 0), stats.problems[:5]
    assert stats.problems == [], "\n".join(stats.problems[:5])


# -- the wrapper itself ---------------------------------------------------------------------------
def test_faulty_backend_is_seeded_and_counts(tmp_path):
    def run(seed):
        fb = FaultyBackend(LocalBackend(tmp_path / str(seed)), seed=seed, keep_log=True, rules=[
            Fault("transient", ops="get", rate=0.5), Fault("corrupt", ops="get", prefix="objects/", rate=0.5)])
        fb.inner.put("objects/a", b"x" * 100)
        out = []
        for _ in range(50):
            try:
                out.append(fb.get("objects/a"))
            except (ConnectionError, TimeoutError) as e:
                out.append(type(e).__name__)
        return out, fb

    a, fa = run(3)
    b, _ = run(3)
    assert a == b and fa.injected["transient"] > 5 and fa.injected["corrupt"] > 5
    assert fa.calls["get"] == 50 and len(fa.log) == fa.total_injected
    assert any(isinstance(x, bytes) and x != b"x" * 100 for x in a)


def test_partial_drop_permanent_and_retrying(tmp_path):
    inner = LocalBackend(tmp_path)
    fb = FaultyBackend(inner, rules=[Fault("partial", ops="put", prefix="p/", limit=1),
                                     Fault("drop", ops="put", prefix="d/", limit=1),
                                     Fault("permanent", ops="get", prefix="x/")])
    with pytest.raises(ConnectionError):
        fb.put("p/k", b"0123456789")
    assert len(inner.get("p/k")) < 10  # a truncated value landed
    with pytest.raises(ConnectionError):
        fb.put("d/k", b"v", mode="create")
    assert inner.get("d/k") == b"v"  # the write landed, its answer was lost
    inner.put("x/k", b"v")
    with pytest.raises(PermissionError):
        fb.get("x/k")
    # the retrying wrapper: a create whose first answer was dropped is its own write, a real conflict is not
    fb2 = FaultyBackend(inner, rules=[Fault("drop", ops="put", limit=1)])
    rb = RetryingBackend(fb2, {"attempts": 3, "base_delay": 0.001})
    rb.put("versions/1", b"mine", mode="create")
    assert rb.retries == 1 and inner.get("versions/1") == b"mine"
    with pytest.raises(KeyExistsError):
        rb.put("versions/1", b"other", mode="create")
    with pytest.raises(PermissionError):  # permanent errors are not retried
        RetryingBackend(fb, 5).get("x/k")
    with pytest.raises(ValueError):
        Fault("nonsense")


# -- scenarios, local and S3 ---------------------------------------------------------------------------
@pytest.mark.slow
def test_crash_sigkill_during_publish(where):
    stats = run_crash(where, trials=10, seed=11)
    _ok(stats)
    assert stats.faults >= 4  # most children were really killed mid-way


def test_corruption_is_detected_never_applied(where):
    stats = run_corruption(where, trials=30 if where.kind == "local" else 16, seed=12)
    _ok(stats)


def test_transient_faults_complete_bit_exact(where, request):
    if where.kind == "local":
        stats = run_transient_local(where, cycles=25, seed=13)
    else:
        stats = run_transient_s3(where, request.getfixturevalue("seaweed_server"), cycles=15, seed=13)
    _ok(stats)
    assert stats.faults > 0
    assert max(stats.recovery) < 60  # bounded: no cycle waits out a long deadline


def test_concurrent_publishers_one_winner(where):
    stats = run_races(where, races=8 if where.kind == "local" else 5, seed=14)
    _ok(stats)
    assert stats.trials == (8 if where.kind == "local" else 5)


def test_apply_interrupted_restores_the_target():
    stats = run_apply_interrupted(trials=60, seed=15)
    _ok(stats)
    assert stats.notes.get("restored", 0) >= 10


# -- hostile input -------------------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parents[1]
MAX_GROWTH_MB = 256


def _memcheck(*args: str) -> dict:
    """Run ``memcheck.py`` in a fresh interpreter (its own memory peak); its JSON result."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, "-m", "test_reliability.memcheck", *args], cwd=str(TESTS), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"memcheck {args} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fuzz, n", [("manifests", 500), ("safetensors", 300), ("streams", 400)])
def test_hostile_input_typed_errors_only(fuzz, n):
    """Each fuzz run in its own interpreter; every case's own memory peak stays small."""
    r = _memcheck("fuzz", fuzz, str(n))
    assert r["cases"] >= n // 2, r["counts"]  # the fuzz really ran
    assert r["untyped"] == []
    assert r["max_growth_mb"] < MAX_GROWTH_MB, f"a hostile case allocated too much memory: {r['worst']}"


def test_zstd_bombs_are_refused_without_inflating():
    """A 1 GiB zstd frame (size declared or not) in each place a codec keeps one: refused with a typed error,
    each case in its own interpreter (two at a time), without inflating."""
    cases = [(c, f, d) for c, f in hostile.BOMB_CASES for d in ("1", "0")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda case: _memcheck("bomb", *case), cases))
    assert len(results) == 2 * len(hostile.BOMB_CASES) == 10
    untyped = [r for r in results if not r["typed"]]
    assert not untyped, untyped
    inflated = [r for r in results if r["growth_mb"] >= MAX_GROWTH_MB]
    assert not inflated, f"bombs were inflated: {inflated}"
