"""``dense``: whole tensors (anchors), byte planes compressed with zstd.

Format 2.0 (written with ``planes=True``): for every tensor ``<name>`` one uint8 tensor
``<name>`` holding zstd frames, and the header metadata key
``deltastore.dense`` = JSON ``{name: [[plane, elem_start, elem_count, nbytes, stored], ...]}``
listing, in order, the frames concatenated in that tensor. A frame holds byte
``plane`` (0 = least significant) of the raw bits of ``elem_count`` elements
starting at ``elem_start``; ``stored`` is ``"z"`` (zstd frame, level 1,
content size declared) or ``"r"`` (the bytes as they are, when zstd would not
shrink them). Float tensors are first rotated left by one bit (the sign moves
to bit 0, so for bf16 byte 1 is exactly the 8-bit exponent and byte 0 the sign
and mantissa, as ZipNN does); integer tensors are not rotated. Elements are cut in chunks of ``chunk`` (default 2**22) so frames
decode in parallel. For bf16 plane 1 (the exponent) compresses to about a third; plane 0
(sign and mantissa) is stored raw: ≈ 66-68 % of the raw size.

Format 1.0 (the default, and always read): one tensor per name in its own dtype and shape, a
plain safetensors checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import CorruptObjectError
from ._common import MANTISSA_BITS, np_bits, np_bits_dtype, pack_meta, parallel_map, to_torch_bits, u8, unpack_meta
from ._common import zstd_compress, zstd_decompress
from ._safetensors import take
from .base import Codec, OldBits, TensorSpec, Update


def _rotl1(bits: np.ndarray) -> np.ndarray:
    u = bits.view(np.dtype(f"u{bits.dtype.itemsize}"))
    w = bits.dtype.itemsize * 8
    return ((u << u.dtype.type(1)) | (u >> u.dtype.type(w - 1))).view(bits.dtype)


def _rotr1(bits: np.ndarray) -> np.ndarray:
    u = bits.view(np.dtype(f"u{bits.dtype.itemsize}"))
    w = bits.dtype.itemsize * 8
    return ((u >> u.dtype.type(1)) | (u << u.dtype.type(w - 1))).view(bits.dtype)


def split_planes(bits: np.ndarray, chunk: int, level: int, rotate: bool = False) -> tuple[list[list[Any]], bytes]:
    """Frames (index entries, payload) of one tensor's flat raw bits (rotated left by one bit if ``rotate``)."""
    width = bits.dtype.itemsize
    if rotate:
        bits = _rotl1(bits)
    planes = bits.astype(bits.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, width)
    jobs = [(start, j) for start in range(0, bits.size, chunk) for j in range(width)]

    def one(job: tuple[int, int]) -> tuple[list[Any], bytes]:
        start, j = job
        raw = np.ascontiguousarray(planes[start:start + chunk, j]).tobytes()
        z = zstd_compress(raw, level)
        if len(z) < len(raw):
            return [j, start, len(raw), len(z), "z"], z
        return [j, start, len(raw), len(raw), "r"], raw

    parts = parallel_map(one, jobs)
    return [p[0] for p in parts], b"".join(p[1] for p in parts)


def join_planes(spec: TensorSpec, index: Any, payload: bytes | memoryview, rotate: bool = False) -> np.ndarray:
    """Inverse of :func:`split_planes`, checking the index covers every byte exactly once."""
    dt = np_bits_dtype(spec)
    width, n = dt.itemsize, spec.numel
    if not isinstance(index, list):
        raise CorruptObjectError(f"dense: bad frame index for {spec.name!r}")
    out = np.empty((n, width), dtype=np.uint8)
    covered = 0
    jobs, off = [], 0
    for e in index:
        if (not isinstance(e, list) or len(e) != 5 or not all(isinstance(x, int) for x in e[:4])
                or e[4] not in ("z", "r")):
            raise CorruptObjectError(f"dense: bad frame entry {e!r} for {spec.name!r}")
        j, start, count, nbytes, stored = e
        if not (0 <= j < width and 0 <= start and 0 <= count and start + count <= n and nbytes >= 0):
            raise CorruptObjectError(f"dense: frame {e!r} outside tensor {spec.name!r}")
        if off + nbytes > len(payload):
            raise CorruptObjectError(f"dense: frames of {spec.name!r} are truncated")
        jobs.append((j, start, count, payload[off:off + nbytes], stored))
        off += nbytes
        covered += count
    if off != len(payload) or covered != n * width:
        raise CorruptObjectError(f"dense: frames of {spec.name!r} cover {covered} of {n * width} bytes")

    def one(job: tuple[int, int, int, bytes, str]) -> None:
        j, start, count, data, stored = job
        raw = zstd_decompress(data, count, f"dense {spec.name}") if stored == "z" else data
        if len(raw) != count:
            raise CorruptObjectError(f"dense: raw frame of {spec.name!r} has {len(raw)} bytes, {count} expected")
        out[start:start + count, j] = np.frombuffer(raw, np.uint8)

    parallel_map(one, jobs)
    bits = out.view(dt.newbyteorder("<")).reshape(-1).astype(dt, copy=False)
    return _rotr1(bits) if rotate else bits


class DenseCodec(Codec):
    """Whole tensors; with ``planes=True`` as zstd-compressed byte planes (format 2), else plain (format 1).

    Config: ``planes`` (default False, so objects stay readable by older
    readers and plain safetensors tools), ``level`` (zstd level, 1),
    ``chunk`` (elements per frame). :meth:`describe` records the format
    actually written.
    """

    codec_id = "dense"
    format_version = "2.0"
    readable_majors = ("1",)
    dense = True

    def __init__(self, planes: bool = False, level: int = 1, chunk: int = 1 << 22):
        if not isinstance(planes, bool):
            raise ValueError(f"planes must be a bool, got {planes!r}")
        self.planes = planes
        if not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22:
            raise ValueError(f"level must be an integer in [-7, 22], got {level!r}")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        self.level, self.chunk = level, chunk

    def get_config(self) -> dict[str, Any]:
        if not self.planes:
            return {}
        return {"planes": True, "level": self.level, "chunk": self.chunk}

    def describe(self) -> dict[str, Any]:
        return {"id": self.codec_id, "version": "2.0" if self.planes else "1.0", "config": self.get_config()}

    def encode(self, updates: Sequence[Update]) -> bytes:
        if any(u.positions is not None for u in updates):
            raise ValueError("dense encodes whole tensors only")
        if not self.planes:
            plain = {u.spec.name: u.bits.view(u.spec.dtype).reshape(u.spec.shape) for u in updates}
            return pack_meta(plain, self.codec_id, "1.0", {})
        out: dict[str, torch.Tensor] = {}
        index: dict[str, Any] = {}
        for u in updates:
            entries, payload = split_planes(np_bits(u.bits).reshape(-1), self.chunk, self.level,
                                            rotate=u.spec.dtype in MANTISSA_BITS)
            out[u.spec.name] = u8(payload)
            index[u.spec.name] = entries
        return pack_meta(out, self.codec_id, self.format_version, {"deltastore.dense": json.dumps(index)})

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        raw, meta = unpack_meta(data, self.codec_id)
        version = meta.get("deltastore.codec_version", "1.0")
        if version.split(".")[0] == "1":
            return _decode_v1(raw, specs)
        if version.split(".")[0] != "2":
            raise CorruptObjectError(f"dense: object format {version!r} does not match its manifest")
        try:
            index = json.loads(meta["deltastore.dense"])
        except (KeyError, ValueError) as e:
            raise CorruptObjectError(f"dense: object lacks a valid frame index ({e!r})") from None
        result = {}
        for spec in specs:
            t = take(raw, spec.name, self.codec_id)
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise CorruptObjectError(f"dense: {spec.name} payload is {t.dtype}{tuple(t.shape)}")
            bits = join_planes(spec, index.get(spec.name), memoryview(t.numpy()).cast("B"),
                               rotate=spec.dtype in MANTISSA_BITS)
            result[spec.name] = Update(spec, to_torch_bits(bits, spec))
        return result


def _decode_v1(raw: dict[str, torch.Tensor], specs: Sequence[TensorSpec]) -> dict[str, Update]:
    result = {}
    for spec in specs:
        t = take(raw, spec.name, "dense")
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise CorruptObjectError(f"dense: {spec.name} is {t.dtype}{tuple(t.shape)}, "
                                     f"expected {spec.dtype}{spec.shape}")
        result[spec.name] = Update(spec, t.reshape(-1).view(spec.bits_dtype))
    return result
