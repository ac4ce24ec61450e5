"""Inference side: resolve a path to the wanted version, fetch, verify, decode, apply.

A pull never leaves the target half-updated: all objects on the path are
fetched, hash-checked, decoded and checksum-verified before the first write
(see :mod:`deltastore.apply`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from . import tracking
from .apply import (FullState, Reader, SparseOverlay, check_layout, check_update, mapping_reader, write_full,
                    write_sparse)
from .checksum import full_checksum
from .codecs import OldBits, TensorSpec, Update, get_codec
from .errors import (ApplyError, ChecksumMismatchError, CorruptObjectError, ManifestError, ObjectNotFoundError,
                     ParentMismatchError, StaleVersionError, VersionNotFoundError)
from .manifest import Manifest, Part, Role, TensorRecord, VersionRef
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
    lag: committed versions newer than ``step`` when the pull started.
    created: wall-clock time (seconds since the epoch) the version was committed;
        ``age`` is how old it is now.
    """

    step: int
    state: Any
    bytes_fetched: int = 0
    versions_applied: list[int] = field(default_factory=list)
    path: Literal["anchor", "delta", "none"] = "none"
    digest: str = ""
    written: dict[str, int] = field(default_factory=dict)
    lag: int = 0
    created: float = 0.0

    @property
    def age(self) -> float:
        """Seconds since the pulled version was committed by the trainer."""
        return max(0.0, time.time() - self.created) if self.created else 0.0


@dataclass
class Staged:
    """A verified pull, decoded but not yet written (:meth:`Subscriber.stage`).

    state: a ``FullState`` (whole tensors, when the path starts at an anchor),
        a ``SparseOverlay`` (the net changes to the target's own version:
        ``pending[name]`` holds positions, final bits and the target's original
        bits), or None when the target already holds ``ref``.
    """

    ref: VersionRef
    manifest: Manifest
    plan: Plan | None
    state: FullState | SparseOverlay | None
    bytes_fetched: int = 0

    @property
    def path(self) -> Literal["anchor", "delta", "none"]:
        if self.state is None:
            return "none"
        return "anchor" if isinstance(self.state, FullState) else "delta"


@dataclass
class Plan:
    """What a pull fetches, in order.

    anchor: step whose full objects start the path (None: start from the target's own version).
    differential: step whose differential (its anchor -> itself) is applied next, or None.
    deltas: steps whose deltas follow, ascending.
    nbytes: object bytes the path downloads.
    """

    anchor: int | None
    deltas: list[int]
    nbytes: int
    differential: int | None = None

    @property
    def steps(self) -> list[int]:
        """Every step whose objects the plan reads."""
        head = [s for s in (self.anchor, self.differential) if s is not None]
        return head + self.deltas


class Subscriber:
    """Pull versions from a store into targets.

    Args:
        uri: the store (same forms as :class:`Publisher`), or an open :class:`DeltaStore`.
        storage_options: passed to the backend.
        verify_anchors: re-hash every tensor decoded from an anchor against its
            manifest checksum (O(model); deltas are always checked in O(changed)).
        max_lag: refuse (:class:`StaleVersionError`) to pull a version more than
            this many versions behind the latest; :meth:`sync` pulls only when
            the target is more than this far behind.
        max_workers: objects downloaded in parallel.
    """

    def __init__(self, uri: Any, *, storage_options: dict[str, Any] | None = None, verify_anchors: bool = True,
                 max_lag: int | None = None, max_workers: int = 4):
        self.store: DeltaStore = open_store(uri, **(storage_options or {}))
        self.verify_anchors = verify_anchors
        if max_lag is not None and (not isinstance(max_lag, int) or max_lag < 0):
            raise ValueError(f"max_lag must be a non-negative integer, got {max_lag!r}")
        self.max_lag = max_lag
        self.max_workers = max(1, max_workers)
        self.replans = 0  # pulls that had to plan again because GC removed part of their path

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

    def lag(self, target: Target) -> int | None:
        """How many committed versions are newer than the one ``target`` holds (None: unknown version)."""
        ref = tracking.get_version(target)
        if ref is None:
            return None
        return sum(1 for s in self.versions() if s > ref.step)

    # -- planning ------------------------------------------------------------------
    def plan(self, step: int, current: VersionRef | None = None, *, allow_anchor: bool = True,
             avoid: frozenset[str] = frozenset()) -> Plan:
        """The cheapest path (in object bytes) from ``current`` to ``step``.

        Walking parents down from ``step``, the candidates are: the delta chain
        from ``current``; every anchor met, followed by its deltas; and every
        differential met (its anchor's full objects, or ``current`` when it is
        that anchor, then the differential, then the deltas above it).
        With ``allow_anchor=False`` only paths that start at ``current`` count;
        paths that read an object whose digest is in ``avoid`` do not count.
        Raises :class:`VersionNotFoundError` when no path exists (for example
        a broken chain with no anchor below the step).
        """
        best: Plan | None = None

        def offer(candidate: Plan) -> None:
            nonlocal best
            if candidate.anchor is not None and not allow_anchor:
                return
            if best is None or candidate.nbytes < best.nbytes:
                best = candidate

        chain: list[int] = []  # steps above the walk position, newest first
        delta_bytes = 0
        m, digest = self.store.manifest_with_digest(step)
        while True:
            if current is not None and m.step == current.step and digest == current.digest:
                if best is None or delta_bytes <= best.nbytes:
                    best = Plan(None, chain[::-1], delta_bytes)
                break
            if m.kind == "anchor" and not _uses(m, m.full_objects, avoid):
                offer(Plan(m.step, chain[::-1], m.object_bytes(m.full_objects) + delta_bytes))
            if m.differential is not None and not _uses(m, m.diff_objects, avoid):
                self._offer_differential(m, chain, delta_bytes, current, offer, avoid)
            if not m.has_delta or m.parent is None or _uses(m, m.delta_objects, avoid):
                break  # every start further down would have to replay this version's delta
            if current is None and m.kind == "anchor":
                break  # without a current version only anchors start a path; deeper ones cost more
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

    def _offer_differential(self, m: Manifest, chain: list[int], delta_bytes: int, current: VersionRef | None,
                            offer: Any, avoid: frozenset[str]) -> None:
        base = m.differential
        assert base is not None
        diff_bytes = m.object_bytes(m.diff_objects)
        if current is not None and current == base:
            offer(Plan(None, chain[::-1], diff_bytes + delta_bytes, differential=m.step))
        try:
            bm, bdigest = self.store.manifest_with_digest(base.step)
        except VersionNotFoundError:
            return
        if bdigest == base.digest and bm.kind == "anchor" and not _uses(bm, bm.full_objects, avoid):
            offer(Plan(base.step, chain[::-1], bm.object_bytes(bm.full_objects) + diff_bytes + delta_bytes,
                       differential=m.step))

    # -- pulling -------------------------------------------------------------------
    def pull(self, target: Target = None, *, step: int | None = None, allow_anchor: bool = True) -> PullResult:
        """Bring ``target`` to version ``step`` (default: the latest), bit-exactly.

        ``target`` is an ``nn.Module`` or a mutable mapping of tensors (any
        device), updated in place with storage kept; with None a new dict of
        CPU tensors is returned in ``.state``. With ``allow_anchor=False`` only
        a path from the target's current version is accepted.

        If a version or object on the planned path disappears meanwhile
        (garbage collection), the pull plans once more through newer versions.

        Raises :class:`VersionNotFoundError` (no such version), :class:`StaleVersionError`
        (more than ``max_lag`` behind), :class:`ParentMismatchError`
        (``allow_anchor=False`` and the target is not on the chain),
        :class:`TargetMismatchError`, :class:`CorruptObjectError`,
        :class:`ChecksumMismatchError`, :class:`ObjectNotFoundError`,
        :class:`UnknownCodecError`, :class:`ApplyError`. On any error the target
        keeps its previous version.
        """
        versions = self.versions()
        if step is None:
            if not versions:
                raise VersionNotFoundError(f"{self.store.uri} holds no versions yet")
            step = versions[-1]
        lag = sum(1 for s in versions if s > step)
        if self.max_lag is not None and lag > self.max_lag:
            raise StaleVersionError(f"version {step} is {lag} versions behind the latest ({versions[-1]}), "
                                    f"over max_lag={self.max_lag}")
        avoid: set[str] = set()
        corrupt: CorruptObjectError | None = None
        collected = False
        while True:
            try:
                return self._pull(target, step, allow_anchor, lag, frozenset(avoid))
            except CorruptObjectError as e:
                # Nothing was written. Go around the bad object if another path exists
                # (an anchor, a differential); else the typed error stands.
                if e.digest is None or e.digest in avoid or len(avoid) >= _MAX_AVOIDED:
                    raise
                avoid.add(e.digest)
                corrupt = e
            except ParentMismatchError:
                if corrupt is None:
                    raise
                raise corrupt from None  # no delta path around the corrupt object
            except (ObjectNotFoundError, VersionNotFoundError):
                if corrupt is not None:
                    raise corrupt from None  # no path around the corrupt object
                if collected:
                    raise
                collected = True  # something was collected under us: re-read and re-plan once
            self.store.forget_all()
            self.replans += 1

    def sync(self, target: Target) -> PullResult | None:
        """Pull the latest version if ``target`` is more than ``max_lag`` (default 0) versions behind.

        Returns the :class:`PullResult`, or None when the target was fresh enough.
        """
        lag = self.lag(target)
        if lag is not None and lag <= (self.max_lag or 0):
            return None
        return self.pull(target)

    def stage(self, step: int, current: VersionRef | None = None, reader: Reader | None = None, *,
              allow_anchor: bool = True, avoid: frozenset[str] = frozenset()) -> Staged:
        """Plan, fetch, verify and decode the way from ``current`` to ``step``, writing nothing.

        ``reader`` gives the bits the target holds now (needed to start from
        ``current``: O(changed) checksum checks and codecs that read old
        values); without it only paths that start at an anchor are possible.
        Integrations whose targets are not a mapping of tensors (vLLM's fused
        parameters) use this and write :attr:`Staged.state` themselves. Raises
        the same typed errors as :meth:`pull`.
        """
        manifest, digest = self.store.manifest_with_digest(step)
        ref = VersionRef(step, digest)
        if current == ref:
            return Staged(ref, manifest, None, None)
        try:
            plan = self.plan(step, current if reader is not None else None, allow_anchor=allow_anchor,
                             avoid=avoid)
        except VersionNotFoundError:
            if allow_anchor or not self.store.has_version(step):
                raise
            plan = Plan(0, [], 0)  # only anchors reach it: reported below
        if plan.anchor is not None and not allow_anchor:
            raise ParentMismatchError(
                f"target holds {_describe(current)}, which is not on the delta chain of version {step}; "
                "pull with allow_anchor=True to start from an anchor")
        self._prefetch(plan)
        fetched = 0
        state: FullState | SparseOverlay
        if plan.anchor is not None:
            am = self.store.manifest(plan.anchor)
            updates, fetched = self.fetch_updates(am, "full", None)
            state = FullState(am, updates, verify=self.verify_anchors)
        else:
            assert reader is not None and current is not None
            state = SparseOverlay(reader, self.store.manifest(current.step))
        steps: list[tuple[int, Role]] = [(plan.differential, "diff")] if plan.differential is not None else []
        steps += [(s, "delta") for s in plan.deltas]
        for s, role in steps:
            m = self.store.manifest(s)
            updates, n = self.fetch_updates(m, role, state.old_bits)
            fetched += n
            state.apply(m, updates)
        return Staged(ref, manifest, plan, state, fetched)

    def _pull(self, target: Target, step: int, allow_anchor: bool, lag: int,
              avoid: frozenset[str] = frozenset()) -> PullResult:
        manifest = self.store.manifest(step)
        tensors = named_tensors(target) if target is not None else None
        copies = check_layout(tensors, manifest) if tensors is not None else {}
        current = tracking.get_version(target) if target is not None else None
        staged = self.stage(step, current, mapping_reader(tensors) if tensors is not None else None,
                            allow_anchor=allow_anchor, avoid=avoid)
        ref, state = staged.ref, staged.state
        created = staged.manifest.created
        if state is None:
            return PullResult(step, target, path="none", digest=ref.digest, lag=lag, created=created)
        applied = staged.plan.steps if staged.plan is not None else []
        if isinstance(state, FullState):
            if tensors is None:
                return PullResult(step, state.as_tensors(), staged.bytes_fetched, applied, "anchor", ref.digest,
                                  lag=lag, created=created)
            written = {n: b.numel() for n, b in state.bits.items()}
            write = lambda: write_full(tensors, state, copies)  # noqa: E731
        else:
            assert tensors is not None
            written = {n: p.positions.numel() for n, p in state.pending.items()}
            write = lambda: write_sparse(tensors, state, copies)  # noqa: E731
        tracking.set_version(target, None)  # unknown while writing
        try:
            write()
        except ApplyError as e:
            tracking.set_version(target, current if e.restored else None)
            raise
        tracking.set_version(target, ref)
        return PullResult(step, target, staged.bytes_fetched, applied, staged.path, ref.digest, written, lag,
                          created)

    def _prefetch(self, plan: Plan) -> None:
        """Download every object of the plan in parallel into the store's read cache."""
        wanted = []
        for s in plan.steps:
            m = self.store.manifest(s)
            role: Role = "full" if s == plan.anchor else "diff" if s == plan.differential else "delta"
            wanted += [(m.objects[i].digest, m.objects[i].size) for i in sorted(m.objects_for(role))]
        self.store.prefetch(wanted, max_workers=self.max_workers)

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
    def fetch_updates(self, manifest: Manifest, role: Role,
                      old: OldBits | None) -> tuple[dict[str, Update], int]:
        """Fetch, verify and decode the ``role`` objects of ``manifest``; returns updates and bytes read.

        Each tensor's parts are decoded from their objects, checked against the
        manifest and joined into one update per tensor: dense (whole tensor)
        when that is what was stored, else sparse with positions in the whole
        tensor. Raises :class:`ObjectNotFoundError`, :class:`CorruptObjectError`,
        :class:`UnknownCodecError` or :class:`UnsupportedFormatError`.
        """
        pieces: dict[str, list[tuple[Part, Update]]] = {}
        fetched = 0
        for i in sorted(manifest.objects_for(role)):
            rec = manifest.objects[i]
            codec = get_codec(rec.codec)
            data = self.store.get_object(rec.digest, rec.size)
            fetched += len(data)
            pairs = manifest.object_parts(i, role)
            names = [t.name for t, _ in pairs]
            if len(set(names)) != len(names):
                raise ManifestError(f"version {manifest.step}: object {i} holds two parts of one tensor")
            offsets = {t.name: p for t, p in pairs}
            specs = [t.spec if t.is_whole(p) else TensorSpec(t.name, t.spec.dtype, (p.numel,)) for t, p in pairs]
            try:
                decoded = codec.decode(data, specs, _part_reader(old, offsets) if old is not None else None)
            except (CorruptObjectError, ChecksumMismatchError):
                raise
            except Exception as e:  # a codec bug or hostile content must not escape untyped
                raise CorruptObjectError(f"version {manifest.step}: codec {codec.codec_id!r} failed on object "
                                         f"{rec.digest}: {e!r}", digest=rec.digest) from e
            if set(decoded) != set(names):
                raise CorruptObjectError(f"version {manifest.step}: object {rec.digest} decoded tensors "
                                         f"{sorted(decoded)[:5]}, manifest expects {names[:5]}", digest=rec.digest)
            for (t, p), spec in zip(pairs, specs):
                u = decoded[t.name]
                part_rec = t if t.is_whole(p) else replace(t, shape=spec.shape)
                dense = role == "full" or codec.dense or u.positions is None
                check_update(u, part_rec, dense=dense, step=manifest.step,
                             expected=u.count if len(getattr(t, role)) > 1 or dense else
                             (t.diff_changed if role == "diff" else t.changed))
                pieces.setdefault(t.name, []).append((p, u))
        updates = {}
        for t in manifest.tensors:
            got = pieces.get(t.name)
            if got is not None:
                updates[t.name] = _join(t, got, role, manifest.step)
        return updates, fetched


def _part_reader(old: OldBits, parts: dict[str, Part]) -> OldBits:
    """``old`` seen from inside parts: positions relative to each part's offset."""

    def read(name: str, positions: torch.Tensor | None) -> torch.Tensor:
        p = parts[name]
        if positions is None:
            whole = old(name, None)
            return whole if p.offset == 0 and whole.numel() == p.numel else whole[p.offset:p.offset + p.numel]
        return old(name, positions + p.offset if p.offset else positions)

    return read


def _join(rec: TensorRecord, got: list[tuple[Part, Update]], role: Role, step: int) -> Update:
    """One update for the whole tensor from its decoded parts (in offset order)."""
    if len(got) == 1 and rec.is_whole(got[0][0]):
        return got[0][1]
    got.sort(key=lambda pu: pu[0].offset)
    if role == "full":
        return Update(rec.spec, torch.cat([u.bits for _, u in got]))
    positions = [u.positions + p.offset if u.positions is not None else torch.arange(p.offset, p.offset + p.numel)
                 for p, u in got]
    joined = Update(rec.spec, torch.cat([u.bits for _, u in got]), torch.cat(positions))
    expected = rec.diff_changed if role == "diff" else rec.changed
    if all(u.positions is not None for _, u in got) and joined.count != expected:
        raise CorruptObjectError(f"version {step}, tensor {rec.name!r}: parts hold {joined.count} changed "
                                 f"elements, manifest says {expected}")
    return joined


_MAX_AVOIDED = 8  # corrupt objects a single pull routes around before giving up


def _uses(m: Manifest, indices: set[int], avoid: frozenset[str]) -> bool:
    return bool(avoid) and any(m.objects[i].digest in avoid for i in indices)


def _describe(ref: VersionRef | None) -> str:
    return "an unknown version" if ref is None else f"version {ref.step}"

