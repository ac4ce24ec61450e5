"""Batched reads on the pull path: old bits of many tensors in one call, joined views, the paused collector."""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import deltastore as ds
import deltastore.codecs.raw  # noqa: F401  (ds.codecs.raw below)
from deltastore import _gc, segments
from deltastore.kernels import bitstream
from deltastore.codecs import read_old_bits
from deltastore.pull import transaction
from deltastore.pull.reader import VersionReader
from deltastore.registry import codecs as codec_registry

from conftest import step_bits

from deltastore.testing import bits_equal


def _states(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {f"l{i}.w": (torch.randn(40, 30, generator=g) * 0.02).bfloat16() for i in range(5)}
    state["norm"] = torch.randn(30, generator=g)  # another element width: its own batch
    out = []
    for _ in range(n):
        state = {k: v.clone() for k, v in state.items()}
        for v in state.values():
            bits = v.view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32).view(-1)
            step_bits(bits, torch.randperm(bits.numel(), generator=g)[: bits.numel() // 20], g)
        out.append(state)
    return out


@contextmanager
def _registered(cls):
    """A test codec registered under its ``codec_id`` for the block."""
    ds.register_codec(cls.codec_id, cls)
    try:
        yield cls.codec_id
    finally:
        codec_registry.unregister(cls.codec_id)


def _publish(uri, states, codec):
    with ds.Publisher(uri, codec=codec, anchor_every=100) as pub:
        for step, s in enumerate(states):
            pub.publish(s, step=step)


def _follow(uri, states, codec):
    _publish(uri, states, codec)
    sub = ds.Subscriber(uri)
    target = {k: v.clone() for k, v in states[0].items()}
    sub.pull(target, step=0)
    for step, s in enumerate(states[1:], start=1):
        assert sub.pull(target, step=step, allow_anchor=False).path == "delta"
        assert bits_equal(target, s)


def test_joined_is_a_view_of_back_to_back_pieces_and_a_copy_otherwise():
    a = torch.arange(10)
    pieces = list(a.split([3, 0, 4, 3]))  # an empty piece has no address of its own
    j = segments.joined(pieces)
    assert j.data_ptr() == a.data_ptr() and torch.equal(j, a)
    gapped = segments.joined([a[0:2], a[3:5]])
    assert gapped.tolist() == [0, 1, 3, 4] and gapped.data_ptr() != a.data_ptr()
    other = torch.arange(5)
    assert segments.joined([a[:2], other[:2]]).tolist() == [0, 1, 0, 1]
    assert segments.joined([a[:0], a[:2]]).tolist() == [0, 1]


def test_read_old_bits_asks_a_plain_receiver_per_tensor_and_a_batched_one_once():
    held = {"a": torch.arange(10, dtype=torch.int16), "b": torch.arange(100, 110, dtype=torch.int16)}
    calls = []

    def one(name, positions):
        calls.append(name)
        return held[name][positions]

    class Batched:
        def __call__(self, name, positions):
            raise AssertionError("asked per tensor")

        def many(self, names, positions, bounds):
            calls.append(tuple(names))
            return torch.cat([held[n][positions[bounds[i]:bounds[i + 1]]] for i, n in enumerate(names)])

    pos, bounds = torch.tensor([1, 4, 0, 9]), np.array([0, 2, 4])
    assert read_old_bits(one, ["a", "b"], pos, bounds).tolist() == [1, 4, 100, 109] and calls == ["a", "b"]
    calls.clear()
    assert read_old_bits(Batched(), ["a", "b"], pos, bounds).tolist() == [1, 4, 100, 109] and calls == [("a", "b")]
    with pytest.raises(ValueError, match="3 positions"):
        read_old_bits(lambda n, p: held[n][:1], ["a"], pos[:3], np.array([0, 3]))


def _counting(monkeypatch):
    """Elements read by ``segments.gather``, written by ``segments.scatter`` and stepped in place, per call."""
    seen = {"gather": [], "scatter": [], "in_place": [], "check": []}
    for mod, name, key in ((segments, "gather", "gather"), (segments, "scatter", "scatter"),
                           (segments, "check_positions", "check")):
        real = getattr(mod, name)

        def counting(*args, _real=real, _key=key):
            seen[_key].append(args[0 if _key == "check" else 1].numel())
            return _real(*args)

        monkeypatch.setattr(mod, name, counting)
    real_run = bitstream.StepsInPlace.run

    def counting_run(self):
        seen["in_place"].append(int(self.counts[self.slot >= 0].sum()))
        return real_run(self)

    monkeypatch.setattr(bitstream.StepsInPlace, "run", counting_run)
    return seen


def _ulp_follower_at_zero(uri):
    """A ulp store of three versions and a follower's target at version 0."""
    states = _states()
    _publish(uri, states, "ulp")
    sub = ds.Subscriber(uri)
    target = {k: v.clone() for k, v in states[0].items()}
    sub.pull(target, step=0)
    return states, sub, target


def test_a_ulp_pull_one_delta_behind_reads_and_writes_each_change_once(memory_uri, monkeypatch):
    states, sub, target = _ulp_follower_at_zero(memory_uri)
    seen = _counting(monkeypatch)
    sub.pull(target, step=1, allow_anchor=False)
    assert bits_equal(target, states[1])
    # the decoder read, stepped and wrote every change where it lies: no gather before, no scatter after
    assert seen["gather"] == [] and seen["scatter"] == [], seen
    assert sum(seen["in_place"]) == sub.manifest(1).changed, seen
    # ... checking each position as it wrote it: the separate pass over the positions is not made again
    assert sum(seen["check"]) == 0, seen


def test_a_ulp_pull_over_two_deltas_writes_each_in_place_in_turn(memory_uri, monkeypatch):
    states, sub, target = _ulp_follower_at_zero(memory_uri)
    seen = _counting(monkeypatch)
    runs = []
    real_advance = VersionReader.advance
    monkeypatch.setattr(VersionReader, "advance", lambda self, state, m, role="delta":
                        (runs.append((m.step, len(seen["in_place"]))), real_advance(self, state, m, role))[1])
    res = sub.pull(target, step=2, allow_anchor=False)
    assert bits_equal(target, states[2]) and res.versions_applied == [1, 2]
    # each delta read, stepped and wrote where it lies, one after the other: nothing staged or gathered
    assert seen["gather"] == [] and seen["scatter"] == [] and sum(seen["check"]) == 0, seen
    (s1, before1), (s2, before2) = runs
    assert (s1, s2) == (1, 2)
    assert sum(seen["in_place"][before1:before2]) == sub.manifest(1).changed, seen
    assert sum(seen["in_place"][before2:]) == sub.manifest(2).changed, seen
    # written: what each delta wrote, summed over them
    assert sum(res.written.values()) == sub.manifest(1).changed + sub.manifest(2).changed


def _staged_path(sub, target, start, steps):
    """The path from version ``start`` through ``steps`` staged on one overlay over ``target``, then written
    (what a pull does for a path with a differential or a layout change, and ``stage()`` for an
    integration); returns the elements staged per tensor."""
    from deltastore.pull.apply import write_sparse
    from deltastore.pull.staging import SparseOverlay, mapping_reader

    overlay = SparseOverlay(mapping_reader(target), sub.manifest(start), target)
    for s in steps:
        sub.reader.advance(overlay, sub.manifest(s))
    written = overlay.pending.counts()
    log = transaction.UndoLog()
    try:
        write_sparse(target, overlay, log.steps())
    except Exception as e:  # undone as a transaction undoes it
        raise transaction.failure(e, log.restore()) from e
    return written


def test_a_ulp_path_staged_over_two_deltas_reads_each_old_bit_once(memory_uri, monkeypatch):
    states, sub, target = _ulp_follower_at_zero(memory_uri)
    seen = _counting(monkeypatch)
    _staged_path(sub, target, 0, [1, 2])
    assert bits_equal(target, states[2])
    # staged across two deltas, nothing is written before the end: each delta's old bits are read once
    # (the decoder's read, reused by the overlay), and the net changes written once
    assert seen["in_place"] == [], seen
    assert sum(seen["gather"]) == sub.manifest(1).changed + sub.manifest(2).changed, seen
    assert seen["scatter"], seen
    assert sum(seen["check"]) == sub.manifest(1).changed + sub.manifest(2).changed, seen


def test_a_codec_reading_other_positions_than_it_returns_does_not_fool_the_overlay(memory_uri):
    """The overlay reuses a decoder's batched read only for exactly the positions the update names."""

    class Peeking(ds.codecs.raw.RawCodec):
        codec_id = "peeking-raw"
        receiver_needs = "old_bits"

        def decode(self, data, specs, old=None):
            out = super().decode(data, specs, old)
            for width in {s.bits_dtype for s in specs}:  # one batched read per element width, as ulp does
                group = [s for s in specs if s.bits_dtype == width]
                shifted = [((out[s.name].positions + 1) % s.numel).unique() for s in group]
                read_old_bits(old, [s.name for s in group], torch.cat(shifted),
                              segments.bounds_of([p.numel() for p in shifted]))
            return out

    with _registered(Peeking) as codec:
        _follow(memory_uri, _states(), codec)  # a reused wrong read would fail the checksum


def test_a_batched_read_past_a_tensor_is_a_typed_error_and_the_target_keeps_its_version(memory_uri):
    """The batched gather checks every position against its tensor: a decoder's bad read is a typed error."""

    class Reaching(ds.codecs.raw.RawCodec):
        codec_id = "reaching-raw"
        receiver_needs = "old_bits"

        def decode(self, data, specs, old=None):
            out = super().decode(data, specs, old)
            group = [s for s in specs if s.bits_dtype == torch.int16]
            n = group[0].numel
            read_old_bits(old, [s.name for s in group], torch.tensor([n + 10**6]), np.array([0] + [1] * len(group)))
            return out

    states = _states()
    with _registered(Reaching) as codec:
        _publish(memory_uri, states, codec)
        sub = ds.Subscriber(memory_uri)
        target = {k: v.clone() for k, v in states[0].items()}
        sub.pull(target, step=0)
        with pytest.raises(ds.errors.CorruptObjectError):
            sub.pull(target, step=1, allow_anchor=False)
        assert bits_equal(target, states[0])


def test_the_batched_gather_refuses_positions_outside_their_tensor_and_bad_bounds():
    from deltastore.pull.staging import _gather_checked

    a, b = torch.arange(10, dtype=torch.int16), torch.arange(100, 105, dtype=torch.int16)
    ok = _gather_checked([a, b], torch.tensor([1, 9, 0, 4]), np.array([0, 2, 4]))
    assert ok is not None and ok.tolist() == [1, 9, 100, 104]
    assert _gather_checked([a, b], torch.tensor([9, 1, 4, 0]), np.array([0, 2, 4])).tolist() == [9, 1, 104, 100]
    for pos in ([1, 10, 0, 4], [1, 9, 0, 5], [-1, 9, 0, 4]):  # past the first tensor, past the second, negative
        with pytest.raises(IndexError, match="outside its tensor"):
            _gather_checked([a, b], torch.tensor(pos), np.array([0, 2, 4]))
    for pos, bounds in [([1, 9, 0, 4], [0, 9, 4]),    # bounds out of order
                        ([1, 9, 0, 4], [0, 2, 9]),    # bounds past the positions
                        ([1, 9, 0, 4], [0, 4])]:      # bounds for another tensor count
        assert _gather_checked([a, b], torch.tensor(pos), np.array(bounds)) is None, (pos, bounds)
    assert _gather_checked([a, torch.arange(5, dtype=torch.int32)], torch.tensor([1, 0]), np.array([0, 1, 2])) is None


def test_collector_paused_nests_across_threads_and_keeps_an_application_choice():
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def other():
        with _gc.collector_paused():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    entered.wait(10)
    with _gc.collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause still holds
    leave.set()
    t.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc.collector_paused():
            pass
        assert not gc.isenabled()  # disabled by the application: left so
    finally:
        gc.enable()


def test_pull_and_publish_run_with_the_collector_paused_and_resume_it(memory_uri):
    seen = []

    class Watching(ds.codecs.raw.RawCodec):
        codec_id = "watching-raw"

        def encode(self, updates):
            seen.append(("encode", gc.isenabled()))
            return super().encode(updates)

        def decode(self, data, specs, old=None):
            seen.append(("decode", gc.isenabled()))
            return super().decode(data, specs, old)

    with _registered(Watching) as codec:
        _follow(memory_uri, _states(2), codec)
    assert {kind for kind, _ in seen} == {"encode", "decode"}
    assert not any(enabled for _, enabled in seen) and gc.isenabled()


def _full_state(sub, states, step):
    from deltastore.pull.staging import FullState

    return FullState.from_bits(sub.manifest(step), {k: v.view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32)
                                                    .reshape(-1).clone() for k, v in states[step].items()})


def test_a_catch_up_from_an_anchor_writes_each_decoded_batch_by_one_scatter(memory_uri, monkeypatch):
    """Host-side staging (an anchor, then deltas) costs a batch's elements, not a call per tensor."""
    states = _states(n=4)
    _publish(memory_uri, states, "ulp")
    sizes = []
    real = segments.scatter

    def counting(tensors, positions, bounds, bits):
        sizes.append(len(tensors))
        return real(tensors, positions, bounds, bits)

    monkeypatch.setattr(segments, "scatter", counting)
    got = ds.Subscriber(memory_uri).pull(step=3)
    assert got.path == "anchor" and got.versions_applied == [0, 1, 2, 3]
    assert bits_equal(got.state, states[3])
    assert sizes.count(5) == 3, sizes  # the five bf16 tensors of each delta: one call per delta


def test_a_batch_that_fails_its_checksum_names_its_tensor_and_stages_nothing(memory_uri):
    states = _states(n=2)
    _publish(memory_uri, states, "ulp")
    sub = ds.Subscriber(memory_uri)
    state = _full_state(sub, states, 0)
    before = {k: v.clone() for k, v in state.bits.items()}
    m = sub.manifest(1)
    updates, _ = sub.reader.fetch_updates(m, "delta", state.old)
    batch = next(b for b in updates.batches if len(b.specs) == 5)
    batch.bits = batch.bits.clone()
    batch.bits[int(batch.bounds[2])] ^= 1  # one element of the third tensor off
    with pytest.raises(ds.errors.ChecksumMismatchError, match=batch.specs[2].name):
        state.apply(m, updates)
    assert all(torch.equal(state.bits[k], before[k]) for k in before)  # the other tensors untouched too
    good, _ = sub.reader.fetch_updates(m, "delta", state.old)
    state.apply(m, good)
    assert bits_equal(state.as_tensors(), states[1])


def _overlapping_states(n=5, seed=1):
    """States whose steps change many of the same elements again (as dither does), and some new ones."""
    g = torch.Generator().manual_seed(seed)
    state = {f"l{i}.w": (torch.randn(40, 30, generator=g) * 0.02).bfloat16() for i in range(5)}
    state["norm"] = torch.randn(30, generator=g)
    hot = {k: torch.randperm(v.numel(), generator=g)[: v.numel() // 10] for k, v in state.items()}
    out = [state]
    for _ in range(n - 1):
        state = {k: v.clone() for k, v in state.items()}
        for k, v in state.items():
            bits = v.view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32).view(-1)
            again = hot[k][torch.rand(hot[k].numel(), generator=g) < 0.6]
            step_bits(bits, torch.cat([again, torch.randperm(bits.numel(), generator=g)[:20]]).unique(), g)
        out.append(state)
    return out


@pytest.mark.parametrize("codec", ["ulp", "raw"])
def test_a_staged_path_merges_each_batch_touched_again_in_one_pass(memory_uri, monkeypatch, codec):
    """Several deltas staged on one overlay over a live target: a batch touching staged tensors again is
    merged by whole-batch searches (no call per tensor), bit-exact, and written by one scatter."""
    from deltastore.pull.staging import SparseOverlay, _PendingMap

    states = _overlapping_states()
    _publish(memory_uri, states, codec)
    sub = ds.Subscriber(memory_uri)
    target = {k: v.clone() for k, v in states[0].items()}
    sub.pull(target, step=0)
    merges, sizes = [], []
    real_merge, real_scatter = SparseOverlay._merge, segments.scatter
    monkeypatch.setattr(SparseOverlay, "_merge", lambda self, name, *a: (merges.append(name), real_merge(self, name, *a)))

    def counting(tensors, positions, bounds, bits):
        sizes.append(len(tensors))
        return real_scatter(tensors, positions, bounds, bits)

    monkeypatch.setattr(segments, "scatter", counting)
    events = []  # the staged changes gathered per batch, and each batch staged
    real_flat, real_add = _PendingMap._flat, _PendingMap.add_batch
    monkeypatch.setattr(_PendingMap, "_flat", lambda self, names: (events.append(tuple(names)),
                                                                   real_flat(self, names))[1])
    monkeypatch.setattr(_PendingMap, "add_batch", lambda self, b: (events.append("staged"), real_add(self, b))[1])
    written = _staged_path(sub, target, 0, [1, 2, 3, 4])
    assert bits_equal(target, states[4])
    between = [[]]
    for e in events:
        between.append([]) if e == "staged" else between[-1].append(e)
    assert any(between) and all(len(b) == len(set(b)) for b in between), events  # read once, reused to merge
    assert set(merges) <= {"norm"}  # every sparse touch went through the batch merge (raw may store norm whole)
    assert sorted(sizes)[-1] == 5 and sizes.count(5) == 1, sizes  # the bf16 batch: one write
    for k in (k for k in states[0] if k != "norm"):  # staged: the union of the elements any delta changed
        ints = [s[k].view(torch.int16).reshape(-1) for s in states]
        union = torch.zeros_like(ints[0], dtype=torch.bool)
        for a, b in zip(ints, ints[1:]):
            union |= a != b
        assert written[k] == int(union.sum()), k


def test_a_failed_write_of_merged_batches_restores_the_bits_before_it(memory_uri, monkeypatch):
    states = _overlapping_states()
    _publish(memory_uri, states, "ulp")
    sub = ds.Subscriber(memory_uri)
    target = {k: v.clone() for k, v in states[0].items()}
    sub.pull(target, step=0)
    real = segments.scatter
    calls = []

    def failing_second(tensors, positions, bounds, bits):
        calls.append(len(tensors))
        if len(calls) == 2:
            raise OSError("injected: the second write fails")
        return real(tensors, positions, bounds, bits)

    monkeypatch.setattr(segments, "scatter", failing_second)
    with pytest.raises(ds.errors.ApplyError):
        _staged_path(sub, target, 0, [1, 2, 3, 4])
    assert len(calls) >= 3 and bits_equal(target, states[0])  # the first batch's write undone from its originals
    monkeypatch.setattr(segments, "scatter", real)
    assert sub.pull(target, step=4, allow_anchor=False).path == "delta"
    assert bits_equal(target, states[4])


@pytest.mark.parametrize("codec", ["ulp", "raw"])
def test_a_lagging_follower_writes_delta_after_delta_and_a_late_failure_undoes_them_all(memory_uri, monkeypatch,
                                                                                          codec):
    """Several deltas behind, each delta is written before the next is read (``ulp`` in place as it decodes,
    ``raw`` staged, then scattered). A failure in the last one, after it landed, puts back every delta
    written before it as well: the target keeps its version, bit for bit."""
    states = _overlapping_states()
    _publish(memory_uri, states, codec)
    sub = ds.Subscriber(memory_uri)
    target = {k: v.clone() for k, v in states[0].items()}
    sub.pull(target, step=0)
    real_advance, real_write = VersionReader.advance, transaction.write_sparse
    at = []

    def advance(self, state, m, role="delta"):
        at.append(m.step)
        got = real_advance(self, state, m, role)
        if at[-1] == 4 and codec == "ulp":  # in the target already: fail before it is written whole
            raise RuntimeError("injected: the last delta fails after its in-place write")
        return got

    def write(target_, overlay, *a, **kw):
        real_write(target_, overlay, *a, **kw)
        if at[-1] == 4:
            raise OSError("injected: the last delta fails after its write landed")

    monkeypatch.setattr(VersionReader, "advance", advance)
    monkeypatch.setattr(transaction, "write_sparse", write)
    with pytest.raises((RuntimeError, OSError)):
        sub.pull(target, step=4, allow_anchor=False)
    assert at == [1, 2, 3, 4]
    assert sub.version_of(target).step == 0 and bits_equal(target, states[0])
    monkeypatch.undo()
    res = sub.pull(target, step=4, allow_anchor=False)
    assert res.versions_applied == [1, 2, 3, 4] and bits_equal(target, states[4])


class _XorRaw(ds.codecs.raw.RawCodec):
    """Stores ``new ^ old``: decoding needs the receiver's bits, read here in descending position order."""

    codec_id = "xor-raw-descending"
    receiver_needs = "old_bits"

    def encode(self, updates):
        return super().encode([ds.Update(u.spec, u.bits ^ u.old_bits, u.positions) for u in updates])

    def decode(self, data, specs, old=None):
        out = super().decode(data, specs, old)
        for width in {s.bits_dtype for s in specs}:
            group = [s for s in specs if s.bits_dtype == width]
            backwards = [out[s.name].positions.flip(0) for s in group]
            got = read_old_bits(old, [s.name for s in group], torch.cat(backwards),
                                segments.bounds_of([p.numel() for p in backwards]))
            for s, b in zip(group, torch.split(got, [p.numel() for p in backwards])):
                u = out[s.name]
                out[s.name] = ds.Update(s, u.bits ^ b.flip(0), u.positions)
        return out


def test_old_bits_read_out_of_order_over_staged_deltas_are_the_staged_ones(memory_uri):
    """A lagging pull whose decoder reads the old bits in descending order: the overlay's linear walk refuses
    them and the general search answers, with the bits as of the deltas staged so far."""
    with _registered(_XorRaw) as codec:
        states = _overlapping_states()
        _publish(memory_uri, states, codec)
        sub = ds.Subscriber(memory_uri)
        target = {k: v.clone() for k, v in states[0].items()}
        sub.pull(target, step=0)
        assert sub.pull(target, step=4, allow_anchor=False).versions_applied == [1, 2, 3, 4]
        assert bits_equal(target, states[4])  # a wrong old bit would fail the checksum
