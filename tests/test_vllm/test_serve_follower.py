"""``FollowStore`` (the follower inside ``vllm serve``) as an ASGI middleware, without vLLM.

The engine client here answers like vLLM's ``AsyncLLM`` does (async
``pause_generation``/``resume_generation``/``collective_rpc``/``reset_prefix_cache``/
``update_weight_version``) by running a real :class:`VllmApplier` on a
vLLM-shaped CPU model, so the follower's pulls are real and bit-checked. The
real server runs it in ``serve_check.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import deltastore as ds
from deltastore.integrations.vllm import VllmApplier
from deltastore.integrations.vllm.serve_follower import FollowStore

from .fake_vllm_model import loaded_model, perturb, random_checkpoint
from .test_mapping import same_params


class EngineClient:
    def __init__(self, model):
        self.applier = VllmApplier(model, None, path="sparse")
        self.applier.allow_cpu_sparse = True
        self.calls: list = []
        self.version = None

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode))

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self):
        self.calls.append("reset")

    async def update_weight_version(self, label):
        self.version = label

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kw = dict(kwargs or {})
        kw.pop("raise_errors", None)
        self.calls.append(method)
        try:
            if method == "deltastore_pull":
                return [self.applier.pull(kw.pop("uri"), kw.pop("step"), **kw)]
            if method == "deltastore_prefetch":
                return [self.applier.prefetch(kw.pop("uri"), kw.pop("step"), **kw)]
            if method == "deltastore_version":
                return [self.applier.describe()]
            if method == "deltastore_verify":
                return [self.applier.verify_local()]
        except Exception as e:  # noqa: BLE001 - as the worker extension answers with raise_errors=False
            return [{"error": {"type": type(e).__name__, "message": str(e)}}]
        raise AssertionError(method)


class State:
    pass


class App:
    """The inner ASGI app: answers the lifespan protocol, as Starlette does."""

    def __init__(self, engine_client):
        self.state = State()
        self.state.engine_client = engine_client

    async def __call__(self, scope, receive, send):
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def _serve(app, mw, until, timeout=30.0):
    """Run the lifespan through ``mw`` until ``until()`` holds, then shut down."""
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        await q.put({"type": "lifespan.startup"})
        sent = []

        async def send(m):
            sent.append(m["type"])
        task = asyncio.create_task(mw({"type": "lifespan", "app": app}, q.get, send))
        t0 = time.monotonic()
        while not until() and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.05)
        await q.put({"type": "lifespan.shutdown"})
        await task
        return sent
    return asyncio.run(main())


def test_follow_store_keeps_the_engine_on_the_newest_version(tmp_path, monkeypatch):
    uri, status = str(tmp_path / "store"), tmp_path / "served.json"
    vs = [random_checkpoint(21)]
    for i in range(2):
        vs.append(perturb(vs[-1], 0.02, 300 + i))
    with ds.Publisher(uri, anchor_every=100) as pub:
        for step, ck in enumerate(vs):
            pub.publish(ck, step=step)
    for k, v in {"DELTASTORE_FOLLOW_URI": uri, "DELTASTORE_FOLLOW_POLL": "0.05",
                 "DELTASTORE_FOLLOW_STATUS_FILE": str(status), "DELTASTORE_FOLLOW_VERIFY": "1"}.items():
        monkeypatch.setenv(k, v)
    served = loaded_model(random_checkpoint(5))
    ec = EngineClient(served)
    app = App(ec)
    mw = FollowStore(app)
    sent = _serve(app, mw, lambda: status.exists() and json.loads(status.read_text())["served_step"] == 2)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    st = json.loads(status.read_text())
    assert st["served_step"] == 2 and st["result"]["verify"]["ok"] is True
    assert same_params(served, loaded_model(vs[2])) and ec.version == "2"
    i = ec.calls.index("deltastore_pull")  # prefetch while serving, then pause (keep), pull, reset, resume
    assert ec.calls[i - 2:i + 4] == ["deltastore_prefetch", ("pause", "keep"), "deltastore_pull",
                                     "deltastore_verify", "reset", "resume"]
    assert mw._stop.is_set()


def test_follow_store_needs_a_uri(monkeypatch):
    monkeypatch.delenv("DELTASTORE_FOLLOW_URI", raising=False)
    app = App(object())
    with pytest.raises(ValueError, match="DELTASTORE_FOLLOW_URI"):
        _serve(app, FollowStore(app), lambda: True)
