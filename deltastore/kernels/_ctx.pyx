# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of :mod:`deltastore.kernels.ctx` (that module states the contract; ``_ctx.h`` holds the C)."""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint64_t
from libc.stdlib cimport free, malloc

from ._arrays cimport ANY, SIGNED, arr, size

import numpy as np

cnp.import_array()

cdef extern from "_ctx.h":
    ctypedef struct dsc_writer:
        uint8_t* buf
        int64_t cap
        int64_t nbits
        int oom
        int64_t at
        uint64_t acc
        int nacc
    void dsc_flush(dsc_writer* w) noexcept nogil
    ctypedef struct dsc_header:
        uint64_t* hdr
        int64_t nh
        int64_t cap
    int DSC_SMALL
    int dsc_code_tensor(int64_t m, const int64_t* bucket, const int64_t* rank, const int64_t* d, int nb,
                        const int64_t* sizes, dsc_header* h, dsc_writer* U, dsc_writer* R, int64_t* scratch,
                        uint64_t* comp, int64_t* hist) noexcept nogil
    int dsc_thresholds(const int64_t* counts, const int64_t* hits, int64_t nclass, int max_buckets, int shift,
                       int64_t* out, int64_t* nz, double* C, double* K, double* best, int64_t* arg) noexcept nogil
    int dsc_encode16(const uint16_t* old, int64_t n, const int64_t* pos, const uint16_t* nw, int64_t m, int shift,
                     int max_buckets, dsc_header* h, dsc_writer* U, dsc_writer* R) noexcept nogil
    int dsc_decode16(const uint16_t* old, int64_t n, int shift, int64_t nth, const int64_t* th, const int64_t* plan,
                     const uint8_t* ubuf, int64_t ulen, const uint8_t* rbuf, int64_t rlen, int64_t m,
                     int64_t* out_pos, uint16_t* out_bits, uint16_t* write_to, uint16_t* out_old) noexcept nogil


cdef void _writer(dsc_writer* w) noexcept:
    w.buf = NULL
    w.cap = 0
    w.nbits = 0
    w.oom = 0
    w.at = 0
    w.acc = 0
    w.nacc = 0


def thresholds(counts, hits, int max_buckets, int shift):
    """``ctx.choose_thresholds`` in C: magnitude thresholds (class << shift, ascending) splitting the classes
    with elements into at most ``max_buckets`` groups by the least ``sum n H(k / n)`` plus 64 bits a group."""
    cdef const int64_t* pc = <const int64_t*>arr(counts, 8, SIGNED, False, "counts")
    cdef const int64_t* ph = <const int64_t*>arr(hits, 8, SIGNED, False, "hits")
    cdef int64_t n = size(counts)
    if size(hits) != n:
        raise ValueError("thresholds: counts and hits of different lengths")
    if not 1 <= max_buckets <= 16:
        raise ValueError("thresholds: max_buckets must be in 1..16")
    cdef int64_t W = n + 1
    cdef int64_t[17] out
    nz = np.empty(W, np.int64)
    work = np.empty(2 * W + (max_buckets + 1) * W, np.float64)
    arg = np.empty((max_buckets + 1) * W, np.int64)
    cdef int64_t* pnz = <int64_t*>cnp.PyArray_DATA(nz)
    cdef double* pw = <double*>cnp.PyArray_DATA(work)
    cdef int64_t* pa = <int64_t*>cnp.PyArray_DATA(arg)
    cdef int k
    with nogil:
        k = dsc_thresholds(pc, ph, n, max_buckets, shift, out, pnz, pw, pw + W, pw + 2 * W, pa)
    return [int(out[i]) for i in range(k)]


def code_tensor(bucket, rank, d, sizes):
    """One tensor's header integers and U and R streams (see ``_ctx.h`` ``dsc_code_tensor``): ``bucket``,
    ``rank``, ``d`` int64 per change in position order, ``sizes`` the buckets' element counts. Returns
    ``(header uint64 array, U bytes, R bytes)`` (the header without the bucket count and thresholds before it
    and the stream lengths after it)."""
    cdef const int64_t* pb = <const int64_t*>arr(bucket, 8, SIGNED, False, "bucket")
    cdef const int64_t* pr = <const int64_t*>arr(rank, 8, SIGNED, False, "rank")
    cdef const int64_t* pd = <const int64_t*>arr(d, 8, SIGNED, False, "d")
    cdef const int64_t* ps = <const int64_t*>arr(sizes, 8, SIGNED, False, "sizes")
    cdef int64_t m = size(bucket), i
    cdef int nb = <int>size(sizes), status
    if size(rank) != m or size(d) != m:
        raise ValueError("code_tensor: bucket, rank and d of different lengths")
    if not 1 <= nb <= 16:
        raise ValueError("code_tensor: 1..16 buckets")
    for i in range(m):
        if not 0 <= pb[i] < nb or not 0 <= pr[i] < ps[pb[i]]:
            raise ValueError("code_tensor: a change outside its bucket")
    header = np.empty(16 * 13 + 4, np.uint64)
    scratch = np.empty(5 * m + 2, np.int64)
    comp = np.empty(m + 1, np.uint64)
    hist = np.empty(DSC_SMALL, np.int64)
    cdef dsc_header h
    h.hdr = <uint64_t*>cnp.PyArray_DATA(header)
    h.nh = 0
    h.cap = size(header)
    cdef dsc_writer U, R
    _writer(&U)
    _writer(&R)
    cdef int64_t* psc = <int64_t*>cnp.PyArray_DATA(scratch)
    cdef uint64_t* pco = <uint64_t*>cnp.PyArray_DATA(comp)
    cdef int64_t* phi = <int64_t*>cnp.PyArray_DATA(hist)
    try:
        with nogil:
            status = dsc_code_tensor(m, pb, pr, pd, nb, ps, &h, &U, &R, psc, pco, phi)
            dsc_flush(&U)
            dsc_flush(&R)
        if status or U.oom or R.oom or h.nh > h.cap:
            raise MemoryError("ctx: out of memory for the bit streams")
        ub = (<char*>U.buf)[:U.at] if U.at else b""
        rb = (<char*>R.buf)[:R.at] if R.at else b""
    finally:
        free(U.buf)
        free(R.buf)
    return header[:h.nh], ub, rb


def encode16(old, pos, new, int shift, int max_buckets):
    """One 16-bit float tensor (bf16 ``shift`` 7, fp16 10) encoded whole (``_ctx.h`` ``dsc_encode16``):
    ``old`` its old bits (uint16 or int16), ``pos`` the sorted changed positions (int64), ``new`` their new bits.
    Returns ``(header uint64 array, U bytes + R bytes)``: the tensor's header integers (bucket count and
    thresholds first, stream lengths last) and its streams."""
    cdef const uint16_t* po = <const uint16_t*>arr(old, 2, ANY, False, "old")
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef const uint16_t* pn = <const uint16_t*>arr(new, 2, ANY, False, "new")
    cdef int64_t n = size(old), m = size(pos), i, last = -1
    cdef int status
    if size(new) != m:
        raise ValueError("encode16: pos and new of different lengths")
    if not 1 <= max_buckets <= 16 or shift not in (7, 10):
        raise ValueError("encode16: 1..16 buckets, shift 7 (bf16) or 10 (fp16)")
    for i in range(m):
        if pp[i] <= last or pp[i] >= n:
            raise ValueError("encode16: positions must be strictly increasing inside the tensor")
        last = pp[i]
    header = np.empty(16 * 13 + 24, np.uint64)
    cdef dsc_header h
    h.hdr = <uint64_t*>cnp.PyArray_DATA(header)
    h.nh = 0
    h.cap = size(header)
    cdef dsc_writer U, R
    _writer(&U)
    _writer(&R)
    try:
        with nogil:
            status = dsc_encode16(po, n, pp, pn, m, shift, max_buckets, &h, &U, &R)
        if status or U.oom or R.oom or h.nh > h.cap:
            raise MemoryError("ctx: out of memory")
        streams = ((<char*>U.buf)[:U.at] if U.at else b"") + ((<char*>R.buf)[:R.at] if R.at else b"")
    finally:
        free(U.buf)
        free(R.buf)
    return header[:h.nh], streams


def decode16(old, int shift, thresholds, plan, ustream, rstream, int64_t m, bint write=False):
    """One 16-bit float tensor decoded whole (``_ctx.h`` ``dsc_decode16``): ``old`` its old bits, ``thresholds``
    (int64, at most 15, each at most 0x8000), ``plan`` 10 int64 per bucket (POS count, mode, kind code; BIG ...;
    NEG ...; MAG kind code or -1), the tensor's U and R streams (uint8 arrays or bytes) and ``m`` the changes
    (the POS counts' sum, at most the tensor's size). Returns ``(status, positions int64, new bits uint16, old
    bits uint16 or None)``: status 0, or why the streams are corrupt (``_ctx.h`` ``DSC_E_*``). With ``write``
    the new bits are written into ``old`` itself once the whole tensor decoded (nothing on a corrupt one), and
    the bits they replaced are returned."""
    cdef const uint16_t* po = <const uint16_t*>arr(old, 2, ANY, write, "old")
    cdef const int64_t* pt = <const int64_t*>arr(thresholds, 8, SIGNED, False, "thresholds")
    cdef const int64_t* pl = <const int64_t*>arr(plan, 8, SIGNED, False, "plan")
    cdef int64_t n = size(old), nth = size(thresholds)
    cdef const uint8_t[::1] u = ustream
    cdef const uint8_t[::1] r = rstream
    if nth > 15 or size(plan) != 10 * (nth + 1) or not 0 <= m <= n or shift not in (7, 10):
        raise ValueError("decode16: thresholds, plan, change count or shift out of range")
    pos = np.empty(m, np.int64)
    bits = np.empty(m, np.uint16)
    before = np.empty(m, np.uint16) if write else None
    cdef int64_t* pp = <int64_t*>cnp.PyArray_DATA(pos)
    cdef uint16_t* pb = <uint16_t*>cnp.PyArray_DATA(bits)
    cdef uint16_t* pw = <uint16_t*>po if write else NULL
    cdef uint16_t* pold = <uint16_t*>cnp.PyArray_DATA(before) if write else NULL
    cdef const uint8_t* pu = &u[0] if u.shape[0] else NULL
    cdef const uint8_t* pr = &r[0] if r.shape[0] else NULL
    cdef int status
    with nogil:
        status = dsc_decode16(po, n, shift, nth, pt, pl, pu, u.shape[0], pr, r.shape[0], m, pp, pb, pw, pold)
    if status == 7:
        raise MemoryError("ctx: out of memory")
    return status, pos, bits, before
