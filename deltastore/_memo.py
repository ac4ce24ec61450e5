"""What follows from a list alone, kept for the last list while the very same objects come again.

A follower's pulls meet the same tensors step after step: the same name
strings and spec objects of one parsed layout (:mod:`deltastore.manifest`).
What follows from such a list alone (its name order, its names' digest) is
then worked out once, not once per pull. The items are compared by identity
(one C-level pass), never by value: a list of other, equal objects is worked
out again. One entry per function, replaced by one assignment, so a thread
sees the old entry or the new one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class LastList(Generic[T, R]):
    """``fn(items)``, kept for the last ``items`` (a copy of the list; the result is returned as it is, so
    ``fn`` should return something its callers do not change)."""

    def __init__(self, fn: Callable[[list[T]], R]):
        self._fn = fn
        self._last: tuple[list[T], R] | None = None

    def __call__(self, items: Sequence[T]) -> R:
        last = self._last
        if last is not None and len(last[0]) == len(items) and all(map(operator.is_, last[0], items)):
            return last[1]
        kept = list(items)
        got = self._fn(kept)
        self._last = (kept, got)
        return got
