"""The transport layer: bytes by key, nothing about deltas.

A backend stores opaque byte strings under ``/``-separated keys relative to
its root. Keys are validated by :func:`check_key`: no empty, absolute or
``..`` parts, so a hostile manifest can never make a backend touch anything
outside its root.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidKeyError

PutMode = Literal["overwrite", "create"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees.

    atomic_create: ``put(mode="create")`` is atomic: of concurrent creators
        exactly one wins and the others get :class:`KeyExistsError`. Without
        it a create is check-then-write and a race can let two writers in.
    listing: ``list(prefix)`` is supported and sees every committed key.
    ranged_reads: ``get_range`` reads a byte range without fetching the whole value.
    """

    atomic_create: bool
    listing: bool = True
    ranged_reads: bool = False


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKeyError(f"invalid store key {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise InvalidKeyError(f"invalid store key {key!r}: empty, '.' or '..' path part")
    return key


class Backend(abc.ABC):
    """Bytes by key.

    Implementations raise :class:`KeyNotFoundError` for a missing key,
    :class:`KeyExistsError` when ``put(mode="create")`` finds the key present,
    and :class:`InvalidKeyError` for a malformed key. A reader must never see a
    partially written value.
    """

    capabilities: Capabilities

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Backend:
        """Open the backend a URI names; ``options`` are the caller's storage options."""
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URI")

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole value stored under ``key``."""

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the value (whole read unless the backend can do better)."""
        return self.get(key)[start:end]

    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        """Store ``data`` under ``key``; with ``mode="create"`` fail if the key exists."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key that starts with ``prefix`` (in no particular order)."""

    def close(self) -> None:
        """Release connections; the default does nothing."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
