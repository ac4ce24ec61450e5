"""Elements that differ from the last anchor, tracked in O(drift) memory.

The Publisher keeps, per tensor, the sorted flat positions whose bits differ
from the last anchor's now, and the anchor's bits there (6 bytes per drifted
bf16 element with 32-bit positions; nothing else: the current bits are the
mirror's). From it come the *drift* (how many elements differ from the anchor)
and the *differential* (anchor -> now) that a joiner can use instead of
replaying the chain. Each version's changes are merged in one pass per tensor
(:func:`deltastore.kernels.diff.drift_merge`); an element that changes back to
the anchor's bits leaves the set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .diff import Change
from .kernels.diff import drift_merge, segment_runs
from .kernels.parallel import chunked, threads

#: ``read(name, positions) -> bits`` of the current version at those flat positions
Read = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class _Since:
    positions: torch.Tensor    # sorted positions whose bits differ from the anchor (int32 when they fit)
    anchor_bits: torch.Tensor  # the anchor's bits there

    @property
    def differing(self) -> int:
        return int(self.positions.numel())


def _positions_dtype(ch: Change, prev: _Since | None) -> torch.dtype:
    if prev is not None and prev.positions.dtype == torch.int64:
        return torch.int64
    last = int(ch.positions[-1]) if ch.count else 0
    return torch.int32 if last < 2**31 - 1 else torch.int64


class DriftTracker:
    """Per tensor, the elements that differ from the anchor and the anchor's bits there."""

    def __init__(self) -> None:
        self._since: dict[str, _Since] = {}

    def reset(self) -> None:
        """Forget everything (a new anchor was committed)."""
        self._since = {}

    def propose(self, changes: Mapping[str, Change]) -> dict[str, _Since]:
        """The per-tensor state after ``changes`` (nothing is modified until :meth:`commit`).

        Tensors are merged in parallel on the kernel threads (the merge kernel runs without the GIL).
        """
        out = dict(self._since)
        merges = []
        for name, ch in changes.items():
            if not ch.count:
                continue
            prev = self._since.get(name)
            pdt = _positions_dtype(ch, prev)
            if prev is None:  # every change is a first change: the old bits are the anchor's
                out[name] = _Since(ch.positions.to(pdt, copy=True), ch.old_bits.clone())
            else:
                merges.append((name, ch, prev, pdt))

        def merge(i: int) -> _Since | None:
            name, ch, prev, pdt = merges[i]
            n = prev.positions.numel() + ch.count
            pos = np.empty(n, dtype=np.int32 if pdt == torch.int32 else np.int64)
            anchor = np.empty(n, dtype=ch.old_bits.numpy().dtype)
            c = drift_merge(prev.positions.numpy(), prev.anchor_bits.numpy(), ch.positions.numpy(),
                            ch.old_bits.numpy(), ch.new_bits.numpy(), pos, anchor)
            pos.resize(c, refcheck=False)
            anchor.resize(c, refcheck=False)
            return _Since(torch.from_numpy(pos), torch.from_numpy(anchor)) if c else None

        sizes = np.fromiter((m[2].positions.numel() + m[1].count for m in merges), dtype=np.int64,
                            count=len(merges))
        runs = segment_runs(np.concatenate([[0], np.cumsum(sizes)]), threads())
        done = chunked(len(runs), lambda a, b: [[merge(i) for i in range(*runs[r])] for r in range(a, b)],
                       min_chunk=1, pieces=len(runs)) if runs else []
        results = [x for part in done for run in part for x in run]
        for (name, *_), since in zip(merges, results):
            if since is None:
                out.pop(name, None)
            else:
                out[name] = since
        return out

    def commit(self, proposed: dict[str, _Since]) -> None:
        self._since = proposed

    @staticmethod
    def count(proposed: Mapping[str, _Since]) -> int:
        return sum(s.differing for s in proposed.values())

    @staticmethod
    def differential(proposed: Mapping[str, _Since], read: Read) -> dict[str, Change]:
        """Per tensor, the elements that differ from the anchor: positions, current bits, anchor bits.

        ``read`` gives the current version's bits (the publisher's mirror once it holds this version).
        """
        out = {}
        for name, s in proposed.items():
            pos = s.positions.to(torch.int64)
            out[name] = Change(pos, read(name, pos), s.anchor_bits)
        return out
