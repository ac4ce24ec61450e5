"""A target whose tensors share memory where the version stores them separately is refused before writing."""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from deltastore import tracking
from conftest import bits_equal
from deltastore.errors import TargetMismatchError


def _states(seed=0):
    g = torch.Generator().manual_seed(seed)
    s0 = {"a": torch.randn(8, 8, generator=g).bfloat16(), "b": torch.randn(8, generator=g).bfloat16(),
          "c": torch.randn(8, 8, generator=g).bfloat16()}
    s1 = {k: (v.view(torch.int16) + 1).view(torch.bfloat16) for k, v in s0.items()}
    return s0, s1


@pytest.fixture
def published(store_uri):
    s0, s1 = _states()
    with ds.Publisher(store_uri, anchor_every=100) as pub:
        pub.publish(s0, step=0)
        pub.publish(s1, step=1)
    return store_uri, s0, s1


def _overlapping(s0):
    base = torch.zeros(64 + 8 + 64 - 4, dtype=torch.bfloat16)  # 'b' overlaps the last 4 elements of 'a'
    target = {"a": base[:64].view(8, 8), "b": base[60:68], "c": base[68:132].view(8, 8)}
    return base, target


@pytest.mark.parametrize("route", ["anchor", "delta"])
def test_overlapping_target_tensors_are_refused(published, route):
    uri, s0, s1 = published
    sub = ds.Subscriber(uri)
    base, target = _overlapping(s0)
    if route == "delta":
        target["a"].copy_(s0["a"])  # the target holds what it holds; tracking says version 0
        tracking.set_version(target, sub.store.ref(0))
    before = base.clone()
    with pytest.raises(TargetMismatchError, match="'a' and 'b' overlap in memory"):
        sub.pull(target, step=1)
    assert torch.equal(base.view(torch.int16), before.view(torch.int16))


def test_tied_target_tensors_the_version_keeps_apart_are_refused(published):
    uri, s0, s1 = published
    sub = ds.Subscriber(uri)
    a = s0["a"].clone()
    target = {"a": a, "b": s0["b"].clone(), "c": a}  # 'c' is 'a' itself
    with pytest.raises(TargetMismatchError, match="'c' and 'a' share storage"):
        sub.pull(target, step=1)
    assert bits_equal({"a": a}, {"a": s0["a"]})


def test_disjoint_views_of_one_buffer_are_fine(published):
    uri, s0, s1 = published
    base = torch.zeros(64 + 8 + 64, dtype=torch.bfloat16)  # a fused buffer: disjoint slices
    target = {"a": base[:64].view(8, 8), "b": base[64:72], "c": base[72:].view(8, 8)}
    ds.Subscriber(uri).pull(target, step=1)
    assert bits_equal(target, s1)
