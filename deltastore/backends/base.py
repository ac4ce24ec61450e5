"""The transport layer: bytes by key, nothing about deltas.

A backend stores opaque byte strings under ``/``-separated keys relative to
its root. :class:`Backend` validates every call once, here: keys by
:func:`check_key` (no empty, absolute or ``..`` parts, so a hostile manifest
can never make a backend touch anything outside its root), put modes by
:func:`check_mode`, ranges and limits by type. Implementations override the
``_``-prefixed hooks and receive only validated arguments.

Layers that add behaviour around any backend (retries, fault injection)
subclass :class:`WrapperBackend`, which forwards every hook to ``inner``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidKeyError, KeyExistsError, ValueTooLargeError

PutMode = Literal["overwrite", "create"]
PUT_MODES: tuple[str, ...] = ("overwrite", "create")


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees.

    atomic_create: ``put(mode="create")`` is atomic: of concurrent creators
        exactly one wins and the others get :class:`KeyExistsError`. Without
        it a create is check-then-write and a race can let two writers in.
    listing: ``list(prefix)`` is supported and sees every committed key.
    ranged_reads: ``get_range`` reads a byte range without fetching the whole value.
    conditional_delete: ``delete_if_unmodified`` is atomic against a concurrent
        ``touch``/``put`` of the key (GC then needs no time bound, see docs/format.md).
    remote: a network service; :func:`~deltastore.backends.open_backend` puts it
        behind the retry layer with a total deadline.
    mtime_resolution: granularity in seconds of :meth:`Backend.stat` times
        (S3 ``LastModified`` has whole seconds).
    """

    atomic_create: bool
    listing: bool = True
    ranged_reads: bool = False
    conditional_delete: bool = False
    remote: bool = False
    mtime_resolution: float = 0.0


@dataclass(frozen=True)
class KeyInfo:
    """Size in bytes and last-modification time (seconds since the epoch, by the store's clock)."""

    size: int
    mtime: float


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKeyError(f"invalid store key {key!r}")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise InvalidKeyError(f"invalid store key {key!r}: empty, '.' or '..' path part")
    return key


def check_prefix(prefix: str) -> str:
    """Return a listing ``prefix`` whose folder part (up to the last ``/``) is a safe key, or ``""``."""
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"invalid listing prefix {prefix!r}")
    folder = prefix.rpartition("/")[0]
    if folder:
        check_key(folder)
    if "\x00" in prefix or "\\" in prefix:
        raise InvalidKeyError(f"invalid listing prefix {prefix!r}")
    return prefix


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is a put mode (``"overwrite"`` or ``"create"``), else raise ValueError."""
    if mode not in PUT_MODES:
        raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
    return mode


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class Backend(abc.ABC):
    """Bytes by key.

    Implementations raise :class:`KeyNotFoundError` for a missing key,
    :class:`KeyExistsError` when ``put(mode="create")`` finds the key present,
    and a :class:`BackendError` subclass for a transport or storage failure.
    A reader must never see a partially written value. Every public method
    raises :class:`InvalidKeyError` for a malformed key and ValueError for a
    bad mode, range or limit before the backend is touched.
    """

    capabilities: Capabilities

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> Backend:
        """Open the backend a URI names; ``options`` are the caller's storage options."""
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URI")

    # -- public API (validated) -------------------------------------------------------
    def get(self, key: str) -> bytes:
        """Return the whole value stored under ``key``."""
        return self._get(check_key(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the value (fewer at its end)."""
        check_key(key)
        _check_int("start", start)
        _check_int("end", end)
        return self._get_range(key, start, end)

    def get_bounded(self, key: str, limit: int) -> bytes:
        """Return the value under ``key`` if it holds at most ``limit`` bytes.

        Never reads (or allocates) more than ``limit + 1`` bytes of it: a longer
        value raises :class:`ValueTooLargeError` (``.size`` is its size when known).
        """
        check_key(key)
        _check_int("limit", limit)
        data = self._get_bounded(key, limit)
        if len(data) > limit:
            raise ValueTooLargeError(f"{key!r} holds more than {limit} bytes", size=None)
        return data

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        """Store ``data`` under ``key``; with ``mode="create"`` fail if the key exists."""
        check_mode(mode)
        self._put(check_key(key), data, mode)

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value."""
        return self._exists(check_key(key))

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        self._delete(check_key(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key that starts with ``prefix`` (in no particular order); an absent prefix yields nothing."""
        return self._list(check_prefix(prefix))

    def stat(self, key: str) -> KeyInfo:
        """Size and modification time of ``key`` (:class:`KeyNotFoundError` when absent)."""
        return self._stat(check_key(key))

    def touch(self, key: str) -> None:
        """Make ``key``'s modification time now, keeping its bytes (:class:`KeyNotFoundError` when absent)."""
        self._touch(check_key(key))

    def delete_if_unmodified(self, key: str, seen: KeyInfo) -> bool:
        """Delete ``key`` only if it still has the ``seen`` size and mtime; True when deleted.

        Atomic against a concurrent ``touch``/``put`` where
        ``capabilities.conditional_delete``; elsewhere NotImplementedError.
        """
        return self._delete_if_unmodified(check_key(key), seen)

    def get_many(self, keys: list[str], *, limits: Mapping[str, int] | None = None) -> dict[str, bytes]:
        """``{key: value}`` for every key (duplicates once); with ``limits``, a key's value is read as by
        :meth:`get_bounded`. Raises :class:`KeyNotFoundError` when any key is missing."""
        keys = [check_key(k) for k in dict.fromkeys(keys)]
        if limits:
            for k, n in limits.items():
                _check_int(f"limit of {k!r}", n)
        out = self._get_many(keys, dict(limits or {}))
        for k, n in (limits or {}).items():
            if k in out and len(out[k]) > n:
                raise ValueTooLargeError(f"{k!r} holds more than {n} bytes", size=None)
        return out

    def put_many(self, items: Mapping[str, bytes], *, mode: PutMode = "overwrite") -> None:
        """Store every ``key -> value``. With ``mode="create"`` a present key raises
        :class:`KeyExistsError` after every other key was written."""
        check_mode(mode)
        self._put_many({check_key(k): v for k, v in items.items()}, mode)

    def check_access(self) -> None:
        """Raise :class:`BucketNotFoundError` / :class:`AccessDeniedError` unless the store is usable
        (called once when opened from a URI); the default checks nothing."""

    def close(self) -> None:
        """Release connections; the default does nothing."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hooks for implementations (arguments already validated) -----------------------
    @abc.abstractmethod
    def _get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def _put(self, key: str, data: bytes, mode: PutMode) -> None: ...

    @abc.abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterator[str]: ...

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Default: a whole read, sliced (honest for backends without ranged reads)."""
        return self._get(key)[start:end]

    def _get_bounded(self, key: str, limit: int) -> bytes:
        """Default: a ranged read of ``limit + 1`` bytes where ranged reads exist, else stat first."""
        if self.capabilities.ranged_reads:
            return self._get_range(key, 0, limit + 1)
        size = self._stat(key).size
        if size > limit:
            raise ValueTooLargeError(f"{key!r} holds {size} bytes, more than {limit}", size=size)
        return self._get(key)

    def _stat(self, key: str) -> KeyInfo:
        raise NotImplementedError(f"{type(self).__name__} cannot stat keys")

    def _touch(self, key: str) -> None:
        """Default: rewrite the value (a download and an upload)."""
        self._put(key, self._get(key), "overwrite")

    def _delete_if_unmodified(self, key: str, seen: KeyInfo) -> bool:
        raise NotImplementedError(f"{type(self).__name__} has no conditional delete")

    def _get_many(self, keys: list[str], limits: dict[str, int]) -> dict[str, bytes]:
        """Default: one key after another."""
        return {k: (self.get_bounded(k, limits[k]) if k in limits else self._get(k)) for k in keys}

    def _put_many(self, items: dict[str, bytes], mode: PutMode) -> None:
        """Default: one key after another, every key tried before a conflict is raised."""
        conflicts = []
        for k, v in items.items():
            try:
                self._put(k, v, mode)
            except KeyExistsError:
                conflicts.append(k)
        if conflicts:
            raise KeyExistsError(f"{len(conflicts)} key(s) already exist: {sorted(conflicts)[:5]}")


class WrapperBackend(Backend):
    """A backend that adds behaviour around ``inner`` (the zarr ``WrapperStore`` pattern).

    Every hook forwards to ``inner``'s public method; a subclass overrides
    :meth:`_call` to run them under its policy (retries, injected faults) and
    reports ``inner``'s capabilities.
    """

    def __init__(self, inner: Backend):
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self.inner.capabilities

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def __getattr__(self, name: str):  # noqa: ANN204 - the wrapped backend's own attributes (uri, fs, root, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _call(self, op: str, key: str, fn):  # noqa: ANN001, ANN202 - fn: () -> T, returns T
        """Run ``fn()`` (one operation ``op`` on ``key``); the default just calls it."""
        return fn()

    def _get(self, key: str) -> bytes:
        return self._call("get", key, lambda: self.inner.get(key))

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self._call("get_range", key, lambda: self.inner.get_range(key, start, end))

    def _get_bounded(self, key: str, limit: int) -> bytes:
        return self._call("get", key, lambda: self.inner.get_bounded(key, limit))

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        self._call("put", key, lambda: self.inner.put(key, data, mode=mode))

    def _exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def _delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def _list(self, prefix: str) -> Iterator[str]:
        yield from self._call("list", prefix, lambda: list(self.inner.list(prefix)))

    def _stat(self, key: str) -> KeyInfo:
        return self._call("stat", key, lambda: self.inner.stat(key))

    def _touch(self, key: str) -> None:
        self._call("touch", key, lambda: self.inner.touch(key))

    def _delete_if_unmodified(self, key: str, seen: KeyInfo) -> bool:
        return self._call("delete", key, lambda: self.inner.delete_if_unmodified(key, seen))

    def _get_many(self, keys: list[str], limits: dict[str, int]) -> dict[str, bytes]:
        return self._call("get", keys[0] if len(keys) == 1 else f"{len(keys)} keys",
                          lambda: self.inner.get_many(keys, limits=limits))

    def _put_many(self, items: dict[str, bytes], mode: PutMode) -> None:
        self._call("put", f"{len(items)} keys", lambda: self.inner.put_many(items, mode=mode))

    def check_access(self) -> None:
        self._call("open", "", self.inner.check_access)

    def close(self) -> None:
        self.inner.close()
