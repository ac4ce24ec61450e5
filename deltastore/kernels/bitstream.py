"""Bit streams and code-cost counting for the built-in sparse codecs (numba, nogil).

The byte layout is the one :mod:`deltastore.codecs._bits` documents: a unary
stream U (``q`` zero bits then a one bit per value) and a raw stream R (each
value in ``w`` bits), both most-significant bit first, zero padded. These
kernels write and read exactly those bytes; callers check sizes and widths
first (see ``_bits``), so a kernel never reads or writes out of bounds on
validated input and reports shortfalls through its return values.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from .checksum import C1, _fmix
from .diff import _at, _prefetch_for_write, _voidptr, segment_runs  # address -> array, for data where it lies
from .jit import njit
from .parallel import chunked, each, threads

_U64 = np.uint64


@njit(nogil=True, cache=True)
def _pack_unary(q: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    pos = 0
    for i in range(q.size):
        pos += q[i]
        out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
        pos += 1


def pack_unary(q: np.ndarray) -> bytes:
    """U stream of the non-negative int64 quotients ``q``."""
    if q.size == 0:
        return b""
    q = np.ascontiguousarray(q, dtype=np.int64)
    total = int(q.sum()) + q.size
    out = np.zeros((total + 7) // 8, np.uint8)
    _pack_unary(q, out)
    return out.tobytes()


@njit(nogil=True, cache=True)
def _unpack_unary(data: np.ndarray, count: int, out: np.ndarray) -> int:  # pragma: no cover - compiled
    found = 0
    last = -1
    for byte in range(data.size):
        b = data[byte]
        if b == 0:
            continue
        for j in range(8):
            if b & (0x80 >> j):
                bit = byte * 8 + j
                out[found] = bit - last - 1
                last = bit
                found += 1
                if found == count:
                    return found
    return found


def unpack_unary(data: bytes | np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """First ``count`` quotients of a U stream (int64) and how many were found (< count: truncated)."""
    out = np.empty(count, np.int64)
    if count == 0:
        return out, 0
    buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    found = _unpack_unary(buf, count, out)
    return out[:found], found


@njit(nogil=True, cache=True)
def _pack_raw(w: np.ndarray, r: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    acc = np.uint64(0)  # pending bits, right-aligned
    n = 0               # how many pending bits (< 8 between values)
    o = 0
    for i in range(w.size):
        width = w[i]
        if width == 0:
            continue
        v = r[i]
        # write the value's bits in pieces of at most 32 so the accumulator never overflows
        while width > 0:
            take = width if width <= 32 else width - 32
            piece = (v >> np.uint64(width - take)) & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))
            acc = (acc << np.uint64(take)) | piece
            n += take
            width -= take
            while n >= 8:
                n -= 8
                out[o] = np.uint8((acc >> np.uint64(n)) & np.uint64(0xFF))
                o += 1
            acc &= (np.uint64(1) << np.uint64(n)) - np.uint64(1)
    if n:
        out[o] = np.uint8((acc << np.uint64(8 - n)) & np.uint64(0xFF))


def pack_raw(w: np.ndarray, r: np.ndarray) -> bytes:
    """R stream: each ``r[i]`` as ``w[i]`` bits (0 <= w <= 64), MSB first."""
    w = np.ascontiguousarray(w, dtype=np.int64)
    total = int(w.sum())
    if total == 0:
        return b""
    out = np.zeros((total + 7) // 8, np.uint8)
    _pack_raw(w, np.ascontiguousarray(r, dtype=np.uint64), out)
    return out.tobytes()


@njit(nogil=True, cache=True)
def _unpack_raw(data: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    bitpos = 0
    for i in range(w.size):
        width = w[i]
        v = np.uint64(0)
        while width > 0:
            byte = bitpos >> 3
            off = bitpos & 7
            avail = 8 - off
            take = width if width < avail else avail
            bits = (np.uint64(data[byte]) >> np.uint64(avail - take)) & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))
            v = (v << np.uint64(take)) | bits
            bitpos += take
            width -= take
        out[i] = v


def unpack_raw(data: bytes | np.ndarray, w: np.ndarray) -> np.ndarray:
    """Values of widths ``w`` read in order from an R stream; the caller has checked it holds sum(w) bits."""
    w = np.ascontiguousarray(w, dtype=np.int64)
    out = np.empty(w.size, np.uint64)
    if w.size:
        buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
        _unpack_raw(buf, w, out)
    return out


# -- exact code costs ---------------------------------------------------------------------
_SMALL = 1 << 12  # values below this are counted in a histogram first (gaps and steps nearly always are)


@njit(nogil=True, cache=True)
def _add_costs(x: np.uint64, c: int, kr: int, ke: int, rice: np.ndarray, rice_f: np.ndarray, eg: np.ndarray,
               short: np.ndarray) -> None:  # pragma: no cover - compiled
    # ``c`` values equal to ``x``: rice[k] += c * (x >> k); eg[k] += c * (bit_length(x + 2**k) - 1) for
    # 2**k <= x (the others contribute exactly k each, added from ``short`` at the end).
    b = 0
    t = x
    while t:
        t >>= np.uint64(1)
        b += 1
    short[b] += c
    for k in range(min(b, kr + 1)):
        q = x >> np.uint64(k)
        rice[k] += q * np.uint64(c)
        rice_f[k] += np.float64(q) * c
    top = np.uint64(1) << np.uint64(b) if b < 64 else np.uint64(0)
    for k in range(min(b, ke + 1)):
        # 2**k <= x < 2**b: x + 2**k has bit length b, or b + 1 once it reaches 2**b
        s = x + (np.uint64(1) << np.uint64(k))
        eg[k] += c * (b - 1 + (1 if (b < 64 and s >= top) else 0))


@njit(nogil=True, cache=True)
def _kind_sums(v: np.ndarray, start: int, stop: int, kr: int, ke: int, rice: np.ndarray, rice_f: np.ndarray,
               eg: np.ndarray, short: np.ndarray) -> None:  # pragma: no cover - compiled
    hist = np.zeros(_SMALL, np.int64)
    for i in range(start, stop):
        x = v[i]
        if x < _SMALL:
            hist[x] += 1
        else:
            _add_costs(x, 1, kr, ke, rice, rice_f, eg, short)
    for u in range(_SMALL):
        if hist[u]:
            _add_costs(np.uint64(u), hist[u], kr, ke, rice, rice_f, eg, short)


def kind_sums(v: np.ndarray, kr: int, ke: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact per-parameter totals for choosing a RICE/EG code for the uint64 values ``v``.

    Returns ``(rice, rice_f, eg_l)``: ``rice[k] = sum(v >> k)`` (uint64, exact;
    ``rice_f`` the same in float64, to spot absurd sums) for ``k <= kr``, and
    ``eg_l[k] = sum(bit_length(v + 2**k) - 1)`` for ``k <= ke``.
    """
    v = np.ascontiguousarray(v, dtype=np.uint64)

    def part(s: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rice = np.zeros(kr + 1, np.uint64)
        rice_f = np.zeros(kr + 1, np.float64)
        eg = np.zeros(ke + 1, np.int64)
        short = np.zeros(66, np.int64)
        _kind_sums(v, s, e, kr, ke, rice, rice_f, eg, short)
        return rice, rice_f, eg, short

    parts = chunked(v.size, part, min_chunk=1 << 20)
    rice = np.zeros(kr + 1, np.uint64)
    rice_f = np.zeros(kr + 1, np.float64)
    eg = np.zeros(ke + 1, np.int64)
    short = np.zeros(66, np.int64)
    for r, rf, e, s in parts:
        rice += r
        rice_f += rf
        eg += e
        short += s
    below = np.cumsum(short)  # below[k] = how many v have bit length <= k, i.e. v < 2**k
    ks = np.arange(ke + 1, dtype=np.int64)
    eg += ks * below[:ke + 1]
    return rice, rice_f, eg


# -- LEB128 ------------------------------------------------------------------------------
@njit(nogil=True, cache=True, inline="always")
def _varint_len(x: np.uint64) -> int:  # pragma: no cover - compiled
    n = 1
    x >>= np.uint64(7)
    while x:
        x >>= np.uint64(7)
        n += 1
    return n


@njit(nogil=True, cache=True, inline="always")
def _put_varint(out: np.ndarray, o: int, x: np.uint64) -> int:  # pragma: no cover - compiled
    while x >= np.uint64(0x80):
        out[o] = np.uint8((x & np.uint64(0x7F)) | np.uint64(0x80))
        x >>= np.uint64(7)
        o += 1
    out[o] = np.uint8(x)
    return o + 1


@njit(nogil=True, cache=True)
def _uvarint_size(v: np.ndarray) -> int:  # pragma: no cover - compiled
    total = 0
    for i in range(v.size):
        total += _varint_len(v[i])
    return total


@njit(nogil=True, cache=True)
def _uvarint_encode(v: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    o = 0
    for i in range(v.size):
        o = _put_varint(out, o, v[i])


@njit(nogil=True, cache=True)
def _gap_stream(ptrs: np.ndarray, lens: np.ndarray, out: np.ndarray) -> int:  # pragma: no cover - compiled
    # the gap stream of the sorted int64 arrays at ptrs: per array its first position, then each gap minus
    # one; with an empty ``out`` only its length is counted
    total = 0
    for s in range(ptrs.size):
        a = numba.carray(_voidptr(ptrs[s]), (lens[s],), np.int64)
        prev = np.int64(-1)
        for i in range(lens[s]):
            x = np.uint64(a[i] - prev - np.int64(1))
            prev = a[i]
            total = _put_varint(out, total, x) if out.size else total + _varint_len(x)
    return total


def gap_stream(arrays: Sequence[np.ndarray]) -> bytes:
    """LEB128 gap stream of sorted int64 arrays, one after the other, read where they are (no
    concatenation, no temporary gaps): the layout :func:`gap_positions` decodes."""
    arrays = [a for a in (np.ascontiguousarray(x, dtype=np.int64) for x in arrays) if a.size]
    if not arrays:
        return b""
    ptrs = np.fromiter((a.ctypes.data for a in arrays), dtype=np.int64, count=len(arrays))
    lens = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    out = _gap_bytes(ptrs, lens)
    del arrays  # alive until here: the kernel reads them by address
    return out


def gap_stream_flat(positions: np.ndarray, bounds: np.ndarray) -> bytes:
    """:func:`gap_stream` of ``positions[bounds[i]:bounds[i + 1]]`` for every ``i``, from one flat int64
    array (``bounds``: non-decreasing offsets into it), with no array object per slice."""
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    b = np.asarray(bounds, dtype=np.int64)
    if not pos.size:
        return b""
    out = _gap_bytes(pos.ctypes.data + 8 * b[:-1], np.diff(b))
    del pos  # alive until here: the kernel reads it by address
    return out


def _gap_bytes(ptrs: np.ndarray, lens: np.ndarray) -> bytes:
    out = np.empty(_gap_stream(ptrs, lens, np.empty(0, np.uint8)), np.uint8)
    _gap_stream(ptrs, lens, out)
    return out.tobytes()


def uvarint_encode(values: np.ndarray) -> bytes:
    """Concatenated unsigned LEB128 of the uint64 ``values``."""
    v = np.ascontiguousarray(values, dtype=np.uint64).ravel()
    if v.size == 0:
        return b""
    out = np.empty(_uvarint_size(v), np.uint8)
    _uvarint_encode(v, out)
    return out.tobytes()


@njit(nogil=True, cache=True)
def _uvarint_decode(b: np.ndarray, count: int, out: np.ndarray) -> tuple[int, int]:  # pragma: no cover
    # returns (values decoded, bytes used); values decoded < count: truncated; -1: a value over 10 bytes
    i = 0
    for k in range(count):
        x = np.uint64(0)
        j = 0
        while True:
            if i >= b.size:
                return k, i
            byte = np.uint64(b[i])
            i += 1
            if j >= 10:
                return -1, i
            x |= (byte & np.uint64(0x7F)) << np.uint64(7 * j)
            j += 1
            if byte < np.uint64(0x80):
                break
        out[k] = x
    return count, i


def uvarint_decode(data: bytes | np.ndarray, count: int) -> tuple[np.ndarray, int, int]:
    """``(values, decoded, used)``: the first ``count`` LEB128 values, how many were complete
    (``-1``: one was longer than 10 bytes) and the bytes they used."""
    b = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    out = np.empty(count, np.uint64)
    decoded, used = _uvarint_decode(b, count, out)
    return out, decoded, used


@njit(nogil=True, cache=True)
def _gap_positions(b: np.ndarray, counts: np.ndarray, numels: np.ndarray, out: np.ndarray) -> tuple[int, int, int]:
    # returns (status, segment, bytes used): 0 ok; 1 truncated; 2 a value over 10 bytes; 3 a position past
    # its segment's numel. Positions are strictly increasing per segment, so each is checked as it is made.
    i = 0
    k = 0
    n = b.size
    for s in range(counts.size):
        lim = np.uint64(numels[s])
        p = np.uint64(0)
        for c in range(counts[s]):
            if i < n and b[i] < 0x80:  # a one-byte value (most gaps): no loop
                x = np.uint64(b[i])
                i += 1
            else:
                x = np.uint64(0)
                j = 0
                while True:
                    if i >= n:
                        return 1, s, i
                    if j >= 10:
                        return 2, s, i
                    byte = np.uint64(b[i])
                    i += 1
                    x |= (byte & np.uint64(0x7F)) << np.uint64(7 * j)
                    j += 1
                    if byte < np.uint64(0x80):
                        break
            if x >= lim:  # checked before the add: no wrap-around
                return 3, s, i
            p = x if c == 0 else p + x + np.uint64(1)
            if p >= lim:
                return 3, s, i
            out[k] = np.int64(p)
            k += 1
    return 0, -1, i


@njit(nogil=True, cache=True)
def _gap_positions_mixed(b: np.ndarray, counts: np.ndarray, numels: np.ndarray,
                         out: np.ndarray) -> tuple[int, int, int]:  # pragma: no cover - compiled
    # :func:`_gap_positions` for streams where one- and two-byte values mix (sparse changes: gaps around
    # 128): a value of one or two bytes is read without a branch on which (that branch would be
    # mispredicted for most values), anything longer by the general loop. Same results, statuses included.
    # (The general loop is written out here as in _gap_positions: moved into a shared inline helper it
    # made _gap_positions 2.7x slower on a real cold stream, 3.7 -> 9.9 ms.)
    i = 0
    k = 0
    n = b.size
    for s in range(counts.size):
        lim = np.int64(numels[s])
        p = np.int64(-1)
        for c in range(counts[s]):
            x = np.int64(-1)
            if i + 1 < n:
                b0 = np.int64(b[i])
                b1 = np.int64(b[i + 1])
                more = b0 >> 7  # 1 when a second byte follows
                if (more & (b1 >> 7)) == 0:
                    x = (b0 & 0x7F) | ((b1 << 7) * more)
                    i += 1 + more
            if x < 0:  # three bytes or more, or the stream's last byte
                xu = np.uint64(0)
                j = 0
                while True:
                    if i >= n:
                        return 1, s, i
                    if j >= 10:
                        return 2, s, i
                    byte = np.uint64(b[i])
                    i += 1
                    xu |= (byte & np.uint64(0x7F)) << np.uint64(7 * j)
                    j += 1
                    if byte < np.uint64(0x80):
                        break
                if xu >= np.uint64(lim):  # checked before the add: no wrap-around
                    return 3, s, i
                x = np.int64(xu)
            p = p + x + 1
            if p >= lim:
                return 3, s, i
            out[k] = p
            k += 1
    return 0, -1, i


#: stream bytes per position above which :func:`gap_positions` uses the branch-free reader (a real cold
#: step, ~1.7 bytes a position: 3.4 -> 2.2 ms for 0.85 M positions; a dense one, ~1.06: the plain loop,
#: whose one-byte branch is then predicted, stays faster, 4.7 vs 6.6 ms for 2.6 M)
MIXED_BYTES_PER_POSITION = 1.25


def gap_positions(data: bytes | np.ndarray, counts: np.ndarray, numels: np.ndarray) -> tuple[np.ndarray, int, int, int]:
    """Decode a LEB128 gap stream of sorted positions for consecutive segments in one pass.

    Segment ``s`` holds ``counts[s]`` positions in ``[0, numels[s])``: its first value is the first
    position, each next value the gap minus one. Returns ``(positions int64, status, segment, bytes used)``
    with status 0 (ok), 1 (stream truncated), 2 (a value over 10 bytes) or 3 (a position past its
    segment, ``segment`` names it); ``positions`` is only complete when status is 0.
    """
    b = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    out = np.empty(int(counts.sum()), np.int64)
    decode = _gap_positions_mixed if b.size > MIXED_BYTES_PER_POSITION * out.size else _gap_positions
    status, seg, used = decode(b, counts, np.ascontiguousarray(numels, dtype=np.int64), out)
    return out, int(status), int(seg), int(used)


# -- ulp steps in the ordered image ----------------------------------------------------------
@njit(nogil=True, cache=True, inline="always")
def _ordered(x: np.int64, fmag: np.int64) -> np.int64:  # pragma: no cover - compiled
    # sign-magnitude -> two's complement for floats (fmag = the magnitude mask; -0.0 -> -1), integers as
    # they are (fmag = 0); branch-free, and its own inverse
    return x ^ ((x >> 63) & fmag)


@njit(nogil=True, cache=True, inline="always")
def _step(new: np.int64, old: np.int64, fmag: np.int64) -> np.uint64:  # pragma: no cover - compiled
    d = _ordered(new, fmag) - _ordered(old, fmag)
    return np.uint64((d << np.int64(1)) ^ (d >> np.int64(63))) - np.uint64(1)  # zig-zag, minus one


@njit(nogil=True, cache=True)
def _max_step(new: np.ndarray, old: np.ndarray, fmag: np.int64) -> np.uint64:  # pragma: no cover - compiled
    m = np.uint64(0)
    for i in range(new.size):
        m = max(m, _step(np.int64(new[i]), np.int64(old[i]), fmag))
    return m


@njit(nogil=True, cache=True)
def _step_planes(new: np.ndarray, old: np.ndarray, fmag: np.int64, out: np.ndarray) -> None:  # pragma: no cover
    npl = out.shape[0]
    for i in range(new.size):
        x = _step(np.int64(new[i]), np.int64(old[i]), fmag)
        for j in range(npl):
            out[j, i] = np.uint8(x & np.uint64(0xFF))
            x >>= np.uint64(8)


def step_planes(new: np.ndarray, old: np.ndarray, is_float: bool, nplanes: int | None = None) -> np.ndarray:
    """``uint8[nplanes, n]``: plane ``j`` holds byte ``j`` (little-endian) of ``zigzag(ordered(new) -
    ordered(old)) - 1`` for paired raw bits of one width.

    ``nplanes``: the plane count; by default the fewest that hold every step (0 when there are no
    elements). The steps are computed twice (their maximum, then the planes) rather than kept: a
    uint64 per element would be the largest temporary of an encode.
    """
    fmag = np.int64((1 << (new.dtype.itemsize * 8 - 1)) - 1) if is_float else np.int64(0)
    new, old = np.ascontiguousarray(new), np.ascontiguousarray(old)
    if nplanes is None:
        top = max(chunked(new.size, lambda a, e: int(_max_step(new[a:e], old[a:e], fmag)), 1 << 18), default=0)
        nplanes = max(1, (top.bit_length() + 7) // 8) if new.size else 0
    out = np.empty((nplanes, new.size), np.uint8)
    if nplanes and new.size:
        chunked(new.size, lambda a, e: _step_planes(new[a:e], old[a:e], fmag, out[:, a:e]), 1 << 18)
    return out


@njit(nogil=True, cache=True, inline="always")
def _applied(z: np.int64, x: np.int64, fmag: np.int64) -> np.int64:  # pragma: no cover - compiled
    # old bits x (sign-extended) plus the step coded as z = zigzag(step) - 1, in the ordered image
    u = np.uint64(z) + np.uint64(1)  # unsigned: a 64-bit step's top bit must shift out logically
    return _ordered(x, fmag) + (np.int64(u >> np.uint64(1)) ^ -np.int64(u & np.uint64(1)))


@njit(nogil=True, cache=True, inline="always")
def _unapplied(z: np.int64, y: np.int64, fmag: np.int64) -> np.int64:  # pragma: no cover - compiled
    # the inverse of _applied: the old raw bits from the new ones y (sign-extended) and the coded step z
    u = np.uint64(z) + np.uint64(1)
    return _ordered(_ordered(y, fmag) - (np.int64(u >> np.uint64(1)) ^ -np.int64(u & np.uint64(1))), fmag)


@njit(nogil=True, cache=True, inline="always")
def _plane_step(planes: np.ndarray, npl: int, i: int) -> np.int64:  # pragma: no cover - compiled
    # planes[j, i]: byte j of (zigzag(step) - 1) of element i; one and two planes (most steps) read directly
    if npl == 1:
        return np.int64(planes[0, i])
    if npl == 2:
        return np.int64(planes[0, i]) | (np.int64(planes[1, i]) << 8)
    u = np.uint64(0)
    for j in range(npl):
        u |= np.uint64(planes[j, i]) << np.uint64(8 * j)
    return np.int64(u)


@njit(nogil=True, cache=True)
def _apply_steps(old: np.ndarray, planes: np.ndarray, fmag: np.int64, lo: np.int64, hi: np.int64,
                 out: np.ndarray) -> int:  # pragma: no cover - compiled
    # returns the first element whose result leaves the dtype's range, or -1
    npl = planes.shape[0]
    for i in range(old.size):
        o = _applied(_plane_step(planes, npl, i), np.int64(old[i]), fmag)
        if o < lo or o > hi:
            return i
        out[i] = _ordered(o, fmag)  # back to raw bits
    return -1


def _step_range(dtype: np.dtype, is_float: bool) -> tuple[np.int64, np.int64, np.int64]:
    """``(fmag, lo, hi)`` for the step kernels: the magnitude mask of a float's ordered image (0 for
    integers and 8-bit patterns) and the range a stepped value must stay in."""
    width = dtype.itemsize * 8
    if dtype == np.uint8:  # 8-bit dtypes are unsigned patterns 0..255
        return np.int64(0), np.int64(0), np.int64(255)
    lo, hi = (np.int64(-(1 << (width - 1))), np.int64((1 << (width - 1)) - 1)) if width < 64 else \
        (np.int64(-(1 << 63)), np.int64((1 << 63) - 1))
    return (np.int64((1 << (width - 1)) - 1) if is_float else np.int64(0)), lo, hi


def apply_steps(old: np.ndarray, planes: np.ndarray, is_float: bool) -> tuple[np.ndarray, int]:
    """New raw bits from the receiver's ``old`` bits and the byte planes of their steps.

    ``planes`` is ``uint8[nplanes, n]`` (plane ``j`` = byte ``j`` of ``zigzag(step) - 1``).
    Returns ``(bits, bad)``: ``bad`` is the index of the first element whose new value
    leaves the dtype's range (a corrupt object), or -1.
    """
    fmag, lo, hi = _step_range(old.dtype, is_float)
    out = np.empty(old.size, old.dtype)
    old = np.ascontiguousarray(old)

    def run(a: int, e: int) -> int:  # elements are independent: one chunk per kernel thread
        bad = _apply_steps(old[a:e], planes[:, a:e], fmag, lo, hi, out[a:e])
        return a + bad if bad >= 0 else -1

    found = [b for b in chunked(old.size, run, 1 << 18) if b >= 0]
    return out, int(found[0]) if found else -1


_STEP_AHEAD = 32  # items: the cache line of the position this far ahead is fetched for writing
_RING_MASK = 63  # positions decoded ahead are kept in a ring of this many + 1 (> _STEP_AHEAD)


@njit(nogil=True, cache=True, inline="always")
def _leb128(b: np.ndarray, i: int, n: int) -> tuple[np.uint64, int, int]:  # pragma: no cover - compiled
    # the LEB128 value at b[i]: (value, next index, status 0 / 1 truncated / 2 over 10 bytes)
    if i < n and b[i] < 0x80:  # a one-byte value (most gaps): no loop
        return np.uint64(b[i]), i + 1, 0
    x = np.uint64(0)
    j = 0
    while True:
        if i >= n:
            return x, i, 1
        if j >= 10:
            return x, i, 2
        byte = np.uint64(b[i])
        i += 1
        x |= (byte & np.uint64(0x7F)) << np.uint64(7 * j)
        j += 1
        if byte < np.uint64(0x80):
            return x, i, 0


@njit(nogil=True, cache=True)
def _apply_gaps_at(like, ptr, lens, keys, slot, counts, s0, s1, gaps, i0, e0, planes, fmag, lo, hi, zmask, done,
                   sums):  # pragma: no cover - compiled
    # Segments s0..s1 of a LEB128 gap stream, from byte i0 and stream item e0 (a column of planes). Segment s
    # with t = slot[s] >= 0 is tensor t: lens[t] elements of like's dtype at ptr[t]; each of its items is
    # read, stepped and written back, the checksum change summed in sums[t]; it is written whole (done[t])
    # or, at a bad item, put back as it was (each written item stepped back) before returning. A segment
    # with slot -1 is only read past. Returns (status, segment, byte after the run): 0 ok; 1 truncated
    # stream; 2 a value over 10 bytes; 3 a position past its tensor; 4 a value out of the dtype's range
    # (statuses 1 and 2 of skipped segments too).
    npl = planes.shape[0]
    width = like.itemsize
    n = gaps.size
    i = i0
    e = e0
    ring = np.empty(_RING_MASK + 1, np.int64)
    for s in range(s0, s1):
        m = counts[s]
        t = slot[s]
        if t < 0:
            for c in range(m):
                x, i, status = _leb128(gaps, i, n)
                if status:
                    return status, s, i
            e += m
            continue
        lim = np.int64(lens[t])
        a = _at(ptr[t], lens[t], like)
        key = keys[t]
        seg_i, seg_e = i, e
        # positions are decoded _STEP_AHEAD items ahead of their write into a small ring, so that the cache
        # line of each is fetched while the items before it are stepped
        q = np.int64(-1)
        got = 0  # items decoded into the ring
        status = 0
        p = np.int64(-1)
        total = np.uint64(0)
        c = 0
        while c < m:
            while got < m and got <= c + _STEP_AHEAD:
                x, i, status = _leb128(gaps, i, n)
                if status:
                    break
                if x >= np.uint64(lim):  # checked before the add: no wrap-around
                    status = 3
                    break
                q += np.int64(x) + 1
                if q >= lim:
                    status = 3
                    break
                ring[got & _RING_MASK] = q
                _prefetch_for_write(ptr[t] + q * width)
                got += 1
            if status:
                break
            p = ring[c & _RING_MASK]
            old = a[p]
            o = _applied(_plane_step(planes, npl, e), np.int64(old), fmag)
            if o < lo or o > hi:
                status = 4
                break
            y = _ordered(o, fmag)
            a[p] = y
            h = np.uint64(p) * C1
            total += _fmix((h ^ (np.uint64(y) & zmask)) + key) - _fmix((h ^ (np.uint64(np.int64(old)) & zmask)) + key)
            e += 1
            c += 1
        if status:  # step back the items of this segment written so far (their bytes read again)
            j, r = seg_i, np.int64(-1)
            for d in range(c):
                x, j, st = _leb128(gaps, j, n)
                r += np.int64(x) + 1
                a[r] = _unapplied(_plane_step(planes, npl, seg_e + d), np.int64(a[r]), fmag)
            return status, s, i
        sums[t] = total
        done[t] = True
    return 0, -1, i


@njit(nogil=True, cache=True)
def _restore_gaps_at(like, ptr, lens, slot, counts, s0, s1, gaps, i0, e0, planes, fmag, done):  # pragma: no cover
    # step back every item of the done tensors of a run of _apply_gaps_at (its stream read again): the old
    # bits follow from the new ones and the step; a run's tensors after one not done were not reached
    npl = planes.shape[0]
    n = gaps.size
    i = i0
    e = e0
    for s in range(s0, s1):
        t = slot[s]
        if t >= 0 and not done[t]:
            return
        p = np.int64(-1)
        for c in range(counts[s]):
            x, i, st = _leb128(gaps, i, n)
            if t >= 0:
                p += np.int64(x) + 1
                a = _at(ptr[t], lens[t], like)
                a[p] = _unapplied(_plane_step(planes, npl, e), np.int64(a[p]), fmag)
            e += 1


@njit(nogil=True, cache=True)
def _gap_offsets(gaps, ends):  # pragma: no cover - compiled
    # the byte index after the first ends[k] values of a LEB128 stream (ends sorted), or -1 past its end:
    # each value ends at a byte below 0x80, counted 64 bytes at a time while a whole block cannot overshoot
    out = np.full(ends.size, -1, np.int64)
    n = gaps.size
    i = 0
    seen = 0
    for k in range(ends.size):
        want = ends[k]
        while i + 64 <= n and seen + 64 <= want:
            c = 0
            for j in range(i, i + 64):
                c += gaps[j] < 0x80
            seen += c
            i += 64
        while i < n and seen < want:
            seen += gaps[i] < 0x80
            i += 1
        if seen < want:
            return out
        out[k] = i
    return out


class StepsInPlace:
    """A ``ulp`` object's gap stream decoded and its values stepped into the tensors themselves, in one pass.

    Segment ``s`` of the LEB128 gap stream ``gaps`` (:func:`gap_positions`'s layout) holds ``counts[s]``
    positions; item ``i`` of the stream (over every segment in turn) has its step in column ``i`` of
    ``planes`` (:func:`step_planes`' layout). Segment ``s`` is tensor ``t = slot[s]`` (default: ``s``):
    ``lengths[t]`` elements of ``dtype`` (an integer view dtype) at address ``pointers[t]``, memory the
    caller keeps alive and owns; a segment with slot -1 is read past, not written (an object mixing element
    kinds takes one of these per kind). :meth:`run` writes the tensors: ``sums[t]`` receives the change of
    tensor ``t``'s checksum (:mod:`deltastore.checksum`, tensor key ``keys[t]``) and ``done[t]`` is set once
    it is written; a tensor is written whole or not at all. :meth:`undo` steps every done tensor back (a
    ``ulp`` step is undone from the new bits alone: nothing is kept per item), so it can be handed out
    before :meth:`run` starts. The segments are split into runs of about equal size, one per kernel thread,
    found by one scan of the stream. Nothing is read or written outside the tensors; arrays that do not fit
    together raise ``ValueError`` here, before anything is touched.
    """

    def __init__(self, pointers: np.ndarray, lengths: np.ndarray, keys: np.ndarray, done: np.ndarray,
                 sums: np.ndarray, counts: np.ndarray, gaps: np.ndarray, planes: np.ndarray, dtype: np.dtype,
                 is_float: bool, slot: np.ndarray | None = None):
        k = pointers.size
        counts = np.ascontiguousarray(counts, np.int64)
        given = slot is not None
        slot = np.ascontiguousarray(slot, np.int64) if given else np.arange(counts.size, dtype=np.int64)
        if (lengths.shape != (k,) or keys.shape != (k,) or sums.shape != (k,) or sums.dtype != np.uint64
                or done.shape != (k,) or done.dtype != np.bool_ or slot.shape != counts.shape or counts.ndim != 1
                or bool((counts < 0).any()) or bool((slot >= k).any())
                or (given and np.unique(slot[slot >= 0]).size != int((slot >= 0).sum()))
                or planes.ndim != 2 or planes.shape[1] != int(counts.sum()) or planes.dtype != np.uint8
                or gaps.dtype != np.uint8 or gaps.ndim != 1 or np.dtype(dtype).kind not in "iu"):
            raise ValueError("StepsInPlace: pointers, counts, planes and buffers do not fit together")
        self.pointers, self.lengths, self.counts, self.slot, self.gaps = pointers, lengths, counts, slot, gaps
        self.keys = np.ascontiguousarray(keys, np.uint64)
        self.planes = np.ascontiguousarray(planes)
        self.done, self.sums = done, sums
        self.like = np.zeros(0, dtype)
        self.fmag, self.lo, self.hi = _step_range(self.like.dtype, is_float)
        width = self.like.dtype.itemsize
        self.zmask = np.uint64((1 << (8 * width)) - 1) if width < 8 else np.uint64(0xFFFFFFFFFFFFFFFF)
        bounds = np.zeros(counts.size + 1, np.int64)  # stream items before each segment
        np.cumsum(counts, out=bounds[1:])
        self.runs = segment_runs(bounds, threads())
        firsts = np.array([a for a, _ in self.runs], np.int64)
        self.starts = _gap_offsets(gaps, bounds[firsts])
        if (self.starts < 0).any():  # the stream ends before a run's first item: one run, which meets it
            self.runs, self.starts, firsts = self.runs[:1], self.starts[:1], firsts[:1]
        self.items = bounds[firsts]

    def run(self) -> tuple[int, int]:
        """Write every tensor; ``(status, segment)``: status 0, or the first problem in stream order (1 the
        stream ends early, 2 a value over 10 bytes, 3 a position past its tensor, 4 a value out of the
        dtype's range, 5 bytes left after the last position) and the segment it is in."""
        runs = self.runs
        got = each(len(runs), lambda r: _apply_gaps_at(
            self.like, self.pointers, self.lengths, self.keys, self.slot, self.counts, runs[r][0], runs[r][1],
            self.gaps, int(self.starts[r]), int(self.items[r]), self.planes, self.fmag, self.lo, self.hi,
            self.zmask, self.done, self.sums))
        for r, (status, seg, end) in enumerate(got):
            if status:
                return int(status), int(seg)
            nxt = int(self.starts[r + 1]) if r + 1 < len(runs) else self.gaps.size
            if int(end) != nxt:  # a run must end where the next begins, the last at the stream's end
                return (5 if r + 1 == len(runs) else 1), int(runs[r][1]) - 1
        return 0, -1

    def undo(self) -> None:
        """Step every tensor written whole back to the bits it held."""
        for r, (a, e) in enumerate(self.runs):
            _restore_gaps_at(self.like, self.pointers, self.lengths, self.slot, self.counts, a, e, self.gaps,
                             int(self.starts[r]), int(self.items[r]), self.planes, self.fmag, self.done)
