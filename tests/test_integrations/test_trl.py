"""DeltaStoreCallback with a real tiny ``transformers`` model and a real ``transformers.Trainer``.

The model (Llama architecture, hidden 64, 2 layers, vocab 128) is built
in-process with random weights: no downloads. A second callback, after ours,
snapshots the bf16 weights at every optimizer step; a Subscriber then pulls
every version into a bf16 replica that starts from the *initial* weights (so a
pull that does nothing cannot pass), and the two are compared through integer
views. transformers, accelerate, trl and datasets are installed by ``make test``
(requirements-test.txt): under ``DELTASTORE_STRICT=1`` a broken install fails.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import require_module
from deltastore.testing import bits_equal

transformers = require_module("transformers")
require_module("accelerate")

import deltastore as ds  # noqa: E402
from deltastore.integrations.trl import DeltaStoreCallback, unwrap_model  # noqa: E402
from deltastore.tensors import named_tensors  # noqa: E402

VOCAB, SEQ = 128, 16


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class Snapshots(transformers.TrainerCallback):
    """Records the bf16 bits of the model after every optimizer step, and counts micro-steps."""

    def __init__(self):
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.substeps = 0

    def on_step_end(self, args, state, control, model=None, **kw):
        self.states[state.global_step] = {n: t.detach().to(torch.bfloat16).clone()
                                          for n, t in named_tensors(model).items()}

    def on_substep_end(self, args, state, control, **kw):
        self.substeps += 1


def train(tmp_path, callback, steps: int = 4, accum: int = 2, lr: float = 1e-3, model=None, **extra):
    model = model if model is not None else tiny_llama()
    snaps = Snapshots()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=accum, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, run_name="tiny-grpo", seed=0, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(),
                                   callbacks=[callback, snaps])
    trainer.train()
    return model, snaps


def _bf16_bits(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named_tensors(module).items()}


def test_publishes_once_per_optimizer_step_bit_exact(tmp_path):
    uri = str(tmp_path / "store")
    cb = DeltaStoreCallback(uri, anchor_every=3, metadata={"experiment": "t"})
    initial = tiny_llama()
    model, snaps = train(tmp_path, cb, steps=5, accum=2, model=copy.deepcopy(initial))

    assert snaps.substeps == 5  # one non-final micro-step per optimizer step: accumulation really happened
    assert sorted(snaps.states) == [1, 2, 3, 4, 5]
    assert cb.published == [1, 2, 3, 4, 5]
    assert cb.publisher is None  # closed by on_train_end
    sub = ds.Subscriber(uri)
    assert sub.versions() == [1, 2, 3, 4, 5]
    meta = sub.manifest(5).metadata
    assert meta["run_name"] == "tiny-grpo" and meta["learning_rate"] == 1e-3 and meta["experiment"] == "t"
    assert meta["gradient_accumulation_steps"] == 2

    # the replica starts from the initial weights (an inference server's checkpoint), not the trained ones
    replica = copy.deepcopy(initial).to(torch.bfloat16)
    assert not bits_equal(_bf16_bits(replica), snaps.states[5])
    for step in range(1, 6):
        before = _bf16_bits(replica)
        res = sub.pull(replica, step=step)
        assert res.step == step
        got = _bf16_bits(replica)
        assert bits_equal(got, snaps.states[step]), f"step {step} differs"
        assert not bits_equal(got, before), f"the pull of step {step} changed nothing"
        assert sub.manifest(step).changed > 0
        sub.verify(replica)
        if step > 1:
            assert res.path == "delta" and res.versions_applied == [step]
    # the weights really are bf16 on the store, from the fp32 model
    assert {r.dtype for r in sub.manifest(5).tensors} == {"bfloat16"}


def test_every_and_publish_initial_and_resume(tmp_path):
    uri = str(tmp_path / "store")
    base = tiny_llama()
    cb = DeltaStoreCallback(uri, every=2, publish_initial=True)
    model, snaps = train(tmp_path, cb, steps=5, accum=1, lr=2e-6, model=copy.deepcopy(base))
    assert cb.published == [0, 2, 4, 5]  # the initial weights, every 2nd step, and the last step
    sub = ds.Subscriber(uri)
    assert sub.versions() == [0, 2, 4, 5]

    # an inference server that loaded the same base checkpoint takes only deltas
    server = copy.deepcopy(base).to(torch.bfloat16)
    sub.identify(server, 0)
    res = sub.pull(server, allow_anchor=False)
    assert res.path == "delta" and res.versions_applied[-1] == 5  # the chain 2, 4, 5 or the differential 0 -> 5
    assert bits_equal(named_tensors(server), snaps.states[5])

    # a second run on the same store (e.g. resumed from an older checkpoint) skips steps
    # the store already has, then continues the chain
    cb2 = DeltaStoreCallback(uri)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, snaps2 = train(tmp_path, cb2, steps=7, accum=1, lr=2e-6, model=model)
    assert any("not above the store's latest version 5" in str(x.message) for x in w)
    assert cb2.published == [6, 7]
    res = sub.pull(server, allow_anchor=False)
    assert res.path == "delta" and res.versions_applied[-1] == 7
    assert bits_equal(named_tensors(server), snaps2.states[7])


def test_only_main_process_publishes(tmp_path):
    cb = DeltaStoreCallback(str(tmp_path / "store"))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "o"), report_to=[], use_cpu=True)
    state = transformers.TrainerState(is_world_process_zero=False, is_local_process_zero=False)
    control = transformers.TrainerControl()
    model = tiny_llama()
    cb.on_train_begin(args, state, control, model=model)
    state.global_step = 1
    cb.on_step_end(args, state, control, model=model)
    cb.on_train_end(args, state, control, model=model)
    assert cb.published == [] and not (tmp_path / "store").exists()

    # a state_fn runs on every process (it may gather), its result is published on the main one only
    calls = []
    cb = DeltaStoreCallback(str(tmp_path / "store3"), state_fn=lambda m: calls.append(m) or {})
    cb.on_train_begin(args, state, control, model=model)
    cb.on_step_end(args, state, control, model=model)
    cb.on_train_end(args, state, control, model=model)
    assert calls == [model] and cb.published == [] and not (tmp_path / "store3").exists()

    cb = DeltaStoreCallback(str(tmp_path / "store2"), main_process_only=False)
    cb.on_train_begin(args, state, control, model=model)
    cb.on_step_end(args, state, control, model=model)
    cb.on_train_end(args, state, control, model=model)
    assert cb.published == [1]


def test_given_publisher_is_flushed_not_closed(tmp_path):
    pub = ds.Publisher(str(tmp_path / "store"), dtype=torch.bfloat16)
    cb = DeltaStoreCallback(pub)
    train(tmp_path, cb, steps=2, accum=1)
    assert cb.published == [1, 2]
    pub.publish(tiny_llama(1), step=3)  # still open
    pub.close()


def test_background_publisher_is_drained_at_train_end(tmp_path):
    uri = str(tmp_path / "store")
    cb = DeltaStoreCallback(uri, background=True)
    model, snaps = train(tmp_path, cb, steps=3, accum=2)
    assert cb.published == [1, 2, 3]
    sub = ds.Subscriber(uri)
    assert sub.versions() == [1, 2, 3]  # on_train_end waited for every queued version
    assert bits_equal(sub.pull(step=3).state, snaps.states[3])


def test_unwrap_model():
    inner = tiny_llama()

    class Wrapper(torch.nn.Module):  # like DDP / DeepSpeedEngine: owns nothing, holds .module
        def __init__(self, m):
            super().__init__()
            self.module = m

    class HasModule(torch.nn.Module):  # a real model whose submodule happens to be named "module"
        def __init__(self, m):
            super().__init__()
            self.module = m
            self.extra = torch.nn.Linear(2, 2)

    assert unwrap_model(Wrapper(Wrapper(inner))) is inner
    own = HasModule(inner)
    assert unwrap_model(own) is own
    assert unwrap_model(inner) is inner


def test_missing_transformers_message():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import deltastore.integrations.trl as t\n"
            "try:\n"
            "    from deltastore.integrations.trl import DeltaStoreCallback\n"
            "except ImportError as e:\n"
            "    from deltastore.errors import MissingDependencyError\n"
            "    assert isinstance(e, MissingDependencyError), type(e)\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'deltastore[trl]'" in out.stdout


def test_trl_grpo_trainer_smoke(tmp_path):
    """A real TRL GRPOTrainer (generation with the model itself, on CPU) publishes once per optimizer step."""
    trl = require_module("trl")
    datasets = require_module("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(VOCAB - 8)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>")
    model = tiny_llama()
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 1, 1
    initial = copy.deepcopy(model).to(torch.bfloat16)  # the replica starts here, not from the trained weights
    prompts = datasets.Dataset.from_dict({"prompt": [" ".join(words[i:i + 4]) for i in range(16)]})

    def diversity(completions, **kw):
        return [float(len(set(c.split()))) for c in completions]

    uri = str(tmp_path / "store")
    cb, snaps = DeltaStoreCallback(uri), Snapshots()
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                          num_generations=4, gradient_accumulation_steps=2, max_completion_length=8,
                          learning_rate=1e-5, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                          disable_tqdm=True, bf16=False, seed=0)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=diversity, args=args, train_dataset=prompts,
                              processing_class=tok, callbacks=[cb, snaps])
    trainer.train()
    assert cb.published == [1, 2, 3]
    sub = ds.Subscriber(uri)
    assert sub.versions() == [1, 2, 3]
    replica = initial
    assert not bits_equal(_bf16_bits(replica), snaps.states[3])  # training moved the bf16 weights
    for step in (1, 2, 3):
        sub.pull(replica, step=step)
        assert bits_equal(_bf16_bits(replica), snaps.states[step]), f"step {step} differs"


# -- DeltaStoreWeightTransfer: TRL's WeightTransferProtocol, driven the way AsyncGRPOTrainer drives it ---------------
def _sync(wt, model):
    """What ``AsyncGRPOTrainer._sync_weight_merged`` does on the main process (TRL 1.16)."""
    wt.pause()
    wt.send_weights((n, p.detach()) for n, p in model.named_parameters())
    wt.resume()


def test_weight_transfer_publishes_one_version_per_sync(tmp_path):
    from deltastore.integrations.trl import DeltaStoreWeightTransfer

    uri = str(tmp_path / "store")
    model = tiny_llama(3).to(torch.bfloat16)
    wt = DeltaStoreWeightTransfer(uri, anchor_every=100)
    wt.init_weight_transfer()
    states = []
    for k in range(3):
        _sync(wt, model)
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.view(-1)[k] += 1
    wt.destroy()
    assert wt.published == [1, 2, 3] and wt.publisher is None
    sub = ds.Subscriber(uri)
    assert sub.versions() == [1, 2, 3]
    for step, want in zip([1, 2, 3], states):
        assert bits_equal(sub.pull(step=step).state, want), step
    again = DeltaStoreWeightTransfer(uri)  # a new transfer on the same store continues its chain
    _sync(again, model)
    assert again.published == [4]
    again.destroy()

    class Trainer:
        model_version = 9
    att = DeltaStoreWeightTransfer(uri).attach(Trainer())
    _sync(att, model)
    assert att.published == [10]  # TRL's model_version + 1: the version the next rollouts carry
    att.destroy()


def test_weight_transfer_synchronous_swap_order(tmp_path):
    from deltastore.integrations.trl import DeltaStoreWeightTransfer

    calls = []

    class Control:
        def pause(self):
            calls.append("pause")

        def apply(self, uri, step, storage_options):
            assert ds.Subscriber(uri).latest() == step  # committed before the server is told
            calls.append(("apply", step))

        def reset_prefix_cache(self):
            calls.append("reset")

        def set_version(self, label):
            calls.append(("version", label))

        def resume(self):
            calls.append("resume")
    wt = DeltaStoreWeightTransfer(str(tmp_path / "store"), control=Control())
    wt.init_weight_transfer()
    _sync(wt, tiny_llama(4))
    wt.destroy()
    assert calls == ["pause", ("apply", 1), "reset", ("version", "1"), "resume"]
