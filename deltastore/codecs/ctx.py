"""``ctx``: positions and values coded in the context of the receiver's current tensor.

An element's chance to change between two RL steps depends strongly on its
current magnitude (its ulp is proportional to it). Both sides see the old
tensor, so the encoder splits it into up to ``buckets`` contiguous magnitude
ranges (exponent ranges chosen per tensor to minimise the coded size) and
codes, per bucket, *which* of the bucket's elements changed (their ranks in
the bucket, gap-coded with the cheapest Rice / Exp-Golomb parameter, or the
complement, or a bitmap), then the ulp step of each changed element (is
``|step| > 1``, the sign, and ``|step| - 2``), all with vectorised numpy. A
bucket in which nothing changed costs nothing, which is the common case for
large weights. The full byte layout is in ``docs/codecs.md``.

Decoding needs the whole old tensor: ``receiver_needs = "old_tensor"``; the
decoder calls ``old(name, None)``. The encoder reads ``Update.old_tensor``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..checksum import sparse_sum
from ..errors import CorruptObjectError
from ..kernels import ctx as K
from ..kernels import ranks as R
from . import _bits as B
from ._common import (MANTISSA_BITS, position_bits, check_object, names_digest, np_bits, pack_meta,
                      parallel_map, sorted_updates, to_torch_bits, u8, unpack_frames)
from .base import Codec, InPlace, OldBits, TensorSpec, Update, UpdateBatch, WrittenBatch, write_in_place

# -- subsets of [0, N) -------------------------------------------------------------------
NONE, DIRECT, COMPLEMENT, BITMAP = 0, 1, 2, 3


@dataclass
class _Seq:
    """One coded integer sequence: its length and kind (and values when encoding)."""

    length: int
    kind: B.Kind
    values: np.ndarray | None = None


@dataclass
class _SubsetDesc:
    count: int
    mode: int = NONE
    kind: B.Kind = field(default_factory=lambda: B.Kind(B.RICE, 0))


def parse_subset(h: _Reader) -> _SubsetDesc:
    c = h.next()
    if c == 0:
        return _SubsetDesc(0)
    mode = h.next()
    if mode > BITMAP:
        raise CorruptObjectError(f"ctx: bad subset mode {mode}")
    kind = B.Kind.parse(h.next()) if mode in (DIRECT, COMPLEMENT) else B.Kind(B.FIXED, 1)
    if mode in (DIRECT, COMPLEMENT) and kind.kind == B.FIXED:
        raise CorruptObjectError("ctx: fixed-width kind in a gap sequence")
    return _SubsetDesc(c, mode, kind)


def subset_seq(d: _SubsetDesc, n: int) -> _Seq | None:
    """The coded sequence a subset description implies over a universe of ``n``."""
    if d.count > n:
        raise CorruptObjectError(f"ctx: subset of {d.count} in a universe of {n}")
    if d.count == 0:
        return None
    if d.mode == NONE:
        if d.count != n:
            raise CorruptObjectError("ctx: implicit subset that is not the whole universe")
        return None
    length = {DIRECT: d.count, COMPLEMENT: n - d.count, BITMAP: n}[d.mode]
    return _Seq(length, d.kind)


def decode_subset(d: _SubsetDesc, n: int, values: np.ndarray | None) -> np.ndarray:
    """Sorted int64 members of the subset."""
    if d.count == 0:
        return np.zeros(0, np.int64)
    if d.mode == NONE:
        return np.arange(n, dtype=np.int64)
    assert values is not None
    if d.mode == BITMAP:
        if values.size and int(values.max()) > 1:
            raise CorruptObjectError("ctx: bitmap value above 1")
        s = np.flatnonzero(values)
    else:
        if values.size and int(values.max()) >= n:
            raise CorruptObjectError("ctx: gap beyond the universe")
        s = np.cumsum(values.astype(np.int64) + 1) - 1
        if s.size and int(s[-1]) >= n:
            raise CorruptObjectError("ctx: subset member beyond the universe")
        if d.mode == COMPLEMENT:
            mask = np.ones(n, dtype=bool)
            mask[s] = False
            s = np.flatnonzero(mask)
    if s.size != d.count:
        raise CorruptObjectError(f"ctx: subset decoded {s.size} members, header says {d.count}")
    return s.astype(np.int64, copy=False)


class _Reader:
    """Walks the object's header integers."""

    def __init__(self, ints: list[int]):
        self.ints, self.i = ints, 0

    def next(self) -> int:
        if self.i >= len(self.ints):
            raise CorruptObjectError("ctx: header is truncated")
        self.i += 1
        return self.ints[self.i - 1]


# -- one tensor --------------------------------------------------------------------------
@dataclass
class _Bucket:
    pos: _SubsetDesc
    big: _SubsetDesc | None = None
    neg: _SubsetDesc | None = None
    mag: B.Kind | None = None


@dataclass
class _TensorHeader:
    thresholds: list[int]
    buckets: list[_Bucket]
    len_u: int
    len_r: int


def _magnitude(bits: np.ndarray, spec: TensorSpec) -> np.ndarray:
    if spec.dtype not in _MANTISSA:
        return bits
    width = bits.dtype.itemsize * 8
    return bits & bits.dtype.type((1 << (width - 1)) - 1)


#: float dtypes ctx models by magnitude: the 1-byte e4m3 of FP8 served weights too (deltastore.quantize),
#: whose change odds depend on the old exponent as bf16's do (positions cost 0.50-0.67x given it, on the traces)
_MANTISSA = {**MANTISSA_BITS, torch.float8_e4m3fn: 3}

_SAMPLE_ABOVE = 1 << 16  # larger tensors choose thresholds from every 16th element's class (4096 or more)
#: the 16-bit floats, encoded whole by one kernel call (the other dtypes: numpy around the kernels)
_WHOLE_IN_C = (torch.bfloat16, torch.float16)


class _Classes:
    """Exponent classes of a float tensor's bits: ``class = (bits & mask) >> shift``."""

    def __init__(self, old: np.ndarray, spec: TensorSpec):
        self.old = old
        self.shift = _MANTISSA[spec.dtype]
        self.mask = (1 << (old.dtype.itemsize * 8 - 1)) - 1
        self.n = (self.mask >> self.shift) + 1

    def counts(self) -> np.ndarray:
        """Elements per class, for choosing thresholds (sampled for large tensors: only the choice depends on it)."""
        return R.class_counts(self.old, self.mask, self.shift, self.n, 16 if self.old.size > _SAMPLE_ABOVE else 1)

    def lut(self, thresholds: list[int]) -> np.ndarray:
        """class -> bucket for magnitude ``thresholds`` on class boundaries (bucket = thresholds <= magnitude)."""
        cuts = np.array([min(t >> self.shift, self.n) for t in thresholds], dtype=np.int64)
        return np.searchsorted(cuts, np.arange(self.n), side="right").astype(np.int64)


class CtxCodec(Codec):
    """Context-modelled sparse codec (see module docstring). Config: ``buckets`` (1..16, default 4)."""

    codec_id = "ctx"
    format_version = "1.0"
    receiver_needs = "old_tensor"

    def __init__(self, buckets: int = 4):
        if not isinstance(buckets, int) or isinstance(buckets, bool) or not 1 <= buckets <= 16:
            raise ValueError(f"buckets must be an integer in [1, 16], got {buckets!r}")
        self.buckets = buckets

    def get_config(self) -> dict[str, Any]:
        return {"buckets": self.buckets}

    def estimate_size(self, spec: TensorSpec, changed: int) -> int:
        # measured on the traces: 0.45-0.75 x the independent-position bound; the upper end
        return int(changed * 0.75 * (position_bits(spec.numel, changed) + 1.6) / 8) + 64

    # -- encode --------------------------------------------------------------------------
    def encode(self, updates: Sequence[Update]) -> bytes:
        ups = sorted_updates(updates)
        for u in ups:
            if u.positions is None:
                raise ValueError("ctx encodes sparse updates only")
            if u.old_tensor is None or u.old_tensor.numel() != u.spec.numel:
                raise ValueError(f"ctx needs the whole old tensor of {u.spec.name!r} (Update.old_tensor)")
        parts = parallel_map(self._encode_one, ups)
        header: list[int] = []
        streams = []
        for h, s in parts:
            header.extend(h)
            streams.append(s)
        meta = {"deltastore.names": names_digest([u.spec.name for u in ups])}
        return pack_meta({"header": u8(B.uvarint_encode(np.array(header, dtype=np.uint64))),
                          "streams": u8(b"".join(streams))}, self.codec_id, self.format_version, meta)

    def _encode_one(self, u: Update) -> tuple[list[int], bytes]:
        spec = u.spec
        assert u.positions is not None and u.old_tensor is not None
        old = np_bits(u.old_tensor).reshape(-1)
        pos = u.positions.numpy().astype(np.int64, copy=False)
        new = np_bits(u.bits).reshape(-1)
        if spec.dtype in _WHOLE_IN_C:  # bf16, fp16: the whole tensor in one kernel call (kernels/ctx.py)
            header, streams = K.encode16(old, np.ascontiguousarray(pos), np.ascontiguousarray(new),
                                         _MANTISSA[spec.dtype], self.buckets)
            return header.tolist(), streams
        is_float = spec.dtype in _MANTISSA
        old_at = old[pos]
        mag_at = _magnitude(old_at, spec)
        thresholds: list[int] = []
        if is_float and self.buckets > 1 and pos.size:
            classes = _Classes(old, spec)
            hits = np.bincount((mag_at >> classes.shift).astype(np.int64), minlength=classes.n)
            thresholds = K.thresholds(np.maximum(classes.counts(), hits), hits, self.buckets, classes.shift)
        d = B.ordered(new, is_float) - B.ordered(old_at, is_float)  # wraps for 64-bit: still a bijection
        if thresholds:
            bucket_of, rank, sizes = R.bucket_ranks(old, pos, classes.mask, classes.shift,
                                                    classes.lut(thresholds), len(thresholds) + 1)
        else:
            bucket_of, rank, sizes = np.zeros(pos.size, np.int64), pos, np.array([old.size], np.int64)
        # the subsets and magnitudes of every bucket, coded in one kernel call (kernels/ctx.py)
        coded, ustream, rstream = K.code_tensor(np.ascontiguousarray(bucket_of, np.int64),
                                                np.ascontiguousarray(rank, np.int64), d.astype(np.int64, copy=False),
                                                np.asarray(sizes, np.int64))
        header: list[int] = [len(thresholds) + 1, *thresholds, *coded.tolist(), len(ustream), len(rstream)]
        return header, ustream + rstream

    # -- decode --------------------------------------------------------------------------
    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        if old is None:
            raise ValueError("ctx decoding needs the receiver's old tensors (old(name, None))")
        jobs = self._parse(data, specs)

        def run(job: tuple[TensorSpec, _TensorHeader, bytes, bytes]) -> Update:
            spec = job[0]
            o = old(spec.name, None)
            if o.numel() != spec.numel:
                raise CorruptObjectError(f"ctx: old tensor {spec.name!r} has {o.numel()} elements, "
                                         f"expected {spec.numel}")
            return self.decode_tensor(spec, job[1], job[2], job[3], np_bits(o).reshape(-1))

        return {u.spec.name: u for u in parallel_map(run, jobs)}

    def decode_batch(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None
                     ) -> list[UpdateBatch | WrittenBatch]:
        """:meth:`decode` as batches; where the receiver offers its tensors to be written in place
        (:func:`~deltastore.codecs.base.write_in_place`) and every tensor of the object is bf16 or fp16 of
        one element width, each tensor is decoded and written into the target in one kernel call (the new
        bits only once the whole tensor decoded), its checksum change noted: a :class:`WrittenBatch`."""
        if old is None:
            raise ValueError("ctx decoding needs the receiver's old tensors (old(name, None))")
        jobs = self._parse(data, specs)
        if jobs and all(j[0].dtype in _WHOLE_IN_C and j[0].bits_dtype == jobs[0][0].bits_dtype for j in jobs):
            counts = np.array([sum(bk.pos.count for bk in th.buckets) for _, th, _, _ in jobs], np.int64)
            bounds = np.zeros(len(jobs) + 1, np.int64)
            np.cumsum(counts, out=bounds[1:])
            ordered = [j[0] for j in jobs]
            target = write_in_place(old, [s.name for s in ordered], bounds)
            if target is not None:
                self._write_in_place(jobs, target)
                return [WrittenBatch(ordered, bounds, target)]
        return Codec.decode_batch(self, data, specs, old)

    def _write_in_place(self, jobs: list[tuple[TensorSpec, _TensorHeader, bytes, bytes]], target: InPlace) -> None:
        """Every tensor of ``jobs`` decoded into ``target`` (tensor ``i`` at ``target.pointers[i]``): the undo
        is set first; a tensor is written whole once decoded, then marked done with its checksum change."""
        undo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (target view, positions, old bits)

        def put_back() -> None:
            for view, pos, before in reversed(undo):
                view[pos] = before

        target.undo = put_back
        for i, (spec, th, ustream, rstream) in enumerate(jobs):
            n = int(target.lengths[i])
            if n != spec.numel:
                raise CorruptObjectError(f"ctx: target tensor {spec.name!r} has {n} elements, expected {spec.numel}")
            view = np.ctypeslib.as_array(ctypes.cast(int(target.pointers[i]), ctypes.POINTER(ctypes.c_uint16)),
                                         shape=(n,))
            pos, bits, before = self._decode16(spec, th, ustream, rstream, view, write=True)
            undo.append((view, pos, before))
            if pos.size:
                key = int(target.keys[i])
                p = torch.from_numpy(pos)
                delta = sparse_sum(key, p, torch.from_numpy(bits.view(np.int16))) - \
                    sparse_sum(key, p, torch.from_numpy(before.view(np.int16)))
                target.sums[i] = np.uint64(delta % (1 << 64))
            target.done[i] = True

    def _parse(self, data: bytes, specs: Sequence[TensorSpec]) -> list[tuple[TensorSpec, _TensorHeader, bytes, bytes]]:
        """The object's tensors in name order, each with its parsed header and its two streams."""
        raw, meta = unpack_frames(data, self.codec_id)
        ordered_specs = check_object(meta, specs, self.codec_id)
        hdr, streams = raw.get("header"), raw.get("streams")
        if hdr is None or streams is None:
            raise CorruptObjectError("ctx: object lacks its header or streams")
        ints = self._header_ints(hdr)
        r = _Reader(ints)
        jobs = []
        offset = 0
        for spec in ordered_specs:
            th = self._parse_tensor(r, spec)
            end = offset + th.len_u + th.len_r
            if end > len(streams):
                raise CorruptObjectError(f"ctx: streams truncated at tensor {spec.name!r}")
            jobs.append((spec, th, streams[offset:offset + th.len_u], streams[offset + th.len_u:end]))
            offset = end
        if r.i != len(ints) or offset != len(streams):
            raise CorruptObjectError("ctx: trailing data after the last tensor")
        return jobs

    @staticmethod
    def _header_ints(hdr: bytes) -> list[int]:
        b = np.frombuffer(hdr, np.uint8)
        n = int(np.count_nonzero(b < 0x80))
        vals, used = B.uvarint_decode(b, n)
        if used != b.size:
            raise CorruptObjectError("ctx: header ends inside a varint")
        return vals.tolist()

    def _parse_tensor(self, r: _Reader, spec: TensorSpec) -> _TensorHeader:
        nb = r.next()
        if not 1 <= nb <= 16 or (nb > 1 and spec.dtype not in _MANTISSA):
            raise CorruptObjectError(f"ctx: {spec.name!r} has {nb} buckets")
        thresholds = [r.next() for _ in range(nb - 1)]
        if any(b <= a for a, b in zip(thresholds, thresholds[1:])):
            raise CorruptObjectError("ctx: thresholds are not increasing")
        buckets = []
        for _ in range(nb):
            bk = _Bucket(parse_subset(r))
            if bk.pos.count:
                bk.big = parse_subset(r)
                bk.neg = parse_subset(r)
                if bk.big.count:
                    bk.mag = B.Kind.parse(r.next())
            buckets.append(bk)
        return _TensorHeader(thresholds, buckets, r.next(), r.next())

    def decode_tensor(self, spec: TensorSpec, th: _TensorHeader, ustream: bytes, rstream: bytes,
                      old: np.ndarray) -> Update:
        """Decode one tensor given its parsed header, its two streams and the old flat bits."""
        is_float = spec.dtype in _MANTISSA
        nb = len(th.buckets)
        if nb > 1:
            classes = _Classes(old, spec)
            if any(t & ((1 << classes.shift) - 1) for t in th.thresholds):
                raise CorruptObjectError(f"ctx: {spec.name!r} has a threshold inside an exponent class")
        if spec.dtype in _WHOLE_IN_C:  # bf16, fp16: decoded whole by one kernel call (kernels/ctx.py)
            pos, bits, _ = self._decode16(spec, th, ustream, rstream, old)
            return Update(spec, torch.from_numpy(bits.view(np.int16)), torch.from_numpy(pos))
        if nb > 1:
            buckets = R.Buckets(old, classes.mask, classes.shift, classes.lut(th.thresholds), nb)
            sizes = buckets.sizes
        else:
            sizes = [spec.numel]
        seqs: list[_Seq] = []
        plan = []  # per bucket: the seq index of each part (or None)
        for b, bk in enumerate(th.buckets):
            if not bk.pos.count:
                plan.append(None)
                continue
            parts = []
            m = bk.pos.count
            assert bk.big is not None and bk.neg is not None
            for desc, n in ((bk.pos, int(sizes[b])), (bk.big, m), (bk.neg, m)):
                s = subset_seq(desc, n)
                parts.append(len(seqs) if s is not None else None)
                if s is not None:
                    seqs.append(s)
            if bk.mag is not None:
                parts.append(len(seqs))
                seqs.append(_Seq(bk.big.count, bk.mag))
            else:
                parts.append(None)
            plan.append(parts)
        values = self._read_streams(seqs, ustream, rstream)
        ranks, steps = [], []
        for b, (bk, parts) in enumerate(zip(th.buckets, plan)):
            if parts is None:
                ranks.append(np.zeros(0, np.int64))
                steps.append(np.zeros(0, np.int64))
                continue
            assert bk.big is not None and bk.neg is not None
            r = decode_subset(bk.pos, int(sizes[b]), values[parts[0]] if parts[0] is not None else None)
            m = r.size
            big = decode_subset(bk.big, m, values[parts[1]] if parts[1] is not None else None)
            neg = decode_subset(bk.neg, m, values[parts[2]] if parts[2] is not None else None)
            a = np.ones(m, dtype=np.uint64)
            if parts[3] is not None:
                a[big] = values[parts[3]] + np.uint64(2)
            d = a.view(np.int64).copy()
            d[neg] = -d[neg]
            ranks.append(r)
            steps.append(d)
        if nb > 1:
            found = R.bucket_select(buckets, ranks)
            if found is None:
                raise CorruptObjectError(f"ctx: {spec.name!r}: ranks beyond their buckets")
            pos, src = found
            d = np.concatenate(steps)[src]
        else:
            pos, d = ranks[0], steps[0]
        bits = B.unordered(B.ordered(old[pos], is_float) + d, old.dtype, is_float)
        return Update(spec, to_torch_bits(bits, spec), torch.from_numpy(pos.astype(np.int64, copy=False)))

    @staticmethod
    def _decode16(spec: TensorSpec, th: _TensorHeader, ustream: bytes, rstream: bytes, old: np.ndarray,
                  write: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`decode_tensor` of a bf16 / fp16 tensor by :func:`deltastore.kernels.ctx.decode16`: positions,
        new bits (uint16) and, with ``write`` (the new bits written into ``old`` once all decoded), the old."""
        plan: list[int] = []
        for bk in th.buckets:
            if not bk.pos.count:
                plan += [0, 0, 0, 0, 0, 0, 0, 0, 0, -1]
                continue
            assert bk.big is not None and bk.neg is not None
            plan += [bk.pos.count, bk.pos.mode, bk.pos.kind.code(), bk.big.count, bk.big.mode, bk.big.kind.code(),
                     bk.neg.count, bk.neg.mode, bk.neg.kind.code(), bk.mag.code() if bk.mag is not None else -1]
        m = sum(bk.pos.count for bk in th.buckets)
        if m > spec.numel:
            raise CorruptObjectError(f"ctx: {spec.name!r}: {m} changes in {spec.numel} elements")
        # a threshold past every magnitude (0x8000) is never met, however far past it is
        cuts = np.array([min(t, 0x8000) for t in th.thresholds], np.int64)
        status, pos, bits, before = K.decode16(old if write else np.ascontiguousarray(old), _MANTISSA[spec.dtype],
                                               cuts, np.array(plan, np.int64), ustream, rstream, m, write)
        if status:
            raise CorruptObjectError(f"ctx: {spec.name!r}: {K.DECODE_ERRORS.get(status, status)}")
        return pos, bits, before

    @staticmethod
    def _read_streams(seqs: list[_Seq], ustream: bytes, rstream: bytes) -> list[np.ndarray]:
        unary = [s for s in seqs if s.kind.kind != B.FIXED]
        n_unary = sum(s.length for s in unary)
        q_all = B.unpack_unary(ustream, n_unary)
        used_u = int(q_all.sum()) + n_unary
        if (used_u + 7) // 8 != len(ustream):
            raise CorruptObjectError(f"ctx: unary stream has {len(ustream)} bytes, {(used_u + 7) // 8} expected")
        qs, ws = [], []
        i = 0
        for s in seqs:
            if s.kind.kind == B.FIXED:
                q = np.full(s.length, -1, np.int64)
            else:
                q = q_all[i:i + s.length]
                i += s.length
            qs.append(q)
            ws.append(B.widths(q, s.kind))
        w = np.concatenate(ws) if ws else np.zeros(0, np.int64)
        if w.size and int(w.max()) > B.MAX_WIDTH:
            raise CorruptObjectError("ctx: field wider than 64 bits")
        total = int(w.sum())
        if (total + 7) // 8 != len(rstream):
            raise CorruptObjectError(f"ctx: raw stream has {len(rstream)} bytes, {(total + 7) // 8} expected")
        r = B.unpack_raw(rstream, w)
        out, j = [], 0
        for s, q in zip(seqs, qs):
            out.append(B.join(q, r[j:j + s.length], s.kind))
            j += s.length
        return out
