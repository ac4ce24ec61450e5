"""A synchronous publish moves the mirror to the new version in the compare's own pass: every failure after that
moves it back, so the same step can be published again and every version pulls bit-exact."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore import segments
from deltastore.backends.memory import MemoryBackend
from deltastore.store import DeltaStore
from deltastore.testing.faults import Fault, FaultyBackend


def _states(n, seed=0, shapes=((64, 32), (32,), (300,))):
    g = torch.Generator().manual_seed(seed)
    s = {f"t{i}": torch.randn(*shape, generator=g).bfloat16() for i, shape in enumerate(shapes)}
    out = [s]
    for _ in range(1, n):
        nxt = {}
        for k, v in out[-1].items():
            bits = v.view(torch.int16).clone()
            bits[torch.rand(bits.shape, generator=g) < 0.05] += 1
            nxt[k] = bits.view(torch.bfloat16)
        out.append(nxt)
    return out


def _pulls_bit_exact(inner, states):
    sub = ds.Subscriber(DeltaStore(inner))
    target = sub.pull(step=0).state
    for step in range(1, len(states)):
        sub.pull(target, step=step)
        assert bits_equal(target, states[step]), step


@pytest.mark.parametrize("codec", ["auto", {"id": "auto", "config": {"link_mbps": None}}, "ulp"])
def test_a_delta_whose_upload_fails_leaves_the_mirror_at_the_parent(codec):
    inner = MemoryBackend(uuid.uuid4().hex)
    faulty = FaultyBackend(inner)
    states = _states(4)
    with ds.Publisher(DeltaStore(faulty), codec=codec, anchor_every=100) as pub:
        pub.publish(states[0], step=0)
        faulty.rules.append(Fault("permanent", ops="put", prefix="objects/", limit=1))  # the delta's object
        with pytest.raises(PermissionError):
            pub.publish(states[1], step=1)
        assert bits_equal({n: pub._mirror.view(n).view(torch.bfloat16).reshape(t.shape) for n, t in states[0].items()},
                          states[0])
        for step in (1, 2, 3):
            pub.publish(states[step], step=step)
    _pulls_bit_exact(inner, states)


def test_a_failed_manifest_write_after_a_fused_compare_can_be_retried_with_other_weights():
    inner = MemoryBackend(uuid.uuid4().hex)
    faulty = FaultyBackend(inner, rules=[Fault("permanent", ops="put", prefix="versions/", skip=1, limit=1)])
    states = _states(3)
    other = _states(3, seed=5)[1]
    with ds.Publisher(DeltaStore(faulty), anchor_every=100) as pub:
        pub.publish(states[0], step=0)
        with pytest.raises(PermissionError):
            pub.publish(other, step=1)  # compared (and the mirror advanced) against step 0, then not committed
        pub.publish(states[1], step=1)
        pub.publish(states[2], step=2)
    _pulls_bit_exact(inner, states)


@pytest.mark.parametrize("fail_at", [1, 2])
def test_diff_segments_that_fail_part_way_put_back_what_they_advanced(monkeypatch, fail_at):
    """An output buffer that cannot be allocated (after some were filled, on two threads) leaves the olds as
    they were; without the failure the olds hold the news."""
    monkeypatch.setenv("DELTASTORE_THREADS", "2")
    monkeypatch.setattr(segments, "MIN_CHUNK", 512)
    rng = np.random.default_rng(fail_at)
    olds = [torch.from_numpy(rng.integers(-2**15, 2**15, n, dtype=np.int16)) for n in (50000, 7, 60000)]
    news = [o.clone() for o in olds]
    for t in news:
        t[torch.from_numpy(rng.random(t.numel()) < 0.3)] += 1
    keys = np.arange(3, dtype=np.uint64)
    before = [o.clone() for o in olds]
    real, calls = np.empty, {"n": 0}

    def failing_empty(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3 * fail_at + 1:  # three arrays per buffer: the buffer after fail_at of them
            raise MemoryError("no room")
        return real(*a, **k)

    monkeypatch.setattr(segments.np, "empty", failing_empty)
    with pytest.raises(MemoryError):
        segments.diff_segments(olds, news, keys, hint=0.0, advance=True)
    monkeypatch.setattr(segments.np, "empty", real)
    assert all(torch.equal(o, b) for o, b in zip(olds, before))
    fc = segments.diff_segments(olds, news, keys, hint=0.0, advance=True)
    assert all(torch.equal(o, n) for o, n in zip(olds, news))
    for o, n, ch in zip(before, news, fc.changes()):
        idx = torch.nonzero(o != n).squeeze(1)
        assert torch.equal(ch.positions, idx) and torch.equal(ch.old_bits, o[idx]) and torch.equal(ch.new_bits, n[idx])


def test_a_cast_compare_advances_and_moves_back_too():
    """An fp32 master published as bf16 is compared tensor by tensor (the loose path): advanced in the compare
    as well, moved back when the delta's upload fails, every version pulled bit-exact."""
    inner = MemoryBackend(uuid.uuid4().hex)
    faulty = FaultyBackend(inner)
    g = torch.Generator().manual_seed(3)
    masters = [{"w": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g)}]
    for _ in range(3):
        masters.append({k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in masters[-1].items()})
    states = [{k: v.bfloat16() for k, v in m.items()} for m in masters]
    with ds.Publisher(DeltaStore(faulty), dtype=torch.bfloat16, anchor_every=100) as pub:
        pub.publish(masters[0], step=0)
        faulty.rules.append(Fault("permanent", ops="put", prefix="objects/", limit=1))
        with pytest.raises(PermissionError):
            pub.publish(masters[1], step=1)
        for step in (1, 2, 3):
            pub.publish(masters[step], step=step)
    _pulls_bit_exact(inner, states)
