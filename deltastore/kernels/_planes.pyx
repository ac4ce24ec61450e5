# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of :mod:`deltastore.kernels.planes` (that module checks every argument first and states the
layout); the element loops are ``_simd.h``'s ``ds_split_*`` / ``ds_join_*``."""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

from ._arrays cimport ADDRESS, ANY, SIGNED, UNSIGNED, arr, size

cnp.import_array()

cdef extern from "_simd.h":
    void ds_split_1(const uint8_t* src, int64_t n, uint8_t* p0) noexcept nogil
    void ds_split_2(const uint16_t* src, int64_t n, int rotate, uint8_t* p0, uint8_t* p1) noexcept nogil
    void ds_split_4(const uint32_t* src, int64_t n, int rotate, uint8_t* p0, uint8_t* p1, uint8_t* p2,
                    uint8_t* p3) noexcept nogil
    void ds_split_8(const uint64_t* src, int64_t n, int rotate, uint8_t* const* p) noexcept nogil
    void ds_join_1(const uint8_t* p0, int64_t n, uint8_t* out) noexcept nogil
    void ds_join_2(const uint8_t* p0, const uint8_t* p1, int64_t n, int rotate, uint16_t* out) noexcept nogil
    void ds_join_4(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, const uint8_t* p3, int64_t n,
                   int rotate, uint32_t* out) noexcept nogil
    void ds_join_8(const uint8_t* const* p, int64_t n, int rotate, uint64_t* out) noexcept nogil


cdef void _split(int w, const void* src, int64_t n, bint rotate, uint8_t** p) noexcept nogil:
    if w == 1:
        ds_split_1(<const uint8_t*>src, n, p[0])
    elif w == 2:
        ds_split_2(<const uint16_t*>src, n, rotate, p[0], p[1])
    elif w == 4:
        ds_split_4(<const uint32_t*>src, n, rotate, p[0], p[1], p[2], p[3])
    else:
        ds_split_8(<const uint64_t*>src, n, rotate, p)


cdef void _join(int w, uint8_t** p, int64_t n, bint rotate, void* out) noexcept nogil:
    if w == 1:
        ds_join_1(p[0], n, <uint8_t*>out)
    elif w == 2:
        ds_join_2(p[0], p[1], n, rotate, <uint16_t*>out)
    elif w == 4:
        ds_join_4(p[0], p[1], p[2], p[3], n, rotate, <uint32_t*>out)
    else:
        ds_join_8(<const uint8_t* const*>p, n, rotate, <uint64_t*>out)


cdef int _planes(int w, object planes, int64_t n, bint write, uint8_t** p) except -1:
    if w != 1 and w != 2 and w != 4 and w != 8:
        raise ValueError(f"element width {w} is not 1, 2, 4 or 8")
    if len(planes) != w:
        raise ValueError(f"need {w} planes")
    cdef int j
    for j in range(w):
        p[j] = <uint8_t*>arr(planes[j], 1, UNSIGNED, write, "planes")
        if size(planes[j]) < n:
            raise ValueError(f"need {w} planes of at least {n} bytes")
    return 0


def split_array(src, bint rotate, planes):
    """Plane ``j`` of every element of ``src`` into ``planes[j][:src.size]`` (see :func:`planes.split`)."""
    cdef int w = src.itemsize
    cdef const char* s = arr(src, w, ANY, False, "src")
    cdef int64_t n = size(src)
    cdef uint8_t* p[8]
    _planes(w, planes, n, True, p)
    with nogil:
        _split(w, s, n, rotate, p)


def join_array(planes, bint rotate, out):
    """``out[i]`` from byte ``i`` of each plane (see :func:`planes.join`)."""
    cdef int w = out.itemsize
    cdef char* o = arr(out, w, ANY, True, "out")
    cdef int64_t n = size(out)
    cdef uint8_t* p[8]
    _planes(w, planes, n, False, p)
    with nogil:
        _join(w, p, n, rotate, o)


cdef int _segment_args(addrs, counts, starts, const uint64_t** a, const int64_t** c,
                       const int64_t** s) except -1:
    a[0] = <const uint64_t*>arr(addrs, 8, ADDRESS, False, "addrs")
    c[0] = <const int64_t*>arr(counts, 8, SIGNED, False, "counts")
    s[0] = <const int64_t*>arr(starts, 8, SIGNED, False, "starts")
    if size(counts) != size(addrs) or size(starts) != size(addrs):
        raise ValueError("addrs, counts and starts must be of one length")
    return 0


def split_at(int width, bint rotate, addrs, counts, starts, planes):
    """For each segment ``k``: split ``counts[k]`` elements at address ``addrs[k]`` into
    ``planes[j][starts[k]:starts[k] + counts[k]]`` (see :func:`planes.split_segments`, which checks the sizes)."""
    cdef const uint64_t* a
    cdef const int64_t* c
    cdef const int64_t* s
    _segment_args(addrs, counts, starts, &a, &c, &s)
    cdef uint8_t* p[8]
    cdef uint8_t* q[8]
    _planes(width, planes, 0, True, p)
    cdef Py_ssize_t k, n = size(addrs)
    cdef int j
    with nogil:
        for k in range(n):
            for j in range(width):
                q[j] = p[j] + s[k]
            _split(width, <const void*><uintptr_t>a[k], c[k], rotate, q)


def join_at(int width, bint rotate, planes, starts, counts, addrs):
    """For each segment ``k``: join ``planes[j][starts[k]:starts[k] + counts[k]]`` into the ``counts[k]``
    elements at address ``addrs[k]`` (see :func:`planes.join_segments`)."""
    cdef const uint64_t* a
    cdef const int64_t* c
    cdef const int64_t* s
    _segment_args(addrs, counts, starts, &a, &c, &s)
    cdef uint8_t* p[8]
    cdef uint8_t* q[8]
    _planes(width, planes, 0, False, p)
    cdef Py_ssize_t k, n = size(addrs)
    cdef int j
    with nogil:
        for k in range(n):
            for j in range(width):
                q[j] = p[j] + s[k]
            _join(width, q, c[k], rotate, <void*><uintptr_t>a[k])
