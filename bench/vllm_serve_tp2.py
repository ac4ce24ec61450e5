"""The follower inside ``vllm serve`` at tensor_parallel_size=2, on the vLLM CPU build (one core per rank).

    .venv-vllm/bin/python bench/vllm_serve_tp2.py [--work DIR] [--steps 5]

Too slow for the suite (two TP=2 servers start, ~1.5-2 min each on 2 busy cores), so it runs here:

1. a tiny random Qwen2 (``tests/test_vllm/engine_check.py``'s) and version 0 are published to a local store;
2. ``vllm serve --tensor-parallel-size 2 --middleware ...serve_follower.FollowStore`` (no
   ``VLLM_SERVER_DEV_MODE``) follows the store by itself, ``DELTASTORE_FOLLOW_VERIFY=1``: after every apply
   both ranks' served weights are checked against the manifest and the verdict lands in the status file;
3. versions 1..N are published one at a time; for each, the time from the end of ``publish()`` to the status
   file naming that version (poll interval 0.2 s) is measured;
4. a corrupt version N+1 is published: the server keeps serving N (status file, same greedy completion);
   the refusal is a line in the server's log; the store is then repaired (the same bytes back) and the
   follower applies N+1;
5. a second, fresh TP=2 server on ``deltastore materialize`` of version N+1 must give the same greedy
   completion (token ids and logprobs, exact).

Prints one JSON line (``RESULT {...}``) and writes it to ``<work>/serve_tp2_result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "test_vllm"))
_cpus = sorted(os.sched_getaffinity(0))[:2]
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, _cpus)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, os.path.join(ROOT, "tests", "test_vllm", "amx_permission"), os.environ.get("PYTHONPATH", "")])

from engine_check import FRACTION, build_model, log, perturb  # noqa: E402
from serve_check import http, publish_corrupt, start_server, stop_server  # noqa: E402

TP = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]


def complete(url: str, model: str) -> dict:
    out = http("POST", url + "/v1/completions", {
        "model": model, "prompt": [1, 2, 3, 4], "max_tokens": 6, "temperature": 0, "return_token_ids": True,
        "logprobs": 1, "return_tokens_as_token_ids": True})
    choice = out["choices"][0]
    return {"token_ids": [int(t) for t in choice["token_ids"]],
            "logprobs": [float(x) for x in choice["logprobs"]["token_logprobs"]]}


def wait_served(status: str, step: int, timeout: float = 120.0) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(status):
            st = json.load(open(status))
            if st["served_step"] == step:
                return st
        time.sleep(0.02)
    raise TimeoutError(f"the in-server follower did not serve step {step} in {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="serve-tp2-")
    import deltastore as ds
    from deltastore.store import object_key
    from safetensors.torch import load_file

    base, uri, mat = (os.path.join(work, d) for d in ("base", "store", "materialized"))
    status = os.path.join(work, "served.json")
    for d in (base, uri, mat):
        shutil.rmtree(d, ignore_errors=True)
    build_model(base)
    state = load_file(os.path.join(base, "model.safetensors"))
    res: dict = {"omp_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "steps": []}
    pub = ds.Publisher(uri, anchor_every=100)
    pub.publish(state, step=0)

    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", DELTASTORE_FOLLOW_URI=uri, DELTASTORE_FOLLOW_POLL="0.2",
               DELTASTORE_FOLLOW_STATUS_FILE=status, DELTASTORE_FOLLOW_VERIFY="1")
    t0 = time.time()
    srv, logf, url = start_server(work, base, env, [*TP, "--middleware",
                                                    "deltastore.integrations.vllm.serve_follower.FollowStore"],
                                  "server_tp2.log")
    try:
        res["server_start_s"] = round(time.time() - t0, 1)
        st = wait_served(status, 0)
        assert st["result"]["route"] == "anchor" and st["result"]["verify"]["ok"], st
        before = complete(url, base)
        for step in range(1, args.steps + 1):
            state = perturb(state, FRACTION, 3000 + step)
            pub.publish(state, step=step)
            t_pub = time.time()
            st = wait_served(status, step)
            r = st["result"]
            res["steps"].append({"step": step, "publish_to_served_s": round(time.time() - t_pub, 3),
                                 "route": r["route"], "verify_ok": r["verify"]["ok"]})
            assert r["route"] == "delta" and r["verify"]["ok"], st
            log(f"step {step}: served {res['steps'][-1]['publish_to_served_s']} s after publish")
        pub.close()
        at_n = complete(url, base)
        res["completion_changed"] = at_n != before
        assert res["completion_changed"], "versions 0 and N serve the same completion"
        # a corrupt version N+1: refused, the server keeps serving N. It is published into a copy of the
        # store and corrupted there, then its files land objects first: the follower never sees it intact
        originals = publish_corrupt(uri, os.path.join(work, "staging"), perturb(state, FRACTION, 4000),
                                    args.steps + 1)
        time.sleep(3.0)  # 15 polls
        res["served_after_corrupt"] = json.load(open(status))["served_step"]
        res["completion_unchanged_after_corrupt"] = complete(url, base) == at_n
        res["refusal_logged"] = "CorruptObjectError" in open(os.path.join(work, "server_tp2.log")).read()
        assert res["served_after_corrupt"] == args.steps and res["completion_unchanged_after_corrupt"], res
        assert res["refusal_logged"], "a refused version left no line in the server's log"
        # the store repaired (the same bytes back): the follower, still alive, applies N+1
        for p, data in originals.items():
            open(p, "wb").write(data)
        st = wait_served(status, args.steps + 1)
        res["applied_after_repair"] = st["result"]["route"] == "delta" and st["result"]["verify"]["ok"]
        assert res["applied_after_repair"], st
        final = complete(url, base)
    finally:
        stop_server(srv, logf)

    subprocess.run([sys.executable, "-m", "deltastore", "materialize", uri, str(args.steps + 1), mat], check=True)
    for f in os.listdir(base):
        if f.endswith(".json") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(base, f), mat)
    plain = {k: v for k, v in env.items() if not k.startswith("DELTASTORE_FOLLOW_")}
    srv, logf, url2 = start_server(work, mat, plain, TP, "server_tp2_fresh.log")
    try:
        res["identical_to_fresh_server"] = complete(url2, mat) == final
    finally:
        stop_server(srv, logf)
    times = sorted(s["publish_to_served_s"] for s in res["steps"])
    res["publish_to_served_median_s"] = times[len(times) // 2]
    res["ok"] = bool(res["identical_to_fresh_server"])
    line = json.dumps(res)
    print("RESULT " + line, flush=True)
    with open(os.path.join(work, "serve_tp2_result.json"), "w") as f:
        f.write(line + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
