"""Parsed manifests by step, bounded: a long-running follower or publisher does not grow with its step count.

A manifest is immutable once committed, so a parsed copy can be reused for
as long as it is kept; dropping one only costs reading and parsing it again.
A parsed manifest holds several times its JSON size (format 1.2: four to
five times, 12 MB for 16,384 tensors; 1.3, whose layout is shared by every
manifest of that layout: 4.7 MB for 0.6 MB of JSON), and a follower reads one
per step: kept for ever, they would grow without end.

The cache keeps the most recently used manifests within ``max_entries``
entries and ``max_bytes`` bytes of JSON, but always the ``keep`` most recent
ones (the version a target holds and the one it moves to). While an
operation *holds* the cache (:meth:`ManifestCache.holding`: a pull walking a
chain of parents, then staging along it), nothing is dropped, so one pull
reads each manifest of its path once whatever the path's length; the cache
is trimmed when the last holder returns. Holds nest and may come from
several threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

V = TypeVar("V")

MAX_ENTRIES = 4
"""Manifests kept between operations, at most."""
MAX_BYTES = 4 << 20
"""Bytes of manifest JSON kept between operations, at most (parsed, four to five times as much): a
follower between two pulls needs only the manifest of the version it holds."""
KEEP = 2
"""The most recently used manifests kept whatever their size."""


class ManifestCache(Generic[V]):
    """Values by step, least recently used dropped beyond the bounds (see the module docstring).

    ``max_entries`` / ``max_bytes``: the bounds outside holds (``ValueError`` if negative or below
    ``keep``); ``keep``: entries always kept. Thread-safe.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, keep: int = KEEP):
        if keep < 0 or max_entries < keep or max_bytes < 0:
            raise ValueError(f"manifest cache bounds: max_entries={max_entries}, max_bytes={max_bytes}, "
                             f"keep={keep} (need 0 <= keep <= max_entries and max_bytes >= 0)")
        self.max_entries, self.max_bytes, self.keep = max_entries, max_bytes, keep
        self._items: OrderedDict[int, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._holders = 0
        self._lock = threading.Lock()

    def get(self, step: int) -> V | None:
        """The value of ``step`` (now the most recently used), or None."""
        with self._lock:
            got = self._items.get(step)
            if got is None:
                return None
            self._items.move_to_end(step)
            return got[0]

    def put(self, step: int, value: V, nbytes: int) -> None:
        """Keep ``value`` for ``step`` (``nbytes``: its manifest's JSON size), then trim unless held."""
        with self._lock:
            old = self._items.pop(step, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[step] = (value, nbytes)
            self._bytes += nbytes
            if not self._holders:
                self._trim()

    def pop(self, step: int) -> None:
        """Drop ``step`` if kept."""
        with self._lock:
            old = self._items.pop(step, None)
            if old is not None:
                self._bytes -= old[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes of manifest JSON kept now."""
        return self._bytes

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Nothing is dropped until the block (and every other holder's) ends; then the cache is trimmed."""
        with self._lock:
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if not self._holders:
                    self._trim()

    def _trim(self) -> None:
        items = self._items
        while len(items) > self.keep and (len(items) > self.max_entries or self._bytes > self.max_bytes):
            _, (_, n) = items.popitem(last=False)
            self._bytes -= n
