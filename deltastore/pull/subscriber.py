"""Inference side: the :class:`Subscriber` facade over a version reader and one transaction per pull.

A pull never leaves the target half-updated. The reader
(:mod:`deltastore.pull.reader`) plans the path and fetches, verifies and
decodes its objects; a transaction (:mod:`deltastore.pull.transaction`) owns
the target from its checks to commit or abort, with every write in one undo
log, so any failure puts the target back (``docs/architecture.md``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .. import progress as _progress
from .._gc import paused
from .._memory import pin_allocator
from ..codecs import OldBits
from ..errors import StaleVersionError, VersionNotFoundError
from ..manifest import Manifest, VersionRef
from ..signing import as_trust
from ..store import DeltaStore, open_store
from ..tensors import named_tensors
from . import tracking
from .checked_target import CheckedTarget
from .checks import check_checksums
from .latest import LatestCheck
from .planner import Plan
from .reader import Staged, VersionReader, check_step_arg, log_pulled
from .transaction import Transaction
from .undo import DEFAULT_MEMORY_BYTES

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
        self.reader = VersionReader(self.store, max_workers=max_workers, verify_anchors=verify_anchors)
        if max_lag is not None and (not isinstance(max_lag, int) or max_lag < 0):
            raise ValueError(f"max_lag must be a non-negative integer, got {max_lag!r}")
        self.max_lag = max_lag
        self.journal_dir = journal_dir
        self.journal_memory = journal_memory
        self._checked = CheckedTarget()  # the last target's checks, reused while it stays as they saw it
        # one pull or stage at a time (they share _checked and the store's prefetches); re-entrant
        self._lock = threading.RLock()

    @property
    def verify_anchors(self) -> bool:
        """Whether every tensor decoded from an anchor is re-hashed against its manifest checksum."""
        return self.reader.verify_anchors

    @property
    def replans(self) -> int:
        """Pulls that planned again because GC removed part of their path or an object was corrupt."""
        return self.reader.replans

    @property
    def max_workers(self) -> int:
        """Objects downloaded in parallel."""
        return self.reader.max_workers

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
        """The cheapest path (in object bytes) from ``current`` to ``step``: :meth:`VersionReader.plan
        <deltastore.pull.reader.VersionReader.plan>` (candidates, tie rule, errors)."""
        return self.reader.plan(step, current, allow_anchor=allow_anchor, avoid=avoid)

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
            check_step_arg(step)
        with self._lock, tracking.exclusive(target):
            if progress is not None and progress is not False:
                with _progress.reporting(progress, desc="pull"):
                    return self._pull_latest(target, step, allow_anchor)
            return self._pull_latest(target, step, allow_anchor)

    @paused
    def _pull_latest(self, target: Target, step: int | None, allow_anchor: bool) -> PullResult:
        """:meth:`pull` once the target is held: resolve the step, then run a transaction, again around
        garbage collection and corrupt objects."""
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
        out = self.reader.replanning(lambda avoid: Transaction(
            self.reader, target, self._checked, journal_dir=self.journal_dir, journal_memory=self.journal_memory
        ).pull(step, allow_anchor=allow_anchor, avoid=avoid))
        res = PullResult(step, out.state, out.fetched, out.applied, out.path, out.ref.digest, out.written, lag,
                         out.manifest.created)
        log_pulled(res.step, res.path, res.bytes_fetched, res.versions_applied, t0)
        if self.store.trust is not None:
            res.signed_by, res.latest_age = self.store.manifest(res.step).signed_by, latest_age
        return res

    def sync(self, target: Target) -> PullResult | None:
        """Pull the latest version if ``target`` is more than ``max_lag`` (default 0) versions behind.

        Returns the :class:`PullResult`, or None when the target was fresh enough.
        """
        lag = self.lag(target)
        if lag is not None and lag <= (self.max_lag or 0):
            return None
        return self.pull(target)

    @paused
    def stage(self, step: int, current: VersionRef | None = None, reader: OldBits | None = None, *,
              allow_anchor: bool = True, avoid: frozenset[str] = frozenset(),
              layout_changes: bool = False) -> Staged:
        """Plan, fetch, verify and decode the way from ``current`` to ``step``, writing nothing:
        :meth:`VersionReader.stage <deltastore.pull.reader.VersionReader.stage>`, one at a time with this
        Subscriber's pulls. Integrations whose targets are not a mapping of tensors (vLLM's fused
        parameters) use this and write :attr:`Staged.state` themselves. Raises the same typed errors as
        :meth:`pull`.
        """
        with self._lock:
            return self.reader.stage(step, current, reader, allow_anchor=allow_anchor, avoid=avoid,
                                     layout_changes=layout_changes)

    def fill(self, dests: dict[str, torch.Tensor], *, step: int) -> None:
        """Write version ``step`` into ``dests`` from scratch: :meth:`VersionReader.fill
        <deltastore.pull.reader.VersionReader.fill>` (contract, errors), one at a time with this Subscriber's
        pulls."""
        with self._lock:
            self.reader.fill(dests, step=step)

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
        check_step_arg(step)
        check_checksums(named_tensors(target), self.store.manifest(step))

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
