"""LoRA adapter sync: ``Publisher(adapter_only=True)`` with a real PEFT LoRA trained by real optimizer steps.

Every version is materialised and loaded back with ``PeftModel.from_pretrained``:
the adapter tensors and the logits must be bit-identical (integer views) to the
trainer's model at that step.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import deltastore as ds
from conftest import require_module
from deltastore.testing import bits_equal
from deltastore.errors import TargetMismatchError
from deltastore.pull.materialize import materialize
from peft_tiny import base_model, logits, lora_model, train

peft = require_module("peft")
require_module("transformers")

STEPS = 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store with versions 0..STEPS of the adapter, the base folder, and what the trainer had at each step."""
    work = tmp_path_factory.mktemp("lora")
    base = base_model()
    base.save_pretrained(work / "base")
    model = lora_model(base)
    uri = str(work / "store")
    want, infos = {}, []
    with ds.Publisher(uri, adapter_only=True) as pub:
        infos.append(pub.publish(model, step=0))
        want[0] = ({k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()}, logits(model))
        for k in train(model, STEPS):
            infos.append(pub.publish(model, step=k))
            want[k] = ({k2: v.clone() for k2, v in peft.get_peft_model_state_dict(model).items()}, logits(model))
    model.save_pretrained(work / "trainer_adapter")  # what save_pretrained writes at the last step
    return work, uri, want, infos


def test_every_version_loads_in_peft_bit_identically(trained):
    work, uri, want, infos = trained
    store = ds.open_store(uri)
    assert all(i.changed > 0 for i in infos[1:])  # real steps move the adapter (AdamW: nearly every element)
    for step, (tensors, trainer_logits) in want.items():
        out = work / f"v{step}"
        written = materialize(store, step, out)
        assert sorted(written) == ["adapter_config.json", "adapter_model.safetensors"]
        base = type(base_model()).from_pretrained(work / "base").eval()
        loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
        assert bits_equal(peft.get_peft_model_state_dict(loaded), tensors), step
        got = logits(loaded)
        assert torch.equal(_bits(got), _bits(trainer_logits)), step
    # the recorded config is the one save_pretrained writes, and the tensor names are PEFT's
    assert (work / f"v{STEPS}" / "adapter_config.json").read_bytes() == \
        (work / "trainer_adapter" / "adapter_config.json").read_bytes()
    from safetensors.torch import load_file

    assert bits_equal(load_file(str(work / f"v{STEPS}" / "adapter_model.safetensors")),
                      load_file(str(work / "trainer_adapter" / "adapter_model.safetensors")))
    assert json.loads((work / "v0" / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_untrained_version_differs_from_trained(trained):
    _, _, want, _ = trained
    assert not torch.equal(_bits(want[0][1]), _bits(want[STEPS][1]))  # the check above can fail


def test_non_peft_model_is_a_typed_error(tmp_path):
    with ds.Publisher(str(tmp_path / "s"), adapter_only=True) as pub:
        with pytest.raises(TargetMismatchError, match="PEFT"):
            pub.publish(base_model(), step=0)
        with pytest.raises(TargetMismatchError, match="PEFT"):
            pub.publish({"w": torch.zeros(2)}, step=0)
    assert ds.open_store(str(tmp_path / "s")).latest() is None


class _Control:
    """Records what a LoraFollower asks of the engine (the real engine: tests/test_vllm/test_lora_engine.py)."""

    def __init__(self, fail_on: str | None = None):
        self.loaded: dict[str, str] = {}
        self.fail_on = fail_on

    def load(self, name, path):
        assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
        if name == self.fail_on:
            raise ds.errors.ApplyError(f"engine refused {name}")
        self.loaded[name] = path
        return name

    def unload(self, handle):
        del self.loaded[handle]


def test_follower_keeps_the_newest_k_and_its_folders(trained, tmp_path):
    from deltastore.integrations.vllm_lora import LoraFollower

    _, uri, _, _ = trained
    control = _Control(fail_on=f"policy@{STEPS}")
    f = LoraFollower(control, uri, tmp_path / "adapters", keep=2)
    for step in range(STEPS):
        f.apply(step)
    assert sorted(control.loaded) == [f"policy@{STEPS - 2}", f"policy@{STEPS - 1}"]
    assert sorted(os.listdir(tmp_path / "adapters")) == [f"policy-{s:012d}" for s in (STEPS - 2, STEPS - 1)]
    with pytest.raises(ds.errors.ApplyError):  # the engine refuses the newest: it keeps what it had
        f.poll_once()
    assert f.served_step == STEPS - 1 and f.status()["last_error"].startswith("ApplyError")
    assert sorted(os.listdir(tmp_path / "adapters")) == [f"policy-{s:012d}" for s in (STEPS - 2, STEPS - 1)]
    control.fail_on = None
    assert f.poll_once()["served_name"] == f"policy@{STEPS}" and f.poll_once() is None


def test_follower_refuses_a_store_of_whole_models(tmp_path):
    from deltastore.integrations.vllm_lora import LoraFollower

    uri = str(tmp_path / "s")
    with ds.Publisher(uri) as pub:
        pub.publish({"w": torch.zeros(4)}, step=0)
    f = LoraFollower(_Control(), uri, tmp_path / "a")
    with pytest.raises(TargetMismatchError, match="not a PEFT adapter"):
        f.poll_once()
    assert f.served_step is None and os.listdir(tmp_path / "a") == []


def test_cli_materialize_writes_the_adapter_folder(trained, tmp_path):
    from deltastore.cli import main

    _, uri, want, _ = trained
    assert main(["materialize", uri, "2", str(tmp_path / "out")]) == 0
    from safetensors.torch import load_file

    assert bits_equal(load_file(str(tmp_path / "out" / "adapter_model.safetensors")), want[2][0])


def test_trl_callback_publishes_the_adapter_of_a_peft_trainer(tmp_path):
    """``DeltaStoreCallback(uri, adapter_only=True)`` on a real ``transformers.Trainer`` training a PEFT model."""
    transformers = require_module("transformers")
    require_module("accelerate")
    from deltastore.integrations.trl import DeltaStoreCallback

    class Snap(transformers.TrainerCallback):
        def __init__(self):
            self.states = {}

        def on_step_end(self, args, state, control, model=None, **kw):
            self.states[state.global_step] = {k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()}

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 512, (16, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}

    uri = str(tmp_path / "s")
    model, snap = lora_model(base_model()), Snap()
    cb = DeltaStoreCallback(uri, adapter_only=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[snap, cb]).train()
    sub = ds.Subscriber(uri)
    steps = [s for s in sub.versions() if s in snap.states]
    assert steps == [1, 2, 3]
    for s in steps:
        # the callback publishes bf16 by default: the adapter's fp32 parameters rounded
        assert bits_equal(sub.pull(step=s).state, {k: v.to(torch.bfloat16) for k, v in snap.states[s].items()}), s
        assert "adapter_config.json" in sub.manifest(s).files


def test_recorded_config_lists_sets_in_the_order_peft_writes_them(tmp_path):
    """PEFT writes a set field as list(deepcopy(live set)); a set copied twice may iterate in another order."""
    import copy
    import random
    import string

    from deltastore.adapters import _config_bytes

    rng = random.Random(0)
    for _ in range(2000):  # a target_modules set whose second copy iterates differently (about 1 in 5 do)
        names = {"".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) + "_proj"
                 for _ in range(rng.randint(3, 9))}
        live = peft.LoraConfig(r=4, target_modules=names, base_model_name_or_path="base", task_type="CAUSAL_LM")
        s = live.target_modules
        if list(copy.deepcopy(s)) != list(copy.deepcopy(copy.deepcopy(s))):
            break
    else:
        pytest.fail("no set found whose copies iterate differently")
    ours = _config_bytes(None, live)
    live.inference_mode = True  # what PeftModel.save_pretrained does to the live config before saving it
    live.save_pretrained(str(tmp_path))
    assert ours == (tmp_path / "adapter_config.json").read_bytes()
