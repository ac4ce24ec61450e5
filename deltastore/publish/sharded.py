"""Sharded publishing with ``torch.distributed``: every rank diffs and uploads its own shards.

    pub = ShardedPublisher("s3://bucket/run")          # on every rank, after init_process_group
    pub.publish(model, step=step)                      # FSDP2 DTensor parameters
    pub.publish([(name, local_tensor, offset), ...], step=step)   # or plain flat shards

Each rank compares only the shards it holds against its own mirror, encodes
them as *parts* (flat slices, see ``docs/format.md``) and uploads its objects
in parallel with the other ranks. Rank 0 gathers the object records, the
per-shard changed counts and checksum contributions (the checksum is a sum
over positions, so partial sums add up), commits one manifest, and tells every
rank the outcome. Subscribers see one normal version.

Shards: a plain shard is ``(name, local_tensor, flat_offset)`` or
``(name, local_tensor, flat_offset, full_shape)``; a DTensor must be sharded
on dim 0 only (``Shard(0)``, as FSDP2 does) or replicated. A tensor held by
several ranks at the same offset (replicated) is uploaded by the lowest rank.
Together the shards must tile every tensor exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._gc import paused
from ..checksum import full_checksum, sparse_sum, tensor_key
from ..codecs import TensorSpec
from ..errors import TargetMismatchError
from ..manifest import ObjectRecord, Part, VersionRef, check_tensor_name
from ..segments import Change
from ..store import DeltaStore
from ..tensors import dtype_name, published_dtype
from .chain import Decision, check_step
from .collective import Collective
from .commit import commit_manifest, post_commit, producer, tensor_record, version_manifest
from .drift import DriftTracker
from .info import VersionInfo
from .mirror import Diff, Mirror
from .objects import Whole
from .stages import PublishStages
from .upload import Job

_M64 = (1 << 64) - 1
#: Publisher arguments a ShardedPublisher refuses (given as anything but None or False), and why
_NOT_SHARDED = {
    "background": "does not run in the background",
    "max_pending": "does not run in the background",
    "resume": "does not resume a chain: its first publish writes an anchor",
    "quantize": "does not quantize its shards",
    "adapter_only": "does not publish adapters: use a Publisher on one rank",
    "anchor_copy_dir": "builds its differentials from an exact drift, never from the stored anchor",
}


@dataclass(frozen=True)
class _Shard:
    name: str
    offset: int
    numel: int
    full_shape: tuple[int, ...]
    dtype: str


@dataclass
class _Compared:
    """What one rank's compare found: per owned tensor ``(changed, checksum contribution)``, the drift it
    proposes, and the mirror it compared against (or a new one, holding this version)."""

    summary: dict[str, tuple[int, int]]
    changes: dict[str, Change]
    diff: Diff | None
    mirror: Mirror
    proposed: Any


class ShardedPublisher:
    """One logical Publisher spread over the ranks of a process group.

    Every rank constructs it with the same arguments (those of
    :class:`~deltastore.Publisher` that configure its stages: not
    ``background``, ``max_pending``, ``resume``, ``quantize`` or
    ``adapter_only``, which are ``ValueError``) and calls :meth:`publish`
    with the same steps. Returns the same :class:`VersionInfo`
    on every rank. Raises the errors of :meth:`Publisher.publish`; a failure on
    any rank aborts the version on all ranks (nothing is committed): the rank
    that failed raises its own error, the others a
    :class:`~deltastore.publish.collective.CollectiveError` naming it.

    Each rank opens the same stages a :class:`~deltastore.Publisher` does
    (:class:`~deltastore.publish.stages.PublishStages`: its ``planner``, chain
    ``head``, ``uploader`` and ``retainer``) and composes them through one
    :class:`~deltastore.publish.collective.Collective`: without an initialised
    process group (or with ``group=LOCAL``) it runs as a single rank, through
    the same code.
    """

    def __init__(self, uri: Any, *, group: Any = None, **publisher_kwargs: Any):
        for name, why in _NOT_SHARDED.items():
            if publisher_kwargs.pop(name, None) not in (None, False):
                raise ValueError(f"ShardedPublisher {why} ({name}=)")
        self.collective = Collective(group)
        self.rank, self.world = self.collective.rank, self.collective.world
        # This rank's stages (its shards' codecs, chain head, uploads), as a Publisher would open them.
        self._stages = PublishStages.open(uri, **publisher_kwargs)
        self._mirror: Mirror | None = None
        self._layout: list[_Shard] | None = None
        self._last_step = self.store.latest()

    @property
    def store(self) -> DeltaStore:
        """The store every rank writes to."""
        return self._stages.store

    @paused
    def publish(self, state: Any, *, step: int) -> VersionInfo:
        """Publish this rank's shards of version ``step``; collective over the group."""
        st, coll = self._stages, self.collective
        what = f"version {step}"
        local: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {}

        def describe_shards() -> list[_Shard]:
            local.update(_normalise_shards(state))
            return [_Shard(n, off, t.numel(), shape, dtype_name(published_dtype(t, st.dtype)))
                    for n, (t, off, shape) in local.items()]

        everyone = coll.reduce(describe_shards, lambda xs: xs, what=f"{what}: shard layout")
        layout, owned = _plan_layout(everyone, self.rank)
        specs = {n: TensorSpec(n, published_dtype(local[n][0], st.dtype), (local[n][0].numel(),)) for n in owned}
        same_layout = self._mirror is not None and layout == self._layout
        total = sum(math.prod(shape) for shape, _ in _tensors(layout).values())
        compared: list[_Compared] = []

        def compare() -> int:  # this rank's drift: rank 0 decides from the ranks' sum
            check_step(step, self.store if self.rank == 0 else None, self._last_step)
            compared.append(self._compare({n: local[n][0] for n in owned}, {n: local[n][1] for n in owned},
                                          specs, same_layout))
            return DriftTracker.count(compared[0].proposed)

        def decide(drifts: list[int]) -> Decision:
            return st.head.decide(same_layout=same_layout, drift_elements=sum(drifts), total=total,
                                  tracking=same_layout and st.head.tracks_drift())

        decision = coll.reduce(compare, decide, what=f"{what}: compare")
        c = compared[0]
        advanced = False

        def upload() -> tuple[Any, ...]:
            nonlocal advanced
            records, parts, diff_counts, advanced = self._upload(specs, c, decision, local)
            # rank 0 assembles the manifest from every rank's objects, parts, counts and checksum sums
            return records, parts, diff_counts, c.summary, DriftTracker.count(c.proposed)

        try:
            info, last, anchor = coll.reduce(
                upload, lambda uploads: self._commit(step, layout, uploads, same_layout, decision),
                what=f"{what}: upload and commit")
        except BaseException:
            if advanced:  # the version failed somewhere: this rank's mirror goes back to the parent
                assert c.diff is not None
                c.mirror.revert(c.diff)
            raise
        # Committed everywhere: this rank's mirror (already advanced) and head move forward.
        c.mirror.version = step
        self._mirror = c.mirror
        st.head.adopt(last, anchor, decision, c.proposed)
        self._layout = layout
        self._last_step = step
        return info

    def close(self) -> None:
        """Release this rank's mirror and store connection."""
        self._mirror = None
        self._stages.close()

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- every rank ------------------------------------------------------------------
    def _compare(self, mine: dict[str, torch.Tensor], offsets: dict[str, int], specs: dict[str, TensorSpec],
                 same_layout: bool) -> _Compared:
        """Diff this rank's shards against its mirror (or capture them into a new one)."""
        st = self._stages
        summary: dict[str, tuple[int, int]] = {}
        if not same_layout:
            mirror = Mirror.capture(mine, specs, st.mirror_device)
            for n in mine:
                summary[n] = (specs[n].numel, _partial_full(n, mirror.view(n), offsets[n]))
            return _Compared(summary, {}, None, mirror, None)
        mirror = self._mirror
        assert mirror is not None
        diff = mirror.diff(mine, chunk_elems=st.chunk_elems)
        changes = diff.changes
        for n in mine:
            off, ch = offsets[n], changes[n]
            if off == 0:
                summary[n] = (ch.count, diff.sums[n])
            else:
                k = tensor_key(n)
                summary[n] = (ch.count, (sparse_sum(k, ch.positions + off, ch.new_bits)
                                         - sparse_sum(k, ch.positions + off, ch.old_bits)) & _M64)
        proposed = st.head.drift.propose(changes) if st.head.tracks_drift() else None
        return _Compared(summary, changes, diff, mirror, proposed)

    def _upload(self, specs: dict[str, TensorSpec], c: _Compared, decision: Decision,
                local: Mapping[str, tuple[torch.Tensor, int, tuple[int, ...]]]
                ) -> tuple[list[ObjectRecord], list[tuple[str, str, Part]], dict[str, int], bool]:
        """Encode and upload this rank's objects; returns their records, their parts (``(role, name, part)``
        with a local object index and the shard's offset added), the differential's counts, and whether
        the mirror was advanced to this version (moved back by the caller if the version fails)."""
        st = self._stages
        planner, uploader = st.planner, st.uploader
        records: list[ObjectRecord] = []
        delta_of: dict[str, list[Part]] = {}
        diff_of: dict[str, list[Part]] = {}
        full_of: dict[str, list[Part]] = {}
        whole: Whole = []
        diff_changes: dict[str, Change] = {}
        if c.diff is not None:
            jobs = planner.sparse_jobs(specs, c.changes, c.mirror, delta_of, whole, None)
            records += uploader.run(jobs, first_index=len(records))
            c.mirror.advance(c.diff)
        advanced = c.diff is not None
        try:
            later: list[Job] = []
            object_bytes, inflight = planner.anchor_streaming(specs)
            if decision.with_diff:  # anchor -> now, read from the mirror (which holds "now")
                assert c.proposed is not None
                diff_changes = DriftTracker.differential(c.proposed, c.mirror.gather)
                later += planner.sparse_jobs(specs, diff_changes, c.mirror, diff_of, whole, c.proposed)
            later += planner.whole_jobs(specs, whole, c.mirror, object_bytes)
            if decision.is_anchor:
                later += planner.dense_jobs(specs, list(specs), c.mirror, full_of, object_bytes)
            records += uploader.run(later, inflight=inflight, first_index=len(records))
        except BaseException:
            if advanced:
                assert c.diff is not None
                c.mirror.revert(c.diff)
            raise
        parts = [(role, n, Part(p.object, p.offset + local[n][1], p.numel))
                 for role, index_of in (("delta", delta_of), ("diff", diff_of), ("full", full_of))
                 for n, plist in index_of.items() for p in plist]
        return records, parts, {n: ch.count for n, ch in diff_changes.items()}, advanced

    # -- rank 0 ----------------------------------------------------------------------
    def _commit(self, step: int, layout: list[_Shard], uploads: list[Any], same_layout: bool, decision: Decision
                ) -> tuple[VersionInfo, VersionRef, VersionRef | None]:
        """Assemble every rank's objects, parts and checksum contributions into one manifest and commit it."""
        st = self._stages
        head = st.head
        objects: list[ObjectRecord] = []
        roles: dict[tuple[str, str], list[Part]] = {}
        diff_changed: dict[str, int] = {}
        changed: dict[str, int] = {}
        partial: dict[str, int] = {}
        drift = 0
        for records, parts, diff_counts, summary, rank_drift in uploads:
            base = len(objects)
            objects += records
            for role, name, p in parts:
                roles.setdefault((role, name), []).append(Part(p.object + base, p.offset, p.numel))
            for n, cnt in diff_counts.items():
                diff_changed[n] = diff_changed.get(n, 0) + cnt
            for n, (cnt, cs) in summary.items():
                changed[n] = changed.get(n, 0) + cnt
                partial[n] = (partial.get(n, 0) + cs) & _M64
            drift += rank_drift
        records = []
        checksums = {}
        for name, (shape, dtype) in _tensors(layout).items():
            cs = partial[name] if not same_layout else (head.checksums[name] + partial[name]) & _M64
            checksums[name] = cs
            records.append(tensor_record(name, dtype, shape, changed[name], cs,
                                         *(sorted(roles.get((r, name), ()), key=lambda p: p.offset)
                                           for r in ("delta", "full", "diff")), diff_changed.get(name, 0)))
        manifest = version_manifest(step, decision, head, same_layout=same_layout, tensors=records, objects=objects,
                                    producer={**producer(st.writer_id), "ranks": self.world}, metadata=st.metadata,
                                    files=st.files)
        data, digest, notes = commit_manifest(self.store, manifest, st.writer_id)
        head.advance(manifest, digest, decision, checksums=checksums, drift_elements=drift)
        if st.retainer is not None:
            try:
                st.retainer.after_commit()
            except Exception as e:  # noqa: BLE001 - after the commit point: reported, never raised
                notes.append(post_commit(f"retention after version {step} failed: {e!r}"))
        info = VersionInfo(step=step, kind=manifest.kind, changed=manifest.changed, total=manifest.total,
                           nbytes=manifest.object_bytes() + len(data), digest=digest, created=manifest.created,
                           differential=decision.with_diff, warnings=tuple(notes))
        assert head.last is not None
        return info, head.last, head.anchor


def _partial_full(name: str, bits: torch.Tensor, offset: int) -> int:
    if offset == 0:
        return full_checksum(name, bits)
    return sparse_sum(tensor_key(name), torch.arange(offset, offset + bits.numel()), bits)


def _tensors(layout: list[_Shard]) -> dict[str, tuple[tuple[int, ...], str]]:
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for s in layout:
        out.setdefault(s.name, (s.full_shape, s.dtype))
    return out


def _plan_layout(everyone: list[list[_Shard]], rank: int) -> tuple[list[_Shard], list[str]]:
    """Validate that the shards tile every tensor; pick one owner per slice; return (layout, names this rank owns)."""
    owner: dict[tuple[str, int], tuple[int, _Shard]] = {}
    for r, shards in enumerate(everyone):
        for s in shards:
            key = (s.name, s.offset)
            prev = owner.get(key)
            if prev is None:
                owner[key] = (r, s)
            elif prev[1] != s:
                raise TargetMismatchError(f"ranks {prev[0]} and {r} disagree about shard {s.name}@{s.offset}")
    by_tensor: dict[str, list[_Shard]] = {}
    for _, s in owner.values():
        by_tensor.setdefault(s.name, []).append(s)
    for name, shards in by_tensor.items():
        shards.sort(key=lambda s: s.offset)
        end = 0
        for s in shards:
            if s.offset != end or s.full_shape != shards[0].full_shape or s.dtype != shards[0].dtype:
                raise TargetMismatchError(f"shards of {name!r} overlap, leave a gap or disagree on shape/dtype")
            end += s.numel
        if end != math.prod(shards[0].full_shape):
            raise TargetMismatchError(f"shards of {name!r} cover {end} of {math.prod(shards[0].full_shape)} elements")
    layout = sorted((s for _, s in owner.values()), key=lambda s: (s.name, s.offset))
    mine = [s.name for r, s in sorted(owner.values(), key=lambda rs: (rs[1].name, rs[1].offset)) if r == rank]
    return layout, mine


def _normalise_shards(state: Any) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
    """``name -> (local contiguous tensor, flat offset in the full tensor, full shape)``."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, torch.nn.Module):
        items: Iterable[Any] = state.state_dict(keep_vars=True).items()
    elif isinstance(state, Mapping):
        items = state.items()
    else:
        items = state
    out: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {}
    for item in items:
        if isinstance(item, tuple) and len(item) in (3, 4):
            name, t, offset, *shape = item
            full_shape = tuple(shape[0]) if shape else None
        else:
            name, t = item
            offset, full_shape = 0, None
        check_tensor_name(name)
        if name in out:
            raise TargetMismatchError(f"this rank holds two shards of {name!r}; give one shard per tensor per rank")
        if isinstance(t, DTensor):
            t, offset, full_shape = _dtensor_shard(name, t)
        t = t.detach()
        if not t.is_contiguous():
            raise TargetMismatchError(f"shard of {name!r} is not contiguous")
        if full_shape is None:
            full_shape = tuple(t.shape) if offset == 0 else None
        if full_shape is None:
            raise TargetMismatchError(f"shard of {name!r} at offset {offset} needs its full shape: "
                                      "pass (name, tensor, offset, full_shape)")
        out[name] = (t, int(offset), tuple(int(d) for d in full_shape))
    return out


def _dtensor_shard(name: str, t: Any) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not isinstance(p, (Replicate, Shard)) or (isinstance(p, Shard) and p.dim != 0):
            raise TargetMismatchError(f"{name!r}: only Shard(0) and Replicate placements can be published "
                                      f"(got {t.placements})")
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    full_shape = tuple(t.shape)
    row = math.prod(full_shape[1:]) if len(full_shape) > 1 else 1
    return t.to_local().contiguous(), int(offset[0]) * row if full_shape else 0, full_shape
