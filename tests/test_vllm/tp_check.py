"""Real-engine check at tensor_parallel_size=2 (vLLM CPU build, one core per rank): run with the vLLM
virtualenv's python, not under pytest.

    .venv-vllm/bin/python tests/test_vllm/tp_check.py WORKDIR

1. builds the tiny Qwen2 of ``engine_check.py`` and publishes versions 0..6 (~1 % of elements each);
2. engine A (TP=2, the worker extension) starts on version 0 and follows versions 1..6 through
   ``deltastore_pull``: after each, both ranks report that version and ``deltastore_verify`` proves the
   served shards of both ranks against the manifest (the ranks hold different halves of the weights);
3. version 7 is published and its objects corrupted: the pull is refused (CorruptObjectError),
   and both ranks still serve version 6: the same version, the same bits (per rank, read inside the
   worker before and after: a digest of every served parameter and of the host copy the CPU build's
   packed GEMM weights are computed from) and the same outputs;
4. engine B (TP=2) starts fresh from ``deltastore materialize URI 6`` and must generate the same greedy
   token ids and logprobs (prompt and sampled) as engine A, exactly.

``VLLM_CPU_OMP_THREADS_BIND`` is set to the first two CPUs this process may use ("0|1" on a 2-core
machine): without it the CPU build refuses TP=2 there ("Not enough allowed NUMA nodes").
Writes WORKDIR/result.json; exit status 0 when every check passed, 3 when vLLM is not importable.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time

_cpus = sorted(os.sched_getaffinity(0))[:2]
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, _cpus)))

from engine_check import (FRACTION, build_model, expect_error, generate, log, make_llm, perturb,  # noqa: E402
                          publish, run_as_child)

STEPS = 6
TP = 2


def rank_digests(llm) -> list[dict]:
    """Per rank, read inside the worker: a sha256 over every parameter it serves (name order; the CPU
    build empties the GEMM weights it repacks), a sha256 over the host copy those packed weights were
    computed from (the applier's mirror, None without the extension), and one vocabulary-sharded shape."""
    def read(self):
        import hashlib

        import torch

        def digest(tensors):
            h = hashlib.sha256()
            for name in sorted(tensors):
                t = tensors[name].detach().contiguous().reshape(-1)
                h.update(name.encode())
                h.update(t.view(torch.uint8).numpy().tobytes())
            return h.hexdigest()

        params = {n: p for n, p in self.model_runner.get_model().named_parameters() if p.numel()}
        host = self._deltastore_applier().host if hasattr(self, "_deltastore_applier") else None
        return {"params": digest(params), "served_params": len(params), "host": host and digest(host),
                "embed_shape": list(params["model.embed_tokens.weight"].shape)}
    return llm.collective_rpc(read)


def rank_versions(llm) -> list[dict]:
    return llm.collective_rpc("deltastore_version")


def main(work: str) -> int:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"vllm not importable: {e!r}", file=sys.stderr)
        return 3
    import deltastore as ds
    import deltastore.integrations.vllm as dv
    from deltastore.store import object_key

    result: dict = {"checks": {}, "timings": {}, "omp_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}
    checks = result["checks"]
    t_start = time.time()
    base, uri, mat = (os.path.join(work, d) for d in ("base", "store", "materialized"))
    for d in (base, uri, mat):
        shutil.rmtree(d, ignore_errors=True)
    build_model(base)
    versions = publish(base, uri, STEPS, seed0=2000)

    t0 = time.time()
    llm = make_llm(base, extension=True, tensor_parallel_size=TP, distributed_executor_backend="mp")
    result["timings"]["engine_a_start_s"] = round(time.time() - t0, 2)
    out_v0 = generate(llm)
    ident = llm.collective_rpc("deltastore_identify", kwargs={"uri": uri, "step": 0})
    assert len(ident) == TP and all(r["step"] == 0 for r in ident), ident

    shards = rank_digests(llm)
    checks["ranks"] = len(shards)
    checks["embed_shapes"] = [s["embed_shape"] for s in shards]
    # vocabulary-parallel embedding: each rank holds half of the 512 rows
    assert checks["embed_shapes"] == [[256, 128]] * TP, shards
    assert shards[0]["params"] != shards[1]["params"], "the two ranks serve the same weights: no sharding"

    followed = []
    t0 = time.time()
    for step in range(1, STEPS + 1):
        r = dv.pull(llm, uri, step)
        assert r["step"] == step and r["route"] == "delta", r
        per_rank = [v["step"] for v in rank_versions(llm)]
        assert per_rank == [step] * TP, per_rank
        rep = dv.verify(llm)  # both ranks' served shards against the manifest
        followed.append({"step": step, "route": r["route"], "ranks": per_rank, "verified": rep["ok"],
                         "apply_s": r["apply_s"], "bytes": r["bytes_fetched"]})
    result["timings"]["follow_1_to_6_s"] = round(time.time() - t0, 2)
    checks["followed"] = followed
    out_a = generate(llm)
    checks["outputs_changed_v0_to_v6"] = out_a != out_v0
    assert out_a != out_v0, "versions 0 and 6 give the same outputs: the pulls did not reach the model"

    # a corrupt version 7: refused; both ranks keep serving version 6, bit for bit
    before = rank_digests(llm)
    with ds.Publisher(uri) as pub:
        pub.publish(perturb(versions[-1], FRACTION, 77), step=STEPS + 1)
    manifest = ds.Subscriber(uri).manifest(STEPS + 1)
    for o in manifest.objects:
        path = os.path.join(uri, object_key(o.digest))
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x5A
        open(path, "wb").write(bytes(data))
    checks["corrupt_refused"] = expect_error(lambda: dv.pull(llm, uri, STEPS + 1), "CorruptObjectError")
    after = rank_digests(llm)
    checks["ranks_after_refusal"] = [v["step"] for v in rank_versions(llm)]
    assert checks["ranks_after_refusal"] == [STEPS] * TP, checks["ranks_after_refusal"]
    checks["rank_bits_unchanged_after_refusal"] = [(a["params"], a["host"]) == (b["params"], b["host"])
                                                   for a, b in zip(after, before)]
    assert all(checks["rank_bits_unchanged_after_refusal"]), (before, after)
    checks["verify_after_refusal"] = dv.verify(llm)["ok"]
    checks["outputs_unchanged_after_refusal"] = generate(llm) == out_a
    assert checks["outputs_unchanged_after_refusal"]
    del llm
    gc.collect()

    # a fresh TP=2 engine on the materialized version 6
    subprocess.run([sys.executable, "-m", "deltastore", "materialize", uri, str(STEPS), mat], check=True)
    for f in os.listdir(base):
        if f.endswith(".json") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(base, f), mat)
    t0 = time.time()
    fresh = make_llm(mat, extension=False, tensor_parallel_size=TP, distributed_executor_backend="mp")
    result["timings"]["engine_b_start_s"] = round(time.time() - t0, 2)
    out_b = generate(fresh)
    checks["identical_to_fresh_engine"] = out_a == out_b
    if out_a != out_b:
        result["diff"] = {"followed": out_a, "fresh": out_b}
    assert out_a == out_b, "the TP=2 engine that followed the store differs from a fresh TP=2 load of version 6"
    checks["fresh_rank_digests_equal_followed"] = [s["params"] for s in rank_digests(fresh)] == \
        [s["params"] for s in before]
    assert checks["fresh_rank_digests_equal_followed"], "a fresh load's shards differ from the followed ones"
    del fresh
    gc.collect()
    result["outputs"] = out_b
    result["timings"]["total_s"] = round(time.time() - t_start, 2)
    result["ok"] = True
    log(f"TP={TP}: followed 1..{STEPS}, refused {STEPS + 1}, identical to a fresh engine ({result['timings']})")
    with open(os.path.join(work, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    run_as_child(main)
