"""Object planning: which objects a version's changes and whole tensors become, as upload jobs.

An :class:`ObjectPlanner` turns a version's changes into *jobs*
(:data:`deltastore.publish.upload.Job`: a codec, a function that builds the
object's updates on the worker, and the ``name -> [Part]`` index that notes its
parts); :func:`deltastore.publish.upload.store_jobs` encodes and uploads them.

* :meth:`~ObjectPlanner.sparse_jobs` — changed elements with the delta codec,
  grouped into objects of about ``max_object_bytes``; a tensor whose sparse
  form each codec estimates (:meth:`Codec.estimate_size`) to be no smaller than
  the whole tensor is set aside to be stored whole instead;
* :meth:`~ObjectPlanner.dense_jobs` — whole tensors (views of the mirror) with
  the anchor codec, a tensor larger than an object cut into flat slices;
* :meth:`~ObjectPlanner.anchor_streaming` — the object size and the number of
  objects in flight that let an anchor stream through bounded memory.

The planner hard-codes no codec's layout and reads nothing but the specs, the
changes and the mirror it is handed; :class:`~deltastore.Publisher` and
:class:`~deltastore.ShardedPublisher` (one planner per rank) share it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from ..codecs import Codec, TensorSpec, Update, UpdateBatch
from ..segments import Change
from ..manifest import Part
from .mirror import Diff, Mirror
from .upload import Job

#: whole tensors (anchors) are cut into objects of about model / 64 bytes, within these bounds, so that
#: an anchor streams through memory (encode, upload, free) a few objects at a time
ANCHOR_OBJECT_MIN = 16 << 20
ANCHOR_OBJECT_MAX = 256 << 20
#: changed elements of a version above which its objects break where the compare's buffers do
#: (``Diff.part_breaks``): below, one object's copy (12 B a change) costs less than the bytes a
#: follower downloads for another object (a cold 1 GB step: 1.42 -> 1.55 B a change, ``bench/NOTES.md``)
SPLIT_AT_BUFFERS_ABOVE = 1 << 22

#: tensors set aside to be stored whole, each with the role index (delta, differential) its parts go to
Whole = list[tuple[str, dict[str, list[Part]]]]


class ObjectPlanner:
    """Plans a version's objects (see the module). ``codec``: sparse objects; ``anchor_codec``: whole
    tensors (``dense``); ``max_object_bytes``: the estimated size of one sparse object; ``max_workers``:
    objects encoded at once (bounds how many an anchor holds in flight)."""

    def __init__(self, codec: Codec, anchor_codec: Codec, *, max_object_bytes: int, max_workers: int):
        if codec.dense:
            raise ValueError(f"codec {codec.codec_id!r} stores whole tensors; pass it as anchor_codec")
        if not anchor_codec.dense:
            raise ValueError(f"anchor_codec {anchor_codec.codec_id!r} does not store whole tensors")
        self.codec = codec
        self.anchor_codec = anchor_codec
        self.max_object_bytes = max_object_bytes
        self.max_workers = max(1, max_workers)

    def sparse_jobs(self, specs: Mapping[str, TensorSpec], changes: Mapping[str, Change] | Diff, mirror: Mirror,
                    index_of: dict[str, list[Part]], whole: Whole, base: Any = None,
                    limit: int | None = None, reads_parent: list[str] | None = None) -> list[Job]:
        """Jobs that encode ``changes`` against the parent's bits (``base`` None) or against the anchor.

        For a delta ``mirror`` holds the parent version (at least in the
        tensors listed in ``reads_parent``, see below); for a differential
        (``base``: the drift) it holds this version. A tensor whose
        sparse form would be larger than the whole tensor is added to
        ``whole`` instead (stored with the anchor codec once the mirror holds
        this version). A group of tensors that lie in one flat group of
        ``changes`` (a :class:`Diff`: the compare, or a differential from the
        drift) is handed to the codec as one :class:`UpdateBatch`
        (:meth:`Codec.encode_batch`) with the old tensors only of those whose
        encoding reads them, not as an :class:`Update` per tensor. ``limit``: the estimated bytes
        of one object (default ``max_object_bytes``). ``reads_parent``: where the names of the
        tensors whose encoding reads the whole old tensor are added (for a delta whose compare
        advanced the mirror, the caller moves those back to the parent while the jobs run).
        """
        diff = changes if isinstance(changes, Diff) else None
        counts = diff.counts() if diff is not None else {n: ch.count for n, ch in changes.items()}
        sparse: list[tuple[int, str]] = []
        codec, dense = self.codec, self.anchor_codec
        for name, count in counts.items():
            if not count:
                continue
            spec = specs[name]
            sparse_bytes = codec.estimate_size(spec, count)  # each codec sizes its own layout
            if sparse_bytes < dense.estimate_size(spec, count):
                sparse.append((sparse_bytes, name))
            else:
                whole.append((name, index_of))

        def old_tensor(name: str) -> torch.Tensor:
            if base is None:
                return mirror.host_view(name)  # a view of the parent's bits: the codec only reads it
            # the anchor's tensor: the mirror (this version) with the anchor's bits where they differ
            since = base.get(name)
            return mirror.at_anchor(name, since.positions, since.anchor_bits) if since is not None \
                else mirror.host_view(name)

        def needs_old(name: str) -> bool:  # what the encoder reads for this tensor (auto: only some)
            return codec.needs_for(specs[name], counts[name]) == "old_tensor"

        if reads_parent is not None:
            reads_parent += [n for _, n in sparse if needs_old(n)]
        jobs: list[Job] = []
        # an object per compare buffer only where the copy it saves outweighs an object's fixed bytes
        breaks = diff.part_breaks() if diff is not None and diff.changed >= SPLIT_AT_BUFFERS_ABOVE else set()
        for group in groups(sparse, limit or self.max_object_bytes, breaks):
            def make(group: list[str] = group) -> list[tuple[int, Update]] | UpdateBatch:
                olds = [needs_old(n) for n in group]
                if diff is not None:  # in name order, the order the built-in layouts store (no reorder there)
                    batch = diff.batch([specs[n] for n in sorted(group)],
                                       {n: old_tensor(n) for n, o in zip(group, olds) if o})
                    if batch is not None:
                        return batch
                ch = diff.changes if diff is not None else changes
                return [(0, Update(specs[n], ch[n].new_bits, ch[n].positions, ch[n].old_bits,
                                   old_tensor(n) if o else None)) for n, o in zip(group, olds)]
            jobs.append((codec, make, index_of))
        return jobs

    def whole_jobs(self, specs: Mapping[str, TensorSpec], whole: Whole, mirror: Mirror,
                   object_bytes: int) -> list[Job]:
        """:meth:`dense_jobs` for the tensors :meth:`sparse_jobs` set aside, each into its own role's index."""
        jobs: list[Job] = []
        for role_index in {id(ix): ix for _, ix in whole}.values():
            jobs += self.dense_jobs(specs, [n for n, ix in whole if ix is role_index], mirror, role_index,
                                    object_bytes)
        return jobs

    def dense_jobs(self, specs: Mapping[str, TensorSpec], names: list[str], mirror: Mirror,
                   index_of: dict[str, list[Part]], object_bytes: int) -> list[Job]:
        """Whole tensors (views of the mirror) with the anchor codec; a tensor larger than an object is cut
        into flat slices."""
        items: list[tuple[int, tuple[str, int, int]]] = []
        for name in names:
            spec = specs[name]
            item = spec.bits_dtype.itemsize
            step = max(1, object_bytes // item)
            if spec.numel <= step:
                items.append((spec.numel * item, (name, 0, spec.numel)))
                continue
            for offset in range(0, spec.numel, step):
                numel = min(step, spec.numel - offset)
                items.append((numel * item, (name, offset, numel)))

        def make(group: list[tuple[str, int, int]]) -> list[tuple[int, Update]]:
            out = []
            for name, offset, numel in group:
                spec = specs[name]
                bits = mirror.host_view(name)
                if numel == spec.numel:
                    out.append((0, Update(spec, bits)))
                else:
                    out.append((offset, Update(TensorSpec(name, spec.dtype, (numel,)), bits[offset:offset + numel])))
            return out

        return [(self.anchor_codec, lambda group=group: make(group), index_of)
                for group in groups(items, object_bytes)]

    def anchor_streaming(self, specs: Mapping[str, TensorSpec]) -> tuple[int, int]:
        """``(object bytes, objects in flight)`` for whole tensors: small enough objects, few enough at once
        that an anchor streams through a bounded amount of memory (about a tenth of the model; at least two
        objects, so that one encodes while another uploads)."""
        total = sum(s.nbytes for s in specs.values())
        object_bytes = min(self.max_object_bytes, max(ANCHOR_OBJECT_MIN, min(ANCHOR_OBJECT_MAX, total // 64)))
        inflight = max(min(2, self.max_workers), min(self.max_workers, int(0.1 * total) // max(1, object_bytes)))
        return object_bytes, inflight


def groups(items: list[tuple[int, Any]], limit: int, breaks: Collection[Any] = ()) -> Iterator[list[Any]]:
    """Runs of ``items`` (``(bytes, item)``, in order) of about ``limit`` bytes; an item in ``breaks`` starts a
    new run."""
    group: list[Any] = []
    size = 0
    for nbytes, item in items:
        if group and (size + nbytes > limit or item in breaks):
            yield group
            group, size = [], 0
        group.append(item)
        size += nbytes
    if group:
        yield group
