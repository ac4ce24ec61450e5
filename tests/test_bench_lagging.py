"""bench/lagging.py runs end to end on the test model's own sizes and prints a row per follower and density
(correctness only: every final state is checked bit-exact inside the benchmark; no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_lagging_bench_prints_both_followers_bit_exact():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "lagging.py"), "--tiny", "--repeat", "1",
                        "--deltas", "2", "--density", "0.05"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 5.0% |")]
    assert len(rows) == 2 and "Subscriber.pull" in rows[0] and "vLLM applier" in rows[1], r.stdout
