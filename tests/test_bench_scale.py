"""bench/scale.py at its smallest size (--quick): it completes and reports every figure.

Correctness only: no timing is asserted (speed lives in the benchmark itself).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import ROOT, TRACES, _trace_module

RUNS = {"cold-lr1e-6": "cold", "dither-lr1e-5": "dither"}
PER_RUN = ["publish_sync", "publish_background", "pull", "download_vs_bound", "publisher_rss_sync",
           "publisher_rss_background", "publisher_rss_anchor_peak", "subscriber_rss_steady",
           "subscriber_rss_anchor_peak"]
GLOBAL = ["many_delta_publish", "many_delta_pull", "many_anchor_publish", "many_anchor_pull", "dense_encode_gbps",
          "dense_decode_gbps", "dense_size_pct"]
CODECS = ["auto", "ulp", "zstd", "raw"]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_scale_quick_reports_every_figure(tmp_path):
    _trace_module()  # skips without the trace locally; fails under CI=true
    out = tmp_path / "scale.json"
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--json", str(out), "--workdir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "## Targets" in proc.stdout and "PROJECTION (not measured)" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    assert doc["config"]["quick"] is True and doc["config"]["runs"] == list(RUNS)
    figures = doc["figures"]
    want = [f"{k}.{r}" for r in RUNS.values() for k in PER_RUN] + GLOBAL
    assert set(want) <= set(figures), sorted(set(want) - set(figures))
    for key in want:
        f = figures[key]
        assert _finite(f["value"]), (key, f["value"])
        # extra RSS can legitimately be ~0; everything else (ratios, throughput, sizes) is positive
        assert f["value"] >= 0 if "rss" in key else f["value"] > 0, (key, f["value"])
        assert _finite(f["target"]) and f["target"] > 0 and f["op"] in ("<=", ">=")
        assert isinstance(f["met"], bool)
        assert f["label"] and f"| {f['label']} |" in proc.stdout  # printed next to its target
        if f.get("cpu") is not None:
            assert _finite(f["cpu"]) and f["cpu"] > 0, key
        if f.get("spread"):
            lo, hi = f["spread"]
            assert _finite(lo) and _finite(hi) and 0 < lo <= hi, key
    assert 30 < figures["dense_size_pct"]["value"] < 100  # a compressed anchor, never bigger than raw
    for r in RUNS.values():  # what the steady publisher figure is made of (informational)
        assert _finite(figures[f"publisher_rss_sync.{r}"]["drift_tracker"])
        every = doc["rss"][f"publisher_sync_every10.{r}"]
        assert _finite(every["steady"]) and _finite(every["trimmed"])
    assert doc["runtime"]["publish"] > 0 and "fixed runtime memory" in proc.stdout
    fresh = doc["fresh_memory"]  # what page faults cost here, the key to the kernel-time lines
    for kind in ("small", "huge"):
        assert all(_finite(v) and v > 0 for k, v in fresh[kind].items() if not k.endswith("sys_s_per_gib")), fresh
    assert fresh["reports_free_pages"] in (True, False, None) and "what fresh memory costs" in proc.stdout
    for r in RUNS.values():  # the steady subscriber figure, split: anonymous memory within it
        for key in (f"subscriber_rss_steady.{r}", f"publisher_rss_sync.{r}", f"publisher_rss_background.{r}"):
            assert _finite(figures[key]["anonymous"]) and figures[key]["anonymous"] <= figures[key]["value"] + 0.01
    for r in RUNS.values():  # the replicated runs keep their densities (~0.2 % and ~2 %)
        assert 0 < doc["densities"][r] < 0.1
    assert doc["densities"]["cold"] < doc["densities"]["dither"]

    for codec in CODECS:
        for r in RUNS.values():
            row = doc["throughput"][f"{codec}.{r}"]
            for k in ("publish_mbps_core", "pull_mbps_core", "publish_mbps", "pull_mbps", "bytes_per_changed",
                      "download_per_changed"):
                assert _finite(row[k]) and row[k] > 0, (codec, r, k, row.get(k))
    for what in ("publish", "pull", "compare", "dense copy"):
        for r in RUNS.values():
            for model in ("7B", "70B"):
                p = doc["projection"][f"{what}.{r}.{model}"]
                assert _finite(p["cpu_s"]) and p["cpu_s"] > 0 and _finite(p["wall_s_16_cores"]), (what, r, model)


def test_kernels_bench_runs_and_checks_its_bits():
    _trace_module()
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "kernels.py", "--size", "0.02", "--repeat", "1"], cwd=ROOT / "bench",
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "changed elements" not in line]
    assert [r.split("|")[1].strip() for r in rows] == list(RUNS)
    assert all(r.rstrip().endswith("| exact |") for r in rows), rows


def test_pull_stages_times_every_stage(tmp_path):
    """bench/pull_stages.py at a tiny size: bit-exact pulls, and every stage it names still exists and runs."""
    _trace_module()
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pull_stages.py"), "--size", "0.01", "--steps", "3",
         "--store", str(tmp_path / "store")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "not found" not in proc.stdout, proc.stdout  # a renamed stage must be renamed here too
    rows = dict(line.strip("|").split("|")[:2] for line in proc.stdout.splitlines() if line.startswith("| `"))
    timed = {k.strip().strip("`"): float(v) for k, v in rows.items()}
    for stage in ("Manifest.from_json", "UlpCodec.decode_batch", "StepsInPlace.run"):
        assert timed.get(stage, 0) > 0, (stage, timed)
    assert "_expect_sums" in timed, timed  # called (a row only for a stage that ran): under 0.05 ms at this size


def test_publish_stages_times_every_stage():
    """bench/publish_stages.py at a tiny size: every stage it names still exists, and the main ones ran."""
    _trace_module()
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "publish_stages.py"), "--size", "0.01", "--steps", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "not found" not in proc.stdout, proc.stdout  # a renamed stage must be renamed here too
    timed = {line.split("|")[1].strip().strip("`") for line in proc.stdout.splitlines() if line.startswith("| `")}
    assert {"Publisher._publish", "Mirror.diff", "write_version"} <= timed, timed


def test_pull_floor_runs_bit_exact(tmp_path):
    """bench/pull_floor.py at a tiny size: its fused floor kernels write the same bits as the library's pull
    (the bench checks every row against the model and exits 1 otherwise), and it prints all three rows."""
    _trace_module()
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pull_floor.py"), "--size", "0.01", "--steps", "3", "--repeat", "1",
         "--store", str(tmp_path / "store")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["library pull", "floor: decompress + fused apply", "floor + checksum in the same pass"], rows


def test_drift_bench_runs_bit_exact(tmp_path):
    """bench/drift.py at a tiny size: it times every step's drift count and merge and ends bit-exact."""
    _trace_module()
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "drift.py"), "--size", "0.01", "--steps", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2", "3"] and "bit-exact" in proc.stdout.splitlines()


def test_scale_quick_runs_on_the_bert_trace(tmp_path):
    """``--trace minilm-l6`` (bench/traces/): scale.py takes that trace's runs and reports their publish and pull
    figures under the same keys (``cold`` / ``dither``) as for the shared trace."""
    _trace_module()
    out = tmp_path / "scale.json"
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES)}
    env.pop("DELTASTORE_TRACE", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--trace", "minilm-l6", "--skip", "background",
         "memory", "codecs", "many", "dense", "--json", str(out), "--workdir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert doc["errors"] == [] and doc["config"]["trace"] == "minilm-l6"
    assert doc["config"]["runs"] == ["cold-lr1e-6", "dither-lr5e-6"]
    for r in ("cold", "dither"):
        for key in ("publish_sync", "pull", "download_vs_bound"):
            assert _finite(doc["figures"][f"{key}.{r}"]["value"]) and doc["figures"][f"{key}.{r}"]["value"] > 0
    assert 0 < doc["densities"]["cold"] < doc["densities"]["dither"] < 0.1
