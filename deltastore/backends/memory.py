"""In-process backend for tests and experiments: ``memory://NAME``.

Stores with the same name share their contents inside one process, so a
Publisher and a Subscriber opened on ``memory://run`` meet each other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..errors import KeyExistsError, KeyNotFoundError
from .base import Backend, Capabilities, KeyInfo, PutMode
from .options import check_options

_SHARED: dict[str, tuple[dict[str, tuple[bytes, float]], threading.Lock]] = {}
_SHARED_LOCK = threading.Lock()


class MemoryBackend(Backend):
    """A dict of ``(bytes, mtime)`` guarded by a lock; ``name`` selects a process-wide shared dict."""

    capabilities = Capabilities(atomic_create=True, listing=True, ranged_reads=True, conditional_delete=True)

    def __init__(self, name: str = ""):
        self.name = name
        with _SHARED_LOCK:
            self._data, self._lock = _SHARED.setdefault(name, ({}, threading.Lock()))

    def __repr__(self) -> str:
        return f"MemoryBackend({self.name!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> MemoryBackend:
        """``memory://NAME`` -> the shared in-process store NAME."""
        check_options(options, (), uri)
        return cls(uri.split("://", 1)[1])

    def _entry(self, key: str) -> tuple[bytes, float]:
        try:
            return self._data[key]
        except KeyError:
            raise KeyNotFoundError(f"{key!r} not found in memory://{self.name}") from None

    def _get(self, key: str) -> bytes:
        return self._entry(key)[0]

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self._entry(key)[0][start:end]

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        with self._lock:
            if mode == "create" and key in self._data:
                raise KeyExistsError(f"{key!r} already exists in memory://{self.name}")
            self._data[key] = (bytes(data), time.time())

    def _exists(self, key: str) -> bool:
        return key in self._data

    def _delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def _stat(self, key: str) -> KeyInfo:
        data, mtime = self._entry(key)
        return KeyInfo(len(data), mtime)

    def _touch(self, key: str) -> None:
        with self._lock:
            data, _ = self._entry(key)
            self._data[key] = (data, time.time())

    def _delete_if_unmodified(self, key: str, seen: KeyInfo) -> bool:
        with self._lock:
            entry = self._data.get(key)
            if entry is None or (len(entry[0]), entry[1]) != (seen.size, seen.mtime):
                return False
            del self._data[key]
            return True

    def _list(self, prefix: str) -> Iterator[str]:
        with self._lock:
            keys = [k for k in self._data if k.startswith(prefix)]
        yield from keys

    @staticmethod
    def clear_all() -> None:
        """Forget every shared memory store in this process."""
        with _SHARED_LOCK:
            _SHARED.clear()
