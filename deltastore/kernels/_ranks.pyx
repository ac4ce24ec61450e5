# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of :mod:`deltastore.kernels.ranks` (that module describes classes, buckets, ranks and select).

Elements are read as unsigned bits of their width: a magnitude ``bits & mask`` is the same for zero- and
sign-extension while ``mask`` is below ``2**width``, which every wrapper checks (``ValueError`` otherwise).
"""

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free

from ._arrays cimport ANY, SIGNED, arr, bits_t, size

cnp.import_array()

cdef extern from "_simd.h":
    void ds_count3_1(const uint8_t* b, int64_t n, int32_t mask, int32_t t1, int32_t t2, int32_t t3,
                     int64_t* out) noexcept nogil
    void ds_count3_2(const uint16_t* b, int64_t n, int32_t mask, int32_t t1, int32_t t2, int32_t t3,
                     int64_t* out) noexcept nogil
    void ds_count3_4(const uint32_t* b, int64_t n, int64_t mask, int64_t t1, int64_t t2, int64_t t3,
                     int64_t* out) noexcept nogil
    void ds_count3_8(const uint64_t* b, int64_t n, int64_t mask, int64_t t1, int64_t t2, int64_t t3,
                     int64_t* out) noexcept nogil
    void ds_ranks3_1(const uint8_t* bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3, const int64_t* pos,
                     int64_t i0, int64_t i1, int64_t start, int64_t g1, int64_t g2, int64_t g3, int64_t* rank,
                     int64_t* bucket) noexcept nogil
    void ds_ranks3_2(const uint16_t* bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3, const int64_t* pos,
                     int64_t i0, int64_t i1, int64_t start, int64_t g1, int64_t g2, int64_t g3, int64_t* rank,
                     int64_t* bucket) noexcept nogil
    void ds_ranks3_4(const uint32_t* bits, int64_t mask, int64_t t1, int64_t t2, int64_t t3, const int64_t* pos,
                     int64_t i0, int64_t i1, int64_t start, int64_t g1, int64_t g2, int64_t g3, int64_t* rank,
                     int64_t* bucket) noexcept nogil
    void ds_ranks3_8(const uint64_t* bits, int64_t mask, int64_t t1, int64_t t2, int64_t t3, const int64_t* pos,
                     int64_t i0, int64_t i1, int64_t start, int64_t g1, int64_t g2, int64_t g3, int64_t* rank,
                     int64_t* bucket) noexcept nogil
    int64_t ds_select3_1(const uint8_t* bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3, int64_t start,
                         int64_t stop, const int64_t* ranks, const int64_t* off, const int64_t* lo, const int64_t* hi,
                         int64_t g1, int64_t g2, int64_t g3, int64_t base, int64_t* outpos,
                         int64_t* src) noexcept nogil
    int64_t ds_select3_2(const uint16_t* bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3, int64_t start,
                         int64_t stop, const int64_t* ranks, const int64_t* off, const int64_t* lo, const int64_t* hi,
                         int64_t g1, int64_t g2, int64_t g3, int64_t base, int64_t* outpos,
                         int64_t* src) noexcept nogil
    int64_t ds_select3_4(const uint32_t* bits, int64_t mask, int64_t t1, int64_t t2, int64_t t3, int64_t start,
                         int64_t stop, const int64_t* ranks, const int64_t* off, const int64_t* lo, const int64_t* hi,
                         int64_t g1, int64_t g2, int64_t g3, int64_t base, int64_t* outpos,
                         int64_t* src) noexcept nogil
    int64_t ds_select3_8(const uint64_t* bits, int64_t mask, int64_t t1, int64_t t2, int64_t t3, int64_t start,
                         int64_t stop, const int64_t* ranks, const int64_t* off, const int64_t* lo, const int64_t* hi,
                         int64_t g1, int64_t g2, int64_t g3, int64_t base, int64_t* outpos,
                         int64_t* src) noexcept nogil


    void ds_ranks3b_2(int isa, const uint16_t* bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3,
                      const int64_t* pos, int64_t i0, int64_t i1, int64_t start, int64_t stop, int64_t g1,
                      int64_t g2, int64_t g3, int64_t* rank, int64_t* bucket, int64_t* gend) noexcept nogil
    int64_t ds_select3b_2(int isa, const uint16_t* bits, int32_t mask, int32_t t1, int32_t t2, int32_t t3,
                          int64_t start, int64_t stop, const int64_t* ranks, const int64_t* off, const int64_t* lo,
                          const int64_t* hi, int64_t g1, int64_t g2, int64_t g3, int64_t base, int64_t* outpos,
                          int64_t* src, const int64_t* steps, uint16_t* newbits, int* bad) noexcept nogil


cdef const char* _bits(object bits, int64_t mask, int* w) except NULL:
    cdef const char* p = arr(bits, 0, ANY, False, "bits")
    w[0] = bits.itemsize
    if mask < 0 or (w[0] < 8 and mask >> (8 * w[0]) != 0):
        raise ValueError(f"mask {mask:#x} does not fit the elements' {8 * w[0]} bits")
    return p


cdef inline void _count3_s(const bits_t* b, int64_t start, int64_t stop, int64_t mask, int64_t t1, int64_t t2,
                         int64_t t3, int64_t* out) noexcept nogil:
    # elements of b[start:stop] whose magnitude is >= t1, t2, t3 (the vectorised loop of _simd.h)
    if stop <= start:
        out[0] = 0
        out[1] = 0
        out[2] = 0
    elif bits_t is uint8_t:
        ds_count3_1(b + start, stop - start, <int32_t>mask, <int32_t>t1, <int32_t>t2, <int32_t>t3, out)
    elif bits_t is uint16_t:
        ds_count3_2(b + start, stop - start, <int32_t>mask, <int32_t>t1, <int32_t>t2, <int32_t>t3, out)
    elif bits_t is uint32_t:
        ds_count3_4(b + start, stop - start, mask, t1, t2, t3, out)
    else:
        ds_count3_8(b + start, stop - start, mask, t1, t2, t3, out)


cdef int _class_hist_s(const bits_t* x, int64_t stride, int64_t start, int64_t stop, int64_t mask, int64_t shift,
                       int64_t* hist, int64_t n) noexcept nogil:
    # four interleaved sub-histograms: consecutive elements of one class do not wait on each other's store
    cdef int64_t* h = <int64_t*>calloc(4 * n if n > 0 else 1, sizeof(int64_t))
    if h == NULL:
        return -1
    cdef int64_t i = start, c
    while i + 4 <= stop:
        h[(<int64_t>x[i * stride] & mask) >> shift] += 1
        h[n + ((<int64_t>x[(i + 1) * stride] & mask) >> shift)] += 1
        h[2 * n + ((<int64_t>x[(i + 2) * stride] & mask) >> shift)] += 1
        h[3 * n + ((<int64_t>x[(i + 3) * stride] & mask) >> shift)] += 1
        i += 4
    while i < stop:
        h[(<int64_t>x[i * stride] & mask) >> shift] += 1
        i += 1
    for c in range(n):
        hist[c] += h[c] + h[n + c] + h[2 * n + c] + h[3 * n + c]
    free(h)
    return 0


def _class_hist(bits, int64_t start, int64_t stop, int64_t mask, int64_t shift, hist):
    """Add the class counts of ``bits[start:stop]`` to ``hist`` (``bits`` 1-D, any stride)."""
    if not isinstance(bits, cnp.ndarray) or bits.ndim != 1:
        raise TypeError("bits: expected a 1-D numpy array")
    cdef int w = bits.itemsize
    if not (cnp.PyArray_ISINTEGER(bits) or cnp.PyArray_ISBOOL(bits)) or w not in (1, 2, 4, 8):
        raise TypeError(f"bits: unexpected dtype {bits.dtype}")
    if mask < 0 or (w < 8 and mask >> (8 * w) != 0):
        raise ValueError(f"mask {mask:#x} does not fit the elements' {8 * w} bits")
    cdef int64_t stride = bits.strides[0] // w if bits.size > 1 else 1
    if bits.size > 1 and bits.strides[0] % w != 0:
        raise ValueError("bits: stride is not a multiple of the element size")
    cdef const char* x = <const char*>cnp.PyArray_DATA(<cnp.ndarray>bits)
    cdef int64_t* ph = <int64_t*>arr(hist, 8, SIGNED, True, "hist")
    cdef int64_t n = size(hist)
    cdef int r
    with nogil:
        if w == 1:
            r = _class_hist_s(<const uint8_t*>x, stride, start, stop, mask, shift, ph, n)
        elif w == 2:
            r = _class_hist_s(<const uint16_t*>x, stride, start, stop, mask, shift, ph, n)
        elif w == 4:
            r = _class_hist_s(<const uint32_t*>x, stride, start, stop, mask, shift, ph, n)
        else:
            r = _class_hist_s(<const uint64_t*>x, stride, start, stop, mask, shift, ph, n)
    if r:
        raise MemoryError()


cdef void _ranks_s(const bits_t* bits, int64_t mask, int64_t shift, const int64_t* lut, const int64_t* pos,
                   int64_t i0, int64_t i1, int64_t start, int64_t* running, int64_t* rank,
                   int64_t* bucket) noexcept nogil:
    if i0 >= i1:
        return
    cdef int64_t j = i0, last = pos[i1 - 1], idx, b
    for idx in range(start, last + 1):
        b = lut[(<int64_t>bits[idx] & mask) >> shift]
        if idx == pos[j]:
            rank[j] = running[b]
            bucket[j] = b
            j += 1
        running[b] += 1


def _ranks(bits, int64_t mask, int64_t shift, lut, pos, int64_t i0, int64_t i1, int64_t start, running, rank,
           bucket):
    cdef int w
    cdef const char* pb = _bits(bits, mask, &w)
    cdef const int64_t* pl = <const int64_t*>arr(lut, 8, SIGNED, False, "lut")
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef int64_t* pr = <int64_t*>arr(running, 8, SIGNED, True, "running")
    cdef int64_t* pk = <int64_t*>arr(rank, 8, SIGNED, True, "rank")
    cdef int64_t* pu = <int64_t*>arr(bucket, 8, SIGNED, True, "bucket")
    with nogil:
        if w == 1:
            _ranks_s(<const uint8_t*>pb, mask, shift, pl, pp, i0, i1, start, pr, pk, pu)
        elif w == 2:
            _ranks_s(<const uint16_t*>pb, mask, shift, pl, pp, i0, i1, start, pr, pk, pu)
        elif w == 4:
            _ranks_s(<const uint32_t*>pb, mask, shift, pl, pp, i0, i1, start, pr, pk, pu)
        else:
            _ranks_s(<const uint64_t*>pb, mask, shift, pl, pp, i0, i1, start, pr, pk, pu)


def _count3(bits, int64_t start, int64_t stop, int64_t mask, int64_t t1, int64_t t2, int64_t t3):
    """Elements of ``bits[start:stop]`` whose magnitude is >= t1, t2, t3."""
    cdef int w
    cdef const char* pb = _bits(bits, mask, &w)
    cdef int64_t out[3]
    with nogil:
        if w == 1:
            _count3_s(<const uint8_t*>pb, start, stop, mask, t1, t2, t3, out)
        elif w == 2:
            _count3_s(<const uint16_t*>pb, start, stop, mask, t1, t2, t3, out)
        elif w == 4:
            _count3_s(<const uint32_t*>pb, start, stop, mask, t1, t2, t3, out)
        else:
            _count3_s(<const uint64_t*>pb, start, stop, mask, t1, t2, t3, out)
    return out[0], out[1], out[2]


def _ranks3(bits, int64_t mask, int64_t t1, int64_t t2, int64_t t3, pos, int64_t i0, int64_t i1, int64_t start,
            int64_t stop, int64_t g1, int64_t g2, int64_t g3, rank, bucket, int isa=-1):
    """Ranks and buckets of ``pos[i0:i1]`` (inside ``[start, stop)``, ``stop`` at most the array's end), the
    counts before ``start`` being ``g1 .. g3``; 16-bit elements by 32-element blocks (``isa``: at most that
    instruction set, for tests)."""
    cdef int w
    cdef const char* pb = _bits(bits, mask, &w)
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef int64_t* pk = <int64_t*>arr(rank, 8, SIGNED, True, "rank")
    cdef int64_t* pu = <int64_t*>arr(bucket, 8, SIGNED, True, "bucket")
    if not 0 <= start <= stop <= size(bits) or (i1 > i0 and (pp[i0] < start or pp[i1 - 1] >= stop)):
        raise ValueError("_ranks3: positions outside [start, stop) or stop past the array")
    with nogil:  # the loops are _simd.h's ds_ranks3b_2 (16-bit) and ds_ranks3_*
        if w == 2:
            ds_ranks3b_2(isa, <const uint16_t*>pb, <int32_t>mask, <int32_t>t1, <int32_t>t2, <int32_t>t3, pp, i0, i1,
                         start, stop, g1, g2, g3, pk, pu, NULL)
        elif w == 1:
            ds_ranks3_1(<const uint8_t*>pb, <int32_t>mask, <int32_t>t1, <int32_t>t2, <int32_t>t3, pp, i0, i1, start,
                        g1, g2, g3, pk, pu)
        elif w == 4:
            ds_ranks3_4(<const uint32_t*>pb, mask, t1, t2, t3, pp, i0, i1, start, g1, g2, g3, pk, pu)
        else:
            ds_ranks3_8(<const uint64_t*>pb, mask, t1, t2, t3, pp, i0, i1, start, g1, g2, g3, pk, pu)


cdef int64_t _select_s(const bits_t* bits, int64_t mask, int64_t shift, const int64_t* lut, int64_t start,
                       int64_t stop, const int64_t* ranks, const int64_t* off, int64_t* ptr, const int64_t* hi,
                       int64_t nb, int64_t* running, int64_t base, int64_t* outpos, int64_t* src) noexcept nogil:
    cdef int64_t remaining = 0, o = base, idx = start, b, p
    for b in range(nb):
        remaining += hi[b] - ptr[b]
    while remaining > 0 and idx < stop:
        b = lut[(<int64_t>bits[idx] & mask) >> shift]
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


def _select(bits, int64_t mask, int64_t shift, lut, int64_t start, int64_t stop, ranks, off, lo, hi, running,
            int64_t base, outpos, src):
    cdef int w
    cdef const char* pb = _bits(bits, mask, &w)
    cdef const int64_t* pl = <const int64_t*>arr(lut, 8, SIGNED, False, "lut")
    cdef const int64_t* pr = <const int64_t*>arr(ranks, 8, SIGNED, False, "ranks")
    cdef const int64_t* po = <const int64_t*>arr(off, 8, SIGNED, False, "off")
    arr(lo, 8, SIGNED, False, "lo")
    cdef const int64_t* ph = <const int64_t*>arr(hi, 8, SIGNED, False, "hi")
    cdef int64_t* pu = <int64_t*>arr(running, 8, SIGNED, True, "running")
    cdef int64_t* pp = <int64_t*>arr(outpos, 8, SIGNED, True, "outpos")
    cdef int64_t* ps = <int64_t*>arr(src, 8, SIGNED, True, "src")
    cdef int64_t nb = size(lo), r
    if size(hi) < nb or size(off) < nb:
        raise ValueError("_select: lo, hi and off of different lengths")
    cdef cnp.ndarray ptr = lo.copy()
    cdef int64_t* pt = <int64_t*>cnp.PyArray_DATA(ptr)
    with nogil:
        if w == 1:
            r = _select_s(<const uint8_t*>pb, mask, shift, pl, start, stop, pr, po, pt, ph, nb, pu, base, pp, ps)
        elif w == 2:
            r = _select_s(<const uint16_t*>pb, mask, shift, pl, start, stop, pr, po, pt, ph, nb, pu, base, pp, ps)
        elif w == 4:
            r = _select_s(<const uint32_t*>pb, mask, shift, pl, start, stop, pr, po, pt, ph, nb, pu, base, pp, ps)
        else:
            r = _select_s(<const uint64_t*>pb, mask, shift, pl, start, stop, pr, po, pt, ph, nb, pu, base, pp, ps)
    return r


def _select3(bits, int64_t mask, int64_t t1, int64_t t2, int64_t t3, int64_t start, int64_t stop, ranks, off, lo,
             hi, int64_t g1, int64_t g2, int64_t g3, int64_t base, outpos, src, int isa=-1):
    cdef int w
    cdef const char* pb = _bits(bits, mask, &w)
    cdef const int64_t* pr = <const int64_t*>arr(ranks, 8, SIGNED, False, "ranks")
    cdef const int64_t* po = <const int64_t*>arr(off, 8, SIGNED, False, "off")
    cdef const int64_t* pl = <const int64_t*>arr(lo, 8, SIGNED, False, "lo")
    cdef const int64_t* ph = <const int64_t*>arr(hi, 8, SIGNED, False, "hi")
    cdef int64_t* pp = <int64_t*>arr(outpos, 8, SIGNED, True, "outpos")
    cdef int64_t* ps = <int64_t*>arr(src, 8, SIGNED, True, "src")
    cdef int64_t r
    if size(lo) < 4 or size(hi) < 4 or size(off) < 4:
        raise ValueError("_select3: four buckets")
    if not 0 <= start <= stop <= size(bits):
        raise ValueError("_select3: stop past the array")
    with nogil:  # the loops are _simd.h's ds_select3b_2 (16-bit) and ds_select3_*
        if w == 2:
            r = ds_select3b_2(isa, <const uint16_t*>pb, <int32_t>mask, <int32_t>t1, <int32_t>t2, <int32_t>t3, start,
                              stop, pr, po, pl, ph, g1, g2, g3, base, pp, ps, NULL, NULL, NULL)
        elif w == 1:
            r = ds_select3_1(<const uint8_t*>pb, <int32_t>mask, <int32_t>t1, <int32_t>t2, <int32_t>t3, start, stop,
                             pr, po, pl, ph, g1, g2, g3, base, pp, ps)
        elif w == 4:
            r = ds_select3_4(<const uint32_t*>pb, mask, t1, t2, t3, start, stop, pr, po, pl, ph, g1, g2, g3, base,
                             pp, ps)
        else:
            r = ds_select3_8(<const uint64_t*>pb, mask, t1, t2, t3, start, stop, pr, po, pl, ph, g1, g2, g3, base,
                             pp, ps)
    return r
