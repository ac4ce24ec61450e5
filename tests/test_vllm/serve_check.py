"""Real ``vllm serve`` (CPU build) followed by the sidecar follower over HTTP.

    .venv-vllm/bin/python tests/test_vllm/serve_check.py WORKDIR

Starts the OpenAI server with the worker extension and the "deltastore"
weight-transfer backend, then drives it only through HTTP with
``deltastore.integrations.vllm.HTTPControl`` + ``Follower``: first sync (anchor
route) over ``/collective_rpc``, a later version over the standard weight-transfer
routes, the ``max_lag`` rule, ``/weight_info``, served-weight verification, and
a corrupt version refused while the server keeps serving exactly what it served
before: the greedy completion (token ids and their logprobs) after the refusal
equals the one taken before it, and the served weights still verify against
version 8. The completion at version 8 must differ from the base model's, so
the pulls really reached the served weights. Then a second server, without
``VLLM_SERVER_DEV_MODE`` (its dev routes absent), follows another store by
itself through ``--middleware ...serve_follower.FollowStore``, verifies what it
serves after every apply, and serves the completion the first server served for
the same weights, and refuses a corrupt version with a line in the server's log while it keeps serving.
Writes WORKDIR/result.json; exit 0 when every check passed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_check import FRACTION, build_model, log, perturb, run_as_child  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method)
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}


def main(work: str) -> int:
    import deltastore as ds
    import deltastore.integrations.vllm as dv
    from deltastore.store import object_key
    from safetensors.torch import load_file

    res: dict = {"checks": {}}
    checks = res["checks"]
    base, uri = os.path.join(work, "base"), os.path.join(work, "store")
    os.makedirs(work, exist_ok=True)
    build_model(base)
    state = load_file(os.path.join(base, "model.safetensors"))
    pub = ds.Publisher(uri, anchor_every=3)
    pub.publish(state, step=0)

    def publish_next(step: int) -> None:
        nonlocal state
        state = perturb(state, FRACTION, 2000 + step)
        pub.publish(state, step=step)

    for s in range(1, 5):
        publish_next(s)

    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="INFO")
    t0 = time.time()
    srv, logf, srv_url = start_server(work, base, env, ["--weight-transfer-config", '{"backend": "deltastore"}'],
                                      "server.log")
    try:
        res["server_start_s"] = round(time.time() - t0, 1)
        log(f"server up in {res['server_start_s']}s")

        def complete() -> dict:
            return complete_at(srv_url)

        def complete_at(url: str) -> dict:
            """Greedy completion of a fixed prompt: generated token ids and their logprobs (exact floats)."""
            out = http("POST", url + "/v1/completions", {
                "model": base, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, "return_token_ids": True,
                "logprobs": 1, "return_tokens_as_token_ids": True})
            choice = out["choices"][0]
            ids, lps = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
            assert isinstance(ids, list) and len(ids) == 4 and isinstance(lps, list) and len(lps) == 4, choice
            return {"token_ids": [int(t) for t in ids], "logprobs": [float(x) for x in lps]}

        completion_base = complete()
        checks["completion_before"] = completion_base
        status_file = os.path.join(work, "served.json")
        rpc = dv.HTTPControl(srv_url, transport="rpc")
        fol = dv.Follower(rpc, uri, poll_interval=0.2, max_lag=0, status_file=status_file)
        assert fol.served_step is None  # the server knows no version yet
        r = fol.poll_once()
        assert r["step"] == 4 and r["route"] == "anchor", r
        checks["first_sync_anchor"] = r
        checks["status_file"] = json.load(open(status_file))["served_step"] == 4
        checks["weight_info_4"] = http("GET", srv_url + "/weight_info").get("weight_version")
        assert checks["weight_info_4"] == "4", checks["weight_info_4"]
        checks["completion_after_4"] = complete() is not None
        assert fol.poll_once() is None

        publish_next(5)
        publish_next(6)
        wt = dv.Follower(dv.HTTPControl(srv_url, transport="weight-transfer"), uri, poll_interval=0.2, max_lag=0)
        wt.served_step = 4
        r = wt.poll_once()
        assert r["step"] == 6, r
        v = rpc.served()
        assert v["step"] == 6, v
        checks["weight_transfer_6"] = {"served": v, "weight_info": http("GET", srv_url + "/weight_info")}

        lagged = dv.Follower(rpc, uri, poll_interval=0.2, max_lag=1)
        assert lagged.served_step == 6
        publish_next(7)
        checks["max_lag_waits"] = lagged.poll_once() is None
        publish_next(8)
        r = lagged.poll_once()
        state_8 = dict(state)
        assert r is not None and r["step"] == 8 and r["versions_applied"] == [7, 8], r
        checks["max_lag_applies_8"] = r

        report = dv.combine_verify(rpc._rpc("deltastore_verify", {"raise_errors": "false"}))
        assert report["ok"] and report["step"] == 8, report
        checks["verify_8"] = report
        completion_8 = complete()
        checks["completion_8"] = completion_8
        checks["completion_changed_0_to_8"] = completion_8 != completion_base
        assert checks["completion_changed_0_to_8"], "versions 0 and 8 serve the same completion: no update arrived"

        publish_next(9)
        for o in ds.Subscriber(uri).manifest(9).objects:
            p = os.path.join(uri, object_key(o.digest))
            data = bytearray(open(p, "rb").read())
            data[len(data) // 2] ^= 0x33
            open(p, "wb").write(bytes(data))
        try:
            lagged.max_lag = 0
            lagged.poll_once()
            raise AssertionError("a corrupt version was applied")
        except ds.errors.CorruptObjectError as e:
            checks["corrupt_refused"] = f"{type(e).__name__}: {e}"
        assert rpc.served()["step"] == 8
        wt.served_step = 8
        try:  # the weight-transfer routes refuse it too, and the server stays up
            wt.poll_once()
            raise AssertionError("a corrupt version was applied through /update_weights")
        except ds.errors.ApplyError as e:
            checks["corrupt_refused_weight_transfer"] = str(e)[:300]
        assert rpc.served()["step"] == 8
        assert http("GET", srv_url + "/is_paused").get("is_paused") is False
        after = complete()
        checks["completion_after_refusal"] = after
        checks["completion_unchanged_after_refusal"] = after == completion_8
        assert after == completion_8, f"the server serves something else after refusing version 9: {after}"
        report = dv.combine_verify(rpc._rpc("deltastore_verify", {"raise_errors": "false"}))
        checks["verify_after_refusal"] = report
        assert report["ok"] and report["step"] == 8, report
        logf.flush()
        served_log = [line.strip() for line in open(os.path.join(work, "server.log"))
                      if "deltastore: serving step" in line]
        checks["server_logs_served_version"] = served_log[-1] if served_log else None
        assert served_log and "serving step 8" in served_log[-1], served_log
    finally:
        stop_server(srv, logf)
        pub.close()
    checks["in_server_follower"] = in_server_follower(work, base, state_8, checks["completion_8"], complete_at)
    res["ok"] = True
    with open(os.path.join(work, "result.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


def publish_corrupt(uri: str, staging: str, state: dict, step: int) -> dict[str, bytes]:
    """Publish ``state`` as ``step`` with every object of it corrupted, atomically as seen from ``uri``;
    returns ``{path in uri: intact bytes}`` of those objects."""
    import deltastore as ds
    from deltastore.store import object_key

    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(uri, staging)
    with ds.Publisher(staging) as pub:
        pub.publish(state, step=step)
    intact, new = {}, []
    for o in ds.Subscriber(staging).manifest(step).objects:
        rel = object_key(o.digest)
        data = open(os.path.join(staging, rel), "rb").read()
        intact[os.path.join(uri, rel)] = data
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x5A
        open(os.path.join(staging, rel), "wb").write(bytes(bad))
    for d, _, files in os.walk(staging):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), staging)
            dst = os.path.join(uri, rel)
            if not os.path.exists(dst) or open(dst, "rb").read() != open(os.path.join(d, f), "rb").read():
                new.append(rel)
    objects = {os.path.relpath(p, uri) for p in intact}
    for rel in sorted(new, key=lambda r: r not in objects):  # the objects first, then what names the version
        os.makedirs(os.path.dirname(os.path.join(uri, rel)), exist_ok=True)
        tmp = os.path.join(uri, rel) + ".landing"
        shutil.copyfile(os.path.join(staging, rel), tmp)
        os.replace(tmp, os.path.join(uri, rel))
    return intact


def start_server(work: str, base: str, env: dict, extra: list[str], name: str):
    """``vllm serve`` of ``base`` with the worker extension and ``extra`` flags, healthy; (process, log, url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--port", str(port),
           "--host", "127.0.0.1", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
           "--max-model-len", "128", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.1",
           "--kv-cache-memory-bytes", str(32 << 20),
           "--worker-extension-cls", "deltastore.integrations.vllm.DeltaStoreWorkerExtension", *extra]
    logf = open(os.path.join(work, name), "w")
    srv = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if srv.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {srv.returncode}; see {name}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                return srv, logf, url
            except OSError:
                if time.time() - t0 > 240:
                    raise TimeoutError("vllm serve did not become healthy in 240 s") from None
                time.sleep(1)
    except BaseException:
        stop_server(srv, logf)
        raise


def stop_server(srv, logf) -> None:
    try:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(timeout=30)
    except Exception:  # noqa: BLE001
        try:
            os.killpg(srv.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    logf.close()


def in_server_follower(work: str, base: str, state_8: dict, completion_8: dict, complete_at) -> dict:
    """``--middleware ...FollowStore`` without VLLM_SERVER_DEV_MODE: the dev routes are absent, the server
    follows a store by itself, verifies what it serves, and serves exactly what the first server served
    for the same weights."""
    import urllib.error

    import deltastore as ds
    from safetensors.torch import load_file

    uri2, status = os.path.join(work, "store2"), os.path.join(work, "served2.json")
    with ds.Publisher(uri2) as pub:
        pub.publish(load_file(os.path.join(base, "model.safetensors")), step=0)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", DELTASTORE_FOLLOW_URI=uri2, DELTASTORE_FOLLOW_POLL="0.2",
               DELTASTORE_FOLLOW_STATUS_FILE=status, DELTASTORE_FOLLOW_VERIFY="1")
    srv, logf, url = start_server(work, base, env, ["--middleware",
                                                    "deltastore.integrations.vllm.serve_follower.FollowStore"],
                                  "server2.log")
    out: dict = {}
    try:
        try:
            http("POST", url + "/collective_rpc", {"method": "deltastore_version"})
            out["dev_routes_absent"] = False
        except urllib.error.HTTPError as e:
            out["dev_routes_absent"] = e.code == 404
        assert out["dev_routes_absent"], "the dev-mode routes are served without VLLM_SERVER_DEV_MODE"

        def served(step: int) -> dict:
            t0 = time.time()
            while time.time() - t0 < 120:
                if os.path.exists(status):
                    st = json.load(open(status))
                    if st["served_step"] == step:
                        return st
                time.sleep(0.2)
            raise TimeoutError(f"the in-server follower did not serve step {step}")
        st0 = served(0)
        with ds.Publisher(uri2) as pub:
            pub.publish(state_8, step=1)
        st1 = served(1)
        out["step0"] = {"route": st0["result"]["route"], "verify": st0["result"]["verify"]}
        out["step1"] = {"route": st1["result"]["route"], "verify": st1["result"]["verify"]}
        assert st0["result"]["route"] == "anchor" and st0["result"]["verify"]["ok"], st0
        assert st1["result"]["route"] == "delta" and st1["result"]["verify"]["ok"], st1
        out["completion_equals_first_server_at_8"] = complete_at(url) == completion_8
        assert out["completion_equals_first_server_at_8"], "the in-server follower serves other weights"
        # a corrupt version: refused, said in the server's log, the server keeps serving step 1
        publish_corrupt(uri2, os.path.join(work, "staging2"), perturb(state_8, FRACTION, 77), 2)
        time.sleep(2.0)  # 10 polls
        out["served_after_corrupt"] = json.load(open(status))["served_step"]
        out["refusal_logged"] = "CorruptObjectError" in open(os.path.join(work, "server2.log")).read()
        out["completion_unchanged_after_corrupt"] = complete_at(url) == completion_8
        assert out["served_after_corrupt"] == 1 and out["completion_unchanged_after_corrupt"], out
        assert out["refusal_logged"], "a refused version left no line in the server's log"
    finally:
        stop_server(srv, logf)
    return out


if __name__ == "__main__":
    run_as_child(main)
