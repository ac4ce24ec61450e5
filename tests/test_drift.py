"""The drift tracker against a plain reference: per tensor, the elements that differ from the anchor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore.publish import drift
from deltastore.publish.diff import find_changes
from deltastore.publish.drift import DriftTracker


@pytest.fixture(params=["one thread", "runs of rows on three threads"])
def merge_threads(request, monkeypatch):
    """Merges on one thread (these tables are small), or cut into runs of a row or a few on three threads."""
    if request.param != "one thread":
        monkeypatch.setattr(drift, "_MIN_MERGE_WORK", 1)
        monkeypatch.setenv("DELTASTORE_THREADS", "3")


@pytest.mark.parametrize("seed", range(3))
def test_drift_matches_a_direct_compare_with_the_anchor(seed, merge_threads):
    g = torch.Generator().manual_seed(seed)
    # mixed widths (two tables), a tensor that only appears later, and elements that change back
    anchor = {"a": torch.randint(-5, 5, (4000,), dtype=torch.int16, generator=g),
              "b": torch.randint(-5, 5, (10,), dtype=torch.int16, generator=g),
              "f": torch.randint(-5, 5, (3000,), dtype=torch.int32, generator=g)}
    state = {k: v.clone() for k, v in anchor.items()}
    tracker = DriftTracker()
    for step in range(12):
        before = {k: v.clone() for k, v in state.items()}
        for k, t in state.items():
            if k == "b" and step < 5:
                continue  # untouched for a while: no row yet
            hit = torch.rand(t.numel(), generator=g) < 0.05
            t[hit] = torch.randint(-5, 5, (int(hit.sum()),), dtype=t.dtype, generator=g)  # often back to the anchor
        changes = {k: find_changes(before[k], state[k]) for k in state}
        proposed = tracker.propose(changes)
        if step % 4 == 3:  # a proposal that is not committed changes nothing
            state = before
            continue
        tracker.commit(proposed)
        want = {k: torch.nonzero(anchor[k] != state[k]).reshape(-1) for k in state}
        assert DriftTracker.count(proposed) == sum(int(w.numel()) for w in want.values())
        diff = DriftTracker.differential(proposed, lambda n, p: state[n][p])
        for k, w in want.items():
            if not w.numel():
                assert k not in diff and proposed.get(k) is None
                continue
            ch = diff[k]
            assert torch.equal(ch.positions, w)
            assert torch.equal(ch.old_bits, anchor[k][w]) and torch.equal(ch.new_bits, state[k][w])
            assert ch.old_bits.dtype == anchor[k].dtype


def test_positions_beyond_32_bits_widen_the_table():
    big = 2**31 + 5
    ch = find_changes(torch.zeros(3, dtype=torch.int16), torch.tensor([0, 1, 0], dtype=torch.int16))
    tracker = DriftTracker()
    tracker.commit(tracker.propose({"x": ch}))
    far = type(ch)(torch.tensor([big]), torch.tensor([7], dtype=torch.int16), torch.tensor([0], dtype=torch.int16))
    proposed = tracker.propose({"y": far, "x": ch.__class__(torch.tensor([1]), torch.tensor([0], dtype=torch.int16),
                                                           torch.tensor([1], dtype=torch.int16))})
    assert proposed.get("x") is None  # changed back
    y = proposed.get("y")
    assert y is not None and y.positions.tolist() == [big] and np.asarray(y.positions).dtype == np.int64


def test_flat_changes_give_the_same_drift_as_per_tensor_changes(monkeypatch):
    from deltastore import segments
    from deltastore.publish import drift
    per_tensor = []
    rows = drift._rows
    monkeypatch.setattr(drift, "_rows", lambda *a: per_tensor.append(1) or rows(*a))
    g = torch.Generator().manual_seed(5)
    names = [f"t{i}" for i in range(40)]
    anchor = [torch.randint(-3, 3, (int(n),), dtype=torch.int16, generator=g)
              for n in torch.randint(1, 300, (40,), generator=g)]
    state = [a.clone() for a in anchor]
    by_dict, by_flat = DriftTracker(), DriftTracker()
    keys = np.arange(40, dtype=np.uint64)
    for step in range(6):
        before = [s.clone() for s in state]
        for t in state:
            hit = torch.rand(t.numel(), generator=g) < 0.2
            t[hit] = torch.randint(-3, 3, (int(hit.sum()),), dtype=t.dtype, generator=g)
        fc = segments.diff_segments(before, state, keys)
        changes = dict(zip(names, fc.changes()))
        flat = [(names, fc)] if step != 3 else []  # one step without flat changes (a corrected diff)
        by_dict.commit(by_dict.propose(changes))
        before_flat = len(per_tensor)
        by_flat.commit(by_flat.propose(changes, flat))
        assert len(per_tensor) - before_flat == (1 if step == 3 else 0)  # the flat path, except without flat
        for name, a, s in zip(names, anchor, state):
            want = torch.nonzero(a != s).reshape(-1)
            for tracker in (by_dict, by_flat):
                got = tracker._drift.get(name)
                assert (got is None and not want.numel()) or torch.equal(got.positions.to(torch.int64), want)


def test_flat_changes_held_in_many_parts_merge_as_one_stream(merge_threads):
    """The compare's buffers are merged as they are, never joined: a tensor's changes may straddle parts,
    and a part may be empty."""
    from deltastore import segments
    g = torch.Generator().manual_seed(11)
    names = [f"t{i}" for i in range(7)]
    anchor = [torch.randint(-3, 3, (int(n),), dtype=torch.int16, generator=g) for n in (50, 1, 400, 3, 0, 90, 200)]
    state = [a.clone() for a in anchor]
    keys = np.arange(len(names), dtype=np.uint64)
    whole, pieces = DriftTracker(), DriftTracker()
    for _ in range(5):
        before = [s.clone() for s in state]
        for t in state:
            hit = torch.rand(t.numel(), generator=g) < 0.3
            t[hit] = torch.randint(-3, 3, (int(hit.sum()),), dtype=t.dtype, generator=g)
        fc = segments.diff_segments(before, state, keys)
        pos, new, old = (torch.cat([p[j] for p in fc.parts]) for j in range(3))
        n = pos.numel()
        cuts = sorted({0, n, *torch.randint(0, n + 1, (5,), generator=g).tolist(), n // 2, n // 2})
        parts = [(pos[a:b].clone(), new[a:b].clone(), old[a:b].clone()) for a, b in zip(cuts, cuts[1:])]
        parts.insert(1, (pos[:0].clone(), new[:0].clone(), old[:0].clone()))  # an empty part in between
        starts = np.cumsum([0] + [p.numel() for p, _, _ in parts[:-1]])
        split = segments.FlatChanges(fc.bounds, parts, starts, fc.sums)
        assert len(split.parts) > 2
        whole.commit(whole.propose(dict(zip(names, fc.changes()))))
        pieces.commit(pieces.propose(dict(zip(names, split.changes())), [(names, split)]))
        for name, a, s in zip(names, anchor, state):
            want = torch.nonzero(a != s).reshape(-1)
            for tracker in (whole, pieces):
                got = tracker._drift.get(name)
                if not want.numel():
                    assert got is None
                    continue
                assert torch.equal(got.positions.to(torch.int64), want)
                assert torch.equal(got.anchor_bits.view(torch.int16), a[want])


def _step(state, g, share=0.05):
    before = {k: v.clone() for k, v in state.items()}
    for t in state.values():
        hit = torch.rand(t.numel(), generator=g) < share
        t[hit] = torch.randint(-5, 5, (int(hit.sum()),), dtype=t.dtype, generator=g)  # often back to the anchor
    return {k: find_changes(before[k], state[k]) for k in state}


def test_commits_merge_into_the_committed_buffers_and_stay_exact(merge_threads):
    """A commit writes the merged table over the committed one (its buffers have room), and a
    proposal read before its commit (a differential) is built apart: both give the direct compare."""
    g = torch.Generator().manual_seed(3)
    anchor = {"a": torch.randint(-5, 5, (300_000,), dtype=torch.int16, generator=g),
              "b": torch.randint(-5, 5, (200_000,), dtype=torch.int16, generator=g)}
    state = {k: v.clone() for k, v in anchor.items()}
    tracker = DriftTracker()
    reused = 0
    for step in range(10):
        proposed = tracker.propose(_step(state, g))
        want = {k: torch.nonzero(anchor[k] != state[k]).reshape(-1) for k in state}
        assert DriftTracker.count(proposed) == sum(int(w.numel()) for w in want.values())  # counted, not built
        before = next(iter(tracker._drift.tables.values()), None)
        if step % 3 == 2:  # read first: built in fresh buffers, committed as they are
            assert proposed.get("a") is not None
        tracker.commit(proposed)
        after = next(iter(tracker._drift.tables.values()))
        if before is not None and before.room is not None and step % 3 != 2:
            reused += np.shares_memory(after.positions, before.room[0])
        for k, w in want.items():
            got = proposed.get(k)
            assert torch.equal(got.positions.to(torch.int64), w)
            assert torch.equal(got.anchor_bits, anchor[k][w])
    assert reused >= 3  # the committed buffers were written over, not replaced


def test_a_proposal_made_before_a_commit_is_refused():
    g = torch.Generator().manual_seed(4)
    state = {"a": torch.randint(-5, 5, (5000,), dtype=torch.int16, generator=g)}
    tracker = DriftTracker()
    first = tracker.propose(_step(state, g))
    tracker.commit(first)
    stale, fresh = tracker.propose(_step(state, g)), tracker.propose(_step(state, g))
    tracker.commit(fresh)
    with pytest.raises(RuntimeError, match="before the last commit"):
        tracker.commit(stale)
    tracker.reset()
    with pytest.raises(RuntimeError, match="before the last commit"):
        tracker.commit(fresh)


def test_an_uncommitted_proposal_leaves_the_committed_drift_alone():
    g = torch.Generator().manual_seed(6)
    anchor = {"a": torch.randint(-5, 5, (200_000,), dtype=torch.int16, generator=g)}
    state = {k: v.clone() for k, v in anchor.items()}
    tracker = DriftTracker()
    tracker.commit(tracker.propose(_step(state, g)))
    tracker.commit(tracker.propose(_step(state, g)))  # now with room
    kept = {k: v.clone() for k, v in state.items()}
    snapshot = tracker._drift.get("a")
    snapshot = (snapshot.positions.clone(), snapshot.anchor_bits.clone())
    dropped = tracker.propose(_step(state, g, share=0.3))
    assert dropped.count > 0
    now = tracker._drift.get("a")
    assert torch.equal(now.positions, snapshot[0]) and torch.equal(now.anchor_bits, snapshot[1])
    state = kept
    proposed = tracker.propose(_step(state, g))
    tracker.commit(proposed)
    w = torch.nonzero(anchor["a"] != state["a"]).reshape(-1)
    assert torch.equal(proposed.get("a").positions.to(torch.int64), w)


@pytest.mark.parametrize("seed", range(2))
def test_a_drift_over_its_budget_is_a_sample_of_the_exact_drift_and_estimates_it(seed, merge_threads):
    """Within budget the drift is exact; past it, the held positions are exactly the sampled subset of the
    exact drift (with the anchor's bits), held in the budget, and the scaled count estimates the drift."""
    g = torch.Generator().manual_seed(seed)
    anchor = {"a": torch.randint(-50, 50, (200_000,), dtype=torch.int16, generator=g),
              "f": torch.randint(-50, 50, (50_000,), dtype=torch.int32, generator=g)}
    state = {k: v.clone() for k, v in anchor.items()}
    tracker = DriftTracker()
    budget = 40_000
    rates = []
    for step in range(8):
        before = {k: v.clone() for k, v in state.items()}
        for t in state.values():
            hit = torch.rand(t.numel(), generator=g) < 0.02
            t[hit] = torch.randint(-50, 50, (int(hit.sum()),), dtype=t.dtype, generator=g)
        proposed = tracker.propose({k: find_changes(before[k], state[k]) for k in state}, budget_bytes=budget)
        tracker.commit(proposed)
        rates.append(proposed.rate_log2)
        want = {k: torch.nonzero(anchor[k] != state[k]).reshape(-1) for k in state}
        exact = sum(int(w.numel()) for w in want.values())
        assert proposed.held_bytes() <= budget or proposed.rate_log2 == 0 and exact * 6 <= budget
        for k, w in want.items():
            keep = torch.from_numpy(drift.sampled(w.numpy(), proposed.rate_log2))
            since = proposed.get(k)
            got = since.positions.to(torch.int64) if since is not None else torch.zeros(0, dtype=torch.int64)
            assert torch.equal(got, w[keep])
            if since is not None:
                assert torch.equal(since.anchor_bits, anchor[k][w[keep]])
        est = DriftTracker.count(proposed)
        if proposed.exact:
            assert est == exact
        else:
            assert abs(est - exact) < 0.25 * exact, (est, exact, proposed.rate_log2)
            with pytest.raises(ValueError, match="sample"):
                DriftTracker.differential(proposed, lambda n, p: state[n][p])
    assert rates[0] == 0 and rates[-1] > 0 and rates == sorted(rates)  # exact first, sampled once it grew
    tracker.reset()
    assert tracker.propose({k: find_changes(anchor[k], state[k]) for k in state}).rate_log2 == 0


def test_no_proposal_counts_no_drift():
    """A version that tracks no drift (no proposal) reports 0 drifted elements to the policy."""
    assert DriftTracker.count(None) == 0
