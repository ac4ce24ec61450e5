"""A real vLLM engine (CPU build) follows a store and serves exactly what a fresh load serves.

The engine runs in the separate vLLM virtualenv (``tests/test_vllm/setup_venv.sh``
creates ``.venv-vllm``), in a subprocess running ``engine_check.py``, so this
pytest process needs no vLLM. Skipped when that virtualenv is missing, except
under ``make test`` / CI (``DELTASTORE_STRICT=1`` or ``CI=true``), which installs
it: there a missing engine is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def vllm_python() -> str:
    """The vLLM virtualenv's python (``DELTASTORE_VLLM_PYTHON`` overrides); skip or fail without it."""
    py = os.environ.get("DELTASTORE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    ok = Path(py).exists() and subprocess.run([py, "-c", "import vllm, deltastore"], capture_output=True,
                                              timeout=300).returncode == 0
    require(ok, f"no vLLM virtualenv at {py} (run tests/test_vllm/setup_venv.sh)")
    return py


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM process: this checkout importable, and AMX state granted
    (``amx_permission/sitecustomize.py`` says why)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE / "amx_permission")]),
                VLLM_CPU_KVCACHE_SPACE="1", **extra)


def run_check(script: str, work: Path) -> dict:
    """Run a check script in the vLLM virtualenv, in its own session (killed afterwards)."""
    py = vllm_python()
    env = vllm_env()
    proc = subprocess.Popen([py, str(HERE / script), str(work)], cwd=str(ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        out = ""
        pytest.fail(f"{script} ran over 15 minutes")
    finally:
        try:  # the engine's worker processes live in the same session: never leave them behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    res_path = work / "result.json"
    result = json.loads(res_path.read_text()) if res_path.exists() else {}
    if proc.returncode != 0 or not result.get("ok"):
        tail = "\n".join(line for line in out.splitlines() if "DEBUG" not in line)[-6000:]
        pytest.fail(f"{script} failed (exit {proc.returncode}):\n{result.get('error', '')}\n{tail}")
    return result


@pytest.mark.slow
def test_engine_follows_store_bit_exactly(tmp_path):
    result = run_check("engine_check.py", tmp_path)
    checks = result["checks"]
    assert checks["identical_to_fresh_engine"]            # greedy token ids and logprobs, exact
    assert checks["anchor_route_matches_followed_step3"]
    assert checks["outputs_changed_v0_to_v10"]
    assert checks["outputs_unchanged_after_refusals"]
    assert [p["route"] for p in checks["pulls"]] == ["delta"] * 6  # steps 1, 2, 3, then 4-6 at once, 7, 8
    assert checks["corrupt_object"].startswith("CorruptObjectError")
    assert checks["foreign_chain"].startswith("ParentMismatchError")
    assert checks["wrong_declared_base"].startswith("ChecksumMismatchError")
    assert checks["weight_transfer_step9"]["version"]["step"] == 9
    assert checks["follower_step10"]["status"]["served_step"] == 10
    # engine B: first call through the weight-transfer backend (its own reload path), then vLLM's native loader
    assert checks["anchor_route_step3"]["step"] == 3 and checks["anchor_route_step3"]["path"] == "reload"
    native = checks["native"]
    assert native["nan_lands"] and native["pull_1"]["path"] == "native" and native["pull_2"]["path"] == "native"
    assert native["outputs_changed_by_native"]
    assert native["native_refused_for_linears"].startswith("TargetMismatchError")
    assert native["fallback_3"]["path"] == "reload" and native["fallback_3"]["route"] == "delta"
    print(json.dumps(result["timings"]), file=sys.stderr)


@pytest.mark.slow  # not long, but it needs the vLLM venv, which only `make test` builds
def test_vllm_venv_keeps_vllms_pins():
    """deltastore was installed beside vLLM without moving a version vLLM pins (numba, torch, ...)."""
    proc = subprocess.run([vllm_python(), str(HERE / "check_pins.py")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout


@pytest.mark.slow
def test_tensor_parallel_engine_follows_store_bit_exactly(tmp_path):
    """TP=2 (one core per rank): followed version by version on both ranks, a corrupt version refused with
    both ranks' bits unchanged, and the same token ids and logprobs as a fresh TP=2 engine."""
    result = run_check("tp_check.py", tmp_path)
    checks = result["checks"]
    assert checks["ranks"] == 2 and checks["embed_shapes"] == [[256, 128], [256, 128]]
    assert [f["ranks"] for f in checks["followed"]] == [[s, s] for s in range(1, 7)]
    assert all(f["verified"] and f["route"] == "delta" for f in checks["followed"])
    assert checks["outputs_changed_v0_to_v6"]
    assert checks["corrupt_refused"].startswith("CorruptObjectError")
    assert checks["ranks_after_refusal"] == [6, 6] and checks["rank_bits_unchanged_after_refusal"] == [True, True]
    assert checks["verify_after_refusal"] and checks["outputs_unchanged_after_refusal"]
    assert checks["identical_to_fresh_engine"] and checks["fresh_rank_digests_equal_followed"]
    print(json.dumps(result["timings"]), file=sys.stderr)


@pytest.mark.slow
def test_vllm_serve_follows_store_over_http(tmp_path):
    result = run_check("serve_check.py", tmp_path)
    checks = result["checks"]
    assert checks["first_sync_anchor"]["route"] == "anchor"
    assert checks["weight_info_4"] == "4" and checks["status_file"]
    assert checks["weight_transfer_6"]["served"]["step"] == 6
    assert checks["max_lag_waits"] and checks["max_lag_applies_8"]["versions_applied"] == [7, 8]
    assert checks["verify_8"]["ok"]
    assert checks["completion_changed_0_to_8"]                 # the pulls reached the served weights
    assert checks["corrupt_refused"].startswith("CorruptObjectError")
    assert checks["completion_unchanged_after_refusal"]         # token ids and logprobs, exact
    assert checks["completion_after_refusal"] == checks["completion_8"]
    assert checks["verify_after_refusal"]["ok"] and checks["verify_after_refusal"]["step"] == 8
    follow = checks["in_server_follower"]   # --middleware FollowStore, no VLLM_SERVER_DEV_MODE
    assert follow["dev_routes_absent"] and follow["completion_equals_first_server_at_8"]
    assert follow["step0"]["route"] == "anchor" and follow["step1"]["route"] == "delta"
    assert follow["step0"]["verify"]["ok"] and follow["step1"]["verify"]["ok"]
    assert follow["served_after_corrupt"] == 1 and follow["completion_unchanged_after_corrupt"]
    assert follow["refusal_logged"]                             # in the server's log, not lost
