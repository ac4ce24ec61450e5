"""Framing shared by the built-in codecs: one object = safetensors with codec metadata.

Here: the object frame (``pack_meta`` / ``unpack_meta``; ``unpack_frames``
reads the sparse codecs' byte frames without a copy; the tensor-names digest
``check_object``), bomb-safe zstd (``zstd_decompress`` refuses any
frame whose declared size is not the expected one), the LEB128 header and
gap-coded position stream of ``zstd`` and ``ulp``, the zstd ``level`` config,
numpy views of bit tensors, and the per-tensor thread map. Bit streams live
in ``_bits``; no codec imports another codec's module.
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch
import zstandard

from .._memo import LastList
from ..errors import CorruptObjectError
from ..kernels import bitstream as K
from . import _bits as B
from .base import RowSpecs, TensorSpec, Update

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


_NAME, _NUMEL = operator.attrgetter("name"), operator.attrgetter("numel")


def sorted_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    return sorted(specs, key=_NAME)


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


_local = threading.local()


def zstd_compress(data: bytes | memoryview | np.ndarray, level: int = 1) -> bytes:
    """One zstd frame of ``data`` (its size declared) at ``level``. A context per call: one kept per thread
    would keep the tables of the largest input it ever compressed (megabytes at level 1) resident."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompression context (a context is not shared between threads; one per call costs
    its allocation)."""
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def zstd_decompress(data: bytes | memoryview, expected: int, what: str) -> bytes:
    """Decompress exactly ``expected`` bytes; anything else is :class:`CorruptObjectError` (bomb-safe)."""
    if expected == 0 and len(data) == 0:
        return b""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: not a zstd frame ({e})") from e
    if params.content_size != expected:  # our frames always declare their size: this bounds memory
        raise CorruptObjectError(f"{what}: zstd frame declares {params.content_size} bytes, {expected} expected")
    try:  # one call into one buffer of the declared size; a short frame or bytes after it raise
        out = _decompressor().decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: zstd stream is corrupt or not one whole frame ({e})") from e
    if len(out) != expected:
        raise CorruptObjectError(f"{what}: zstd stream holds {len(out)} bytes, {expected} expected")
    return out


def _name_order_and_digest(specs: list[TensorSpec]) -> tuple[list[TensorSpec], str]:
    ordered = sorted_specs(specs)
    return ordered, names_digest(list(map(_NAME, ordered)))


#: a follower's objects hold the same tensors (the same spec objects, from one parsed layout) step after step
_sorted_with_digest = LastList(_name_order_and_digest)


#: (table, rows, names digest) of the last :class:`RowSpecs` in name order whose digest was worked out
_last_row_digest: tuple[list[str], np.ndarray, str] | None = None


def _row_digest(specs: RowSpecs) -> str:
    """:func:`names_digest` of ``specs`` (in name order), kept for the last table and rows asked (a follower's
    objects hold the same rows step after step, or nearly: compared as one array)."""
    global _last_row_digest
    last = _last_row_digest
    if last is not None and last[0] is specs.table and np.array_equal(last[1], specs.rows):
        return last[2]
    digest = names_digest(list(map(_NAME, specs)))
    _last_row_digest = (specs.table, specs.rows.copy(), digest)
    return digest


def check_object(meta: dict[str, str], specs: Sequence[TensorSpec], codec_id: str) -> list[TensorSpec]:
    """Check an object's name digest against the specs the manifest gives for it; returns those specs in
    name order (:func:`sorted_specs`, the order of the object's layout), a list of the caller's own
    (:class:`RowSpecs` already in name order: a copy with its facts)."""
    if isinstance(specs, RowSpecs) and specs.name_sorted:
        ordered, want = specs.copy(), _row_digest(specs)
    else:
        ordered, want = _sorted_with_digest(specs)
        ordered = ordered[:]  # the caller's own list
    got = meta.get("deltastore.names")
    if got != want:
        raise CorruptObjectError(f"{codec_id}: object holds tensors {got!r}, manifest expects {want!r}")
    return ordered


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


def unpack_frames(data: bytes | memoryview, codec_id: str) -> tuple[dict[str, memoryview], dict[str, str]]:
    """The byte frames and header metadata of a sparse codec's object (every entry 1-D uint8), no copy.

    The frames are views of ``data`` (:func:`deltastore.codecs._safetensors.view` checks the file as the
    safetensors library does); a malformed file, or an entry of another dtype or rank, is
    :class:`CorruptObjectError`.
    """
    from ._safetensors import view

    entries, meta = view(data, codec_id)
    frames = {}
    for key, (dtype, shape, mv) in entries.items():
        if dtype != "U8" or len(shape) != 1:
            raise CorruptObjectError(f"{codec_id}: {key} is {dtype}{list(shape)}, expected 1-D uint8")
        frames[key] = mv
    return frames, meta


def pack_meta(tensors: dict[str, torch.Tensor], codec_id: str, version: str, meta: dict[str, str]) -> bytes:
    """Safetensors bytes with the codec id/version and ``meta`` in the header metadata.

    The bytes are a function of the contents alone (see ``_safetensors.pack_sorted``):
    content addressing only deduplicates objects that encode the same way every time.
    """
    from ._safetensors import pack_sorted

    return pack_sorted(tensors, {"deltastore.codec": codec_id, "deltastore.codec_version": version, **meta})


def u8(b: bytes) -> torch.Tensor:
    """A uint8 tensor holding ``b``."""
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)


# -- gap-coded positions and LEB128 headers (zstd, ulp) ---------------------------------------
def encode_positions(positions: Sequence[np.ndarray]) -> bytes:
    """LEB128 gap stream of several sorted position arrays, one after the other (one fused kernel pass,
    :func:`deltastore.kernels.bitstream.gap_stream`)."""
    return K.gap_stream(positions)


def decode_positions(stream: bytes, counts: Sequence[int], numels: Sequence[int],
                     codec_id: str) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_positions` in one fused pass, checking each array stays inside its tensor:
    every tensor's positions in turn as one array, and the ``len(counts) + 1`` bounds of each one's slice."""
    counts_a = np.asarray(counts, dtype=np.int64)
    if int(counts_a.sum()) > len(stream):  # each position takes a byte at least: no allocation for a lie
        raise CorruptObjectError(f"{codec_id}: position stream holds fewer than {int(counts_a.sum())} positions")
    p, status, seg, used = K.gap_positions(stream, counts_a, np.asarray(numels, dtype=np.int64))
    if status == 1:
        raise CorruptObjectError(f"{codec_id}: position stream holds fewer than {p.size} positions")
    if status == 2:
        raise CorruptObjectError(f"{codec_id}: position stream holds a varint longer than 10 bytes")
    if status == 3:
        raise CorruptObjectError(f"{codec_id}: position beyond the tensor (tensor {seg} of the object)")
    if used != len(stream):
        raise CorruptObjectError(f"{codec_id}: position stream has trailing bytes")
    bounds = np.zeros(len(counts_a) + 1, np.int64)
    np.cumsum(counts_a, out=bounds[1:])
    return p, bounds


def read_header(frames: dict[str, memoryview], specs: Sequence[TensorSpec], codec_id: str,
                extra: int) -> tuple[list[int], list[int]]:
    """Per-tensor counts and ``extra`` trailing integers from the ``header`` frame."""
    if "header" not in frames:
        raise CorruptObjectError(f"{codec_id}: object lacks its header")
    hdr = frames["header"]
    vals, used = B.uvarint_decode(hdr, len(specs) + extra)
    if used != len(hdr):
        raise CorruptObjectError(f"{codec_id}: header has trailing bytes")
    n = len(specs)
    numels = specs.numels.astype(np.uint64) if isinstance(specs, RowSpecs) else \
        np.fromiter(map(_NUMEL, specs), dtype=np.uint64, count=n)
    over = np.flatnonzero(vals[:n] > numels)  # both uint64: compared exactly
    if over.size:
        s = specs[int(over[0])]
        raise CorruptObjectError(f"{codec_id}: {int(vals[over[0]])} changes in {s.name!r} of {s.numel} elements")
    ints = vals.tolist()
    return ints[:n], ints[n:]


def position_stream(frames: dict[str, memoryview], counts: list[int], raw_len: int, codec_id: str) -> bytes:
    """The object's ``positions`` frame decompressed (the LEB128 gap stream, ``raw_len`` bytes as its header
    says, at most 10 a position): :class:`CorruptObjectError` for anything else."""
    if raw_len > 10 * sum(counts):
        raise CorruptObjectError(f"{codec_id}: position stream of {raw_len} bytes for {sum(counts)} changes")
    if "positions" not in frames:
        raise CorruptObjectError(f"{codec_id}: object lacks its positions")
    return zstd_decompress(frames["positions"], raw_len, f"{codec_id} positions")


def read_positions(frames: dict[str, memoryview], specs: Sequence[TensorSpec], counts: list[int], raw_len: int,
                   codec_id: str) -> tuple[np.ndarray, np.ndarray]:
    """The object's ``positions`` stream decoded: every tensor's positions in turn, and their bounds
    (see :func:`decode_positions`)."""
    stream = position_stream(frames, counts, raw_len, codec_id)
    return decode_positions(stream, counts, [s.numel for s in specs], codec_id)


class ZstdLevel:
    """Config shared by the zstd-based codecs: ``level`` (zstd level, default 1)."""

    def __init__(self, level: int = 1):
        if not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22:
            raise ValueError(f"level must be an integer in [-7, 22], got {level!r}")
        self.level = level

    def get_config(self) -> dict[str, Any]:
        return {"level": self.level}


def position_bits(numel: int, changed: int) -> float:
    """Bits per changed element of an ideal code for ``changed`` independent positions among ``numel``."""
    if changed <= 0 or changed >= numel:
        return 0.0
    p = changed / numel
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / p  # math, not numpy: asked per tensor
