"""Local-disk backend: bare paths and ``file://`` URIs.

Every write goes to a temporary file in the destination folder first and is
then published with ``os.link`` (create-only: fails if the name exists) or
``os.replace`` (overwrite). Both are atomic on POSIX file systems, so a reader
sees either the old value, nothing, or the complete new value.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

from ..errors import KeyExistsError, KeyNotFoundError
from .base import Backend, Capabilities, PutMode, check_key

_TMP_PREFIX = ".tmp-"


class LocalBackend(Backend):
    """Files under ``root``; ``fsync=True`` also flushes each file and its folder to disk."""

    capabilities = Capabilities(atomic_create=True, listing=True, ranged_reads=True)

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False):
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"LocalBackend({self.root!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: object) -> LocalBackend:
        """A bare path or ``file://PATH``; ``options`` may hold ``fsync``."""
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        return cls(path, **options)  # type: ignore[arg-type]

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise KeyNotFoundError(f"{key!r} not found in {self.root}") from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise KeyNotFoundError(f"{key!r} not found in {self.root}") from None

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
        path = self._path(key)
        folder = os.path.dirname(path)
        if mode == "create" and os.path.exists(path):
            raise KeyExistsError(f"{key!r} already exists in {self.root}")
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=folder)
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
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def list(self, prefix: str = "") -> Iterator[str]:
        # Walk only the deepest folder the prefix fully names.
        folder_key = prefix.rpartition("/")[0]
        start = os.path.join(self.root, *folder_key.split("/")) if folder_key else self.root
        if folder_key:
            check_key(folder_key)
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
