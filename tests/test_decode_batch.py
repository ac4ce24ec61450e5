"""Flat batches on the pull path (``Codec.decode_batch``): what ``decode`` returns, validated in one pass
per batch, staged without an object per tensor, and refused with a typed error when a decoder lies."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch

import deltastore as ds
from conftest import step_bits
from deltastore import segments
from deltastore.pull import tracking
from deltastore.pull.staging import _Pending, _PendingMap
from deltastore.codecs import TensorSpec, Update, UpdateBatch, WrittenBatch, get_codec, register_codec
from deltastore.codecs.auto import AutoCodec
from deltastore.codecs.base import decode_batched, encode_batched
from deltastore.codecs.raw import RawCodec
from deltastore.codecs.ulp import UlpCodec
from deltastore.pull.decoded import DecodedUpdates
from deltastore.registry import codecs as codec_registry

SPARSE = ("auto", "ulp", "zstd", "raw", "ctx")


def _case(rng: np.random.Generator, n: int) -> tuple[list[Update], dict[str, torch.Tensor]]:
    """``n`` sparse updates of mixed element kinds under shuffled names, with the receiver's old tensors."""
    names = random.Random(int(rng.integers(1 << 30))).sample([f"layer.{i}.w" for i in range(3 * n)], n)
    updates, olds = [], {}
    for name in names:
        dtype = [torch.bfloat16, torch.float16, torch.int16][int(rng.integers(3))]
        numel = int(rng.integers(1, 600))
        count = int(rng.integers(0, numel + 1)) if rng.random() < 0.4 else int(rng.integers(0, max(1, numel // 20)))
        p = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
        whole = rng.integers(-2**15, 2**15, numel).astype(np.int16)
        new = whole[p] + (rng.integers(1, 4, count) * rng.choice([-1, 1], count)).astype(np.int16)
        olds[name] = torch.from_numpy(whole)
        updates.append(Update(TensorSpec(name, dtype, (numel,)), torch.from_numpy(new.astype(np.int16)),
                              torch.from_numpy(p), torch.from_numpy(whole[p]), olds[name]))
    return updates, olds


def _reader(olds: dict[str, torch.Tensor]):  # noqa: ANN202
    def old(name: str, positions: torch.Tensor | None) -> torch.Tensor:
        return olds[name] if positions is None else olds[name][positions]
    return old


@pytest.mark.parametrize("codec_id", [*SPARSE, "auto-bytes-first"])
def test_decode_batch_returns_what_decode_returns(codec_id):
    codec = AutoCodec(link_mbps=None) if codec_id == "auto-bytes-first" else get_codec(codec_id)
    rng = np.random.default_rng(abs(hash(codec_id)) % 2**32)
    for n in (1, 3, 25):
        updates, olds = _case(rng, n)
        data = codec.encode(updates)
        specs = [u.spec for u in updates]
        want = codec.decode(data, specs, _reader(olds))
        batches = codec.decode_batch(data, specs, _reader(olds))
        seen = [s.name for b in batches for s in b.specs]
        assert sorted(seen) == sorted(s.name for s in specs)  # every tensor once
        for b in batches:
            assert b.bounds.shape == (len(b.specs) + 1,) and int(b.bounds[-1]) == b.bits.numel() == b.positions.numel()
            assert {s.bits_dtype for s in b.specs} <= {b.bits.dtype}, "a batch holds one bits dtype"
            for u in b.updates():
                w = want[u.spec.name]
                assert torch.equal(u.positions, w.positions), u.spec.name
                assert torch.equal(u.bits.view(torch.int16), w.bits.view(torch.int16)), u.spec.name


def test_auto_returns_its_ulp_part_as_the_decoder_made_it_and_joins_the_rest():
    """The mixed object: ctx and dense tensors (bytes first) come back joined, ulp ones as ulp's batches."""
    rng = np.random.default_rng(3)
    updates, olds = _case(rng, 40)
    updates = [u if i % 2 else Update(u.spec, u.bits, u.positions, u.old_bits) for i, u in enumerate(updates)]
    codec = AutoCodec(link_mbps=None)  # ctx where an old tensor is given, ulp elsewhere
    data = codec.encode(updates)
    batches = codec.decode_batch(data, [u.spec for u in updates], _reader(olds))
    assert len(batches) > 1
    ulp_only = {u.spec.name for i, u in enumerate(updates) if not i % 2}
    assert any({s.name for s in b.specs} <= ulp_only for b in batches)


class _SpyUlp(UlpCodec):
    codec_id = "test-spy-ulp"
    calls: list[str] = []

    def decode(self, data, specs, old=None):
        _SpyUlp.calls.append("decode")
        return super().decode(data, specs, old)

    def encode(self, updates):
        _SpyUlp.calls.append("encode")
        return super().encode(updates)


class _BatchUlp(_SpyUlp):
    codec_id = "test-batch-ulp"

    def decode_batch(self, data, specs, old=None):
        _SpyUlp.calls.append("decode_batch")
        return UlpCodec.decode_batch(self, data, specs, old)


def test_a_subclass_overriding_decode_or_encode_alone_is_never_bypassed():
    rng = np.random.default_rng(5)
    updates, olds = _case(rng, 6)
    batch = UpdateBatch.join([Update(u.spec, u.bits, u.positions) for u in updates])
    batch.old_bits = segments.cat([u.old_bits for u in updates])
    _SpyUlp.calls.clear()
    data = encode_batched(_SpyUlp(), batch)
    got = decode_batched(_SpyUlp(), data, [u.spec for u in updates], _reader(olds))
    assert _SpyUlp.calls == ["encode", "decode"]
    assert sum(len(b.specs) for b in got) == len(updates)
    _SpyUlp.calls.clear()
    decode_batched(_BatchUlp(), data, [u.spec for u in updates], _reader(olds))
    assert _SpyUlp.calls == ["decode_batch"]  # its own batch method: defined below its decode


def test_decoded_updates_read_as_a_mapping():
    a = UpdateBatch.join([Update(TensorSpec("a", torch.bfloat16, (5,)), torch.tensor([1, 2], dtype=torch.int16),
                                 torch.tensor([0, 3])),
                          Update(TensorSpec("b", torch.bfloat16, (4,)), torch.tensor([7], dtype=torch.int16),
                                 torch.tensor([2]))])
    loose = {"c": Update(TensorSpec("c", torch.bfloat16, (2,)), torch.tensor([9], dtype=torch.int16), torch.tensor([1]))}
    d = DecodedUpdates([a], loose)
    assert list(d) == ["a", "b", "c"] and len(d) == 3 and "b" in d and "z" not in d
    assert d["b"].positions.tolist() == [2] and d["b"].bits.tolist() == [7] and d["b"].spec.name == "b"
    assert d["a"].positions.tolist() == [0, 3] and d["c"] is loose["c"]
    assert d.get("z") is None
    with pytest.raises(KeyError):
        d["z"]


def test_pending_map_makes_an_entry_only_when_asked():
    pos, bits, orig = torch.tensor([1, 4, 0, 2, 3]), torch.arange(5, dtype=torch.int16), torch.zeros(5, dtype=torch.int16)
    m = _PendingMap()
    m.add_batch((["x", "y"], pos, bits, orig, np.array([0, 2, 5])))
    assert m.counts() == {"x": 2, "y": 3} and len(m) == 2 and set(m) == {"x", "y"}
    assert not m._items  # nothing made yet
    y = m["y"]
    assert y.positions.tolist() == [0, 2, 3] and y.bits.tolist() == [2, 3, 4]
    x = m["x"]  # a segment with another after it: cut at its own end
    assert x.positions.tolist() == [1, 4] and x.bits.tolist() == [0, 1] and x.original.tolist() == [0, 0]
    m["x"] = _Pending(torch.tensor([9]), torch.tensor([1], dtype=torch.int16), torch.tensor([0], dtype=torch.int16))
    assert m.counts() == {"x": 1, "y": 3}
    del m["y"]
    assert set(m) == {"x"} and m.pop("x").positions.tolist() == [9] and not m
    with pytest.raises(KeyError):
        del m["x"]


def _state(n: int = 50, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"block.{i}.w": (torch.randn(16 + i, 9, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}
    out["scale"] = torch.ones(40, dtype=torch.float16)
    return out


def _step(state: dict[str, torch.Tensor], g: torch.Generator, share: float = 0.05) -> None:
    for v in state.values():
        hit = torch.rand(v.shape, generator=g) < share
        step_bits(v.view(torch.int16), hit, g)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


@pytest.mark.parametrize("codec_id", ["auto", "ulp", "raw"])
def test_a_delta_pull_stages_batches_without_an_update_per_tensor(memory_uri, monkeypatch, codec_id):
    """One delta: nothing per tensor (no Update, no staged entry); several behind: later deltas merge by
    name. Both bit-exact."""
    g = torch.Generator().manual_seed(1)
    state = _state()
    pub = ds.Publisher(memory_uri, codec=codec_id, anchor_every=100)
    pub.publish(state, step=0)
    target = {k: v.clone() for k, v in state.items()}
    ds.Subscriber(memory_uri).pull(target, step=0)
    lagging = {k: v.clone() for k, v in state.items()}
    lag_sub = ds.Subscriber(memory_uri)
    lag_sub.pull(lagging, step=0)
    made = []
    monkeypatch.setattr(UpdateBatch, "updates", lambda self, idxs=None, _f=UpdateBatch.updates:
                        made.append(len(self.specs) if idxs is None else len(idxs)) or _f(self, idxs))
    monkeypatch.setattr(_PendingMap, "__getitem__", lambda self, name, _f=_PendingMap.__getitem__:
                        made.append(name) or _f(self, name))
    sub = ds.Subscriber(memory_uri)
    sub.pull(target, step=0)
    for step in range(1, 4):
        _step(state, g)
        pub.publish(state, step=step)
        made.clear()
        res = sub.pull(target, step=step, allow_anchor=False)
        assert _equal(target, state), step
        assert res.path == "delta"
        if codec_id != "raw":  # raw's decode is per tensor: the default decode_batch joins it
            assert not made, f"step {step}: {len(made)} per-tensor objects made"
        m = sub.manifest(step)
        assert set(res.written) == {r.name for r in m.tensors if r.changed} and sum(res.written.values()) == m.changed
    pub.close()
    res = lag_sub.pull(lagging, step=3, allow_anchor=False)  # three deltas: the later ones merge by name
    assert res.versions_applied == [1, 2, 3] and _equal(lagging, state)


class _Lying(RawCodec):
    """raw, whose batches are bent one way (``how``) after decoding."""

    codec_id = "test-lying-raw"
    how = ""

    def decode_batch(self, data, specs, old=None):
        got = RawCodec.decode_batch(self, data, specs, old)
        b = max(got, key=lambda x: x.bits.numel())
        how = _Lying.how
        if how == "count":
            b.bounds = b.bounds.copy()
            b.bounds[1] += 1
            b.bounds[1] = min(b.bounds[1], b.bounds[-1])
        elif how == "bounds":
            b.bounds = b.bounds[:-1]
        elif how == "missing":
            b.specs, b.bounds = b.specs[1:], b.bounds[1:] - b.bounds[1]
            b.positions, b.bits = b.positions[int(got[0].bounds[1]):], b.bits[int(got[0].bounds[1]):]
        elif how == "order":
            b.positions = b.positions.flip(0).contiguous()
        elif how == "range":
            b.positions = b.positions.clone()
            b.positions[-1] = 10**9
        elif how == "dtype":
            b.bits = b.bits.to(torch.int32)
        elif how == "length":
            b.bits = b.bits[:-1]
        elif how == "numpy":
            b.bits = b.bits.numpy()
        elif how == "not-a-list":
            return {"batch": b}
        return got


class _LyingInPlace(UlpCodec):
    """ulp, whose batch written in place (the row path of a follower one behind) is described falsely
    (``how``) after the writes."""

    codec_id = "test-lying-in-place"
    how = ""

    def decode_batch(self, data, specs, old=None):
        got = UlpCodec.decode_batch(self, data, specs, old)
        (b,) = got
        assert isinstance(b, WrittenBatch)
        how = _LyingInPlace.how
        if how == "count":
            bounds = b.bounds.copy()
            bounds[1] -= 1
            return [WrittenBatch(b.specs, bounds, b.target)]
        if how == "bounds":
            return [WrittenBatch(b.specs, b.bounds[:-1], b.target)]
        if how == "specs":  # the same tensors, named in another order than they were written
            return [WrittenBatch(list(reversed(b.specs)), b.bounds, b.target)]
        return got


_NAMED = {"count": "changed elements decoded, manifest says|malformed bounds", "dtype": "decoded bits are torch.int32",
          "order": "not strictly increasing", "range": "not strictly increasing", "length": "disagree",
          "bounds": "malformed bounds", "missing": "decoded tensors|failed on object",
          "specs": "changed elements decoded, manifest says"}


@pytest.mark.parametrize("liar, how", [(_Lying, h) for h in ["count", "bounds", "missing", "order", "range", "dtype",
                                                             "length", "numpy", "not-a-list"]]
                         + [(_LyingInPlace, h) for h in ["count", "bounds", "specs"]])
def test_a_decoder_lying_in_its_batch_is_a_typed_error_and_the_target_keeps_its_version(memory_uri, liar, how):
    register_codec(liar.codec_id, liar, clobber=True)
    try:
        g = torch.Generator().manual_seed(2)
        state = {k: v for k, v in _state(6).items() if k.startswith("block")}
        pub = ds.Publisher(memory_uri, codec=liar.codec_id, anchor_every=100)
        pub.publish(state, step=0)
        before = {k: v.clone() for k, v in state.items()}
        _step(state, g, share=0.3)
        pub.publish(state, step=1)
        pub.close()
        sub = ds.Subscriber(memory_uri)
        target = {k: v.clone() for k, v in before.items()}
        sub.pull(target, step=0)
        liar.how = how
        with pytest.raises(ds.errors.CorruptObjectError, match=_NAMED.get(how)):  # names what is wrong
            sub.pull(target, step=1, allow_anchor=False)
        assert _equal(target, before) and tracking.get_version(target).step == 0
        liar.how = ""
        sub.pull(target, step=1, allow_anchor=False)
        assert _equal(target, state)
    finally:
        liar.how = ""
        with contextlib.suppress(Exception):
            codec_registry.unregister(liar.codec_id)
