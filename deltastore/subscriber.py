"""Inference side: resolve a path to the wanted version, fetch, verify, decode, apply.

A pull never leaves the target half-updated: all objects on the path are
fetched, hash-checked, decoded and checksum-verified before the first write
(see :mod:`deltastore.apply`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from . import tracking
from .apply import FullState, SparseOverlay, check_layout, check_update, write_full, write_sparse
from .checksum import full_checksum
from .codecs import OldBits, Update, get_codec
from .errors import ApplyError, ChecksumMismatchError, CorruptObjectError, ParentMismatchError, VersionNotFoundError
from .manifest import Manifest, VersionRef
from .store import DeltaStore, open_store
from .tensors import named_tensors

Target = Any  # nn.Module | MutableMapping[str, Tensor] | None


@dataclass
class PullResult:
    """Outcome of :meth:`Subscriber.pull`.

    step: the version the target now holds.
    state: the target itself, or a new ``{name: tensor}`` dict when no target was given.
    bytes_fetched: object bytes downloaded for this pull.
    versions_applied: steps whose objects were applied, in order (the anchor first, if one was used).
    path: ``"anchor"``, ``"delta"`` or ``"none"`` (already at the version).
    digest: sha256 of the version's manifest.
    written: tensor name -> elements written into the target (every element of
        every tensor after an anchor; the net changed elements after deltas).
    """

    step: int
    state: Any
    bytes_fetched: int = 0
    versions_applied: list[int] = field(default_factory=list)
    path: Literal["anchor", "delta", "none"] = "none"
    digest: str = ""
    written: dict[str, int] = field(default_factory=dict)


@dataclass
class Plan:
    """Which objects a pull will fetch: an optional anchor, then deltas in order."""

    anchor: int | None
    deltas: list[int]
    nbytes: int


class Subscriber:
    """Pull versions from a store into targets.

    Args:
        uri: the store (same forms as :class:`Publisher`), or an open :class:`DeltaStore`.
        storage_options: passed to the backend.
        verify_anchors: re-hash every tensor decoded from an anchor against its
            manifest checksum (O(model); deltas are always checked in O(changed)).
    """

    def __init__(self, uri: Any, *, storage_options: dict[str, Any] | None = None, verify_anchors: bool = True):
        self.store: DeltaStore = open_store(uri, **(storage_options or {}))
        self.verify_anchors = verify_anchors

    # -- discovery ---------------------------------------------------------------
    def versions(self) -> list[int]:
        """Committed steps, ascending."""
        return self.store.versions()

    def latest(self) -> int | None:
        """The highest committed step, or None."""
        return self.store.latest()

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of ``step`` (:class:`VersionNotFoundError` if absent)."""
        return self.store.manifest(step)

    def version_of(self, target: Target) -> VersionRef | None:
        """The version ``target`` holds as far as deltastore knows, or None."""
        return tracking.get_version(target)

    # -- planning ------------------------------------------------------------------
    def plan(self, step: int, current: VersionRef | None = None) -> Plan:
        """The cheapest path (in object bytes) from ``current`` to ``step``.

        Candidates: the delta chain from ``current`` if ``step``'s parent chain
        reaches it, and every anchor on that chain followed by its deltas.
        Raises :class:`VersionNotFoundError` when no path exists (for example
        a broken chain with no anchor below the step).
        """
        best: Plan | None = None
        chain: list[int] = []  # steps above the current walk position, newest first
        delta_bytes = 0
        m, digest = self.store.manifest_with_digest(step)
        while True:
            if current is not None and m.step == current.step and digest == current.digest:
                if best is None or delta_bytes <= best.nbytes:
                    best = Plan(None, chain[::-1], delta_bytes)
                break
            if m.kind == "anchor":
                cost = m.object_bytes(m.full_objects) + delta_bytes
                if best is None or cost < best.nbytes:
                    best = Plan(m.step, chain[::-1], cost)
            if not m.has_delta or m.parent is None:
                break
            if current is None and best is not None:
                break  # without a current version only anchors are starts; deeper ones cost more
            if current is not None and m.parent.step < current.step and best is not None:
                break
            delta_bytes += m.object_bytes(m.delta_objects)
            if best is not None and delta_bytes >= best.nbytes:
                break
            chain.append(m.step)
            parent = m.parent
            try:
                m, digest = self.store.manifest_with_digest(parent.step)
            except VersionNotFoundError:
                break
            if digest != parent.digest:
                break  # the parent step was rewritten by another writer: this chain ends here
        if best is None:
            raise VersionNotFoundError(f"no anchor and no delta chain reaches version {step} in {self.store.uri}")
        return best

    # -- pulling -------------------------------------------------------------------
    def pull(self, target: Target = None, *, step: int | None = None, allow_anchor: bool = True) -> PullResult:
        """Bring ``target`` to version ``step`` (default: the latest), bit-exactly.

        ``target`` is an ``nn.Module`` or a mutable mapping of tensors (any
        device), updated in place with storage kept; with None a new dict of
        CPU tensors is returned in ``.state``. With ``allow_anchor=False`` only
        a delta chain from the target's current version is accepted.

        Raises :class:`VersionNotFoundError` (no such version), :class:`ParentMismatchError`
        (``allow_anchor=False`` and the target is not on the chain),
        :class:`TargetMismatchError`, :class:`CorruptObjectError`,
        :class:`ChecksumMismatchError`, :class:`ObjectNotFoundError`,
        :class:`UnknownCodecError`, :class:`ApplyError`. On any error the target
        keeps its previous version.
        """
        if step is None:
            step = self.latest()
            if step is None:
                raise VersionNotFoundError(f"{self.store.uri} holds no versions yet")
        manifest, digest = self.store.manifest_with_digest(step)
        ref = VersionRef(step, digest)
        tensors = named_tensors(target) if target is not None else None
        copies = check_layout(tensors, manifest) if tensors is not None else {}
        current = tracking.get_version(target) if target is not None else None
        if current == ref:
            return PullResult(step, target, path="none", digest=digest)
        plan = self.plan(step, current if tensors is not None else None)
        if plan.anchor is not None and not allow_anchor:
            raise ParentMismatchError(
                f"target holds {_describe(current)}, which is not on the delta chain of version {step}; "
                "pull with allow_anchor=True to start from an anchor")

        fetched = 0
        applied: list[int] = []
        if plan.anchor is not None:
            am = self.store.manifest(plan.anchor)
            updates, n = self.fetch_updates(am, "full", None)
            fetched += n
            state = FullState(am, updates, verify=self.verify_anchors)
            applied.append(am.step)
            for s in plan.deltas:
                dm = self.store.manifest(s)
                updates, n = self.fetch_updates(dm, "delta", state.old_bits)
                fetched += n
                state.apply(dm, updates)
                applied.append(s)
            if tensors is None:
                return PullResult(step, state.as_tensors(), fetched, applied, "anchor", digest)
            tracking.set_version(target, None)  # unknown while writing; restored below
            try:
                write_full(tensors, state, copies)
            except ApplyError as e:
                tracking.set_version(target, current if e.restored else None)
                raise
            tracking.set_version(target, ref)
            return PullResult(step, target, fetched, applied, "anchor", digest,
                              {n: b.numel() for n, b in state.bits.items()})

        assert tensors is not None and current is not None
        overlay = SparseOverlay(tensors, self.store.manifest(current.step))
        for s in plan.deltas:
            dm = self.store.manifest(s)
            updates, n = self.fetch_updates(dm, "delta", overlay.old_bits)
            fetched += n
            overlay.apply(dm, updates)
            applied.append(s)
        tracking.set_version(target, None)
        try:
            write_sparse(tensors, overlay, copies)
        except ApplyError as e:
            tracking.set_version(target, current if e.restored else None)
            raise
        tracking.set_version(target, ref)
        return PullResult(step, target, fetched, applied, "delta", digest,
                          {n: p.positions.numel() for n, p in overlay.pending.items()})

    def identify(self, target: Target, step: int) -> VersionRef:
        """Declare that ``target`` holds version ``step`` after checking every tensor's checksum.

        Use it when a target was loaded some other way (a materialized
        checkpoint, a restart) so the next pull can go through deltas.
        Raises :class:`ChecksumMismatchError` if any tensor differs.
        """
        self.verify(target, step)
        ref = self.store.ref(step)
        tracking.set_version(target, ref)
        return ref

    def verify(self, target: Target, step: int | None = None) -> None:
        """Check the target's full checksums against version ``step`` (default: the version it holds).

        Raises :class:`ChecksumMismatchError` naming the differing tensors,
        :class:`TargetMismatchError` for a layout mismatch, or
        :class:`VersionNotFoundError` when the version is unknown.
        """
        if step is None:
            ref = tracking.get_version(target)
            if ref is None:
                raise VersionNotFoundError("the target's version is unknown; pass step=")
            step = ref.step
        manifest = self.store.manifest(step)
        tensors = named_tensors(target)
        copies = check_layout(tensors, manifest)
        bad = [dest for r in manifest.tensors for dest in [r.name, *copies.get(r.name, [])]
               if full_checksum(r.name, tensors[dest]) != int(r.checksum, 16)]
        if bad:
            raise ChecksumMismatchError(f"{len(bad)} tensor(s) differ from version {step}: {bad[:5]}")

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- decoding --------------------------------------------------------------------
    def fetch_updates(self, manifest: Manifest, role: Literal["delta", "full"],
                old: OldBits | None) -> tuple[dict[str, Update], int]:
        """Fetch, verify and decode the ``role`` objects of ``manifest``; returns updates and bytes read."""
        indices = manifest.full_objects if role == "full" else manifest.delta_objects
        updates: dict[str, Update] = {}
        fetched = 0
        for i in sorted(indices):
            rec = manifest.objects[i]
            codec = get_codec(rec.codec)
            data = self.store.get_object(rec.digest, rec.size)
            fetched += len(data)
            tensors = manifest.object_tensors(i, role)
            try:
                decoded = codec.decode(data, [t.spec for t in tensors], old)
            except (CorruptObjectError, ChecksumMismatchError):
                raise
            except Exception as e:  # a codec bug or hostile content must not escape untyped
                raise CorruptObjectError(f"version {manifest.step}: codec {codec.codec_id!r} failed on object "
                                         f"{rec.digest}: {e!r}") from e
            if set(decoded) != {t.name for t in tensors}:
                raise CorruptObjectError(f"version {manifest.step}: object {rec.digest} decoded tensors "
                                         f"{sorted(decoded)[:5]}, manifest expects {[t.name for t in tensors][:5]}")
            for t in tensors:
                u = decoded[t.name]
                check_update(u, t, dense=role == "full" or codec.dense, step=manifest.step)
                updates[t.name] = u
        return updates, fetched


def _describe(ref: VersionRef | None) -> str:
    return "an unknown version" if ref is None else f"version {ref.step}"

