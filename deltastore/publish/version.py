"""Writing one captured version: decide, encode, upload, commit, then move the chain forward.

:func:`write_version` is the write half of :meth:`deltastore.Publisher.publish`
(run at once, or by the background writer), over the stages a
:class:`~deltastore.publish.stages.PublishStages` holds:

1. the chain head decides (anchor? differential?) from the drift this version proposes;
2. sparse deltas are encoded against the mirror as it is (they need the parent's bits);
3. the mirror is advanced to this version, and what needs its bits (a differential, tensors stored
   whole, an anchor) is encoded from views of it, streamed a bounded number of objects at a time;
4. the manifest is committed create-only;
5. only then the head moves forward, and retention runs (its failure is a note, never raised).

A failure before step 4 moves the mirror back and leaves the head as it was: the same step can be
written again. :class:`Captured` is what the capture half hands over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..codecs import TensorSpec
from .drift import DriftTracker, anchored
from ..manifest import Part
from ..tensors import dtype_name
from .commit import commit_manifest, post_commit, producer, tensor_record, version_manifest
from .info import VersionInfo
from .mirror import Diff, Mirror
from .objects import Whole
from .resume import differential_from_anchor
from .stages import PublishStages
from .upload import Job

_log = logging.getLogger("deltastore.publisher")
_M64 = (1 << 64) - 1


@dataclass
class Captured:
    """What ``publish()`` captured: everything the write needs, no reference to the caller's tensors.

    ``mirror`` is the mirror this version was compared against (``diff`` set),
    or, for a new chain (``diff`` None), a new mirror holding this version.
    """

    step: int
    specs: dict[str, TensorSpec]
    aliases: dict[str, str]
    mirror: Mirror
    diff: Diff | None
    captured: float
    #: a layout change against the parent: (tensors stored whole, tensors dropped); the mirror is then a
    #: new one in this version's layout, holding the parent's bits for the other tensors
    layout: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    @property
    def fresh(self) -> bool:
        return self.diff is None


def write_version(stages: PublishStages, c: Captured, *, files: dict[str, dict[str, Any]],
                  quantizer: Any = None) -> VersionInfo:
    """Write and commit version ``c`` (see the module docstring) with ``stages``, recording ``files`` and,
    with a ``quantizer``, its scheme. Returns the committed :class:`VersionInfo`; raises what encoding,
    upload or the commit raise (:class:`~deltastore.errors.VersionExistsError` for a step another writer
    took), with the mirror and the head as they were."""
    step, specs, aliases, mirror = c.step, c.specs, c.aliases, c.mirror
    # a compare that advanced the mirror (a synchronous publish) has it hold this version already: from here
    # on, any failure before the commit moves it back
    advanced = c.diff is not None and c.diff.advanced
    copy_notes: list[str | None] = []  # the anchor copy's trouble, warned about once the version is committed
    if stages.anchor_copy is not None:  # the last anchor's copy is complete before the mirror changes
        stages.anchor_copy.settle()
    try:
        same_layout = c.diff is not None  # on the chain (a parent), possibly with a layout change
        new, dropped = c.layout if c.layout is not None else ((), ())
        relaid = set(new)
        counts = c.diff.counts() if c.diff is not None else {}
        total = sum(s.numel for s in specs.values())
        # drift and differentials are measured against the anchor's layout: off from a layout change to the
        # next anchor
        head = stages.head
        proposed = head.drift.propose(c.diff, budget_bytes=head.drift_budget(specs)) \
            if c.diff is not None and head.tracks_drift(c.layout is not None) else None
        drift_elements = DriftTracker.count(proposed)
        decision = head.decide(same_layout=same_layout, drift_elements=drift_elements, total=total,
                               tracking=proposed is not None)
        is_anchor, with_diff = decision.is_anchor, decision.with_diff
        planner = stages.planner

        delta_of: dict[str, list[Part]] = {}
        full_of: dict[str, list[Part]] = {}
        diff_of: dict[str, list[Part]] = {}
        diff_counts: dict[str, int] = {}
        whole: Whole = []  # tensors stored whole, and in which role
        jobs: list[Job] = []
        reads_parent: list[str] = []
        if same_layout:  # against the parent's bits
            jobs += planner.sparse_jobs(specs, c.diff, mirror, delta_of, whole, base=None, reads_parent=reads_parent)
        if advanced and reads_parent:  # those tensors back to the parent while a codec reads them whole
            mirror.write_changes(c.diff, reads_parent, new=False)
        objects = stages.uploader.run(jobs)
        if advanced and reads_parent:
            mirror.write_changes(c.diff, reads_parent, new=True)
        if c.diff is not None and not advanced:
            mirror.advance(c.diff)  # from here on the mirror holds this version
            advanced = True
        later: list[Job] = []
        object_bytes, inflight = planner.anchor_streaming(specs)
        if with_diff:  # anchor -> now, read from the mirror (which holds "now")
            assert proposed is not None
            base: Any = proposed
            if not proposed.exact:  # a sampled drift: from the local anchor copy, else from the stored anchor
                loose, note = stages.anchor_copy.differential(mirror, head.anchor, hint=_drift_hint(head)) \
                    if stages.anchor_copy is not None and head.anchor is not None else (None, None)
                if note is not None:
                    copy_notes.append(note)
                if loose is None:
                    loose = differential_from_anchor(stages.store, head, mirror, workers=planner.max_workers)
                    _log.info("version %d: its differential read anchor %d back from the store (a local copy, "
                              "anchor_copy_dir=, would spare that)", step, head.anchor.step)
                differential, base = Diff({}, loose=loose), anchored(loose)
            elif mirror.device.type == "cpu":
                differential = Diff({}, DriftTracker.differential_flat(proposed, mirror.view))
            else:
                differential = Diff({}, loose=DriftTracker.differential(proposed, mirror.gather))
            diff_counts = differential.counts()
            # the drift can be a large part of the model: objects no larger than an anchor's, read from
            # the drift as each is encoded, so memory follows the objects in flight
            later += planner.sparse_jobs(specs, differential, mirror, diff_of, whole, base=base,
                                         limit=object_bytes)
        later += planner.whole_jobs(specs, whole, mirror, object_bytes)
        if new:  # stored whole, in objects of their own (a follower reads them and nothing else whole)
            later += planner.dense_jobs(specs, list(new), mirror, full_of, object_bytes)
        if is_anchor:
            later += planner.dense_jobs(specs, [n for n in specs if n not in relaid], mirror, full_of,
                                        object_bytes)
        objects += stages.uploader.run(later, inflight=inflight, first_index=len(objects))
        checksums = new_checksums(c, head.checksums)
        records = [tensor_record(name, dtype_name(spec.dtype), spec.shape,
                                 counts[name] if same_layout and name not in relaid else spec.numel,
                                 checksums[name], delta_of.get(name, ()), full_of.get(name, ()),
                                 diff_of.get(name, ()), diff_counts.get(name, 0))
                   for name, spec in specs.items()]
        manifest = version_manifest(
            step, decision, head, same_layout=same_layout, tensors=records, objects=objects,
            producer={**producer(stages.writer_id), "captured": c.captured}, metadata=stages.metadata,
            files=files, aliases=aliases, new_tensors=new, dropped_tensors=dropped,
            quantization=quantizer.record(specs) if quantizer is not None else None)
        data, digest, notes = commit_manifest(stages.store, manifest, stages.writer_id)
    except BaseException:
        if advanced:
            assert c.diff is not None
            mirror.revert(c.diff)
        raise

    # Committed: now (and only now) the chain state moves forward.
    mirror.version = step
    head.advance(manifest, digest, decision, checksums=checksums, proposed=proposed,
                 drift_elements=drift_elements, relaid=c.layout is not None)
    _log.info("committed version %d (%s): %d of %d elements changed, %d B stored, %.3f s", step, manifest.kind,
              manifest.changed, manifest.total, manifest.object_bytes() + len(data), time.time() - c.captured)
    if stages.anchor_copy is not None:
        copy_notes.append(stages.anchor_copy.take_note())
    notes += [post_commit(n) for n in copy_notes if n is not None]
    if is_anchor and stages.anchor_copy is not None and head.tracks_drift() and head.last is not None:
        stages.anchor_copy.write(mirror, head.last, checksums)  # on its own thread; settled before the next
    if stages.retainer is not None:
        try:
            stages.retainer.after_commit()
        except Exception as e:  # noqa: BLE001 - after the commit point: reported, never raised
            notes.append(post_commit(f"retention after version {step} failed: {e!r}"))
    return VersionInfo(step=step, kind=manifest.kind, changed=manifest.changed, total=manifest.total,
                       nbytes=manifest.object_bytes() + len(data), digest=digest, created=manifest.created,
                       differential=with_diff, warnings=tuple(notes))


def _drift_hint(head: Any) -> float:
    """The drifted fraction a differential's compare should expect (sizes its first output buffers)."""
    return min(1.0, max(head.state.drift, 1 / 64) * 1.25)


def new_checksums(c: Captured, parent: Mapping[str, int]) -> dict[str, int]:
    """Every tensor's checksum after version ``c`` (its mirror already holds it), the parent's being
    ``parent``: each one updated by the sum of what changed, or summed whole where the version stores it whole."""
    if c.diff is None:
        return c.mirror.checksums()
    new = c.mirror.checksums(c.layout[0]) if c.layout is not None else {}
    return {name: new[name] if name in new else (parent[name] + delta) & _M64
            for name, delta in c.diff.sums.items()}


__all__ = ["Captured", "new_checksums", "write_version"]
