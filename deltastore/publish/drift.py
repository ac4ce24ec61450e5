"""Elements that differ from the last anchor, tracked in O(drift) memory, within a budget.

The Publisher keeps the flat positions whose bits differ from the last
anchor's now, and the anchor's bits there (6 bytes per drifted bf16 element
with 32-bit positions; nothing else: the current bits are the mirror's). From
it come the *drift* (how many elements differ from the anchor) and the
*differential* (anchor -> now) that a joiner can use instead of replaying the
chain. An element that changes back to the anchor's bits leaves the set.

**Sampling.** A proposal may be given a memory budget. While the drift fits,
every position is tracked (the drift is *exact*, and so is the differential it
gives). When it would not fit, the tracker keeps only the positions whose hash
falls in a fraction ``2**-rate_log2`` of the hash space (:func:`sampled`:
Fibonacci hashing of the position, so the positions kept at a higher rate are a
subset of those kept at a lower one, and raising the rate only drops entries),
and :meth:`DriftTracker.count` scales the sample back up: an estimate for the
anchor policy, in bounded memory. A sampled drift cannot give the
differential: the Publisher then rebuilds it from the stored anchor
(``deltastore.publish.resume.differential_from_anchor``). An anchor resets the rate.

Layout: one compressed-row table per element width (:class:`_Table`): tensor
``k`` of the table owns ``positions[bounds[k]:bounds[k + 1]]`` (sorted) and the
anchor's bits there. A version's changes are merged into a table by one
kernel call (:func:`deltastore.kernels.diff.drift_merge_rows`) per run of
rows (:func:`~deltastore.kernels.diff.merge_runs`, one per kernel thread)
whatever the tensor count, so the cost follows the drifted and changed
elements, not the number of tensors. The count that decides the anchor
policy and a merge into fresh buffers run on every thread; a merge into the
committed table's own buffers (it writes over rows other runs still read)
on one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import segments
from .._memory import discard
from ..kernels.diff import drift_merge_rows, drift_merge_rows_in_place, merge_runs, sample_stream
from ..kernels.parallel import each, threads
from ..segments import Change, FlatChanges

if TYPE_CHECKING:
    from .mirror import Diff

#: a version's changes as rows of a table: names, name -> row, row bounds in the change stream, and the stream's
#: parts (positions, old bits, new bits)
_Rows = tuple[tuple[str, ...], dict[str, int], np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]
#: ``read(name, positions) -> bits`` of the current version at those flat positions
Read = Callable[[str, torch.Tensor], torch.Tensor]

_INT32_MAX = 2**31 - 1
#: 2**64 / golden ratio: a position is sampled at rate ``2**-k`` when the top ``k`` bits of ``position * _GOLDEN``
#: (mod 2**64) are zero
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: the highest sampling rate (one position in 2**24): beyond it the budget is not kept
_MAX_RATE_LOG2 = 24
#: elements (previous and changed) below which a merge runs on one thread
_MIN_MERGE_WORK = 1 << 18


@dataclass(frozen=True)
class _Since:
    positions: torch.Tensor    # sorted positions whose bits differ from the anchor (int32 when they fit)
    anchor_bits: torch.Tensor  # the anchor's bits there

    @property
    def differing(self) -> int:
        return int(self.positions.numel())


@dataclass(frozen=True)
class _Table:
    """The drift of every tensor of one element width (see the module docstring)."""

    names: tuple[str, ...]
    index: dict[str, int]
    bounds: np.ndarray     # int64, len(names) + 1
    positions: np.ndarray  # int32, or int64 once a position needs it
    anchor: np.ndarray     # the anchor's bits (integer view dtype)
    #: the buffers ``positions`` and ``anchor`` are the front of, with room for later merges in place
    room: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)

    def row(self, name: str) -> _Since | None:
        k = self.index.get(name)
        if k is None:
            return None
        a, b = int(self.bounds[k]), int(self.bounds[k + 1])
        if a == b:
            return None
        return _Since(torch.from_numpy(self.positions[a:b]), torch.from_numpy(self.anchor[a:b]))


def sampled(positions: np.ndarray, rate_log2: int) -> np.ndarray:
    """Boolean mask of the ``positions`` a drift sampled at ``rate_log2`` keeps (all of them at 0)."""
    if rate_log2 <= 0:
        return np.ones(positions.shape, dtype=bool)
    h = positions.astype(np.uint64) * _GOLDEN  # wraps mod 2**64, as Fibonacci hashing wants
    return (h >> np.uint64(64 - rate_log2)) == 0


def _kept_bounds(bounds: np.ndarray, masks: Sequence[np.ndarray]) -> np.ndarray:
    """Row bounds over the stream ``masks`` (concatenated) keeps, from the bounds over the whole stream."""
    kept = np.zeros(int(bounds[-1]) + 1, np.int64)
    if kept.size > 1:
        np.cumsum(np.concatenate(masks) if len(masks) != 1 else masks[0], out=kept[1:])
    return kept[bounds]


def _sample_table(t: _Table, rate_log2: int) -> _Table:
    """``t`` with only the positions sampled at ``rate_log2`` (fresh buffers)."""
    m = sampled(t.positions, rate_log2)
    return _Table(t.names, t.index, _kept_bounds(t.bounds, [m]), t.positions[m], t.anchor[m])


def _sample_rows(rows: _Rows, rate_log2: int) -> _Rows:
    """A version's changes with only the positions sampled at ``rate_log2`` (copies of those, in one part: one
    kernel pass over the changes, :func:`~deltastore.kernels.diff.sample_stream`)."""
    if rate_log2 <= 0:
        return rows
    names, index, c_bounds, parts = rows
    parts = [(np.ascontiguousarray(pos, np.int64), np.ascontiguousarray(old), np.ascontiguousarray(new))
             for pos, old, new in parts]
    total = sum(p.size for p, _, _ in parts)
    bits = parts[0][1].dtype if parts else np.dtype(np.uint16)
    # room for every change (pages never written cost nothing), shrunk in place to the sample
    pos, old, new = np.empty(total + 1, np.int64), np.empty(total + 1, bits), np.empty(total + 1, bits)
    bounds = np.empty(len(c_bounds), np.int64)
    at = [np.fromiter((a[j].ctypes.data for a in parts), np.int64, len(parts)) for j in range(3)]
    kept = sample_stream(old[:0], at[0], at[1], at[2],
                         np.fromiter((p.size for p, _, _ in parts), np.int64, len(parts)),
                         np.ascontiguousarray(c_bounds, np.int64), rate_log2, pos, old, new, bounds)
    for a in (pos, old, new):
        a.resize(kept, refcheck=False)
    return names, index, bounds, [(pos, old, new)]


class Drift:
    """A drift state (proposed or committed): per tensor, the elements that differ from the anchor.

    A proposal holds its merges prepared and counted (:attr:`count` needs no table); the first read
    of its elements (:meth:`get`, :meth:`items`, :attr:`nbytes`) builds them in fresh buffers, else
    :meth:`DriftTracker.commit` merges them into the committed table's own buffers. ``rate_log2``: the
    positions held are a sample of one in ``2**rate_log2`` (0: every one, :attr:`exact`).
    """

    def __init__(self, tables: Mapping[np.dtype, _Table], merges: Mapping[np.dtype, _Merge] | None = None,
                 generation: int = 0, rate_log2: int = 0):
        self._built = dict(tables)
        self._merges = dict(merges or {})
        self.generation = generation
        self.rate_log2 = rate_log2

    @property
    def exact(self) -> bool:
        """Whether every drifted position is held (else a sample: no differential from it)."""
        return self.rate_log2 == 0

    @property
    def tables(self) -> dict[np.dtype, _Table]:
        """Every element width's table (a proposal's merges built now, once)."""
        if self._merges:
            for dt, m in self._merges.items():
                self._built[dt] = m.into_new()
            self._merges = {}
        return self._built

    def get(self, name: str) -> _Since | None:
        """The elements of ``name`` that differ from the anchor (views), or None when none do."""
        for t in self.tables.values():
            since = t.row(name)
            if since is not None:
                return since
        return None

    @property
    def count(self) -> int:
        """Positions held (the drift itself when :attr:`exact`, else the sample's size)."""
        return sum(int(t.bounds[-1]) for dt, t in self._built.items() if dt not in self._merges) + \
            sum(m.count for m in self._merges.values())

    def held_bytes(self) -> int:
        """Bytes the held positions and anchor bits take (counted, nothing built)."""
        out = 0
        for dt, t in self._built.items():
            if dt not in self._merges:
                out += int(t.bounds[-1]) * (t.positions.itemsize + t.anchor.itemsize)
        for m in self._merges.values():
            out += m.count * ((8 if m.wide else 4) + m.p_anchor.itemsize)
        return out

    @property
    def nbytes(self) -> int:
        """Host bytes the drift holds (positions and the anchor's bits)."""
        return sum(t.positions.nbytes + t.anchor.nbytes + t.bounds.nbytes for t in self.tables.values())

    def items(self) -> list[tuple[str, _Since]]:
        out = []
        for t in self.tables.values():
            sizes = np.diff(t.bounds)
            for k in np.flatnonzero(sizes).tolist():
                since = t.row(t.names[k])
                assert since is not None
                out.append((t.names[k], since))
        return out


def _rows(prev: _Table | None, group: list[tuple[str, Change]]) -> _Rows:
    """The version's changes of ``group`` as rows of ``prev``'s table (new tensors appended), a part per tensor."""
    names = list(prev.names) if prev is not None else []
    index = dict(prev.index) if prev is not None else {}
    for name, _ in group:
        if name not in index:
            index[name] = len(names)
            names.append(name)
    group.sort(key=lambda item: index[item[0]])
    keys = np.fromiter((index[n] for n, _ in group), dtype=np.int64, count=len(group))
    counts = np.zeros(len(names), np.int64)
    counts[keys] = np.fromiter((ch.count for _, ch in group), dtype=np.int64, count=len(group))
    c_bounds = np.zeros(len(names) + 1, np.int64)
    np.cumsum(counts, out=c_bounds[1:])
    return tuple(names), index, c_bounds, [(ch.positions.numpy(), ch.old_bits.numpy(), ch.new_bits.numpy())
                                           for _, ch in group]


def _flat_rows(prev: _Table | None, names: list[str], fc: FlatChanges) -> _Rows | None:
    """The compare's flat changes as rows, when their tensors are exactly ``prev``'s rows (or it has none)."""
    if prev is not None and prev.names != tuple(names):
        return None
    index = prev.index if prev is not None else {n: k for k, n in enumerate(names)}
    # the compare's parts as they are: joining them would fault in a fresh copy of every change (12 B each)
    return (tuple(names), index, np.ascontiguousarray(fc.bounds, dtype=np.int64),
            [(pos.numpy(), old.numpy(), new.numpy()) for pos, new, old in fc.parts])


class _Merge:
    """One element width's merge of a version's changes into the committed table: prepared and counted
    now (one pass that writes nothing), written later, into fresh buffers or into the table's own."""

    def __init__(self, prev: _Table | None, rows: _Rows):
        self.names, self.index, self.c_bounds, parts = rows
        self.prev = prev
        k_all = len(self.names)
        if prev is not None:
            self.p_bounds = np.concatenate([prev.bounds, np.full(k_all - len(prev.names), prev.bounds[-1], np.int64)])
            p_pos, p_anchor = prev.positions, prev.anchor
        else:
            self.p_bounds = np.zeros(k_all + 1, np.int64)
            p_pos, p_anchor = np.zeros(0, np.int32), np.zeros(0, parts[0][1].dtype)  # callers pass >= 1 part
        self.p_pos, self.p_anchor = p_pos, p_anchor
        # the kernels read the parts by address: contiguous, int64 positions, bits of the table's dtype
        self.parts = [(np.ascontiguousarray(pos, np.int64), np.ascontiguousarray(old).view(p_anchor.dtype),
                       np.ascontiguousarray(new).view(p_anchor.dtype)) for pos, old, new in parts]
        self.wide = p_pos.dtype == np.int64 or any(pos.size and int(pos.max()) > _INT32_MAX
                                                   for pos, _, _ in self.parts)
        self.lens = np.fromiter((pos.size for pos, _, _ in self.parts), np.int64, len(self.parts))
        assert int(self.lens.sum()) == int(self.c_bounds[-1])
        self.at = [np.fromiter((a[j].ctypes.data for a in self.parts), np.int64, len(self.parts)) for j in range(3)]
        self.runs = merge_runs(self.p_bounds, self.c_bounds, self.lens, threads(), _MIN_MERGE_WORK)
        # counted on every kernel thread (the count decides the anchor policy: it is on the publish path)
        self.run_counts = self._each(self.p_pos[:0], self.p_anchor[:0], np.empty(0, np.int64), [0] * len(self.runs),
                                     write=False)
        self.count = sum(self.run_counts)

    @property
    def size(self) -> int:
        """Elements the merge may write (before dropping those back at the anchor's bits)."""
        return self.p_pos.size + int(self.lens.sum())

    def _each(self, out_pos: np.ndarray, out_anchor: np.ndarray, out_bounds: np.ndarray, starts: list[int], *,
              write: bool) -> list[int]:
        """Each run of rows merged (or counted) on its own thread, its output from ``starts[r]`` on."""
        def run(r: int) -> int:
            k0, k1, q0, base0 = self.runs[r]
            return drift_merge_rows(self.p_anchor[:0], np.empty(0, np.int64), self.p_bounds, self.p_pos,
                                    self.p_anchor, self.c_bounds, *self.at, self.lens, out_bounds, out_pos,
                                    out_anchor, write, k0, k1, q0, base0, starts[r])
        return each(len(self.runs), run)

    def _run(self, out_pos: np.ndarray, out_anchor: np.ndarray, out_bounds: np.ndarray) -> int:
        """The merged table written to ``out_*`` (every run at its place, on every kernel thread)."""
        out_bounds[0] = 0
        starts = np.concatenate([[0], np.cumsum(self.run_counts)]).astype(np.int64).tolist()
        self._each(out_pos, out_anchor, out_bounds, starts[:-1], write=True)
        return self.count

    def _table(self, bounds: np.ndarray, pos: np.ndarray, anchor: np.ndarray, used: int, *, room: bool) -> _Table:
        return _Table(self.names, self.index, bounds, pos[:used], anchor[:used], (pos, anchor) if room else None)

    def into_new(self) -> _Table:
        """The merged table in fresh buffers of its exact size."""
        out_pos = np.empty(self.size, np.int64 if self.wide else np.int32)
        out_anchor = np.empty(self.size, self.p_anchor.dtype)
        out_bounds = np.empty(len(self.names) + 1, np.int64)
        used = self._run(out_pos, out_anchor, out_bounds)
        out_pos.resize(used, refcheck=False)  # in place: no second copy of the drift at its peak
        out_anchor.resize(used, refcheck=False)
        return self._table(out_bounds, out_pos, out_anchor, used, room=False)

    def into_prev(self) -> _Table:
        """The merged table written over the previous one (``prev``'s buffers are reused when they have
        room, else new ones with room for later merges): the pages a merge writes are then mostly
        resident already, where fresh ones cost a page fault each (see ``bench/NOTES.md``).
        ``prev`` is not valid afterwards."""
        bounds = np.empty(len(self.names) + 1, np.int64)
        room = self.prev.room if self.prev is not None else None
        pdt = np.int64 if self.wide else np.int32
        if room is not None and room[0].dtype == pdt and room[0].size >= self.size:
            pos, anchor = room
            used = drift_merge_rows_in_place(self.p_anchor[:0], np.empty(0, np.int64), self.p_bounds, pos, anchor,
                                             self.c_bounds, *self.at, self.lens, bounds)
            touched = self.size
        else:  # room for a few more versions like this one: untouched pages cost no memory
            capacity = self.size + 2 * int(self.lens.sum()) + 4096
            pos, anchor = np.empty(capacity, pdt), np.empty(capacity, self.p_anchor.dtype)
            used = self._run(pos, anchor, bounds)
            touched = used
        for a in (pos, anchor):  # what lies beyond the merged table goes back to the system
            discard(a, used, touched)
        return self._table(bounds, pos, anchor, used, room=True)


class DriftTracker:
    """The committed drift, and proposals of what it becomes after one more version.

    A commit merges the proposal into the committed table's own buffers (unless the proposal's
    elements were read already, which built them apart): every proposal made before a commit is
    stale after it (:meth:`commit` refuses one).
    """

    def __init__(self) -> None:
        self._generation = 0
        self._drift = Drift({})

    def reset(self) -> None:
        """Forget everything (a new anchor was committed)."""
        self._generation += 1
        self._drift = Drift({}, generation=self._generation)

    @property
    def nbytes(self) -> int:
        """Host bytes of the committed drift (the one piece of publisher memory that grows along a chain)."""
        return self._drift.nbytes

    @property
    def rate_log2(self) -> int:
        """The committed drift holds one drifted position in ``2**rate_log2`` (0: every one, exact)."""
        return self._drift.rate_log2

    def propose(self, changes: Mapping[str, Change] | Diff,
                flat: Sequence[tuple[list[str], FlatChanges]] = (), *, budget_bytes: int | None = None) -> Drift:
        """The drift after ``changes`` (nothing is modified until :meth:`commit`); one merge per element width.

        ``flat``: the compare's flat changes (:attr:`deltastore.publish.mirror.Diff.flat`); when they
        cover every tensor of ``changes``, they are merged as they are, with no work per tensor.
        ``changes`` may be the compare's :class:`~deltastore.publish.mirror.Diff` itself: its flat
        changes are used, and its per-tensor changes only when those do not cover every tensor.
        The arrays of ``changes`` must stay as they are until the proposal is committed or dropped.
        ``budget_bytes``: the most the drift may hold (see the module's "Sampling"); None: exact, unbounded.
        """
        committed = self._drift
        tables = committed.tables
        staged: list[tuple[np.dtype, _Rows]] | None = None
        if isinstance(changes, Mapping):
            n_tensors = len(changes)
        else:  # a Diff
            flat, n_tensors = changes.flat, len(changes.sums)
        if flat and sum(len(names) for names, _ in flat) == n_tensors:
            staged = []
            for names, fc in flat:
                if not fc.parts:
                    continue
                dt = fc.parts[0][2].numpy().dtype
                rows = _flat_rows(tables.get(dt), names, fc)
                if rows is None:
                    staged = None
                    break
                staged.append((dt, rows))
        if staged is None:
            groups: dict[np.dtype, list[tuple[str, Change]]] = {}
            for name, ch in (changes if isinstance(changes, Mapping) else changes.changes).items():
                if ch.count:
                    groups.setdefault(ch.old_bits.numpy().dtype, []).append((name, ch))
            staged = [(dt, _rows(tables.get(dt), group)) for dt, group in groups.items()]
        rate = committed.rate_log2
        while True:
            base = tables if rate == committed.rate_log2 else {dt: _sample_table(t, rate) for dt, t in tables.items()}
            merges = {dt: _Merge(base.get(dt), _sample_rows(rows, rate)) for dt, rows in staged}
            proposed = Drift(base, merges, self._generation, rate)
            held = proposed.held_bytes()
            if budget_bytes is None or held <= budget_bytes or rate >= _MAX_RATE_LOG2:
                return proposed
            # a sample of one in 2**k more holds about held / 2**k: a little under the budget
            rate = min(_MAX_RATE_LOG2, rate + max(1, math.ceil(math.log2(held / max(1, budget_bytes))) + 1))

    def commit(self, proposed: Drift) -> None:
        """Make ``proposed`` the committed drift; it stays valid as that. Raises ``RuntimeError`` for a
        proposal made before the last commit or reset."""
        if proposed.generation != self._generation:
            raise RuntimeError("drift: this proposal was made before the last commit or reset")
        built = dict(proposed._built)
        built.update((dt, m.into_prev()) for dt, m in proposed._merges.items())
        self._generation += 1
        proposed._built, proposed._merges, proposed.generation = built, {}, self._generation
        self._drift = proposed

    @staticmethod
    def count(proposed: Drift | None) -> int:
        """Elements that differ from the anchor: exact, or the sample scaled up (an estimate); 0 without a
        proposal (a version that tracks no drift)."""
        return 0 if proposed is None else proposed.count << proposed.rate_log2

    @staticmethod
    def differential(proposed: Drift, read: Read) -> dict[str, Change]:
        """Per tensor, the elements that differ from the anchor: positions, current bits, anchor bits.

        ``read`` gives the current version's bits (the publisher's mirror once it holds this version).
        Raises ``ValueError`` for a sampled drift (it holds only some of the positions).
        """
        _require_exact(proposed)
        out = {}
        for name, s in proposed.items():
            pos = s.positions.to(torch.int64)
            out[name] = Change(pos, read(name, pos), s.anchor_bits)
        return out

    @staticmethod
    def differential_flat(proposed: Drift, views: Callable[[str], torch.Tensor]
                          ) -> list[tuple[list[str], DifferentialRows]]:
        """:meth:`differential` as flat changes, one per element width, with no work per tensor.

        ``views(name)``: the current version's flat bits as a CPU tensor (the mirror's view). Nothing
        is read here: each :class:`DifferentialRows` reads its tensors' rows when an encoder selects
        them. Tensors without drift have empty rows. Raises ``ValueError`` for a sampled drift.
        """
        _require_exact(proposed)
        return [(list(t.names), DifferentialRows(t, views)) for t in proposed.tables.values()]


def _require_exact(proposed: Drift) -> None:
    if not proposed.exact:
        raise ValueError(f"the drift is a sample (one position in {1 << proposed.rate_log2}): it gives no "
                         "differential; rebuild it from the stored anchor")


def anchored(differential: Mapping[str, Change]) -> dict[str, _Since]:
    """A differential's changes (current bits new, the anchor's old) as what the drift gives per tensor:
    positions and the anchor's bits there (``ObjectPlanner.sparse_jobs(base=)`` reads these)."""
    return {n: _Since(ch.positions, ch.old_bits) for n, ch in differential.items() if ch.count}


class DifferentialRows:
    """One drift table's differential (anchor -> now), read when selected.

    It answers what :class:`~deltastore.publish.mirror.Diff` asks of its flat
    changes (``bounds``, :meth:`select`, :meth:`changes`): :meth:`select`
    widens the positions and gathers the current bits of the selected tensors
    only, so an encoder holds its own object's elements (10 bytes each beyond
    the drift), not the whole differential's at once. The views must hold the
    version being published while it is used.
    """

    def __init__(self, table: _Table, views: Callable[[str], torch.Tensor]):
        self.bounds = table.bounds
        self._table = table
        self._views = views

    def select(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
        """``(positions int64, current bits, anchor bits, bounds)`` of rows ``idx`` (any order), back to back
        (as :meth:`FlatChanges.select <deltastore.segments.FlatChanges.select>`: views of one range of the
        table, else one kernel copy)."""
        t = self._table
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        run = segments.one_range(t.bounds, idx)
        if run is not None:
            a, e, bounds = run
            pos, anchor = torch.from_numpy(t.positions[a:e]), torch.from_numpy(t.anchor[a:e])
        else:
            (pos, anchor), bounds = segments.take([torch.from_numpy(t.positions), torch.from_numpy(t.anchor)],
                                                  t.bounds, idx)
        positions = pos.to(torch.int64)  # the drift keeps 32-bit positions where they fit: widened per object
        new = segments.gather([self._views(t.names[i]) for i in idx.tolist()], positions, bounds)
        return positions, new, anchor, bounds

    def changes(self) -> list[Change]:
        """Every row's :class:`~deltastore.segments.Change` (one read of the whole table)."""
        pos, new, old, bounds = self.select(np.arange(len(self._table.names)))
        sizes = np.diff(bounds).tolist()
        return [Change(p, q, o) for p, q, o in zip(pos.split(sizes), new.split(sizes), old.split(sizes))]
