"""``verify`` judges what a reader would do: a writer that lost a race and continued from its own last
version leaves a branch every reader pulls bit-exactly, and verify must not call it unreachable."""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore.errors import VersionExistsError
from deltastore.store import version_key
from deltastore.pull.verify import verify_store


def _bump(s, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in s.items():
        bits = v.view(torch.int16).clone()
        bits[torch.rand(bits.shape, generator=g) < 0.05] += 1
        out[k] = bits.view(torch.bfloat16)
    return out


def test_lost_race_branch_verifies_clean(store_uri):
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(32, 16, generator=g).bfloat16(), "b": torch.randn(16, generator=g).bfloat16()}
    a = ds.Publisher(store_uri, anchor_every=100)
    want = {0: base, 1: _bump(base, 1), 2: _bump(_bump(base, 1), 2)}
    for s in range(3):
        a.publish(want[s], step=s)
    b = ds.Publisher(store_uri, anchor_every=100)  # a second trainer, resumed at version 2
    want[3] = _bump(want[2], 3)
    a.publish(want[3], step=3)  # the winner
    with pytest.raises(VersionExistsError):
        b.publish(_bump(want[2], 30), step=3)  # the loser ...
    want[4] = _bump(want[2], 4)
    want[5] = _bump(want[4], 5)
    b.publish(want[4], step=4)  # ... continues at the next step, from its own last version (2)
    b.publish(want[5], step=5)
    a.close()
    b.close()
    sub = ds.Subscriber(store_uri)
    assert sub.manifest(4).parent == sub.store.ref(2) and sub.manifest(5).parent == sub.store.ref(4)
    for s in range(6):  # every version pulls bit-exact
        assert bits_equal(sub.pull(step=s).state, want[s]), s

    report = verify_store(ds.open_store(store_uri))
    assert report.ok, report.problems
    assert report.replayed == list(range(6))


def test_a_delta_no_reader_can_reach_is_still_reported(store_uri, tmp_path):
    g = torch.Generator().manual_seed(0)
    s0 = {"w": torch.randn(32, 16, generator=g).bfloat16()}
    with ds.Publisher(store_uri, anchor_every=100) as pub:
        for s in range(4):
            pub.publish(s0 if s == 0 else _bump(s0, s), step=s)
            s0 = s0 if s == 0 else _bump(s0, s)
    (tmp_path / "store" / version_key(1)).unlink()  # a broken chain: 2 and 3 have no path from an anchor
    report = verify_store(ds.open_store(store_uri))
    unreachable = [s for s, msg in report.problems if "not reachable" in msg]
    assert unreachable == [2, 3] and report.replayed == [0]
