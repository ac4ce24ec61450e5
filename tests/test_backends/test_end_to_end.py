"""The whole shared trace through every network backend: publish, then pull fresh and lagging, bit-exact."""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal


@pytest.mark.slow
def test_publish_whole_trace_then_pull_fresh_and_lagging(dither_trace, network_target):
    tr = dither_trace
    opts = network_target.options
    follower = {k: torch.zeros_like(v) for k, v in tr.base.items()}
    sub = ds.Subscriber(network_target.uri, storage_options=dict(opts))
    with ds.Publisher(network_target.uri, storage_options=dict(opts), anchor_every=5) as pub:
        for step, state in tr.iter_states():
            pub.publish(state, step=step)
            if step == 2:  # a lagging server: it pulled step 2, then sleeps through the rest of the run
                lagging = {k: torch.zeros_like(v) for k, v in tr.base.items()}
                res = sub.pull(lagging)
                assert res.step == 2 and bits_equal(lagging, tr.state(2))
            if step % 5 == 4:  # a follower that keeps up now and then
                sub.pull(follower)
                assert bits_equal(follower, tr.state(step))

    last = tr.steps
    fresh = ds.Subscriber(network_target.uri, storage_options=dict(opts))
    assert fresh.versions() == list(range(last + 1))
    res = fresh.pull()
    assert res.step == last and bits_equal(res.state, tr.state(last))
    res = sub.pull(lagging)
    assert res.step == last and bits_equal(lagging, tr.state(last))
    res = sub.pull(follower)
    assert res.step == last and bits_equal(follower, tr.state(last))
    mid = fresh.pull(step=7)  # an older version from scratch
    assert bits_equal(mid.state, tr.state(7))
