"""A follower that starts from ``pull().state`` stays on deltas, and the dict it got is not kept alive."""

from __future__ import annotations

import gc
import weakref

import torch

import deltastore as ds
from deltastore.pull import tracking


def test_a_fresh_dict_is_tracked_weakly_and_the_next_pull_takes_the_delta(tmp_path):
    g = torch.Generator().manual_seed(1)
    model = {f"w{i}": torch.randn(32, 32, generator=g).to(torch.bfloat16) for i in range(3)}
    pub = ds.Publisher(str(tmp_path), anchor_every=1000)
    sub = ds.Subscriber(str(tmp_path))
    pub.publish(model, step=0)
    state = sub.pull(step=0).state
    assert isinstance(state, dict) and tracking.get_version(state) == sub.store.ref(0)
    for t in model.values():
        t.view(torch.int16)[::5] += 1
    pub.publish(model, step=1)
    res = sub.pull(state, step=1)
    assert res.path == "delta" and res.versions_applied == [1]
    assert all(torch.equal(state[k].view(torch.int16), v.view(torch.int16)) for k, v in model.items())
    gone = weakref.ref(state)
    del state, res
    gc.collect()
    assert gone() is None  # tracking holds no strong reference to a dict the pull made
