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
from the specs, i.e. the manifest), or takes the caller's (``decode_into``),
and writes the planes straight into it;
every zstd frame must declare the content size the index implies before it is
decompressed, so nothing larger than the specs imply is ever allocated.
"""

from __future__ import annotations

import json
import math
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard

from .._memory import on_release
from ..errors import CorruptObjectError, UnsupportedFormatError
from ..kernels import planes as _planes
from ..kernels.parallel import chunked
from ._common import MANTISSA_BITS, names_digest, np_bits_dtype, pack_meta, parallel_map, to_torch_bits
from ._common import unpack_meta, zstd_decompress
from ._safetensors import header, new_bytes, take, u8_header, view
from .base import Codec, OldBits, TensorSpec, Update

#: format written with ``planes=True``
PLANES_VERSION = "2.1"
_GROUPS_KEY = "deltastore.dense.groups"
#: bytes of a plane test-compressed (4 evenly spaced slices) before a whole frame is
_SAMPLE = 1 << 16
#: a frame is compressed only if its sample shrinks below this fraction
_WORTH = 0.97

#: compressors by (level, hash_log), idle between the calls that use them: an anchor's frames reuse them, and
#: they are dropped after each publish (``deltastore._memory.release_memory``), so that the tables of a large
#: input (megabytes at level 1) do not stay resident between versions
_idle: dict[tuple[int, int | None], list[zstandard.ZstdCompressor]] = {}
_idle_lock = threading.Lock()


def _take_cctx(level: int, hash_log: int | None) -> zstandard.ZstdCompressor:
    """An idle compressor for ``(level, hash_log)``, or a new one (a context serves one thread at a time)."""
    with _idle_lock:
        free = _idle.get((level, hash_log))
        if free:
            return free.pop()
    if hash_log is None:
        return zstandard.ZstdCompressor(level=level, write_content_size=True)
    params = zstandard.ZstdCompressionParameters.from_level(level, hash_log=hash_log, write_content_size=1)
    return zstandard.ZstdCompressor(compression_params=params)


def _give_cctx(level: int, hash_log: int | None, c: zstandard.ZstdCompressor) -> None:
    with _idle_lock:
        _idle.setdefault((level, hash_log), []).append(c)


def drop_contexts() -> None:
    """Forget the idle compressors (their memory goes back with them)."""
    with _idle_lock:
        _idle.clear()


on_release(drop_contexts)


def _compress_plane(plane: np.ndarray, level: int, hash_log: int | None) -> tuple[str, Any]:
    """``("z", zstd frame)`` or, when zstd would not shrink it, ``("r", plane)``."""
    n = plane.size
    c = _take_cctx(level, hash_log)
    try:
        if n > 4 * _SAMPLE:
            step, part = n // 4, _SAMPLE // 4
            sample = np.concatenate([plane[i * step:i * step + part] for i in range(4)])
            if len(c.compress(sample)) > _WORTH * sample.size:
                return "r", plane
        z = c.compress(plane)
    finally:
        _give_cctx(level, hash_log, c)
    return ("z", z) if len(z) < n else ("r", plane)


#: the integer dtype holding raw bits, by element width (``TensorSpec.bits_dtype`` costs a torch call per tensor)
_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_BITS = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}


_KINDS: dict[torch.dtype, tuple[int, bool]] = {dt: (dt.itemsize, dt in MANTISSA_BITS) for dt in
                                               (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                                torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                                                torch.bool)}


def _kind(dtype: torch.dtype) -> tuple[int, bool]:
    """(element width, rotated?) of a dtype: its group kind."""
    k = _KINDS.get(dtype)
    return k if k is not None else (dtype.itemsize, dtype in MANTISSA_BITS)


class _Group:
    """Tensors laid out back to back: member ``i`` is ``names[i]``, ``sizes[i]`` elements from ``offsets[i]``."""

    def __init__(self, width: int, rotate: bool, names: list[str], sizes: list[int]):
        self.width, self.rotate, self.names = width, rotate, names
        self.sizes = np.array(sizes, dtype=np.int64)
        self.offsets = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(self.sizes[:-1], out=self.offsets[1:])
        self.total = int(self.sizes.sum())
        self.addrs = np.zeros(len(sizes), dtype=np.uint64)  # filled by the encoder / decoder

    def segments(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Members holding elements of ``[start, stop)``: (member indices, addresses of their first such
        element, element counts, starts relative to ``start``). Vectorised: no per-tensor Python."""
        lo = max(0, int(np.searchsorted(self.offsets, start, "right")) - 1)
        hi = int(np.searchsorted(self.offsets, stop, "left"))
        off, size = self.offsets[lo:hi], self.sizes[lo:hi]
        a, b = np.maximum(off, start), np.minimum(off + size, stop)
        keep = np.nonzero(a < b)[0]
        a, b, off = a[keep], b[keep], off[keep]
        addrs = self.addrs[lo:hi][keep] + ((a - off) * self.width).astype(np.uint64)
        return keep + lo, addrs, b - a, a - start


def make_groups(specs: Sequence[TensorSpec], chunk: int) -> list[_Group]:
    """Format 2.1's grouping of ``specs`` (already in name order); see the module docstring."""
    order: list[list[Any]] = []  # [width, rotate, names, sizes, total] in order of their first tensor
    open_: dict[tuple[int, bool], list[Any]] = {}
    for s in specs:
        kind = _kind(s.dtype)
        n = math.prod(s.shape)
        if n >= chunk:
            order.append([*kind, [s.name], [n], n])
            continue
        g = open_.get(kind)
        if g is None or g[4] + n > chunk:
            g = open_[kind] = [*kind, [], [], 0]
            order.append(g)
        g[2].append(s.name)
        g[3].append(n)
        g[4] += n
    return [_Group(w, r, names, sizes) for w, r, names, sizes, _ in order]


@dataclass
class _Unit:
    """Elements ``[start, start + count)`` of a group: one frame per plane."""

    group: _Group
    start: int
    count: int
    stored: list[str] = field(default_factory=list)
    #: the zstd frame of each compressed plane (None for a raw one, which is split again into the object)
    frames: list[bytes | None] = field(default_factory=list)

    def nbytes(self, j: int) -> int:
        f = self.frames[j]
        return self.count if f is None else len(f)


class _Encoder:
    """Two passes over the units, so the object is written once, straight into its final memory.

    1. (parallel) split each unit into this thread's scratch planes and compress
       the planes zstd shrinks; raw planes are dropped, not copied;
    2. the index (all sizes now known) gives every frame's offset; the object
       is allocated once (:func:`new_bytes`) and (parallel) each unit copies
       its zstd frames in and splits its raw planes straight into place.
    """

    def __init__(self, codec: DenseCodec, ups: list[Update]):
        self.codec = codec
        self.srcs = {u.spec.name: _src(u.bits) for u in ups}
        self.names = [u.spec.name for u in ups]
        self.groups = make_groups([u.spec for u in ups], codec.chunk)
        for g in self.groups:
            g.addrs[:] = [self.srcs[name].data_ptr() for name in g.names]
        self.units = [_Unit(g, start, min(codec.chunk, g.total - start))
                      for g in self.groups for start in range(0, g.total, codec.chunk)]
        self._scratch: dict[int, np.ndarray] = {}  # per thread, for this encode only (freed with it)
        self._scratch_size = max((u.group.width * u.count for u in self.units), default=0)

    def scratch(self, width: int, count: int) -> list[np.ndarray]:
        """This thread's plane buffers (``width`` rows of ``count`` bytes), reused across its units."""
        me = threading.get_ident()
        buf = self._scratch.get(me)
        if buf is None or buf.size < width * count:
            buf = self._scratch[me] = np.empty(max(width * count, self._scratch_size), np.uint8)
        return [buf[j * count:(j + 1) * count] for j in range(width)]

    def _split(self, u: _Unit, planes: list[np.ndarray]) -> None:
        g = u.group
        _, addrs, counts, starts = g.segments(u.start, u.start + u.count)
        _planes.split_segments(g.width, g.rotate, addrs, counts, starts, planes)

    def _single_plane(self, u: _Unit) -> np.ndarray | None:
        """For a 1-byte group of one tensor, the plane is the tensor's own bytes (no split needed)."""
        g = u.group
        if g.width != 1 or len(g.names) != 1:
            return None
        return self.srcs[g.names[0]].detach().reshape(-1).view(torch.uint8).numpy()[u.start:u.start + u.count]

    def compress(self, i: int) -> None:
        u = self.units[i]
        one = self._single_plane(u)
        if one is not None:
            planes = [one]
        else:
            planes = self.scratch(u.group.width, u.count)
            self._split(u, planes)
        for p in planes:
            stored, data = _compress_plane(p, self.codec.level, self.codec.hash_log)
            u.stored.append(stored)
            u.frames.append(data if stored == "z" else None)

    def write(self) -> bytes:
        _parallel(len(self.units), self.compress)
        index, offsets, off, k = [], [], 0, 0
        for g in self.groups:
            entries = []
            while k < len(self.units) and self.units[k].group is g:
                u = self.units[k]
                offs = []
                for j in range(g.width):
                    entries.append([j, u.start, u.count, u.nbytes(j), u.stored[j]])
                    offs.append(off)
                    off += u.nbytes(j)
                offsets.append(offs)
                k += 1
            index.append({"tensors": g.names, "frames": entries})
        meta = {"deltastore.codec": self.codec.codec_id, "deltastore.codec_version": PLANES_VERSION,
                "deltastore.names": names_digest(self.names), _GROUPS_KEY: json.dumps(index, separators=(",", ":"))}
        head = u8_header({"frames": off}, meta)
        out, buf = new_bytes(len(head) + off)
        buf[:len(head)] = np.frombuffer(head, np.uint8)
        body = buf[len(head):]

        def place(i: int) -> None:
            u = self.units[i]
            dest = [body[o:o + u.nbytes(j)] for j, o in enumerate(offsets[i])]
            for j, f in enumerate(u.frames):
                if f is not None:
                    dest[j][:] = np.frombuffer(f, np.uint8)
            if all(f is not None for f in u.frames):
                return
            one = self._single_plane(u)
            if one is not None:
                dest[0][:] = one
                return
            scratch = self.scratch(u.group.width, u.count)
            self._split(u, [dest[j] if f is None else scratch[j] for j, f in enumerate(u.frames)])

        _parallel(len(self.units), place)
        return out


def _src(bits: torch.Tensor) -> torch.Tensor:
    """Bits as a contiguous CPU tensor (a copy only when they are not one already; no per-tensor view calls)."""
    if bits.device.type != "cpu" or not bits.is_contiguous():
        bits = bits.detach().cpu().contiguous()
    return bits


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

    def estimate_size(self, spec: TensorSpec, changed: int) -> int:
        """Expected object bytes for ``spec`` stored whole (``changed`` is ignored).

        Format 1.0: the raw bits. Format 2.1: float tensors keep all planes but
        the exponent raw and the exponent plane shrinks to about a third
        (33.6 % on the trace's bf16 weights; 0.36 is assumed), plus the
        tensor's index entry; integer tensors are counted raw.
        """
        if not self.planes:
            return super().estimate_size(spec, changed)
        n, w = spec.numel, spec.dtype.itemsize
        body = n * (w - 1) + int(0.36 * n) if spec.dtype in MANTISSA_BITS else n * w
        return body + len(spec.name) + 40

    # --- encode ------------------------------------------------------------------------------------

    def encode(self, updates: Sequence[Update]) -> bytes:
        if any(u.positions is not None for u in updates):
            raise ValueError("dense encodes whole tensors only")
        for u in updates:
            if u.bits.numel() != u.spec.numel or u.bits.element_size() != u.spec.dtype.itemsize:
                raise ValueError(f"dense: {u.spec.name} bits are {u.bits.numel()} x {u.bits.element_size()} bytes, "
                                 f"its spec says {u.spec.numel} x {u.spec.dtype.itemsize}")
        if not self.planes:
            plain = {u.spec.name: u.bits.view(u.spec.dtype).reshape(u.spec.shape) for u in updates}
            return pack_meta(plain, self.codec_id, "1.0", {})
        ups = sorted(updates, key=lambda u: u.spec.name)
        if len({u.spec.name for u in ups}) != len(ups):
            raise ValueError("dense: duplicate tensor names")
        return _Encoder(self, ups).write()

    # --- decode ------------------------------------------------------------------------------------

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        parsed, version = self._parse(data)
        if version == PLANES_VERSION:
            tensors, meta = view(data, self.codec_id, parsed)
            outs = {s.name: _empty(math.prod(s.shape), _kind(s.dtype)[0]) for s in specs}
            _decode_v21(tensors, meta, specs, [outs[s.name] for s in specs])
            return {s.name: Update(s, outs[s.name]) for s in specs}
        raw, meta = unpack_meta(data, self.codec_id)
        if version.split(".")[0] == "1":
            return _decode_v1(raw, specs)
        if version != "2.0":
            raise UnsupportedFormatError(f"dense: object format {version!r} is newer than this reader "
                                         f"(1.x, 2.0, {PLANES_VERSION}); upgrade deltastore")
        return _decode_v20(raw, meta, specs)

    def decode_into(self, data: bytes, specs: Sequence[TensorSpec], dests: Sequence[torch.Tensor]) -> bool:
        """Format 2.1 objects are decoded straight into ``dests`` (the planes joined where they go);
        older formats answer False."""
        parsed, version = self._parse(data)
        if version != PLANES_VERSION:
            return False
        if len(dests) != len(specs):
            raise ValueError(f"dense: {len(dests)} destinations for {len(specs)} tensors")
        if not _fit(specs, dests):  # C-level passes first; the loop only to name the one that does not fit
            for s, d in zip(specs, dests):
                if not _fit([s], [d]):
                    raise ValueError(f"dense: destination {d.dtype}{tuple(d.shape)} on {d.device} cannot hold "
                                     f"{s.name!r} ({s.dtype}{tuple(s.shape)}, contiguous, on the CPU)")
        tensors, meta = view(data, self.codec_id, parsed)
        _decode_v21(tensors, meta, specs, dests)
        return True

    def _parse(self, data: bytes) -> tuple[Any, str]:
        """The object's safetensors header and its format version; a foreign codec's object is refused."""
        parsed = header(data, self.codec_id)
        meta = parsed[1]
        if meta.get("deltastore.codec", self.codec_id) != self.codec_id:
            raise CorruptObjectError(f"dense: object was written by codec {meta.get('deltastore.codec')!r}")
        return parsed, meta.get("deltastore.codec_version", "1.0")


_NAME, _NUMEL, _ITEMSIZE = operator.attrgetter("name"), operator.attrgetter("numel"), operator.attrgetter("dtype.itemsize")
_IS_CPU, _FIRST, _SECOND = operator.attrgetter("is_cpu"), operator.itemgetter(0), operator.itemgetter(1)


def _fit(specs: Sequence[TensorSpec], dests: Sequence[torch.Tensor]) -> bool:
    """Whether every ``dests[i]`` is a contiguous CPU tensor of ``specs[i]``'s element count and width."""
    return (all(map(_IS_CPU, dests)) and all(map(torch.Tensor.is_contiguous, dests))
            and list(map(torch.Tensor.element_size, dests)) == list(map(_ITEMSIZE, specs))
            and list(map(torch.Tensor.numel, dests)) == list(map(_NUMEL, specs)))


def _decode_v21(tensors: dict[str, tuple[str, tuple[int, ...], memoryview]], meta: dict[str, str],
                specs: Sequence[TensorSpec], outs: Sequence[torch.Tensor]) -> None:
    """Join the 2.1 object's planes into ``outs`` (``outs[i]``: a contiguous CPU buffer of ``specs[i]``'s
    element count and width, checked by the caller); raises :class:`CorruptObjectError` first when the
    index does not describe exactly these tensors."""
    if set(tensors) != {"frames"} or tensors["frames"][0] != "U8" or len(tensors["frames"][1]) != 1:
        raise CorruptObjectError(f"dense: a {PLANES_VERSION} object holds one 1-D uint8 tensor 'frames', "
                                 f"found {sorted(tensors)}")
    payload = tensors["frames"][2]
    info: dict[str, tuple[int, tuple[int, bool]]] = dict(zip(map(_NAME, specs), zip(
        map(_NUMEL, specs), map(_kind, map(operator.attrgetter("dtype"), specs)))))
    if len(info) != len(specs):
        raise CorruptObjectError("dense: duplicate tensor names in the specs")
    want = names_digest(sorted(info))
    if meta.get("deltastore.names") != want:
        raise CorruptObjectError(f"dense: object holds tensors {meta.get('deltastore.names')!r}, manifest expects {want!r}")
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
        names = gd["tensors"]
        if not names:
            raise CorruptObjectError("dense: empty group")
        if not set(map(type, names)) <= {str} or not info.keys() >= set(names):
            bad = next(n for n in names if type(n) is not str or n not in info)
            raise CorruptObjectError(f"dense: group names {str(bad)[:200]!r}, not a tensor of this object")
        before = len(seen)
        seen.update(names)
        if len(seen) != before + len(names):
            raise CorruptObjectError(f"dense: a tensor of the group of {names[0]!r} is listed twice")
        members = list(map(info.__getitem__, names))
        kinds = set(map(_SECOND, members))
        if len(kinds) != 1:
            raise CorruptObjectError(f"dense: the group of {names[0]!r} mixes element kinds")
        g = _Group(*kinds.pop(), names, list(map(_FIRST, members)))
        frames, w, at = gd["frames"], g.width, 0
        if len(frames) % w:
            raise CorruptObjectError(f"dense: group of {names[0]!r} has {len(frames)} frames for {w} planes")
        for k in range(0, len(frames), w):
            planes = []
            count = -1
            for j, e in enumerate(frames[k:k + w]):
                if (not isinstance(e, list) or len(e) != 5 or e[4] not in ("z", "r")
                        or not all(type(x) is int for x in e[:4])):
                    raise CorruptObjectError(f"dense: bad frame entry {str(e)[:200]}")
                plane, start, cnt, nbytes, stored = e
                if count < 0:
                    count = cnt
                if plane != j or start != at or cnt != count or cnt <= 0 or start + cnt > g.total or nbytes < 0:
                    raise CorruptObjectError(f"dense: frame {e!r} out of place in the group of {names[0]!r}")
                if stored == "r" and nbytes != cnt:
                    raise CorruptObjectError(f"dense: raw frame {e!r} must hold {cnt} bytes")
                if off + nbytes > payload.nbytes:
                    raise CorruptObjectError("dense: frames are truncated")
                planes.append((stored, off, nbytes))
                off += nbytes
            units.append((g, at, count, planes))
            at += count
        if at != g.total:
            raise CorruptObjectError(f"dense: frames of the group of {names[0]!r} cover {at} of {g.total} elements")
        groups.append(g)
    if len(seen) != len(info):
        raise CorruptObjectError(f"dense: object lacks tensors {sorted(info.keys() - seen)[:5]}")
    if off != payload.nbytes:
        raise CorruptObjectError(f"dense: {payload.nbytes - off} bytes after the last frame")

    addr = dict(zip(map(_NAME, specs), map(torch.Tensor.data_ptr, outs)))
    for g in groups:
        g.addrs[:] = list(map(addr.__getitem__, g.names))

    def one(i: int) -> None:
        g, start, count, frames = units[i]
        planes = []
        for stored, o, nbytes in frames:
            if stored == "r":
                planes.append(np.frombuffer(payload, np.uint8, count, o))
            else:
                raw = zstd_decompress(payload[o:o + nbytes], count, f"dense frame at {o}")
                planes.append(np.frombuffer(raw, np.uint8))
        _, addrs, counts, starts = g.segments(start, start + count)
        _planes.join_segments(g.width, g.rotate, planes, starts, counts, addrs)

    _parallel(len(units), one)


#: below this many bytes torch.empty is cheaper; above, numpy's buffers (advised onto transparent huge pages)
#: take far fewer page faults when first written
_HUGE = 1 << 20


def _empty(n: int, width: int) -> torch.Tensor:
    """A new flat tensor of ``n`` raw-bits elements of ``width`` bytes (uninitialised)."""
    if n * width < _HUGE:
        return torch.empty(n, dtype=_TORCH_BITS[width])
    return torch.from_numpy(np.empty(n, _NP_BITS[width]))


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
