"""A follower pulling into the same tensors skips re-checking them, and sees every change that matters.

:class:`deltastore.pull.checked_target.CheckedTarget` lets a pull reuse the
previous pull's target checks (entries, layout, overlaps) while the target's
tensors are the very ones checked, at the same addresses, with the same
element counts, dtypes and version counters. Each case below changes one of
those between two pulls; the pull must then check again and refuse the
target, writing nothing.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import deltastore as ds
from conftest import chain_states
import deltastore.pull.transaction as transaction_module
from deltastore.pull import tracking
from deltastore.testing import bits_equal
from deltastore import segments
from deltastore.pull.staging import SparseOverlay, TargetAddresses
from deltastore.checksum import tensor_keys
from deltastore.errors import TargetMismatchError
from deltastore.pull.checked_target import CheckedTarget


SHAPES = {"a": (8, 8), "b": (16,), "c": (4, 8)}
PUBLISHED = {"n": 4, "shapes": SHAPES, "changes": 1.0}  # every element one step up each version


def _states(n=4, seed=0):
    return chain_states(n, SHAPES, changes=1.0, seed=seed)


def _following(uri, states):
    """A subscriber and a dict target it pulled to step 1 (anchor, then a checked delta pull)."""
    sub = ds.Subscriber(uri)
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    sub.pull(target, step=0)
    sub.pull(target, step=1)
    return sub, target


@pytest.fixture
def counted_checks(monkeypatch):
    """How many times a pull checked its target's layout."""
    calls = []
    real = transaction_module.check_target

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(transaction_module, "check_target", counting)
    return calls


@pytest.fixture
def overlays(monkeypatch):
    """The overlays the pulls make from now on."""
    made = []

    class Seen(SparseOverlay):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(transaction_module, "SparseOverlay", Seen)
    return made


def test_a_follower_into_the_same_tensors_checks_them_once(published, counted_checks, overlays):
    uri, states, _, _ = published
    sub, target = _following(uri, states)
    checked = len(counted_checks)
    overlays.clear()
    for step in (2, 3):
        assert sub.pull(target, step=step).path == "delta"
        assert bits_equal(target, states[step])
    assert len(counted_checks) == checked  # the second and later delta pulls reused the checks
    # ... and handed the decoders the addresses those checks found
    assert len(overlays) == 2 and all(o._addresses is not None for o in overlays)


def _replace_with_wrong_shape(t):
    t["a"] = torch.zeros(4, 16, dtype=torch.bfloat16)


def _swap_data_for_smaller(t):
    t["a"].data = torch.zeros(2, 8, dtype=torch.bfloat16)


def _resize_in_place(t):
    t["a"].resize_(2, 8)


def _restride_in_place(t):
    t["a"].as_strided_((8, 8), (1, 8))  # the same memory and shape, transposed: not contiguous


def _view_as_another_dtype(t):
    t["a"] = t["a"].view(torch.float16)


def _overlap_another(t):
    t["b"] = t["a"].view(-1)[48:64]  # 'b' now lies inside 'a'


def _drop_a_tensor(t):
    del t["c"]


CHANGES = {
    "replaced by a tensor of another shape": (_replace_with_wrong_shape, "'a'"),
    ".data swapped for a smaller tensor": (_swap_data_for_smaller, "'a'"),
    "resized in place": (_resize_in_place, "'a'"),
    "re-strided in place": (_restride_in_place, "'a' is not contiguous"),
    "viewed as another dtype": (_view_as_another_dtype, "'a'"),
    "overlapping another tensor": (_overlap_another, "overlap in memory"),
    "a tensor removed": (_drop_a_tensor, "'c'"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_target_changed_between_pulls_is_checked_again_and_refused(published, change):
    uri, states, _, _ = published
    sub, target = _following(uri, states)  # checked, and remembered
    do, match = CHANGES[change]
    memory = [v.data for v in target.values()]  # kept alive: a write to a stale address fails a test, not the process
    do(target)
    kept = {k: v.clone() for k, v in target.items() if k != "a"}
    with pytest.raises(TargetMismatchError, match=match):
        sub.pull(target, step=2)
    assert bits_equal({k: target[k] for k in kept}, kept)  # nothing written
    assert bits_equal(dict(zip(states[1], memory)), states[1])  # nor at the addresses the target had


def test_a_target_changed_back_is_pulled_again(published):
    """After a refused pull, a target put right is checked and followed as before, bit-exact."""
    uri, states, _, _ = published
    sub, target = _following(uri, states)
    a = target["a"]
    target["a"] = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(TargetMismatchError):
        sub.pull(target, step=2)
    target["a"] = a
    sub.pull(target, step=2)
    sub.pull(target, step=3)
    assert bits_equal(target, states[3])


def test_the_record_keeps_no_tensor_alive(published):
    uri, states, _, _ = published
    sub, target = _following(uri, states)
    sub.pull(target, step=2)
    refs = [weakref.ref(t) for t in target.values()]
    tracking.set_version(target, None)  # the version table holds plain dicts; the record must not
    del target
    gc.collect()
    assert all(r() is None for r in refs)
    fresh = {k: torch.zeros_like(v) for k, v in states[0].items()}  # a new target (maybe at the old ids)
    sub.pull(fresh, step=0)
    sub.pull(fresh, step=3)
    assert bits_equal(fresh, states[3])


def test_a_data_swap_to_new_memory_of_the_same_shape_is_written_there(store_uri):
    """A tensor whose memory moved (``.data`` swapped for a same-shaped copy) is followed at its new address:
    the addresses a pull hands its decoder come from the tensors as they are, never from an older record."""
    states = _states(5)
    with ds.Publisher(store_uri, anchor_every=100) as pub:
        for step, s in enumerate(states):
            pub.publish(s, step=step)
    sub, target = _following(store_uri, states)
    sub.pull(target, step=2)  # a pull that reused the checks, and the addresses they found
    old_memory = target["a"].data
    kept = old_memory.clone()
    target["a"].data = old_memory.clone()
    assert target["a"].data_ptr() != old_memory.data_ptr()
    for step in (3, 4):  # checked again, then reused again at the new address
        sub.pull(target, step=step)
        assert bits_equal(target, states[step])
        assert bits_equal({"a": old_memory}, {"a": kept})  # the memory it left is not written


class _Marked(torch.Tensor):
    """A tensor subclass (as an instrumented or distributed tensor would be): written through torch ops."""


@pytest.mark.parametrize("when", ["from the start", "class changed between pulls"])
def test_a_target_holding_a_tensor_subclass_gets_no_addresses(published, overlays, when):
    """The addresses a checked target hands the overlay are trusted to be plain CPU tensors': a target with
    a subclassed tensor (from the start, or re-classed after the checks) is never offered them."""
    uri, states, _, _ = published
    sub = ds.Subscriber(uri)
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    if when == "from the start":
        target["b"] = target["b"].as_subclass(_Marked)
    sub.pull(target, step=0)
    sub.pull(target, step=1)
    if when != "from the start":
        target["b"].__class__ = _Marked
    overlays.clear()
    for step in (2, 3):
        sub.pull(target, step=step)
        assert bits_equal(target, states[step])
    assert type(target["b"]) is _Marked
    assert [o._addresses for o in overlays] == [None, None] and all("b" not in o._fast for o in overlays)


def _offers(overlay, names):
    offer = overlay.in_place(list(names), np.zeros(len(names) + 1, np.int64))
    assert offer is not None
    return offer


@pytest.mark.parametrize("names", [["a", "b", "c"], ["a", "c"], ["c"]])
def test_known_addresses_offer_what_a_check_per_tensor_offers(names):
    """SparseOverlay.in_place from the caller's checked addresses gives the very arrays it builds tensor by
    tensor without them (addresses, lengths, element type, checksum keys) and the same tensors."""
    tensors = {k: v.clone() for k, v in _states(1)[0].items()}
    every = list(tensors)
    values = list(tensors.values())
    known = TargetAddresses(every, segments.pointers(values), segments.lengths(values),
                            np.dtype(np.uint16), tensor_keys(every, len(every)))

    class _Base:  # the manifest fields SparseOverlay reads
        checksum_values: dict[str, int] = {}

    fast = SparseOverlay(None, _Base(), tensors, write_through=True, addresses=known)
    slow = SparseOverlay(None, _Base(), tensors, write_through=True)
    assert fast._addresses is known and slow._addresses is None
    a, b = _offers(fast, names), _offers(slow, names)
    for field in ("pointers", "lengths", "keys", "done", "sums"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert np.dtype(a.dtype).itemsize == np.dtype(b.dtype).itemsize == 2
    assert [t is u for t, u in zip(fast.tensors_written_in_place()[0], slow.tensors_written_in_place()[0])] \
        == [True] * len(names)
    a.pointers[:] = 0  # the offer is the decoder's own copy
    assert np.array_equal(known.pointers, segments.pointers(values))


def test_addresses_of_other_tensors_are_not_used():
    tensors = {k: v.clone() for k, v in _states(1)[0].items()}
    others = {"a": tensors["a"], "b": tensors["b"]}
    values = list(others.values())
    known = TargetAddresses(list(others), segments.pointers(values), segments.lengths(values),
                            np.dtype(np.uint16), tensor_keys(list(others), 2))

    class _Base:
        checksum_values: dict[str, int] = {}

    assert SparseOverlay(None, _Base(), tensors, write_through=True, addresses=known)._addresses is None


def test_a_follower_one_behind_downloads_the_version_while_its_target_is_checked(published, monkeypatch):
    """The version's own objects are asked for before the target is looked at, so on a remote store their
    download overlaps the target's checks; a pull that then takes another path drops them."""
    uri, states, _, _ = published
    sub, target = _following(uri, states)
    manifest = sub.manifest(2)
    wanted = {o.digest for o in manifest.objects}
    seen = []
    real = CheckedTarget.lookup

    def lookup(self, *a, **k):
        store = sub.store
        seen.append(wanted <= (set(store._pending) | set(store._verified)))
        return real(self, *a, **k)

    monkeypatch.setattr(CheckedTarget, "lookup", lookup)
    sub.pull(target, step=2)
    assert seen == [True] and bits_equal(target, states[2])
    assert not sub.store._pending and not sub.store._verified  # nothing left held after the pull
