"""A GC grace below the documented minimum is refused everywhere it can be set (issue 48): with a grace
not longer than the refresh window plus the store's timestamp resolution, a publish that reuses an object
while GC runs can lose a committed version. Each entry point raises ``GraceTooShortError`` naming the grace
and the minimum, before anything is read or deleted; local disk and SeaweedFS (whose whole-second times
make the minimum 11 s)."""

from __future__ import annotations

import math

import pytest
import torch

import deltastore as ds
from deltastore.cli import main
from deltastore.errors import GraceTooShortError
from deltastore.gc import Retention, collect_garbage, delete_unreferenced

from .scenarios import bits_equal

BELOW = [0.0, "floor", math.nan]  # none, exactly the minimum (not longer), not a number


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"w": torch.randn(2048, generator=g).bfloat16()} for _ in range(n)]


@pytest.fixture
def gc_store(where):
    return published_store(where)


def published_store(where):
    """A store with versions 0..5 (anchors every 2) that a retention of 2 would shrink."""
    uri = where.fresh()
    states = _states(6)
    with ds.Publisher(where.store(uri), anchor_every=2) as pub:
        for k, s in enumerate(states):
            pub.publish(s, step=k)
    store = where.store(uri)
    return where, uri, states, (store.versions(), sorted(store.list_objects()))


def _grace(store, value):
    return store.min_gc_grace if value == "floor" else value


def _unchanged(where, uri, states, stored) -> None:
    store = where.store(uri)
    assert (store.versions(), sorted(store.list_objects())) == stored  # nothing deleted
    sub = ds.Subscriber(where.store(uri))
    for k in stored[0]:
        assert bits_equal(sub.pull(step=k).state, states[k]), k


def _refused(e, store, value) -> None:
    floor = 10.0 if store.backend.capabilities.mtime_resolution == 0 else 11.0
    assert store.min_gc_grace == floor
    assert f"is too short for {store.uri}: it must be longer than {floor:g} s (the refresh window, 10 s, plus " \
           "the store's timestamp resolution" in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


def test_collect_garbage_refuses_a_short_grace(gc_store):
    where, uri, states, stored = gc_store
    store = where.store(uri)
    slept = []
    for value in BELOW:
        with pytest.raises(GraceTooShortError, match=r"^grace=") as e:
            collect_garbage(store, Retention(keep_last=2, keep_anchors=1), grace=_grace(store, value),
                            sleep=slept.append)
        _refused(e, store, value)
    assert slept == []  # refused before phase 1: no manifest deleted, no wait
    _unchanged(where, uri, states, stored)


def test_collect_garbage_takes_a_grace_just_above_the_minimum(gc_store):
    where, uri, states, stored = gc_store
    store = where.store(uri)
    slept = []
    plan = collect_garbage(store, Retention(keep_last=2, keep_anchors=1), grace=store.min_gc_grace + 0.5,
                           sleep=slept.append)
    assert plan.delete_versions and slept == [store.min_gc_grace + 0.5]  # (the control: the check is not a wall)
    assert where.store(uri).versions() == plan.keep


def test_delete_unreferenced_and_a_publisher_refuse_a_short_grace(gc_store):
    where, uri, states, stored = gc_store
    store = where.store(uri)
    for value in BELOW:
        with pytest.raises(GraceTooShortError, match=r"^grace=") as e:
            delete_unreferenced(store, stored[1], grace=_grace(store, value))
        _refused(e, store, value)
        for retention in (Retention(keep_last=2, keep_anchors=1), None):  # (gc_grace is unused without one)
            with pytest.raises(GraceTooShortError, match=r"^gc_grace=") as e:
                ds.Publisher(store, gc_grace=_grace(store, value), retention=retention)
            _refused(e, store, value)
    _unchanged(where, uri, states, stored)


@pytest.mark.parametrize("value", ["0", "1", "10"])
def test_cli_gc_refuses_a_short_grace(tmp_path, value, capsys):
    uri = str(tmp_path / "s")
    states = _states(6)
    with ds.Publisher(uri, anchor_every=2) as pub:
        for k, s in enumerate(states):
            pub.publish(s, step=k)
    store = ds.open_store(uri)
    stored = (store.versions(), sorted(store.list_objects()))
    assert main(["gc", uri, "--keep-last", "2", "--keep-anchors", "1", "--grace", value]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"deltastore: GraceTooShortError: grace={float(value)} s is too "
                                               "short"), err
    assert "it must be longer than 10 s" in err[0]
    assert (store.versions(), sorted(store.list_objects())) == stored
    assert bits_equal(ds.Subscriber(uri).pull(step=5).state, states[5])


def test_retention_has_no_grace_of_its_own():
    """``Retention`` says what to keep, not when: its grace is the Publisher's ``gc_grace`` or
    ``collect_garbage``'s ``grace``, both checked above."""
    with pytest.raises(TypeError):
        Retention(keep_last=2, keep_anchors=1, grace=1)  # type: ignore[call-arg]
