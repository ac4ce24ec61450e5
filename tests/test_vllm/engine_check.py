"""Real-engine check (vLLM CPU build): run with the vLLM virtualenv's python, not under pytest.

    .venv-vllm/bin/python tests/test_vllm/engine_check.py WORKDIR

1. builds a tiny random Qwen2 (head size 64) with transformers and saves it;
2. publishes versions 0..10 (each ~1 % of elements moved by +-1 ulp) to a local store;
3. engine A starts from the base checkpoint with the worker extension and the
   "deltastore" weight-transfer backend; identifies itself as version 0; follows
   versions 1..10 through ``deltastore_pull`` (1..8; 4..6 in one pull, three deltas behind), the weight-transfer API (9)
   and the pull-only Follower (10), checking ``deltastore_verify`` at every step;
4. a corrupt version 11, a wrong declared base and a foreign chain are refused, and
   the engine keeps serving version 10 (same outputs, verify still passes);
5. engine B starts fresh from ``deltastore materialize URI 10`` and must give the
   same greedy token ids and logprobs as engine A; its first deltastore call is
   the weight-transfer API (the backend's own reload path, before any
   worker-extension call), then vLLM's native sparse loader path (a NaN value
   included) and the reload fallback on another store (:func:`native_checks`).

Writes WORKDIR/result.json; exit status 0 when every check passed, 3 when vLLM is
not importable.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

from fake_vllm_model import perturb  # noqa: F401 - also used by serve_check (script dir is on sys.path)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable): reads served bits

PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 42], [300, 301, 302, 303, 304, 305, 306], [9]]
STEPS = 10
FRACTION = 0.01


def log(msg: str) -> None:
    print(f"[engine_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # wider weights than the default init, so small changes move the logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(1.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)


def publish(base_dir: str, uri: str, steps: int, seed0: int) -> list[dict]:
    from safetensors.torch import load_file

    import deltastore as ds

    state = load_file(os.path.join(base_dir, "model.safetensors"))
    versions = [state]
    with ds.Publisher(uri, anchor_every=5) as pub:
        pub.publish(state, step=0)
        for step in range(1, steps + 1):
            state = perturb(state, FRACTION, seed0 + step)
            versions.append(state)
            info = pub.publish(state, step=step)
            log(f"published step {step}: {info.kind}, {info.changed} changed ({info.fraction:.4%}), {info.nbytes} B")
    return versions


def make_llm(model_dir: str, extension: bool, **extra):
    """A small CPU engine on ``model_dir``; ``extra`` goes to ``vllm.LLM`` (``tensor_parallel_size``...)."""
    from vllm import LLM

    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
                  enforce_eager=True, max_num_seqs=4, gpu_memory_utilization=0.1, kv_cache_memory_bytes=32 << 20,
                  seed=0, **extra)
    if extension:
        kwargs["worker_extension_cls"] = "deltastore.integrations.vllm.DeltaStoreWorkerExtension"
        kwargs["weight_transfer_config"] = {"backend": "deltastore"}
    return LLM(**kwargs)


def generate(llm) -> list:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=3, detokenize=False, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [sorted((int(t), float(lp.logprob)) for t, lp in d.items()) for d in (c.logprobs or [])]
        plps = [None if d is None else sorted((int(t), float(lp.logprob)) for t, lp in d.items())
                for d in (o.prompt_logprobs or [])]
        res.append({"tokens": list(c.token_ids), "logprobs": lps, "prompt_logprobs": plps})
    return res


def expect_error(fn, name: str) -> str:
    from deltastore.errors import DeltaStoreError

    try:
        fn()
    except DeltaStoreError as e:
        if type(e).__name__ != name:
            raise AssertionError(f"expected {name}, got {type(e).__name__}: {e}") from e
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"expected {name}, nothing raised")


def _bf16_set(t, index: int, bits: int):
    import torch

    flat = t.reshape(-1).clone().view(torch.int16)
    flat[index] = bits - 0x10000 if bits >= 0x8000 else bits
    return flat.view(t.dtype).reshape(t.shape)


def native_checks(llm, state: dict, nuri: str) -> dict:
    """vLLM's native sparse loader (load_checkpoint_weight_patches) inside our transaction, on the real engine.

    The versions change only RMSNorm weights (the CPU build computes them from the parameters, not from a
    packed copy), so ``path="auto"`` takes the native path; version 1 writes a NaN (vLLM's loader reserves NaN
    as "unchanged": that value must still land bit-exactly), version 2 turns it back into a number. Version 3
    moves linear weights too: auto falls back to the reload path and ``path="native"`` is refused, typed.
    """
    import deltastore as ds
    import deltastore.integrations.vllm as dv

    assert dv.native_patch_loader() is not None, "this vLLM has no load_checkpoint_weight_patches"
    norm = "model.layers.0.input_layernorm.weight"
    v0 = dict(state)
    v1 = dict(v0, **{norm: _bf16_set(_bf16_set(v0[norm], 0, 0x7FC0), 5, 0x3F81),
                     "model.norm.weight": _bf16_set(v0["model.norm.weight"], 7, 0xBF00)})
    v2 = dict(v1, **{norm: _bf16_set(v1[norm], 0, 0x3F80)})
    v3 = perturb(v2, FRACTION, 4242)
    with ds.Publisher(nuri, anchor_every=100) as pub:
        for step, st in enumerate([v0, v1, v2, v3]):
            pub.publish(st, step=step)
    out: dict = {}
    r = dv.pull(llm, nuri, 0)  # another store: an anchor, reload path
    assert r["route"] == "anchor" and r["path"] == "reload", r
    before = generate(llm)
    r = dv.pull(llm, nuri, 1)
    assert r["route"] == "delta" and r["path"] == "native", r
    dv.verify(llm)
    served = llm.collective_rpc("deltastore_verify")[0]["tensors"]
    assert served[norm]["source"] == "served" and served[norm]["ok"], served[norm]
    out["nan_lands"] = _served_bits(llm, norm, [0, 5]) == [0x7FC0, 0x3F81]
    assert out["nan_lands"], _served_bits(llm, norm, [0, 5])
    out["pull_1"] = r
    r = dv.pull(llm, nuri, 2)
    assert r["path"] == "native" and _served_bits(llm, norm, [0]) == [0x3F80], r
    dv.verify(llm)
    out["pull_2"] = r
    out["outputs_changed_by_native"] = generate(llm) != before
    assert out["outputs_changed_by_native"], "the native writes did not reach the forward pass"
    out["native_refused_for_linears"] = expect_error(lambda: dv.pull(llm, nuri, 3, path="native"),
                                                     "TargetMismatchError")
    assert dv.version(llm)["step"] == 2
    dv.verify(llm)
    r = dv.pull(llm, nuri, 3)  # the fallback: our reload path
    assert r["route"] == "delta" and r["path"] == "reload", r
    dv.verify(llm)
    out["fallback_3"] = r
    return out


def _served_bits(llm, name: str, positions: list[int]) -> list[int]:
    """The served parameter's bits at flat positions (RMSNorm weights: checkpoint layout == parameter layout)."""
    def read(self, name=name, positions=positions):
        p = dict(self.model_runner.get_model().named_parameters())[name]
        return [int(v) & 0xFFFF for v in p.detach().reshape(-1).view(__import__("torch").int16)[positions].tolist()]
    return llm.collective_rpc(read)[0]


def main(work: str) -> int:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"vllm not importable: {e!r}", file=sys.stderr)
        return 3
    import deltastore.integrations.vllm as dv
    from deltastore.integrations.vllm._rpc import results
    from deltastore.store import object_key

    result: dict = {"checks": {}, "timings": {}}
    checks = result["checks"]
    t_start = time.time()
    os.makedirs(work, exist_ok=True)
    base = os.path.join(work, "base")
    uri = os.path.join(work, "store")
    other_uri = os.path.join(work, "other-store")
    for d in (base, uri, other_uri, os.path.join(work, "materialized")):
        shutil.rmtree(d, ignore_errors=True)
    build_model(base)
    versions = publish(base, uri, STEPS, seed0=1000)
    result["timings"]["build_publish_s"] = round(time.time() - t_start, 2)
    import deltastore as ds

    sub = ds.Subscriber(uri)
    result["codecs"] = sorted({o.codec["id"] for s in sub.versions() for o in sub.manifest(s).objects})

    t0 = time.time()
    llm = make_llm(base, extension=True)
    result["timings"]["engine_a_start_s"] = round(time.time() - t0, 2)
    out_v0 = generate(llm)

    ident = llm.collective_rpc("deltastore_identify", kwargs={"uri": uri, "step": 0})[0]
    checks["identify_v0"] = ident
    assert ident["step"] == 0 and ident["path"] == "reload", ident
    checks["wrong_declared_base"] = expect_error(
        lambda: results(llm.collective_rpc("deltastore_identify", kwargs={
            "uri": uri, "step": 5, "raise_errors": False})), "ChecksumMismatchError")
    assert dv.version(llm)["step"] == 0

    pulls = []
    out_a3 = None
    for step in (1, 2, 3, 6, 7, 8):  # 6: three deltas behind, taken one after the other (4, 5, 6)
        r = dv.pull(llm, uri, step)
        if step == 3:
            out_a3 = generate(llm)
        assert r["step"] == step and r["route"] == "delta" and r["path"] == "reload", r
        assert r["versions_applied"] == ([4, 5, 6] if step == 6 else [step]), r
        rep = dv.verify(llm)
        pulls.append({"step": step, "route": r["route"], "bytes": r["bytes_fetched"], "apply_s": r["apply_s"],
                      "verify_served": rep["served"], "verify_host": rep["host"]})
    checks["pulls"] = pulls

    # step 9 through the standard weight-transfer API
    llm.start_weight_update()
    llm.update_weights({"update_info": {"uri": uri, "step": 9}})
    llm.finish_weight_update(weight_version="9")
    llm.reset_prefix_cache()
    v = dv.version(llm)
    assert v["step"] == 9, v
    dv.verify(llm)
    checks["weight_transfer_step9"] = {"version": v, "weight_version": llm.get_weight_version()}

    # step 10 through the pull-only follower
    fol = dv.Follower(dv.LLMControl(llm), uri, poll_interval=0.1, max_lag=0)
    assert fol.served_step == 9
    r = fol.poll_once()
    assert r is not None and r["step"] == 10 and r["route"] == "delta", r
    assert fol.poll_once() is None  # nothing newer
    dv.verify(llm)
    checks["follower_step10"] = {"result": r, "status": fol.status()}
    out_a = generate(llm)

    # bad inputs: the engine keeps serving version 10
    with ds.Publisher(uri) as pub:  # resumes at 10
        pub.publish(perturb(versions[-1], FRACTION, 99), step=11)
    m11 = ds.Subscriber(uri).manifest(11)
    for o in m11.objects:
        path = os.path.join(uri, object_key(o.digest))
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x5A
        open(path, "wb").write(bytes(data))
    checks["corrupt_object"] = expect_error(lambda: dv.pull(llm, uri, 11), "CorruptObjectError")
    try:
        fol.poll_once()
        raise AssertionError("the follower applied a corrupt version")
    except ds.errors.CorruptObjectError:
        pass
    assert fol.served_step == 10 and dv.version(llm)["step"] == 10
    with ds.Publisher(other_uri) as pub:  # another run: its chain does not contain our version
        for s, st in enumerate([perturb(versions[0], 0.5, 7), perturb(versions[0], 0.5, 8)]):
            pub.publish(st, step=20 + s)
    checks["foreign_chain"] = expect_error(lambda: dv.pull(llm, other_uri, 21, allow_anchor=False),
                                           "ParentMismatchError")
    assert dv.version(llm)["step"] == 10
    dv.verify(llm)
    out_a_after = generate(llm)
    checks["outputs_unchanged_after_refusals"] = out_a_after == out_a
    if out_a_after != out_a:
        import pickle
        pickle.dump({"before": out_a, "after": out_a_after}, open(os.path.join(work, "diff.pkl"), "wb"))
    assert out_a_after == out_a
    checks["outputs_changed_v0_to_v10"] = out_v0 != out_a
    assert out_v0 != out_a, "versions 0 and 10 give the same logprobs: the updates did not reach the model"
    del llm
    gc.collect()

    # a fresh engine from the materialized checkpoint of version 10
    mat = os.path.join(work, "materialized")
    subprocess.run([sys.executable, "-m", "deltastore", "materialize", uri, "10", mat], check=True)
    for f in os.listdir(base):
        if f.endswith(".json") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(base, f), mat)
    t0 = time.time()
    fresh = make_llm(mat, extension=True)
    result["timings"]["engine_b_start_s"] = round(time.time() - t0, 2)
    out_b = generate(fresh)
    checks["identical_to_fresh_engine"] = out_a == out_b
    if out_a != out_b:
        result["diff"] = {"followed": out_a, "fresh": out_b}
    assert out_a == out_b, "the engine that followed the store differs from a fresh load of version 10"
    # engine B knows no version. Its first deltastore call is the weight-transfer API (no worker-extension
    # call before it): the backend's own reload path (vLLM's reload_weights from reload/inplace.py) loads
    # the anchor route (anchor 0 + deltas 1..3).
    fresh.start_weight_update()
    fresh.update_weights({"update_info": {"uri": uri, "step": 3}})
    fresh.finish_weight_update(weight_version="3")
    fresh.reset_prefix_cache()
    v = dv.version(fresh)
    assert v["step"] == 3 and v["path"] == "reload", v
    dv.verify(fresh)
    checks["anchor_route_step3"] = v
    checks["anchor_route_matches_followed_step3"] = generate(fresh) == out_a3
    assert checks["anchor_route_matches_followed_step3"], "version 3 by anchor route differs from version 3 by deltas"
    checks["native"] = native_checks(fresh, versions[3], os.path.join(work, "norm-store"))
    result["outputs"] = out_b
    result["timings"]["total_s"] = round(time.time() - t_start, 2)
    result["ok"] = True
    with open(os.path.join(work, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


def run_as_child(main) -> None:
    """The ``__main__`` of every check script: exit with ``main(work_dir)``'s status (``work_dir`` from argv,
    created first); an exception is printed and written to ``work_dir/result.json`` as ``{"ok": false,
    "error": ...}``, which the test shows."""
    work_dir = sys.argv[1]
    status = 1
    os.makedirs(work_dir, exist_ok=True)
    try:
        status = main(work_dir)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        with open(os.path.join(work_dir, "result.json"), "w") as f:
            json.dump({"ok": False, "error": traceback.format_exc()}, f)
        status = 1
    sys.stdout.flush()
    sys.exit(status)


if __name__ == "__main__":
    run_as_child(main)
