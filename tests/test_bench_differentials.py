"""bench/differentials.py: both publishers see the same versions, the copy's reads nothing back, both stores
pull bit-exact (the script exits non-zero otherwise). Correctness only: no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, TRACES, _trace_module


def test_differentials_bench_runs_both_configs_on_the_same_versions(tmp_path):
    _trace_module()  # skips without the shared loader locally; fails under CI=true
    out = tmp_path / "d.json"
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "differentials.py"), "--trace", "minilm-l6", "--runs", "dither-lr5e-6",
         "--size", "0.03", "--steps", "12", "--json", str(out), "--workdir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (res,) = json.loads(out.read_text()).values()
    plain, copied = res["rows"]["from the store"], res["rows"]["anchor copy"]
    assert [r["kind"] for r in plain] == [r["kind"] for r in copied]
    assert sum(r["kind"] == "differential" for r in plain) >= 1
    assert all(r["read"] > 0 for r in plain if r["kind"] == "differential")  # the anchor streamed back
    assert all(r["read"] == 0 for r in copied) and not any(r["warnings"] for r in copied)
    assert "every version, mean" in proc.stdout
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bench-diff")]  # stores and copy removed
