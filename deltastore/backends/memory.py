"""In-process backend for tests and experiments: ``memory://NAME``.

Stores with the same name share their contents inside one process, so a
Publisher and a Subscriber opened on ``memory://run`` meet each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from ..errors import KeyExistsError, KeyNotFoundError
from .base import Backend, Capabilities, PutMode, check_key

_SHARED: dict[str, tuple[dict[str, bytes], threading.Lock]] = {}
_SHARED_LOCK = threading.Lock()


class MemoryBackend(Backend):
    """A dict of bytes guarded by a lock; ``name`` selects a process-wide shared dict."""

    capabilities = Capabilities(atomic_create=True, listing=True, ranged_reads=True)

    def __init__(self, name: str = ""):
        self.name = name
        with _SHARED_LOCK:
            self._data, self._lock = _SHARED.setdefault(name, ({}, threading.Lock()))

    def __repr__(self) -> str:
        return f"MemoryBackend({self.name!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> MemoryBackend:
        """``memory://NAME`` -> the shared in-process store NAME."""
        if options:
            raise TypeError(f"memory:// takes no storage options, got {sorted(options)}")
        return cls(uri.split("://", 1)[1])

    def get(self, key: str) -> bytes:
        check_key(key)
        try:
            return self._data[key]
        except KeyError:
            raise KeyNotFoundError(f"{key!r} not found in memory://{self.name}") from None

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
        check_key(key)
        with self._lock:
            if mode == "create" and key in self._data:
                raise KeyExistsError(f"{key!r} already exists in memory://{self.name}")
            self._data[key] = bytes(data)

    def exists(self, key: str) -> bool:
        return check_key(key) in self._data

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(check_key(key), None)

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            keys = [k for k in self._data if k.startswith(prefix)]
        yield from keys

    @staticmethod
    def clear_all() -> None:
        """Forget every shared memory store in this process."""
        with _SHARED_LOCK:
            _SHARED.clear()
