"""Bit streams and code-cost counting for the built-in sparse codecs (compiled: ``_bitstream.pyx``, nogil).

The byte layout is the one :mod:`deltastore.codecs._bits` documents: a unary
stream U (``q`` zero bits then a one bit per value) and a raw stream R (each
value in ``w`` bits), both most-significant bit first, zero padded. These
kernels write and read exactly those bytes; callers check sizes and widths
first (see ``_bits``), so a kernel never reads or writes out of bounds on
validated input and reports shortfalls through its return values.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._bitstream import (  # noqa: F401 - tests call the two gap readers and _gap_offsets directly
    _apply_gaps_at, _apply_steps, _gap_offsets, _gap_positions, _gap_positions_mixed, _gap_stream, _kind_sums,
    _max_step, _pack_raw, _pack_unary, _restore_gaps_at, _step_planes, _unpack_raw, _unpack_unary,
    _uvarint_decode, _uvarint_encode, _uvarint_size)
from .diff import segment_runs
from .parallel import chunked, each, threads


def pack_unary(q: np.ndarray) -> bytes:
    """U stream of the non-negative int64 quotients ``q``."""
    if q.size == 0:
        return b""
    q = np.ascontiguousarray(q, dtype=np.int64)
    total = int(q.sum()) + q.size
    out = np.zeros((total + 7) // 8, np.uint8)
    _pack_unary(q, out)
    return out.tobytes()


def unpack_unary(data: bytes | np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """First ``count`` quotients of a U stream (int64) and how many were found (< count: truncated)."""
    out = np.empty(count, np.int64)
    if count == 0:
        return out, 0
    buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    found = _unpack_unary(buf, count, out)
    return out[:found], found


def pack_raw(w: np.ndarray, r: np.ndarray) -> bytes:
    """R stream: each ``r[i]`` as ``w[i]`` bits (0 <= w <= 64), MSB first."""
    w = np.ascontiguousarray(w, dtype=np.int64)
    total = int(w.sum())
    if total == 0:
        return b""
    out = np.zeros((total + 7) // 8, np.uint8)
    _pack_raw(w, np.ascontiguousarray(r, dtype=np.uint64), out)
    return out.tobytes()


def unpack_raw(data: bytes | np.ndarray, w: np.ndarray) -> np.ndarray:
    """Values of widths ``w`` read in order from an R stream; the caller has checked it holds sum(w) bits."""
    w = np.ascontiguousarray(w, dtype=np.int64)
    out = np.empty(w.size, np.uint64)
    if w.size:
        buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
        _unpack_raw(buf, w, out)
    return out


# -- exact code costs ---------------------------------------------------------------------
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


def uvarint_decode(data: bytes | np.ndarray, count: int) -> tuple[np.ndarray, int, int]:
    """``(values, decoded, used)``: the first ``count`` LEB128 values, how many were complete
    (``-1``: one was longer than 10 bytes) and the bytes they used."""
    b = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    out = np.empty(count, np.uint64)
    decoded, used = _uvarint_decode(b, count, out)
    return out, decoded, used


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
