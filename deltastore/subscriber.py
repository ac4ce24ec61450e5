"""Inference side: resolve a path to the wanted version, fetch, verify, decode, apply.

A pull never leaves the target half-updated. Deltas are fetched,
hash-checked, decoded and checksum-verified before the first write (see
:mod:`deltastore.apply`); an anchor is streamed into a live target object by
object with the target's old bits in an undo journal, so any failure puts the
target back (see :mod:`deltastore.pull.anchor` and ``docs/architecture.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from . import progress as _progress, segments, tracking
from ._gc import paused
from ._memory import pin_allocator, release_memory
from .apply import (FullState, Reader, SparseOverlay, TargetAddresses, check_layout, check_overlaps, check_target,
                    check_tied, fits, mapping_reader, plain_cpu_groups, put_back, restored_after, write_sparse)
from .checksum import full_checksum, tensor_keys
from .codecs import OldBits, Update, UpdateBatch, WrittenBatch
from .errors import (ApplyError, ChecksumMismatchError, CorruptObjectError, DeltaStoreError, ObjectNotFoundError,
                     InvalidStepError, ParentMismatchError, StaleVersionError, TargetMismatchError,
                     UntrustedVersionError, VersionNotFoundError)
from .layout import PathLayout, layout_diff, layout_of, path_layout, same_spec
from .manifest import Manifest, Part, Role, TensorRecord, VersionRef
from .pull.anchor import WriteFailed, stream_anchor
from .pull.checked_target import CheckedTarget
from .pull.decoded import DecodedUpdates
from .pull.latest import LatestCheck
from .pull.objects import decode_object, decode_sparse_object, object_index
from .pull.planner import Plan, plan_path
from .signing import as_trust
from .store import DeltaStore, open_store
from .tensors import bits_view, named_tensors
from .undo import DEFAULT_MEMORY_BYTES, UndoJournal

Target = Any  # nn.Module | MutableMapping[str, Tensor] | None
_log = logging.getLogger(__name__)


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
        every tensor after an anchor; after deltas, the changed elements: the net ones
        of a path staged whole, what each delta wrote, summed, of deltas written one by
        one, see ``docs/architecture.md``).
    lag: committed versions newer than ``step`` when the pull started.
    created: wall-clock time (seconds since the epoch) the version was committed;
        ``age`` is how old it is now.
    signed_by: the key id that signed the version, checked (None without ``trusted_keys``).
    latest_age: with ``trusted_keys``, a pull of the latest: seconds since the signed latest was issued
        (``docs/security.md``); else None.
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
    signed_by: str | None = None
    latest_age: float | None = None

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
        journal_dir: where an anchor pull into a live target saves the target's old
            bits beyond ``journal_memory`` bytes (its undo journal; default: the
            system temp directory). Needs up to the target's size in free space.
        journal_memory: old bits an anchor pull keeps in memory before it spills
            to ``journal_dir``.
        trusted_keys: public keys (paths, PEM or OpenSSH text, key objects) whose signatures this
            Subscriber accepts: every manifest it reads must carry one, checked on its bytes before any
            object is fetched, and the latest comes from the signed ``refs/latest``, never older than one
            seen before (:class:`UntrustedVersionError` and its subclasses; ``docs/security.md``). None
            (default): versions are not checked (an open store's own ``trust`` applies, if it has one).
        max_latest_age: with ``trusted_keys``, refuse (:class:`StaleLatestError`) a latest whose signature
            is older than this many seconds (a frozen store or relay); :attr:`PullResult.latest_age` reports it.
    """

    def __init__(self, uri: Any, *, storage_options: dict[str, Any] | None = None, verify_anchors: bool = True,
                 max_lag: int | None = None, max_workers: int = 4, journal_dir: str | None = None,
                 journal_memory: int = DEFAULT_MEMORY_BYTES, trusted_keys: Any = None,
                 max_latest_age: float | None = None):
        pin_allocator()  # freed temporaries go back to the OS (deltastore._memory)
        trust = as_trust(trusted_keys)  # keys checked before the store is opened
        self.store: DeltaStore = open_store(uri, **(storage_options or {}))
        if trust is not None:
            self.store.trust = trust
            self.store.forget_all()  # a manifest read before without the check is read again with it
        self.latest_check = LatestCheck(self.store.trust, max_latest_age)
        self.verify_anchors = verify_anchors
        if max_lag is not None and (not isinstance(max_lag, int) or max_lag < 0):
            raise ValueError(f"max_lag must be a non-negative integer, got {max_lag!r}")
        self.max_lag = max_lag
        self.max_workers = max(1, max_workers)
        self.journal_dir = journal_dir
        self.journal_memory = journal_memory
        self.replans = 0  # pulls that had to plan again because GC removed part of their path
        self._checked = CheckedTarget()  # the last target's checks, reused while it stays as they saw it
        # one pull or stage at a time (they share _checked and the store's prefetches); re-entrant: a pull
        # into a new dict stages its anchor
        self._lock = threading.RLock()

    # -- discovery ---------------------------------------------------------------
    def versions(self) -> list[int]:
        """Committed steps, ascending."""
        return self.store.versions()

    def latest(self) -> int | None:
        """The highest committed step, or None; with trusted keys, the signed latest (checked as in
        :meth:`pull`, :mod:`deltastore.pull.latest`)."""
        with self._lock:  # the latest accepted is this Subscriber's state, shared with its pulls
            return self.latest_check.resolve(self.store, self.versions())

    def resolve_latest(self, current: VersionRef | None = None) -> int:
        """The version a pull of the latest brings a target holding ``current`` to: :meth:`latest`, and with
        trusted keys never below ``current`` (:class:`RollbackError`). Raises :class:`VersionNotFoundError`
        for an empty store."""
        with self._lock:
            step = self.latest_check.resolve(self.store, self.versions(), current)
        if step is None:
            raise VersionNotFoundError(f"{self.store.uri} holds no versions yet")
        return step

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
        """The cheapest path (in object bytes) from ``current`` to ``step``, from this store's manifests.

        Candidates and tie rule: :func:`deltastore.pull.planner.plan_path`.
        With ``allow_anchor=False`` only paths that start at ``current`` count;
        paths that read an object whose digest is in ``avoid`` do not count.
        Raises :class:`VersionNotFoundError` when no path exists (for example
        a broken chain with no anchor below the step) and
        :class:`InvalidStepError` when ``step`` is not an integer.
        """
        _check_step_arg(step)
        return plan_path(self.store.manifest_with_digest, step, current, allow_anchor=allow_anchor, avoid=avoid,
                         where=self.store.uri)

    # -- pulling -------------------------------------------------------------------
    def pull(self, target: Target = None, *, step: int | None = None, allow_anchor: bool = True,
             progress: _progress.ProgressArg = None) -> PullResult:
        """Bring ``target`` to version ``step`` (default: the latest), bit-exactly.

        ``target`` is an ``nn.Module`` or a mutable mapping of tensors (any
        device), updated in place with storage kept; with None a new dict of
        CPU tensors is returned in ``.state``. With ``allow_anchor=False`` only
        a path from the target's current version is accepted. When the wanted
        version's layout differs from the one the target holds (a tensor
        added, dropped, reshaped, re-typed), a mapping target gets such tensors
        set or deleted and a Module refuses before anything is written
        (``docs/format.md``, "Layout changes"). Target tensors that overlap in
        memory where the version keeps them apart are refused too.

        If a version or object on the planned path disappears meanwhile
        (garbage collection), the pull plans once more through newer versions.

        Raises :class:`VersionNotFoundError` (no such version), :class:`StaleVersionError`
        (more than ``max_lag`` behind), :class:`ParentMismatchError`
        (``allow_anchor=False`` and the target is not on the chain),
        :class:`TargetMismatchError`, :class:`CorruptObjectError`,
        :class:`ChecksumMismatchError`, :class:`ObjectNotFoundError`,
:class:`UnknownCodecError`, :class:`ApplyError`, :class:`InvalidStepError`
        (``step`` is not an integer). On any error the target keeps its previous version.

        ``progress``: ``True`` for a bar on stderr, or an fsspec ``Callback``
        (see :mod:`deltastore.progress`); it counts object bytes fetched.

        With ``trusted_keys``, every manifest the pull reads is checked before any object is fetched, and a
        pull of the latest takes it from the signed ``refs/latest``: an unsigned version, an unknown key, a
        bad signature, a replayed or frozen latest, or a latest below the target's version raise a subclass
        of :class:`UntrustedVersionError` naming the version and the key id, the target untouched.

        Thread-safe: a Subscriber runs one pull or stage at a time, and pulls
        into one target, from any Subscribers and threads, run one at a time
        (each starts from the version the one before it left).
        """
        if step is not None:
            _check_step_arg(step)
        with self._lock, tracking.exclusive(target):
            if progress is not None and progress is not False:
                with _progress.reporting(progress, desc="pull"):
                    return self._pull_latest(target, step, allow_anchor)
            return self._pull_latest(target, step, allow_anchor)

    @paused
    def _pull_latest(self, target: Target, step: int | None, allow_anchor: bool) -> PullResult:
        """:meth:`pull` once the target is held: resolve the step, then pull, re-planning around GC and
        corrupt objects."""
        t0 = time.perf_counter()
        versions = self.versions()
        latest_age = None
        if step is None:
            current = tracking.get_version(target) if target is not None else None
            step = self.latest_check.resolve(self.store, versions, current)
            if step is None:
                raise VersionNotFoundError(f"{self.store.uri} holds no versions yet")
            latest_age = self.latest_check.age
        lag = sum(1 for s in versions if s > step)
        if self.max_lag is not None and lag > self.max_lag:
            raise StaleVersionError(f"version {step} is {lag} versions behind the latest ({versions[-1]}), "
                                    f"over max_lag={self.max_lag}")
        avoid: set[str] = set()
        corrupt: CorruptObjectError | None = None
        collected = False
        while True:
            try:
                with self.store.manifest_cache.holding():  # the path's manifests read once, then trimmed
                    try:
                        res = self._pull(target, step, allow_anchor, lag, frozenset(avoid))
                    finally:
                        self.store.forget_prefetched()  # what a failed pull left downloading
                _log.info("pulled version %d (%s): %d B fetched, %d versions applied, %.3f s", res.step, res.path,
                          res.bytes_fetched, len(res.versions_applied), time.perf_counter() - t0)
                if self.store.trust is not None:
                    res.signed_by, res.latest_age = self.store.manifest(res.step).signed_by, latest_age
                return res
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

    @paused
    def stage(self, step: int, current: VersionRef | None = None, reader: Reader | None = None, *,
              allow_anchor: bool = True, avoid: frozenset[str] = frozenset(),
              layout_changes: bool = False) -> Staged:
        """Plan, fetch, verify and decode the way from ``current`` to ``step``, writing nothing.

        ``reader`` gives the bits the target holds now (needed to start from
        ``current``: O(changed) checksum checks and codecs that read old
        values); without it only paths that start at an anchor are possible.
        Integrations whose targets are not a mapping of tensors (vLLM's fused
        parameters) use this and write :attr:`Staged.state` themselves (an
        anchor path is staged whole in host memory). Such a target is taken to
        have a fixed layout: a path that adds, drops, reshapes or re-types a
        tensor raises :class:`TargetMismatchError` naming it before any object
        is fetched, unless ``layout_changes=True`` (then a ``FullState`` holds
        the final layout, and a ``SparseOverlay`` lists tensors held whole in
        ``.whole`` / ``.whole_specs`` and tensors to delete in ``.dropped``).
        Raises the same typed errors as :meth:`pull`.
        """
        _check_step_arg(step)
        with self._lock, self.store.manifest_cache.holding():  # the path's manifests read once, then trimmed
            return self._stage(step, current, reader, allow_anchor, avoid, layout_changes)

    def _stage(self, step: int, current: VersionRef | None, reader: Reader | None, allow_anchor: bool,
               avoid: frozenset[str], layout_changes: bool) -> Staged:
        manifest, digest = self.store.manifest_with_digest(step)
        ref = VersionRef(step, digest)
        if current == ref:
            return Staged(ref, manifest, None, None)
        plan = self._plan_for(step, current if reader is not None else None, allow_anchor, avoid)
        lay = self.path_layout(plan, current)
        if not layout_changes:
            for d in (lay, layout_diff(self.store.manifest(current.step), manifest) if current is not None else lay):
                if d.changes:
                    raise TargetMismatchError(f"version {step} {d.first_change()} (from version "
                                              f"{d.start_manifest.step}); the target's layout is fixed (stage with "
                                              "layout_changes=True to get such a path)")
        fetched = 0
        state: FullState | SparseOverlay
        if plan.anchor is not None:
            self._prefetch(plan)
            am = self.store.manifest(plan.anchor)
            bits = stream_anchor(self.store, am, workers=self.max_workers, ahead=self._ahead(am),
                                 verify=self.verify_anchors)
            fetched = am.object_bytes(am.full_objects)
            state = FullState.from_bits(am, bits)
        else:
            assert reader is not None and current is not None
            self._prefetch(plan)
            state = SparseOverlay(reader, self.store.manifest(current.step))
        fetched += self._apply_steps(plan, state)
        return Staged(ref, manifest, plan, state, fetched)

    def _plan_for(self, step: int, current: VersionRef | None, allow_anchor: bool,
                  avoid: frozenset[str]) -> Plan:
        try:
            plan = self.plan(step, current, allow_anchor=allow_anchor, avoid=avoid)
        except VersionNotFoundError:
            if allow_anchor or not self.store.has_version(step):
                raise
            plan = Plan(0, [], 0)  # only anchors reach it: reported below
        if plan.anchor is not None and not allow_anchor:
            raise ParentMismatchError(
                f"target holds {_describe(current)}, which is not on the delta chain of version {step}; "
                "pull with allow_anchor=True to start from an anchor")
        return plan

    def _apply_steps(self, plan: Plan, state: FullState | SparseOverlay) -> int:
        """Fetch, decode and stage the plan's differential and deltas; returns the bytes read."""
        fetched = 0
        steps: list[tuple[int, Role]] = [(plan.differential, "diff")] if plan.differential is not None else []
        steps += [(s, "delta") for s in plan.deltas]
        for s, role in steps:
            fetched += self.advance(state, self.store.manifest(s), role)
        return fetched

    def advance(self, state: FullState | SparseOverlay, m: Manifest, role: Role = "delta") -> int:
        """Fetch, decode, check and stage version ``m``'s ``role`` objects onto ``state``; returns bytes read.

        For a delta that changes the layout, its dropped tensors leave the
        state and its new tensors (stored whole) enter it first. The layout
        step must have been validated (:func:`deltastore.layout.path_layout`).
        """
        fetched = 0
        if role == "delta" and m.changes_layout:
            whole, fetched = self.fetch_updates(m, "full", None, names=set(m.new_tensors))
            state.relayout(m, whole)
        updates, n = self.fetch_updates(m, role, state.old)
        state.apply(m, updates)
        return fetched + n

    def path_layout(self, plan: Plan, current: VersionRef | None) -> PathLayout:
        """What ``plan`` does to the layout (validated; :class:`ManifestError` naming a tensor if a step is off)."""
        start = plan.anchor if plan.anchor is not None else current.step if current is not None else None
        if start is None:
            raise VersionNotFoundError("a plan without anchor needs the target's version")
        diff = self.store.manifest(plan.differential) if plan.differential is not None else None
        return path_layout(self.store.manifest(start), [self.store.manifest(s) for s in plan.deltas], diff)

    def _ahead(self, am: Manifest) -> int:
        """Anchor objects downloaded ahead of the one being decoded: about a tenth of the model in flight."""
        full = am.full_objects
        if not full:
            return 1
        per = am.object_bytes(full) / len(full)
        model = sum(r.spec.nbytes for r in am.tensors)
        return max(1, min(self.max_workers, int(0.1 * model / max(per, 1.0))))

    def _pull(self, target: Target, step: int, allow_anchor: bool, lag: int,
              avoid: frozenset[str] = frozenset()) -> PullResult:
        manifest, digest = self.store.manifest_with_digest(step)
        ref = VersionRef(step, digest)
        created = manifest.created
        tied: dict[str, str] = {}
        current = tracking.get_version(target) if target is not None else None
        if current is not None and current == manifest.parent and not avoid:
            # a follower one behind reads this version's own objects: they download while the target is checked
            self.store.prefetch(_objects_of(manifest, manifest.step_objects), max_workers=self.max_workers,
                                wait=False)
        checked = self._checked.lookup(target, manifest) if target is not None else None
        self._checked.forget()  # remembered again only after a pull that succeeds
        tensors = checked if checked is not None else named_tensors(target, tied) if target is not None else None
        if current == ref:
            assert tensors is not None
            if checked is None:
                check_layout(tensors, manifest)
            if not tied:
                self._checked.remember(target, manifest)
            return PullResult(step, target, path="none", digest=ref.digest, lag=lag, created=created)
        if tensors is not None and current is not None and not self._holds_layout(tensors, current, manifest):
            current = None  # laid out otherwise than the tracked version: start from an anchor
        plan = self._plan_for(step, current if tensors is not None else None, allow_anchor, avoid)
        applied = plan.steps
        if plan.anchor is None and tensors is not None:  # the objects download while the target is checked
            self._prefetch(plan, wait=False)
        if plan.anchor is not None:
            self.store.forget_prefetched()  # a delta fetched ahead for a follower one behind, not read after all
        if plan.anchor is not None and tensors is None:  # a new dict: stream the anchor into new tensors
            staged = self.stage(step, None, None, allow_anchor=allow_anchor, avoid=avoid, layout_changes=True)
            assert isinstance(staged.state, FullState)
            result = tracking.StateDict(staged.state.as_tensors())
            tracking.set_version(result, ref)  # tracked weakly: the next pull into it takes deltas
            release_memory()
            return PullResult(step, result, staged.bytes_fetched, applied, "anchor", ref.digest, lag=lag,
                              created=created)
        assert tensors is not None
        lay = self.path_layout(plan, current)
        laid_out = True  # the target holds every tensor of the version as the version lays it out
        if checked is None:
            check_tied(manifest, tied)
            held = self._held(current)
            copies, drop = check_target(target, tensors, manifest, held)
            check_overlaps(tensors, manifest, copies)
            laid_out = held is None or held.layout_key == manifest.layout_key  # check_target: check_layout
        else:  # the same tensors, unchanged since a pull checked them against this very layout
            copies, drop = {}, []
        if plan.anchor is not None:
            fetched = self._pull_anchor(target, tensors, copies, drop, plan, current, lay, laid_out)
            written = {r.name: r.numel for r in manifest.tensors}
            path: Literal["anchor", "delta", "none"] = "anchor"
        else:
            assert current is not None
            names = lay.start_manifest.layout_columns[0]
            # the version's tensors, contiguous (check_target): the target itself when it holds just those
            held = tensors if list(tensors) == names else dict(zip(names, map(tensors.__getitem__, names)))
            # deltas that keep the layout are written one after the other, each as it is decoded (its changes
            # staged once: one pass over the target per delta, nothing held for the next), every one undone
            # if a later one fails; any other path is staged whole, then written
            through = (plan.differential is None and not lay.changes and not copies
                       and (len(plan.deltas) == 1 or not drop))
            # the same tensors as checked before, in the version's order: their addresses are known already
            known = self._checked.addresses() if checked is not None and held is tensors else None
            fetched, written = self._write_deltas(target, tensors, held, known, names, step, plan, current, copies,
                                                  drop, through)
            path = "delta"
        tracking.set_version(target, ref)
        if not (tied or copies or drop or lay.changes):
            self._checked.remember(target, manifest)
        release_memory()
        return PullResult(step, target, fetched, applied, path, ref.digest, written, lag, created)

    def _write_deltas(self, target: Target, tensors: dict[str, torch.Tensor], held: dict[str, torch.Tensor],
                      known: TargetAddresses | None, names: list[str], step: int, plan: Plan, current: VersionRef,
                      copies: dict[str, list[str]], drop: list[str], through: bool) -> tuple[int, dict[str, int]]:
        """Write the plan's differential and deltas (to version ``step``) into the live target from ``current``;
        all or nothing.

        With ``through``, each delta is staged on its own overlay, its decoders writing into the target as
        they decode (one delta behind each time), and written before the next is read; otherwise the whole
        path is staged on one overlay, then written. Returns the bytes read and the elements written per
        tensor (summed over the deltas written one by one). On any failure, an interrupt too, every write
        is undone, newest first, and the error re-raised (:class:`ApplyError` with ``restored = False`` when
        an undo refused: the target's version is then unknown).
        """
        groups: list[list[int] | None] = [[s] for s in plan.deltas] if through else [None]
        done: list[tuple[SparseOverlay, list[Callable[[], object]]]] = []
        base = self.store.manifest(current.step)
        fetched = 0
        written: dict[str, int] = {}
        tracking.set_version(target, None)  # unknown while writing
        try:
            for k, group in enumerate(groups):
                overlay = SparseOverlay(mapping_reader(tensors), base, held, write_through=through,
                                        addresses=known, table=names)
                undo: list[Callable[[], object]] = []
                done.append((overlay, undo))
                if group is None:
                    fetched += self._apply_steps(plan, overlay)
                else:
                    base = self.store.manifest(group[0])
                    fetched += self.advance(overlay, base, "delta")
                counts = overlay.pending.counts()
                counts.update(overlay.written_in_place)
                counts.update((n, b.numel()) for n, b in overlay.whole.items())
                if not written:
                    written = counts
                else:  # a later delta of the path: summed with what the ones before wrote
                    for name, n in counts.items():
                        written[name] = written.get(name, 0) + n
                write_sparse(tensors, overlay, copies, owner=target, drop=drop if k == len(groups) - 1 else None,
                             undo_out=undo)
        except BaseException as e:  # an interrupt too: undone by write_sparse and here, then re-raised
            refused = 0
            for overlay, undo in reversed(done):
                refused += put_back(undo)  # the staged writes of a delta written whole already
                refused += overlay.undo_in_place()
            tracking.set_version(target, current if restored_after(e) and not refused else None)
            if refused:
                err = ApplyError(f"pulling version {step} failed ({e!r}) and {refused} write(s) refused the "
                                 "restore; the target's version is unknown: pull again (from an anchor) to repair it")
                err.restored = False
                raise err from e
            raise
        return fetched, written

    def _held(self, current: VersionRef | None) -> Manifest | None:
        """The manifest of the version a target holds, if this store has exactly that version."""
        if current is None:
            return None
        try:
            m, digest = self.store.manifest_with_digest(current.step)
        except (VersionNotFoundError, UntrustedVersionError):  # (untrusted: a path from it is not planned)
            return None
        return m if digest == current.digest else None

    def _holds_layout(self, tensors: dict[str, torch.Tensor], current: VersionRef, wanted: Manifest) -> bool:
        """False when the target is laid out otherwise than ``current`` where ``wanted``'s layout differs.

        (A model resized by its owner after its last pull: it no longer holds
        that version, and a delta from it would be read against the wrong
        layout.) Where both versions agree, a mismatch is left to the layout
        check, which names it.
        """
        held = self._held(current)
        if held is None or held.layout_key == wanted.layout_key:  # (planning handles a vanished version)
            return True
        final = layout_of(wanted)
        for rec in held.tensors:
            if same_spec(final.get(rec.name), rec.spec):
                continue
            t = tensors.get(rec.name)
            if t is None or t.dtype != rec.spec.dtype or tuple(t.shape) != tuple(rec.shape):
                return False
        return True

    def _pull_anchor(self, target: Target, tensors: dict[str, torch.Tensor], copies: dict[str, list[str]],
                     drop: list[str], plan: Plan, current: VersionRef | None, lay: PathLayout,
                     laid_out: bool) -> int:
        """Stream the plan's anchor into the live target, then its differential and deltas; all or nothing.

        Every target tensor's old bits go to an undo journal just before the
        anchor overwrites them; if anything fails (a corrupt or missing
        object, a checksum, a write), the journal puts them back and the
        error is raised: typed as it was when the target is restored, else
        :class:`ApplyError` with ``restored = False``. Tensors the target
        cannot take from the anchor as they are (the path re-lays them, or the
        target holds them in another layout) are kept on the host from the
        anchor on and written (or, in a mapping, set) at the end; ``drop`` is
        deleted then. ``laid_out``: the target was checked to hold every tensor of the path's last
        version (and its aliases) as that version lays it out, so none needs a look of its own.
        """
        assert plan.anchor is not None
        am = self.store.manifest(plan.anchor)
        self._prefetch(plan)
        keep = _kept(am, lay, None if laid_out else tensors, copies)
        names = [r.name for r in am.tensors] if keep is None else [r.name for r in am.tensors if r.name in keep]
        dests = dict(zip(names, map(tensors.__getitem__, names)))  # checked contiguous: no view per tensor
        alias_dests = {n: [bits_view(tensors[a]) for a in aliases] for n, aliases in copies.items() if n in dests}
        journal = UndoJournal(self.journal_dir, self.journal_memory)
        tracking.set_version(target, None)  # unknown while writing
        try:
            held = stream_anchor(self.store, am, workers=self.max_workers, ahead=self._ahead(am), dests=dests,
                                 alias_dests=alias_dests, journal=journal, verify=self.verify_anchors)
            fetched = am.object_bytes(am.full_objects)
            overlay = SparseOverlay(mapping_reader(tensors), am, dests)
            records = am.tensor_map()
            for name, bits in held.items():
                overlay.hold(name, records[name].spec, bits, int(records[name].checksum, 16))
            fetched += self._apply_steps(plan, overlay)
            write_sparse(tensors, overlay, copies, owner=target, drop=drop)
        except BaseException as e:
            failed = journal.restore()
            journal.close()
            restored = failed == 0 and restored_after(e)
            tracking.set_version(target, current if restored else None)
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt & co., after the restore (the tracked version says if it worked)
            if restored and isinstance(e, DeltaStoreError) and not isinstance(e, ApplyError):
                raise  # nothing changed: the typed error stands (a corrupt object is planned around)
            cause = e.__cause__ if isinstance(e, WriteFailed) and e.__cause__ is not None else e
            if restored:
                err = ApplyError(f"writing into the target failed ({cause!r}); the target was restored")
            else:
                err = ApplyError(f"writing into the target failed ({cause!r}) and {max(failed, 1)} tensor(s) "
                                 "refused the restore; the target's version is unknown: pull again (from an "
                                 "anchor) to repair it")
            err.restored = restored
            raise err from cause
        journal.close()
        return fetched

    def fill(self, dests: dict[str, torch.Tensor], *, step: int) -> None:
        """Write version ``step`` into ``dests``: per tensor a flat bit view (the integer dtype of its width)
        whose current content does not matter.

        The anchor path, with no undo journal and no version tracking: for buffers filled from scratch
        (a resuming Publisher's mirror). ``dests`` must name every tensor of the version. Raises what
        :meth:`pull` raises; on an error the buffers hold anything.
        """
        plan = self._plan_for(step, None, True, frozenset())
        assert plan.anchor is not None
        am = self.store.manifest(plan.anchor)
        keep = _kept(am, self.path_layout(plan, None))
        direct = {r.name: dests[r.name] for r in am.tensors if keep is None or r.name in keep}
        self._prefetch(plan)
        held = stream_anchor(self.store, am, workers=self.max_workers, ahead=self._ahead(am), dests=direct,
                             verify=self.verify_anchors)
        state = FullState.from_bits(am, {**direct, **held})
        self._apply_steps(plan, state)
        for name, bits in state.bits.items():  # tensors the path re-laid: held on the host until now
            if bits.data_ptr() != dests[name].data_ptr():
                dests[name].copy_(bits)
        release_memory()

    def _prefetch(self, plan: Plan, wait: bool = True) -> None:
        """Download the plan's differential and delta objects in parallel into the store's read cache
        (``wait=False``: in the background, see :meth:`DeltaStore.prefetch`).

        The anchor's full objects are not prefetched: they are streamed, a few at a time.
        """
        wanted = []
        for s in plan.steps:
            if s == plan.anchor:
                continue
            m = self.store.manifest(s)
            wanted += _objects_of(m, m.objects_for("diff") if s == plan.differential else m.step_objects)
        self.store.prefetch(wanted, max_workers=self.max_workers, wait=wait)

    def identify(self, target: Target, step: int) -> VersionRef:
        """Declare that ``target`` holds version ``step`` after checking every tensor's checksum.

        Use it when a target was loaded some other way (a materialized
        checkpoint, a restart) so the next pull can go through deltas.
        Raises :class:`ChecksumMismatchError` if any tensor differs.
        """
        _check_step_arg(step)
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
        _check_step_arg(step)
        manifest = self.store.manifest(step)
        tensors = named_tensors(target)
        copies = check_layout(tensors, manifest)
        pairs = [(r, dest) for r in manifest.tensors for dest in [r.name, *copies.get(r.name, [])]]
        sums = _full_checksums([(r.name, bits_view(tensors[dest])) for r, dest in pairs])
        bad = [dest for (r, dest), cs in zip(pairs, sums) if cs != int(r.checksum, 16)]
        if bad:
            raise ChecksumMismatchError(f"{len(bad)} tensor(s) differ from version {step}: {bad[:5]}")

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- decoding --------------------------------------------------------------------
    def fetch_updates(self, manifest: Manifest, role: Role, old: OldBits | None,
                      names: set[str] | None = None) -> tuple[Mapping[str, Update], int]:
        """Fetch, verify and decode the ``role`` objects of ``manifest``; returns updates and bytes read.

        With ``names``, only the objects holding one of those tensors are read
        and only their updates returned (a layout change's new tensors).

        Each tensor's parts are decoded from their objects, checked against the
        manifest and joined into one update per tensor: dense (whole tensor)
        when that is what was stored, else sparse with positions in the whole
        tensor. For a delta or differential (without ``names``) the result is a
        :class:`~deltastore.pull.decoded.DecodedUpdates`: the decoders' flat
        batches, read by name on demand. Raises :class:`ObjectNotFoundError`,
        :class:`CorruptObjectError`, :class:`UnknownCodecError` or
        :class:`UnsupportedFormatError`.
        """
        batched = role != "full" and names is None
        batches: list[UpdateBatch | WrittenBatch] = []
        pieces: dict[str, list[tuple[Part, Update]]] = {}
        fetched = 0
        index = object_index(manifest, role)
        if names is not None:
            index = {i: pairs for i, pairs in index.items() if any(t.name in names for t, _ in pairs)}
        bar = _progress.current()
        _progress.grow(bar, manifest.object_bytes(set(index)))
        for i, pairs in index.items():
            rec = manifest.objects[i]
            data = self.store.get_object(rec.digest, rec.size)
            fetched += len(data)
            _progress.advance(bar, len(data))
            if batched:
                whole, split = decode_sparse_object(manifest, i, data, pairs, role, old)
                batches += whole
            else:
                split = decode_object(manifest, i, data, pairs, role, old)
            for t, p, u in split:
                pieces.setdefault(t.name, []).append((p, u))
            del data
        records = manifest.tensor_map() if pieces else {}
        updates = {name: _join(records[name], got, role, manifest.step) for name, got in pieces.items()
                   if names is None or name in names}  # in decoding order (see SparseOverlay.apply)
        return (DecodedUpdates(batches, updates) if batched else updates), fetched


def _objects_of(m: Manifest, indices: Iterable[int]) -> list[tuple[str, int]]:
    """``(digest, size)`` of objects ``indices`` of ``m``, in index order (what :meth:`DeltaStore.prefetch` takes)."""
    return [(m.objects[i].digest, m.objects[i].size) for i in sorted(indices)]


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


def _full_checksums(items: list[tuple[str, torch.Tensor]]) -> list[int]:
    """Whole checksums of ``(name, flat bits)`` pairs; plain CPU tensors in one kernel pass per element width."""
    out: list[int | None] = [None] * len(items)
    groups, others = plain_cpu_groups([t for _, t in items])
    for i in others:
        out[i] = full_checksum(*items[i])
    for idx in groups.values():
        keys = tensor_keys([items[i][0] for i in idx], len(idx))
        for i, v in zip(idx, segments.full_sums([items[i][1] for i in idx], keys).tolist()):
            out[i] = v
    return out  # type: ignore[return-value]


_MAX_AVOIDED = 8  # corrupt objects a single pull routes around before giving up


def _check_step_arg(step: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool):
        raise InvalidStepError(f"step must be an integer, got {step!r} ({type(step).__name__})")


def _kept(am: Manifest, lay: PathLayout, tensors: Mapping[str, torch.Tensor] | None = None,
          copies: Mapping[str, list[str]] | None = None) -> set[str] | None:
    """Anchor tensors streamed straight into their destination (None: all of them): those the path keeps
    as they are and, with ``tensors`` (a live target), that the target holds in that layout (aliases too).
    The others are held on the host until the path's end."""
    if not lay.changes and (tensors is None or all(fits(tensors.get(r.name), r.spec) for r in am.tensors)):
        return None
    whole = set(lay.whole)
    final = lay.final
    out = set()
    for r in am.tensors:
        spec = final.get(r.name)
        if spec is None or r.name in whole or (tensors is not None and not all(
                fits(tensors.get(n), spec) for n in (r.name, *(copies or {}).get(r.name, ())))):
            continue
        out.add(r.name)
    return out


def _describe(ref: VersionRef | None) -> str:
    return "an unknown version" if ref is None else f"version {ref.step}"

