"""Changes since the last anchor, tracked in O(drift) memory.

The Publisher keeps, per tensor, the sorted flat positions that changed at
least once since the last anchor and the anchor's bits there. From it come
the *drift* (how many elements differ from the anchor now: a union, and
elements that changed back do not count) and the *differential* (anchor ->
now) that a joiner can use instead of replaying the chain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .diff import Change


@dataclass
class _Since:
    positions: torch.Tensor    # sorted, every position changed since the anchor
    anchor_bits: torch.Tensor  # the anchor's bits there
    current: torch.Tensor      # the bits there now
    differing: int             # how many of them differ from the anchor now


class DriftTracker:
    """Union of changes since the anchor, per tensor."""

    def __init__(self) -> None:
        self._since: dict[str, _Since] = {}

    def reset(self) -> None:
        """Forget everything (a new anchor was committed)."""
        self._since = {}

    def propose(self, changes: Mapping[str, Change]) -> dict[str, _Since]:
        """The per-tensor state after ``changes`` (nothing is modified until :meth:`commit`)."""
        out = dict(self._since)
        for name, ch in changes.items():
            if not ch.count:
                continue
            prev = self._since.get(name)
            if prev is None:
                out[name] = _Since(ch.positions, ch.old_bits, ch.new_bits, ch.count)
                continue
            union, inverse = torch.unique(torch.cat([prev.positions, ch.positions]), sorted=True,
                                          return_inverse=True)
            n_prev = prev.positions.numel()
            anchor = torch.empty(union.numel(), dtype=ch.new_bits.dtype)
            current = torch.empty_like(anchor)
            anchor[inverse[n_prev:]] = ch.old_bits  # first touches: the bits before are the anchor's
            anchor[inverse[:n_prev]] = prev.anchor_bits  # earlier touches keep their anchor bits
            current[inverse[:n_prev]] = prev.current
            current[inverse[n_prev:]] = ch.new_bits
            out[name] = _Since(union, anchor, current, int((anchor != current).sum()))
        return out

    def commit(self, proposed: dict[str, _Since]) -> None:
        self._since = proposed

    @staticmethod
    def count(proposed: Mapping[str, _Since]) -> int:
        return sum(s.differing for s in proposed.values())

    @staticmethod
    def differential(proposed: Mapping[str, _Since]) -> dict[str, Change]:
        """Per tensor, the elements that differ from the anchor: positions, current bits, anchor bits."""
        out = {}
        for name, s in proposed.items():
            mask = s.anchor_bits != s.current
            out[name] = Change(s.positions[mask], s.current[mask], s.anchor_bits[mask])
        return out
