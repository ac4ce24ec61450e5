"""Real-engine check of signed versions (vLLM CPU build): run with the vLLM virtualenv's python, not under pytest.

    .venv-vllm/bin/python tests/test_vllm/signed_check.py WORKDIR

1. builds the tiny Qwen2 of engine_check.py, a key pair (``deltastore keygen``), and publishes versions 0..3
   signed;
2. starts an engine with the worker extension and ``DELTASTORE_TRUSTED_KEYS`` naming the public key (the
   workers pin it whatever a caller passes); identifies it as version 0;
3. a pull-only Follower with ``trusted_keys`` applies version 3 (deltas 1..3);
4. someone with write access but without the key commits version 4 unsigned: the follower refuses it
   (``refs/latest`` unsigned, then, with the signed ref put back, version 4 unsigned), a direct pull without
   keys is refused by the workers themselves, and the engine keeps serving version 3 bit-exactly (verify
   passes, same greedy outputs and logprobs).

Writes WORKDIR/result.json; exit 0 when every check passed, 3 when vLLM is not importable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from engine_check import FRACTION, build_model, expect_error, generate, log, make_llm, run_as_child
from fake_vllm_model import perturb


def main(work: str) -> int:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"vllm not importable: {e!r}", file=sys.stderr)
        return 3
    from safetensors.torch import load_file

    import deltastore as ds
    import deltastore.integrations.vllm as dv

    checks: dict = {}
    os.makedirs(work, exist_ok=True)
    base, uri, key = (os.path.join(work, n) for n in ("base", "store", "key"))
    for d in (base, uri):
        shutil.rmtree(d, ignore_errors=True)
    build_model(base)
    subprocess.run([sys.executable, "-m", "deltastore", "keygen", key, "--public-format", "openssh"], check=True)
    pub_key = key + ".pub"
    state = load_file(os.path.join(base, "model.safetensors"))
    with ds.Publisher(uri, anchor_every=5, signing_key=key) as pub:
        pub.publish(state, step=0)
        for step in range(1, 5):
            state = perturb(state, FRACTION, 500 + step)
            if step < 4:
                pub.publish(state, step=step)
    v4 = state
    log("published signed versions 0..3")

    os.environ["DELTASTORE_TRUSTED_KEYS"] = pub_key  # inherited by the engine's workers
    llm = make_llm(base, extension=True)
    ident = llm.collective_rpc("deltastore_identify", kwargs={"uri": uri, "step": 0})[0]
    assert ident["step"] == 0, ident
    fol = dv.Follower(dv.LLMControl(llm), uri, poll_interval=0.1, trusted_keys=[pub_key], max_latest_age=600)
    r = fol.poll_once()
    assert r is not None and r["step"] == 3 and r["route"] == "delta", r
    dv.verify(llm)
    checks["follower_applied_3"] = {"result": r, "status": fol.status()}
    served = generate(llm)

    signed_latest = open(os.path.join(uri, "refs", "latest"), "rb").read()
    with ds.Publisher(uri) as pub:  # resumes at 3, no signing key
        pub.publish(v4, step=4)
    checks["unsigned_latest_refused"] = expect_error(fol.poll_once, "UnsignedVersionError")
    with open(os.path.join(uri, "refs", "latest"), "wb") as f:  # the signed ref as it was
        f.write(signed_latest)
    checks["unsigned_version_refused"] = expect_error(fol.poll_once, "UnsignedVersionError")
    assert "version 4 is unsigned" in checks["unsigned_version_refused"], checks["unsigned_version_refused"]
    checks["follower_last_error"] = fol.last_error
    # a caller that passes no keys: the workers' DELTASTORE_TRUSTED_KEYS refuses it all the same
    checks["worker_refuses_without_keys"] = expect_error(lambda: dv.pull(llm, uri, 4), "UnsignedVersionError")
    assert fol.served_step == 3 and dv.version(llm)["step"] == 3
    dv.verify(llm)
    checks["outputs_unchanged"] = generate(llm) == served
    assert checks["outputs_unchanged"], "the engine's outputs changed after refusing an unsigned version"
    with open(os.path.join(work, "result.json"), "w") as f:
        json.dump({"ok": True, "checks": checks}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    run_as_child(main)
