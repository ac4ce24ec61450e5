"""publish() of an iterator on a known chain: diffed as it streams (few tensors alive), same versions as a dict."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import deltastore as ds
from deltastore.errors import TargetMismatchError
from deltastore.publish import stream
from conftest import bits_equal


def _states(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = {f"layer{i}.weight": torch.randn(64, 32, generator=g).bfloat16() for i in range(6)}
    s["norm.weight"] = torch.randn(32, generator=g).bfloat16()
    out = [s]
    for _ in range(1, n):
        nxt = {}
        for k, v in out[-1].items():
            bits = v.view(torch.int16).clone()
            bits[torch.rand(bits.shape, generator=g) < 0.05] += 1
            nxt[k] = bits.view(torch.bfloat16)
        out.append(nxt)
    return out


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
