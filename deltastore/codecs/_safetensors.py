"""Safetensors framing shared by the built-in codecs."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Mapping

import numpy as np
import torch
from safetensors.torch import load as st_load

from ..errors import CorruptObjectError

_PyBytes_New = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_New.restype = ctypes.py_object
_PyBytes_New.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
_PyBytes_AsString.restype = ctypes.c_void_p
_PyBytes_AsString.argtypes = (ctypes.py_object,)
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform == "linux" else None
    _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)  # type: ignore[union-attr]
except (OSError, AttributeError):  # pragma: no cover - no libc / no madvise
    _LIBC = None


def pack(tensors: Mapping[str, torch.Tensor], codec_id: str, version: str) -> bytes:
    """Safetensors bytes with the codec named in the header metadata (deterministic: :func:`pack_sorted`)."""
    return pack_sorted(tensors, {"deltastore.codec": codec_id, "deltastore.codec_version": version})


_ST_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
             torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
             torch.float64: "F64", torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fn: "F8_E4M3"}


def pack_sorted(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """Safetensors bytes that depend on the contents alone.

    ``safetensors.torch.save`` writes the metadata in arbitrary order, so the
    same object would hash differently from one process to the next (and
    content addressing would store it twice). Here metadata keys are sorted,
    and tensors are laid out by element size (largest first, so each stays
    aligned) then name, as safetensors itself orders them.
    """
    import json

    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    chunks, off = [], 0
    for name in order:
        t = tensors[name].detach().contiguous().cpu()
        if t.dtype not in _ST_NAMES:
            raise ValueError(f"cannot store {t.dtype} in a safetensors object")
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + data.size]}
        off += data.size
        chunks.append(memoryview(data))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([len(text).to_bytes(8, "little"), text, *chunks])


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


#: safetensors dtype names and their element sizes (what :func:`view` accepts)
_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: the largest header we parse (safetensors' own limit is 100 MB)
MAX_HEADER = 100_000_000


def u8_header(sizes: Mapping[str, int], metadata: Mapping[str, str]) -> bytes:
    """The first bytes (length + JSON header, padded with spaces to 8 bytes) of a safetensors file holding
    one 1-D uint8 tensor of ``sizes[name]`` bytes per name, in that order; the data follows it."""
    import json

    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for name, size in sizes.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [off, off + size]}
        off += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def pack_u8(pieces: Mapping[str, list], metadata: Mapping[str, str]) -> bytes:
    """Safetensors bytes holding one 1-D uint8 tensor per key, each the concatenation of its byte ``pieces``.

    The file is what ``safetensors.torch.save`` writes for the same tensors
    (header padded with spaces to 8 bytes), assembled with a single copy of the
    pieces (any buffer-protocol objects).
    """
    views = {name: [memoryview(p).cast("B") for p in parts] for name, parts in pieces.items()}
    head = u8_header({name: sum(m.nbytes for m in mv) for name, mv in views.items()}, metadata)
    return b"".join([head, *(m for mv in views.values() for m in mv)])


def new_bytes(n: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` object of ``n`` bytes and a writable uint8 array over its memory, to fill it in place.

    CPython allows exactly this for an object it has just created with
    ``PyBytes_FromStringAndSize(NULL, n)`` (its contents are then
    uninitialised): the caller must write every byte before the object is
    used, hashed or shared, and keep it alive while the array is used. This
    lets an encoder write a large object once, straight into its final
    memory (no joined copy). Large buffers are advised onto transparent huge
    pages, as numpy does for its own (far fewer page faults when first
    written). Elsewhere than CPython: a bytearray copied into bytes at the end
    is not offered; use :func:`pack_u8`.
    """
    import ctypes

    b = _PyBytes_New(None, n)
    addr = _PyBytes_AsString(b)
    arr = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(addr)) if n else np.empty(0, np.uint8)
    _advise_huge(addr, n)
    return b, arr


def _advise_huge(addr: int, n: int) -> None:
    huge = 1 << 21
    lo, hi = -(-addr // huge) * huge, (addr + n) // huge * huge
    if hi - lo >= huge and _LIBC is not None:
        _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 14)  # MADV_HUGEPAGE; a failure is harmless


Header = tuple[dict, dict[str, str], memoryview]


def header(data: bytes | memoryview, codec_id: str) -> Header:
    """``(tensor entries, metadata, data section)`` of a safetensors file, the entries not yet checked.

    Checks the header length and JSON and the metadata (a dict of strings);
    any failure is :class:`CorruptObjectError`. No copy of the data.
    """
    import json

    buf = memoryview(data).cast("B")
    if buf.nbytes < 8:
        raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: {buf.nbytes} bytes")
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER or 8 + n > buf.nbytes:
        raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: header of {n} bytes")
    try:
        head = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: bad header ({e})") from None
    if not isinstance(head, dict):
        raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: header is not an object")
    meta = head.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptObjectError(f"{codec_id} object has bad safetensors metadata")
    return head, meta, buf[8 + n:]


def view(data: bytes | memoryview, codec_id: str, parsed: Header | None = None
         ) -> tuple[dict[str, tuple[str, tuple[int, ...], memoryview]], dict[str, str]]:
    """Parse a safetensors file without copying: ``({name: (dtype, shape, bytes view)}, metadata)``.

    Checks what the safetensors library checks (header length and JSON, known
    dtypes, sizes matching shapes, data offsets contiguous from 0 and covering
    the data exactly); any failure is :class:`CorruptObjectError`. The views
    share ``data``'s memory. ``parsed``: :func:`header`'s result for ``data``
    when the caller already has it.
    """
    import math

    head, meta, body = parsed if parsed is not None else header(data, codec_id)
    entries = []
    for name, info in head.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (dtype in _DTYPE_SIZES and isinstance(shape, list)
                  and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                  and all(isinstance(x, int) and not isinstance(x, bool) for x in (begin, end))
                  and 0 <= begin <= end and end - begin == math.prod(shape) * _DTYPE_SIZES[dtype])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: bad entry {name!r}")
        entries.append((begin, end, name, dtype, tuple(shape)))
    entries.sort()
    at = 0
    out = {}
    for begin, end, name, dtype, shape in entries:
        if begin != at:
            raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: data offsets of {name!r}")
        out[name] = (dtype, shape, body[begin:end])
        at = end
    if at != body.nbytes:
        raise CorruptObjectError(f"{codec_id} object is not a valid safetensors file: "
                                 f"{body.nbytes} data bytes, {at} described")
    return out, meta
