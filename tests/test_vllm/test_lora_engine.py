"""A real vLLM CPU engine with ``enable_lora`` follows adapter versions published from real PEFT training.

The training and publishing run here (PEFT lives in the main environment); the
engine runs ``lora_check.py`` in the vLLM virtualenv (see ``test_engine.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import require_module

from .test_engine import run_check

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from peft_tiny import base_model, lora_model, train  # noqa: E402

STEPS = 3


@pytest.mark.slow
def test_engine_serves_newest_adapter_like_a_fresh_engine(tmp_path):
    require_module("peft")
    import deltastore as ds

    base = base_model()
    base.save_pretrained(tmp_path / "base")
    model = lora_model(base)
    with ds.Publisher(str(tmp_path / "store"), adapter_only=True) as pub:
        pub.publish(model, step=0)
        for k in train(model, STEPS):
            pub.publish(model, step=k)
    model.save_pretrained(tmp_path / "trainer_adapter")
    (tmp_path / "params.json").write_text(json.dumps({"steps": STEPS}))

    checks = run_check("lora_check.py", tmp_path)["checks"]
    assert checks["identical_to_fresh_engine"]           # greedy token ids and logprobs, exact
    assert checks["base_differs"] and checks["previous_version_still_served"]
    assert [x["steps"] for x in checks["loaded_after_each"]] == [[1], [1, 2], [2, 3]]
    assert [len(x["engine_ids"]) for x in checks["loaded_after_each"]] == [1, 2, 2]  # older ones unloaded
    assert checks["loaded_after_each"][-1]["folders"] == ["policy-000000000002", "policy-000000000003"]
    assert checks["poll_after_newest"] is None
    assert checks["served"]["served_name"] == f"policy@{STEPS}"
    assert checks["http_follower_identical_to_fresh"]    # over /v1/load_lora_adapter
    assert checks["server_models"][-3:] == ["fresh", f"policy@{STEPS - 1}", f"policy@{STEPS}"]  # older unloaded
    assert checks["alias_identical_to_fresh"]            # HTTPLoraControl(alias=True): the bare name
