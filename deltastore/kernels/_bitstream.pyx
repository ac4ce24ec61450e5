# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of :mod:`deltastore.kernels.bitstream` (that module states the byte layouts, the statuses and
each kernel's contract). Element values of the ``ulp`` step kernels are read with their dtype's signedness
(``step_t``): a step is taken between sign-extended raw bits, as the format defines it."""

cimport numpy as cnp
from libc.stdint cimport (int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t)
from libc.string cimport memset

from ._arrays cimport (ADDRESS, ANY, FLOAT64, SIGNED, UNSIGNED, C1, arr, arr2, ds_prefetch_w, fmix, size)

import numpy as np

cnp.import_array()

cdef extern from "_simd.h":
    uint64_t ds_max_step_u8(const uint8_t* new, const uint8_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_u8(const uint8_t* new, const uint8_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil
    uint64_t ds_max_step_i8(const int8_t* new, const int8_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_i8(const int8_t* new, const int8_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil
    uint64_t ds_max_step_i16(const int16_t* new, const int16_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_i16(const int16_t* new, const int16_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil
    uint64_t ds_max_step_u16(const uint16_t* new, const uint16_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_u16(const uint16_t* new, const uint16_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil
    uint64_t ds_max_step_i32(const int32_t* new, const int32_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_i32(const int32_t* new, const int32_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil
    uint64_t ds_max_step_u32(const uint32_t* new, const uint32_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_u32(const uint32_t* new, const uint32_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil
    uint64_t ds_max_step_i64(const int64_t* new, const int64_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_i64(const int64_t* new, const int64_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil
    uint64_t ds_max_step_u64(const uint64_t* new, const uint64_t* old, int64_t n, int64_t fmag) noexcept nogil
    void ds_step_planes_u64(const uint64_t* new, const uint64_t* old, int64_t n, int64_t fmag, uint8_t* out,
                            int64_t row_stride, int64_t npl) noexcept nogil

ctypedef fused step_t:
    uint8_t
    int8_t
    int16_t
    uint16_t
    int32_t
    uint32_t
    int64_t
    uint64_t

cdef enum:
    _SMALL = 4096     # values below this are counted in a histogram first (gaps and steps nearly always are)
    _STEP_AHEAD = 32  # items: the cache line of the position this far ahead is fetched for writing
    _RING_MASK = 63   # positions decoded ahead are kept in a ring of this many + 1 (> _STEP_AHEAD)


cdef int _code(object a, str name) except -1:
    """0..7: the index of ``a``'s dtype in ``step_t`` (a 1-byte to 8-byte integer)."""
    if not isinstance(a, cnp.ndarray):
        raise TypeError(f"{name}: expected a numpy array")
    cdef int w = a.itemsize
    cdef bint signed = cnp.PyArray_ISSIGNED(<cnp.ndarray>a)
    if not (cnp.PyArray_ISINTEGER(<cnp.ndarray>a) or cnp.PyArray_ISBOOL(<cnp.ndarray>a)) or w not in (1, 2, 4, 8):
        raise TypeError(f"{name}: unexpected dtype {a.dtype}")
    return (0 if w == 1 else 2 if w == 2 else 4 if w == 4 else 6) + (signed if w == 1 else not signed)


cdef object _bytes(object b):
    """``b`` as uint8: a stream handed over as a wider integer array (values 0..255) reads the same."""
    if isinstance(b, cnp.ndarray) and b.dtype != np.uint8 and b.dtype.kind in "iu" and b.ndim == 1:
        if b.size and (int(b.min()) < 0 or int(b.max()) > 255):
            raise ValueError("a byte stream holds values outside 0..255")
        return b.astype(np.uint8)
    return b


# --- unary and raw streams ----------------------------------------------------------------------------

def _pack_unary(q, out):
    cdef const int64_t* pq = <const int64_t*>arr(q, 8, SIGNED, False, "q")
    cdef uint8_t* po = <uint8_t*>arr(out, 1, UNSIGNED, True, "out")
    cdef Py_ssize_t n = size(q), i
    cdef int64_t pos = 0
    with nogil:
        for i in range(n):
            pos += pq[i]
            po[pos >> 3] |= <uint8_t>(0x80 >> (pos & 7))
            pos += 1


def _unpack_unary(data, int64_t count, out):
    data = _bytes(data)
    cdef const uint8_t* d = <const uint8_t*>arr(data, 1, ANY, False, "data")
    cdef int64_t* po = <int64_t*>arr(out, 8, SIGNED, True, "out")
    cdef Py_ssize_t n = size(data), byte
    cdef int64_t found = 0, last = -1, bit
    cdef int j
    cdef uint8_t b
    with nogil:
        for byte in range(n):
            b = d[byte]
            if b == 0:
                continue
            for j in range(8):
                if b & (0x80 >> j):
                    bit = byte * 8 + j
                    po[found] = bit - last - 1
                    last = bit
                    found += 1
                    if found == count:
                        break
            if found == count:
                break
    return found


def _pack_raw(w, r, out):
    cdef const int64_t* pw = <const int64_t*>arr(w, 8, SIGNED, False, "w")
    cdef const uint64_t* pr = <const uint64_t*>arr(r, 8, UNSIGNED, False, "r")
    cdef uint8_t* po = <uint8_t*>arr(out, 1, UNSIGNED, True, "out")
    cdef Py_ssize_t m = size(w), i
    cdef uint64_t acc = 0, v, piece  # pending bits, right-aligned
    cdef int64_t n = 0, o = 0, width, take  # n: how many pending bits (< 8 between values)
    with nogil:
        for i in range(m):
            width = pw[i]
            if width == 0:
                continue
            v = pr[i]
            # write the value's bits in pieces of at most 32 so the accumulator never overflows
            while width > 0:
                take = width if width <= 32 else width - 32
                piece = (v >> <uint64_t>(width - take)) & ((<uint64_t>1 << <uint64_t>take) - 1)
                acc = (acc << <uint64_t>take) | piece
                n += take
                width -= take
                while n >= 8:
                    n -= 8
                    po[o] = <uint8_t>((acc >> <uint64_t>n) & 0xFF)
                    o += 1
                acc &= (<uint64_t>1 << <uint64_t>n) - 1
        if n:
            po[o] = <uint8_t>((acc << <uint64_t>(8 - n)) & 0xFF)


def _unpack_raw(data, w, out):
    data = _bytes(data)
    cdef const uint8_t* d = <const uint8_t*>arr(data, 1, ANY, False, "data")
    cdef const int64_t* pw = <const int64_t*>arr(w, 8, SIGNED, False, "w")
    cdef uint64_t* po = <uint64_t*>arr(out, 8, UNSIGNED, True, "out")
    cdef Py_ssize_t m = size(w), i
    cdef int64_t bitpos = 0, width, byte, off, avail, take
    cdef uint64_t v, bits
    with nogil:
        for i in range(m):
            width = pw[i]
            v = 0
            while width > 0:
                byte = bitpos >> 3
                off = bitpos & 7
                avail = 8 - off
                take = width if width < avail else avail
                bits = (<uint64_t>d[byte] >> <uint64_t>(avail - take)) & ((<uint64_t>1 << <uint64_t>take) - 1)
                v = (v << <uint64_t>take) | bits
                bitpos += take
                width -= take
            po[i] = v


# --- exact code costs ---------------------------------------------------------------------------------

cdef inline void _add_costs(uint64_t x, int64_t c, int64_t kr, int64_t ke, uint64_t* rice, double* rice_f,
                            int64_t* eg, int64_t* shorts) noexcept nogil:
    # c values equal to x: rice[k] += c * (x >> k); eg[k] += c * (bit_length(x + 2**k) - 1) for 2**k <= x (the
    # others contribute exactly k each, added from shorts at the end).
    cdef int64_t b = 0, k
    cdef uint64_t t = x, q, top, s
    while t:
        t >>= 1
        b += 1
    shorts[b] += c
    for k in range(min(b, kr + 1)):
        q = x >> <uint64_t>k
        rice[k] += q * <uint64_t>c
        rice_f[k] += <double>q * <double>c
    top = (<uint64_t>1 << <uint64_t>b) if b < 64 else 0
    for k in range(min(b, ke + 1)):
        # 2**k <= x < 2**b: x + 2**k has bit length b, or b + 1 once it reaches 2**b
        s = x + (<uint64_t>1 << <uint64_t>k)
        eg[k] += c * (b - 1 + (1 if (b < 64 and s >= top) else 0))


def _kind_sums(v, int64_t start, int64_t stop, int64_t kr, int64_t ke, rice, rice_f, eg, shorts):
    cdef const uint64_t* pv = <const uint64_t*>arr(v, 8, UNSIGNED, False, "v")
    cdef uint64_t* pr = <uint64_t*>arr(rice, 8, UNSIGNED, True, "rice")
    cdef double* pf = <double*>arr(rice_f, 8, FLOAT64, True, "rice_f")
    if size(rice_f) < kr + 1 or size(rice) < kr + 1:
        raise ValueError("rice, rice_f: fewer than kr + 1 entries")
    cdef int64_t* pe = <int64_t*>arr(eg, 8, SIGNED, True, "eg")
    cdef int64_t* ps = <int64_t*>arr(shorts, 8, SIGNED, True, "shorts")
    if size(eg) < ke + 1 or size(shorts) < 65:
        raise ValueError("eg, shorts: too short")
    cdef int64_t hist[_SMALL]
    cdef int64_t i, u
    cdef uint64_t x
    with nogil:
        memset(hist, 0, sizeof(hist))
        for i in range(start, stop):
            x = pv[i]
            if x < _SMALL:
                hist[x] += 1
            else:
                _add_costs(x, 1, kr, ke, pr, pf, pe, ps)
        for u in range(_SMALL):
            if hist[u]:
                _add_costs(<uint64_t>u, hist[u], kr, ke, pr, pf, pe, ps)


# --- LEB128 -------------------------------------------------------------------------------------------

cdef inline int64_t _varint_len(uint64_t x) noexcept nogil:
    cdef int64_t n = 1
    x >>= 7
    while x:
        x >>= 7
        n += 1
    return n


cdef inline int64_t _put_varint(uint8_t* out, int64_t o, uint64_t x) noexcept nogil:
    while x >= 0x80:
        out[o] = <uint8_t>((x & 0x7F) | 0x80)
        x >>= 7
        o += 1
    out[o] = <uint8_t>x
    return o + 1


def _uvarint_size(v):
    cdef const uint64_t* pv = <const uint64_t*>arr(v, 8, UNSIGNED, False, "v")
    cdef Py_ssize_t n = size(v), i
    cdef int64_t total = 0
    with nogil:
        for i in range(n):
            total += _varint_len(pv[i])
    return total


def _uvarint_encode(v, out):
    cdef const uint64_t* pv = <const uint64_t*>arr(v, 8, UNSIGNED, False, "v")
    cdef uint8_t* po = <uint8_t*>arr(out, 1, UNSIGNED, True, "out")
    cdef Py_ssize_t n = size(v), i
    cdef int64_t o = 0
    with nogil:
        for i in range(n):
            o = _put_varint(po, o, pv[i])


def _gap_stream(ptrs, lens, out):
    """The gap stream of the sorted int64 arrays at ``ptrs``: per array its first position, then each gap minus
    one; with an empty ``out`` only its length is counted. Returns the length."""
    cdef const int64_t* pt = <const int64_t*>arr(ptrs, 8, ADDRESS, False, "ptrs")
    cdef const int64_t* pl = <const int64_t*>arr(lens, 8, SIGNED, False, "lens")
    cdef uint8_t* po = <uint8_t*>arr(out, 1, UNSIGNED, True, "out")
    cdef bint count_only = size(out) == 0
    cdef Py_ssize_t n = size(ptrs), s
    cdef int64_t total = 0, prev, i
    cdef const int64_t* a
    with nogil:
        for s in range(n):
            a = <const int64_t*><uintptr_t>pt[s]
            prev = -1
            if count_only:
                for i in range(pl[s]):
                    total += _varint_len(<uint64_t>(a[i] - prev - 1))
                    prev = a[i]
            else:
                for i in range(pl[s]):
                    total = _put_varint(po, total, <uint64_t>(a[i] - prev - 1))
                    prev = a[i]
    return total


def _uvarint_decode(b, int64_t count, out):
    """(values decoded, bytes used); values decoded < count: truncated; -1: a value over 10 bytes."""
    b = _bytes(b)
    cdef const uint8_t* pb = <const uint8_t*>arr(b, 1, ANY, False, "b")
    cdef uint64_t* po = <uint64_t*>arr(out, 8, UNSIGNED, True, "out")
    cdef int64_t n = size(b), i = 0, k, j, res = count
    cdef uint64_t x, byte
    with nogil:
        for k in range(count):
            x = 0
            j = 0
            while True:
                if i >= n:
                    res = k
                    break
                byte = pb[i]
                i += 1
                if j >= 10:
                    res = -1
                    break
                x |= (byte & 0x7F) << <uint64_t>(7 * j)
                j += 1
                if byte < 0x80:
                    break
            if res != count:
                break
            po[k] = x
    return res, i


def _gap_positions(b, counts, numels, out):
    """(status, segment, bytes used): 0 ok; 1 truncated; 2 a value over 10 bytes; 3 a position past its
    segment's numel. Positions are strictly increasing per segment, so each is checked as it is made."""
    b = _bytes(b)
    cdef const uint8_t* pb = <const uint8_t*>arr(b, 1, ANY, False, "b")
    cdef const int64_t* pc = <const int64_t*>arr(counts, 8, SIGNED, False, "counts")
    cdef const int64_t* pn = <const int64_t*>arr(numels, 8, SIGNED, False, "numels")
    cdef int64_t* po = <int64_t*>arr(out, 8, SIGNED, True, "out")
    cdef int64_t n = size(b), nseg = size(counts), i = 0, k = 0, s, c, j, status = 0, seg = -1
    cdef uint64_t lim, p, x, byte
    with nogil:
        for s in range(nseg):
            lim = <uint64_t>pn[s]
            p = 0
            for c in range(pc[s]):
                if i < n and pb[i] < 0x80:  # a one-byte value (most gaps): no loop
                    x = pb[i]
                    i += 1
                else:
                    x = 0
                    j = 0
                    while True:
                        if i >= n:
                            status = 1
                            break
                        if j >= 10:
                            status = 2
                            break
                        byte = pb[i]
                        i += 1
                        x |= (byte & 0x7F) << <uint64_t>(7 * j)
                        j += 1
                        if byte < 0x80:
                            break
                    if status:
                        break
                if x >= lim:  # checked before the add: no wrap-around
                    status = 3
                    break
                p = x if c == 0 else p + x + 1
                if p >= lim:
                    status = 3
                    break
                po[k] = <int64_t>p
                k += 1
            if status:
                seg = s
                break
    return status, seg, i


def _gap_positions_mixed(b, counts, numels, out):
    """:func:`_gap_positions` for streams where one- and two-byte values mix (sparse changes: gaps around 128):
    a value of one or two bytes is read without a branch on which (that branch would be mispredicted for most
    values), anything longer by the general loop. Same results, statuses included."""
    b = _bytes(b)
    cdef const uint8_t* pb = <const uint8_t*>arr(b, 1, ANY, False, "b")
    cdef const int64_t* pc = <const int64_t*>arr(counts, 8, SIGNED, False, "counts")
    cdef const int64_t* pn = <const int64_t*>arr(numels, 8, SIGNED, False, "numels")
    cdef int64_t* po = <int64_t*>arr(out, 8, SIGNED, True, "out")
    cdef int64_t n = size(b), nseg = size(counts), i = 0, k = 0, s, c, j, status = 0, seg = -1
    cdef int64_t lim, p, x, b0, b1, more
    cdef uint64_t xu, byte
    with nogil:
        for s in range(nseg):
            lim = pn[s]
            p = -1
            for c in range(pc[s]):
                x = -1
                if i + 1 < n:
                    b0 = pb[i]
                    b1 = pb[i + 1]
                    more = b0 >> 7  # 1 when a second byte follows
                    if (more & (b1 >> 7)) == 0:
                        x = (b0 & 0x7F) | ((b1 << 7) * more)
                        i += 1 + more
                if x < 0:  # three bytes or more, or the stream's last byte
                    xu = 0
                    j = 0
                    while True:
                        if i >= n:
                            status = 1
                            break
                        if j >= 10:
                            status = 2
                            break
                        byte = pb[i]
                        i += 1
                        xu |= (byte & 0x7F) << <uint64_t>(7 * j)
                        j += 1
                        if byte < 0x80:
                            break
                    if status:
                        break
                    if xu >= <uint64_t>lim:  # checked before the add: no wrap-around
                        status = 3
                        break
                    x = <int64_t>xu
                p = p + x + 1
                if p >= lim:
                    status = 3
                    break
                po[k] = p
                k += 1
            if status:
                seg = s
                break
    return status, seg, i


# --- ulp steps in the ordered image -------------------------------------------------------------------

cdef inline int64_t _ordered(int64_t x, int64_t fmag) noexcept nogil:
    # sign-magnitude -> two's complement for floats (fmag = the magnitude mask; -0.0 -> -1), integers as they
    # are (fmag = 0); branch-free, and its own inverse
    return x ^ ((x >> 63) & fmag)


cdef inline uint64_t _step(int64_t new, int64_t old, int64_t fmag) noexcept nogil:
    cdef int64_t d = <int64_t>(<uint64_t>_ordered(new, fmag) - <uint64_t>_ordered(old, fmag))
    return ((<uint64_t>d << 1) ^ <uint64_t>(d >> 63)) - 1  # zig-zag, minus one


cdef inline int64_t _delta(int64_t z) noexcept nogil:
    # the step coded as z = zigzag(step) - 1 (unsigned: a 64-bit step's top bit must shift out logically)
    cdef uint64_t u = <uint64_t>z + 1
    return <int64_t>(u >> 1) ^ -<int64_t>(u & 1)


cdef inline int64_t _applied(int64_t z, int64_t x, int64_t fmag) noexcept nogil:
    # old bits x (sign-extended) plus the step coded as z, in the ordered image
    return <int64_t>(<uint64_t>_ordered(x, fmag) + <uint64_t>_delta(z))


cdef inline int64_t _unapplied(int64_t z, int64_t y, int64_t fmag) noexcept nogil:
    # the inverse of _applied: the old raw bits from the new ones y (sign-extended) and the coded step z
    return _ordered(<int64_t>(<uint64_t>_ordered(y, fmag) - <uint64_t>_delta(z)), fmag)


ctypedef struct Planes:
    const uint8_t* data
    Py_ssize_t rows, cols, row_stride, col_stride


cdef int _planes(object a, bint write, str name, Planes* p) except -1:
    p.data = <const uint8_t*>arr2(a, write, name, &p.rows, &p.cols, &p.row_stride, &p.col_stride)
    return 0


cdef inline int64_t _plane_step(const Planes* p, int64_t i) noexcept nogil:
    # planes[j, i]: byte j of (zigzag(step) - 1) of element i; one and two planes (most steps) read directly
    cdef const uint8_t* c = p.data + i * p.col_stride
    if p.rows == 1:
        return c[0]
    if p.rows == 2:
        return <int64_t>c[0] | (<int64_t>c[p.row_stride] << 8)
    cdef uint64_t u = 0
    cdef Py_ssize_t j
    for j in range(p.rows):
        u |= <uint64_t>c[j * p.row_stride] << <uint64_t>(8 * j)
    return <int64_t>u


def _max_step(new, old, int64_t fmag):
    cdef int code = _code(new, "new")
    if _code(old, "old") != code:
        raise TypeError("new and old: one dtype")
    cdef const char* pn = arr(new, 0, ANY, False, "new")
    cdef const char* po = arr(old, 0, ANY, False, "old")
    cdef int64_t n = size(new)
    cdef uint64_t r
    if size(old) < n:
        raise ValueError("old is shorter than new")
    with nogil:  # the loops are _simd.h's ds_max_step_*
        if code == 0:
            r = ds_max_step_u8(<const uint8_t*>pn, <const uint8_t*>po, n, fmag)
        elif code == 1:
            r = ds_max_step_i8(<const int8_t*>pn, <const int8_t*>po, n, fmag)
        elif code == 2:
            r = ds_max_step_i16(<const int16_t*>pn, <const int16_t*>po, n, fmag)
        elif code == 3:
            r = ds_max_step_u16(<const uint16_t*>pn, <const uint16_t*>po, n, fmag)
        elif code == 4:
            r = ds_max_step_i32(<const int32_t*>pn, <const int32_t*>po, n, fmag)
        elif code == 5:
            r = ds_max_step_u32(<const uint32_t*>pn, <const uint32_t*>po, n, fmag)
        elif code == 6:
            r = ds_max_step_i64(<const int64_t*>pn, <const int64_t*>po, n, fmag)
        else:
            r = ds_max_step_u64(<const uint64_t*>pn, <const uint64_t*>po, n, fmag)
    return r


cdef void _step_planes_s(const step_t* new, const step_t* old, int64_t n, int64_t fmag,
                         const Planes* out) noexcept nogil:
    cdef int64_t i
    cdef Py_ssize_t j
    cdef uint64_t x
    cdef uint8_t* o = <uint8_t*>out.data
    for i in range(n):
        x = _step(<int64_t>new[i], <int64_t>old[i], fmag)
        for j in range(out.rows):
            o[j * out.row_stride + i * out.col_stride] = <uint8_t>(x & 0xFF)
            x >>= 8


def _step_planes(new, old, int64_t fmag, out):
    cdef int code = _code(new, "new")
    if _code(old, "old") != code:
        raise TypeError("new and old: one dtype")
    cdef const char* pn = arr(new, 0, ANY, False, "new")
    cdef const char* po = arr(old, 0, ANY, False, "old")
    cdef Planes pout
    _planes(out, True, "out", &pout)
    cdef int64_t n = size(new)
    if size(old) < n or (pout.rows and pout.cols < n):
        raise ValueError("new, old and out of different lengths")
    if pout.cols > 1 and pout.col_stride != 1:  # columns apart: the general loop
        with nogil:
            if code == 0:
                _step_planes_s(<const uint8_t*>pn, <const uint8_t*>po, n, fmag, &pout)
            elif code == 1:
                _step_planes_s(<const int8_t*>pn, <const int8_t*>po, n, fmag, &pout)
            elif code == 2:
                _step_planes_s(<const int16_t*>pn, <const int16_t*>po, n, fmag, &pout)
            elif code == 3:
                _step_planes_s(<const uint16_t*>pn, <const uint16_t*>po, n, fmag, &pout)
            elif code == 4:
                _step_planes_s(<const int32_t*>pn, <const int32_t*>po, n, fmag, &pout)
            elif code == 5:
                _step_planes_s(<const uint32_t*>pn, <const uint32_t*>po, n, fmag, &pout)
            elif code == 6:
                _step_planes_s(<const int64_t*>pn, <const int64_t*>po, n, fmag, &pout)
            else:
                _step_planes_s(<const uint64_t*>pn, <const uint64_t*>po, n, fmag, &pout)
        return
    cdef uint8_t* o = <uint8_t*>pout.data
    with nogil:  # the loops are _simd.h's ds_step_planes_*
        if code == 0:
            ds_step_planes_u8(<const uint8_t*>pn, <const uint8_t*>po, n, fmag, o, pout.row_stride, pout.rows)
        elif code == 1:
            ds_step_planes_i8(<const int8_t*>pn, <const int8_t*>po, n, fmag, o, pout.row_stride, pout.rows)
        elif code == 2:
            ds_step_planes_i16(<const int16_t*>pn, <const int16_t*>po, n, fmag, o, pout.row_stride, pout.rows)
        elif code == 3:
            ds_step_planes_u16(<const uint16_t*>pn, <const uint16_t*>po, n, fmag, o, pout.row_stride, pout.rows)
        elif code == 4:
            ds_step_planes_i32(<const int32_t*>pn, <const int32_t*>po, n, fmag, o, pout.row_stride, pout.rows)
        elif code == 5:
            ds_step_planes_u32(<const uint32_t*>pn, <const uint32_t*>po, n, fmag, o, pout.row_stride, pout.rows)
        elif code == 6:
            ds_step_planes_i64(<const int64_t*>pn, <const int64_t*>po, n, fmag, o, pout.row_stride, pout.rows)
        else:
            ds_step_planes_u64(<const uint64_t*>pn, <const uint64_t*>po, n, fmag, o, pout.row_stride, pout.rows)


cdef int64_t _apply_steps_s(const step_t* old, int64_t n, const Planes* planes, int64_t fmag, int64_t lo,
                            int64_t hi, step_t* out) noexcept nogil:
    # returns the first element whose result leaves the dtype's range, or -1
    cdef int64_t i, o
    for i in range(n):
        o = _applied(_plane_step(planes, i), <int64_t>old[i], fmag)
        if o < lo or o > hi:
            return i
        out[i] = <step_t>_ordered(o, fmag)  # back to raw bits
    return -1


def _apply_steps(old, planes, int64_t fmag, int64_t lo, int64_t hi, out):
    cdef int code = _code(old, "old")
    if _code(out, "out") != code:
        raise TypeError("old and out: one dtype")
    cdef const char* po = arr(old, 0, ANY, False, "old")
    cdef char* pout = arr(out, 0, ANY, True, "out")
    cdef Planes pp
    _planes(planes, False, "planes", &pp)
    cdef int64_t n = size(old), r
    if size(out) < n or pp.cols < n:
        raise ValueError("old, planes and out of different lengths")
    with nogil:
        if code == 0:
            r = _apply_steps_s(<const uint8_t*>po, n, &pp, fmag, lo, hi, <uint8_t*>pout)
        elif code == 1:
            r = _apply_steps_s(<const int8_t*>po, n, &pp, fmag, lo, hi, <int8_t*>pout)
        elif code == 2:
            r = _apply_steps_s(<const int16_t*>po, n, &pp, fmag, lo, hi, <int16_t*>pout)
        elif code == 3:
            r = _apply_steps_s(<const uint16_t*>po, n, &pp, fmag, lo, hi, <uint16_t*>pout)
        elif code == 4:
            r = _apply_steps_s(<const int32_t*>po, n, &pp, fmag, lo, hi, <int32_t*>pout)
        elif code == 5:
            r = _apply_steps_s(<const uint32_t*>po, n, &pp, fmag, lo, hi, <uint32_t*>pout)
        elif code == 6:
            r = _apply_steps_s(<const int64_t*>po, n, &pp, fmag, lo, hi, <int64_t*>pout)
        else:
            r = _apply_steps_s(<const uint64_t*>po, n, &pp, fmag, lo, hi, <uint64_t*>pout)
    return r


cdef inline int64_t _leb128(const uint8_t* b, int64_t i, int64_t n, uint64_t* x, int* status) noexcept nogil:
    # the LEB128 value at b[i] into x; returns the next index; status 0 / 1 truncated / 2 over 10 bytes
    status[0] = 0
    if i < n and b[i] < 0x80:  # a one-byte value (most gaps): no loop
        x[0] = b[i]
        return i + 1
    cdef uint64_t v = 0, byte
    cdef int64_t j = 0
    while True:
        if i >= n:
            status[0] = 1
            x[0] = v
            return i
        if j >= 10:
            status[0] = 2
            x[0] = v
            return i
        byte = b[i]
        i += 1
        v |= (byte & 0x7F) << <uint64_t>(7 * j)
        j += 1
        if byte < 0x80:
            x[0] = v
            return i


cdef (int64_t, int64_t, int64_t) _apply_gaps_s(
        step_t* like, const int64_t* ptr, const int64_t* lens, const uint64_t* keys, const int64_t* slot,
        const int64_t* counts, int64_t s0, int64_t s1, const uint8_t* gaps, int64_t n, int64_t i0, int64_t e0,
        const Planes* planes, int64_t fmag, int64_t lo, int64_t hi, uint64_t zmask, uint8_t* done,
        uint64_t* sums) noexcept nogil:
    # Segments s0..s1 of a LEB128 gap stream, from byte i0 and stream item e0 (a column of planes). Segment s with
    # t = slot[s] >= 0 is tensor t: lens[t] elements of like's dtype at ptr[t]; each of its items is read,
    # stepped and written back, the checksum change summed in sums[t]; it is written whole (done[t]) or, at a
    # bad item, put back as it was (each written item stepped back) before returning. A segment with slot -1 is
    # only read past. Returns (status, segment, byte after the run): 0 ok; 1 truncated stream; 2 a value over
    # 10 bytes; 3 a position past its tensor; 4 a value out of the dtype's range (statuses 1 and 2 of skipped
    # segments too).
    cdef int64_t width = sizeof(step_t)
    cdef int64_t i = i0, e = e0, s, m, t, c, lim, seg_i, seg_e, q, got, p, o, y, j, r, d, old
    cdef int status, st
    cdef uint64_t x, total, h, key
    cdef step_t* a
    cdef int64_t ring[_RING_MASK + 1]
    for s in range(s0, s1):
        m = counts[s]
        t = slot[s]
        if t < 0:
            for c in range(m):
                i = _leb128(gaps, i, n, &x, &status)
                if status:
                    return status, s, i
            e += m
            continue
        lim = lens[t]
        a = <step_t*><uintptr_t>ptr[t]
        key = keys[t]
        seg_i = i
        seg_e = e
        # positions are decoded _STEP_AHEAD items ahead of their write into a small ring, so that the cache line
        # of each is fetched while the items before it are stepped
        q = -1
        got = 0  # items decoded into the ring
        status = 0
        p = -1
        total = 0
        c = 0
        while c < m:
            while got < m and got <= c + _STEP_AHEAD:
                i = _leb128(gaps, i, n, &x, &status)
                if status:
                    break
                if x >= <uint64_t>lim:  # checked before the add: no wrap-around
                    status = 3
                    break
                q += <int64_t>x + 1
                if q >= lim:
                    status = 3
                    break
                ring[got & _RING_MASK] = q
                ds_prefetch_w(a + q)
                got += 1
            if status:
                break
            p = ring[c & _RING_MASK]
            old = <int64_t>a[p]
            o = _applied(_plane_step(planes, e), old, fmag)
            if o < lo or o > hi:
                status = 4
                break
            y = _ordered(o, fmag)
            a[p] = <step_t>y
            h = <uint64_t>p * C1
            total += fmix((h ^ (<uint64_t>y & zmask)) + key) - fmix((h ^ (<uint64_t>old & zmask)) + key)
            e += 1
            c += 1
        if status:  # step back the items of this segment written so far (their bytes read again)
            j = seg_i
            r = -1
            for d in range(c):
                j = _leb128(gaps, j, n, &x, &st)
                r += <int64_t>x + 1
                a[r] = <step_t>_unapplied(_plane_step(planes, seg_e + d), <int64_t>a[r], fmag)
            return status, s, i
        sums[t] = total
        done[t] = 1
    return 0, -1, i


cdef void _restore_gaps_s(step_t* like, const int64_t* ptr, const int64_t* slot, const int64_t* counts, int64_t s0,
                          int64_t s1, const uint8_t* gaps, int64_t n, int64_t i0, int64_t e0, const Planes* planes,
                          int64_t fmag, const uint8_t* done) noexcept nogil:
    # step back every item of the done tensors of a run of _apply_gaps_at (its stream read again): the old bits
    # follow from the new ones and the step; a run's tensors after one not done were not reached
    cdef int64_t i = i0, e = e0, s, t, p, c
    cdef int st
    cdef uint64_t x
    cdef step_t* a
    for s in range(s0, s1):
        t = slot[s]
        if t >= 0 and not done[t]:
            return
        p = -1
        for c in range(counts[s]):
            i = _leb128(gaps, i, n, &x, &st)
            if t >= 0:
                p += <int64_t>x + 1
                a = <step_t*><uintptr_t>ptr[t]
                a[p] = <step_t>_unapplied(_plane_step(planes, e), <int64_t>a[p], fmag)
            e += 1


def _apply_gaps_at(like, ptr, lens, keys, slot, counts, int64_t s0, int64_t s1, gaps, int64_t i0, int64_t e0,
                   planes, int64_t fmag, int64_t lo, int64_t hi, uint64_t zmask, done, sums):
    cdef int code = _code(like, "like")
    cdef const int64_t* pt = <const int64_t*>arr(ptr, 8, SIGNED, False, "ptr")
    cdef const int64_t* pl = <const int64_t*>arr(lens, 8, SIGNED, False, "lens")
    cdef const uint64_t* pk = <const uint64_t*>arr(keys, 8, UNSIGNED, False, "keys")
    cdef const int64_t* ps = <const int64_t*>arr(slot, 8, SIGNED, False, "slot")
    cdef const int64_t* pc = <const int64_t*>arr(counts, 8, SIGNED, False, "counts")
    cdef const uint8_t* pg = <const uint8_t*>arr(gaps, 1, ANY, False, "gaps")
    cdef Planes pp
    _planes(planes, False, "planes", &pp)
    cdef uint8_t* pd = <uint8_t*>arr(done, 1, UNSIGNED, True, "done")
    cdef uint64_t* pu = <uint64_t*>arr(sums, 8, UNSIGNED, True, "sums")
    cdef int64_t n = size(gaps)
    cdef (int64_t, int64_t, int64_t) r
    with nogil:
        if code == 0:
            r = _apply_gaps_s(<uint8_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, lo,
                              hi, zmask, pd, pu)
        elif code == 1:
            r = _apply_gaps_s(<int8_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, lo,
                              hi, zmask, pd, pu)
        elif code == 2:
            r = _apply_gaps_s(<int16_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, lo,
                              hi, zmask, pd, pu)
        elif code == 3:
            r = _apply_gaps_s(<uint16_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag,
                              lo, hi, zmask, pd, pu)
        elif code == 4:
            r = _apply_gaps_s(<int32_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, lo,
                              hi, zmask, pd, pu)
        elif code == 5:
            r = _apply_gaps_s(<uint32_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag,
                              lo, hi, zmask, pd, pu)
        elif code == 6:
            r = _apply_gaps_s(<int64_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, lo,
                              hi, zmask, pd, pu)
        else:
            r = _apply_gaps_s(<uint64_t*>NULL, pt, pl, pk, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag,
                              lo, hi, zmask, pd, pu)
    return r


def _restore_gaps_at(like, ptr, lens, slot, counts, int64_t s0, int64_t s1, gaps, int64_t i0, int64_t e0, planes,
                     int64_t fmag, done):
    cdef int code = _code(like, "like")
    cdef const int64_t* pt = <const int64_t*>arr(ptr, 8, SIGNED, False, "ptr")
    arr(lens, 8, SIGNED, False, "lens")
    cdef const int64_t* ps = <const int64_t*>arr(slot, 8, SIGNED, False, "slot")
    cdef const int64_t* pc = <const int64_t*>arr(counts, 8, SIGNED, False, "counts")
    cdef const uint8_t* pg = <const uint8_t*>arr(gaps, 1, ANY, False, "gaps")
    cdef Planes pp
    _planes(planes, False, "planes", &pp)
    cdef const uint8_t* pd = <const uint8_t*>arr(done, 1, UNSIGNED, False, "done")
    cdef int64_t n = size(gaps)
    with nogil:
        if code == 0:
            _restore_gaps_s(<uint8_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)
        elif code == 1:
            _restore_gaps_s(<int8_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)
        elif code == 2:
            _restore_gaps_s(<int16_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)
        elif code == 3:
            _restore_gaps_s(<uint16_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)
        elif code == 4:
            _restore_gaps_s(<int32_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)
        elif code == 5:
            _restore_gaps_s(<uint32_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)
        elif code == 6:
            _restore_gaps_s(<int64_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)
        else:
            _restore_gaps_s(<uint64_t*>NULL, pt, ps, pc, s0, s1, pg, n, i0, e0, &pp, fmag, pd)


def _gap_offsets(gaps, ends):
    """The byte index after the first ``ends[k]`` values of a LEB128 stream (``ends`` sorted), or -1 past its end:
    each value ends at a byte below 0x80, counted 64 bytes at a time while a whole block cannot overshoot."""
    gaps = _bytes(gaps)
    cdef const uint8_t* pg = <const uint8_t*>arr(gaps, 1, ANY, False, "gaps")
    cdef const int64_t* pe = <const int64_t*>arr(ends, 8, SIGNED, False, "ends")
    cdef int64_t m = size(ends)
    out = np.full(m, -1, np.int64)
    cdef int64_t* po = <int64_t*>cnp.PyArray_DATA(out)
    cdef int64_t n = size(gaps), i = 0, seen = 0, k, want, c, j
    with nogil:
        for k in range(m):
            want = pe[k]
            while i + 64 <= n and seen + 64 <= want:
                c = 0
                for j in range(i, i + 64):
                    c += pg[j] < 0x80
                seen += c
                i += 64
            while i < n and seen < want:
                seen += pg[i] < 0x80
                i += 1
            if seen < want:
                break
            po[k] = i
    return out
