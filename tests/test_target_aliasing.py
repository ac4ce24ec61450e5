"""A target whose tensors share memory where the version stores them separately is refused before writing."""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from conftest import chain_states
from deltastore.pull import tracking
from deltastore.testing import bits_equal
from deltastore.errors import TargetMismatchError


SHAPES = {"a": (8, 8), "b": (8,), "c": (8, 8)}
PUBLISHED = {"n": 2, "shapes": SHAPES, "changes": 1.0}  # every element one step up


def _states(seed=0):
    return chain_states(2, SHAPES, changes=1.0, seed=seed)


def _overlapping(s0):
    base = torch.zeros(64 + 8 + 64 - 4, dtype=torch.bfloat16)  # 'b' overlaps the last 4 elements of 'a'
    target = {"a": base[:64].view(8, 8), "b": base[60:68], "c": base[68:132].view(8, 8)}
    return base, target


@pytest.mark.parametrize("route", ["anchor", "delta"])
def test_overlapping_target_tensors_are_refused(published, route):
    uri, (s0, s1), _, _ = published
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
    uri, (s0, s1), _, _ = published
    sub = ds.Subscriber(uri)
    a = s0["a"].clone()
    target = {"a": a, "b": s0["b"].clone(), "c": a}  # 'c' is 'a' itself
    with pytest.raises(TargetMismatchError, match="'c' and 'a' share storage"):
        sub.pull(target, step=1)
    assert bits_equal({"a": a}, {"a": s0["a"]})


def test_disjoint_views_of_one_buffer_are_fine(published):
    uri, (s0, s1), _, _ = published
    base = torch.zeros(64 + 8 + 64, dtype=torch.bfloat16)  # a fused buffer: disjoint slices
    target = {"a": base[:64].view(8, 8), "b": base[64:72], "c": base[72:].view(8, 8)}
    ds.Subscriber(uri).pull(target, step=1)
    assert bits_equal(target, s1)


def test_named_tensors_drops_exact_aliases_only_and_stays_linear_at_one_address():
    """Tied entries (same address, layout, dtype, device) go; views at one address that differ in shape,
    stride or dtype stay; many tensors at one address (empty ones, views) cost one lookup each."""
    from deltastore.tensors import named_tensors

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": w, "tied": w, "same_view": w.view(3, 4), "flat": w.view(-1), "t": w.t(),
             "bits": w.view(torch.int32), "head": w[0], "other": w.clone()}
    state.update({f"empty.{i}": torch.empty(0) for i in range(20000)})
    state.update({f"view.{i}": w.view(-1)[: i % 11 + 1] for i in range(20000)})  # 11 layouts at one address
    aliases: dict[str, str] = {}
    out = named_tensors(state, aliases)
    assert aliases["tied"] == "w" and aliases["same_view"] == "w" and aliases["view.11"] == "view.0"
    assert {"w", "flat", "t", "bits", "head", "other", "empty.7"} <= set(out) and "tied" not in out
    assert aliases.get("head") is None and "view.10" in out and "view.21" not in out
    assert list(out) == [k for k in state if k in out]  # the state's order


def test_named_tensors_of_distinct_tensors_is_the_mapping_itself_in_order():
    """The common target (a mapping of tensors at addresses of their own) is taken by a few whole-mapping
    passes: the same entries in the same order, nothing dropped; anything else still gets the entry-by-entry
    checks and their errors."""
    from deltastore.errors import TargetMismatchError
    from deltastore.tensors import named_tensors

    state = {f"layer.{i}": torch.full((3,), float(i)) for i in reversed(range(50))}
    aliases: dict[str, str] = {}
    out = named_tensors(state, aliases)
    assert list(out.items()) == list(state.items()) and aliases == {} and out is not state
    with pytest.raises(TargetMismatchError, match="not a tensor"):
        named_tensors({**state, "x": [1.0]})
    with pytest.raises(TargetMismatchError, match="names must be strings"):
        named_tensors({**state, 3: torch.zeros(1)})
    w = state["layer.0"]
    assert named_tensors({**state, "tied": w}, aliases) == state and aliases == {"tied": "layer.0"}
