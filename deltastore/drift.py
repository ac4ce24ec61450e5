"""Elements that differ from the last anchor, tracked in O(drift) memory.

The Publisher keeps the flat positions whose bits differ from the last
anchor's now, and the anchor's bits there (6 bytes per drifted bf16 element
with 32-bit positions; nothing else: the current bits are the mirror's). From
it come the *drift* (how many elements differ from the anchor) and the
*differential* (anchor -> now) that a joiner can use instead of replaying the
chain. An element that changes back to the anchor's bits leaves the set.

Layout: one compressed-row table per element width (:class:`_Table`): tensor
``k`` of the table owns ``positions[bounds[k]:bounds[k + 1]]`` (sorted) and the
anchor's bits there. A version's changes are merged into a table by one
kernel call (:func:`deltastore.kernels.diff.drift_merge_rows`) whatever the
tensor count, so the cost follows the drifted and changed elements, not the
number of tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import segments
from .diff import Change
from .kernels.diff import drift_merge_rows
from .segments import FlatChanges

if TYPE_CHECKING:
    from .publish.mirror import Diff

#: ``read(name, positions) -> bits`` of the current version at those flat positions
Read = Callable[[str, torch.Tensor], torch.Tensor]

_INT32_MAX = 2**31 - 1


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

    def row(self, name: str) -> _Since | None:
        k = self.index.get(name)
        if k is None:
            return None
        a, b = int(self.bounds[k]), int(self.bounds[k + 1])
        if a == b:
            return None
        return _Since(torch.from_numpy(self.positions[a:b]), torch.from_numpy(self.anchor[a:b]))


class Drift:
    """A drift state (proposed or committed): per tensor, the elements that differ from the anchor."""

    def __init__(self, tables: Mapping[np.dtype, _Table]):
        self._tables = dict(tables)

    def get(self, name: str) -> _Since | None:
        """The elements of ``name`` that differ from the anchor (views), or None when none do."""
        for t in self._tables.values():
            since = t.row(name)
            if since is not None:
                return since
        return None

    @property
    def count(self) -> int:
        return sum(int(t.bounds[-1]) for t in self._tables.values())

    @property
    def nbytes(self) -> int:
        """Host bytes the drift holds (positions and the anchor's bits)."""
        return sum(t.positions.nbytes + t.anchor.nbytes + t.bounds.nbytes for t in self._tables.values())

    def items(self) -> list[tuple[str, _Since]]:
        out = []
        for t in self._tables.values():
            sizes = np.diff(t.bounds)
            for k in np.flatnonzero(sizes).tolist():
                since = t.row(t.names[k])
                assert since is not None
                out.append((t.names[k], since))
        return out


def _rows(prev: _Table | None, group: list[tuple[str, Change]]
          ) -> tuple[tuple[str, ...], dict[str, int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The version's changes of ``group`` as rows of ``prev``'s table (new tensors appended)."""
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
    return (tuple(names), index, c_bounds, np.concatenate([ch.positions.numpy() for _, ch in group]),
            np.concatenate([ch.old_bits.numpy() for _, ch in group]),
            np.concatenate([ch.new_bits.numpy() for _, ch in group]))


def _flat_rows(prev: _Table | None, names: list[str], fc: FlatChanges
               ) -> tuple[tuple[str, ...], dict[str, int], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The compare's flat changes as rows, when their tensors are exactly ``prev``'s rows (or it has none)."""
    if prev is not None and prev.names != tuple(names):
        return None
    index = prev.index if prev is not None else {n: k for k, n in enumerate(names)}
    pos, new, old = (np.concatenate([p[j].numpy() for p in fc.parts]) if len(fc.parts) != 1 else fc.parts[0][j].numpy()
                     for j in range(3))
    return tuple(names), index, np.ascontiguousarray(fc.bounds, dtype=np.int64), pos, old, new


def _merge(prev: _Table | None, rows: tuple[tuple[str, ...], dict[str, int], np.ndarray, np.ndarray, np.ndarray,
                                            np.ndarray]) -> _Table:
    names, index, c_bounds, c_pos, c_old, c_new = rows
    k_all = len(names)
    if prev is not None:
        p_bounds = np.concatenate([prev.bounds, np.full(k_all - len(prev.names), prev.bounds[-1], np.int64)])
        p_pos, p_anchor = prev.positions, prev.anchor
    else:
        p_bounds = np.zeros(k_all + 1, np.int64)
        p_pos, p_anchor = np.zeros(0, np.int32), np.zeros(0, c_old.dtype)
    wide = p_pos.dtype == np.int64 or (c_pos.size and int(c_pos.max()) > _INT32_MAX)
    n = p_pos.size + c_pos.size
    out_pos = np.empty(n, np.int64 if wide else np.int32)
    out_anchor = np.empty(n, c_old.dtype)
    out_bounds = np.empty(k_all + 1, np.int64)
    used = drift_merge_rows(p_bounds, p_pos, p_anchor, c_bounds, c_pos, c_old, c_new,
                            out_bounds, out_pos, out_anchor)
    out_pos.resize(used, refcheck=False)  # in place: no second copy of the drift at its peak
    out_anchor.resize(used, refcheck=False)
    return _Table(names, index, out_bounds, out_pos, out_anchor)


class DriftTracker:
    """The committed drift, and proposals of what it becomes after one more version."""

    def __init__(self) -> None:
        self._drift = Drift({})

    def reset(self) -> None:
        """Forget everything (a new anchor was committed)."""
        self._drift = Drift({})

    @property
    def nbytes(self) -> int:
        """Host bytes of the committed drift (the one piece of publisher memory that grows along a chain)."""
        return self._drift.nbytes

    def propose(self, changes: Mapping[str, Change] | Diff,
                flat: Sequence[tuple[list[str], FlatChanges]] = ()) -> Drift:
        """The drift after ``changes`` (nothing is modified until :meth:`commit`); one merge per element width.

        ``flat``: the compare's flat changes (:attr:`deltastore.publish.mirror.Diff.flat`); when they
        cover every tensor of ``changes``, they are merged as they are, with no work per tensor.
        ``changes`` may be the compare's :class:`~deltastore.publish.mirror.Diff` itself: its flat
        changes are used, and its per-tensor changes only when those do not cover every tensor.
        """
        tables = dict(self._drift._tables)
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
                    break
                staged.append((dt, rows))
            else:
                for dt, rows in staged:
                    tables[dt] = _merge(tables.get(dt), rows)
                return Drift(tables)
        groups: dict[np.dtype, list[tuple[str, Change]]] = {}
        for name, ch in (changes if isinstance(changes, Mapping) else changes.changes).items():
            if ch.count:
                groups.setdefault(ch.old_bits.numpy().dtype, []).append((name, ch))
        for dt, group in groups.items():
            tables[dt] = _merge(tables.get(dt), _rows(tables.get(dt), group))
        return Drift(tables)

    def commit(self, proposed: Drift) -> None:
        self._drift = proposed

    @staticmethod
    def count(proposed: Drift) -> int:
        return proposed.count

    @staticmethod
    def differential(proposed: Drift, read: Read) -> dict[str, Change]:
        """Per tensor, the elements that differ from the anchor: positions, current bits, anchor bits.

        ``read`` gives the current version's bits (the publisher's mirror once it holds this version).
        """
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
        them. Tensors without drift have empty rows.
        """
        return [(list(t.names), DifferentialRows(t, views)) for t in proposed._tables.values()]


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
        if idx.size and bool((np.diff(idx) == 1).all()):
            a, e = int(t.bounds[idx[0]]), int(t.bounds[idx[-1] + 1])
            pos, anchor = torch.from_numpy(t.positions[a:e]), torch.from_numpy(t.anchor[a:e])
            bounds = t.bounds[idx[0]:idx[-1] + 2] - a
        else:
            (pos, anchor), bounds = segments.take([torch.from_numpy(t.positions), torch.from_numpy(t.anchor)],
                                                  t.bounds, idx)
        positions = pos.to(torch.int64)  # the drift keeps 32-bit positions where they fit: widened per object
        new = segments.gather([self._views(t.names[i]) for i in idx.tolist()], positions, bounds)
        return positions, new, anchor, bounds

    def changes(self) -> list[Change]:
        """Every row's :class:`~deltastore.diff.Change` (one read of the whole table)."""
        pos, new, old, bounds = self.select(np.arange(len(self._table.names)))
        sizes = np.diff(bounds).tolist()
        return [Change(p, q, o) for p, q, o in zip(pos.split(sizes), new.split(sizes), old.split(sizes))]
