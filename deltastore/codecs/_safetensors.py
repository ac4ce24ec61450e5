"""Safetensors framing shared by the built-in codecs."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import CorruptObjectError


def pack(tensors: Mapping[str, torch.Tensor], codec_id: str, version: str) -> bytes:
    """Safetensors bytes with the codec named in the header metadata."""
    return st_save({k: v.contiguous() for k, v in tensors.items()},
                   metadata={"deltastore.codec": codec_id, "deltastore.codec_version": version})


def unpack(data: bytes, codec_id: str) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes, mapping any parse failure to :class:`CorruptObjectError`."""
    try:
        return st_load(bytes(data))
    except Exception as e:  # safetensors raises its own error types and sometimes plain ones
        raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: {e}") from e


def take(tensors: Mapping[str, torch.Tensor], key: str, codec_id: str) -> torch.Tensor:
    """``tensors[key]`` or :class:`CorruptObjectError` naming the missing key."""
    try:
        return tensors[key]
    except KeyError:
        raise CorruptObjectError(f"{codec_id} object lacks tensor {key!r}") from None
