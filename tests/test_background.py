"""Non-blocking publishing: order, back-pressure, errors surfacing, recovery."""

from __future__ import annotations

import gc
import threading
import time
import uuid

import pytest
import torch

import deltastore as ds
from conftest import chain_states
from deltastore.testing import bits_equal
from deltastore.backends.memory import MemoryBackend
from deltastore.publish.mirror import Diff
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


class GatedBackend(MemoryBackend):
    """A memory backend whose puts wait until ``gate`` is opened; ``entered`` is set once a put is waiting.

    No timing: a test holds the gate closed, checks what ``publish()`` did meanwhile, then opens it.
    """

    def __init__(self):
        super().__init__(uuid.uuid4().hex)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.puts = []  # keys whose write completed, in order
        self.callers = set()

    def put(self, key, data, *, mode="overwrite"):
        self.callers.add(threading.current_thread().name)
        self.entered.set()
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the gate stayed closed for 60 s")
        super().put(key, data, mode=mode)
        self.puts.append(key)


def _states(n, seed=0):
    return chain_states(n, {"w": (128, 64), "b": (64,)}, changes=0.02, seed=seed)


def test_background_publish_keeps_order_and_loses_nothing():
    backend = GatedBackend()
    states = _states(12)
    live = {k: v.clone() for k, v in states[0].items()}  # the "model" the trainer keeps training
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=3, anchor_every=5)
    futures = []
    for i, s in enumerate(states):
        for k in live:
            live[k].copy_(s[k])
        futures.append(pub.publish(live, step=i))
        if i == 0:  # the writer took version 0 and is blocked inside its first put
            assert backend.entered.wait(timeout=30), "the background writer never started writing"
        if i == 3:
            # publish() returned four times while no write could finish: 1 being written + 3 queued
            assert not backend.gate.is_set() and backend.puts == []
            assert not any(f.done() for f in futures)
            assert threading.current_thread().name not in backend.callers  # only the writer writes
            for k in live:  # the trainer moves on: the queued versions must be what was captured
                live[k].view(torch.int16).fill_(0x7F7F)
            backend.gate.set()
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


def _diffs_alive():
    gc.collect()
    return {id(o) for o in gc.get_objects() if type(o) is Diff}


def test_nothing_of_a_written_version_outlives_its_commit():
    """Once the writer has committed what was queued, no captured change is kept (the capture side's record
    of queued versions and the writer's last item included): background memory at rest is the mirror's."""
    before = _diffs_alive()
    backend = GatedBackend()
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=3, anchor_every=100)
    states = _states(5)
    pub.publish(states[0], step=0)
    assert backend.entered.wait(timeout=30)
    for i in range(1, 4):  # queued behind the blocked writer: each compare is corrected by the ones before
        pub.publish(states[i], step=i)
    assert len(_diffs_alive() - before) >= 3
    backend.gate.set()
    pub.flush()
    assert _diffs_alive() - before == set()
    pub.publish(states[4], step=4)
    pub.flush()
    assert _diffs_alive() - before == set()
    sub = ds.Subscriber(DeltaStore(backend))
    target = sub.pull(step=0).state
    for i, s in enumerate(states):
        sub.pull(target, step=i)
        assert bits_equal(target, s)
    pub.close()


def test_back_pressure_bounds_the_queue():
    """With max_pending=1 and the writer blocked, a third publish() waits until the writer moves on."""
    backend = GatedBackend()
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=1, codec="raw", anchor_every=100)
    states = _states(4)
    f0 = pub.publish(states[0], step=0)
    assert backend.entered.wait(timeout=30)  # the writer holds version 0, blocked in a put
    f1 = pub.publish(states[1], step=1)  # one version may wait: returns at once
    assert not f0.done() and not f1.done()
    returned = {}

    def third():
        f = pub.publish(states[2], step=2)
        returned["gate_open"] = backend.gate.is_set()  # when publish() came back
        returned["future"] = f

    t = threading.Thread(target=third)
    t.start()
    t.join(timeout=1.0)  # a publish() that does not wait returns well within this
    assert t.is_alive(), "publish() returned while max_pending versions were already queued"
    backend.gate.set()
    t.join(timeout=30)
    assert not t.is_alive() and returned["gate_open"] is True
    pub.publish(states[3], step=3)
    pub.close()
    assert [f.result().step for f in (f0, f1, returned["future"])] == [0, 1, 2]
    assert ds.Subscriber(DeltaStore(backend)).versions() == list(range(4))


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


def test_background_publish_returns_a_pending_version_info():
    backend = GatedBackend()
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=2, codec="raw", anchor_every=100)
    states = _states(2)
    info = pub.publish(states[0], step=0)
    assert isinstance(info, ds.VersionInfo)  # always a VersionInfo, never a bare Future
    assert (info.step, info.changed, info.total) == (0, 128 * 64 + 64, 128 * 64 + 64)  # known at capture
    assert not info.committed and not info.done() and "pending" in repr(info)
    with pytest.raises(TimeoutError):
        info.wait(timeout=0.05)
    seen = []
    info.add_done_callback(seen.append)
    backend.gate.set()
    committed = info.wait(timeout=30)
    assert info.committed and info.done() and info.exception() is None and seen == [info]
    assert committed.digest == info.digest == ds.Subscriber(DeltaStore(backend)).store.ref(0).digest
    assert info.kind == "anchor" and info.nbytes > 0 and info.warnings == () and info.result() is committed
    pub.close()


def test_pending_version_info_reraises_the_background_error():
    backend = SlowBackend(fail_on=lambda key: key == "versions/000000000001.json")
    pub = ds.Publisher(DeltaStore(backend), background=True, max_pending=4, anchor_every=100)
    states = _states(3)
    infos = [pub.publish(s, step=i) for i, s in enumerate(states)]
    assert infos[0].wait(timeout=10).step == 0
    with pytest.raises(ConnectionError):
        infos[1].wait(timeout=10)
    with pytest.raises(ConnectionError):
        infos[1].digest  # a commit-only field waits too, and raises
    with pytest.raises(RuntimeError, match="dropped"):
        infos[2].wait(timeout=10)
    assert not infos[1].committed and not infos[2].committed and infos[0].committed
    with pytest.raises(ConnectionError):
        pub.close()
