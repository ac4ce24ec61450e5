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
3. engine B is a fresh ``vllm serve`` (``--enable-lora``,
   ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) given the trainer's adapter folder
   (``--lora-modules fresh=...``): its greedy token ids and logprobs must equal
   engine A's follower exactly;
4. on engine B an HTTP follower (``/v1/load_lora_adapter``,
   ``/v1/unload_lora_adapter``) follows versions 1..N with ``keep=2``: the server
   lists only the newest two versions, and the newest answers exactly as
   ``fresh``; with ``alias=True`` the bare name answers as the newest.

Writes WORKDIR/result.json; exit 0 when every check passed, 3 when vLLM is not importable.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

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


def http(method: str, url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method)
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}


def serve(work: str, base: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--port", str(port),
           "--host", "127.0.0.1", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
           "--max-model-len", "128", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0",
           "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
           "--lora-modules", f"fresh={os.path.join(work, 'trainer_adapter')}"]
    srv = subprocess.Popen(cmd, env=env, stdout=open(os.path.join(work, "server.log"), "w"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if srv.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {srv.returncode}; see server.log")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return srv, url
        except Exception:  # noqa: BLE001
            if time.time() - t0 > 300:
                raise TimeoutError("vllm serve did not become healthy in 300 s") from None
            time.sleep(1)


def complete(url: str, model: str) -> list:
    """Greedy completions of PROMPTS by adapter ``model``: token ids and their logprobs (exact floats)."""
    res = []
    for p in PROMPTS:
        out = http("POST", url + "/v1/completions", {
            "model": model, "prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "logprobs": 1, "return_tokens_as_token_ids": True, "seed": 0})
        c = out["choices"][0]
        res.append({"tokens": [int(t) for t in c["token_ids"]],
                    "logprobs": [float(x) for x in c["logprobs"]["token_logprobs"]]})
    return res


def chosen(outputs: list) -> list:
    """Offline outputs reduced to what the server returns: tokens and the chosen token's logprob."""
    return [{"tokens": o["tokens"], "logprobs": [dict(lp)[t] for t, lp in zip(o["tokens"], o["logprobs"])]}
            for o in outputs]


def main(work: str) -> int:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"vllm not importable: {e!r}", file=sys.stderr)
        return 3
    from deltastore.integrations.vllm_lora import EngineLoraControl, HTTPLoraControl, LoraFollower

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
        srv, url = serve(work, base)  # a fresh engine given the trainer's own adapter folder
        try:
            result["timings"]["engine_b_start_s"] = round(time.time() - t1, 1)
            fresh = complete(url, "fresh")
            checks["identical_to_fresh_engine"] = fresh == chosen(followed)
            http_follower = LoraFollower(HTTPLoraControl(url), uri, os.path.join(work, "http-adapters"),
                                         name="policy", keep=2)
            for step in range(1, steps + 1):
                http_follower.apply(step)
            checks["server_models"] = sorted(m["id"] for m in http("GET", url + "/v1/models")["data"])
            served = complete(url, http_follower.served_name())
            checks["http_follower_identical_to_fresh"] = served == fresh
            aliased = LoraFollower(HTTPLoraControl(url, alias=True), uri, os.path.join(work, "alias-adapters"),
                                   name="stable", keep=2)
            aliased.apply(steps - 1)
            aliased.apply(steps)  # the bare name is re-pointed at the newest version
            checks["alias_identical_to_fresh"] = complete(url, "stable") == fresh
            if served != fresh or fresh != chosen(followed):
                checks["outputs"] = {"followed": chosen(followed), "fresh": fresh, "http": served}
        finally:
            os.killpg(srv.pid, 9)
            srv.wait()
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
