"""DeltaStore: content-addressed objects and write-once manifests over a backend.

Layout under the store root::

    deltastore.json                    store marker (format name and version)
    objects/sha256/ab/cdef...          immutable objects, named by the sha256 of their bytes
    versions/000000000120.json         the manifest of step 120, written once, after its objects
    refs/latest                        optional hint, never the source of truth (signed, with the time
                                       it was issued, when the publisher signs: deltastore.signing)
    refs/index.json                    recent versions and anchors, for readers that cannot list (deltastore.index)

Commit order gives crash safety: objects first, manifest last with a
create-only write. A version exists exactly when its manifest does; an object
no manifest names is garbage, never half a version.

GC safety (docs/format.md, "Garbage collection and concurrent publishers"):
an object a publish reuses (found present) is *refreshed* (its modification
time made new) instead of skipped; right before the commit every object the
manifest names that was reused and last refreshed more than
:attr:`DeltaStore.refresh_window` seconds ago (or that this store never
wrote) is refreshed again, and on a
backend without an atomic conditional delete the store waits
:data:`DELETE_WINDOW` after its last refresh of a reused object and checks
that each is still there (except those the parent version names while its
manifest is stored as it was). GC (:meth:`DeltaStore.delete_object`) deletes an
object only when it is older than the GC's listing time minus its grace.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any

from .backends import Backend, open_backend
from .backends.base import KeyInfo
from .errors import (CorruptObjectError, DeltaStoreError, KeyExistsError, KeyNotFoundError, ManifestError,
                     ObjectNotFoundError, StoreIndexError, ValueTooLargeError, VersionExistsError,
                     VersionNotFoundError)
from .index import (INDEX_KEY, MAX_INDEX_BYTES, IndexEntry, StoreIndex, index_bytes, latest_step, merged, parse_index,
                    read_bounded)
from .manifest import MAX_MANIFEST_BYTES, MAX_STEP, Manifest, VersionRef, sha256_digest
from .manifest_cache import ManifestCache
from .signing import LATEST_KEY, MAX_LATEST_BYTES, SigningKey, Trust, latest_bytes, sign_document, sign_manifest

log = logging.getLogger("deltastore.store")

REFRESH_WINDOW = 10.0
"""Seconds: a commit re-refreshes every object it names that was last written or refreshed longer ago.
GC's grace must exceed it (plus the commit's own latency) for the GC-safety guarantee."""
DELETE_WINDOW = 5.0
"""Seconds: on backends without conditional delete, the bound on the time between GC's stat of an object
and its delete landing; a publish that reused objects checks them this long after its last refresh."""
STAT_TO_DELETE = 1.0
"""Seconds GC may take between its stat of an object and sending the delete (else it stats again)."""
CLOCK_KEY = "gc/clock"
STORE_MARKER = "deltastore.json"
STORE_FORMAT = {"format": "deltastore", "format_version": "1.1"}
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
    and cached by step (they are immutable), the cache bounded
    (:attr:`manifest_cache`, :mod:`deltastore.manifest_cache`).
    """

    def __init__(self, backend: Backend, uri: str = "", *, refresh_window: float | None = None,
                 delete_window: float = DELETE_WINDOW):
        self.backend = backend
        self.uri = uri or repr(backend)
        #: seconds (default :data:`REFRESH_WINDOW`); a GC grace on this store must exceed it (:attr:`min_gc_grace`)
        self.refresh_window = REFRESH_WINDOW if refresh_window is None else refresh_window
        self.delete_window = delete_window
        #: parsed manifests and their digests by step (bounds adjustable: ``max_entries``, ``max_bytes``)
        self.manifest_cache: ManifestCache[tuple[Manifest, str]] = ManifestCache()
        self._verified: dict[str, bytes] = {}  # filled by prefetch, consumed by get_object
        self._pending: dict[str, Future[bytes]] = {}  # background prefetches, consumed by get_object
        self._fetchers: ThreadPoolExecutor | None = None
        self._fetchers_pid = 0
        self._lock = threading.Lock()
        # GC safety: monotonic time before this store last wrote/refreshed each object, and which
        # objects since the last commit were reused (found present, refreshed) rather than uploaded
        self._written: dict[str, float] = {}
        self._reused: dict[str, float] = {}
        #: signs every committed manifest and ``refs/latest`` (a Publisher's ``signing_key``); kept in memory only
        self.signer: SigningKey | None = None
        #: the keys every manifest read must be signed by (a Subscriber's ``trusted_keys``); checked on the bytes,
        #: before the manifest is parsed or any object fetched
        self.trust: Trust | None = None
        self._index: tuple[bytes, StoreIndex] | None = None  # the last index read (its bytes and parse)

    def __repr__(self) -> str:
        return f"DeltaStore({self.uri!r})"

    @property
    def min_gc_grace(self) -> float:
        """Seconds a GC grace on this store must exceed for the GC-safety guarantee: the refresh window of
        publishers using it plus the backend's timestamp resolution (10 s on local disk, 11 s on S3 by
        default). Where both are 0 (a store built with ``refresh_window=0`` on a backend with exact times,
        whose publishers refresh every reused object right before each commit: tests), a grace of 0 is
        accepted."""
        return self.refresh_window + self.backend.capabilities.mtime_resolution

    def close(self) -> None:
        self.forget_prefetched()
        if self._fetchers is not None and self._fetchers_pid == os.getpid():
            self._fetchers.shutdown(wait=True, cancel_futures=True)
            self._fetchers = None
        self.backend.close()

    def __enter__(self) -> DeltaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- objects -----------------------------------------------------------------
    def put_object(self, data: bytes) -> str:
        """Store ``data`` (idempotent) and return its digest.

        An object already present is refreshed (its modification time made
        new, so a concurrent GC spares it; see the module docstring); one that
        vanishes meanwhile is written again.
        """
        digest = sha256_digest(data)
        key = object_key(digest)
        started = time.monotonic()
        reused = False
        if self.backend.exists(key):
            try:
                self.backend.touch(key)
                reused = True
            except KeyNotFoundError:
                pass  # deleted (by GC) since the check: upload it
        if not reused:
            try:
                self.backend.put(key, data, mode="create")
            except KeyExistsError:
                self.backend.touch(key)  # another writer's copy (same bytes): make it ours
                reused = True
        with self._lock:
            self._written[digest] = started
            if reused:
                self._reused[digest] = started
        return digest

    def _prepare_commit(self, manifest: Manifest) -> None:
        """The GC-safety steps before a commit (module docstring); raises :class:`ObjectNotFoundError`
        when a concurrent GC deleted an object this version needs (nothing is committed; publish again)."""
        digests = list(manifest.references())
        now = time.monotonic()
        with self._lock:  # reused objects refreshed too long ago, and any this store never wrote
            stale = [d for d in dict.fromkeys(digests) if d not in self._written
                     or (d in self._reused and now - self._written[d] > self.refresh_window)]
        for d in stale:
            try:
                self.backend.touch(object_key(d))
            except KeyNotFoundError:
                raise ObjectNotFoundError(
                    f"object {d} was deleted (by a concurrent GC) before version {manifest.step} was committed; "
                    f"nothing was committed, publish the step again") from None
            with self._lock:
                self._written[d] = now
                self._reused[d] = now
        named = set(digests)
        with self._lock:
            reused = {d: t for d, t in self._reused.items() if d in named}
        if reused and not self.backend.capabilities.conditional_delete:
            # the objects the parent names, its manifest stored as it was, are safe from every GC (P3)
            parents = self._named_by_stored_parent(manifest)
            reused = {d: t for d, t in reused.items() if d not in parents}
            if not reused:
                return
            # a GC that stat'ed one of them before our refresh may still delete it: let such deletes land
            wait = max(reused.values()) + self.delete_window - time.monotonic()
            if wait > 0:
                log.debug("commit of step %d waits %.2f s for concurrent GC deletes to land", manifest.step, wait)
                time.sleep(wait)
            for d in reused:
                if not self.backend.exists(object_key(d)):
                    raise ObjectNotFoundError(
                        f"object {d} was deleted by a concurrent GC before version {manifest.step} was "
                        "committed; nothing was committed, publish the step again")

    def _named_by_stored_parent(self, manifest: Manifest) -> frozenset[str]:
        """What ``manifest``'s parent version names (:meth:`Manifest.references`), when its manifest, read
        from the backend now (after the commit's refreshes), has the digest ``manifest.parent`` gives; else
        nothing (no parent, or it is gone, changed or unreadable).

        Such a manifest was stored from the parent's commit until now, so a GC that listed the manifests
        meanwhile found these objects named, one that listed before was covered by the parent's own
        commit, and one that lists later finds them refreshed (docs/format.md, P3)."""
        parent = manifest.parent
        if parent is None:
            return frozenset()
        try:
            data = self.backend.get_bounded(version_key(parent.step), MAX_MANIFEST_BYTES)
            if sha256_digest(data) != parent.digest:
                return frozenset()
            known = self.manifest_cache.get(parent.step)
            held = known[0] if known is not None and known[1] == parent.digest else self.parse_manifest(data)
        except DeltaStoreError:
            return frozenset()
        return frozenset(held.references())

    def get_object(self, digest: str, size: int | None = None) -> bytes:
        """The verified bytes of object ``digest``.

        With ``size`` (the manifest's) at most ``size + 1`` bytes are ever read.
        Raises :class:`ObjectNotFoundError` when absent and
        :class:`CorruptObjectError` when the bytes (or their size) do not match.
        """
        with self._lock:
            cached = self._verified.pop(digest, None)
            pending = self._pending.pop(digest, None)
        if cached is None and pending is not None:
            try:
                cached = pending.result()
            except (DeltaStoreError, OSError):
                cached = None  # read again below, which raises the typed error
        if cached is not None and (size is None or len(cached) == size):
            return cached
        return self._read_object(digest, size)

    def _read_object(self, digest: str, size: int | None) -> bytes:
        """:meth:`get_object` without the prefetched copies: read from the backend and verify."""
        key = object_key(digest)
        try:
            data = self.backend.get(key) if size is None else self.backend.get_bounded(key, size)
        except KeyNotFoundError:
            raise ObjectNotFoundError(f"object {digest} is missing from {self.uri}") from None
        except ValueTooLargeError as e:
            stored = f"{e.size} bytes" if e.size is not None else "more bytes"
            raise CorruptObjectError(f"object {digest} holds {stored}, manifest says {size} (not read whole)",
                                     digest=digest) from None
        if size is not None and len(data) != size:
            raise CorruptObjectError(f"object {digest} has {len(data)} bytes, manifest says {size} (truncated?)",
                                     digest=digest)
        if sha256_digest(data) != digest:
            raise CorruptObjectError(f"object {digest} fails its sha256 check (corrupted in storage or transit)",
                                     digest=digest)
        return data

    def prefetch(self, wanted: list[tuple[str, int]], *, max_workers: int = 4, wait: bool = True) -> None:
        """Download and verify ``(digest, size)`` objects in parallel for the next :meth:`get_object` calls.

        Failures are not raised here: the later ``get_object`` of that object
        fetches it again and raises the typed error. Replaces any earlier
        prefetch that was not consumed, except the objects both ask for (those
        are not fetched again). The reads run on the store's fetch
        threads; with ``wait=False`` this returns at once (a single object is
        fetched too) and a ``get_object`` of one of them waits for it. Either
        way the prefetched bytes are held until consumed or dropped
        (:meth:`forget_prefetched`).
        """
        keep = {d for d, _ in wanted}
        with self._lock:
            dropped = [f for d, f in self._pending.items() if d not in keep]
            self._pending = {d: f for d, f in self._pending.items() if d in keep}
            self._verified = {d: b for d, b in self._verified.items() if d in keep}
            wanted = [(d, n) for d, n in wanted if d not in self._pending and d not in self._verified]
        for fut in dropped:
            fut.cancel()
        if self.backend.capabilities.batch_transfers:  # one event loop, one xet batch
            if len(wanted) < 2:
                return
            sizes = dict(wanted)
            keys = {object_key(d): d for d in sizes}
            try:
                got = self.backend.get_many(list(keys), limits={k: sizes[d] for k, d in keys.items()})
            except (DeltaStoreError, OSError):
                return
            for d, size in sizes.items():
                data = got.get(object_key(d))
                if data is not None and len(data) == size and sha256_digest(data) == d:
                    with self._lock:
                        self._verified[d] = data
            return
        if not wanted or (wait and (len(wanted) < 2 or max_workers < 2)):
            return  # nothing to overlap: get_object reads it where it is used
        # reads and sha256 checks on the store's fetch threads (both release the GIL)
        with self._lock:
            if self._fetchers is None or self._fetchers_pid != os.getpid():  # a forked child has no threads
                self._fetchers = ThreadPoolExecutor(max(2, max_workers), thread_name_prefix="deltastore-fetch")
                self._fetchers_pid = os.getpid()
            futures = [self._fetchers.submit(self._read_object, d, size) for d, size in wanted]
            self._pending.update((d, f) for (d, _), f in zip(wanted, futures))
        if wait:
            wait_all(futures)

    def has_object(self, digest: str) -> bool:
        return self.backend.exists(object_key(digest))

    def delete_object(self, digest: str, *, older_than: float | None = None) -> bool:
        """Delete object ``digest``; True when this call deleted it.

        With ``older_than`` (a time by the store's clock, see :meth:`clock`)
        only an object last modified before it (less the backend's mtime
        resolution) is deleted, atomically against a concurrent refresh where
        the backend has a conditional delete, else with the delete sent within
        :data:`STAT_TO_DELETE` of the stat (the GC protocol of docs/format.md).
        """
        key = object_key(digest)
        if older_than is None:
            self.backend.delete(key)
            return True
        limit = older_than - self.backend.capabilities.mtime_resolution
        for _ in range(3):
            try:
                seen: KeyInfo = self.backend.stat(key)
            except KeyNotFoundError:
                return False
            stat_at = time.monotonic()
            if seen.mtime >= limit:
                return False  # written or refreshed recently: a publish may be about to name it
            if self.backend.capabilities.conditional_delete:
                return self.backend.delete_if_unmodified(key, seen)
            if time.monotonic() - stat_at <= STAT_TO_DELETE:
                self.backend.delete(key)
                return True
        return False  # this machine is too slow between a stat and a delete to delete safely

    def delete_version(self, step: int) -> None:
        """Delete the manifest of ``step`` (its objects stay; GC deletes those separately)."""
        self.backend.delete(version_key(step))
        self.forget(step)

    def clock(self) -> float:
        """The store's current time (seconds since the epoch, by the store's own clock): the
        modification time of a probe key written now. GC compares object times with it, so clock
        skew between the GC's machine, the publishers' machines and the store does not matter."""
        self.backend.put(CLOCK_KEY, b"", mode="overwrite")
        return self.backend.stat(CLOCK_KEY).mtime

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
        """Committed steps, ascending: by listing manifests, or on a backend that cannot list (plain HTTP) the
        steps ``refs/index.json`` names (:meth:`read_index`; without an index, the step ``refs/latest`` names)."""
        if not self.backend.capabilities.listing:
            return self._unlisted_versions()
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
        cached = self.manifest_cache.get(step)
        if cached is not None:
            return cached
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise VersionNotFoundError(f"no version {step!r}: steps are integers in [0, {MAX_STEP}]")
        try:
            data = self.backend.get_bounded(version_key(step), MAX_MANIFEST_BYTES)
        except KeyNotFoundError:
            raise VersionNotFoundError(f"no version {step} in {self.uri}") from None
        except ValueTooLargeError as e:
            stored = f"{e.size} bytes" if e.size is not None else "larger"
            raise ManifestError(f"{version_key(step)} is {stored}, over the {MAX_MANIFEST_BYTES} byte manifest "
                                "limit (not read)") from None
        digest = sha256_digest(data)
        self._check_indexed(step, digest)
        manifest = self.parse_manifest(data)
        if manifest.step != step:
            raise ManifestError(f"{version_key(step)} holds the manifest of step {manifest.step}")
        result = (manifest, digest)
        self.manifest_cache.put(step, result, len(data))
        return result

    def parse_manifest(self, data: bytes) -> Manifest:
        """:meth:`Manifest.from_json` of manifest bytes, reading the layout object a 1.3 manifest names from
        this store (verified against its digest) unless this process has parsed it already.

        Raises :class:`ManifestError`, :class:`UnsupportedFormatError`, and for
        the layout object :class:`ObjectNotFoundError` or :class:`CorruptObjectError`.
        """
        return Manifest.from_json(data, layouts=self._read_object,
                                  check=self.trust.check_manifest if self.trust is not None else None)

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of ``step`` (see :meth:`manifest_with_digest`)."""
        return self.manifest_with_digest(step)[0]

    def ref(self, step: int) -> VersionRef:
        """``VersionRef`` of a committed step."""
        return VersionRef(step, self.manifest_with_digest(step)[1])

    def commit(self, manifest: Manifest) -> tuple[bytes, str]:
        """Write ``manifest`` create-only; returns its bytes and digest.

        Call only after every object it names is stored (by :meth:`put_object`);
        the layout object of a 1.3 manifest is stored here, unless this store
        wrote it for the commit before.
        Raises :class:`VersionExistsError` when the step is already committed
        (this is how a conflicting writer is detected) and
        :class:`ObjectNotFoundError` when a concurrent GC deleted an object it
        names (nothing committed). On a backend without atomic create-only
        writes the manifest's ``producer`` records ``"commit": "check-then-write"``.
        """
        self._put_layout(manifest)
        self._prepare_commit(manifest)
        if not self.backend.capabilities.atomic_create:
            manifest = dataclasses.replace(manifest, producer={**manifest.producer, "commit": "check-then-write"})
        if self.signer is not None:
            manifest, data = sign_manifest(manifest, self.signer)
        else:
            data = manifest.to_json()
        try:
            self.backend.put(version_key(manifest.step), data, mode="create")
        except KeyExistsError:
            raise VersionExistsError(f"version {manifest.step} already exists in {self.uri}") from None
        digest = sha256_digest(data)
        self.manifest_cache.put(manifest.step, (manifest, digest), len(data))
        keep = manifest.references()
        with self._lock:  # the ledger holds what the next commit may name again
            self._written = {d: t for d, t in self._written.items() if d in keep}
            self._reused.clear()
        self._ensure_marker()
        try:
            self.write_latest(manifest.step, digest)
        except OSError:
            pass  # only a hint (a signing follower takes a newer signed manifest over it)
        return data, digest

    def write_latest(self, step: int, digest: str) -> None:
        """Write ``refs/latest``: the step as ASCII digits, or with a :attr:`signer` the signed latest document
        (step, manifest digest, the time now; :mod:`deltastore.signing`)."""
        if self.signer is None:
            self.backend.put(LATEST_KEY, str(step).encode(), mode="overwrite")
        else:
            self.backend.put(LATEST_KEY, latest_bytes(step, digest, self.signer), mode="overwrite")

    def read_latest(self) -> bytes | None:
        """The bytes of ``refs/latest`` (at most :data:`~deltastore.signing.MAX_LATEST_BYTES`), None when absent."""
        try:
            return self.backend.get_bounded(LATEST_KEY, MAX_LATEST_BYTES)
        except KeyNotFoundError:
            return None
        except ValueTooLargeError:
            raise ManifestError(f"{LATEST_KEY} is over {MAX_LATEST_BYTES} bytes (not read)") from None

    # -- the store index (refs/index.json; deltastore.index) ------------------------------------------
    def read_index(self) -> StoreIndex | None:
        """The parsed ``refs/index.json`` (None when the store has none); see :meth:`read_index_bytes`."""
        got = self.read_index_bytes()
        return None if got is None else got[1]

    def read_index_bytes(self) -> tuple[bytes, StoreIndex] | None:
        """The bytes of ``refs/index.json`` and their parse (None when the store has none). With :attr:`trust`, a
        signed index must verify (:class:`SignatureError`, :class:`UntrustedKeyError`); an unsigned one is read,
        since it only lists versions: each manifest and the signed latest are checked on their own.

        Raises :class:`StoreIndexError` (malformed, over its bound) and :class:`UnsupportedFormatError`.
        """
        data = read_bounded(self.backend, INDEX_KEY, MAX_INDEX_BYTES)
        if data is None:
            return None
        held = self._index
        if held is not None and held[0] == data:
            return held
        self._index = held = (data, parse_index(data, self._check_index if self.trust is not None else None))
        return held

    def update_index(self, add: list[IndexEntry] | tuple[IndexEntry, ...] = (), drop: list[int] | tuple[int, ...] = ()) \
            -> None:
        """Rewrite ``refs/index.json`` with the entries ``add`` put in and the steps ``drop`` taken out, bounded
        to the recent window and the last anchors (:func:`deltastore.index.merged`), signed by :attr:`signer`
        when set. A malformed stored index is replaced; with nothing to add and no index stored, nothing is
        written. Raises what the backend raises."""
        try:
            previous = self.read_index()
        except StoreIndexError:
            previous = None
        if previous is None and not add:
            return
        signer = self.signer
        sign = (lambda doc: sign_document(doc, signer)) if signer is not None else None
        self.backend.put(INDEX_KEY, index_bytes(merged(previous, add, drop), sign=sign), mode="overwrite")

    def _check_index(self, data: bytes, doc: Any) -> None:
        if self.trust is not None and isinstance(doc, dict) and doc.get("signature") is not None:
            self.trust.check(data, doc, INDEX_KEY)

    def _unlisted_versions(self) -> list[int]:
        """The steps of the index, or for a store written before it the step ``refs/latest`` names."""
        index = self.read_index()
        if index is not None:
            return index.steps
        data = self.read_latest()
        step = latest_step(data) if data is not None else None
        return [] if step is None else [step]

    def _check_indexed(self, step: int, digest: str) -> None:
        """On a backend that cannot list, a manifest's bytes must have the ``digest`` the index read last gives."""
        held = self._index
        if held is None or self.backend.capabilities.listing:
            return
        entry = held[1].entry(step)
        if entry is not None and entry.digest != digest:
            raise StoreIndexError(f"{version_key(step)} in {self.uri} has digest {digest}, "
                                  f"{INDEX_KEY} names {entry.digest}: refused (a stale or tampered index or "
                                  "manifest)")

    def _put_layout(self, manifest: Manifest) -> None:
        """Store the layout object ``manifest`` names, unless the last commit named it too (kept in the ledger,
        and refreshed by :meth:`_prepare_commit` like any object)."""
        ref = manifest.layout_ref
        if ref is None:
            return
        with self._lock:
            if ref.digest in self._written:
                return
        if self.put_object(manifest.layout_bytes) != ref.digest:
            raise ManifestError(f"version {manifest.step} names layout object {ref.digest}, which is not the "
                                "layout of its tensors (nothing was committed)")

    def forget_all(self) -> None:
        """Drop every cached manifest and prefetched object (after a GC race)."""
        self.manifest_cache.clear()
        self.forget_prefetched()

    def forget_prefetched(self) -> None:
        """Drop the prefetched objects not consumed yet (downloads still running finish, unused)."""
        with self._lock:
            self._verified.clear()
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.cancel()

    def forget(self, step: int) -> None:
        """Drop a cached manifest (after it was deleted by GC)."""
        self.manifest_cache.pop(step)

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

