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
import numpy as np
import torch

from ..errors import CorruptObjectError
from . import _bits as B
from ._common import (ZstdLevel, position_bits, check_object, encode_positions, names_digest, np_bits, np_bits_dtype, pack_meta,
                      read_header, read_positions, sorted_updates, to_torch_bits, u8, unpack_frames,
                      zstd_compress)
from .base import Codec, OldBits, TensorSpec, Update


class ZstdCodec(ZstdLevel, Codec):
    """Gap-coded positions + zstd, raw values. Config: ``level`` (zstd level, default 1)."""

    codec_id = "zstd"
    format_version = "1.0"

    def estimate_size(self, spec: TensorSpec, changed: int) -> int:
        # gap-coded positions come within ~15 % of the ideal code on the traces; values are stored raw
        return int(changed * (1.15 * position_bits(spec.numel, changed) / 8 + spec.bits_dtype.itemsize)) + 64

    def encode(self, updates: Sequence[Update]) -> bytes:
        ups = sorted_updates(updates)
        if any(u.positions is None for u in ups):
            raise ValueError("zstd encodes sparse updates only")
        pos = [u.positions.numpy() for u in ups if u.positions is not None]
        stream = encode_positions(pos)
        header = B.uvarint_encode(np.array([u.count for u in ups] + [len(stream)], dtype=np.uint64))
        values = b"".join(np_bits(u.bits).astype(np_bits(u.bits).dtype.newbyteorder("<")).tobytes() for u in ups)
        return pack_meta({"header": u8(header), "positions": u8(zstd_compress(stream, self.level)),
                          "values": u8(values)}, self.codec_id, self.format_version,
                         {"deltastore.names": names_digest([u.spec.name for u in ups])})

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        raw, meta = unpack_frames(data, self.codec_id)
        specs = check_object(meta, specs, self.codec_id)
        counts, (raw_len,) = read_header(raw, specs, self.codec_id, 1)
        flat, bounds = read_positions(raw, specs, counts, raw_len, self.codec_id)
        positions = torch.from_numpy(flat).split(np.diff(bounds).tolist())
        values = raw.get("values")
        need = sum(c * s.bits_dtype.itemsize for c, s in zip(counts, specs))
        if values is None or len(values) != need:
            raise CorruptObjectError(f"{self.codec_id}: values hold {None if values is None else len(values)} "
                                     f"bytes, {need} expected")
        if specs and len({sp.bits_dtype for sp in specs}) == 1:  # one dtype (the usual case): one array, views
            dt = np_bits_dtype(specs[0]).newbyteorder("<")
            bits = to_torch_bits(np.frombuffer(values, dtype=dt), specs[0]).split(np.diff(bounds).tolist())
            return {sp.name: Update(sp, b, p) for sp, b, p in zip(specs, bits, positions)}
        out, off = {}, 0
        for spec, c, p in zip(specs, counts, positions):
            dt = np_bits_dtype(spec).newbyteorder("<")
            n = c * dt.itemsize
            bits = np.frombuffer(values, dtype=dt, count=c, offset=off)
            off += n
            out[spec.name] = Update(spec, to_torch_bits(bits, spec), p)
        return out
