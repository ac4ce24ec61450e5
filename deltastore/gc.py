"""Retention and garbage collection.

:class:`Retention` says what must stay restorable: the last ``keep_last``
versions and the last ``keep_anchors`` anchors, plus every version their
chains need (down to an anchor). Everything else can go.

:func:`collect_garbage` deletes in an order that never exposes a wrong
version:

1. manifests first (oldest first): a reader can no longer plan through them;
2. wait ``grace`` seconds, so readers that already hold those manifests can
   finish downloading (longer than the store's refresh window plus its
   timestamp resolution, :func:`check_grace`: else it is refused);
3. read the store's clock, list the manifests again, and delete only
   candidate objects that no manifest references now *and* that were last
   modified more than ``grace`` seconds before that clock reading. A publish
   that reuses an object refreshes it and commits within the store's refresh
   window, so an object a version committed after the listing needs is never
   deleted (the full argument, interleaving by interleaving, is in
   docs/format.md, "Garbage collection and concurrent publishers"). Objects
   spared for being young stay until a later collection (``orphans=True``).

A reader that loses a race gets :class:`VersionNotFoundError` or
:class:`ObjectNotFoundError`, never a wrong tensor, and its retry plans a path
through newer versions. Objects no manifest ever referenced (left by a
crashed publish) are removed only with ``orphans=True``, because an object
uploaded by a publish still in progress looks exactly like one: run it when no
Publisher is writing to the store.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import DeltaStoreError, GraceTooShortError, VersionNotFoundError
from .manifest import Manifest
from .store import DeltaStore

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """What GC keeps: the last ``keep_last`` versions and the last ``keep_anchors`` anchors (and their chains)."""

    keep_last: int = 20
    keep_anchors: int = 2

    def __post_init__(self) -> None:
        if self.keep_last < 1 or self.keep_anchors < 1:
            raise ValueError("Retention keeps at least the last version and the last anchor")


@dataclass
class GCPlan:
    """What a collection deletes (or, for a dry run, would delete)."""

    keep: list[int] = field(default_factory=list)
    delete_versions: list[int] = field(default_factory=list)
    delete_objects: list[str] = field(default_factory=list)
    reclaimed_bytes: int = 0


def check_grace(store: DeltaStore, grace: float, what: str = "grace") -> None:
    """Refuse a GC grace the GC-safety guarantee does not hold for: not a finite number, or not longer than
    :attr:`DeltaStore.min_gc_grace` (0 is accepted only where that is 0). Raises :class:`GraceTooShortError`
    naming the grace, the minimum and what it is made of."""
    floor = store.min_gc_grace
    if isinstance(grace, (int, float)) and not isinstance(grace, bool) and math.isfinite(grace) and (
            grace > floor or grace == floor == 0):
        return
    raise GraceTooShortError(
        f"{what}={grace!r} s is too short for {store.uri}: it must be longer than {floor:g} s (the refresh "
        f"window, {store.refresh_window:g} s, plus the store's timestamp resolution, "
        f"{store.backend.capabilities.mtime_resolution:g} s); with less, a publish that reuses an object while "
        "GC runs can lose a committed version (docs/format.md, \"Garbage collection and concurrent publishers\")")


def plan_gc(store: DeltaStore, retention: Retention) -> GCPlan:
    """Decide what to delete under ``retention``; nothing is modified.

    A version whose manifest cannot be read is kept (never delete what is not
    understood), and so is everything below it on its chain.
    """
    steps = store.versions()
    manifests: dict[int, Manifest] = {}
    unreadable: list[int] = []
    for s in steps:
        try:
            manifests[s] = store.manifest(s)
        except DeltaStoreError:
            unreadable.append(s)
    anchors = [s for s, m in manifests.items() if m.kind == "anchor"]
    keep = set(steps[-retention.keep_last:]) | set(anchors[-retention.keep_anchors:]) | set(unreadable)
    for s in sorted(keep, reverse=True):  # each kept version keeps its chain down to an anchor
        m = manifests.get(s)
        while m is not None and m.kind != "anchor" and m.parent is not None:
            keep.add(m.parent.step)
            m = manifests.get(m.parent.step)
        if s in unreadable:  # cannot see its chain: keep everything below it
            keep.update(x for x in steps if x < s)
    plan = GCPlan(keep=sorted(keep), delete_versions=[s for s in steps if s not in keep])
    kept_refs: set[str] = set()
    for s in keep:
        if s in manifests:
            kept_refs.update(manifests[s].references())
    candidates: dict[str, int] = {}
    for s in plan.delete_versions:
        candidates.update(manifests[s].references())
    plan.delete_objects = sorted(d for d in candidates if d not in kept_refs)
    plan.reclaimed_bytes = sum(candidates[d] for d in plan.delete_objects)
    return plan


def delete_versions(store: DeltaStore, steps: list[int]) -> None:
    """Delete manifests, oldest first (phase 1), after taking them out of ``refs/index.json`` (a failure
    there is logged: a reader that meets a deleted version plans again)."""
    if steps:
        try:
            store.update_index(drop=steps)
        except Exception as e:  # noqa: BLE001 - the index is a discovery aid, the deletes go on
            _log.warning("gc of %s: could not take %d deleted versions out of refs/index.json: %r", store.uri,
                         len(steps), e)
    for s in sorted(steps):
        store.delete_version(s)


def delete_unreferenced(store: DeltaStore, digests: list[str], *, grace: float = 0.0) -> list[str]:
    """Delete the ``digests`` that no manifest in the store references now and that were last modified
    more than ``grace`` seconds before this call read the store's clock (phase 3); returns those deleted.

    ``grace`` must exceed :attr:`DeltaStore.min_gc_grace` (the publishers'
    refresh window plus the timestamp resolution) for the GC-safety
    guarantee: a shorter one raises :class:`GraceTooShortError` (see :func:`check_grace`).
    """
    check_grace(store, grace)
    before = store.clock() - grace  # read before the listing: a commit after it names fresh objects only
    referenced: set[str] = set()
    for s in store.versions():
        try:
            referenced.update(store.manifest(s).references())
        except VersionNotFoundError:
            continue  # deleted meanwhile
        except DeltaStoreError:
            return []  # an unreadable manifest might reference anything: delete nothing
    return [d for d in digests if d not in referenced and store.delete_object(d, older_than=before)]


def collect_garbage(store: DeltaStore, retention: Retention, *, dry_run: bool = False, grace: float = 30.0,
                    orphans: bool = False, sleep: Callable[[float], None] = time.sleep) -> GCPlan:
    """Apply ``retention`` to ``store`` (see the module docstring for the order and guarantees).

    With ``orphans=True`` objects that no manifest references are deleted too
    (only safe while no Publisher writes). Returns the :class:`GCPlan`; with
    ``dry_run`` nothing is deleted. Raises :class:`GraceTooShortError`, before
    anything is read or deleted, for a ``grace`` not longer than
    :attr:`DeltaStore.min_gc_grace` (10 s on local disk, 11 s on S3).
    """
    check_grace(store, grace)
    with store.manifest_cache.holding():  # every manifest is read in each pass: once, not once per pass
        return _collect(store, retention, dry_run, grace, orphans, sleep)


def _collect(store: DeltaStore, retention: Retention, dry_run: bool, grace: float, orphans: bool,
             sleep: Callable[[float], None]) -> GCPlan:
    plan = plan_gc(store, retention)
    if orphans:
        listed = set(store.list_objects())
        referenced = set()
        for s in plan.keep:
            try:
                referenced.update(store.manifest(s).references())
            except DeltaStoreError:
                return plan  # cannot prove anything is an orphan
        extra = sorted(listed - referenced - set(plan.delete_objects))
        plan.delete_objects.extend(extra)
    if dry_run:
        return plan
    delete_versions(store, plan.delete_versions)
    if plan.delete_objects:
        if grace > 0:
            sleep(grace)
        plan.delete_objects = delete_unreferenced(store, plan.delete_objects, grace=grace)
    _log.info("gc of %s: deleted %d versions and %d objects, kept %d versions", store.uri,
              len(plan.delete_versions), len(plan.delete_objects), len(plan.keep))
    return plan
