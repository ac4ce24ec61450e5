"""publish() of an iterator on a known chain: diffed as it streams (few tensors alive), same versions as a dict."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import deltastore as ds
from conftest import chain_states
from deltastore.errors import TargetMismatchError
from deltastore.publish import stream
from deltastore.testing import bits_equal


def _states(n=5, seed=0):
    return chain_states(n, {**{f"layer{i}.weight": (64, 32) for i in range(6)}, "norm.weight": (32,)}, changes=0.05,
                        seed=seed)


class _Produced:
    """A generator of fresh copies (like gathered FSDP2 shards) that counts how many are alive at once."""

    def __init__(self, state):
        self.state, self.alive, self.most = state, 0, 0

    def _gone(self):
        self.alive -= 1

    def __iter__(self):
        for k, v in self.state.items():
            t = v.clone()
            self.alive += 1
            self.most = max(self.most, self.alive)
            weakref.finalize(t, self._gone)
            yield k, t
            del t
            gc.collect()


def test_streamed_versions_equal_dict_versions_and_hold_one_piece(tmp_path, monkeypatch):
    monkeypatch.setattr(stream, "STREAM_PIECE_BYTES", 1)  # a piece per tensor: at most it and the next alive
    states = _states()
    a, b = str(tmp_path / "dict"), str(tmp_path / "stream")
    with ds.Publisher(a, anchor_every=100) as pa, ds.Publisher(b, anchor_every=100) as pb:
        for step, s in enumerate(states):
            pa.publish(s, step=step)
            produced = _Produced(s)
            pb.publish(iter(produced), step=step)
            if step:  # the first version captures a mirror (all tensors); later ones stream
                assert produced.most <= 2, produced.most
    sa, sb = ds.Subscriber(a), ds.Subscriber(b)
    for step, s in enumerate(states):
        ma, mb = sa.manifest(step), sb.manifest(step)
        assert [(t.name, t.checksum, t.changed) for t in ma.tensors] == [(t.name, t.checksum, t.changed)
                                                                         for t in mb.tensors]
        assert bits_equal(sb.pull(step=step).state, s)
    follower = {k: torch.empty_like(v) for k, v in states[0].items()}
    for step, s in enumerate(states):
        sb.pull(follower, step=step)
        assert bits_equal(follower, s)


@pytest.mark.parametrize("change", ["add", "drop", "reshape", "retype"])
def test_a_stream_that_leaves_the_layout_is_published_as_a_layout_change(tmp_path, change):
    states = _states(3)
    nxt = dict(states[2])
    if change == "add":
        nxt["value_head.weight"] = torch.randn(1, 32).bfloat16()
    elif change == "drop":
        del nxt["layer3.weight"]
    elif change == "reshape":
        nxt["layer3.weight"] = torch.randn(80, 32).bfloat16()
    else:
        nxt["layer3.weight"] = nxt["layer3.weight"].float()
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=100) as pub:
        for step, s in enumerate(states[:2]):
            pub.publish(iter(s.items()), step=step)
        pub.publish(iter(nxt.items()), step=2)
    sub = ds.Subscriber(uri)
    m = sub.manifest(2)
    assert m.kind == "delta" and (m.new_tensors or m.dropped_tensors)
    assert bits_equal(sub.pull(step=2).state, nxt)


def test_tied_weights_stream_as_aliases_and_an_untied_alias_falls_back(tmp_path):
    emb = torch.randn(16, 8).bfloat16()
    base = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(8).bfloat16()}
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=100) as pub:
        pub.publish(base, step=0)  # tied (one storage): lm_head is an alias
        emb2 = emb.view(torch.int16).clone()
        emb2[3] += 1
        emb2 = emb2.view(torch.bfloat16)
        pub.publish(iter([("embed.weight", emb2), ("lm_head.weight", emb2.clone()),
                          ("norm.weight", base["norm.weight"])]), step=1)
        untied = emb2.view(torch.int16).clone()
        untied[0] += 1
        pub.publish(iter([("embed.weight", emb2), ("lm_head.weight", untied.view(torch.bfloat16)),
                          ("norm.weight", base["norm.weight"])]), step=2)
    sub = ds.Subscriber(uri)
    assert sub.manifest(1).aliases == {"lm_head.weight": "embed.weight"}
    s1 = sub.pull(step=1).state
    assert torch.equal(s1["embed.weight"].view(torch.int16), emb2.view(torch.int16))
    s2 = sub.pull(step=2).state  # lm_head is its own tensor again
    assert torch.equal(s2["lm_head.weight"].view(torch.int16), untied)
    assert torch.equal(s2["embed.weight"].view(torch.int16), emb2.view(torch.int16))


def test_a_stream_naming_a_tensor_twice_is_refused_and_nothing_is_committed(tmp_path):
    states = _states(2)
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=100) as pub:
        pub.publish(states[0], step=0)
        with pytest.raises(TargetMismatchError, match="duplicate"):
            pub.publish(iter([*states[1].items(), ("norm.weight", states[1]["norm.weight"])]), step=1)
        pub.publish(iter(states[1].items()), step=1)  # the same step, retried
    assert bits_equal(ds.Subscriber(uri).pull(step=1).state, states[1])


# -- the item contract: an item is valid until the next one is requested ------------------------------------------

def _sized_states(sizes, n=4, seed=1, fp32=False):
    """Versions of tensors of ``sizes`` elements (bf16, or an fp32 master published as bf16), ~5 % changed a
    step; the first tensor also crosses signs and zeros."""
    g = torch.Generator().manual_seed(seed)
    first = {f"t{i}.weight": torch.randn(k, generator=g).bfloat16() for i, k in enumerate(sizes)}
    first["t0.weight"][:4] = torch.tensor([0.0, -0.0, 1e-38, -1e-38]).bfloat16()
    out = [first]
    for _ in range(1, n):
        nxt = {}
        for k, v in out[-1].items():
            bits = v.view(torch.int16).clone()
            hit = torch.rand(bits.shape, generator=g) < 0.05
            bits[hit] += torch.randint(-3, 4, bits.shape, generator=g, dtype=torch.int16)[hit]
            bits[:2] ^= torch.tensor([-32768, 0], dtype=torch.int16)  # a sign flip, -0.0 <-> 0.0
            nxt[k] = bits.view(torch.bfloat16)
        out.append(nxt)
    return [{k: v.float() for k, v in s.items()} for s in out] if fp32 else out


def _recycling(state):
    """One buffer for every tensor, refilled for each (a bucketed gather that reuses its buffer)."""
    buf = torch.empty(max(v.numel() for v in state.values()), dtype=next(iter(state.values())).dtype)
    for k, v in state.items():
        view = buf[: v.numel()].view(v.shape)
        view.copy_(v)
        yield k, view


def _trashing(state):
    """A fresh tensor per item, overwritten with noise as soon as the next item is asked for."""
    for k, v in state.items():
        t = v.clone()
        yield k, t
        t.view(torch.int16 if t.element_size() == 2 else torch.int32).random_()


def _flat_buckets(state, bucket_elems=3000):
    """Views of one flat buffer, refilled bucket by bucket (how bucketed all-gathers hand tensors over)."""
    dtype = next(iter(state.values())).dtype
    flat = torch.empty(max(bucket_elems, max(v.numel() for v in state.values())), dtype=dtype)
    bucket, used = [], 0

    def drain():
        at = 0
        for name, v in bucket:
            flat[at: at + v.numel()].copy_(v.reshape(-1))
            yield name, flat[at: at + v.numel()].view(v.shape)
            at += v.numel()
        flat.view(torch.int16 if flat.element_size() == 2 else torch.int32).random_()  # the next bucket's fill

    for k, v in state.items():
        if bucket and used + v.numel() > flat.numel():
            yield from drain()
            bucket, used = [], 0
        bucket.append((k, v))
        used += v.numel()
    yield from drain()


_PRODUCERS = {"recycled buffer": _recycling, "mutated after yield": _trashing, "views of a flat buffer": _flat_buckets}


@pytest.mark.parametrize("producer", list(_PRODUCERS))
@pytest.mark.parametrize("mode", ["sync", "background", "fp32 master"])
def test_a_producer_that_reuses_its_memory_publishes_every_version_bit_exactly(tmp_path, monkeypatch, producer,
                                                                                   mode):
    # sizes around both thresholds (scaled down): copied and compared in pieces, compared as they arrive
    monkeypatch.setattr(stream, "STREAM_COPY_BYTES", 4096)
    monkeypatch.setattr(stream, "STREAM_PIECE_BYTES", 10_000)
    sizes = [100, 2047, 2048, 2049, 1500, 6000, 4999, 300]
    states = _sized_states(sizes, fp32=mode == "fp32 master")
    uri = str(tmp_path / "s")
    make = _PRODUCERS[producer]
    with ds.Publisher(uri, anchor_every=100, background=mode == "background",
                      dtype=torch.bfloat16 if mode == "fp32 master" else None) as pub:
        for step, s in enumerate(states):  # step 0 starts the chain (captured whole), later ones stream
            pub.publish(make(s), step=step)
        grown = dict(states[-1], **{"extra.weight": states[-1]["t1.weight"][:77].clone()})
        pub.publish(make(grown), step=len(states))  # a layout change mid-stream: the rest captured whole
    want = [{k: v.bfloat16() for k, v in s.items()} for s in [*states, grown]]
    sub = ds.Subscriber(uri)
    follower = None
    for step, s in enumerate(want):
        assert bits_equal(sub.pull(step=step).state, s), step
        if step < len(states):
            follower = follower or {k: torch.empty_like(v) for k, v in s.items()}
            sub.pull(follower, step=step)
            assert bits_equal(follower, s), step


def test_a_producer_that_reuses_its_memory_streams_at_the_real_thresholds(tmp_path):
    # tensors just under and over STREAM_COPY_BYTES (1 MiB of bf16 is 524,288 elements)
    half = stream.STREAM_COPY_BYTES // 2
    states = _sized_states([half - 1, half, half + 1, 1000], n=3)
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=100) as pub:
        for step, s in enumerate(states):
            pub.publish(_recycling(s), step=step)
    sub = ds.Subscriber(uri)
    for step, s in enumerate(states):
        assert bits_equal(sub.pull(step=step).state, s), step


def test_a_recycled_buffer_is_not_taken_for_tied_weights_but_a_real_tie_is(tmp_path):
    emb = torch.randn(16, 8).bfloat16()
    norm = torch.randn(16, 8).bfloat16()
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=100) as pub:
        # embed and lm_head yielded from one storage with the same bits: a tie; norm refills the same buffer
        pub.publish(_recycling({"embed.weight": emb, "lm_head.weight": emb, "other.weight": norm}), step=0)
    sub = ds.Subscriber(uri)
    assert sub.manifest(0).aliases == {"lm_head.weight": "embed.weight"}
    assert bits_equal(sub.pull(step=0).state, {"embed.weight": emb, "other.weight": norm})  # the alias: one entry


@pytest.mark.parametrize("item, problem", [
    (("w",), "pair"), (("w", torch.zeros(2), 3), "pair"), (42, "pair"), ((3, torch.zeros(2)), "strings"),
    (("w", [1.0]), "not a tensor"), (("w", torch.empty(4, device="meta")), "meta tensor")])
@pytest.mark.parametrize("known_chain", [False, True])
def test_a_malformed_streamed_item_is_a_typed_error_and_nothing_is_committed(tmp_path, item, problem, known_chain):
    s = {"w": torch.ones(4).bfloat16()}
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=100) as pub:
        if known_chain:
            pub.publish(s, step=0)
        with pytest.raises(TargetMismatchError, match=problem):
            pub.publish(iter([item]), step=1)
        assert ds.Subscriber(uri).versions() == ([0] if known_chain else [])
