"""vLLM on a GPU: sparse in-place apply vs the reload path vs a full ``reload_weights``.

A prepared one-shot check for a machine with an NVIDIA GPU and the vLLM (CUDA)
build installed next to deltastore. Nothing is downloaded: a random ~1.1B
Qwen2-style model is built locally with transformers.

    python bench/vllm_gpu.py                    # ~1.1B model, 8 versions, ~1 % of elements per step
    python bench/vllm_gpu.py --cpu-smoke        # tiny model on the vLLM CPU build: reload paths only

Measured (times are medians over the steps of each kind):

* full reload: ``reload_weights(weights_path=<materialized checkpoint>)``, the whole model from disk;
* reload path: ``deltastore_pull(path="reload")``, delta route (host mirror -> layer-wise reload);
* sparse path: ``deltastore_pull(path="sparse")``, changed elements written in place;
  ``apply`` is the worker's write time, ``served after`` the client's wall time
  until the call returned (fetch + verify + write + prefix-cache reset), and
  ``pause`` the wall time of the write after a ``deltastore_prefetch`` (what a
  follower pauses the engine for).

Checks: ``deltastore_verify`` (checksums of the served parameters) after the
sparse steps, every parameter's ``data_ptr`` unchanged (CUDA graphs captured at
start stay valid), and greedy token ids + logprobs identical to a fresh engine
started from ``deltastore materialize`` of the last version. Goal: sparse in
place >= 10x faster than the full reload. Prints one JSON line (``RESULT ...``)
and writes it to ``<work>/vllm_gpu_result.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # data_ptr probe via a collective_rpc lambda

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], [11] * 16, [4242, 17, 9, 5000]]


def log(msg: str) -> None:
    print(f"[vllm_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(path: str, a: argparse.Namespace) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
            else:
                p.normal_(1.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    return n


def perturb(state: dict, fraction: float, seed: int) -> dict:
    """~fraction of each tensor's elements moved by +-1 ulp (finite, nonzero, no sign flips)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.reshape(-1).view(torch.int16).to(torch.int32)
        mask = torch.rand(bits.numel(), generator=g) < fraction
        step = torch.where(torch.rand(bits.numel(), generator=g) < 0.5, 1, -1).to(torch.int32)
        sign, mag = bits & 0x8000, bits & 0x7FFF
        new = mag + step
        ok = mask & (new >= 1) & (new < 0x7F80)
        bits = torch.where(ok, sign | new, bits & 0xFFFF)
        out[name] = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(t.dtype).reshape(t.shape)
    return out


def publish(base: str, uri: str, versions: int, fraction: float) -> list[dict]:
    from safetensors.torch import load_file

    import deltastore as ds

    files = sorted(f for f in os.listdir(base) if f.endswith(".safetensors"))
    state: dict = {}
    for f in files:
        state.update(load_file(os.path.join(base, f)))
    infos = []
    with ds.Publisher(uri, anchor_every=1000) as pub:
        pub.publish(state, step=0)
        for step in range(1, versions + 1):
            state = perturb(state, fraction, 1000 + step)
            t0 = time.perf_counter()
            info = pub.publish(state, step=step)
            infos.append({"step": step, "changed": info.changed, "fraction": info.fraction, "bytes": info.nbytes,
                          "publish_s": round(time.perf_counter() - t0, 3)})
            log(f"published {step}: {info.fraction:.3%} changed, {info.nbytes / 1e6:.1f} MB")
    return infos


def materialize(uri: str, step: int, base: str, out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "deltastore", "materialize", uri, str(step), out], check=True)
    for f in os.listdir(base):
        if f.endswith(".json") and not f.endswith(".index.json"):
            shutil.copy(os.path.join(base, f), out)


def make_llm(model: str, a: argparse.Namespace, extension: bool = True):
    from vllm import LLM

    kw = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, seed=0,
              tensor_parallel_size=a.tp)
    if a.cpu_smoke:
        kw.update(enforce_eager=True, gpu_memory_utilization=0.1, kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
    else:
        kw.update(gpu_memory_utilization=a.gpu_mem, enforce_eager=False)  # CUDA graphs on: data_ptr must hold
    if extension:
        kw["worker_extension_cls"] = "deltastore.integrations.vllm.DeltaStoreWorkerExtension"
    return LLM(**kw)


def generate(llm, vocab: int) -> list:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, detokenize=False, seed=0)
    outs = llm.generate([{"prompt_token_ids": [t % vocab for t in p]} for p in PROMPTS], sp, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [sorted((int(t), float(lp.logprob)) for t, lp in d.items()) for d in o.outputs[0].logprobs]}
            for o in outs]


def timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/deltastore-vllm-gpu")
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on vLLM's CPU build, reload paths only")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.hidden, a.layers, a.heads, a.kv_heads, a.inter, a.vocab, a.versions = 128, 2, 2, 1, 256, 512, 4
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.versions < 4:
        ap.error("--versions must be >= 4")

    import deltastore.integrations.vllm as dv

    res: dict = {"args": vars(a), "checks": {}}
    os.makedirs(a.work, exist_ok=True)
    base, uri = os.path.join(a.work, "base"), os.path.join(a.work, "store")
    for d in (base, uri):
        shutil.rmtree(d, ignore_errors=True)
    n, t = timed(lambda: build_model(base, a))
    res["params"], res["build_s"] = n, round(t, 1)
    log(f"model: {n / 1e9:.2f}B parameters, built in {t:.0f}s")
    res["published"] = publish(base, uri, a.versions, a.fraction)
    V = a.versions
    mat_ref = os.path.join(a.work, "mat-2")
    materialize(uri, 2, base, mat_ref)

    t0 = time.perf_counter()
    llm = make_llm(base, a)
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    ptrs = lambda: llm.collective_rpc(  # noqa: E731
        lambda self: {n: p.data_ptr() for n, p in self.model_runner.get_model().named_parameters()})
    ptr0 = ptrs()
    ident, t = timed(lambda: llm.collective_rpc("deltastore_identify", kwargs={"uri": uri, "step": 0}))
    res["identify"] = {"result": ident[0], "s": round(t, 2)}  # includes the loader probe on the sparse path
    log(f"identify: {ident[0]} in {t:.1f}s")

    # reload path: anchor route first (no host mirror yet), then a delta
    r1, t1 = timed(lambda: dv.pull(llm, uri, 1, path="reload"))
    r2, t2 = timed(lambda: dv.pull(llm, uri, 2, path="reload"))
    assert r2["route"] == "delta", r2
    res["reload_path"] = {"anchor_first_s": round(t1, 3), "delta_s": round(t2, 3), "delta_apply_s": r2["apply_s"]}
    log(f"reload path: first (anchor) {t1:.2f}s, delta {t2:.2f}s")

    # full reload of a whole checkpoint from disk (same weights: version 2)
    _, tf = timed(lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": mat_ref,
                                                                        "is_checkpoint_format": True}))
    llm.reset_prefix_cache()
    res["full_reload_s"] = round(tf, 3)
    dv.verify(llm)
    log(f"full reload_weights: {tf:.2f}s")

    sparse = []
    if not a.cpu_smoke:
        for step in range(3, V):
            r, t = timed(lambda: dv.pull(llm, uri, step, path="sparse"))
            assert r["route"] == "delta" and r["path"] == "sparse", r
            sparse.append({"step": step, "served_after_s": round(t, 4), "apply_s": r["apply_s"],
                           "stage_s": r["stage_s"], "elements": r["elements_written"]})
            log(f"sparse step {step}: served after {t:.3f}s (apply {r['apply_s']:.4f}s)")
        # the follower's way: prefetch while serving, then only the write while paused
        llm.collective_rpc("deltastore_prefetch", kwargs={"uri": uri, "step": V, "path": "sparse"})
        r, tp = timed(lambda: dv.pull(llm, uri, V, path="sparse"))
        res["pause_after_prefetch_s"] = round(tp, 4)
        res["sparse"] = sparse
        rep = dv.verify(llm)
        res["checks"]["verify_after_sparse"] = rep["ok"]
        res["checks"]["data_ptr_kept"] = ptrs() == ptr0
        final = V
    else:
        for step in range(3, V + 1):
            dv.pull(llm, uri, step)
        final = V
    out_followed = generate(llm, a.vocab)
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass

    mat = os.path.join(a.work, f"mat-{final}")
    materialize(uri, final, base, mat)
    fresh = make_llm(mat, a, extension=False)
    out_fresh = generate(fresh, a.vocab)
    res["checks"]["identical_to_fresh_engine"] = out_followed == out_fresh
    del fresh
    gc.collect()

    if sparse:
        med = statistics.median(s["served_after_s"] for s in sparse)
        res["summary"] = {
            "full_reload_s": res["full_reload_s"],
            "reload_path_delta_s": res["reload_path"]["delta_s"],
            "sparse_served_after_s": med,
            "sparse_apply_s": statistics.median(s["apply_s"] for s in sparse),
            "pause_after_prefetch_s": res["pause_after_prefetch_s"],
            "speedup_vs_full_reload": round(res["full_reload_s"] / med, 1),
            "speedup_vs_reload_path": round(res["reload_path"]["delta_s"] / med, 1),
            "goal_10x": res["full_reload_s"] / med >= 10,
        }
    res["ok"] = all(v is True for v in res["checks"].values())
    line = json.dumps(res, default=str)
    with open(os.path.join(a.work, "vllm_gpu_result.json"), "w") as f:
        f.write(line)
    print("RESULT " + json.dumps(res.get("summary", {})) + " checks=" + json.dumps(res["checks"]), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
