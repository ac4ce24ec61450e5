"""Non-blocking publishing: order, back-pressure, errors surfacing, recovery."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

import deltastore as ds
from conftest import bits_equal
from deltastore.backends.memory import MemoryBackend
from deltastore.store import DeltaStore


class SlowBackend(MemoryBackend):
    """A memory backend whose writes take ``delay`` seconds; ``fail_on`` makes matching puts raise."""

    def __init__(self, delay=0.0, fail_on=None):
        super().__init__(uuid.uuid4().hex)
        self.delay = delay
        self.fail_on = fail_on
        self.puts = []

    def put(self, key, data, *, mode="overwrite"):
        time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on(key):
            raise ConnectionError(f"injected failure writing {key}")
        self.puts.append(key)
        super().put(key, data, mode=mode)


def _states(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = {"w": torch.randn(128, 64, generator=g).bfloat16(), "b": torch.randn(64, generator=g).bfloat16()}
    out = [s]
    for _ in range(1, n):
        nxt = {}
        for k, v in out[-1].items():
            bits = v.view(torch.int16).clone()
            bits[torch.rand(bits.shape, generator=g) < 0.02] += 1
            nxt[k] = bits.view(torch.bfloat16)
        out.append(nxt)
    return out


def test_background_publish_keeps_order_and_loses_nothing():
    backend = SlowBackend(delay=0.01)
    states = _states(12)
    live = {k: v.clone() for k, v in states[0].items()}  # the "model" the trainer keeps training
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=3, anchor_every=5)
    futures = []
    t0 = time.perf_counter()
    for i, s in enumerate(states):
        for k in live:
            live[k].copy_(s[k])
        futures.append(pub.publish(live, step=i))
    blocking = time.perf_counter() - t0
    pub.flush()
    infos = [f.result() for f in futures]
    assert [i.step for i in infos] == list(range(12))
    manifests = [k for k in backend.puts if k.startswith("versions/")]
    assert manifests == [f"versions/{i:012d}.json" for i in range(12)]  # committed in publish() order
    sub = ds.Subscriber(DeltaStore(backend))
    target = sub.pull(step=0).state
    for i, s in enumerate(states):
        assert bits_equal(sub.pull(step=i).state, s)  # each version is what was captured, not the live tensors
        sub.pull(target, step=i)
        assert bits_equal(target, s)
    pub.close()
    assert blocking < sum(1 for _ in backend.puts) * backend.delay  # the loop did not wait for every write


def test_back_pressure_bounds_the_queue():
    backend = SlowBackend(delay=0.05)
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=1, codec="raw", anchor_every=100)
    states = _states(6)
    pub.publish(states[0], step=0).result()
    inflight = []
    for i in range(1, 6):
        pub.publish(states[i], step=i)
        inflight.append(pub._queue.qsize())
    assert max(inflight) <= 1
    pub.close()
    assert ds.Subscriber(DeltaStore(backend)).versions() == list(range(6))


def test_background_error_surfaces_and_the_next_publish_recovers():
    failing = {"armed": True}

    def fail(key):
        if key == "versions/000000000003.json" and failing["armed"]:
            failing["armed"] = False
            return True
        return False

    backend = SlowBackend(fail_on=fail)
    states = _states(8)
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=4, anchor_every=100)
    f = [pub.publish(states[i], step=i) for i in range(5)]
    with pytest.raises(ConnectionError):
        f[3].result(timeout=10)
    with pytest.raises(RuntimeError, match="dropped"):
        f[4].result(timeout=10)
    with pytest.raises(ConnectionError):  # surfaced to the training loop on the next call
        pub.publish(states[5], step=5)
    info = pub.publish(states[5], step=5).result(timeout=10)
    assert info.kind == "anchor"  # a new chain from the committed state
    pub.publish(states[6], step=6)
    pub.close()
    sub = ds.Subscriber(DeltaStore(backend))
    assert sub.versions() == [0, 1, 2, 5, 6]
    for i in sub.versions():
        assert bits_equal(sub.pull(step=i).state, states[i])


def test_flush_and_close_raise_background_errors():
    backend = SlowBackend(fail_on=lambda key: key.startswith("versions/000000000001"))
    pub = ds.Publisher(DeltaStore(backend), background=True)
    states = _states(2)
    pub.publish(states[0], step=0)
    pub.publish(states[1], step=1)
    with pytest.raises(ConnectionError):
        pub.flush()
    pub.publish(states[1], step=2)
    backend.fail_on = lambda key: key.startswith("versions/000000000003")
    pub.publish(states[0], step=3)
    with pytest.raises(ConnectionError):
        pub.close()
    assert ds.Subscriber(DeltaStore(backend)).versions() == [0, 2]


def test_mirror_device_cpu_is_accepted_and_sync_mode_unchanged(memory_uri):
    states = _states(3)
    with ds.Publisher(memory_uri, mirror_device="cpu") as pub:
        for i, s in enumerate(states):
            assert pub.publish(s, step=i).step == i
    assert bits_equal(ds.Subscriber(memory_uri).pull().state, states[2])
