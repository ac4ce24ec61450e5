"""A verified, version-aware copy of a store: ``deltastore mirror SRC DST [--follow]``, :func:`mirror_store`.

Like ``rclone sync`` for one store, but it never exposes half a version: versions are copied in commit
order, each one's objects first (every one re-hashed against its digest and size), its manifest after
(byte for byte, so its digest, its parent chain and any signature stay valid), and ``refs/latest`` and
``refs/index.json`` last, naming only versions the destination holds whole. So the destination is a
valid store a follower can use at every moment, a killed mirror resumes where it stopped (what is there
is skipped, what is half there is an unnamed object, never a version), and running it again copies
nothing. It makes a region-local relay: S3 in one region, a mirror on local disk in another, served by
nginx over HTTP to the servers there (docs/backends.md, "Serving a store over HTTP").

What is verified before anything of a version is written: its manifest's bytes against the digest the
source's index gives or its child's ``parent`` record gives (a hash chain down from the index), with
``trusted_keys`` its signature (and the signed ``refs/latest``'s, before it is copied), and whatever
``verify_manifest(data, step)`` checks; then every object against its digest. Signatures travel with
the bytes, so a follower of the copy with the same keys checks the trainer's signatures, never the
relay's. The copy's ``refs/latest`` never moves backward.

Versions the source reaches only through its index (a plain HTTP source keeps the recent window and the
last anchors there) are completed by walking parents: every version copied keeps its chain down to an
anchor, so a joiner on the destination can plan from there.
"""

from __future__ import annotations

import heapq
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import (BackendUnavailableError, KeyExistsError, ManifestError, MirrorConflictError,
                     StoreIndexError, VersionNotFoundError)
from .index import INDEX_KEY, IndexEntry, StoreIndex, latest_step, read_bounded
from .manifest import MAX_MANIFEST_BYTES, sha256_digest
from .signing import LATEST_KEY, as_trust
from .store import STORE_FORMAT, STORE_MARKER, DeltaStore, object_key, open_store, version_key

log = logging.getLogger("deltastore.mirror")

ManifestVerifier = Callable[[bytes, int], object]
"""``verify_manifest(data, step)``: raises (a typed error) unless the manifest bytes of ``step`` are trusted."""
LatestVerifier = Callable[[bytes], object]
"""``verify_latest(data)``: raises unless the bytes of ``refs/latest`` are trusted."""


@dataclass
class MirrorReport:
    """What :func:`mirror_store` did (summed over the rounds of ``follow``).

    copied: steps copied, in order; present: steps the destination already held with the same bytes;
    objects / object_bytes: objects (and their bytes) copied; reused: objects found in the destination;
    gone: steps the source named but deleted (GC) before they were copied; rounds: passes made.
    """

    copied: list[int] = field(default_factory=list)
    present: list[int] = field(default_factory=list)
    objects: int = 0
    object_bytes: int = 0
    reused: int = 0
    gone: list[int] = field(default_factory=list)
    rounds: int = 0


@dataclass(frozen=True)
class _Planned:
    step: int
    digest: str
    size: int
    kind: str
    parent: int | None


class _Mirror:
    def __init__(self, src: DeltaStore, dst: DeltaStore, verify_manifest: ManifestVerifier | None,
                 verify_latest: LatestVerifier | None, max_workers: int,
                 on_version: Callable[[int, int, int], None] | None):
        if not dst.backend.capabilities.listing:
            raise ValueError(f"the mirror's destination {dst.uri} must be a writable store (a folder or a bucket)")
        self.src, self.dst = src, dst
        self.verify_manifest = verify_manifest
        self.verify_latest = verify_latest
        self.max_workers = max(1, max_workers)
        self.on_version = on_version
        self.report = MirrorReport()
        self.held: dict[int, str] = {}  # destination step -> manifest digest (checked this process)

    # -- one pass ------------------------------------------------------------------------------
    def round(self) -> None:
        self.report.rounds += 1
        latest_data = self.src.read_latest()
        try:
            index_data, index = self.src.read_index_bytes() or (None, None)
        except StoreIndexError:
            if not self.src.backend.capabilities.listing:
                raise
            log.warning("mirror: %s has a malformed %s; the listing decides, the copy gets its own index",
                        self.src.uri, INDEX_KEY)
            index_data = index = None
        listed = self.src.versions()  # the listing, or without one the index (or the step refs/latest names)
        expected = {e.step: e.digest for e in index.entries} if index is not None else {}
        dst_steps = set(self.dst.versions())
        plan = self._plan(listed, expected, dst_steps)
        for item in plan:
            self._copy(item)
        self._write_refs(latest_data, index_data, index, plan)

    def _held_digest(self, step: int, dst_steps: set[int]) -> str | None:
        """The digest of the destination's manifest of ``step`` (None when it has none)."""
        if step in self.held:
            return self.held[step]
        if step not in dst_steps:
            return None
        data = self.dst.backend.get_bounded(version_key(step), MAX_MANIFEST_BYTES)
        self.held[step] = digest = sha256_digest(data)
        return digest

    def _plan(self, listed: list[int], expected: dict[int, str], dst_steps: set[int]) -> list[_Planned]:
        """The versions to copy, ascending: those the source names that the destination lacks, and the
        chains (parents, a differential's anchor) they need that it lacks; every manifest read is checked
        against the digest its index entry or its child gives, and by ``verify_manifest``."""
        todo = [-s for s in set(listed)]  # newest first: a child names its parent's digest before it is read
        heapq.heapify(todo)
        seen: set[int] = set()
        planned: dict[int, _Planned] = {}
        while todo:
            step = -heapq.heappop(todo)
            if step in seen:
                continue
            seen.add(step)
            held = self._held_digest(step, dst_steps)
            want = expected.get(step)
            if held is not None:
                if want is not None and held != want:
                    raise MirrorConflictError(f"{self.dst.uri} holds version {step} with manifest {held}, the "
                                              f"source's is {want}: not a mirror of {self.src.uri}")
                if step not in self.report.present:
                    self.report.present.append(step)
                continue
            data = self._read_manifest(step, want)
            if data is None:
                continue
            doc = json.loads(data)
            kind, parent, differential = doc.get("kind"), doc.get("parent"), doc.get("differential")
            planned[step] = _Planned(step, sha256_digest(data), len(data), kind,
                                     parent["step"] if isinstance(parent, dict) else None)
            for ref in ((parent if kind != "anchor" else None), differential):
                if isinstance(ref, dict) and isinstance(ref.get("step"), int) and ref["step"] not in seen:
                    expected.setdefault(ref["step"], ref.get("digest"))
                    heapq.heappush(todo, -ref["step"])
        return [planned[s] for s in sorted(planned)]

    def _read_manifest(self, step: int, want: str | None, verify: bool = True) -> bytes | None:
        """The source's manifest bytes of ``step``, checked against ``want`` (and with ``verify`` by
        ``verify_manifest``); None when the source no longer has it."""
        try:
            data = self.src.backend.get_bounded(version_key(step), MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            if step not in self.report.gone:
                self.report.gone.append(step)
            log.warning("mirror: version %d is gone from %s (deleted by its GC): not copied", step, self.src.uri)
            return None
        digest = sha256_digest(data)
        if want is not None and digest != want:
            raise StoreIndexError(f"version {step} in {self.src.uri} has manifest {digest}, the source names "
                                  f"{want} for it (its index, or its child's parent record): refused, nothing of "
                                  "it copied")
        if verify and self.src.trust is not None:  # the signature, before anything of the version is copied
            self.src.trust.check_manifest(data, json.loads(data))
        if verify and self.verify_manifest is not None:
            self.verify_manifest(data, step)
        return data

    def _copy(self, item: _Planned) -> None:
        """Objects (verified), then the manifest's bytes, create-only."""
        data = self._read_manifest(item.step, item.digest, verify=False)  # the planned bytes, checked then
        if data is None:
            return
        manifest = self.src.parse_manifest(data)  # validated; its layout object read and verified
        if manifest.step != item.step:
            raise ManifestError(f"{version_key(item.step)} in {self.src.uri} holds step {manifest.step}")
        refs = manifest.references()
        missing = [(d, n) for d, n in refs.items() if not self.dst.has_object(d)]
        self.report.reused += len(refs) - len(missing)

        def copy(ref: tuple[str, int]) -> int:
            digest, size = ref
            body = self.src.get_object(digest, size)  # size-bounded read, sha256 checked
            self.dst.put_object(body)
            return len(body)

        if missing:
            with ThreadPoolExecutor(min(self.max_workers, len(missing)), thread_name_prefix="deltastore-mirror") as pool:
                sizes = list(pool.map(copy, missing))
            self.report.objects += len(sizes)
            self.report.object_bytes += sum(sizes)
        self.dst._prepare_commit(manifest)  # the GC-safety refreshes of a commit (docs/format.md)
        try:
            self.dst.backend.put(version_key(item.step), data, mode="create")
        except KeyExistsError:
            theirs = sha256_digest(self.dst.backend.get_bounded(version_key(item.step), MAX_MANIFEST_BYTES))
            if theirs != item.digest:
                raise MirrorConflictError(f"version {item.step} appeared in {self.dst.uri} with manifest {theirs} "
                                          f"while this mirror copied {item.digest}") from None
        self.held[item.step] = item.digest
        self.report.copied.append(item.step)
        if self.on_version is not None:
            self.on_version(item.step, len(missing), sum(n for _, n in missing))
        log.info("mirror: version %d (%s) copied, %d objects new", item.step, item.kind, len(missing))

    def _write_refs(self, latest_data: bytes | None, index_data: bytes | None, index: StoreIndex | None,
                    plan: list[_Planned]) -> None:
        """The marker, then ``refs/latest`` and the index: the source's bytes when the destination holds
        every version they name, else (no such source bytes) ones made from what it holds."""
        if not self.dst.backend.exists(STORE_MARKER):
            marker = read_bounded(self.src.backend, STORE_MARKER, 1 << 16)
            try:
                self.dst.backend.put(STORE_MARKER, marker or json.dumps(STORE_FORMAT).encode(), mode="create")
            except KeyExistsError:
                pass
        holds = set(self.held)
        if index_data is not None and index is not None and all(
                self.held.get(e.step) == e.digest for e in index.entries):
            self._put_if_changed(INDEX_KEY, index_data)
        elif plan:
            self.dst.update_index(add=[IndexEntry(p.step, p.kind, p.digest, p.size, p.parent) for p in plan])
        step = latest_step(latest_data) if latest_data is not None else None
        held = self.dst.read_latest()
        if held is not None and step is not None and (latest_step(held) or -1) > step:
            log.warning("mirror: %s names version %d, older than %s's latest %s: the copy's latest is kept (never "
                        "moved backward)", self.src.uri, step, self.dst.uri, latest_step(held))
        elif step is not None and step in holds:
            if self.src.trust is not None:
                self.src.trust.check_latest(latest_data)
            if self.verify_latest is not None:
                self.verify_latest(latest_data)
            self._put_if_changed(LATEST_KEY, latest_data)
        elif latest_data is None and plan:
            self._put_if_changed(LATEST_KEY, str(max(holds)).encode())

    def _put_if_changed(self, key: str, data: bytes) -> None:
        try:
            if self.dst.backend.get_bounded(key, len(data)) == data:
                return
        except (FileNotFoundError, ValueError):
            pass
        self.dst.backend.put(key, data, mode="overwrite")


def mirror_store(src: Any, dst: Any, *, follow: bool = False, poll_interval: float = 1.0, trusted_keys: Any = None,
                 verify_manifest: ManifestVerifier | None = None, verify_latest: LatestVerifier | None = None,
                 max_workers: int = 8, src_options: dict[str, Any] | None = None,
                 dst_options: dict[str, Any] | None = None, stop: threading.Event | None = None,
                 on_version: Callable[[int, int, int], None] | None = None) -> MirrorReport:
    """Copy every version of the store ``src`` into ``dst`` (URIs or open stores), verified, in commit order.

    ``src`` may be any store, a plain ``https://`` one included; ``dst`` must be writable (a folder or a
    bucket). With ``follow`` the copy repeats every ``poll_interval`` seconds until ``stop`` is set (or
    Ctrl-C), and a source that cannot be reached for a while is retried at the next round.
    ``trusted_keys`` (as :class:`~deltastore.Subscriber` takes them): every manifest must be signed by one of
    them before anything of its version is copied, and so must the ``refs/latest`` copied (and a signed index);
    the signatures are copied with the bytes, so followers of ``dst`` check the same ones.
    ``verify_manifest`` / ``verify_latest``: further checks run on the raw bytes before a version (or the
    latest ref) is copied. ``on_version(step, objects, nbytes)`` is called after each
    version copied. Returns a :class:`MirrorReport`.

    Raises :class:`StoreIndexError` (a manifest whose bytes are not those its index or child names),
    :class:`CorruptObjectError` (an object that fails its digest), :class:`MirrorConflictError` (the
    destination holds another version under a step), with ``trusted_keys`` the subclasses of
    :class:`UntrustedVersionError` (unsigned, unknown key, bad signature), what the verifiers raise, and the
    backends' errors;
    in each case the destination keeps every version it holds, whole.
    """
    if not isinstance(poll_interval, (int, float)) or poll_interval < 0:
        raise ValueError(f"poll_interval must be a non-negative number of seconds, got {poll_interval!r}")
    trust = as_trust(trusted_keys)  # keys checked before any store is opened
    source = open_store(src, **(src_options or {}))
    target = open_store(dst, **(dst_options or {}))
    try:
        if trust is not None:
            source.trust = trust
        m = _Mirror(source, target, verify_manifest, verify_latest, max_workers, on_version)
        m.round()
        while follow and not (stop is not None and stop.is_set()):
            if stop is not None:
                stop.wait(poll_interval)
                if stop.is_set():
                    break
            else:
                time.sleep(poll_interval)
            try:
                m.round()
            except (BackendUnavailableError, VersionNotFoundError) as e:
                log.warning("mirror: round %d failed, retried next round: %s", m.report.rounds, e)
        return m.report
    finally:
        if source is not src:
            source.close()
        if target is not dst:
            target.close()


__all__ = ["MirrorReport", "mirror_store"]
