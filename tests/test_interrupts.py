"""An interrupt (KeyboardInterrupt, SystemExit) raised inside a target write rolls the target back, then
propagates: anchor and delta paths, dict and Module targets, in-place writes and a layout change's inserts."""

from __future__ import annotations

from collections.abc import MutableMapping

import pytest
import torch
from torch import nn

import deltastore as ds
from conftest import chain_states
from deltastore.testing import bits_equal

_WRITES = ("copy_", "__setitem__", "index_put_")


class Hooked(torch.Tensor):
    """A tensor whose writes count down a shared budget; the write that overdraws it raises ``exc``."""

    budget: int | None = None
    exc: type[BaseException] = KeyboardInterrupt

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _WRITES and Hooked.budget is not None:
            Hooked.budget -= 1
            if Hooked.budget < 0:
                Hooked.budget = None
                raise Hooked.exc("injected in the middle of a target write")
        return super().__torch_function__(func, types, args, kwargs or {})


def _plain(state):
    return {k: v.detach().as_subclass(torch.Tensor).clone() for k, v in state.items()}


SHAPES = {f"t{i}": (32, 16) for i in range(4)}
PUBLISHED = {"n": 3, "shapes": SHAPES, "changes": 0.1}


def _states(n=3, seed=0):
    return chain_states(n, SHAPES, changes=0.1, seed=seed)


class _Buffers(nn.Module):
    def __init__(self, state):
        super().__init__()
        for k, v in state.items():
            self.register_buffer(k, v.clone().as_subclass(Hooked))


def _target(kind, state):
    if kind == "module":
        return _Buffers(state)
    return {k: v.clone().as_subclass(Hooked) for k, v in state.items()}


def _bits(target):
    return _plain(target.state_dict() if isinstance(target, nn.Module) else target)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("kind", ["dict", "module"])
@pytest.mark.parametrize("route", ["delta", "anchor"])
def test_interrupt_mid_write_rolls_back_then_propagates(published, kind, route, exc):
    uri, states, _, _ = published
    sub = ds.Subscriber(uri)
    target = _target(kind, states[1])
    if route == "delta":
        sub.identify(target, 1)
    held = sub.version_of(target)
    Hooked.exc = exc
    Hooked.budget = 2  # two tensors written, the third write raises
    try:
        with pytest.raises(exc, match="injected"):
            sub.pull(target, step=2)
    finally:
        Hooked.budget = None
    assert bits_equal(_bits(target), states[1])  # rolled back, every bit
    assert sub.version_of(target) == held
    r = sub.pull(target, step=2)  # and the next pull works
    assert r.path == route and bits_equal(_bits(target), states[2])


class _Mapping(MutableMapping):
    """A dict target whose ``__setitem__`` raises ``KeyboardInterrupt`` once, on call number ``fail_at``."""

    def __init__(self, data, fail_at):
        self.data, self.fail_at, self.calls = dict(data), fail_at, 0

    def __getitem__(self, k):
        return self.data[k]

    def __setitem__(self, k, v):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt("injected in __setitem__")
        self.data[k] = v

    def __delitem__(self, k):
        del self.data[k]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_interrupt_while_inserting_new_tensors_rolls_back(store_uri):
    states = _states(2)
    grown = {k: v.clone() for k, v in states[1].items()}
    grown["head_a"] = torch.ones(3, 4, dtype=torch.bfloat16)
    grown["head_b"] = torch.full((5,), 2.0, dtype=torch.bfloat16)
    del grown["t3"]
    grown["t0"] = torch.cat([grown["t0"], grown["t0"][:2]])  # re-laid: replaced in the dict
    with ds.Publisher(store_uri, anchor_every=100) as pub:
        pub.publish(states[0], step=0)
        pub.publish(grown, step=1)
    sub = ds.Subscriber(store_uri)
    target = _Mapping(_plain(states[0]), fail_at=2)
    sub.identify(target, 0)
    objects = dict(target.data)
    with pytest.raises(KeyboardInterrupt):
        sub.pull(target, step=1)
    assert target.data.keys() == objects.keys() and all(target.data[k] is objects[k] for k in objects)
    assert bits_equal(_plain(target.data), states[0]) and sub.version_of(target) == sub.store.ref(0)
    assert sub.pull(target, step=1).path == "delta"
    assert bits_equal(_plain(target.data), grown)
