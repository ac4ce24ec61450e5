"""TRL's ``AsyncGRPOTrainer`` syncing through a store into a real vLLM server, end to end, on CPU.

The real trainer (TRL 1.16, ``trl.experimental.async_grpo``) trains a tiny
random Qwen2 (bf16) with ``weight_transfer=DeltaStoreWeightTransfer(store,
control=HTTPControl(server))``; TRL's own rollout worker (a spawned process)
asks a real ``vllm serve`` (CPU build, ``.venv-vllm``, worker extension,
``VLLM_SERVER_DEV_MODE=1`` for the routes the control uses) for completions.
Every sync publishes one version and the server pulls and applies it before
TRL resumes. Checked after every sync: the version's manifest checksums equal
the trainer's tensors as TRL streamed them, and the server's served weights
verify against that manifest (``deltastore_verify``), so the server serves the
trainer's bits; the rollouts TRL takes carry versions that were published and
served, and (``max_staleness=0``) the second optimizer step trains on rollouts
of version 2, the weights the first step produced.

CPU accommodations, nothing else replaced: TRL's flash-attention-3 kernel
(CUDA, from the Hub) by a torch implementation of the same varlen attention
(``trl_rollout_helpers``); TRL's CUDA device-name lookup for its MFU metric
by its own "unknown device" answer; TRL's "vLLM importable" guard (vLLM runs
in its own virtualenv; the rollout worker only speaks HTTP to it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import require_module

require_module("trl")
require_module("datasets")
require_module("aiohttp")

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2")
    # a chat template TRL's rollout worker knows how to parse responses for (its special tokens are unknown
    # words to this tokenizer: they encode as "t0")
    from trl.chat_template_utils import deepseek_r1_distill_chat_template
    fast.chat_template = deepseek_r1_distill_chat_template
    fast.save_pretrained(path)
    return fast


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve not healthy after {timeout}s:\n{log.read_text()[-4000:]}")


class _RecordingQueue:
    """TRL's rollout queue, recording each sample's model version as the trainer takes it."""

    def __init__(self, inner, trainer):
        self.inner, self.trainer, self.taken = inner, trainer, []

    def get(self, *a, **k):
        s = self.inner.get(*a, **k)
        self.taken.append((int(s.model_version), int(self.trainer.model_version)))
        return s

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow
def test_async_grpo_trainer_syncs_through_the_store_into_vllm(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tests" / "test_vllm"))
    from engine_check import build_model
    from test_vllm.test_engine import vllm_env, vllm_python

    import datasets
    import torch
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trainer_mod
    from trl.experimental.async_grpo import async_rollout_worker as worker_mod
    from trl.experimental.async_grpo.packing import TREE_ATTENTION
    from trl_rollout_helpers import cpu_tree_attention, reward_len

    import deltastore as ds
    from deltastore.checksum import full_checksum
    from deltastore.integrations.trl import DeltaStoreWeightTransfer
    from deltastore.integrations.vllm import HTTPControl, combine_verify

    vpy = vllm_python()
    model_dir, store = tmp_path / "model", str(tmp_path / "store")
    build_model(str(model_dir))
    tok = _tokenizer(model_dir)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    control = HTTPControl(url)
    # TRL reads the CUDA device name for its MFU metric; on CPU its own "unknown device" answer is None
    monkeypatch.setattr(trainer_mod, "get_peak_flops_per_device", lambda *a, **k: None)
    # TRL's rollout worker only speaks HTTP to the server; its "vLLM installed" guard is for TRL's own NCCL
    # sync (replaced here), and vLLM lives in its own virtualenv (it pins another torch build)
    monkeypatch.setattr(worker_mod, "is_vllm_available", lambda *a, **k: True)
    synced: list[dict] = []

    class CheckedTransfer(DeltaStoreWeightTransfer):
        def send_weights(self, iterator):
            sums = {}

            def seen():
                for name, t in iterator:
                    sums[name] = full_checksum(name, t.detach().contiguous().view(-1).view(torch.int16))
                    yield name, t
            super().send_weights(seen())
            step = self.published[-1]
            manifest = ds.Subscriber(store).manifest(step)
            report = combine_verify(control._rpc("deltastore_verify", {"raise_errors": "false"}))
            synced.append({"step": step, "report_ok": report["ok"], "report_step": report["step"],
                           "manifest_is_trainer": all(int(r.checksum, 16) == sums[r.name]
                                                      for r in manifest.tensors)
                           and set(sums) == {r.name for r in manifest.tensors}})

    wt = CheckedTransfer(store, control=control, anchor_every=100)
    prompts = [[{"role": "user", "content": " ".join(f"t{3 + (i * 7 + j) % 500}" for j in range(6))}]
               for i in range(64)]
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=8, weight_sync_steps=1, token_budget=0,
                          use_cpu=True, dtype="bfloat16", report_to=[], logging_steps=1, save_strategy="no",
                          vllm_server_base_url=url, max_inflight_tasks=4, learning_rate=1e-2,
                          temperature=1.0, heartbeat_stale_after_s=300,
                          max_staleness=0)  # TRL drops older samples: after a sync it trains on the new version
    log = tmp_path / "server.log"
    env = vllm_env(VLLM_SERVER_DEV_MODE="1")
    cmd = [vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "128",
           "--max-num-seqs", "4", "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(32 << 20),
           "--worker-extension-cls", "deltastore.integrations.vllm.DeltaStoreWorkerExtension"]
    with open(log, "w") as logf:  # boots while the trainer is built
        server = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=cfg,
                                   train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                                   processing_class=tok, weight_transfer=wt)
        _wait_healthy(url, server, log)
        AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)
        queue = trainer.rollout_queue = _RecordingQueue(trainer.rollout_queue, trainer)
        trainer.train()
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(json.dumps({"synced": synced, "taken": queue.taken}), file=sys.stderr)
    assert [s["step"] for s in synced] == [1, 2, 3] == wt.published   # cold sync + one per optimizer step
    assert all(s["manifest_is_trainer"] and s["report_ok"] and s["report_step"] == s["step"] for s in synced)
    versions = {v for v, _ in queue.taken}
    assert versions <= set(wt.published)                  # every rollout came from a served, verified version
    assert all(v <= now for v, now in queue.taken)
    after_first_step = [v for v, now in queue.taken if now == 2]
    assert after_first_step.count(2) >= cfg.per_device_train_batch_size  # step 2 trained on version-2 rollouts
