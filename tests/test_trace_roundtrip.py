"""Bit-exactness on every version of both runs of the real trace."""

from __future__ import annotations

import torch

import deltastore as ds
from deltastore.testing import bits_equal


def _publish_trace(tr, uri, anchor_every=5):
    infos = []
    with ds.Publisher(uri, anchor_every=anchor_every) as pub:
        for step, state in tr.iter_states():
            infos.append(pub.publish(state, step=step))
    return infos


def test_every_version_into_fresh_dict_and_lagging_target(trace, store_uri):
    infos = _publish_trace(trace, store_uri)
    assert [i.step for i in infos] == list(range(trace.steps + 1))
    assert [i.kind for i in infos[:6]] == ["anchor", "delta", "delta", "delta", "delta", "anchor"]
    for info, step in zip(infos[1:], range(1, trace.steps + 1)):
        assert info.changed == sum(idx.numel() for idx, _ in trace.changes(step).values())

    sub = ds.Subscriber(store_uri)
    assert sub.versions() == list(range(trace.steps + 1))
    follower = {k: torch.zeros_like(v) for k, v in trace.base.items()}
    lagging = {k: torch.zeros_like(v) for k, v in trace.base.items()}
    for step in range(trace.steps + 1):
        want = trace.state(step)
        fresh = sub.pull(step=step)
        assert fresh.path == "anchor" and bits_equal(fresh.state, want), step
        res = sub.pull(follower, step=step)
        assert bits_equal(follower, want), step
        if step > 0:  # a follower only ever needs the one delta, anchors included
            assert res.path == "delta" and res.versions_applied == [step]
        if step % 4 == 3:  # a lagging target skips versions
            res = sub.pull(lagging, step=step)
            assert bits_equal(lagging, want), step
    res = sub.pull(lagging)
    assert res.step == trace.steps and bits_equal(lagging, trace.state(trace.steps))


def test_late_joiner_starts_from_nearest_anchor(dither_trace, store_uri):
    _publish_trace(dither_trace, store_uri, anchor_every=5)
    sub = ds.Subscriber(store_uri)
    res = sub.pull(step=8)
    assert res.versions_applied == [5, 6, 7, 8]
    assert bits_equal(res.state, dither_trace.state(8))
    anchor_bytes = sub.manifest(5).object_bytes(sub.manifest(5).full_objects)
    assert res.bytes_fetched < anchor_bytes * 1.5


def test_cheapest_path_is_chosen_by_bytes(dither_trace, memory_uri):
    _publish_trace(dither_trace, memory_uri, anchor_every=10)
    sub = ds.Subscriber(memory_uri)
    target = sub.pull(step=1).state
    sub.pull(target, step=1)

    def delta_bytes(s):
        m = sub.manifest(s)
        return m.object_bytes(m.delta_objects)

    via_deltas = sum(delta_bytes(s) for s in range(2, 15))
    anchor = sub.manifest(10)
    via_anchor = anchor.object_bytes(anchor.full_objects) + sum(delta_bytes(s) for s in range(11, 15))
    plan = sub.plan(14, sub.version_of(target))
    if via_deltas <= via_anchor:
        assert plan.anchor is None and plan.deltas == list(range(2, 15)) and plan.nbytes == via_deltas
    else:
        assert plan.anchor == 10 and plan.deltas == [11, 12, 13, 14] and plan.nbytes == via_anchor
    joiner = sub.plan(14, None)
    assert joiner.anchor == 10 and joiner.deltas == [11, 12, 13, 14] and joiner.nbytes == via_anchor
    res = sub.pull(target, step=14)
    assert res.bytes_fetched == plan.nbytes
    assert bits_equal(target, dither_trace.state(14))


def test_dense_deltas_make_the_anchor_path_cheaper(memory_uri):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 256, generator=g).bfloat16()}
    states = [state]
    pub = ds.Publisher(memory_uri, anchor_every=10, codec="raw")  # 6 B per changed element
    pub.publish(state, step=0)
    for step in range(1, 15):
        bits = states[-1]["w"].view(torch.int16).clone()
        bits[torch.rand(bits.shape, generator=g) < 0.25] += 1
        states.append({"w": bits.view(torch.bfloat16)})
        pub.publish(states[-1], step=step)
    sub = ds.Subscriber(memory_uri)
    target = sub.pull(step=1).state
    sub.pull(target, step=1)
    plan = sub.plan(14, sub.version_of(target))
    assert plan.anchor == 10 and plan.deltas == [11, 12, 13, 14]
    other = sub.pull(step=1).state
    sub.pull(other, step=1)
    res = sub.pull(target, step=14)
    assert res.path == "anchor" and bits_equal(target, states[14])
    # a server that must never take an anchor still gets there through the (dearer) deltas
    res = sub.pull(other, step=14, allow_anchor=False)
    assert res.path == "delta" and res.versions_applied == list(range(2, 15)) and bits_equal(other, states[14])
