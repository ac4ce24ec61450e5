"""Real-engine LoRA check (vLLM CPU build): run with the vLLM virtualenv's python, not under pytest.

    .venv-vllm/bin/python tests/test_vllm/lora_check.py WORKDIR

WORKDIR (written by ``test_lora_engine.py`` in the main environment, which has
PEFT) holds ``base/`` (the tiny Qwen2), ``store/`` (adapter versions 0..N
published with ``adapter_only=True`` from real AdamW steps) and
``trainer_adapter/`` (the trainer's own ``save_pretrained`` of version N).

1. engine A (``enable_lora``, ``max_loras=2``) follows versions 1..N through a
   :class:`LoraFollower` with ``keep=2``: after each, only the newest two
   versions are loaded in the engine and on disk;
2. greedy outputs with the follower's newest adapter differ from the base
   model's (the adapter is live);
3. engine B starts fresh and is given the trainer's adapter folder: its greedy
   token ids and logprobs must equal engine A's exactly.

Writes WORKDIR/result.json; exit 0 when every check passed, 3 when vLLM is not importable.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 42], [300, 301, 302, 303, 304, 305, 306], [9]]


def log(msg: str) -> None:
    print(f"[lora_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_llm(base: str):
    from vllm import LLM

    return LLM(model=base, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, enforce_eager=True,
               max_num_seqs=4, kv_cache_memory_bytes=32 << 20, seed=0,
               enable_lora=True, max_lora_rank=8, max_loras=2)


def generate(llm, lora_request=None) -> list:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, detokenize=False, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False, lora_request=lora_request)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [sorted((int(t), float(lp.logprob)) for t, lp in d.items())
                          for d in (o.outputs[0].logprobs or [])]} for o in outs]


def main(work: str) -> int:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"vllm not importable: {e!r}", file=sys.stderr)
        return 3
    from vllm.lora.request import LoRARequest

    from deltastore.integrations.vllm_lora import EngineLoraControl, LoraFollower

    params = json.load(open(os.path.join(work, "params.json")))
    base, uri, steps = os.path.join(work, "base"), os.path.join(work, "store"), params["steps"]
    result: dict = {"checks": {}, "timings": {}}
    checks = result["checks"]
    t0 = time.time()
    try:
        llm = make_llm(base)
        result["timings"]["engine_a_start_s"] = round(time.time() - t0, 1)
        control = EngineLoraControl(llm)
        follower = LoraFollower(control, uri, os.path.join(work, "adapters"), name="policy", keep=2)
        loaded = []
        for step in range(1, steps + 1):
            follower.apply(step)
            loaded.append({"steps": [x.step for x in follower.loaded], "engine_ids": sorted(control.loaded()),
                           "folders": sorted(os.listdir(os.path.join(work, "adapters")))})
        checks["loaded_after_each"] = loaded
        checks["poll_after_newest"] = follower.poll_once()
        checks["served"] = follower.status()
        followed = generate(llm, follower.lora_request())
        checks["base_differs"] = generate(llm) != followed
        checks["previous_version_still_served"] = generate(llm, follower.loaded[0].handle) != followed
        del llm, control, follower
        gc.collect()
        t1 = time.time()
        llm = make_llm(base)  # a fresh engine given the trainer's own adapter folder
        result["timings"]["engine_b_start_s"] = round(time.time() - t1, 1)
        fresh = generate(llm, LoRARequest("fresh", 1, os.path.join(work, "trainer_adapter")))
        checks["identical_to_fresh_engine"] = fresh == followed
        if fresh != followed:
            checks["outputs"] = {"followed": followed, "fresh": fresh}
        del llm
        gc.collect()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    result["timings"]["total_s"] = round(time.time() - t0, 1)
    with open(os.path.join(work, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(json.dumps(result["timings"]))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
