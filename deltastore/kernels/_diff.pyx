# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled loops of :mod:`deltastore.kernels.diff` (that module describes items, segments and each kernel's
contract). Segment data is read and written by address; ``like`` gives the element width."""

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

from ._arrays cimport (ADDRESS, ANY, SIGNED, UNSIGNED, arr, bits_t, ds_load64, ds_prefetch_w, mix_dense,
                       mix_sparse, size, width_of)

cnp.import_array()

cdef extern from "_simd.h":
    int ds_words_zero(const unsigned char* p, int64_t nw) noexcept nogil
    int64_t ds_diff_1(uint8_t* o, const uint8_t* n, int64_t a, int64_t b, int64_t* pos, uint8_t* nw, uint8_t* od,
                      int64_t cap, int advance, int64_t* next) noexcept nogil
    int64_t ds_diff_2(uint16_t* o, const uint16_t* n, int64_t a, int64_t b, int64_t* pos, uint16_t* nw,
                      uint16_t* od, int64_t cap, int advance, int64_t* next) noexcept nogil
    int64_t ds_diff_4(uint32_t* o, const uint32_t* n, int64_t a, int64_t b, int64_t* pos, uint32_t* nw,
                      uint32_t* od, int64_t cap, int advance, int64_t* next) noexcept nogil
    int64_t ds_diff_8(uint64_t* o, const uint64_t* n, int64_t a, int64_t b, int64_t* pos, uint64_t* nw,
                      uint64_t* od, int64_t cap, int advance, int64_t* next) noexcept nogil
    int ds_diff_isa() noexcept nogil
    int64_t ds_diff_on_1(int isa, uint8_t* o, const uint8_t* n, int64_t a, int64_t b, int64_t* pos, uint8_t* nw,
                         uint8_t* od, int64_t cap, int advance, int64_t* next) noexcept nogil
    int64_t ds_diff_on_2(int isa, uint16_t* o, const uint16_t* n, int64_t a, int64_t b, int64_t* pos, uint16_t* nw,
                         uint16_t* od, int64_t cap, int advance, int64_t* next) noexcept nogil
    int64_t ds_diff_on_4(int isa, uint32_t* o, const uint32_t* n, int64_t a, int64_t b, int64_t* pos, uint32_t* nw,
                         uint32_t* od, int64_t cap, int advance, int64_t* next) noexcept nogil
    int64_t ds_diff_on_8(int isa, uint64_t* o, const uint64_t* n, int64_t a, int64_t b, int64_t* pos, uint64_t* nw,
                         uint64_t* od, int64_t cap, int advance, int64_t* next) noexcept nogil

ctypedef fused pos_t:   # a drift table's positions
    int32_t
    int64_t

ctypedef fused opos_t:  # the merged table's positions (may be wider than the previous table's)
    int32_t
    int64_t

cdef enum:
    _SCATTER_AHEAD = 32  # items: the cache line of the position this far ahead is fetched for writing


# --- compare ------------------------------------------------------------------------------------------

cdef inline int64_t _diff_range(bits_t* o, const bits_t* n, int64_t a, int64_t b, int64_t* pos, bits_t* new,
                                bits_t* old, int64_t cap, int advance, int64_t* nxt) noexcept nogil:
    if bits_t is uint8_t:
        return ds_diff_1(o, n, a, b, pos, new, old, cap, advance, nxt)
    elif bits_t is uint16_t:
        return ds_diff_2(o, n, a, b, pos, new, old, cap, advance, nxt)
    elif bits_t is uint32_t:
        return ds_diff_4(o, n, a, b, pos, new, old, cap, advance, nxt)
    else:
        return ds_diff_8(o, n, a, b, pos, new, old, cap, advance, nxt)


cdef (int64_t, int64_t, int64_t) _diff_items(
        const int64_t* optr, const int64_t* nptr, const int64_t* lens, const uint64_t* keys, const int64_t* iseg,
        const int64_t* istart, const int64_t* istop, int64_t i0, int64_t i1, int64_t e_resume, int64_t* pos,
        bits_t* new, bits_t* old, int64_t cap, int64_t* counts, uint64_t* sums, int advance) noexcept nogil:
    # each item's range by 64-byte blocks (_simd.h ds_diff_*), then its changes' checksum delta
    cdef int64_t c = 0, got, i, s, a, b, j = 0
    for i in range(i0, i1):
        s = iseg[i]
        a = istart[i]
        if i == i0 and e_resume > a:
            a = e_resume
        b = istop[i]
        got = _diff_range(<bits_t*><uintptr_t>optr[s], <const bits_t*><uintptr_t>nptr[s], a, b, pos + c, new + c,
                          old + c, cap - c, advance, &j)
        if got:
            counts[i] += got
            sums[i] += mix_sparse(pos, new, c, c + got, keys[s]) - mix_sparse(pos, old, c, c + got, keys[s])
            c += got
        if j < b:
            return c, i, j
    return c, i1, 0


def compare_isa():
    """The vector instruction set the compare uses on this CPU: 2 AVX-512BW, 1 AVX2, 0 SSE2 or plain C."""
    return ds_diff_isa()


def compare_range(old, new, int64_t a, int64_t b, pos, new_out, old_out, int isa=-1, bint advance=False):
    """One range ``[a, b)`` of the compare (``old``/``new``: unsigned arrays of one width) with instruction set
    ``isa`` (-1: the best; above what the CPU has: the best), for tests. Returns ``(written, next element)``."""
    cdef int w = old.itemsize if isinstance(old, cnp.ndarray) else 0
    cdef char* po = arr(old, w, UNSIGNED, advance, "old")
    cdef const char* pn = arr(new, w, UNSIGNED, False, "new")
    cdef int64_t* pp = <int64_t*>arr(pos, 8, SIGNED, True, "pos")
    cdef char* pno = arr(new_out, w, UNSIGNED, True, "new_out")
    cdef char* poo = arr(old_out, w, UNSIGNED, True, "old_out")
    cdef int64_t cap = min(size(pos), size(new_out), size(old_out)), nxt = 0, c
    if not 0 <= a <= b <= min(size(old), size(new)):
        raise ValueError("compare_range: range outside the arrays")
    with nogil:
        if w == 1:
            c = ds_diff_on_1(isa, <uint8_t*>po, <const uint8_t*>pn, a, b, pp, <uint8_t*>pno, <uint8_t*>poo, cap,
                             advance, &nxt)
        elif w == 2:
            c = ds_diff_on_2(isa, <uint16_t*>po, <const uint16_t*>pn, a, b, pp, <uint16_t*>pno, <uint16_t*>poo, cap,
                             advance, &nxt)
        elif w == 4:
            c = ds_diff_on_4(isa, <uint32_t*>po, <const uint32_t*>pn, a, b, pp, <uint32_t*>pno, <uint32_t*>poo, cap,
                             advance, &nxt)
        else:
            c = ds_diff_on_8(isa, <uint64_t*>po, <const uint64_t*>pn, a, b, pp, <uint64_t*>pno, <uint64_t*>poo, cap,
                             advance, &nxt)
    return c, nxt


def diff_items(like, optr, nptr, lens, keys, iseg, istart, istop, int64_t i0, int64_t i1, int64_t e_resume, pos,
               new, old, counts, sums, bint advance=False):
    """Compare items ``i0 .. i1 - 1`` (the first from element ``e_resume``, if above its start); see
    :mod:`deltastore.kernels.diff`. With ``advance``, the new bits are also written over the old ones where they
    differ (``optr``'s memory: the mirror moves to the new version in the same pass). Returns ``(written, next
    item, next element)``."""
    cdef int w = width_of(like)
    cdef const int64_t* po = <const int64_t*>arr(optr, 8, ADDRESS, False, "optr")
    cdef const int64_t* pn = <const int64_t*>arr(nptr, 8, ADDRESS, False, "nptr")
    cdef const int64_t* pl = <const int64_t*>arr(lens, 8, SIGNED, False, "lens")
    cdef const uint64_t* pk = <const uint64_t*>arr(keys, 8, UNSIGNED, False, "keys")
    cdef const int64_t* ps = <const int64_t*>arr(iseg, 8, SIGNED, False, "iseg")
    cdef const int64_t* pa = <const int64_t*>arr(istart, 8, SIGNED, False, "istart")
    cdef const int64_t* pb = <const int64_t*>arr(istop, 8, SIGNED, False, "istop")
    cdef int64_t* pp = <int64_t*>arr(pos, 8, SIGNED, True, "pos")
    cdef char* pnew = arr(new, w, UNSIGNED, True, "new")
    cdef char* pold = arr(old, w, UNSIGNED, True, "old")
    cdef int64_t* pc = <int64_t*>arr(counts, 8, SIGNED, True, "counts")
    cdef uint64_t* pu = <uint64_t*>arr(sums, 8, UNSIGNED, True, "sums")
    cdef int64_t cap = size(pos)
    cdef (int64_t, int64_t, int64_t) r
    if size(new) < cap or size(old) < cap:
        raise ValueError("diff_items: new and old must hold as many elements as pos")
    with nogil:
        if w == 1:
            r = _diff_items(po, pn, pl, pk, ps, pa, pb, i0, i1, e_resume, pp, <uint8_t*>pnew, <uint8_t*>pold, cap,
                            pc, pu, advance)
        elif w == 2:
            r = _diff_items(po, pn, pl, pk, ps, pa, pb, i0, i1, e_resume, pp, <uint16_t*>pnew, <uint16_t*>pold, cap,
                            pc, pu, advance)
        elif w == 4:
            r = _diff_items(po, pn, pl, pk, ps, pa, pb, i0, i1, e_resume, pp, <uint32_t*>pnew, <uint32_t*>pold, cap,
                            pc, pu, advance)
        else:
            r = _diff_items(po, pn, pl, pk, ps, pa, pb, i0, i1, e_resume, pp, <uint64_t*>pnew, <uint64_t*>pold, cap,
                            pc, pu, advance)
    return r


# --- gather, scatter, copy ----------------------------------------------------------------------------

cdef int64_t _gather_items(const int64_t* ptr, const int64_t* lens, const int64_t* pos, const int64_t* bounds,
                           int64_t s0, int64_t s1, bits_t* out) noexcept nogil:
    cdef int64_t s, n, i, p
    cdef const bits_t* a
    for s in range(s0, s1):
        n = lens[s]
        a = <const bits_t*><uintptr_t>ptr[s]
        for i in range(bounds[s], bounds[s + 1]):
            p = pos[i]
            if p < 0 or p >= n:
                return i
            out[i] = a[p]
    return -1


def gather_items(like, ptr, lens, pos, bounds, int64_t s0, int64_t s1, out):
    """``out[i] = segment s's bits at pos[i]`` for ``i`` in ``bounds[s] .. bounds[s + 1]``, segments
    ``s0 .. s1 - 1``. Returns -1, or the first ``i`` whose position lies outside its segment."""
    cdef int w = width_of(like)
    cdef const int64_t* pt = <const int64_t*>arr(ptr, 8, ADDRESS, False, "ptr")
    cdef const int64_t* pl = <const int64_t*>arr(lens, 8, SIGNED, False, "lens")
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef char* po = arr(out, w, ANY, True, "out")
    cdef int64_t r
    with nogil:
        if w == 1:
            r = _gather_items(pt, pl, pp, pb, s0, s1, <uint8_t*>po)
        elif w == 2:
            r = _gather_items(pt, pl, pp, pb, s0, s1, <uint16_t*>po)
        elif w == 4:
            r = _gather_items(pt, pl, pp, pb, s0, s1, <uint32_t*>po)
        else:
            r = _gather_items(pt, pl, pp, pb, s0, s1, <uint64_t*>po)
    return r


cdef void _scatter_items(const int64_t* ptr, const int64_t* pos, const int64_t* bounds, int64_t s0, int64_t s1,
                         const bits_t* vals, bint ahead) noexcept nogil:
    cdef int64_t s, i, end
    cdef bits_t* a
    for s in range(s0, s1):
        a = <bits_t*><uintptr_t>ptr[s]
        end = bounds[s + 1]
        for i in range(bounds[s], end):
            # Sparse positions defeat the hardware prefetcher, and each store waits for its line: asking
            # for the line _SCATTER_AHEAD items ahead cuts a real dither step's write by a fifth
            # (bench/kernels.py); a gather gains nothing from it (its loads already overlap).
            if ahead and i + _SCATTER_AHEAD < end:
                ds_prefetch_w(a + pos[i + _SCATTER_AHEAD])
            a[pos[i]] = vals[i]


cdef _scatter(like, ptr, lens, pos, bounds, int64_t s0, int64_t s1, vals, bint ahead):
    cdef int w = width_of(like)
    cdef const int64_t* pt = <const int64_t*>arr(ptr, 8, ADDRESS, False, "ptr")
    arr(lens, 8, SIGNED, False, "lens")
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef const char* pv = arr(vals, w, ANY, False, "vals")
    with nogil:
        if w == 1:
            _scatter_items(pt, pp, pb, s0, s1, <const uint8_t*>pv, ahead)
        elif w == 2:
            _scatter_items(pt, pp, pb, s0, s1, <const uint16_t*>pv, ahead)
        elif w == 4:
            _scatter_items(pt, pp, pb, s0, s1, <const uint32_t*>pv, ahead)
        else:
            _scatter_items(pt, pp, pb, s0, s1, <const uint64_t*>pv, ahead)
    return 0


def scatter_items(like, ptr, lens, pos, bounds, int64_t s0, int64_t s1, vals):
    """``segment s's bits at pos[i] = vals[i]`` for ``i`` in ``bounds[s] .. bounds[s + 1]``, segments
    ``s0 .. s1 - 1``."""
    return _scatter(like, ptr, lens, pos, bounds, s0, s1, vals, True)


def scatter_items_plain(like, ptr, lens, pos, bounds, int64_t s0, int64_t s1, vals):
    """:func:`scatter_items` without its prefetch: the reference ``bench/kernels.py`` times it against."""
    return _scatter(like, ptr, lens, pos, bounds, s0, s1, vals, False)


cdef int64_t _take_stream(const int64_t* ptrs, const int64_t* lens, const int64_t* starts, const int64_t* bounds,
                          const int64_t* idx, Py_ssize_t nidx, const int64_t* home, bits_t* out) noexcept nogil:
    cdef int64_t o = 0, a, b, k, e, x
    cdef Py_ssize_t j
    cdef const bits_t* src
    for j in range(nidx):
        a = bounds[idx[j]]
        b = bounds[idx[j] + 1]
        k = home[j]
        while a < b:
            src = <const bits_t*><uintptr_t>ptrs[k]
            e = min(b, starts[k] + lens[k])
            for x in range(a - starts[k], e - starts[k]):
                out[o] = src[x]
                o += 1
            a = e
            k += 1
    return o


def take_stream(like, ptrs, lens, starts, bounds, idx, home, out):
    """``out`` = segments ``idx[0], idx[1], ...`` (any order) of a stream held in parts, back to back; returns
    the elements written (see :mod:`deltastore.kernels.diff`)."""
    cdef int w = width_of(like)
    cdef const int64_t* pt = <const int64_t*>arr(ptrs, 8, ADDRESS, False, "ptrs")
    cdef const int64_t* pl = <const int64_t*>arr(lens, 8, SIGNED, False, "lens")
    cdef const int64_t* ps = <const int64_t*>arr(starts, 8, SIGNED, False, "starts")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef const int64_t* pi = <const int64_t*>arr(idx, 8, SIGNED, False, "idx")
    cdef const int64_t* ph = <const int64_t*>arr(home, 8, SIGNED, False, "home")
    cdef char* po = arr(out, w, ANY, True, "out")
    cdef Py_ssize_t n = size(idx)
    cdef int64_t r
    with nogil:
        if w == 1:
            r = _take_stream(pt, pl, ps, pb, pi, n, ph, <uint8_t*>po)
        elif w == 2:
            r = _take_stream(pt, pl, ps, pb, pi, n, ph, <uint16_t*>po)
        elif w == 4:
            r = _take_stream(pt, pl, ps, pb, pi, n, ph, <uint32_t*>po)
        else:
            r = _take_stream(pt, pl, ps, pb, pi, n, ph, <uint64_t*>po)
    return r


def copy_items(like, src, dst, iseg, istart, istop, int64_t i0, int64_t i1):
    """Copy elements ``[istart[i], istop[i])`` of segment ``iseg[i]`` from ``src`` to ``dst`` addresses (ranges
    that do not overlap)."""
    cdef int64_t w = width_of(like)
    cdef const int64_t* ps = <const int64_t*>arr(src, 8, ADDRESS, False, "src")
    cdef const int64_t* pd = <const int64_t*>arr(dst, 8, ADDRESS, False, "dst")
    cdef const int64_t* pg = <const int64_t*>arr(iseg, 8, SIGNED, False, "iseg")
    cdef const int64_t* pa = <const int64_t*>arr(istart, 8, SIGNED, False, "istart")
    cdef const int64_t* pb = <const int64_t*>arr(istop, 8, SIGNED, False, "istop")
    cdef int64_t i, s
    with nogil:
        for i in range(i0, i1):
            s = pg[i]
            if pb[i] > pa[i]:
                memcpy(<char*><uintptr_t>pd[s] + pa[i] * w, <const char*><uintptr_t>ps[s] + pa[i] * w,
                       <size_t>((pb[i] - pa[i]) * w))
    return 0


# --- checksums -----------------------------------------------------------------------------------------

cdef uint64_t _mix_at(int w, int64_t addr, int64_t start, int64_t stop, uint64_t key) noexcept nogil:
    if w == 1:
        return mix_dense(<const uint8_t*><uintptr_t>addr, start, stop, key)
    if w == 2:
        return mix_dense(<const uint16_t*><uintptr_t>addr, start, stop, key)
    if w == 4:
        return mix_dense(<const uint32_t*><uintptr_t>addr, start, stop, key)
    return mix_dense(<const uint64_t*><uintptr_t>addr, start, stop, key)


def mix_full_items(like, ptr, lens, keys, iseg, istart, istop, int64_t i0, int64_t i1, out):
    """``out[i] = sum mix(key, p, bits[p])`` over elements ``[istart[i], istop[i])`` of segment ``iseg[i]``."""
    cdef int w = width_of(like)
    cdef const int64_t* pt = <const int64_t*>arr(ptr, 8, ADDRESS, False, "ptr")
    arr(lens, 8, SIGNED, False, "lens")
    cdef const uint64_t* pk = <const uint64_t*>arr(keys, 8, UNSIGNED, False, "keys")
    cdef const int64_t* pg = <const int64_t*>arr(iseg, 8, SIGNED, False, "iseg")
    cdef const int64_t* pa = <const int64_t*>arr(istart, 8, SIGNED, False, "istart")
    cdef const int64_t* pb = <const int64_t*>arr(istop, 8, SIGNED, False, "istop")
    cdef uint64_t* po = <uint64_t*>arr(out, 8, UNSIGNED, True, "out")
    cdef int64_t i, s
    with nogil:
        for i in range(i0, i1):
            s = pg[i]
            po[i] = _mix_at(w, pt[s], pa[i], pb[i], pk[s])
    return 0


cdef void _mix_delta(const int64_t* pos, const bits_t* old, const bits_t* new, const int64_t* bounds,
                     const uint64_t* keys, int64_t s0, int64_t s1, uint64_t* out) noexcept nogil:
    cdef int64_t s, a, b
    for s in range(s0, s1):
        a = bounds[s]
        b = bounds[s + 1]
        if b > a:
            out[s] = mix_sparse(pos, new, a, b, keys[s]) - mix_sparse(pos, old, a, b, keys[s])


def mix_delta_segments(pos, old, new, bounds, keys, int64_t s0, int64_t s1, out):
    """``out[s] = sum mix(key_s, p, new) - sum mix(key_s, p, old)`` over segment ``s``'s changes (mod 2**64)."""
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef int w = old.itemsize if isinstance(old, cnp.ndarray) else 0
    cdef const char* po = arr(old, w, UNSIGNED, False, "old")
    cdef const char* pn = arr(new, w, UNSIGNED, False, "new")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef const uint64_t* pk = <const uint64_t*>arr(keys, 8, UNSIGNED, False, "keys")
    cdef uint64_t* pu = <uint64_t*>arr(out, 8, UNSIGNED, True, "out")
    with nogil:
        if w == 1:
            _mix_delta(pp, <const uint8_t*>po, <const uint8_t*>pn, pb, pk, s0, s1, pu)
        elif w == 2:
            _mix_delta(pp, <const uint16_t*>po, <const uint16_t*>pn, pb, pk, s0, s1, pu)
        elif w == 4:
            _mix_delta(pp, <const uint32_t*>po, <const uint32_t*>pn, pb, pk, s0, s1, pu)
        else:
            _mix_delta(pp, <const uint64_t*>po, <const uint64_t*>pn, pb, pk, s0, s1, pu)
    return 0


def check_segments(pos, bounds, numels, int64_t s0, int64_t s1):
    """The first of segments ``s0 .. s1 - 1`` whose positions are not strictly increasing in ``[0, numel)``,
    or -1."""
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef const int64_t* pn = <const int64_t*>arr(numels, 8, SIGNED, False, "numels")
    cdef int64_t s, i, p, last, n, r = -1
    with nogil:
        for s in range(s0, s1):
            last = -1
            n = pn[s]
            for i in range(pb[s], pb[s + 1]):
                p = pp[i]
                if p <= last or p >= n:
                    r = s
                    break
                last = p
            if r >= 0:
                break
    return r


# --- zero tests ----------------------------------------------------------------------------------------

cdef bint _all_zero(int64_t width, int64_t ptr, int64_t n) noexcept nogil:
    # 8 bytes at a time where aligned
    cdef const unsigned char* a = <const unsigned char*><uintptr_t>ptr
    cdef int64_t j = 0, k = 8 // width, nw, q
    while j < n and ((ptr + j * width) & 7) != 0:
        for q in range(width):
            if a[j * width + q] != 0:
                return False
        j += 1
    nw = (n - j) // k if k > 0 else 0
    if nw > 0:
        if not ds_words_zero(a + j * width, nw):
            return False
        j += nw * k
    while j < n:
        for q in range(width):
            if a[j * width + q] != 0:
                return False
        j += 1
    return True


def all_zero(like, int64_t ptr, int64_t n):
    """Whether the ``n`` elements at ``ptr`` are all zero (8 bytes at a time where aligned)."""
    cdef int64_t w = width_of(like)
    cdef bint r
    with nogil:
        r = _all_zero(w, ptr, n)
    return r


def zero_flags(like, ptrs, lens, out):
    """``out[i]`` = whether the ``lens[i]`` elements at ``ptrs[i]`` are all zero."""
    cdef int64_t w = width_of(like)
    cdef const int64_t* pt = <const int64_t*>arr(ptrs, 8, ADDRESS, False, "ptrs")
    cdef const int64_t* pl = <const int64_t*>arr(lens, 8, SIGNED, False, "lens")
    cdef uint8_t* po = <uint8_t*>arr(out, 1, UNSIGNED, True, "out")
    cdef Py_ssize_t n = size(ptrs), i
    if size(lens) < n or size(out) < n:
        raise ValueError("zero_flags: lens and out must be as long as ptrs")
    with nogil:
        for i in range(n):
            po[i] = _all_zero(w, pt[i], pl[i])


# --- drift tables ----------------------------------------------------------------------------------------

cdef inline (int64_t, int64_t) _merge_up(const pos_t* p_pos, const bits_t* p_anchor, int64_t i, int64_t n_p,
                                         const int64_t* cp, const bits_t* co, const bits_t* cn, int64_t j,
                                         int64_t j1, opos_t* out_pos, bits_t* out_anchor, int64_t c,
                                         bint write) noexcept nogil:
    # Changes j .. j1 - 1 of one part merged with the row's previous elements from i (below n_p) that lie
    # below them; returns the new (i, c). Each step emits one element (a previous one below the change, or
    # the change itself, dropped when it is back at the anchor's bits) without a branch on the data: the
    # comparisons select what is written and advance the indices. The element is written at out[c] even when
    # dropped (c does not move): that slot is free.
    cdef int64_t a, x, lt, le, keep, jj
    cdef bits_t anc
    while j < j1:
        if i >= n_p:  # the row's previous elements are used up: the rest are first changes
            for jj in range(j, j1):
                if write:
                    out_pos[c] = <opos_t>cp[jj]
                    out_anchor[c] = co[jj]
                c += 1
            return i, c
        a = p_pos[i]
        x = cp[j]
        anc = p_anchor[i]
        lt = a < x
        le = a <= x
        keep = (a != x) | (anc != cn[j])
        if write:
            out_pos[c] = <opos_t>(a if lt else x)
            out_anchor[c] = anc if le else co[j]
        c += keep
        i += le
        j += 1 - lt
    return i, c


cdef int64_t _drift_merge_rows(const int64_t* p_bounds, const pos_t* p_pos, const bits_t* p_anchor,
                               const int64_t* c_bounds, const int64_t* c_pos_at, const int64_t* c_old_at,
                               const int64_t* c_new_at, const int64_t* c_lens, int64_t* out_bounds,
                               opos_t* out_pos, bits_t* out_anchor, bint write, int64_t k0, int64_t k1, int64_t q0,
                               int64_t base0, int64_t c0) noexcept nogil:
    cdef int64_t c = c0, q = q0, base = base0, k, i, n_p, j, j_end, stop, e
    cdef const int64_t* cp
    cdef const bits_t* co
    cdef const bits_t* cn
    if write:
        out_bounds[k0] = c0
    for k in range(k0, k1):
        i = p_bounds[k]
        n_p = p_bounds[k + 1]
        j = c_bounds[k]
        j_end = c_bounds[k + 1]
        while j < j_end:  # the row's changes, a part at a time
            while j - base >= c_lens[q]:
                base += c_lens[q]
                q += 1
            stop = min(j_end, base + c_lens[q])
            cp = <const int64_t*><uintptr_t>c_pos_at[q]
            co = <const bits_t*><uintptr_t>c_old_at[q]
            cn = <const bits_t*><uintptr_t>c_new_at[q]
            i, c = _merge_up(p_pos, p_anchor, i, n_p, cp, co, cn, j - base, stop - base, out_pos, out_anchor, c,
                             write)
            j = stop
        if write:
            for e in range(n_p - i):
                out_pos[c + e] = <opos_t>p_pos[i + e]
                out_anchor[c + e] = p_anchor[i + e]
        c += n_p - i
        if write:
            out_bounds[k + 1] = c
    return c - c0


cdef int64_t _merge_rows_w(const int64_t* p_bounds, const pos_t* p_pos, const char* p_anchor,
                           const int64_t* c_bounds, const int64_t* c_pos_at, const int64_t* c_old_at,
                           const int64_t* c_new_at, const int64_t* c_lens, int64_t* out_bounds, opos_t* out_pos,
                           char* out_anchor, bint write, int64_t k0, int64_t k1, int64_t q0, int64_t base0,
                           int64_t c0, int w) noexcept nogil:
    if w == 1:
        return _drift_merge_rows(p_bounds, p_pos, <const uint8_t*>p_anchor, c_bounds, c_pos_at, c_old_at, c_new_at,
                                 c_lens, out_bounds, out_pos, <uint8_t*>out_anchor, write, k0, k1, q0, base0, c0)
    if w == 2:
        return _drift_merge_rows(p_bounds, p_pos, <const uint16_t*>p_anchor, c_bounds, c_pos_at, c_old_at,
                                 c_new_at, c_lens, out_bounds, out_pos, <uint16_t*>out_anchor, write, k0, k1, q0,
                                 base0, c0)
    if w == 4:
        return _drift_merge_rows(p_bounds, p_pos, <const uint32_t*>p_anchor, c_bounds, c_pos_at, c_old_at,
                                 c_new_at, c_lens, out_bounds, out_pos, <uint32_t*>out_anchor, write, k0, k1, q0,
                                 base0, c0)
    return _drift_merge_rows(p_bounds, p_pos, <const uint64_t*>p_anchor, c_bounds, c_pos_at, c_old_at, c_new_at,
                             c_lens, out_bounds, out_pos, <uint64_t*>out_anchor, write, k0, k1, q0, base0, c0)


def drift_merge_rows(like, lpos, p_bounds, p_pos, p_anchor, c_bounds, c_pos_at, c_old_at, c_new_at, c_lens,
                     out_bounds, out_pos, out_anchor, bint write, int64_t k0, int64_t k1, int64_t q0, int64_t base0,
                     int64_t c0):
    """Merge one version's changes into the positions that differ from the anchor, rows ``k0 .. k1 - 1``; returns
    how many elements the merged rows hold (see :mod:`deltastore.kernels.diff`). Positions: ``p_pos`` and
    ``out_pos`` int32 or int64, the parts' (``lpos``) int64."""
    cdef int w = width_of(like)
    arr(lpos, 8, SIGNED, False, "lpos")
    cdef const int64_t* ppb = <const int64_t*>arr(p_bounds, 8, SIGNED, False, "p_bounds")
    cdef int pw = p_pos.itemsize if isinstance(p_pos, cnp.ndarray) else 0
    cdef int ow = out_pos.itemsize if isinstance(out_pos, cnp.ndarray) else 0
    if pw not in (4, 8) or ow not in (4, 8):
        raise TypeError("drift_merge_rows: positions must be int32 or int64")
    cdef const char* ppp = arr(p_pos, pw, SIGNED, False, "p_pos")
    cdef const char* ppa = arr(p_anchor, w, ANY, False, "p_anchor")
    cdef const int64_t* pcb = <const int64_t*>arr(c_bounds, 8, SIGNED, False, "c_bounds")
    cdef const int64_t* pcp = <const int64_t*>arr(c_pos_at, 8, ADDRESS, False, "c_pos_at")
    cdef const int64_t* pco = <const int64_t*>arr(c_old_at, 8, ADDRESS, False, "c_old_at")
    cdef const int64_t* pcn = <const int64_t*>arr(c_new_at, 8, ADDRESS, False, "c_new_at")
    cdef const int64_t* pcl = <const int64_t*>arr(c_lens, 8, SIGNED, False, "c_lens")
    cdef int64_t* pob = <int64_t*>arr(out_bounds, 8, SIGNED, write, "out_bounds")
    cdef char* pop = arr(out_pos, ow, SIGNED, write, "out_pos")
    cdef char* poa = arr(out_anchor, w, ANY, write, "out_anchor")
    cdef int64_t r
    with nogil:
        if pw == 4 and ow == 4:
            r = _merge_rows_w(ppb, <const int32_t*>ppp, ppa, pcb, pcp, pco, pcn, pcl, pob, <int32_t*>pop, poa, write,
                              k0, k1, q0, base0, c0, w)
        elif pw == 4:
            r = _merge_rows_w(ppb, <const int32_t*>ppp, ppa, pcb, pcp, pco, pcn, pcl, pob, <int64_t*>pop, poa, write,
                              k0, k1, q0, base0, c0, w)
        elif ow == 4:
            r = _merge_rows_w(ppb, <const int64_t*>ppp, ppa, pcb, pcp, pco, pcn, pcl, pob, <int32_t*>pop, poa, write,
                              k0, k1, q0, base0, c0, w)
        else:
            r = _merge_rows_w(ppb, <const int64_t*>ppp, ppa, pcb, pcp, pco, pcn, pcl, pob, <int64_t*>pop, poa, write,
                              k0, k1, q0, base0, c0, w)
    return r


cdef inline (int64_t, int64_t) _merge_down(pos_t* pos, bits_t* anchor, int64_t i, int64_t i0, const int64_t* cp,
                                           const bits_t* co, const bits_t* cn, int64_t j, int64_t j0,
                                           int64_t w) noexcept nogil:
    # _merge_up from the top: changes j down to j0 of one part merged with the row's previous elements from i
    # down to i0 that lie above them, written downwards below w; returns the new (i, w). The slot w - 1 is
    # always above i (the room left above the previous table is at least the changes still to merge), so it
    # is written even for a dropped element.
    cdef int64_t a, x, gt, ge, keep, jj
    cdef bits_t anc
    while j >= j0:
        if i < i0:  # the row's previous elements are used up: the rest are first changes
            jj = j
            while jj >= j0:
                w -= 1
                pos[w] = <pos_t>cp[jj]
                anchor[w] = co[jj]
                jj -= 1
            return i, w
        a = pos[i]
        x = cp[j]
        anc = anchor[i]
        gt = a > x
        ge = a >= x
        keep = (a != x) | (anc != cn[j])
        pos[w - 1] = <pos_t>(a if gt else x)
        anchor[w - 1] = anc if ge else co[j]
        w -= keep
        i -= ge
        j -= 1 - gt
    return i, w


cdef int64_t _drift_merge_in_place(const int64_t* p_bounds, int64_t nrows, pos_t* pos, bits_t* anchor,
                                   const int64_t* c_bounds, const int64_t* c_pos_at, const int64_t* c_old_at,
                                   const int64_t* c_new_at, const int64_t* c_lens, int64_t nparts,
                                   int64_t* out_bounds) noexcept nogil:
    cdef int64_t end = p_bounds[nrows] + c_bounds[nrows]
    cdef int64_t w = end  # the next element is written at w - 1
    cdef int64_t q = nparts - 1
    cdef int64_t base = c_bounds[nrows] - (c_lens[q] if q >= 0 else 0)  # stream index of part q's first element
    cdef int64_t k, i, i0, j, j_start, first, used, e
    cdef const int64_t* cp
    cdef const bits_t* co
    cdef const bits_t* cn
    k = nrows - 1
    while k >= 0:
        out_bounds[k + 1] = w
        i = p_bounds[k + 1] - 1
        i0 = p_bounds[k]
        j = c_bounds[k + 1] - 1
        j_start = c_bounds[k]
        while j >= j_start:  # the row's changes, a part at a time, from the last
            while j < base:
                q -= 1
                base -= c_lens[q]
            first = max(j_start, base)
            cp = <const int64_t*><uintptr_t>c_pos_at[q]
            co = <const bits_t*><uintptr_t>c_old_at[q]
            cn = <const bits_t*><uintptr_t>c_new_at[q]
            i, w = _merge_down(pos, anchor, i, i0, cp, co, cn, j - base, first - base, w)
            j = first - 1
        while i >= i0:
            w -= 1
            pos[w] = pos[i]
            anchor[w] = anchor[i]
            i -= 1
        k -= 1
    out_bounds[0] = w
    used = end - w
    for e in range(used):  # to the front (forward: the source lies after the destination)
        pos[e] = pos[w + e]
        anchor[e] = anchor[w + e]
    for k in range(nrows + 1):
        out_bounds[k] -= w
    return used


cdef int64_t _in_place_w(const int64_t* p_bounds, int64_t nrows, pos_t* pos, char* anchor, const int64_t* c_bounds,
                         const int64_t* c_pos_at, const int64_t* c_old_at, const int64_t* c_new_at,
                         const int64_t* c_lens, int64_t nparts, int64_t* out_bounds, int w) noexcept nogil:
    if w == 1:
        return _drift_merge_in_place(p_bounds, nrows, pos, <uint8_t*>anchor, c_bounds, c_pos_at, c_old_at, c_new_at,
                                     c_lens, nparts, out_bounds)
    if w == 2:
        return _drift_merge_in_place(p_bounds, nrows, pos, <uint16_t*>anchor, c_bounds, c_pos_at, c_old_at,
                                     c_new_at, c_lens, nparts, out_bounds)
    if w == 4:
        return _drift_merge_in_place(p_bounds, nrows, pos, <uint32_t*>anchor, c_bounds, c_pos_at, c_old_at,
                                     c_new_at, c_lens, nparts, out_bounds)
    return _drift_merge_in_place(p_bounds, nrows, pos, <uint64_t*>anchor, c_bounds, c_pos_at, c_old_at, c_new_at,
                                 c_lens, nparts, out_bounds)


def drift_merge_rows_in_place(like, lpos, p_bounds, pos, anchor, c_bounds, c_pos_at, c_old_at, c_new_at, c_lens,
                              out_bounds):
    """:func:`drift_merge_rows` (writing) with the merged table written over the previous one; returns the merged
    count (see :mod:`deltastore.kernels.diff`)."""
    cdef int w = width_of(like)
    arr(lpos, 8, SIGNED, False, "lpos")
    cdef const int64_t* ppb = <const int64_t*>arr(p_bounds, 8, SIGNED, False, "p_bounds")
    cdef int pw = pos.itemsize if isinstance(pos, cnp.ndarray) else 0
    if pw not in (4, 8):
        raise TypeError("drift_merge_rows_in_place: positions must be int32 or int64")
    cdef char* pp = arr(pos, pw, SIGNED, True, "pos")
    cdef char* pa = arr(anchor, w, ANY, True, "anchor")
    cdef const int64_t* pcb = <const int64_t*>arr(c_bounds, 8, SIGNED, False, "c_bounds")
    cdef const int64_t* pcp = <const int64_t*>arr(c_pos_at, 8, ADDRESS, False, "c_pos_at")
    cdef const int64_t* pco = <const int64_t*>arr(c_old_at, 8, ADDRESS, False, "c_old_at")
    cdef const int64_t* pcn = <const int64_t*>arr(c_new_at, 8, ADDRESS, False, "c_new_at")
    cdef const int64_t* pcl = <const int64_t*>arr(c_lens, 8, SIGNED, False, "c_lens")
    cdef int64_t* pob = <int64_t*>arr(out_bounds, 8, SIGNED, True, "out_bounds")
    cdef int64_t nrows = size(p_bounds) - 1, nparts = size(c_lens), r
    if nrows < 0 or size(c_bounds) != nrows + 1 or size(out_bounds) < nrows + 1:
        raise ValueError("drift_merge_rows_in_place: bounds of different lengths")
    with nogil:
        if pw == 4:
            r = _in_place_w(ppb, nrows, <int32_t*>pp, pa, pcb, pcp, pco, pcn, pcl, nparts, pob, w)
        else:
            r = _in_place_w(ppb, nrows, <int64_t*>pp, pa, pcb, pcp, pco, pcn, pcl, nparts, pob, w)
    return r


# --- drift sampling ------------------------------------------------------------------------------------------

cdef int64_t _sample_stream(const int64_t* pos_at, const int64_t* old_at, const int64_t* new_at,
                            const int64_t* lens, int64_t nparts, const int64_t* bounds, int64_t rows,
                            int rate_log2, int64_t* out_pos, bits_t* out_old, bits_t* out_new,
                            int64_t* out_bounds) noexcept nogil:
    cdef int64_t k, e, q = 0, base = 0, c = 0, idx, p
    cdef int shift = 64 - rate_log2
    cdef const int64_t* pp
    cdef const bits_t* po
    cdef const bits_t* pn
    out_bounds[0] = 0
    for k in range(rows):
        e = bounds[k]
        while e < bounds[k + 1]:
            while e - base >= lens[q]:
                base += lens[q]
                q += 1
            pp = <const int64_t*><uintptr_t>pos_at[q]
            po = <const bits_t*><uintptr_t>old_at[q]
            pn = <const bits_t*><uintptr_t>new_at[q]
            idx = e - base
            p = pp[idx]
            # branch-free: written always, kept (c moves) when the position's Fibonacci hash falls in the sample
            out_pos[c] = p
            out_old[c] = po[idx]
            out_new[c] = pn[idx]
            c += ((<uint64_t>p * <uint64_t>0x9E3779B97F4A7C15ULL) >> shift) == 0
            e += 1
        out_bounds[k + 1] = c
    return c


def sample_stream(like, pos_at, old_at, new_at, lens, bounds, int rate_log2, out_pos, out_old, out_new,
                  out_bounds):
    """The changes of a stream held in parts (``*_at``: each part's array addresses, ``lens`` their lengths;
    row ``k`` is stream elements ``bounds[k] .. bounds[k + 1] - 1``) whose position the drift samples at
    ``rate_log2`` >= 1 (the top ``rate_log2`` bits of ``position * 0x9E3779B97F4A7C15`` zero, as
    ``deltastore.drift.sampled``), in order, and their row bounds; returns how many were kept. The outputs hold
    one slot more than the stream."""
    cdef int w = width_of(like)
    cdef const int64_t* pp = <const int64_t*>arr(pos_at, 8, ADDRESS, False, "pos_at")
    cdef const int64_t* po = <const int64_t*>arr(old_at, 8, ADDRESS, False, "old_at")
    cdef const int64_t* pn = <const int64_t*>arr(new_at, 8, ADDRESS, False, "new_at")
    cdef const int64_t* pl = <const int64_t*>arr(lens, 8, SIGNED, False, "lens")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef int64_t* op = <int64_t*>arr(out_pos, 8, SIGNED, True, "out_pos")
    cdef char* oo = arr(out_old, w, ANY, True, "out_old")
    cdef char* on = arr(out_new, w, ANY, True, "out_new")
    cdef int64_t* ob = <int64_t*>arr(out_bounds, 8, SIGNED, True, "out_bounds")
    cdef int64_t rows = size(bounds) - 1, nparts = size(lens), total = 0, i, r
    if not 1 <= rate_log2 <= 63:
        raise ValueError("sample_stream: rate_log2 must be in 1..63")
    if size(pos_at) != nparts or size(old_at) != nparts or size(new_at) != nparts or rows < 0:
        raise ValueError("sample_stream: part arrays of different lengths")
    for i in range(nparts):
        total += pl[i]
    if pb[0] != 0 or pb[rows] != total or size(out_bounds) < rows + 1 or \
            min(size(out_pos), size(out_old), size(out_new)) < total + 1:
        raise ValueError("sample_stream: bounds or outputs do not fit the stream")
    with nogil:
        if w == 1:
            r = _sample_stream(pp, po, pn, pl, nparts, pb, rows, rate_log2, op, <uint8_t*>oo, <uint8_t*>on, ob)
        elif w == 2:
            r = _sample_stream(pp, po, pn, pl, nparts, pb, rows, rate_log2, op, <uint16_t*>oo, <uint16_t*>on, ob)
        elif w == 4:
            r = _sample_stream(pp, po, pn, pl, nparts, pb, rows, rate_log2, op, <uint32_t*>oo, <uint32_t*>on, ob)
        else:
            r = _sample_stream(pp, po, pn, pl, nparts, pb, rows, rate_log2, op, <uint64_t*>oo, <uint64_t*>on, ob)
    return r
