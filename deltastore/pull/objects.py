"""Fetching and decoding a version's objects.

:func:`object_index` maps each object of a role to the ``(tensor, part)``
pairs it holds (one pass over the manifest, not one per object).
:func:`stream_objects` yields objects in order while downloading a bounded
number ahead, so a pull holds a few encoded objects at a time, never all of
them. :func:`decode_object` decodes one object with the codec named in the
manifest and validates every update (names, counts, dtypes, position order
and range) before anything uses it; codec failures become
:class:`CorruptObjectError` naming the object; :func:`decode_object_into`
writes a dense object's tensors straight where they go when its codec can.
:func:`decode_sparse_object`
does the same for a delta's object as flat batches (one check pass per
batch, no object per tensor).
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from .. import segments
from .._memo import LastList
from ..codecs import (Codec, InPlace, OldBits, TensorSpec, Update, UpdateBatch, WrittenBatch, get_codec,
                      read_old_bits, write_in_place)
from ..codecs.base import RowSpecs, decode_batched, decode_placed
from ..errors import ChecksumMismatchError, CorruptObjectError, ManifestError
from ..manifest import Manifest, Part, Role, RowLayout, TensorRecord
from ..store import DeltaStore
from ..tensors import DTYPES

Pairs = list[tuple[TensorRecord, Part]]


class RowPairs(list):  # type: ignore[type-arg]
    """The ``(tensor, part)`` pairs of one object (:data:`Pairs`), every part a whole tensor, with ``rows``
    (int64): each pair's row in its manifest's tensors (:attr:`Manifest.row_layout`)."""

    __slots__ = ("rows",)

    def __init__(self, pairs: Iterable[tuple[TensorRecord, Part]], rows: np.ndarray):
        super().__init__(pairs)
        self.rows = rows

#: the record and the part of a ``(tensor, part)`` pair, as C-level getters for passes over many pairs
record_of, part_of = operator.itemgetter(0), operator.itemgetter(1)
_NUMEL, _BITS_DTYPE = operator.attrgetter("numel"), operator.attrgetter("spec.bits_dtype")
_SPEC, _NAME = operator.attrgetter("spec"), operator.attrgetter("name")
_FIRST, _OBJECT, _OFFSET = operator.itemgetter(0), operator.attrgetter("object"), operator.attrgetter("offset")


def object_index(manifest: Manifest, role: Role) -> dict[int, Pairs]:
    """``object index -> [(tensor, part), ...]`` (manifest order) for every object ``role`` reads."""
    tensors = manifest.tensors
    held = list(map(operator.attrgetter(role), tensors))
    if set(map(len, held)) <= {0, 1}:  # no tensor in parts (the usual version): C-level passes
        recs = list(itertools.compress(tensors, held))
        parts = list(map(_FIRST, itertools.compress(held, held)))
        objs = list(map(_OBJECT, parts))
        if len(set(objs)) == 1:
            if manifest.row_layout is None:
                return {objs[0]: list(zip(recs, parts))}
            # parsed from plain columns: every part is its whole tensor, and the rows let a decoder skip
            # passes per tensor (decode_sparse_object)
            rows = np.fromiter(itertools.compress(itertools.count(), held), dtype=np.int64, count=len(recs))
            return {objs[0]: RowPairs(zip(recs, parts), rows)}
        pairs = zip(objs, zip(recs, parts))
    else:
        pairs = ((p.object, (t, p)) for t, ps in zip(tensors, held) for p in ps)
    out: dict[int, Pairs] = {}
    for i, pair in pairs:
        out.setdefault(i, []).append(pair)
    return dict(sorted(out.items()))


def stream_objects(store: DeltaStore, manifest: Manifest, indices: Sequence[int], *, workers: int,
                   ahead: int) -> Iterator[tuple[int, bytes]]:
    """``(index, verified bytes)`` for each object in ``indices``, in order, at most ``ahead`` downloaded early."""
    if not indices:
        return
    if len(indices) == 1 or workers < 2 or ahead < 1:
        for i in indices:
            rec = manifest.objects[i]
            yield i, store.get_object(rec.digest, rec.size)
        return
    pool = ThreadPoolExecutor(min(workers, len(indices)), thread_name_prefix="deltastore-get")
    queue: deque[tuple[int, Future[bytes]]] = deque()
    todo = iter(indices)

    def submit() -> None:
        i = next(todo, None)
        if i is not None:
            rec = manifest.objects[i]
            queue.append((i, pool.submit(store.get_object, rec.digest, rec.size)))

    try:
        for _ in range(max(1, ahead)):
            submit()
        while queue:
            i, fut = queue.popleft()
            data = fut.result()
            submit()
            yield i, data
            del data
    finally:
        for _, fut in queue:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


class PartReader:
    """An :data:`OldBits` seen from inside parts: positions relative to each part's offset.

    ``whole``: the names whose part is their whole tensor; only those are offered for writing in place
    (:func:`~deltastore.codecs.write_in_place`). ``parts=None``: every part is its whole tensor (the usual
    object; nothing is kept per tensor).
    """

    def __init__(self, old: OldBits, parts: dict[str, Part] | None, whole: frozenset[str] = frozenset()):
        self.old, self.parts, self.whole = old, parts, whole
        self.shifted = parts is not None and any(p.offset for p in parts.values())

    def __call__(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        if self.parts is None:
            return self.old(name, positions)
        p = self.parts[name]
        if positions is None:
            whole = self.old(name, None)
            return whole if p.offset == 0 and whole.numel() == p.numel else whole[p.offset:p.offset + p.numel]
        return self.old(name, positions + p.offset if p.offset else positions)

    def many(self, names: list[str], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
        if self.shifted:
            offsets = np.fromiter((self.parts[n].offset for n in names), dtype=np.int64, count=len(names))
            positions = positions + torch.from_numpy(np.repeat(offsets, np.diff(bounds)))
        return read_old_bits(self.old, names, positions, bounds)

    def in_place(self, names: list[str], bounds: np.ndarray) -> InPlace | None:
        return write_in_place(self.old, names, bounds) if self.parts is None or self.whole.issuperset(names) \
            else None


@contextmanager
def _typed_errors(manifest: Manifest, index: int, codec: Codec) -> Iterator[None]:
    """A codec's failure on object ``index`` as :class:`CorruptObjectError` naming it (typed errors pass)."""
    try:
        yield
    except (CorruptObjectError, ChecksumMismatchError):
        raise
    except Exception as e:  # a codec bug or hostile content must not escape untyped
        digest = manifest.objects[index].digest
        raise CorruptObjectError(f"version {manifest.step}: codec {codec.codec_id!r} failed on object "
                                 f"{digest}: {e!r}", digest=digest) from e


def decode_object_into(manifest: Manifest, index: int, data: bytes, pairs: Pairs,
                       dests: Sequence[torch.Tensor]) -> bool:
    """Decode object ``index`` of ``manifest`` (whole tensors only, ``pairs`` order) straight into ``dests``
    when its codec can place its output (:meth:`~deltastore.codecs.Codec.decode_into`); False, with
    nothing written, when it cannot. Raises :class:`CorruptObjectError` naming the object when it is
    bad (``dests`` may then hold part of it)."""
    codec = get_codec(manifest.objects[index].codec)
    with _typed_errors(manifest, index, codec):
        return decode_placed(codec, data, [t.spec for t, _ in pairs], dests)


def decode_object(manifest: Manifest, index: int, data: bytes, pairs: Pairs, role: Role,
                  old: OldBits | None) -> list[tuple[TensorRecord, Part, Update]]:
    """Decode object ``index`` of ``manifest`` and validate every update it holds."""
    rec = manifest.objects[index]
    codec = get_codec(rec.codec)
    names = [t.name for t, _ in pairs]
    offsets = {t.name: p for t, p in pairs}
    if len(offsets) != len(names):
        raise ManifestError(f"version {manifest.step}: object {index} holds two parts of one tensor")
    wholes = {t.name: p.offset == 0 and p.numel == t.numel for t, p in pairs}
    specs = {t.name: t.spec if wholes[t.name] else TensorSpec(t.name, DTYPES[t.dtype], (p.numel,)) for t, p in pairs}
    records = {t.name: t for t, _ in pairs}
    with _typed_errors(manifest, index, codec):
        decoded = codec.decode(data, list(specs.values()), PartReader(old, offsets) if old is not None else None)
    if len(decoded) != len(names) or not all(n in decoded for n in names):
        raise CorruptObjectError(f"version {manifest.step}: object {rec.digest} decoded tensors "
                                 f"{sorted(decoded)[:5]}, manifest expects {names[:5]}", digest=rec.digest)
    out = []
    batch: list[tuple[TensorRecord, Update]] = []  # sparse updates whose positions are checked in one pass
    multi = role == "full" or codec.dense
    for name, u in decoded.items():  # in the codec's order: its tensors' arrays often lie back to back
        t, p, spec, whole = records[name], offsets[name], specs[name], wholes[name]
        part_rec = t if whole else t._replace(shape=spec.shape)
        dense = multi or u.positions is None
        if dense:
            check_update(u, part_rec, dense=True, step=manifest.step, expected=u.count)
        else:
            expected = u.count if len(getattr(t, role)) > 1 else (t.diff_changed if role == "diff" else t.changed)
            _check_sparse_shape(u, spec, t.name, manifest.step, expected)
            if u.count:
                batch.append((part_rec, u))
        out.append((t, p, u))
    if batch:
        bounds = segments.bounds_of([u.count for _, u in batch])
        pos = segments.joined([u.positions.contiguous() for _, u in batch])
        numels = np.fromiter((r.numel for r, _ in batch), dtype=np.int64, count=len(batch))
        bad = segments.check_positions(pos, bounds, numels)
        if bad >= 0:
            r, u = batch[bad]
            check_update(u, r, dense=False, step=manifest.step, expected=u.count)  # names the problem
            raise CorruptObjectError(f"version {manifest.step}, tensor {r.name!r}: positions are not strictly "
                                     f"increasing in [0, {r.numel})")
    return out


def _order_of(names: list[str]) -> list[int] | None:
    """The indices of ``names`` in name order, or None when they are in it already (or fewer than two)."""
    order = sorted(range(len(names)), key=names.__getitem__)
    return None if len(order) < 2 or order == list(range(len(order))) else order


#: a follower's objects hold the same tensors (the same name objects, from one parsed layout) step after step
_name_order = LastList(_order_of)


def decode_sparse_object(manifest: Manifest, index: int, data: bytes, pairs: Pairs, role: Role,
                         old: OldBits | None
                         ) -> tuple[list[UpdateBatch | WrittenBatch], list[tuple[TensorRecord, Part, Update]]]:
    """Decode object ``index`` of a delta or differential (``role``) and validate it, as flat batches.

    Returns the batches of the tensors the object holds whole (positions in
    the tensor, counts checked against the manifest; a :class:`WrittenBatch`
    for those its decoder wrote into ``old``'s tensors itself, their checksums
    left to the receiver), and ``(tensor, part, update)`` for every tensor it
    holds a part of (positions in the part, joined by the caller), or for
    everything when the codec is dense (:func:`decode_object`). Raises as
    :func:`decode_object`. ``pairs`` from :func:`object_index` with rows
    (:class:`RowPairs`) are prepared from the manifest's row layout: arrays,
    no pass per tensor, and a decoder that writes them all in place is
    checked the same way.
    """
    rec = manifest.objects[index]
    codec = get_codec(rec.codec)
    if codec.dense:
        return [], decode_object(manifest, index, data, pairs, role, old)
    layout = manifest.row_layout
    if isinstance(pairs, RowPairs) and layout is not None:
        return _decode_rows(manifest, index, data, pairs, layout, role, old, codec)
    recs = list(map(record_of, pairs))
    names = list(map(_NAME, recs))
    order = _name_order(names)
    if order is not None:  # the pairs in name order, the order the built-in codecs decode in (a hint only:
        # decoded batches in any other order are matched by name below)
        take = operator.itemgetter(*order)
        pairs, recs, names = list(take(pairs)), list(take(recs)), list(take(names))
    held_parts = list(map(part_of, pairs))
    records = dict(zip(names, pairs))
    if len(records) != len(pairs):
        raise ManifestError(f"version {manifest.step}: object {index} holds two parts of one tensor")
    # the usual case, every part a whole tensor: C-level passes, and none per tensor below asks again
    all_whole = not any(map(_OFFSET, held_parts)) and list(map(_NUMEL, held_parts)) == list(map(_NUMEL, recs))
    whole = [True] * len(pairs) if all_whole else [p.offset == 0 and p.numel == t.numel for t, p in pairs]
    specs = list(map(_SPEC, recs)) if all_whole else [
        t.spec if w else TensorSpec(t.name, DTYPES[t.dtype], (p.numel,)) for (t, p), w in zip(pairs, whole)]
    reader = None if old is None else PartReader(old, None) if all_whole else PartReader(
        old, dict(zip(names, map(part_of, pairs))), frozenset(itertools.compress(names, whole)))
    with _typed_errors(manifest, index, codec):
        batches = decode_batched(codec, data, specs, reader)
    return _checked_batches(manifest, index, codec, batches, pairs, records, all_whole, whole, specs, role)


def _decode_rows(manifest: Manifest, index: int, data: bytes, pairs: RowPairs, layout: RowLayout, role: Role,
                 old: OldBits | None, codec: Codec
                 ) -> tuple[list[UpdateBatch | WrittenBatch], list[tuple[TensorRecord, Part, Update]]]:
    """:func:`decode_sparse_object` of whole tensors at known rows of ``manifest``'s layout: the specs in name
    order as :class:`RowSpecs`, and a decoder's one :class:`WrittenBatch` of exactly those specs checked
    against the count column; anything else is checked as :func:`decode_sparse_object` checks it."""
    order = np.argsort(layout.name_rank[pairs.rows], kind="stable")
    rows = pairs.rows[order]
    specs = RowSpecs(list(map(layout.specs.__getitem__, rows.tolist())), rows, layout.names,
                     layout.numel_array[rows], True, layout.one_dtype)
    with _typed_errors(manifest, index, codec):
        batches = decode_batched(codec, data, specs, None if old is None else PartReader(old, None))
    b = batches[0] if isinstance(batches, list) and len(batches) == 1 else None
    if isinstance(b, WrittenBatch) and len(b.specs) == len(specs) and all(map(operator.is_, b.specs, specs)):
        expected = manifest.count_column(role)[rows]
        _check_counts_of(b.bounds, expected, lambda i: manifest.tensors[int(rows[i])].name, manifest.step)
        if not bool(b.target.done.all()):
            raise CorruptObjectError(f"version {manifest.step}: codec {codec.codec_id!r} returned tensors it "
                                     "did not finish writing in place", digest=manifest.objects[index].digest)
        return [WrittenBatch(specs, b.bounds, b.target)], []
    ordered = list(map(pairs.__getitem__, order.tolist()))
    records = dict(zip(map(_NAME, map(record_of, ordered)), ordered))
    return _checked_batches(manifest, index, codec, batches, ordered, records, True, [True] * len(ordered), specs,
                            role)


def _checked_batches(manifest: Manifest, index: int, codec: Codec, batches: object, pairs: Pairs,
                     records: dict[str, tuple[TensorRecord, Part]], all_whole: bool, whole: list[bool],
                     specs: list[TensorSpec], role: Role
                     ) -> tuple[list[UpdateBatch | WrittenBatch], list[tuple[TensorRecord, Part, Update]]]:
    """What a decoder returned for the ``pairs`` (in name order; ``records``: by name; ``whole``: each part
    its whole tensor; ``specs``: what the decoder was given) checked against the manifest: the batches of
    whole tensors, and ``(tensor, part, update)`` of the parts (:func:`decode_sparse_object`)."""
    rec = manifest.objects[index]
    names = list(records)
    if not isinstance(batches, list) or not all(isinstance(b, (UpdateBatch, WrittenBatch)) for b in batches):
        raise CorruptObjectError(f"version {manifest.step}: codec {codec.codec_id!r} returned "
                                 f"{type(batches).__name__}, not a list of UpdateBatch", digest=rec.digest)
    decoded = [list(map(_NAME, b.specs)) for b in batches]
    in_order = len(decoded) == 1 and decoded[0] == names  # one batch in the manifest's order: the usual case
    if not in_order and (sum(map(len, decoded)) != len(records)
                         or not records.keys() == set(itertools.chain.from_iterable(decoded))):
        got = sorted(set(itertools.chain.from_iterable(decoded)))
        raise CorruptObjectError(f"version {manifest.step}: object {rec.digest} decoded tensors "
                                 f"{got[:5]}, manifest expects {sorted(records)[:5]}", digest=rec.digest)
    whole_batches: list[UpdateBatch | WrittenBatch] = []
    parts: list[tuple[TensorRecord, Part, Update]] = []
    for b, b_names in zip(batches, decoded):
        if b_names == names:  # the object's tensors in the manifest's order (one batch: the usual case)
            held, wholes = pairs, whole
        else:
            held = list(map(records.__getitem__, b_names))
            wholes = [True] * len(held) if all_whole else [p.offset == 0 and p.numel == t.numel for t, p in held]
        if isinstance(b, WrittenBatch):  # in the target already, positions checked as they were written
            if not all(wholes):
                raise CorruptObjectError(f"version {manifest.step}: codec {codec.codec_id!r} wrote a part of a "
                                         "tensor in place", digest=rec.digest)
            _check_counts(b.bounds, held, wholes, role, manifest.step)
            if not bool(b.target.done.all()):
                raise CorruptObjectError(f"version {manifest.step}: codec {codec.codec_id!r} returned tensors it "
                                         "did not finish writing in place", digest=rec.digest)
            whole_batches.append(WrittenBatch(specs if held is pairs else list(map(_SPEC, map(record_of, held))),
                                              b.bounds, b.target))
            continue
        _check_batch(b, held, wholes, role, manifest.step)
        if all(wholes):
            whole_batches.append(UpdateBatch([t.spec for t, _ in held], b.positions.contiguous(), b.bounds,
                                             b.bits.contiguous()))
        else:
            parts += [(t, p, u) for (t, p), u in zip(held, b.updates())]
    return whole_batches, parts


def _check_batch(b: UpdateBatch, held: list[tuple[TensorRecord, Part]], wholes: list[bool], role: Role,
                 step: int) -> None:
    """A decoded batch's arrays, counts and positions against the manifest (:class:`CorruptObjectError`)."""
    first = held[0][0].name if held else "?"
    bits, pos, bounds = b.bits, b.positions, b.bounds
    if not isinstance(bits, torch.Tensor) or not isinstance(pos, torch.Tensor):
        raise CorruptObjectError(f"version {step}, tensor {first!r}: a decoded batch holds no tensors")
    if not isinstance(bounds, np.ndarray) or bounds.dtype != np.int64 or bounds.shape != (len(held) + 1,):
        raise CorruptObjectError(f"version {step}, tensor {first!r}: a decoded batch has malformed bounds")
    if bits.dim() != 1 or pos.dtype != torch.int64 or pos.dim() != 1 or pos.numel() != bits.numel():
        raise CorruptObjectError(f"version {step}, tensor {first!r}: positions and bits disagree "
                                 f"({pos.numel()} vs {bits.numel()})")
    recs = list(map(record_of, held))
    if set(map(_BITS_DTYPE, recs)) - {bits.dtype}:
        t = next(t for t in recs if t.spec.bits_dtype != bits.dtype)
        raise CorruptObjectError(f"version {step}, tensor {t.name!r}: decoded bits are {bits.dtype}")
    if int(bounds[-1]) != bits.numel():
        raise CorruptObjectError(f"version {step}, tensor {first!r}: a decoded batch has malformed bounds")
    _check_counts(bounds, held, wholes, role, step)
    numels = np.fromiter(map(_NUMEL, map(part_of, held)), dtype=np.int64, count=len(held))
    bad = segments.check_positions(pos.contiguous(), bounds, numels)  # type: ignore[arg-type]
    if bad >= 0:
        raise CorruptObjectError(f"version {step}, tensor {held[bad][0].name!r}: positions are not strictly "
                                 f"increasing in [0, {int(numels[bad])})")


def _check_counts(bounds: np.ndarray, held: list[tuple[TensorRecord, Part]], wholes: list[bool], role: Role,
                  step: int) -> None:
    """A decoded batch's ``bounds`` (one count per tensor of ``held``) against the manifest's counts of the
    tensors held whole (:class:`CorruptObjectError`)."""
    recs = list(map(record_of, held))
    attr = "diff_changed" if role == "diff" else "changed"
    if all(wholes):
        expected = np.fromiter(map(operator.attrgetter(attr), recs), dtype=np.int64, count=len(held))
    else:
        expected = np.fromiter((getattr(t, attr) if whole else -1 for t, whole in zip(recs, wholes)),
                               dtype=np.int64, count=len(held))
    _check_counts_of(bounds, expected, lambda i: recs[i].name, step)


def _check_counts_of(bounds: object, expected: np.ndarray, name_of: Callable[[int], str], step: int) -> None:
    """A decoded batch's ``bounds`` (one count per entry of ``expected``) well formed and each count the
    expected one (``-1``: any); :class:`CorruptObjectError` naming tensor ``name_of(i)`` otherwise."""
    first = name_of(0) if len(expected) else "?"
    if not isinstance(bounds, np.ndarray) or bounds.dtype != np.int64 or bounds.shape != (len(expected) + 1,):
        raise CorruptObjectError(f"version {step}, tensor {first!r}: a decoded batch has malformed bounds")
    counts = np.diff(bounds)
    if int(bounds[0]) != 0 or bool((counts < 0).any()):
        raise CorruptObjectError(f"version {step}, tensor {first!r}: a decoded batch has malformed bounds")
    off = np.flatnonzero((counts != expected) & (expected >= 0))
    if off.size:
        k = int(off[0])
        raise CorruptObjectError(f"version {step}, tensor {name_of(k)!r}: {int(counts[k])} changed elements "
                                 f"decoded, manifest says {int(expected[k])}")


def _check_sparse_shape(u: Update, spec: TensorSpec, name: str, step: int, expected: int) -> None:
    bits, p = u.bits, u.positions
    assert p is not None
    if bits.dtype != spec.bits_dtype or bits.dim() != 1:
        raise CorruptObjectError(f"version {step}, tensor {name!r}: decoded bits are {bits.dtype}{tuple(bits.shape)}")
    n = bits.numel()
    if p.dtype != torch.int64 or p.dim() != 1 or p.numel() != n:
        raise CorruptObjectError(f"version {step}, tensor {name!r}: positions and bits disagree ({p.numel()} vs {n})")
    if n != expected:
        raise CorruptObjectError(f"version {step}, tensor {name!r}: {n} changed elements decoded, "
                                 f"manifest says {expected}")


def check_update(u: Update, rec: TensorRecord, *, dense: bool, step: int, expected: int) -> None:
    """Validate a decoded update against its manifest record; :class:`CorruptObjectError` if off."""
    spec = rec.spec
    where = f"version {step}, tensor {rec.name!r}"
    if u.bits.dtype != spec.bits_dtype or u.bits.dim() != 1:
        raise CorruptObjectError(f"{where}: decoded bits are {u.bits.dtype}{tuple(u.bits.shape)}")
    if dense or u.positions is None:
        if u.positions is not None or u.count != spec.numel:
            raise CorruptObjectError(f"{where}: dense update has {u.count} of {spec.numel} elements")
        return
    p = u.positions
    if p.dtype != torch.int64 or p.dim() != 1 or p.numel() != u.count:
        raise CorruptObjectError(f"{where}: positions and bits disagree ({p.numel()} vs {u.count})")
    if u.count != expected:
        raise CorruptObjectError(f"{where}: {u.count} changed elements decoded, manifest says {expected}")
    if u.count:
        if int(p[0]) < 0 or int(p[-1]) >= spec.numel:
            raise CorruptObjectError(f"{where}: position out of range [0, {spec.numel})")
        if u.count > 1 and not bool((p[1:] > p[:-1]).all()):
            raise CorruptObjectError(f"{where}: positions are not strictly increasing")
