"""Rank and select within magnitude buckets of a tensor (numba, nogil) — the ``ctx`` codec's O(model) passes.

A float tensor's elements fall into exponent *classes* ``(bits & mag_mask) >> shift``
(for bf16: the 8-bit exponent); ``lut[class]`` maps classes to contiguous
buckets. For a sorted set of flat positions, the encoder needs each
position's bucket and its *rank* there (how many elements of the same bucket
come before it); the decoder needs the inverse (*select*). Both are one pass
over the tensor's bits, split into contiguous chunks that run in parallel
threads: per-chunk class histograms give every chunk its starting counts.
No full-size temporary is created.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba import types
from numba.extending import overload

from .jit import njit
from .parallel import bounds, each

_MIN_CHUNK = 1 << 20


@njit(nogil=True, cache=True)
def _class_hist(bits: np.ndarray, start: int, stop: int, mask: int, shift: int,
                hist: np.ndarray) -> None:  # pragma: no cover - compiled
    # four interleaved sub-histograms: consecutive elements of one class do not wait on each other's store
    n = hist.size
    h = np.zeros(4 * n, np.int64)
    x = bits[start:stop]
    i = 0
    while i + 4 <= x.size:
        h[(x[i] & mask) >> shift] += 1
        h[n + ((x[i + 1] & mask) >> shift)] += 1
        h[2 * n + ((x[i + 2] & mask) >> shift)] += 1
        h[3 * n + ((x[i + 3] & mask) >> shift)] += 1
        i += 4
    while i < x.size:
        h[(x[i] & mask) >> shift] += 1
        i += 1
    for c in range(n):
        hist[c] += h[c] + h[n + c] + h[2 * n + c] + h[3 * n + c]


def _bucket_prefix(hists: np.ndarray, lut: np.ndarray, nbuckets: int) -> np.ndarray:
    """``prefix[c, b]``: elements of bucket ``b`` in the chunks before chunk ``c`` (``chunks + 1`` rows)."""
    per = np.zeros((hists.shape[0], nbuckets), np.int64)
    for b in range(nbuckets):
        per[:, b] = hists[:, lut == b].sum(axis=1)
    return np.concatenate((np.zeros((1, nbuckets), np.int64), np.cumsum(per, axis=0)))


@njit(nogil=True, cache=True)
def _ranks(bits: np.ndarray, mask: int, shift: int, lut: np.ndarray, pos: np.ndarray, i0: int, i1: int,
           start: int, running: np.ndarray, rank: np.ndarray, bucket: np.ndarray) -> None:  # pragma: no cover
    if i0 >= i1:
        return
    j = i0
    last = pos[i1 - 1]
    for idx in range(start, last + 1):
        b = lut[(bits[idx] & mask) >> shift]
        if idx == pos[j]:
            rank[j] = running[b]
            bucket[j] = b
            j += 1
        running[b] += 1


def widen(x):  # pragma: no cover - replaced by the overload below inside compiled code
    """Lane type for magnitude arithmetic: int32 for 8/16-bit elements (vectorises 2x wider), else int64."""
    return x


@overload(widen)
def _widen(x):  # type: ignore[no-untyped-def]
    if isinstance(x, types.Integer) and x.bitwidth <= 16:
        return lambda x: np.int32(x)
    return lambda x: np.int64(x)


def lane(bits: np.ndarray) -> type:
    """The numpy scalar type :func:`widen` gives for ``bits``' elements (what masks and thresholds are passed as)."""
    return np.int32 if bits.dtype.itemsize <= 2 else np.int64


@njit(nogil=True, cache=True)
def _count3(bits: np.ndarray, start: int, stop: int, mask: Any, t1: Any, t2: Any, t3: Any
            ) -> tuple[int, int, int]:  # pragma: no cover - compiled
    # elements of bits[start:stop] whose magnitude is >= t1, t2, t3; 32-bit lane sums per block.
    # Loops index a slice from 0: an arbitrary start would make numba guard negative indices,
    # which stops vectorisation (3x slower).
    a1 = 0
    a2 = 0
    a3 = 0
    i = start
    while i < stop:
        end = min(stop, i + (1 << 20))
        block = bits[i:end]
        s1 = np.int32(0)
        s2 = np.int32(0)
        s3 = np.int32(0)
        for j in range(block.size):
            m = widen(block[j]) & mask
            s1 += np.int32(m >= t1)
            s2 += np.int32(m >= t2)
            s3 += np.int32(m >= t3)
        a1 += s1
        a2 += s2
        a3 += s3
        i = end
    return a1, a2, a3


@njit(nogil=True, cache=True, inline="always")
def _rank3(b: int, p: int, g1: int, g2: int, g3: int) -> int:  # pragma: no cover - compiled
    # rank at flat position p within bucket b: G_b - G_(b+1), with G_0 = p and G_4 = 0
    if b == 0:
        return p - g1
    if b == 1:
        return g1 - g2
    if b == 2:
        return g2 - g3
    return g3


@njit(nogil=True, cache=True)
def _ranks3(bits: np.ndarray, mask: Any, t1: Any, t2: Any, t3: Any, pos: np.ndarray, i0: int, i1: int,
            start: int, g1: int, g2: int, g3: int, rank: np.ndarray, bucket: np.ndarray) -> None:  # pragma: no cover
    # g_k: elements before the scan point whose magnitude is >= t_k; bucket b's rank at p is
    # G_b - G_(b+1) with G_0 = p and G_4 = 0.
    cur = start
    for j in range(i0, i1):
        p = pos[j]
        a1, a2, a3 = _count3(bits, cur, p, mask, t1, t2, t3)
        g1 += a1
        g2 += a2
        g3 += a3
        m = widen(bits[p]) & mask
        e1 = np.int64(m >= t1)
        e2 = np.int64(m >= t2)
        e3 = np.int64(m >= t3)
        b = e1 + e2 + e3
        rank[j] = _rank3(b, p, g1, g2, g3)
        bucket[j] = b
        g1 += e1
        g2 += e2
        g3 += e3
        cur = p + 1


def cuts3(lut: np.ndarray, mask: int, shift: int) -> tuple[int, int, int] | None:
    """Magnitude thresholds of a lut with at most 4 buckets, padded to three past any magnitude; else None."""
    cuts = [int(c) << shift for c in np.flatnonzero(np.diff(lut)) + 1]
    if len(cuts) > 3:
        return None
    return tuple(cuts + [mask + 1] * (3 - len(cuts)))  # type: ignore[return-value]


def _cut_prefix(bits: np.ndarray, mask: int, cuts: tuple[int, int, int], parts: list[tuple[int, int]]) -> np.ndarray:
    """``prefix[c, k]``: elements before chunk ``c`` (last row: all) whose magnitude is >= ``cuts[k]``."""
    T = lane(bits)

    def one(i: int) -> tuple[int, int, int]:
        return _count3(bits, parts[i][0], parts[i][1], T(mask), *map(T, cuts))

    counts = np.array(each(len(parts), one), dtype=np.int64).reshape(-1, 3)
    return np.concatenate((np.zeros((1, 3), np.int64), np.cumsum(counts, axis=0)))


@njit(nogil=True, cache=True)
def _select(bits: np.ndarray, mask: int, shift: int, lut: np.ndarray, start: int, stop: int, ranks: np.ndarray,
            off: np.ndarray, lo: np.ndarray, hi: np.ndarray, running: np.ndarray, base: int,
            outpos: np.ndarray, src: np.ndarray) -> int:  # pragma: no cover - compiled
    ptr = lo.copy()
    remaining = 0
    for b in range(lo.size):
        remaining += hi[b] - lo[b]
    o = base
    idx = start
    while remaining > 0 and idx < stop:
        b = lut[(bits[idx] & mask) >> shift]
        p = ptr[b]
        if p < hi[b] and ranks[off[b] + p] == running[b]:
            outpos[o] = idx
            src[o] = off[b] + p
            o += 1
            ptr[b] = p + 1
            remaining -= 1
        running[b] += 1
        idx += 1
    return remaining


@njit(nogil=True, cache=True)
def _select3(bits: np.ndarray, mask: Any, t1: Any, t2: Any, t3: Any, start: int, stop: int,
             ranks: np.ndarray, off: np.ndarray, lo: np.ndarray, hi: np.ndarray, g1: int, g2: int, g3: int,
             base: int, outpos: np.ndarray, src: np.ndarray) -> int:  # pragma: no cover - compiled
    # g_k: elements before the scan point whose magnitude is >= t_k, so bucket b holds G_b - G_(b+1)
    # of them (G_0 = the scan point, G_4 = 0). Blocks of 32 are counted first (vectorised); a
    # block that holds none of the wanted ranks is skipped.
    ptr = lo.copy()
    want = np.full(4, -1, np.int64)  # next wanted rank per bucket (-1: none left)
    remaining = 0
    for b in range(4):
        if ptr[b] < hi[b]:
            want[b] = ranks[off[b] + ptr[b]]
        remaining += hi[b] - ptr[b]
    o = base
    idx = start
    while remaining > 0 and idx < stop:
        end = min(idx + 32, stop)
        a1, a2, a3 = _count3(bits, idx, end, mask, t1, t2, t3)
        if ((want[0] < 0 or end - g1 - a1 <= want[0]) and (want[1] < 0 or g1 + a1 - g2 - a2 <= want[1])
                and (want[2] < 0 or g2 + a2 - g3 - a3 <= want[2]) and (want[3] < 0 or g3 + a3 <= want[3])):
            g1 += a1
            g2 += a2
            g3 += a3
            idx = end
            continue
        blk = bits[idx:end]
        for u in range(blk.size):
            i = idx + u
            m = widen(blk[u]) & mask
            e1 = np.int64(m >= t1)
            e2 = np.int64(m >= t2)
            e3 = np.int64(m >= t3)
            b = e1 + e2 + e3
            r = _rank3(b, i, g1, g2, g3)
            if r == want[b]:
                outpos[o] = i
                src[o] = off[b] + ptr[b]
                o += 1
                ptr[b] += 1
                remaining -= 1
                want[b] = ranks[off[b] + ptr[b]] if ptr[b] < hi[b] else -1
            g1 += e1
            g2 += e2
            g3 += e3
        idx = end
    return remaining


def class_counts(bits: np.ndarray, mask: int, shift: int, nclasses: int, stride: int = 1) -> np.ndarray:
    """Elements per class (``int64[nclasses]``); with ``stride > 1`` estimated from every ``stride``-th element."""
    sample = bits[::stride] if stride > 1 else bits
    parts = bounds(sample.size, _MIN_CHUNK)

    def one(i: int) -> np.ndarray:
        h = np.zeros(nclasses, np.int64)
        _class_hist(sample, parts[i][0], parts[i][1], mask, shift, h)
        return h

    counts = sum(each(len(parts), one), np.zeros(nclasses, np.int64))
    return counts * stride if stride > 1 else counts


class Buckets:
    """The bucket sizes of a tensor under ``lut``, with what :func:`bucket_select` needs to find ranks fast.

    ``sizes[b]``: elements in bucket ``b`` (``nbuckets`` entries).
    """

    def __init__(self, bits: np.ndarray, mask: int, shift: int, lut: np.ndarray, nbuckets: int):
        self.bits, self.mask, self.shift, self.lut = bits, mask, shift, lut
        self.parts = bounds(bits.size, _MIN_CHUNK)
        self.cuts = cuts3(lut, mask, shift)
        if self.cuts is not None:  # four buckets or fewer: counted by comparisons, no histogram
            self.g = _cut_prefix(bits, mask, self.cuts, self.parts)
            starts = np.array([s for s, _ in self.parts] + [bits.size], dtype=np.int64)
            g = self.g
            self.before = np.stack([starts - g[:, 0], g[:, 0] - g[:, 1], g[:, 1] - g[:, 2], g[:, 2]], axis=1)
        else:
            def one(i: int) -> np.ndarray:
                h = np.zeros(lut.size, np.int64)
                _class_hist(bits, self.parts[i][0], self.parts[i][1], mask, shift, h)
                return h

            hists = np.stack(each(len(self.parts), one)) if self.parts else np.zeros((0, lut.size), np.int64)
            self.before = _bucket_prefix(hists, lut, nbuckets)
        self.sizes = np.zeros(nbuckets, np.int64)
        k = min(nbuckets, self.before.shape[1])
        self.sizes[:k] = self.before[-1, :k]


def bucket_ranks(bits: np.ndarray, pos: np.ndarray, mask: int, shift: int, lut: np.ndarray,
                 nbuckets: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(bucket, rank, sizes)``: every sorted position's bucket and rank there, and the bucket sizes."""
    rank = np.empty(pos.size, np.int64)
    bucket = np.empty(pos.size, np.int64)
    bk = Buckets(bits, mask, shift, lut, nbuckets)
    cut = np.searchsorted(pos, [s for s, _ in bk.parts] + [bits.size])
    if bk.cuts is not None:
        T = lane(bits)

        def fast(c: int) -> None:
            _ranks3(bits, T(mask), *map(T, bk.cuts), pos, int(cut[c]), int(cut[c + 1]), bk.parts[c][0],
                    *map(int, bk.g[c]), rank, bucket)

        each(len(bk.parts), fast)
    else:
        def one(c: int) -> None:
            _ranks(bits, mask, shift, lut, pos, int(cut[c]), int(cut[c + 1]), bk.parts[c][0], bk.before[c].copy(),
                   rank, bucket)

        each(len(bk.parts), one)
    return bucket, rank, bk.sizes


def bucket_select(bk: Buckets, ranks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions of the given ranks, per bucket, in ascending position order.

    ``ranks[b]`` is bucket ``b``'s strictly increasing ranks, each below
    ``bk.sizes[b]``. Returns ``(positions, src)``: the sorted positions, and
    for each the index into ``np.concatenate(ranks)`` it came from; None if
    some rank was not found (inconsistent input).
    """
    width = bk.before.shape[1]
    ranks = list(ranks) + [np.zeros(0, np.int64)] * (width - len(ranks))
    flat = np.concatenate(ranks) if ranks else np.zeros(0, np.int64)
    off = np.concatenate(([0], np.cumsum([r.size for r in ranks]))).astype(np.int64)
    # bucket b's ranks that fall in chunk c: edges[c, b] .. edges[c + 1, b]
    edges = np.stack([np.searchsorted(r, bk.before[:, b]) for b, r in enumerate(ranks)], axis=1).astype(np.int64)
    outpos = np.empty(flat.size, np.int64)
    src = np.empty(flat.size, np.int64)
    bits, mask, shift = bk.bits, bk.mask, bk.shift

    def one(c: int) -> int:
        s, e = bk.parts[c]
        base = int(edges[c].sum())
        if bk.cuts is not None:
            T = lane(bits)
            return _select3(bits, T(mask), *map(T, bk.cuts), s, e, flat, off[:-1].copy(), edges[c].copy(),
                            edges[c + 1].copy(), *map(int, bk.g[c]), base, outpos, src)
        return _select(bits, mask, shift, bk.lut, s, e, flat, off[:-1].copy(), edges[c].copy(), edges[c + 1].copy(),
                       bk.before[c].copy(), base, outpos, src)

    left = each(len(bk.parts), one)
    if any(left) or int(edges[-1].sum()) != flat.size:
        return None
    return outpos, src
