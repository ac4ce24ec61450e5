"""``zstd``: gap-coded positions compressed with zstd, raw new values (PULSE-style).

Object layout (safetensors, tensors in name order, see ``docs/codecs.md``):

* ``header`` (uint8): LEB128 integers: each tensor's changed count, then the
  byte length of the uncompressed position stream;
* ``positions`` (uint8): one zstd frame (level ``level``, content size
  declared) of the LEB128 gaps of every tensor in turn: the first position,
  then ``p[i] - p[i-1] - 1``;
* ``values`` (uint8): the new raw bits, little-endian, tensor after tensor.

The decoder needs nothing from the receiver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import CorruptObjectError
from . import _bits as B
from ._common import (as_bytes, check_object, names_digest, np_bits, np_bits_dtype, pack_meta, sorted_specs,
                      sorted_updates, to_torch_bits, u8, unpack_meta, zstd_compress, zstd_decompress)
from .base import Codec, OldBits, TensorSpec, Update


def encode_positions(positions: Sequence[np.ndarray]) -> bytes:
    """LEB128 gap stream of several sorted position arrays, one after the other (one vectorised pass)."""
    if not positions:
        return b""
    cat = np.concatenate([np.asarray(p, dtype=np.int64) for p in positions])
    gaps = np.diff(cat, prepend=-1) - 1
    starts = np.cumsum([0] + [len(p) for p in positions[:-1]])
    starts = starts[starts < cat.size]
    gaps[starts] = cat[starts]  # each array's first gap is its first position
    return B.uvarint_encode(gaps.astype(np.uint64))


def decode_positions(stream: bytes, counts: Sequence[int], numels: Sequence[int], codec_id: str) -> list[np.ndarray]:
    """Inverse of :func:`encode_positions`, checking each array stays inside its tensor."""
    total = sum(counts)
    gaps, used = B.uvarint_decode(stream, total)
    if used != len(stream):
        raise CorruptObjectError(f"{codec_id}: position stream has trailing bytes")
    if total == 0:
        return [np.zeros(0, np.int64) for _ in counts]
    if int(gaps.max()) >= max(numels):
        raise CorruptObjectError(f"{codec_id}: position gap beyond the tensor")
    counts_a = np.asarray(counts, dtype=np.int64)
    cs = np.cumsum(gaps.astype(np.int64) + 1)
    ends = np.cumsum(counts_a)
    base = np.concatenate(([0], cs[ends[:-1] - 1])) if len(counts) > 1 else np.zeros(1, np.int64)
    base = np.where(np.concatenate(([0], ends[:-1])) > 0, base, 0)
    p = cs - 1 - np.repeat(base, counts_a)
    nonempty = counts_a > 0
    last = p[ends[nonempty] - 1]
    if np.any(last >= np.asarray(numels, dtype=np.int64)[nonempty]):
        raise CorruptObjectError(f"{codec_id}: position beyond the tensor")
    return np.split(p, ends[:-1])


def read_header(raw: dict[str, torch.Tensor], specs: Sequence[TensorSpec], codec_id: str,
                extra: int) -> tuple[list[int], list[int]]:
    """Per-tensor counts and ``extra`` trailing integers from the ``header`` tensor."""
    if "header" not in raw:
        raise CorruptObjectError(f"{codec_id}: object lacks its header")
    hdr = as_bytes(raw["header"], codec_id, "header")
    vals, used = B.uvarint_decode(hdr, len(specs) + extra)
    if used != len(hdr):
        raise CorruptObjectError(f"{codec_id}: header has trailing bytes")
    ints = [int(v) for v in vals]
    counts = ints[:len(specs)]
    for c, s in zip(counts, specs):
        if c > s.numel:
            raise CorruptObjectError(f"{codec_id}: {c} changes in {s.name!r} of {s.numel} elements")
    return counts, ints[len(specs):]


def read_positions(raw: dict[str, torch.Tensor], specs: Sequence[TensorSpec], counts: list[int], raw_len: int,
                   codec_id: str) -> list[np.ndarray]:
    if raw_len > 10 * sum(counts):
        raise CorruptObjectError(f"{codec_id}: position stream of {raw_len} bytes for {sum(counts)} changes")
    if "positions" not in raw:
        raise CorruptObjectError(f"{codec_id}: object lacks its positions")
    stream = zstd_decompress(as_bytes(raw["positions"], codec_id, "positions"), raw_len, f"{codec_id} positions")
    return decode_positions(stream, counts, [s.numel for s in specs], codec_id)


class ZstdLevel:
    """Config shared by the zstd-based codecs: ``level`` (zstd level, default 1)."""

    def __init__(self, level: int = 1):
        if not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22:
            raise ValueError(f"level must be an integer in [-7, 22], got {level!r}")
        self.level = level

    def get_config(self) -> dict[str, Any]:
        return {"level": self.level}


class ZstdCodec(ZstdLevel, Codec):
    """Gap-coded positions + zstd, raw values. Config: ``level`` (zstd level, default 1)."""

    codec_id = "zstd"
    format_version = "1.0"

    def encode(self, updates: Sequence[Update]) -> bytes:
        ups = sorted_updates(updates)
        if any(u.positions is None for u in ups):
            raise ValueError("zstd encodes sparse updates only")
        pos = [u.positions.numpy().astype(np.int64) for u in ups if u.positions is not None]
        stream = encode_positions(pos)
        header = B.uvarint_encode(np.array([u.count for u in ups] + [len(stream)], dtype=np.uint64))
        values = b"".join(np_bits(u.bits).astype(np_bits(u.bits).dtype.newbyteorder("<")).tobytes() for u in ups)
        return pack_meta({"header": u8(header), "positions": u8(zstd_compress(stream, self.level)),
                          "values": u8(values)}, self.codec_id, self.format_version,
                         {"deltastore.names": names_digest([u.spec.name for u in ups])})

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        raw, meta = unpack_meta(data, self.codec_id)
        check_object(meta, specs, self.codec_id)
        specs = sorted_specs(specs)
        counts, (raw_len,) = read_header(raw, specs, self.codec_id, 1)
        positions = read_positions(raw, specs, counts, raw_len, self.codec_id)
        values = as_bytes(raw["values"], self.codec_id, "values") if "values" in raw else None
        need = sum(c * s.bits_dtype.itemsize for c, s in zip(counts, specs))
        if values is None or len(values) != need:
            raise CorruptObjectError(f"{self.codec_id}: values hold {None if values is None else len(values)} "
                                     f"bytes, {need} expected")
        out, off = {}, 0
        for spec, c, p in zip(specs, counts, positions):
            dt = np_bits_dtype(spec).newbyteorder("<")
            n = c * dt.itemsize
            bits = np.frombuffer(values, dtype=dt, count=c, offset=off)
            off += n
            out[spec.name] = Update(spec, to_torch_bits(bits, spec), torch.from_numpy(p))
        return out
