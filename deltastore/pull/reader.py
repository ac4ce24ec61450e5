"""Reading versions: plan, fetch, verify and decode a version's objects, without owning any target.

:class:`VersionReader` is everything a pull does that does not write a target:
it plans the cheapest path to a version (:mod:`.planner`), downloads its
objects (the small ones ahead, in parallel; an anchor's streamed, a bounded
window at a time), has each decoded by its codec and checked against the
manifest (:mod:`.objects`), and stages the decoded versions on a host state
(:class:`~deltastore.pull.staging.FullState`) or on an overlay over a target it only
reads (:class:`~deltastore.pull.staging.SparseOverlay`). It is usable alone on a
:class:`~deltastore.store.DeltaStore`: whole-store verification, materialize,
a resuming publisher's mirror and the vLLM adapter read through it and never
build a Subscriber. Writing a target, undoing it and tracking its version are
the transaction's (:mod:`.transaction`).

Every call raises the typed errors of the path it reads:
:class:`VersionNotFoundError`, :class:`ParentMismatchError`,
:class:`ObjectNotFoundError`, :class:`CorruptObjectError`,
:class:`ChecksumMismatchError`, :class:`UnknownCodecError`,
:class:`TargetMismatchError` (a layout change a fixed-layout caller cannot
take), :class:`UntrustedVersionError` (a store with trusted keys).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from .. import progress as _progress
from .._memory import release_memory
from ..codecs import OldBits, Update, UpdateBatch, WrittenBatch
from ..errors import (CorruptObjectError, InvalidStepError, ObjectNotFoundError, ParentMismatchError, TargetMismatchError,
                      VersionNotFoundError)
from ..layout import PathLayout, layout_diff, path_layout
from ..manifest import Manifest, Part, Role, TensorRecord, VersionRef
from ..store import DeltaStore
from .anchor import stream_anchor
from .checks import fits
from .decoded import DecodedUpdates
from .objects import decode_object, decode_sparse_object, object_index
from .planner import Plan, plan_path
from .staging import FullState, SparseOverlay
from .undo import UndoJournal

T = TypeVar("T")
#: the pull side's logger, by its documented name
log = logging.getLogger("deltastore.subscriber")
#: corrupt objects a single pull routes around before giving up
_MAX_AVOIDED = 8


@dataclass
class Staged:
    """A verified pull, decoded but not yet written (:meth:`VersionReader.stage`).

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

    @property
    def versions_applied(self) -> list[int]:
        """The steps whose objects were staged, in order (the anchor first, if one was used)."""
        return self.plan.steps if self.plan is not None and self.state is not None else []

    def changes(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A delta path's net changes: ``name -> (positions, new bits, the target's original bits)``, for
        every tensor with at least one change (empty for an anchor path or none)."""
        if not isinstance(self.state, SparseOverlay):
            return {}
        return {name: (p.positions, p.bits, p.original) for name, p in self.state.pending.items()
                if p.positions.numel()}

    def elements(self) -> int:
        """Elements the staged state writes: every element of an anchor path, the changed ones of a delta path."""
        if isinstance(self.state, FullState):
            return sum(b.numel() for b in self.state.bits.values())
        return sum(pos.numel() for pos, _, _ in self.changes().values())


class VersionReader:
    """Plan, fetch, verify and decode versions of ``store``.

    max_workers: objects downloaded in parallel. verify_anchors: re-hash every
    tensor decoded from an anchor against its manifest checksum (O(model);
    deltas are always checked in O(changed)).
    """

    def __init__(self, store: DeltaStore, *, max_workers: int = 4, verify_anchors: bool = True):
        self.store = store
        self.max_workers = max(1, max_workers)
        self.verify_anchors = verify_anchors
        self.replans = 0  # attempts made again because GC removed part of a path or an object was corrupt

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
        check_step_arg(step)
        return plan_path(self.store.manifest_with_digest, step, current, allow_anchor=allow_anchor, avoid=avoid,
                         where=self.store.uri)

    def plan_for(self, step: int, current: VersionRef | None, allow_anchor: bool,
                 avoid: frozenset[str] = frozenset()) -> Plan:
        """:meth:`plan`, and :class:`ParentMismatchError` when only an anchor reaches ``step`` and
        ``allow_anchor`` is False."""
        try:
            plan = self.plan(step, current, allow_anchor=allow_anchor, avoid=avoid)
        except VersionNotFoundError:
            if allow_anchor or not self.store.has_version(step):
                raise
            plan = Plan(0, [], 0)  # only anchors reach it: reported below
        if plan.anchor is not None and not allow_anchor:
            raise ParentMismatchError(
                f"target holds {describe(current)}, which is not on the delta chain of version {step}; "
                "pull with allow_anchor=True to start from an anchor")
        return plan

    def path_layout(self, plan: Plan, current: VersionRef | None) -> PathLayout:
        """What ``plan`` does to the layout (validated; :class:`ManifestError` naming a tensor if a step is off)."""
        start = plan.anchor if plan.anchor is not None else current.step if current is not None else None
        if start is None:
            raise VersionNotFoundError("a plan without anchor needs the target's version")
        diff = self.store.manifest(plan.differential) if plan.differential is not None else None
        return path_layout(self.store.manifest(start), [self.store.manifest(s) for s in plan.deltas], diff)

    def replanning(self, attempt: Callable[[frozenset[str]], T]) -> T:
        """``attempt(avoid)`` (a pull or a stage of one version that plans its own path, ``avoid``: object
        digests its path must not read), again once the store is read afresh when part of its path
        disappears meanwhile (garbage collection: :class:`ObjectNotFoundError`, :class:`VersionNotFoundError`;
        once), or around each corrupt object it meets (:class:`CorruptObjectError`; up to 8), while another
        path exists; else the typed error stands (the corrupt object's, when one was met). Each attempt holds
        the manifests it reads (read once, then trimmed) and drops what it left downloading; :attr:`replans`
        counts the attempts made again."""
        avoid: set[str] = set()
        corrupt: CorruptObjectError | None = None
        collected = False
        while True:
            try:
                with self.store.manifest_cache.holding():  # the path's manifests read once, then trimmed
                    try:
                        return attempt(frozenset(avoid))
                    finally:
                        self.store.forget_prefetched()  # what a failed attempt left downloading
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

    # -- fetching ------------------------------------------------------------------
    def prefetch(self, plan: Plan, wait: bool = True) -> None:
        """Download the plan's differential and delta objects in parallel into the store's read cache
        (``wait=False``: in the background, see :meth:`DeltaStore.prefetch`).

        The anchor's full objects are not prefetched: they are streamed, a few at a time.
        """
        wanted = []
        for s in plan.steps:
            if s == plan.anchor:
                continue
            m = self.store.manifest(s)
            wanted += objects_of(m, m.objects_for("diff") if s == plan.differential else m.step_objects)
        self.store.prefetch(wanted, max_workers=self.max_workers, wait=wait)

    def prefetch_version(self, manifest: Manifest) -> None:
        """Start downloading ``manifest``'s own delta objects in the background (a follower one behind)."""
        self.store.prefetch(objects_of(manifest, manifest.step_objects), max_workers=self.max_workers, wait=False)

    def ahead(self, am: Manifest) -> int:
        """Anchor objects downloaded ahead of the one being decoded: about a tenth of the model in flight."""
        full = am.full_objects
        if not full:
            return 1
        per = am.object_bytes(full) / len(full)
        model = sum(r.spec.nbytes for r in am.tensors)
        return max(1, min(self.max_workers, int(0.1 * model / max(per, 1.0))))

    def stream_anchor(self, am: Manifest, *, dests: Mapping[str, torch.Tensor] | None = None,
                      alias_dests: Mapping[str, list[torch.Tensor]] | None = None,
                      journal: UndoJournal | None = None) -> dict[str, torch.Tensor]:
        """Anchor ``am`` streamed into ``dests`` (and new tensors for the others), see
        :func:`deltastore.pull.anchor.stream_anchor`: this reader's workers, read-ahead and verification."""
        return stream_anchor(self.store, am, workers=self.max_workers, ahead=self.ahead(am), dests=dests,
                             alias_dests=alias_dests, journal=journal, verify=self.verify_anchors)

    # -- decoding ------------------------------------------------------------------
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

    def apply_steps(self, plan: Plan, state: FullState | SparseOverlay) -> int:
        """Fetch, decode and stage the plan's differential and deltas onto ``state``; returns the bytes read."""
        fetched = 0
        steps: list[tuple[int, Role]] = [(plan.differential, "diff")] if plan.differential is not None else []
        steps += [(s, "delta") for s in plan.deltas]
        for s, role in steps:
            fetched += self.advance(state, self.store.manifest(s), role)
        return fetched

    def anchor_state(self, plan: Plan) -> tuple[FullState, int]:
        """The plan's anchor streamed into new host tensors (none streamed ahead of the ones kept), then
        its differential and deltas applied: the version's whole bits, and the bytes read."""
        assert plan.anchor is not None
        self.prefetch(plan)
        am = self.store.manifest(plan.anchor)
        state = FullState.from_bits(am, self.stream_anchor(am))
        return state, am.object_bytes(am.full_objects) + self.apply_steps(plan, state)

    # -- staging -------------------------------------------------------------------
    def stage(self, step: int, current: VersionRef | None = None, reader: OldBits | None = None, *,
              allow_anchor: bool = True, avoid: frozenset[str] = frozenset(),
              layout_changes: bool = False) -> Staged:
        """Plan, fetch, verify and decode the way from ``current`` to ``step``, writing nothing.

        ``reader`` gives the bits the target holds now (needed to start from
        ``current``: O(changed) checksum checks and codecs that read old
        values); without it only paths that start at an anchor are possible.
        A path from ``current`` is staged whole on one overlay (every delta's
        changes merged into the net change); :meth:`stage_each` stages it delta
        by delta instead, for a caller that writes each before the next. A
        target is taken to have a fixed layout: a path that adds, drops,
        reshapes or re-types a tensor raises :class:`TargetMismatchError`
        naming it before any object is fetched, unless ``layout_changes=True``
        (then a ``FullState`` holds the final layout, and a ``SparseOverlay``
        lists tensors held whole in ``.whole`` / ``.whole_specs`` and tensors to
        delete in ``.dropped``).
        """
        check_step_arg(step)
        with self.store.manifest_cache.holding():  # the path's manifests read once, then trimmed
            manifest, digest = self.store.manifest_with_digest(step)
            ref = VersionRef(step, digest)
            if current == ref:
                return Staged(ref, manifest, None, None)
            plan = self.plan_for(step, current if reader is not None else None, allow_anchor, avoid)
            self._check_fixed_layout(plan, current, manifest, layout_changes)
            return self._stage_plan(ref, manifest, plan, current, reader)

    def stage_each(self, step: int, current: VersionRef | None = None, reader: OldBits | None = None, *,
                   allow_anchor: bool = True, avoid: frozenset[str] = frozenset()) -> Iterator[Staged]:
        """:meth:`stage` for a caller that writes what it gets before it asks for more: a path of deltas
        from ``current`` is staged one delta at a time, each on an overlay of its own over ``reader`` from
        the version before it, and the next delta is read only once the caller asks for it (after it
        wrote this one, so ``reader`` then gives that delta's bits). A path from an anchor or through a
        differential comes whole, as one :class:`Staged`; a target that holds ``step`` already gets one
        with ``path == "none"``. Each :class:`Staged` names the version it brings the target to (its
        ``ref`` and ``manifest``; the last one ``step``'s). The layout is fixed, as :meth:`stage` without
        ``layout_changes``. Costs the single pulls of its deltas added up: no delta's changes are merged
        with another's.
        """
        check_step_arg(step)
        with self.store.manifest_cache.holding():
            manifest, digest = self.store.manifest_with_digest(step)
            ref = VersionRef(step, digest)
            if current == ref:
                yield Staged(ref, manifest, None, None)
                return
            plan = self.plan_for(step, current if reader is not None else None, allow_anchor, avoid)
            self._check_fixed_layout(plan, current, manifest, False)
            if plan.anchor is not None or plan.differential is not None or len(plan.deltas) < 2:
                yield self._stage_plan(ref, manifest, plan, current, reader)
                return
            assert reader is not None and current is not None
            self.prefetch(plan, wait=False)
            base = self.store.manifest(current.step)
            for s in plan.deltas:
                m, d = self.store.manifest_with_digest(s)
                overlay = SparseOverlay(reader, base)
                fetched = self.advance(overlay, m)
                yield Staged(VersionRef(s, d), m, Plan(None, [s], m.object_bytes(m.step_objects)), overlay, fetched)
                base = m

    def _stage_plan(self, ref: VersionRef, manifest: Manifest, plan: Plan, current: VersionRef | None,
                    reader: OldBits | None) -> Staged:
        if plan.anchor is not None:
            state, fetched = self.anchor_state(plan)
            return Staged(ref, manifest, plan, state, fetched)
        assert reader is not None and current is not None
        self.prefetch(plan)
        overlay = SparseOverlay(reader, self.store.manifest(current.step))
        return Staged(ref, manifest, plan, overlay, self.apply_steps(plan, overlay))

    def _check_fixed_layout(self, plan: Plan, current: VersionRef | None, manifest: Manifest,
                            layout_changes: bool) -> None:
        """:class:`TargetMismatchError` when the path (or the versions from ``current`` to ``manifest``)
        change the layout and the caller cannot take that (``layout_changes`` False)."""
        lay = self.path_layout(plan, current)
        if layout_changes:
            return
        for d in (lay, layout_diff(self.store.manifest(current.step), manifest) if current is not None else lay):
            if d.changes:
                raise TargetMismatchError(f"version {manifest.step} {d.first_change()} (from version "
                                          f"{d.start_manifest.step}); the target's layout is fixed (stage with "
                                          "layout_changes=True to get such a path)")

    # -- filling buffers -------------------------------------------------------------
    def fill(self, dests: dict[str, torch.Tensor], *, step: int) -> None:
        """Write version ``step`` into ``dests``: per tensor a flat bit view (the integer dtype of its width)
        whose current content does not matter.

        The anchor path, with no undo journal and no version tracking: for buffers filled from scratch
        (a resuming Publisher's mirror). ``dests`` must name every tensor of the version. Raises what a
        pull raises; on an error the buffers hold anything.
        """
        check_step_arg(step)
        plan = self.plan_for(step, None, True)
        assert plan.anchor is not None
        am = self.store.manifest(plan.anchor)
        keep = kept(am, self.path_layout(plan, None))
        direct = {r.name: dests[r.name] for r in am.tensors if keep is None or r.name in keep}
        self.prefetch(plan)
        held = self.stream_anchor(am, dests=direct)
        state = FullState.from_bits(am, {**direct, **held})
        self.apply_steps(plan, state)
        for name, bits in state.bits.items():  # tensors the path re-laid: held on the host until now
            if bits.data_ptr() != dests[name].data_ptr():
                dests[name].copy_(bits)
        release_memory()


def log_pulled(step: int, path: str, fetched: int, applied: list[int], since: float) -> None:
    """One INFO line for a version pulled (``since``: its ``time.perf_counter()`` start)."""
    log.info("pulled version %d (%s): %d B fetched, %d versions applied, %.3f s", step, path, fetched,
             len(applied), time.perf_counter() - since)


def objects_of(m: Manifest, indices: Iterable[int]) -> list[tuple[str, int]]:
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


def check_step_arg(step: object) -> None:
    """:class:`InvalidStepError` unless ``step`` is an integer (not a bool)."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise InvalidStepError(f"step must be an integer, got {step!r} ({type(step).__name__})")


def kept(am: Manifest, lay: PathLayout, tensors: Mapping[str, torch.Tensor] | None = None,
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


def describe(ref: VersionRef | None) -> str:
    """``ref`` in an error message: "version N" or "an unknown version"."""
    return "an unknown version" if ref is None else f"version {ref.step}"
