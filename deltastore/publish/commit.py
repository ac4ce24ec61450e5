"""A version's manifest, its commit point, and what runs after it.

:func:`tensor_record` and :func:`version_manifest` assemble the manifest from
what the stages produced (the chain head's parent and anchor, the policy's
decision, each tensor's parts by role). :func:`commit_manifest` writes a version's manifest create-only (the commit
point) and tells a failure after that point (the store marker, the
``refs/latest`` hint) from one before it. :class:`Retainer` applies a
:class:`~deltastore.gc.Retention` after each commit, deleting unreferenced
objects only once their grace has passed. Both are shared by
:class:`~deltastore.Publisher` and :class:`~deltastore.ShardedPublisher`
(rank 0 commits).
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from typing import Any

from collections.abc import Sequence

from .._version import __version__
from ..checksum import format_checksum
from ..errors import PostCommitWarning, VersionExistsError
from ..gc import Retention, delete_unreferenced, delete_versions, plan_gc
from ..index import INDEX_KEY, IndexEntry
from ..manifest import LAYOUT_OBJECT_FORMAT_VERSION, Manifest, Part, TensorRecord, sha256_digest
from ..store import DeltaStore, version_key
from .chain import ChainHead, Decision



def post_commit(message: str) -> str:
    """Warn (:class:`PostCommitWarning`) about a failure after the commit point; returns ``message`` for the
    version's ``warnings``."""
    warnings.warn(message, PostCommitWarning, stacklevel=3)
    return message


def tensor_record(name: str, dtype: str, shape: tuple[int, ...], changed: int, checksum: int,
                  delta: Sequence[Part] = (), full: Sequence[Part] = (), diff: Sequence[Part] = (),
                  diff_changed: int = 0) -> TensorRecord:
    """One tensor's record: ``changed`` elements this version, its ``checksum`` after it, its parts in each role
    (delta, full, differential; each sorted by offset), ``diff_changed`` elements in its differential."""
    return TensorRecord(name, dtype, shape, changed, format_checksum(checksum), tuple(delta), tuple(full),
                        tuple(diff), diff_changed)


def version_manifest(step: int, decision: Decision, head: ChainHead, *, same_layout: bool,
                     tensors: Sequence[TensorRecord], objects: Sequence[Any], producer: dict[str, Any],
                     metadata: dict[str, Any], files: dict[str, Any], **layout: Any) -> Manifest:
    """The manifest of version ``step``: an anchor or a delta as ``decision`` says, on ``head``'s parent when it
    continues the chain (``same_layout``), with a differential from ``head``'s anchor when the decision has one;
    ``layout``: the other fields a Publisher sets (``aliases``, ``new_tensors``, ``dropped_tensors``,
    ``quantization``)."""
    return Manifest(step=step, kind="anchor" if decision.is_anchor else "delta",
                    parent=head.last if same_layout else None, tensors=tuple(tensors), objects=tuple(objects),
                    created=time.time(), producer=producer, metadata=metadata,
                    differential=head.anchor if decision.with_diff else None, files=files,
                    format_version=LAYOUT_OBJECT_FORMAT_VERSION, **layout)


def producer(writer_id: str) -> dict[str, Any]:
    """The manifest's ``producer`` record of this process as writer ``writer_id``."""
    return {"library": "deltastore", "version": __version__, "writer": writer_id,
            "host": socket.gethostname(), "pid": os.getpid()}


def commit_manifest(store: DeltaStore, manifest: Manifest, writer_id: str) -> tuple[bytes, str, list[str]]:
    """Commit ``manifest``; returns its bytes, digest and what failed after the commit point.

    The commit point is the create-only write of the manifest. If
    :meth:`DeltaStore.commit` raises after it, the manifest is read back: when
    it is ours (``writer_id`` and the creation time; the store may add to the
    producer record) the version is committed and the failure is returned as a
    warning; otherwise (another writer's version, nothing there, the read fails
    too) the error stands. Raises :class:`VersionExistsError` when the version
    is already there. Last, the version is added to ``refs/index.json``; a failure there is a warning too.
    """
    notes: list[str] = []
    try:
        data, digest = store.commit(manifest)
    except VersionExistsError:
        raise
    except Exception as e:
        try:
            data = store.backend.get(version_key(manifest.step))
            theirs = store.parse_manifest(data)
            landed = theirs.producer.get("writer") == writer_id and theirs.created == manifest.created
        except Exception:  # noqa: BLE001 - cannot tell: the commit's own error stands
            landed = False
        if not landed:
            raise
        manifest, digest = theirs, sha256_digest(data)
        notes.append(post_commit(f"version {manifest.step} is committed, but a step after its commit point "
                                 f"failed: {e!r}"))
    try:  # last: readers that cannot list find the version through the index (deltastore.index)
        store.update_index(add=[IndexEntry.of(manifest, digest, len(data))])
    except Exception as e:  # noqa: BLE001 - after the commit point: reported, never raised
        notes.append(post_commit(f"version {manifest.step} is committed, but updating {INDEX_KEY} failed (readers "
                                 f"without a listing API do not see it until the next commit): {e!r}"))
    return data, digest, notes


class Retainer:
    """Keeps ``store`` within ``retention`` after each commit; an object is deleted ``grace`` seconds after
    the versions that used it, so a reader that planned a pull before still finds it."""

    def __init__(self, store: DeltaStore, retention: Retention, grace: float):
        self.store = store
        self.retention = retention
        self.grace = grace
        self._pending: list[tuple[float, list[str]]] = []

    def after_commit(self) -> None:
        """Delete the versions ``retention`` drops now, and the objects whose grace has passed."""
        plan = plan_gc(self.store, self.retention)
        delete_versions(self.store, plan.delete_versions)
        if plan.delete_objects:
            self._pending.append((time.monotonic(), plan.delete_objects))
        self.collect_due()

    def collect_due(self) -> None:
        """Delete the objects whose grace has passed (those still unreferenced)."""
        now = time.monotonic()
        due = [d for t, ds in self._pending if now - t >= self.grace for d in ds]
        self._pending = [(t, ds) for t, ds in self._pending if now - t < self.grace]
        if due:
            delete_unreferenced(self.store, due, grace=self.grace)
