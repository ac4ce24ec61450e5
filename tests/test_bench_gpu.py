"""bench/gpu.py (issue 16's device run) on the CPU at a tiny size: it completes and reports every figure.

Correctness only: no timing is asserted. The script checks its own results bit-exactly and exits 1 on
any mismatch; here it must exit 0 with every figure of the device run present, finite and positive, and
the device-memory figures (CUDA only) listed as skipped with a reason.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import ROOT, TRACES, _trace_module

RUNS = ("cold", "dither")
PER_RUN = ["compare_s", "publish_sync_vs_compare", "publish_background_vs_compare", "publish_sync_s",
           "publish_background_total_s", "publish_model_gbps", "publisher_rss_vs_model", "subscriber_rss_vs_model",
           "pull_s", "pull_vs_dense_copy", "dense_copy_s", "pull_vs_checkpoint_load", "anchor_publish_s",
           "anchor_pull_s"]
CODEC_PER_RUN = [f"codec_{c}_{w}_{k}" for c in ("auto", "ulp") for w in ("encode", "decode")
                 for k in ("gbps", "vs_device_copy")]
GLOBAL = ["copy_gbps_device", "copy_gbps_host", "checkpoint_load_s", "checkpoint_load_warm_s",
          "vllm_tp1_versions_exact", "vllm_tp1_pull_s", "vllm_tp1_pull_vs_dense_copy",
          "vllm_tp2_versions_exact", "vllm_tp2_pull_s", "vllm_tp2_pull_vs_dense_copy"] + [
    f"codec_dense_{w}_{k}" for w in ("encode", "decode") for k in ("gbps", "vs_device_copy", "vs_host_copy")]
DEVICE_ONLY = ["publisher_device_mem_vs_model", "publisher_bg_device_mem_vs_model", "subscriber_device_mem_vs_model"]


def test_gpu_bench_cpu_smoke_reports_every_figure(tmp_path):
    _trace_module()  # skips without the trace locally; fails under CI=true
    out = tmp_path / "gpu.json"
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--size", "0.05", "--json", str(out),
         "--workdir", str(tmp_path), "--profile", "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "RESULT ok" in proc.stdout and "CPU SMOKE TEST" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["errors"] == []
    assert all(p["ok"] for p in doc["phases"].values()), doc["phases"]
    assert doc["config"]["device"] == "cpu"
    figures = doc["figures"]
    want = GLOBAL + [f"{k}.{r}" for r in RUNS for k in PER_RUN + CODEC_PER_RUN]
    assert set(want) <= set(figures), sorted(set(want) - set(figures))
    for key in want:
        f = figures[key]
        v = f["value"]
        assert isinstance(v, (int, float)) and math.isfinite(v), (key, v)
        # extra resident memory can legitimately round to ~0; everything else is a positive time, rate or ratio
        assert v >= 0 if "rss" in key else v > 0, (key, v)
        assert f["label"] and f"| {f['label']} |" in proc.stdout  # printed in the table
    for r in RUNS:  # --profile: one more step per run, profiled, and still bit-exact (checked in the script)
        assert "publisher.py" in doc["raw"]["runs"][r]["profile"]["publish"]
        assert "subscriber.py" in doc["raw"]["runs"][r]["profile"]["pull"]
    assert figures["vllm_tp1_versions_exact"]["value"] == 10 and figures["vllm_tp2_versions_exact"]["value"] == 10
    # no device memory on cpu: skipped, with the reason, never a made-up number
    for r in RUNS:
        for k in DEVICE_ONLY:
            assert f"{k}.{r}" not in figures and "cpu" in doc["skipped"][f"{k}.{r}"]
    # the replicated runs keep their densities (~0.2 % and ~2 %), and every run measured a delta step
    runs = doc["raw"]["runs"]
    assert 0 < runs["cold"]["density"] < runs["dither"]["density"] < 0.1
    for r in RUNS:
        assert runs[r]["steps"] and all(s["changed"] > 0 for s in runs[r]["steps"])
