"""Local-disk backend: bare paths and ``file://`` URIs.

Every write goes to a temporary file in the destination folder first and is
then published with ``os.link`` (create-only: fails if the name exists) or
``os.replace`` (overwrite). Both are atomic on POSIX file systems, so a reader
sees either the old value, nothing, or the complete new value.

Files are created with mode ``0666`` and folders ``0777`` less the process
umask (``0644`` / ``0755`` with the usual ``022``), so a reader running as
another user on a shared file system can read the store.

OS errors are translated in one place (:func:`_translate`): a missing file
is :class:`KeyNotFoundError`, ``EACCES``/``EPERM`` :class:`AccessDeniedError`,
``EROFS`` :class:`ReadOnlyStoreError`, ``ENOSPC``/``EDQUOT``
:class:`StoreFullError`, anything else :class:`BackendError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator

from ..errors import (AccessDeniedError, BackendError, KeyExistsError, KeyNotFoundError, ReadOnlyStoreError,
                      StoreFullError, ValueTooLargeError)
from .base import Backend, Capabilities, KeyInfo, PutMode
from .options import check_options

_TMP_PREFIX = ".tmp-"
_OPTIONS = ("fsync",)
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


@contextlib.contextmanager
def _translate(op: str, key: str, root: str) -> Iterator[None]:
    """Turn an OSError of ``op`` on ``key`` into the typed error of its kind."""
    try:
        yield
    except (KeyNotFoundError, KeyExistsError, ValueTooLargeError):
        raise
    except _MISSING:
        raise KeyNotFoundError(f"{key!r} not found in {root}") from None
    except PermissionError as e:
        raise AccessDeniedError(f"{op} {key!r} in {root}: permission denied ({e.strerror})") from e
    except OSError as e:
        if e.errno == errno.EROFS:
            raise ReadOnlyStoreError(f"{op} {key!r} in {root}: the file system is read-only") from e
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFullError(f"{op} {key!r} in {root}: no space left ({e.strerror})") from e
        raise BackendError(f"{op} {key!r} in {root} failed: {e}") from e


class LocalBackend(Backend):
    """Files under ``root``; ``fsync=True`` also flushes each file and its folder to disk."""

    capabilities = Capabilities(atomic_create=True, listing=True, ranged_reads=True, conditional_delete=True)

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False):
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = bool(fsync)

    def __repr__(self) -> str:
        return f"LocalBackend({self.root!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> LocalBackend:
        """A bare path or ``file://PATH``; ``options`` may hold ``fsync`` (:class:`UnknownOptionError` otherwise)."""
        check_options(options, _OPTIONS, f"the local store {uri}")
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        return cls(path, **options)  # type: ignore[arg-type]

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _get(self, key: str) -> bytes:
        with _translate("get", key, self.root), open(self._path(key), "rb") as f:
            return f.read()

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        with _translate("get", key, self.root), open(self._path(key), "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def _get_bounded(self, key: str, limit: int) -> bytes:
        with _translate("get", key, self.root), open(self._path(key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise ValueTooLargeError(f"{key!r} holds {size} bytes, more than {limit}", size=size)
            return f.read(limit + 1)

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        path = self._path(key)
        folder = os.path.dirname(path)
        with _translate("put", key, self.root):
            if mode == "create" and os.path.exists(path):
                raise KeyExistsError(f"{key!r} already exists in {self.root}")
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
            # os.open applies the umask (mkstemp would force 0600)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                if mode == "create":
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise KeyExistsError(f"{key!r} already exists in {self.root}") from None
                else:
                    os.replace(tmp, path)
                    tmp = ""
                if self.fsync:
                    _fsync_dir(folder)
            finally:
                if tmp:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)

    def _exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def _delete(self, key: str) -> None:
        with _translate("delete", key, self.root), contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def _stat(self, key: str) -> KeyInfo:
        with _translate("stat", key, self.root):
            st = os.stat(self._path(key))
        return KeyInfo(st.st_size, st.st_mtime)

    def _touch(self, key: str) -> None:
        with _translate("touch", key, self.root):
            os.utime(self._path(key))  # times=None: "now" by the file system (the server's, on NFS)

    def _delete_if_unmodified(self, key: str, seen: KeyInfo) -> bool:
        """Rename the file aside (atomic), then check it: a touch or put that came first shows in its
        mtime and the file is put back; one that comes later finds the name absent and writes anew."""
        path = self._path(key)
        aside = os.path.join(os.path.dirname(path), f"{_TMP_PREFIX}gc-{uuid.uuid4().hex}")
        with _translate("delete", key, self.root):
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return False
            st = os.stat(aside)
            if (st.st_size, st.st_mtime) != (seen.size, seen.mtime):
                with contextlib.suppress(FileExistsError):  # a new copy was written meanwhile: keep it
                    os.link(aside, path)
                os.unlink(aside)
                return False
            os.unlink(aside)
            return True

    def _list(self, prefix: str) -> Iterator[str]:
        # Walk only the deepest folder the prefix fully names.
        folder_key = prefix.rpartition("/")[0]
        start = os.path.join(self.root, *folder_key.split("/")) if folder_key else self.root
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(_TMP_PREFIX)]
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = base + name
                if key.startswith(prefix):
                    yield key


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
