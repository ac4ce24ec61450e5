"""``raw``: flat positions plus new values, readable by any safetensors reader.

Object layout (safetensors): for each tensor ``<name>.indices`` (int32 flat
positions when the tensor has fewer than 2**31 elements, else int64) and
``<name>.values`` (the new values in the tensor's own dtype). This is the
layout TRL-style consumers read. 6 bytes per changed bf16 element.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import CorruptObjectError
from ._safetensors import pack, take, unpack
from .base import Codec, OldBits, TensorSpec, Update


class RawCodec(Codec):
    codec_id = "raw"
    format_version = "1.0"

    def encode(self, updates: Sequence[Update]) -> bytes:
        out: dict[str, torch.Tensor] = {}
        for u in updates:
            if u.positions is None:
                raise ValueError("raw encodes sparse updates only")
            index_dtype = torch.int32 if u.spec.numel < 2**31 else torch.int64
            out[u.spec.name + ".indices"] = u.positions.to(index_dtype)
            out[u.spec.name + ".values"] = u.bits.view(u.spec.dtype)
        return pack(out, self.codec_id, self.format_version)

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        raw = unpack(data, self.codec_id)
        result = {}
        for spec in specs:
            idx = take(raw, spec.name + ".indices", self.codec_id)
            val = take(raw, spec.name + ".values", self.codec_id)
            if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
                raise CorruptObjectError(f"raw: {spec.name}.indices is {idx.dtype}{tuple(idx.shape)}, not 1-D int")
            if val.dtype != spec.dtype or val.dim() != 1:
                raise CorruptObjectError(f"raw: {spec.name}.values is {val.dtype}{tuple(val.shape)}, "
                                         f"expected 1-D {spec.dtype}")
            result[spec.name] = Update(spec, val.view(spec.bits_dtype), idx.to(torch.int64))
        return result
