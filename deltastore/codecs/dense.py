"""``dense``: whole tensors (anchors), byte planes compressed with zstd.

Format 2.1 (written with ``planes=True``): tensors, in name order, are laid out
in **groups**: a tensor of ``chunk`` elements or more is a group by itself; smaller
ones are packed, in order, with the following small tensors of the same element
width and kind (float or not) into groups of at most ``chunk`` elements. A
group is the flat concatenation of its tensors' raw bits; float bits are
first rotated left by one bit (the sign moves to bit 0, so for bf16 byte 1 is
exactly the 8-bit exponent and byte 0 the sign and mantissa, as ZipNN does).
The group is cut into chunks of at most ``chunk`` elements, and every chunk
into its byte planes (plane ``j`` = byte ``j`` of each element's value,
0 = least significant). The object is a safetensors file with one uint8
tensor ``frames`` (every frame, in index order) and the header metadata
``deltastore.names`` (the name digest, see ``docs/codecs.md``) and
``deltastore.dense.groups`` = JSON
``[{"tensors": [name, ...], "frames": [[plane, start, count, nbytes, stored], ...]}, ...]``.
Frames of a group come chunk after chunk (``start`` = 0, then the previous
start + count, up to the group's element count), and within a chunk plane 0
to ``width - 1``, all with the same ``start`` and ``count``. ``stored`` is
``"z"`` (one zstd frame declaring content size ``count``) or ``"r"`` (the
``count`` bytes as they are, when zstd would not shrink them: mantissas).
Packing gives many small tensors one frame set (cost follows elements, not
tensor count); chunks let frames be compressed and decoded in parallel. The
zstd parameters are the encoder's choice (config ``level`` and ``hash_log``);
for bf16 weights the exponent plane compresses to about a third and the object
to ≈ 66-67 % of the raw size.

Format 2.0 (written by deltastore ≤ 0.1 with ``planes=True``, still read): one
uint8 tensor ``<name>`` per tensor holding its frames, and the metadata
``deltastore.dense`` = JSON ``{name: [[plane, elem_start, elem_count, nbytes,
stored], ...]}``: the same planes and rotation, frames per tensor. A 2.0 reader
refuses a 2.1 object (``CorruptObjectError``: no ``deltastore.dense`` index).

Format 1.0 (the default, and always read): one tensor per name in its own dtype and shape, a
plain safetensors checkpoint.

Memory: a decoder allocates exactly one output buffer per tensor (its size
from the specs, i.e. the manifest) and writes the planes straight into it;
every zstd frame must declare the content size the index implies before it is
decompressed, so nothing larger than the specs imply is ever allocated.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard

from ..errors import CorruptObjectError, UnsupportedFormatError
from ..kernels import planes as _planes
from ..kernels.parallel import chunked
from ._common import MANTISSA_BITS, names_digest, np_bits_dtype, pack_meta, parallel_map, to_torch_bits
from ._common import unpack_meta, zstd_decompress
from ._safetensors import pack_u8, take, view
from .base import Codec, OldBits, TensorSpec, Update

#: format written with ``planes=True``
PLANES_VERSION = "2.1"
_GROUPS_KEY = "deltastore.dense.groups"
#: bytes of a plane test-compressed (4 evenly spaced slices) before a whole frame is
_SAMPLE = 1 << 16
#: a frame is compressed only if its sample shrinks below this fraction
_WORTH = 0.97

_tls = threading.local()


def _cctx(level: int, hash_log: int | None) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``(level, hash_log)`` (zstd contexts are not shared across threads)."""
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    c = cache.get((level, hash_log))
    if c is None:
        if hash_log is None:
            c = zstandard.ZstdCompressor(level=level, write_content_size=True)
        else:
            params = zstandard.ZstdCompressionParameters.from_level(level, hash_log=hash_log, write_content_size=1)
            c = zstandard.ZstdCompressor(compression_params=params)
        cache[(level, hash_log)] = c
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def _decompress(data: memoryview, count: int, what: str) -> bytes:
    """Exactly ``count`` bytes from one zstd frame; the declared size is checked first (bomb-safe)."""
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: not a zstd frame ({e})") from None
    if declared != count:
        raise CorruptObjectError(f"{what}: zstd frame declares {declared} bytes, {count} expected")
    try:
        out = _dctx().decompress(data, max_output_size=count, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: zstd stream is corrupt ({e})") from None
    if len(out) != count:  # pragma: no cover - zstd checks the declared size itself
        raise CorruptObjectError(f"{what}: zstd frame holds {len(out)} bytes, {count} expected")
    return out


def _compress_plane(plane: np.ndarray, level: int, hash_log: int | None) -> tuple[str, Any]:
    """``("z", zstd frame)`` or, when zstd would not shrink it, ``("r", plane)``."""
    n = plane.size
    c = _cctx(level, hash_log)
    if n > 4 * _SAMPLE:
        step, part = n // 4, _SAMPLE // 4
        sample = np.concatenate([plane[i * step:i * step + part] for i in range(4)])
        if len(c.compress(sample)) > _WORTH * sample.size:
            return "r", plane
    z = c.compress(plane)
    return ("z", z) if len(z) < n else ("r", plane)


#: the integer dtype holding raw bits, by element width (``TensorSpec.bits_dtype`` costs a torch call per tensor)
_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _kind(spec: TensorSpec) -> tuple[int, bool]:
    """(element width, rotated?) of a tensor: its group kind."""
    return spec.dtype.itemsize, spec.dtype in MANTISSA_BITS


@dataclass
class _Group:
    """Tensors laid out back to back: member ``i`` is ``names[i]``, ``sizes[i]`` elements from ``offsets[i]``."""

    width: int
    rotate: bool
    names: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    total: int = 0

    def add(self, name: str, numel: int) -> None:
        self.names.append(name)
        self.sizes.append(numel)
        self.offsets.append(self.total)
        self.total += numel

    def segments(self, start: int, stop: int) -> list[tuple[str, int, int, int]]:
        """``(name, a, b, offset)`` for each member with elements ``[a, b)`` (group coordinates) in ``[start, stop)``."""
        first = max(0, bisect.bisect_right(self.offsets, start) - 1)
        last = bisect.bisect_left(self.offsets, stop)
        out = []
        for i in range(first, max(first, last)):
            off = self.offsets[i]
            a, b = max(start, off), min(stop, off + self.sizes[i])
            if a < b:
                out.append((self.names[i], a, b, off))
        return out


def make_groups(specs: Sequence[TensorSpec], chunk: int) -> list[_Group]:
    """Format 2.1's grouping of ``specs`` (already in name order); see the module docstring."""
    groups: list[_Group] = []
    open_: dict[tuple[int, bool], _Group] = {}
    for s in specs:
        kind = _kind(s)
        n = s.numel
        if n >= chunk:
            groups.append(_Group(*kind))
            groups[-1].add(s.name, n)
            continue
        g = open_.get(kind)
        if g is None or g.total + n > chunk:
            g = open_[kind] = _Group(*kind)
            groups.append(g)
        g.add(s.name, n)
    return groups


def _seg_arrays(segs: list[tuple[str, int, int, int]], start: int, width: int,
                addr: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(addresses, counts, plane starts) of segments ``(name, a, b, offset)`` of a unit starting at ``start``."""
    addrs = np.array([addr[name] + (a - off) * width for name, a, _, off in segs], dtype=np.uint64)
    counts = np.array([b - a for _, a, b, _ in segs], dtype=np.int64)
    starts = np.array([a - start for _, a, _, _ in segs], dtype=np.int64)
    return addrs, counts, starts


def _encode_unit(g: _Group, start: int, count: int, srcs: dict[str, torch.Tensor], addr: dict[str, int],
                 level: int, hash_log: int | None) -> list[tuple[list[Any], Any]]:
    """Frames (index entry, bytes) of elements ``[start, start + count)`` of group ``g``."""
    segs = g.segments(start, start + count)
    if g.width == 1 and len(segs) == 1 and segs[0][2] - segs[0][1] == count:
        name, a, b, off = segs[0]  # a single byte plane is the tensor itself: no copy
        planes = [srcs[name].numpy()[a - off:b - off]]
    else:
        rows = np.empty((g.width, count), np.uint8)
        planes = list(rows)
        _planes.split_segments(g.width, g.rotate, *_seg_arrays(segs, start, g.width, addr), planes)
    out = []
    for j, p in enumerate(planes):
        stored, data = _compress_plane(p, level, hash_log)
        out.append(([j, start, count, len(data), stored], data))
    return out


def _src(u: Update) -> torch.Tensor:
    """An update's bits as a flat contiguous CPU integer tensor (a copy only when they are not one already)."""
    t = u.bits.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.cpu().contiguous()
    t = t.reshape(-1)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        t = t.view(_TORCH_BITS[t.dtype.itemsize])
    return t


def _parallel(n: int, fn: Any) -> list[Any]:
    """``[fn(i) for i in range(n)]``, one kernel-pool task per item (dynamic balance of uneven units)."""
    parts = chunked(n, lambda s, e: [fn(i) for i in range(s, e)], min_chunk=1, pieces=max(1, n))
    return [r for part in parts for r in part]


class DenseCodec(Codec):
    """Whole tensors; with ``planes=True`` as zstd-compressed byte planes (format 2.1), else plain (format 1.0).

    Config: ``planes`` (default False, so objects stay readable by older
    readers and plain safetensors tools), ``level`` (zstd level, 1),
    ``chunk`` (elements per frame, and the size below which tensors are
    packed together), ``hash_log`` (zstd hash table log for the planes; the
    default 6 keeps zstd from chasing short matches in exponent bytes, which
    makes them both smaller and ~3x faster to code than level 1's default;
    ``None`` = the level's own). :meth:`describe` records the format actually
    written. Reads 1.0, 2.0 and 2.1 objects.
    """

    codec_id = "dense"
    format_version = PLANES_VERSION
    readable_majors = ("1",)
    dense = True

    def __init__(self, planes: bool = False, level: int = 1, chunk: int = 1 << 22, hash_log: int | None = 6):
        if not isinstance(planes, bool):
            raise ValueError(f"planes must be a bool, got {planes!r}")
        self.planes = planes
        if not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22:
            raise ValueError(f"level must be an integer in [-7, 22], got {level!r}")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        if hash_log is not None and (not isinstance(hash_log, int) or isinstance(hash_log, bool)
                                     or not 6 <= hash_log <= 30):
            raise ValueError(f"hash_log must be None or an integer in [6, 30], got {hash_log!r}")
        self.level, self.chunk, self.hash_log = level, chunk, hash_log

    def get_config(self) -> dict[str, Any]:
        if not self.planes:
            return {}
        return {"planes": True, "level": self.level, "chunk": self.chunk, "hash_log": self.hash_log}

    def describe(self) -> dict[str, Any]:
        return {"id": self.codec_id, "version": PLANES_VERSION if self.planes else "1.0",
                "config": self.get_config()}

    # --- encode ------------------------------------------------------------------------------------

    def encode(self, updates: Sequence[Update]) -> bytes:
        if any(u.positions is not None for u in updates):
            raise ValueError("dense encodes whole tensors only")
        for u in updates:
            if u.bits.numel() != u.spec.numel:
                raise ValueError(f"dense: {u.spec.name} has {u.bits.numel()} elements, spec says {u.spec.numel}")
        if not self.planes:
            plain = {u.spec.name: u.bits.view(u.spec.dtype).reshape(u.spec.shape) for u in updates}
            return pack_meta(plain, self.codec_id, "1.0", {})
        ups = sorted(updates, key=lambda u: u.spec.name)
        if len({u.spec.name for u in ups}) != len(ups):
            raise ValueError("dense: duplicate tensor names")
        srcs = {u.spec.name: _src(u) for u in ups}
        groups = make_groups([u.spec for u in ups], self.chunk)
        units = [(g, start, min(self.chunk, g.total - start)) for g in groups for start in range(0, g.total, self.chunk)]
        addr = {name: t.data_ptr() for name, t in srcs.items()}
        frames = _parallel(len(units), lambda i: _encode_unit(*units[i], srcs, addr, self.level, self.hash_log))
        index, pieces, k = [], [], 0
        for g in groups:
            entries = []
            for _ in range(-(-g.total // self.chunk)):
                for entry, data in frames[k]:
                    entries.append(entry)
                    pieces.append(data)
                k += 1
            index.append({"tensors": g.names, "frames": entries})
        meta = {"deltastore.codec": self.codec_id, "deltastore.codec_version": PLANES_VERSION,
                "deltastore.names": names_digest([u.spec.name for u in ups]),
                _GROUPS_KEY: json.dumps(index, separators=(",", ":"))}
        return pack_u8({"frames": pieces}, meta)

    # --- decode ------------------------------------------------------------------------------------

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        tensors, meta = view(data, self.codec_id)
        if meta.get("deltastore.codec", self.codec_id) != self.codec_id:
            raise CorruptObjectError(f"dense: object was written by codec {meta.get('deltastore.codec')!r}")
        version = meta.get("deltastore.codec_version", "1.0")
        if version == PLANES_VERSION:
            return _decode_v21(tensors, meta, specs)
        raw, meta = unpack_meta(data, self.codec_id)
        if version.split(".")[0] == "1":
            return _decode_v1(raw, specs)
        if version != "2.0":
            raise UnsupportedFormatError(f"dense: object format {version!r} is newer than this reader "
                                         f"(1.x, 2.0, {PLANES_VERSION}); upgrade deltastore")
        return _decode_v20(raw, meta, specs)


def _decode_v21(tensors: dict[str, tuple[str, tuple[int, ...], memoryview]], meta: dict[str, str],
                specs: Sequence[TensorSpec]) -> dict[str, Update]:
    if set(tensors) != {"frames"} or tensors["frames"][0] != "U8" or len(tensors["frames"][1]) != 1:
        raise CorruptObjectError(f"dense: a {PLANES_VERSION} object holds one 1-D uint8 tensor 'frames', "
                                 f"found {sorted(tensors)}")
    payload = tensors["frames"][2]
    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs):
        raise CorruptObjectError("dense: duplicate tensor names in the specs")
    if meta.get("deltastore.names") != names_digest(sorted(by_name)):
        raise CorruptObjectError(f"dense: object holds tensors {meta.get('deltastore.names')!r}, "
                                 f"manifest expects {names_digest(sorted(by_name))!r}")
    try:
        doc = json.loads(meta[_GROUPS_KEY])
    except (KeyError, ValueError) as e:
        raise CorruptObjectError(f"dense: object lacks a valid group index ({e!r})") from None
    if not isinstance(doc, list):
        raise CorruptObjectError("dense: group index is not a list")
    groups: list[_Group] = []
    units: list[tuple[_Group, int, int, list[tuple[str, int, int]]]] = []
    seen: set[str] = set()
    off = 0
    for gd in doc:
        if not isinstance(gd, dict) or not isinstance(gd.get("tensors"), list) or not isinstance(gd.get("frames"), list):
            raise CorruptObjectError(f"dense: bad group entry {str(gd)[:200]}")
        g: _Group | None = None
        for name in gd["tensors"]:
            if not isinstance(name, str) or name not in by_name or name in seen:
                raise CorruptObjectError(f"dense: group names {str(name)[:200]!r}, unknown or listed twice")
            seen.add(name)
            s = by_name[name]
            kind = _kind(s)
            if g is None:
                g = _Group(*kind)
            elif kind != (g.width, g.rotate):
                raise CorruptObjectError(f"dense: {name!r} ({s.dtype}) does not fit its group's element kind")
            g.add(name, s.numel)
        if g is None:
            raise CorruptObjectError("dense: empty group")
        frames, w, at = gd["frames"], g.width, 0
        if len(frames) % w:
            raise CorruptObjectError(f"dense: group of {g.names[0]!r} has {len(frames)} frames for {w} planes")
        for k in range(0, len(frames), w):
            planes = []
            count = -1
            for j, e in enumerate(frames[k:k + w]):
                if (not isinstance(e, list) or len(e) != 5 or e[4] not in ("z", "r")
                        or not all(isinstance(x, int) and not isinstance(x, bool) for x in e[:4])):
                    raise CorruptObjectError(f"dense: bad frame entry {str(e)[:200]}")
                plane, start, cnt, nbytes, stored = e
                if count < 0:
                    count = cnt
                if plane != j or start != at or cnt != count or cnt <= 0 or start + cnt > g.total or nbytes < 0:
                    raise CorruptObjectError(f"dense: frame {e!r} out of place in the group of {g.names[0]!r}")
                if stored == "r" and nbytes != cnt:
                    raise CorruptObjectError(f"dense: raw frame {e!r} must hold {cnt} bytes")
                if off + nbytes > payload.nbytes:
                    raise CorruptObjectError("dense: frames are truncated")
                planes.append((stored, off, nbytes))
                off += nbytes
            units.append((g, at, count, planes))
            at += count
        if at != g.total:
            raise CorruptObjectError(f"dense: frames of the group of {g.names[0]!r} cover {at} of "
                                     f"{g.total} elements")
        groups.append(g)
    if seen != set(by_name):
        raise CorruptObjectError(f"dense: object lacks tensors {sorted(set(by_name) - seen)[:5]}")
    if off != payload.nbytes:
        raise CorruptObjectError(f"dense: {payload.nbytes - off} bytes after the last frame")

    outs = {s.name: torch.empty(s.numel, dtype=_TORCH_BITS[s.dtype.itemsize]) for s in specs}
    addr = {name: t.data_ptr() for name, t in outs.items()}

    def one(i: int) -> None:
        g, start, count, frames = units[i]
        planes = []
        for stored, o, nbytes in frames:
            if stored == "r":
                planes.append(np.frombuffer(payload, np.uint8, count, o))
            else:
                raw = _decompress(payload[o:o + nbytes], count, f"dense frame at {o}")
                planes.append(np.frombuffer(raw, np.uint8))
        addrs, counts, starts = _seg_arrays(g.segments(start, start + count), start, g.width, addr)
        _planes.join_segments(g.width, g.rotate, planes, starts, counts, addrs)

    _parallel(len(units), one)
    return {s.name: Update(s, outs[s.name]) for s in specs}


def _decode_v20(raw: dict[str, torch.Tensor], meta: dict[str, str], specs: Sequence[TensorSpec]) -> dict[str, Update]:
    try:
        index = json.loads(meta["deltastore.dense"])
    except (KeyError, ValueError) as e:
        raise CorruptObjectError(f"dense: object lacks a valid frame index ({e!r})") from None
    if not isinstance(index, dict):
        raise CorruptObjectError("dense: frame index is not an object")
    result = {}
    for spec in specs:
        t = take(raw, spec.name, "dense")
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise CorruptObjectError(f"dense: {spec.name} payload is {t.dtype}{tuple(t.shape)}")
        bits = _join_planes_v20(spec, index.get(spec.name), memoryview(t.numpy()).cast("B"))
        result[spec.name] = Update(spec, to_torch_bits(bits, spec))
    return result


def _join_planes_v20(spec: TensorSpec, index: Any, payload: memoryview) -> np.ndarray:
    """One tensor of a 2.0 object, checking its frames tile every plane exactly once."""
    dt = np_bits_dtype(spec)
    width, n = dt.itemsize, spec.numel
    if not isinstance(index, list):
        raise CorruptObjectError(f"dense: bad frame index for {spec.name!r}")
    spans: list[list[tuple[int, int]]] = [[] for _ in range(width)]
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
        spans[j].append((start, count))
        off += nbytes
    for j, sp in enumerate(spans):
        at = 0
        for start, count in sorted(sp):
            if start != at:
                raise CorruptObjectError(f"dense: frames of {spec.name!r} do not tile plane {j}")
            at += count
        if at != n:
            raise CorruptObjectError(f"dense: frames of {spec.name!r} cover {at} of {n} elements of plane {j}")
    if off != len(payload):
        raise CorruptObjectError(f"dense: frames of {spec.name!r} leave {len(payload) - off} bytes unused")
    planes = np.empty((width, n), dtype=np.uint8)

    def one(job: tuple[int, int, int, memoryview, str]) -> None:
        j, start, count, data, stored = job
        raw = zstd_decompress(data, count, f"dense {spec.name}") if stored == "z" else data
        if len(raw) != count:
            raise CorruptObjectError(f"dense: raw frame of {spec.name!r} has {len(raw)} bytes, {count} expected")
        planes[j, start:start + count] = np.frombuffer(raw, np.uint8)

    parallel_map(one, jobs)
    out = np.empty(n, dtype=dt)
    _planes.join(list(planes), spec.dtype in MANTISSA_BITS, out)
    return out


def _decode_v1(raw: dict[str, torch.Tensor], specs: Sequence[TensorSpec]) -> dict[str, Update]:
    result = {}
    for spec in specs:
        t = take(raw, spec.name, "dense")
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise CorruptObjectError(f"dense: {spec.name} is {t.dtype}{tuple(t.shape)}, "
                                     f"expected {spec.dtype}{spec.shape}")
        result[spec.name] = Update(spec, t.reshape(-1).view(spec.bits_dtype))
    return result
