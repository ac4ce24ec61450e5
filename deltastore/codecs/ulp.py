"""``ulp``: gap-coded positions + zig-zag ulp steps of the values, byte-split, zstd.

The value of a changed element is stored as its step from the receiver's old
value in the order-preserving integer image of the bits (one ulp = 1; see
:func:`deltastore.codecs._bits.ordered`), so it is exact for every bit
pattern: sign flips, ±0, subnormals, inf and NaN payloads. Needs the old bits
at the changed positions (``receiver_needs = "old_bits"``).

Object layout (safetensors, tensors in name order, see ``docs/codecs.md``):

* ``header`` (uint8): LEB128: each tensor's changed count, the uncompressed
  position stream length, the number of byte planes ``P``;
* ``positions``: as in ``zstd``;
* ``plane0`` .. ``plane{P-1}`` (uint8): zstd frames; plane ``j`` holds byte
  ``j`` (little-endian) of ``zigzag(step) - 1`` for every changed element in order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import CorruptObjectError
from ..kernels import bitstream as K
from ..kernels.parallel import each
from . import _bits as B
from ._common import (MANTISSA_BITS, ZstdLevel, position_bits, check_object, encode_positions, names_digest, np_bits,
                      pack_meta, position_stream, read_header, read_positions, sorted_updates,
                      to_torch_bits, u8, unpack_frames, zstd_compress, zstd_decompress)
from .base import (Codec, InPlace, OldBits, RowSpecs, TensorSpec, Update, UpdateBatch, WrittenBatch, copy_specs,
                   read_old_bits, spec_names, write_in_place)


_DTYPE = operator.attrgetter("dtype")


def _kinds(specs: Sequence[TensorSpec]) -> list[tuple[bool, list[int]]]:
    """Indices of ``specs`` grouped by (bits dtype, is float): one vectorised pass per group (usually one)."""
    if (isinstance(specs, RowSpecs) and specs.one_dtype) or len(set(map(_DTYPE, specs))) == 1:  # the usual one
        return [(specs[0].dtype in MANTISSA_BITS, list(range(len(specs))))]
    groups: dict[tuple[Any, bool], list[int]] = {}
    for i, s in enumerate(specs):
        groups.setdefault((s.bits_dtype, s.dtype in MANTISSA_BITS), []).append(i)
    return [(f, idxs) for (_, f), idxs in groups.items()]


def _take(specs: list[TensorSpec], idxs: list[int]) -> list[TensorSpec]:
    """``specs[i]`` for each of ``idxs`` (a group of :func:`_kinds`; all of them: a copy, no pass)."""
    return copy_specs(specs) if len(idxs) == len(specs) else [specs[i] for i in idxs]


def _elements(bounds: np.ndarray, idxs: Sequence[int]) -> np.ndarray:
    """Indices, in flat arrays laid out by ``bounds`` (segment ``i`` is ``bounds[i]:bounds[i + 1]``), of the
    elements of segments ``idxs`` in turn: one vectorised pass, whatever the segment count."""
    idx = np.asarray(idxs, dtype=np.int64)
    starts, lens = bounds[idx], bounds[idx + 1] - bounds[idx]
    at = np.cumsum(lens) - lens  # where each segment's elements begin in the result
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - at, lens)


#: streams below this many bytes in all are compressed on the calling thread
_INLINE_BYTES = 1 << 18


class UlpCodec(ZstdLevel, Codec):
    """Positions as in ``zstd``; values as byte-split zig-zag ulp steps. Config: ``level`` (default 1)."""

    codec_id = "ulp"
    format_version = "1.0"
    receiver_needs = "old_bits"

    def estimate_size(self, spec: TensorSpec, changed: int) -> int:
        # positions as zstd's; an RL step's ulp steps cost ~0.35 B each after zstd (86-92 % are +-1)
        return int(changed * (1.15 * position_bits(spec.numel, changed) / 8 + 0.35)) + 64

    def encode(self, updates: Sequence[Update]) -> bytes:
        ups = sorted_updates(updates)
        for u in ups:
            if u.positions is None:
                raise ValueError("ulp encodes sparse updates only")
            if u.old_bits is None or u.old_bits.numel() != u.count:
                raise ValueError(f"ulp needs the old bits of {u.spec.name!r} at the changed positions")
        specs = [u.spec for u in ups]
        counts = np.array([u.count for u in ups], dtype=np.int64)

        def arrays(idxs: list[int]) -> tuple[np.ndarray, np.ndarray]:
            return (np.concatenate([np_bits(ups[i].bits).reshape(-1) for i in idxs]),
                    np.concatenate([np_bits(ups[i].old_bits).reshape(-1) for i in idxs]))  # type: ignore[arg-type]

        stream = encode_positions([u.positions.numpy() for u in ups if u.positions is not None])
        return self._pack(specs, counts, stream, arrays)

    def encode_batch(self, batch: UpdateBatch) -> bytes:
        """:meth:`encode` of the batch's tensors from its flat arrays: the same bytes, with no per-tensor work
        beyond putting the tensors in name order (one copy per array when they are not)."""
        n = len(batch.specs)
        total = int(batch.bounds[-1]) if n else 0
        if batch.old_bits is None or batch.old_bits.numel() != total or batch.bits.numel() != total \
                or batch.positions.numel() != total:
            raise ValueError("ulp needs the old bits of every tensor at the changed positions")
        names = [s.name for s in batch.specs]
        if any(a >= b for a, b in zip(names, names[1:])):  # into name order: one copy per array
            batch = batch.subset(sorted(range(n), key=names.__getitem__))
        specs, bounds = batch.specs, np.asarray(batch.bounds, dtype=np.int64)
        pos, new, before = batch.positions.numpy(), np_bits(batch.bits), np_bits(batch.old_bits)
        counts = np.diff(bounds)

        def arrays(idxs: list[int]) -> tuple[np.ndarray, np.ndarray]:
            if len(idxs) == n:
                return new, before
            e = _elements(bounds, idxs)
            return new[e], before[e]

        return self._pack(specs, counts, K.gap_stream_flat(pos, bounds), arrays)

    def _pack(self, specs: list[TensorSpec], counts: np.ndarray, stream: bytes,
              arrays: Callable[[list[int]], tuple[np.ndarray, np.ndarray]]) -> bytes:
        """The object of ``specs`` (name order) with ``counts`` changes each and their position ``stream``;
        ``arrays(idxs)`` gives the new and old bits of the elements of tensors ``idxs`` in turn."""
        # one vectorised pass per kind of element (usually one: every tensor bf16), not per tensor
        kinds = _kinds(specs)
        bounds = np.zeros(len(specs) + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        if len(kinds) == 1:
            planes = K.step_planes(*arrays(kinds[0][1]), kinds[0][0])
        else:  # each kind's planes, laid into one set as wide as the widest kind's
            of_kind = [(idxs, K.step_planes(*arrays(idxs), f)) for f, idxs in kinds]
            planes = np.zeros((max(p.shape[0] for _, p in of_kind), int(bounds[-1])), np.uint8)
            for idxs, p in of_kind:
                planes[:p.shape[0], _elements(bounds, idxs)] = p
        nplanes = planes.shape[0]
        header = B.uvarint_encode(np.concatenate([counts.astype(np.uint64),
                                                  np.array([len(stream), nplanes], dtype=np.uint64)]))

        def frame(j: int) -> bytes:
            return zstd_compress(stream if j == 0 else planes[j - 1], self.level)

        # the streams compress on the kernel threads at once (zstd releases the GIL); small ones (a tensor
        # auto weighs alone) here, where a hand-off to another thread costs more than the compression
        frames = each(1 + nplanes, frame) if len(stream) + planes.size > _INLINE_BYTES else \
            [frame(j) for j in range(1 + nplanes)]
        tensors = {"header": u8(header), "positions": u8(frames[0])}
        for j in range(nplanes):
            tensors[f"plane{j}"] = u8(frames[1 + j])
        return pack_meta(tensors, self.codec_id, self.format_version,
                         {"deltastore.names": names_digest([s.name for s in specs])})

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        return {u.spec.name: u for batch in self._decode(data, specs, old, in_place=False)
                for u in batch.updates()}  # type: ignore[union-attr]

    def decode_batch(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None
                     ) -> list[UpdateBatch | WrittenBatch]:
        return self._decode(data, specs, old, in_place=True)

    def _decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None, *, in_place: bool
                ) -> list[UpdateBatch | WrittenBatch]:
        if old is None:
            raise ValueError("ulp decoding needs the receiver's old bits (old(name, positions))")
        raw, meta = unpack_frames(data, self.codec_id)
        specs = check_object(meta, specs, self.codec_id)
        counts, (raw_len, nplanes) = read_header(raw, specs, self.codec_id, 2)
        if nplanes > 8:
            raise CorruptObjectError(f"ulp: {nplanes} byte planes")
        total = sum(counts)
        planes = np.empty((nplanes, total), np.uint8)
        frames = []
        for j in range(nplanes):
            key = f"plane{j}"
            if key not in raw:
                raise CorruptObjectError(f"ulp: object lacks {key}")
            frames.append(raw[key])
        if total and nplanes == 0:
            raise CorruptObjectError("ulp: changes without value planes")

        def unpack_planes(js: range | None = None) -> None:  # planes js (all of them by default)
            for j in range(len(frames)) if js is None else js:
                planes[j] = np.frombuffer(zstd_decompress(frames[j], total, f"ulp plane{j}"), np.uint8)

        kinds = _kinds(specs)
        counts_a = np.asarray(counts, np.int64)
        if in_place and total:  # each kind's tensors, if the receiver lets them: decode, step and write in one pass
            kind_bounds = [np.concatenate([[0], np.cumsum(counts_a[idxs])]).astype(np.int64) for _, idxs in kinds]
            targets = [write_in_place(old, spec_names(_take(specs, idxs)), b)
                       for (_, idxs), b in zip(kinds, kind_bounds)]
            if all(t is not None for t in targets):
                return self._write_in_place(raw, specs, counts_a, raw_len, unpack_planes, planes, kinds, kind_bounds,
                                            targets)  # type: ignore[arg-type]
        # the value planes decompress on another thread while this one decodes the positions (zstd and the
        # kernels release the GIL)
        _, (flat, bounds) = each(2, lambda k: unpack_planes() if k == 0 else
                                 read_positions(raw, specs, counts, raw_len, self.codec_id))
        positions = torch.from_numpy(flat)
        out: list[UpdateBatch | WrittenBatch] = []
        for f, idxs in kinds:
            if len(kinds) == 1:
                pos, b, steps = positions, bounds, planes
            else:  # several element kinds in one object: each kind's elements taken out of the concatenation
                where = _elements(bounds, idxs)
                pos, steps = positions[torch.from_numpy(where)], planes[:, where]
                b = np.zeros(len(idxs) + 1, np.int64)
                np.cumsum(np.diff(bounds)[idxs], out=b[1:])
            names = [s.name for s in _take(specs, idxs)]
            try:
                before = np_bits(read_old_bits(old, names, pos, b))
            except ValueError as e:
                raise CorruptObjectError(f"ulp: {e}") from e
            bits, bad = K.apply_steps(before, steps, f)
            if bad >= 0:
                raise CorruptObjectError(f"ulp: a decoded value is out of range for its {before.dtype} dtype")
            out.append(UpdateBatch(_take(specs, idxs), pos, b, to_torch_bits(bits, specs[idxs[0]])))
        return out

    def _write_in_place(self, raw: dict[str, memoryview], specs: list[TensorSpec], counts: np.ndarray, raw_len: int,
                        unpack_planes: Callable[[range | None], None], planes: np.ndarray,
                        kinds: list[tuple[bool, list[int]]], kind_bounds: list[np.ndarray],
                        targets: list[InPlace]) -> list[UpdateBatch | WrittenBatch]:
        """The object's changes written into the receiver's tensors (``targets``: one per element kind, its
        tensors' counts laid out by ``kind_bounds``) by
        :class:`deltastore.kernels.bitstream.StepsInPlace`: the value planes and the position stream
        decompressed on two threads at once (the first plane, the largest, on one; the stream and the
        others on the other), then per kind one pass over the stream that reads each gap,
        steps the value there and writes it back, on every kernel thread."""
        stream: list[bytes] = []

        def second() -> None:  # the position stream, then the planes above the first (usually one, small)
            stream.append(position_stream(raw, counts.tolist(), raw_len, self.codec_id))
            unpack_planes(range(1, planes.shape[0]))

        each(2, lambda k: unpack_planes(range(min(1, planes.shape[0]))) if k == 0 else second())
        gaps = np.frombuffer(stream[0], np.uint8)
        out: list[UpdateBatch | WrittenBatch] = []
        for (f, idxs), b, target in zip(kinds, kind_bounds, targets):
            slot = None
            if len(kinds) > 1:  # the other kinds' segments are read past
                slot = np.full(len(specs), -1, np.int64)
                slot[idxs] = np.arange(len(idxs))
            try:
                steps = K.StepsInPlace(target.pointers, target.lengths, target.keys, target.done, target.sums,
                                       counts, gaps, planes, target.dtype, f, slot)
            except ValueError as e:
                raise CorruptObjectError(f"ulp: {e}") from e
            target.undo = steps.undo  # before any write
            status, seg = steps.run()
            if status:
                what = {1: f"position stream holds fewer than {int(counts.sum())} positions",
                        2: "position stream holds a varint longer than 10 bytes", 3: "position beyond the tensor",
                        4: f"a decoded value is out of range for its {target.dtype} dtype",
                        5: "position stream has trailing bytes"}.get(status, f"in-place decode failed ({status})")
                raise CorruptObjectError(f"ulp: {what} (tensor {specs[seg].name!r} of the object)")
            out.append(WrittenBatch(_take(specs, idxs), b, target))
        return out
