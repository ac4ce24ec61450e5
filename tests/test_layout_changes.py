"""A version may change its layout: add a tensor, drop one, reshape one, re-type one (docs/format.md).

Followers (deltas), joiners (an anchor before the change, then deltas across it), pulls without a
target, ``verify`` and ``materialize`` all end bit-exact in the new layout; a Module (fixed layout)
refuses before anything is written; a manifest whose layout step disagrees with its parent is refused
with a typed error naming the tensor.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import deltastore as ds
from conftest import edit_tensor_columns
from deltastore.testing import bits_equal
from deltastore.errors import ManifestError, TargetMismatchError
from deltastore.pull.materialize import materialize
from deltastore.store import version_key
from deltastore.pull.verify import verify_store


def _bump(t, seed, frac=0.05):
    g = torch.Generator().manual_seed(seed)
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).clone().reshape(-1)
    bits[torch.rand(bits.numel(), generator=g) < frac] += 1
    return bits.view(t.dtype).reshape(t.shape)


def _states():
    """v0 base; v1 adds a value head; v2 drops 'b'; v3 resizes the vocabulary; v4 re-types the head; v5 plain."""
    g = torch.Generator().manual_seed(0)
    s0 = {"embed": torch.randn(100, 8, generator=g).bfloat16(), "a": torch.randn(8, 8, generator=g).bfloat16(),
          "b": torch.randn(8, generator=g).bfloat16()}
    s1 = {k: _bump(v, 1) for k, v in s0.items()}
    s1["v_head"] = torch.randn(1, 8, generator=g).bfloat16()
    s2 = {k: _bump(v, 2) for k, v in s1.items() if k != "b"}
    s3 = {k: _bump(v, 3) for k, v in s2.items()}
    s3["embed"] = torch.cat([s2["embed"], torch.randn(20, 8, generator=g).bfloat16()])
    s4 = {k: _bump(v, 4) for k, v in s3.items()}
    s4["v_head"] = s3["v_head"].float()
    s5 = {k: _bump(v, 5) for k, v in s4.items()}
    return [s0, s1, s2, s3, s4, s5]


def _publish(uri, states, **kw):
    with ds.Publisher(uri, anchor_every=100, **kw) as pub:
        infos = [pub.publish(s, step=i).result() for i, s in enumerate(states)]
    return infos


@pytest.mark.parametrize("background", [False, True])
def test_layout_changes_follow_join_verify_materialize(store_uri, tmp_path, background):
    states = _states()
    infos = _publish(store_uri, states, background=background)
    assert [i.kind for i in infos] == ["anchor"] + ["delta"] * 5  # the chain keeps going through every change
    sub = ds.Subscriber(store_uri)
    ms = [sub.manifest(i) for i in range(6)]
    assert [(m.new_tensors, m.dropped_tensors) for m in ms] == [
        ((), ()), (("v_head",), ()), ((), ("b",)), (("embed",), ()), (("v_head",), ()), ((), ())]
    assert {m.format_version for m in ms} == {"1.3"}  # what publishers write (layout changes are 1.1 fields)
    assert all(ms[i].parent == sub.store.ref(i - 1) for i in range(1, 6))

    follower = {k: v.clone() for k, v in states[0].items()}
    sub.identify(follower, 0)
    for i in range(1, 6):
        r = sub.pull(follower, step=i)
        assert r.path == "delta" and r.versions_applied == [i]
        assert bits_equal(follower, states[i]), i
    assert r.bytes_fetched < ms[5].object_bytes() + 1  # a follower reads deltas only

    for i in range(6):  # joiners: the anchor (version 0), then deltas across the changes
        joiner = {k: torch.zeros_like(v) for k, v in states[i].items()}  # allocated for version i, untracked
        ptrs = {k: v.data_ptr() for k, v in joiner.items()}
        r = ds.Subscriber(store_uri).pull(joiner, step=i)
        assert r.path == "anchor" and r.versions_applied == list(range(i + 1))
        assert bits_equal(joiner, states[i]), i
        assert {k: v.data_ptr() for k, v in joiner.items()} == ptrs  # written in place, storage kept
        assert bits_equal(sub.pull(step=i).state, states[i]), i  # no target: new tensors
    stale = {k: v.clone() for k, v in states[0].items()}  # untracked, laid out as another version: refused
    with pytest.raises(TargetMismatchError, match="'v_head'"):  # whatever path the anchors give
        ds.Subscriber(store_uri).pull(stale, step=1)
    assert bits_equal(stale, states[0])

    report = verify_store(ds.open_store(store_uri))
    assert report.ok, report.problems
    assert report.replayed == list(range(6))

    out = tmp_path / "ckpt"
    materialize(ds.open_store(store_uri), 4, out)
    assert bits_equal(load_file(str(out / "model.safetensors")), states[4])

    # a restarted trainer resumes from the new layout and continues the chain with a delta
    s6 = {k: _bump(v, 6) for k, v in states[5].items()}
    with ds.Publisher(store_uri, anchor_every=100) as pub:
        info = pub.publish(s6, step=6)
    assert info.kind == "delta" and sub.manifest(6).parent == sub.store.ref(5)
    assert sub.pull(follower, step=6).path == "delta" and bits_equal(follower, s6)


class _Net(nn.Module):
    def __init__(self, vocab=100, head=False):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(vocab, 8, dtype=torch.bfloat16))
        self.a = nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
        self.b = nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
        if head:
            self.v_head = nn.Parameter(torch.zeros(1, 8, dtype=torch.bfloat16))


def _module_bits(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_module_target_refuses_a_layout_change_before_writing(store_uri):
    states = _states()
    _publish(store_uri, states[:3])
    sub = ds.Subscriber(store_uri)
    net = _Net()
    sub.pull(net, step=0)
    before = _module_bits(net)
    with pytest.raises(TargetMismatchError, match="'v_head'"):
        sub.pull(net, step=1)  # adds a tensor the module does not have
    assert bits_equal(_module_bits(net), before) and sub.version_of(net) == sub.store.ref(0)

    headed = _Net(head=True)  # the owner added the head: written in place, storage kept
    sub.pull(headed, step=0)
    ptr = headed.v_head.data_ptr()
    assert sub.pull(headed, step=1).path == "delta"
    assert headed.v_head.data_ptr() == ptr and bits_equal(_module_bits(headed), states[1])
    before = _module_bits(headed)
    with pytest.raises(TargetMismatchError, match="drops tensor 'b'"):
        sub.pull(headed, step=2)
    assert bits_equal(_module_bits(headed), before) and sub.version_of(headed) == sub.store.ref(1)


def test_stage_refuses_layout_changes_unless_asked(store_uri):
    states = _states()
    _publish(store_uri, states[:2])
    sub = ds.Subscriber(store_uri)
    with pytest.raises(TargetMismatchError, match="adds tensor 'v_head'"):
        sub.stage(1)  # an integration writing a fixed-layout model
    staged = sub.stage(1, layout_changes=True)
    assert bits_equal(staged.state.as_tensors(), states[1])


def _rewrite(uri, step, edit):
    path = os.path.join(uri, *version_key(step).split("/"))
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    os.chmod(path, 0o644)
    with open(path, "w") as f:
        json.dump(doc, f)


def _edit_tensor(uri, doc, name, **fields):
    """Set ``fields`` of tensor ``name`` in a manifest document (its column entries, those of the layout
    object included)."""
    def edit(columns):
        i = columns["name"].index(name)
        for k, v in fields.items():
            columns[k][i] = v
    edit_tensor_columns(uri, doc, edit)


def _drop_tensor(uri, doc, name):
    def edit(columns):
        i = columns["name"].index(name)
        for column in columns.values():
            del column[i]
    edit_tensor_columns(uri, doc, edit)


@pytest.mark.parametrize("attack, named", [
    (lambda u, d: _edit_tensor(u, d, "a", shape=[4, 16]), "'a'"),    # reshaped without saying so
    (lambda u, d: _edit_tensor(u, d, "a", dtype="float16"), "'a'"),  # re-typed without saying so
    (lambda u, d: _drop_tensor(u, d, "v_head"), "'v_head'"),         # dropped without saying so
    (lambda u, d: d.update(dropped_tensors=["nope"]), "'nope'"),     # drops what the parent lacks
])
def test_hostile_layout_step_is_refused_naming_the_tensor(store_uri, attack, named):
    states = _states()
    s2 = {k: _bump(v, 2) for k, v in states[1].items()}  # v2: a plain delta after the head was added
    _publish(store_uri, [states[0], states[1], s2])
    _rewrite(store_uri, 2, lambda d: attack(store_uri, d))
    sub = ds.Subscriber(store_uri)
    target = {k: v.clone() for k, v in states[1].items()}
    sub.identify(target, 1)
    with pytest.raises(ManifestError, match=named):
        sub.pull(target, step=2)
    assert bits_equal(target, states[1]) and sub.version_of(target) == sub.store.ref(1)
    with pytest.raises(ManifestError, match=named):
        sub.pull(step=2)
    assert not verify_store(ds.open_store(store_uri)).ok


def test_manifest_rules_for_new_and_dropped_tensors(store_uri):
    states = _states()
    _publish(store_uri, states[:2])
    sub = ds.Subscriber(store_uri)
    doc = sub.manifest(1).to_dict()
    ok = sub.store.parse_manifest(json.dumps(doc).encode())
    assert ok.new_tensors == ("v_head",)
    bad = dict(doc, new_tensors=["v_head", "a"])  # "a" has a delta, not a whole copy
    with pytest.raises(ManifestError, match="new tensor 'a' must be stored whole"):
        sub.store.parse_manifest(json.dumps(bad).encode())
    bad = dict(doc, dropped_tensors=["a"])
    with pytest.raises(ManifestError, match="dropped tensor 'a' is still listed"):
        sub.store.parse_manifest(json.dumps(bad).encode())
    bad = dict(doc, new_tensors=[])
    with pytest.raises(ManifestError, match="'v_head' must have a parent and no full object"):
        sub.store.parse_manifest(json.dumps(bad).encode())


def test_tracked_target_takes_an_anchor_laid_out_after_the_change(store_uri):
    """The target's layout rule compares its own version with the wanted one, whatever path is cheapest."""
    states = _states()
    with ds.Publisher(store_uri, anchor_every=2) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    sub = ds.Subscriber(store_uri)
    for i in range(1, 6):
        target = {k: v.clone() for k, v in states[0].items()}
        sub.identify(target, 0)
        r = sub.pull(target, step=i)
        assert bits_equal(target, states[i]), i
        if i >= 2:
            assert r.path == "anchor" and r.versions_applied[0] >= 2  # the anchor already has the new layout
