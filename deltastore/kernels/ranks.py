"""Rank and select within magnitude buckets of a tensor (compiled, nogil) — the ``ctx`` codec's O(model) passes.

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

import numpy as np

from ._ranks import _class_hist, _count3, _ranks, _ranks3, _select, _select3
from .parallel import bounds, each

_MIN_CHUNK = 1 << 20


def _bucket_prefix(hists: np.ndarray, lut: np.ndarray, nbuckets: int) -> np.ndarray:
    """``prefix[c, b]``: elements of bucket ``b`` in the chunks before chunk ``c`` (``chunks + 1`` rows)."""
    per = np.zeros((hists.shape[0], nbuckets), np.int64)
    for b in range(nbuckets):
        per[:, b] = hists[:, lut == b].sum(axis=1)
    return np.concatenate((np.zeros((1, nbuckets), np.int64), np.cumsum(per, axis=0)))


def lane(bits: np.ndarray) -> type:
    """The lane type of ``bits``' magnitudes in the kernels: int32 for 8/16-bit elements (vectorises 2x wider),
    else int64 (what masks and thresholds are passed as)."""
    return np.int32 if bits.dtype.itemsize <= 2 else np.int64


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
                    bk.parts[c][1], *map(int, bk.g[c]), rank, bucket)

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
