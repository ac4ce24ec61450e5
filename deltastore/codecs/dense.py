"""``dense``: whole tensors as a plain safetensors file (used for anchors).

Object layout: one tensor per name, in its own dtype and shape, so any
safetensors reader can load an anchor object directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import CorruptObjectError
from ._safetensors import pack, take, unpack
from .base import Codec, OldBits, TensorSpec, Update


class DenseCodec(Codec):
    codec_id = "dense"
    format_version = "1.0"
    dense = True

    def encode(self, updates: Sequence[Update]) -> bytes:
        out: dict[str, torch.Tensor] = {}
        for u in updates:
            if u.positions is not None:
                raise ValueError("dense encodes whole tensors only")
            out[u.spec.name] = u.bits.view(u.spec.dtype).reshape(u.spec.shape)
        return pack(out, self.codec_id, self.format_version)

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        raw = unpack(data, self.codec_id)
        result = {}
        for spec in specs:
            t = take(raw, spec.name, self.codec_id)
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise CorruptObjectError(f"dense: {spec.name} is {t.dtype}{tuple(t.shape)}, "
                                         f"expected {spec.dtype}{spec.shape}")
            result[spec.name] = Update(spec, t.reshape(-1).view(spec.bits_dtype))
        return result
