"""Helpers shared by the built-in sparse codecs: framing of multi-tensor objects, dtype facts, zstd."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch
import zstandard

from ..errors import CorruptObjectError
from .base import TensorSpec, Update

T = TypeVar("T")

#: mantissa bits of the float dtypes (the exponent field starts above them)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def threads() -> int:
    """Worker threads for per-tensor work (env ``DELTASTORE_CODEC_THREADS``, default min(cpus, 4))."""
    env = os.environ.get("DELTASTORE_CODEC_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(os.cpu_count() or 1, 4))


def parallel_map(fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    """``[fn(x) for x in items]``, on a thread pool when there is more than one item (numpy drops the GIL)."""
    n = threads()
    if n == 1 or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(n, len(items))) as ex:
        return list(ex.map(fn, items))


def names_digest(names: Sequence[str]) -> str:
    """16 hex digits identifying an ordered list of tensor names."""
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def sorted_updates(updates: Sequence[Update]) -> list[Update]:
    """Updates in name order (the order every built-in multi-tensor layout uses)."""
    return sorted(updates, key=lambda u: u.spec.name)


def sorted_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    return sorted(specs, key=lambda s: s.name)


def np_bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU integer tensor (bool/uint8 as uint8)."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.device.type == "cpu" and not t.requires_grad:
        return t.numpy()  # shares storage; ~10x cheaper than detach/cpu/contiguous per small tensor
    return t.detach().cpu().contiguous().numpy()


def np_bits_dtype(spec: TensorSpec) -> np.dtype:
    return np.dtype({torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
                     torch.int64: np.int64}[spec.bits_dtype])


def to_torch_bits(a: np.ndarray, spec: TensorSpec) -> torch.Tensor:
    """A torch tensor of ``spec.bits_dtype`` holding ``a``'s bits."""
    a = np.ascontiguousarray(a).astype(np_bits_dtype(spec), copy=False)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


def zstd_compress(data: bytes, level: int = 1) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def zstd_decompress(data: bytes, expected: int, what: str) -> bytes:
    """Decompress exactly ``expected`` bytes; anything else is :class:`CorruptObjectError` (bomb-safe)."""
    if expected == 0 and len(data) == 0:
        return b""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: not a zstd frame ({e})") from e
    if params.content_size != expected:  # our frames always declare their size: this bounds memory
        raise CorruptObjectError(f"{what}: zstd frame declares {params.content_size} bytes, {expected} expected")
    try:
        dobj = zstandard.ZstdDecompressor().decompressobj()
        out = dobj.decompress(data)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: zstd stream is corrupt ({e})") from e
    if len(out) != expected or not dobj.eof or dobj.unused_data:
        raise CorruptObjectError(f"{what}: zstd stream holds {len(out)} bytes "
                                 f"({'complete' if dobj.eof else 'truncated'}), {expected} expected")
    return out


def check_object(meta: dict[str, str], specs: Sequence[TensorSpec], codec_id: str) -> None:
    """Check an object's name digest against the specs the manifest gives for it."""
    want = names_digest([s.name for s in sorted_specs(specs)])
    got = meta.get("deltastore.names")
    if got != want:
        raise CorruptObjectError(f"{codec_id}: object holds tensors {got!r}, manifest expects {want!r}")


def unpack_meta(data: bytes, codec_id: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and header metadata of a safetensors object; :class:`CorruptObjectError` if malformed."""
    import json

    from ._safetensors import unpack

    tensors = unpack(data, codec_id)
    try:
        n = int.from_bytes(bytes(data[:8]), "little")
        header = json.loads(bytes(data[8:8 + n]))
        meta = header.get("__metadata__") or {}
    except Exception as e:  # pragma: no cover - unpack() already validated the header
        raise CorruptObjectError(f"{codec_id}: bad safetensors header ({e})") from e
    if not isinstance(meta, dict):
        raise CorruptObjectError(f"{codec_id}: bad safetensors metadata")
    return tensors, meta


def pack_meta(tensors: dict[str, torch.Tensor], codec_id: str, version: str, meta: dict[str, str]) -> bytes:
    """Safetensors bytes with the codec id/version and ``meta`` in the header metadata."""
    from safetensors.torch import save

    md = {"deltastore.codec": codec_id, "deltastore.codec_version": version, **meta}
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=md)


def u8(b: bytes) -> torch.Tensor:
    """A uint8 tensor holding ``b``."""
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)


def as_bytes(t: torch.Tensor, codec_id: str, key: str) -> bytes:
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise CorruptObjectError(f"{codec_id}: {key} is {t.dtype}{tuple(t.shape)}, expected 1-D uint8")
    return t.numpy().tobytes()
