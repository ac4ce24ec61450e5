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

from collections.abc import Sequence

import numpy as np
import torch

from ..errors import CorruptObjectError
from . import _bits as B
from ._common import (MANTISSA_BITS, as_bytes, check_object, names_digest, np_bits, pack_meta, sorted_specs,
                      sorted_updates, to_torch_bits, u8, unpack_meta, zstd_compress, zstd_decompress)
from .base import Codec, OldBits, TensorSpec, Update
from .zstd import ZstdLevel, encode_positions, read_header, read_positions


class UlpCodec(ZstdLevel, Codec):
    """Positions as in ``zstd``; values as byte-split zig-zag ulp steps. Config: ``level`` (default 1)."""

    codec_id = "ulp"
    format_version = "1.0"
    receiver_needs = "old_bits"

    def encode(self, updates: Sequence[Update]) -> bytes:
        ups = sorted_updates(updates)
        steps = []
        for u in ups:
            if u.positions is None:
                raise ValueError("ulp encodes sparse updates only")
            if u.old_bits is None or u.old_bits.numel() != u.count:
                raise ValueError(f"ulp needs the old bits of {u.spec.name!r} at the changed positions")
            f = u.spec.dtype in MANTISSA_BITS
            d = B.ordered(np_bits(u.bits), f) - B.ordered(np_bits(u.old_bits), f)
            steps.append(B.zigzag(d) - np.uint64(1))
        z = np.concatenate(steps) if steps else np.zeros(0, np.uint64)
        nplanes = max(1, (int(B.bit_length(np.array([z.max()]))[0]) + 7) // 8) if z.size else 0
        pos = [u.positions.numpy().astype(np.int64) for u in ups if u.positions is not None]
        stream = encode_positions(pos)
        header = B.uvarint_encode(np.array([u.count for u in ups] + [len(stream), nplanes], dtype=np.uint64))
        planes = z.astype("<u8").view(np.uint8).reshape(-1, 8)
        tensors = {"header": u8(header), "positions": u8(zstd_compress(stream, self.level))}
        for j in range(nplanes):
            tensors[f"plane{j}"] = u8(zstd_compress(np.ascontiguousarray(planes[:, j]).tobytes(), self.level))
        return pack_meta(tensors, self.codec_id, self.format_version,
                         {"deltastore.names": names_digest([u.spec.name for u in ups])})

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        if old is None:
            raise ValueError("ulp decoding needs the receiver's old bits (old(name, positions))")
        raw, meta = unpack_meta(data, self.codec_id)
        check_object(meta, specs, self.codec_id)
        specs = sorted_specs(specs)
        counts, (raw_len, nplanes) = read_header(raw, specs, self.codec_id, 2)
        if nplanes > 8:
            raise CorruptObjectError(f"ulp: {nplanes} byte planes")
        positions = read_positions(raw, specs, counts, raw_len, self.codec_id)
        total = sum(counts)
        z = np.zeros(total, dtype=np.uint64)
        for j in range(nplanes):
            key = f"plane{j}"
            if key not in raw:
                raise CorruptObjectError(f"ulp: object lacks {key}")
            plane = zstd_decompress(as_bytes(raw[key], self.codec_id, key), total, f"ulp {key}")
            z |= np.frombuffer(plane, np.uint8).astype(np.uint64) << np.uint64(8 * j)
        if total and nplanes == 0:
            raise CorruptObjectError("ulp: changes without value planes")
        d = B.unzigzag(z + np.uint64(1))
        out, i = {}, 0
        for spec, c, p in zip(specs, counts, positions):
            f = spec.dtype in MANTISSA_BITS
            pt = torch.from_numpy(p)
            o = np_bits(old(spec.name, pt)).reshape(-1)
            if o.size != c:
                raise CorruptObjectError(f"ulp: receiver gave {o.size} old values for {c} positions")
            bits = B.unordered(B.ordered(o, f) + d[i:i + c], o.dtype, f)
            i += c
            out[spec.name] = Update(spec, to_torch_bits(bits, spec), pt)
        return out
