"""The LoRA follower over HTTP (``HTTPLoraControl``) when the server fails: a real HTTP server answering
vLLM's LoRA routes as vLLM does (``vllm_lora_standin.py``; the real engine: ``tests/test_vllm``).

A failed apply must leave the server serving what it served before (the stable alias on the previous
folder, which is still on disk with the previous version's bytes), unload the ``name@step`` it loaded,
remove its folder, and raise a typed error naming the problem.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import deltastore as ds
from conftest import require_module
from deltastore.errors import ApplyError, EngineUnavailableError
from peft_tiny import base_model, lora_model, train
from vllm_lora_standin import LoraServer

peft = require_module("peft")
require_module("transformers")


@pytest.fixture(scope="module")
def adapter_store(tmp_path_factory):
    return adapter_store_at(str(tmp_path_factory.mktemp("lora-http") / "store"))


def adapter_store_at(uri: str) -> str:
    """Versions 0..3 of a real PEFT adapter (``adapter_only=True``) published to ``uri``."""
    model = lora_model(base_model())
    with ds.Publisher(uri, adapter_only=True) as pub:
        pub.publish(model, step=0)
        for k in train(model, 3):
            pub.publish(model, step=k)
    return uri


@pytest.fixture
def server():
    s = LoraServer()
    yield s
    s.close()


def _adapter_bytes(folder: str) -> bytes:
    with open(os.path.join(folder, "adapter_model.safetensors"), "rb") as f:
        return f.read()


def _follower(uri, url, work, **control):
    from deltastore.integrations.vllm_lora import HTTPLoraControl, LoraFollower

    return LoraFollower(HTTPLoraControl(url, **control), uri, work, name="policy", keep=2)


@pytest.mark.parametrize("inplace", [True, False], ids=["vllm with in-place loads", "vllm without"])
def test_a_failed_alias_reload_keeps_serving_the_previous_version(adapter_store, server, tmp_path, inplace):
    server.inplace = inplace
    f = _follower(adapter_store, server.url, tmp_path / "a", alias=True)
    f.apply(1)
    served = server.loaded["policy"]
    before = _adapter_bytes(served)
    assert sorted(server.loaded) == ["policy", "policy@1"]
    failure = server.fail(name="policy", status=500)  # a transient engine error on the alias only
    with pytest.raises(ApplyError, match="answered 500: .*injected engine failure \\(load policy\\)") as e:
        f.apply(2)
    assert failure.fired == 1 and not isinstance(e.value, EngineUnavailableError)
    # the server serves what it served before: the alias on version 1's folder, untouched; policy@2 is gone
    assert server.loaded == {"policy": served, "policy@1": served}
    assert _adapter_bytes(served) == before
    assert f.served_step == 1 and f.status()["last_error"].startswith("ApplyError")
    assert sorted(os.listdir(tmp_path / "a")) == ["policy-000000000001"]  # the new folder is removed
    assert ("/v1/unload_lora_adapter", "policy@2", 200) in server.log
    # the next poll goes through
    assert f.poll_once()["served_step"] == 3
    assert sorted(server.loaded) == ["policy", "policy@1", "policy@3"]
    assert server.loaded["policy"] == server.loaded["policy@3"] != served


def test_an_unreachable_server_is_a_typed_error(adapter_store, server, tmp_path):
    f = _follower(adapter_store, server.url, tmp_path / "a", alias=True, timeout=5)
    f.apply(1)
    url = server.url
    server.close()  # the server is down: connections are refused
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"no answer from the vLLM server \(.*Connection ?[Rr]efused") as e:
        f.apply(2)
    assert time.monotonic() - start < 5
    assert isinstance(e.value, ConnectionError) and isinstance(e.value, ApplyError) and url in str(e.value)
    assert f.served_step == 1 and sorted(os.listdir(tmp_path / "a")) == ["policy-000000000001"]


def test_a_slow_server_times_out_typed_and_what_it_loaded_is_unloaded(adapter_store, server, tmp_path):
    f = _follower(adapter_store, server.url, tmp_path / "a", timeout=0.5)
    f.apply(1)
    release = threading.Event()
    server.fail(name="policy@2", status=0, block=release)  # the engine's load of version 2 hangs, then lands
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="timed out.*timeout 0.5 s"):
        f.apply(2)
    assert time.monotonic() - start < 3  # the load and the unload that follows it, each 0.5 s
    assert f.served_step == 1 and sorted(os.listdir(tmp_path / "a")) == ["policy-000000000001"]
    release.set()  # the load lands late; the unload sent after it (queued on the name's lock) takes it back
    _wait_for(lambda: [r for r in server.log if r[1] == "policy@2"] == [
        ("/v1/load_lora_adapter", "policy@2", 200), ("/v1/unload_lora_adapter", "policy@2", 200)])
    assert sorted(server.loaded) == ["policy@1"]
    assert f.poll_once()["served_step"] == 3


def test_an_unload_that_fails_after_a_failed_load_is_done_at_the_next_load(adapter_store, server, tmp_path):
    f = _follower(adapter_store, server.url, tmp_path / "a", alias=True)
    f.apply(1)
    server.fail(name="policy", status=500)        # the alias's re-load fails ...
    server.fail(name="policy@2", status=503, route="unload")  # ... and so does taking policy@2 back
    with pytest.raises(ApplyError, match="answered 500"):
        f.apply(2)
    assert sorted(server.loaded) == ["policy", "policy@1", "policy@2"]  # left behind, for now
    assert server.loaded["policy"] == server.loaded["policy@1"]  # still serving version 1
    assert f.poll_once()["served_step"] == 3  # the next load unloads it first
    assert sorted(server.loaded) == ["policy", "policy@1", "policy@3"]


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there"
        time.sleep(0.01)


def test_a_refused_load_unloads_nothing_and_names_the_status(adapter_store, server, tmp_path):
    f = _follower(adapter_store, server.url, tmp_path / "a")
    f.apply(1)
    server.loaded["policy@2"] = "/elsewhere"  # loaded by someone else: the load is refused (400), not ours
    with pytest.raises(ApplyError, match="answered 400: .*has already been loaded"):
        f.apply(2)
    assert server.loaded == {"policy@1": str(tmp_path / "a" / "policy-000000000001"), "policy@2": "/elsewhere"}
