"""Structural memory bounds of the publish and pull paths (what is held, not how much RSS: that is
``bench/scale.py``'s job): one mirror in background mode, codecs reading views instead of copies, anchors
encoded and fetched a bounded number of objects at a time."""

from __future__ import annotations

import gc
import threading
import uuid

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import deltastore as ds
from conftest import chain_states
import deltastore.publish.objects as objects_mod
from deltastore.testing import bits_equal
from deltastore.pull import tracking
from deltastore.backends.memory import MemoryBackend
from deltastore.codecs import register_codec
from deltastore.codecs.ctx import CtxCodec
from deltastore.codecs.dense import DenseCodec
from deltastore.publish.mirror import Mirror
from deltastore.store import DeltaStore


def _states(n=4, size=30_000, tensors=6, seed=0):
    return chain_states(n, {f"t{i}": (size,) for i in range(tensors)}, changes=0.03, seed=seed)


class _SpyCtx(CtxCodec):
    """ctx, recording where the old tensors it is handed live."""

    codec_id = "test-spy-ctx"
    encoded: list[int] = []
    decoded: list[int] = []

    def encode(self, updates):
        _SpyCtx.encoded += [u.old_tensor.data_ptr() for u in updates]
        return super().encode(updates)

    def decode(self, data, specs, old=None):
        def spy(name, positions):
            t = old(name, positions)
            if positions is None:
                _SpyCtx.decoded.append(t.data_ptr())
            return t
        return super().decode(data, specs, spy)


register_codec(_SpyCtx.codec_id, _SpyCtx, clobber=True)


def test_codecs_read_the_mirror_and_the_target_in_place(memory_uri):
    """No whole-tensor copy per step: the encoder gets views of the mirror, the decoder views of the target."""
    states = _states()
    pub = ds.Publisher(memory_uri, codec=_SpyCtx(), anchor_every=100)
    pub.publish(states[0], step=0)
    mirror_ptrs = {pub._mirror.view(n).data_ptr() for n in states[0]}
    _SpyCtx.encoded.clear()
    pub.publish(states[1], step=1)
    assert _SpyCtx.encoded and set(_SpyCtx.encoded) <= mirror_ptrs
    pub.close()
    sub = ds.Subscriber(memory_uri)
    target = {k: v.clone() for k, v in states[0].items()}
    sub.identify(target, 0)
    _SpyCtx.decoded.clear()
    sub.pull(target, step=1)
    assert bits_equal(target, states[1])
    assert _SpyCtx.decoded and set(_SpyCtx.decoded) <= {t.data_ptr() for t in target.values()}


def test_background_mode_holds_one_mirror():
    states = _states(6)
    pub = ds.Publisher(f"memory://{uuid.uuid4().hex}", background=True, anchor_every=3)
    for i, s in enumerate(states):
        pub.publish(s, step=i)
    pub.flush()
    gc.collect()
    mirrors = [o for o in gc.get_objects() if type(o) is Mirror]
    assert mirrors == [pub._mirror] and pub._capture_mirror is pub._mirror
    model = sum(v.numel() * v.element_size() for v in states[0].values())
    assert pub._mirror.nbytes <= model + 64 * len(states[0])
    pub.close()


@pytest.mark.parametrize("background", [False, True])
def test_nothing_keeps_a_models_tensors_once_its_publisher_and_subscriber_are_gone(background):
    """Once the caller drops them, the publisher's source tensors, the follower's target and every
    stage between are freed: a cache keyed by the tensor (found on an H100 keeping a 14 GB model's
    targets after the run) fails this."""
    uri = f"memory://{uuid.uuid4().hex}"
    states = _states(3)
    pub = ds.Publisher(uri, background=background, anchor_every=2)
    sub = ds.Subscriber(uri)
    # weakly tracked, as a pull without a target returns it (a plain dict is held on purpose: tracking.py)
    target = tracking.StateDict({k: torch.zeros_like(v) for k, v in states[0].items()})
    for i, s in enumerate(states):
        pub.publish(s, step=i)
        pub.flush()
        sub.pull(target, step=i)
        assert bits_equal(target, s)
    pub.close()
    sub.close()
    # the storages, not the tensor objects: a kept view (an int16 view of a target) holds the memory too
    refs = {f"{where}.{k}": StorageWeakRef(t.untyped_storage())
            for where, d in [*((f"state{i}", s) for i, s in enumerate(states)), ("target", target)]
            for k, t in d.items()}
    del pub, sub, states, target, s
    gc.collect()
    alive = sorted(k for k, r in refs.items() if not r.expired())
    assert not alive, f"{len(alive)} of {len(refs)} tensors' memory still held: {alive}"


def test_anchor_objects_are_encoded_a_few_at_a_time(memory_uri, monkeypatch):
    """A large anchor becomes many objects; no more than the in-flight bound are encoded at once."""
    monkeypatch.setattr(objects_mod, "ANCHOR_OBJECT_MIN", 60_000)
    states = _states(2, size=30_000, tensors=40)  # 2.4 MB of bf16: 40 objects of 60 kB
    live = 0
    peak = 0
    lock = threading.Lock()

    class Counting(DenseCodec):
        def encode(self, updates):
            nonlocal live, peak
            with lock:
                live += 1
                peak = max(peak, live)
            try:
                return super().encode(updates)
            finally:
                with lock:
                    live -= 1

    pub = ds.Publisher(memory_uri, anchor_codec=Counting(planes=True), max_workers=8)
    object_bytes, inflight = pub.planner.anchor_streaming(pub._normalise(states[0])[1])
    info = pub.publish(states[0], step=0)
    pub.close()
    m = ds.Subscriber(memory_uri).manifest(0)
    assert info.kind == "anchor" and len(m.full_objects) >= 20
    assert object_bytes == 60_000 and 1 <= peak <= inflight < 8


def test_anchor_pull_fetches_a_bounded_window_and_prefetches_no_anchor_object():
    backend = MemoryBackend(uuid.uuid4().hex)
    states = _states(3, size=30_000, tensors=12)
    with ds.Publisher(DeltaStore(backend), anchor_every=100, max_object_bytes=70_000) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    store = DeltaStore(backend)
    m = store.manifest(0)
    full = {m.objects[i].digest for i in m.full_objects}
    assert len(full) >= 6
    state = {"live": 0, "peak": 0}
    lock = threading.Lock()
    original_get = backend.get

    def counting_get(key):
        with lock:
            state["live"] += 1
            state["peak"] = max(state["peak"], state["live"])
        try:
            return original_get(key)
        finally:
            with lock:
                state["live"] -= 1

    backend.get = counting_get
    prefetched: list[str] = []
    original_prefetch = store.prefetch

    def spy_prefetch(wanted, **kw):
        prefetched.extend(d for d, _ in wanted)
        return original_prefetch(wanted, **kw)

    store.prefetch = spy_prefetch
    sub = ds.Subscriber(store, max_workers=3)
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    tracking.set_version(target, None)
    res = sub.pull(target, step=2)
    assert res.path == "anchor" and bits_equal(target, states[2])
    assert not full & set(prefetched)  # anchors are streamed, never parked in the read cache
    assert state["peak"] <= 3
