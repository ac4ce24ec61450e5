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
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._gc import paused
from .anchors import ChainState
from .checksum import format_checksum, full_checksum, sparse_sum, tensor_key
from .codecs import TensorSpec
from .diff import Change
from .drift import DriftTracker
from .errors import DeltaStoreError, StepOrderError, TargetMismatchError, VersionExistsError
from .manifest import (COLUMNS_FORMAT_VERSION, MAX_STEP, Manifest, ObjectRecord, Part, TensorRecord, VersionRef,
                       check_tensor_name)
from .publish.mirror import Diff, Mirror
from .publish.upload import Job, store_jobs
from .publisher import Publisher, VersionInfo
from .tensors import dtype_name

_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class _Shard:
    name: str
    offset: int
    numel: int
    full_shape: tuple[int, ...]
    dtype: str


class ShardedPublisher:
    """One logical Publisher spread over the ranks of a process group.

    Every rank constructs it with the same arguments (those of
    :class:`Publisher`, except ``background``) and calls :meth:`publish` with
    the same steps. Returns the same :class:`VersionInfo` on every rank.
    Raises the errors of :meth:`Publisher.publish`; a failure on any rank
    aborts the version on all ranks (nothing is committed).
    """

    def __init__(self, uri: Any, *, group: dist.ProcessGroup | None = None, **publisher_kwargs: Any):
        if publisher_kwargs.get("background"):
            raise ValueError("ShardedPublisher does not run in the background")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # The per-rank engine: its mirror, drift tracker, codecs and upload pool hold this rank's shards.
        self._engine = Publisher(uri, resume=False, **publisher_kwargs)
        self._layout: list[_Shard] | None = None
        self._last_step = self._engine.store.latest()

    @property
    def store(self):  # noqa: ANN201 - DeltaStore
        return self._engine.store

    @paused
    def publish(self, state: Any, *, step: int) -> VersionInfo:
        """Publish this rank's shards of version ``step``; collective over the group."""
        e = self._engine
        local = _normalise_shards(state, self.rank, self.group)
        meta = [_Shard(n, off, t.numel(), shape, dtype_name(e._dtype_of(t))) for n, (t, off, shape) in local.items()]
        everyone: list[list[_Shard]] = [[] for _ in range(self.world)]
        dist.all_gather_object(everyone, meta, group=self.group)
        layout, owned = _plan_layout(everyone, self.rank)
        specs = {n: TensorSpec(n, e._dtype_of(local[n][0]), (local[n][0].numel(),)) for n in owned}
        same_layout = e._mirror is not None and layout == self._layout

        error: BaseException | None = None
        summary: dict[str, tuple[int, int]] = {}
        changes: dict[str, Change] = {}
        diff: Diff | None = None
        mirror = e._mirror
        proposed = None
        try:
            self._check_step(step)
            mine = {n: local[n][0] for n in owned}
            if same_layout:
                assert mirror is not None
                diff = mirror.diff(mine, chunk_elems=e.chunk_elems)
                changes = diff.changes
            else:
                mirror = Mirror.capture(mine, specs, e.mirror_device)
            for n in owned:
                off = local[n][1]
                if diff is None:
                    summary[n] = (specs[n].numel, _partial_full(n, mirror.view(n), off))
                elif off == 0:
                    summary[n] = (changes[n].count, diff.sums[n])
                else:
                    ch = changes[n]
                    k = tensor_key(n)
                    summary[n] = (ch.count, (sparse_sum(k, ch.positions + off, ch.new_bits)
                                             - sparse_sum(k, ch.positions + off, ch.old_bits)) & _M64)
            if same_layout and e.policy.tracks_drift:
                proposed = e._drift.propose(changes)
        except BaseException as exc:  # keep taking part in the collectives, then raise
            error = exc
        drift = DriftTracker.count(proposed) if proposed is not None else 0
        gathered = self._gather((summary, drift, _describe(error)))

        decision: list[Any] = [None]
        if self.rank == 0:
            try:
                decision[0] = self._decide(gathered, layout, same_layout)
            except BaseException as exc:  # never leave the other ranks waiting
                decision[0] = (False, False, f"rank 0: {_describe(exc)}")
        dist.broadcast_object_list(decision, src=0, group=self.group)
        is_anchor, with_diff, failed = decision[0]
        if failed:
            raise error if error is not None else DeltaStoreError(f"version {step} aborted: {failed}")

        records: list[ObjectRecord] = []
        parts: list[tuple[str, str, Part]] = []  # (role, name, part with a local object index)
        diff_changes: dict[str, Change] = {}
        advanced = False
        assert mirror is not None
        try:
            whole: list[tuple[str, dict[str, list[Part]]]] = []
            delta_of: dict[str, list[Part]] = {}
            diff_of: dict[str, list[Part]] = {}
            full_of: dict[str, list[Part]] = {}
            if same_layout:
                jobs = e._sparse_jobs(specs, changes, mirror, delta_of, whole, None)
                records += store_jobs(e._pool, e.store, jobs, inflight=e.max_workers, first_index=len(records))
            if diff is not None:
                mirror.advance(diff)
                advanced = True
            later: list[Job] = []
            if with_diff:  # anchor -> now, read from the mirror (which holds "now")
                assert proposed is not None
                diff_changes = DriftTracker.differential(proposed, mirror.gather)
                later += e._sparse_jobs(specs, diff_changes, mirror, diff_of, whole, proposed)
            object_bytes, inflight = e._anchor_streaming(specs)
            for index_of in (delta_of, diff_of):
                names = [n for n, ix in whole if ix is index_of]
                if names:
                    later += e._dense_jobs(specs, names, mirror, index_of, object_bytes)
            if is_anchor:
                later += e._dense_jobs(specs, list(specs), mirror, full_of, object_bytes)
            records += store_jobs(e._pool, e.store, later, inflight=inflight, first_index=len(records))
            for role, index_of in (("delta", delta_of), ("diff", diff_of), ("full", full_of)):
                for n, plist in index_of.items():
                    parts += [(role, n, Part(p.object, p.offset + local[n][1], p.numel)) for p in plist]
        except BaseException as exc:
            error = exc
        diff_counts = {n: ch.count for n, ch in diff_changes.items()}
        uploads = self._gather((records, parts, diff_counts, _describe(error)))

        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome[0] = self._commit(step, layout, gathered, uploads, same_layout, is_anchor, with_diff)
            except BaseException as exc:
                outcome[0] = ("error", f"{type(exc).__name__}: {exc}", exc if isinstance(exc, DeltaStoreError)
                              else None)
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0][0] == "error":
            if advanced:
                assert diff is not None
                mirror.revert(diff)
            if error is not None:
                raise error
            exc = outcome[0][2]
            raise exc if isinstance(exc, BaseException) else DeltaStoreError(f"version {step}: {outcome[0][1]}")
        info: VersionInfo = outcome[0][1]
        last: VersionRef = outcome[0][2]
        anchor: VersionRef | None = outcome[0][3]
        # Committed everywhere: this rank's mirror (already advanced) and drift move forward.
        mirror.version = step
        e._mirror = mirror
        if diff is None:
            e._drift.reset()
        elif is_anchor:
            e._drift.reset()
        elif proposed is not None:
            e._drift.commit(proposed)
        self._layout = layout
        self._last_step = step
        e._last, e._anchor = last, anchor
        return info

    def close(self) -> None:
        """Release this rank's mirror and store connection."""
        self._engine.close()

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rank 0 ----------------------------------------------------------------------
    def _decide(self, gathered: list[Any], layout: list[_Shard], same_layout: bool) -> tuple[bool, bool, str]:
        failed = "; ".join(f"rank {r}: {err}" for r, (_, _, err) in enumerate(gathered) if err)
        if failed:
            return False, False, failed
        e = self._engine
        total = sum(math.prod(shape) for shape, _ in _tensors(layout).values())
        drift = sum(d for _, d, _ in gathered)
        chain_now = ChainState(**{**e._chain.__dict__, "drift": drift / max(total, 1), "drift_elements": drift})
        is_anchor = not same_layout or e.policy.should_anchor(chain_now)
        with_diff = (same_layout and e.policy.tracks_drift and not is_anchor and e._anchor is not None
                     and e.policy.should_differential(chain_now))
        return is_anchor, with_diff, ""

    def _commit(self, step: int, layout: list[_Shard], gathered: list[Any], uploads: list[Any], same_layout: bool,
                is_anchor: bool, with_diff: bool) -> tuple[str, VersionInfo, VersionRef, VersionRef | None]:
        failed = "; ".join(f"rank {r}: {err}" for r, (*_, err) in enumerate(uploads) if err)
        if failed:
            return ("error", failed, None)  # type: ignore[return-value]
        e = self._engine
        objects: list[ObjectRecord] = []
        roles: dict[tuple[str, str], list[Part]] = {}
        diff_changed: dict[str, int] = {}
        for records, parts, diff_counts, _ in uploads:
            base = len(objects)
            objects += records
            for role, name, p in parts:
                roles.setdefault((role, name), []).append(Part(p.object + base, p.offset, p.numel))
            for n, c in diff_counts.items():
                diff_changed[n] = diff_changed.get(n, 0) + c
        changed: dict[str, int] = {}
        partial: dict[str, int] = {}
        for summary, _, _ in gathered:
            for n, (c, cs) in summary.items():
                changed[n] = changed.get(n, 0) + c
                partial[n] = (partial.get(n, 0) + cs) & _M64
        records = []
        checksums = {}
        for name, (shape, dtype) in _tensors(layout).items():
            cs = partial[name] if not same_layout else (e._checksums[name] + partial[name]) & _M64
            checksums[name] = cs
            records.append(TensorRecord(
                name, dtype, shape, changed[name], format_checksum(cs),
                tuple(sorted(roles.get(("delta", name), []), key=lambda p: p.offset)),
                tuple(sorted(roles.get(("full", name), []), key=lambda p: p.offset)),
                tuple(sorted(roles.get(("diff", name), []), key=lambda p: p.offset)), diff_changed.get(name, 0)))
        manifest = Manifest(step=step, kind="anchor" if is_anchor else "delta",
                            parent=e._last if same_layout else None, tensors=tuple(records), objects=tuple(objects),
                            created=time.time(), producer={**e._producer(), "ranks": self.world},
                            metadata=e.metadata, differential=e._anchor if with_diff else None, files=e._files,
                            format_version=COLUMNS_FORMAT_VERSION)
        data, digest = e.store.commit(manifest)
        e._checksums = checksums
        e._last = VersionRef(step, digest)
        drift = sum(d for _, d, _ in gathered)
        e._advance_chain(manifest, is_anchor, with_diff, None, drift, manifest.total)
        if e.retention is not None:
            e._apply_retention()
        info = VersionInfo(step=step, kind=manifest.kind, changed=manifest.changed, total=manifest.total,
                           nbytes=manifest.object_bytes() + len(data), digest=digest, created=manifest.created,
                           differential=with_diff)
        return ("ok", info, e._last, e._anchor)

    # -- helpers -------------------------------------------------------------------
    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise StepOrderError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
        if self.rank == 0 and self.store.has_version(step):
            raise VersionExistsError(f"version {step} already exists in {self.store.uri}")
        if self._last_step is not None and step <= self._last_step:
            raise StepOrderError(f"step {step} is not above the last published step {self._last_step}")

    def _gather(self, item: Any) -> list[Any]:
        out: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(item, out, dst=0, group=self.group)
        return out


def _describe(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"


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


def _normalise_shards(state: Any, rank: int, group: Any) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
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
