"""DeltaStore: content-addressed objects and write-once manifests over a backend.

Layout under the store root::

    deltastore.json                    store marker (format name and version)
    objects/sha256/ab/cdef...          immutable objects, named by the sha256 of their bytes
    versions/000000000120.json         the manifest of step 120, written once, after its objects
    refs/latest                        optional hint, never the source of truth

Commit order gives crash safety: objects first, manifest last with a
create-only write. A version exists exactly when its manifest does; an object
no manifest names is garbage, never half a version.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .backends import Backend, open_backend
from .errors import (CorruptObjectError, DeltaStoreError, KeyExistsError, KeyNotFoundError, ManifestError,
                     ObjectNotFoundError, VersionExistsError, VersionNotFoundError)
from .manifest import MAX_STEP, Manifest, VersionRef, sha256_digest

STORE_MARKER = "deltastore.json"
STORE_FORMAT = {"format": "deltastore", "format_version": "1.0"}
_VERSION_KEY = re.compile(r"^versions/(\d{12})\.json$")


def version_key(step: int) -> str:
    """Backend key of the manifest of ``step``."""
    return f"versions/{step:012d}.json"


def object_key(digest: str) -> str:
    """Backend key of the object with ``digest`` (``"sha256:<hex>"``)."""
    hexdigest = digest.split(":", 1)[1]
    return f"objects/sha256/{hexdigest[:2]}/{hexdigest[2:]}"


class DeltaStore:
    """Objects by digest and manifests by step, on any :class:`Backend`.

    Every object read is re-hashed and must match its digest
    (:class:`CorruptObjectError` otherwise); manifests are validated on parse
    and cached by step (they are immutable).
    """

    def __init__(self, backend: Backend, uri: str = ""):
        self.backend = backend
        self.uri = uri or repr(backend)
        self._manifests: dict[int, tuple[Manifest, str]] = {}
        self._verified: dict[str, bytes] = {}  # filled by prefetch, consumed by get_object
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeltaStore({self.uri!r})"

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> DeltaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- objects -----------------------------------------------------------------
    def put_object(self, data: bytes) -> str:
        """Store ``data`` (idempotent) and return its digest."""
        digest = sha256_digest(data)
        key = object_key(digest)
        if not self.backend.exists(key):
            try:
                self.backend.put(key, data, mode="create")
            except KeyExistsError:
                pass  # same digest, same bytes: another writer got there first
        return digest

    def get_object(self, digest: str, size: int | None = None) -> bytes:
        """The verified bytes of object ``digest``.

        Raises :class:`ObjectNotFoundError` when absent and
        :class:`CorruptObjectError` when the bytes (or their size) do not match.
        """
        with self._lock:
            cached = self._verified.pop(digest, None)
        if cached is not None and (size is None or len(cached) == size):
            return cached
        try:
            data = self.backend.get(object_key(digest))
        except KeyNotFoundError:
            raise ObjectNotFoundError(f"object {digest} is missing from {self.uri}") from None
        if size is not None and len(data) != size:
            raise CorruptObjectError(f"object {digest} has {len(data)} bytes, manifest says {size} (truncated?)",
                                     digest=digest)
        if sha256_digest(data) != digest:
            raise CorruptObjectError(f"object {digest} fails its sha256 check (corrupted in storage or transit)",
                                     digest=digest)
        return data

    def prefetch(self, wanted: list[tuple[str, int]], *, max_workers: int = 4) -> None:
        """Download and verify ``(digest, size)`` objects in parallel for the next :meth:`get_object` calls.

        Failures are not raised here: the later ``get_object`` of that object
        fetches it again and raises the typed error. Replaces any earlier
        prefetch that was not consumed.
        """
        with self._lock:
            self._verified.clear()
        if len(wanted) < 2:
            return
        get_many = getattr(self.backend, "get_many", None)
        if get_many is not None:  # the backend batches on its own client (one event loop, one xet batch)
            sizes = dict(wanted)
            try:
                got = get_many([object_key(d) for d in sizes])
            except (DeltaStoreError, OSError):
                return
            for d, size in sizes.items():
                data = got.get(object_key(d))
                if data is not None and len(data) == size and sha256_digest(data) == d:
                    with self._lock:
                        self._verified[d] = data
            return
        if max_workers < 2:
            return

        def fetch(item: tuple[str, int]) -> None:
            try:
                data = self.get_object(*item)
            except (DeltaStoreError, OSError):
                return
            with self._lock:
                self._verified[item[0]] = data

        with ThreadPoolExecutor(max_workers=min(max_workers, len(wanted))) as pool:
            list(pool.map(fetch, wanted))

    def has_object(self, digest: str) -> bool:
        return self.backend.exists(object_key(digest))

    def list_objects(self) -> list[str]:
        """Digests of every stored object."""
        out = []
        for key in self.backend.list("objects/sha256/"):
            parts = key.split("/")
            if len(parts) == 4:
                out.append(f"sha256:{parts[2]}{parts[3]}")
        return out

    # -- manifests ---------------------------------------------------------------
    def versions(self) -> list[int]:
        """Committed steps, ascending (by listing manifests)."""
        steps = []
        for key in self.backend.list("versions/"):
            m = _VERSION_KEY.match(key)
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> int | None:
        """The highest committed step, or None for an empty store."""
        steps = self.versions()
        return steps[-1] if steps else None

    def has_version(self, step: int) -> bool:
        return self.backend.exists(version_key(step))

    def manifest_with_digest(self, step: int) -> tuple[Manifest, str]:
        """The manifest of ``step`` and the sha256 digest of its bytes.

        Raises :class:`VersionNotFoundError`, :class:`ManifestError` or
        :class:`UnsupportedFormatError`.
        """
        cached = self._manifests.get(step)
        if cached is not None:
            return cached
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise VersionNotFoundError(f"no version {step!r}: steps are integers in [0, {MAX_STEP}]")
        try:
            data = self.backend.get(version_key(step))
        except KeyNotFoundError:
            raise VersionNotFoundError(f"no version {step} in {self.uri}") from None
        manifest = Manifest.from_json(data)
        if manifest.step != step:
            raise ManifestError(f"{version_key(step)} holds the manifest of step {manifest.step}")
        result = (manifest, sha256_digest(data))
        self._manifests[step] = result
        return result

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of ``step`` (see :meth:`manifest_with_digest`)."""
        return self.manifest_with_digest(step)[0]

    def ref(self, step: int) -> VersionRef:
        """``VersionRef`` of a committed step."""
        return VersionRef(step, self.manifest_with_digest(step)[1])

    def commit(self, manifest: Manifest) -> tuple[bytes, str]:
        """Write ``manifest`` create-only; returns its bytes and digest.

        Call only after every object it names is stored. Raises
        :class:`VersionExistsError` when the step is already committed (this
        is how a conflicting writer is detected).
        """
        data = manifest.to_json()
        try:
            self.backend.put(version_key(manifest.step), data, mode="create")
        except KeyExistsError:
            raise VersionExistsError(f"version {manifest.step} already exists in {self.uri}") from None
        digest = sha256_digest(data)
        self._manifests[manifest.step] = (manifest, digest)
        self._ensure_marker()
        try:
            self.backend.put("refs/latest", str(manifest.step).encode(), mode="overwrite")
        except OSError:
            pass  # only a hint
        return data, digest

    def forget_all(self) -> None:
        """Drop every cached manifest and prefetched object (after a GC race)."""
        self._manifests.clear()
        with self._lock:
            self._verified.clear()

    def forget(self, step: int) -> None:
        """Drop a cached manifest (after it was deleted by GC)."""
        self._manifests.pop(step, None)

    def _ensure_marker(self) -> None:
        if not self.backend.exists(STORE_MARKER):
            try:
                self.backend.put(STORE_MARKER, json.dumps(STORE_FORMAT).encode(), mode="create")
            except KeyExistsError:
                pass


def open_store(uri: Any, **storage_options: Any) -> DeltaStore:
    """Open the store at ``uri`` (a path, ``file://``, ``memory://``, or any registered scheme).

    ``storage_options`` go to the backend (credentials, endpoint, ...).
    Raises :class:`UnknownBackendError` or :class:`MissingDependencyError`
    for a scheme that cannot be served.
    """
    if isinstance(uri, DeltaStore):
        return uri
    backend = open_backend(uri, **storage_options)
    return DeltaStore(backend, uri if isinstance(uri, str) else repr(backend))

