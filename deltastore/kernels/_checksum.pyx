# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of :mod:`deltastore.kernels.checksum` (that module states the formula and the contract)."""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

from ._arrays cimport ADDRESS, SIGNED, UNSIGNED, arr, bits_t, mix_dense, mix_sparse, size

import numpy as np

cnp.import_array()


cdef uint64_t _dense_at(int w, uintptr_t a, int64_t start, int64_t stop, uint64_t key) noexcept nogil:
    if w == 1:
        return mix_dense(<const uint8_t*>a, start, stop, key)
    if w == 2:
        return mix_dense(<const uint16_t*>a, start, stop, key)
    if w == 4:
        return mix_dense(<const uint32_t*>a, start, stop, key)
    return mix_dense(<const uint64_t*>a, start, stop, key)


cdef uint64_t _sparse_at(int w, const int64_t* p, uintptr_t b, int64_t start, int64_t stop,
                         uint64_t key) noexcept nogil:
    if w == 1:
        return mix_sparse(p, <const uint8_t*>b, start, stop, key)
    if w == 2:
        return mix_sparse(p, <const uint16_t*>b, start, stop, key)
    if w == 4:
        return mix_sparse(p, <const uint32_t*>b, start, stop, key)
    return mix_sparse(p, <const uint64_t*>b, start, stop, key)


def mix_sum_dense(bits, int64_t start, int64_t stop, uint64_t key):
    """``sum(mix(key, i, bits[i]) for i in range(start, stop)) mod 2**64`` (``bits``: unsigned, 1-D)."""
    cdef uintptr_t b = <uintptr_t>arr(bits, 0, UNSIGNED, False, "bits")
    cdef int w = bits.itemsize
    cdef uint64_t total
    with nogil:
        total = _dense_at(w, b, start, stop, key)
    return total


def mix_sum_sparse(positions, bits, int64_t start, int64_t stop, uint64_t key):
    """``sum(mix(key, positions[i], bits[i]) for i in range(start, stop)) mod 2**64`` (``positions``: int32 or
    int64, a negative one wraps to its two's complement)."""
    if isinstance(positions, np.ndarray) and positions.dtype == np.int32:
        positions = positions.astype(np.int64)  # sign-extended, as the formula's uint64 cast does
    cdef const int64_t* p = <const int64_t*>arr(positions, 8, SIGNED, False, "positions")
    cdef uintptr_t b = <uintptr_t>arr(bits, 0, UNSIGNED, False, "bits")
    cdef int w = bits.itemsize
    cdef uint64_t total
    with nogil:
        total = _sparse_at(w, p, b, start, stop, key)
    return total


# --- the same sums over memory given by address ----------------------------------------------------------

cdef object _dense(int w, uintptr_t addr, int64_t start, int64_t stop, uint64_t key):
    cdef uint64_t total
    with nogil:
        total = _dense_at(w, addr, start, stop, key)
    return total


def _dense_at1(uintptr_t addr, int64_t start, int64_t stop, uint64_t key):
    return _dense(1, addr, start, stop, key)


def _dense_at2(uintptr_t addr, int64_t start, int64_t stop, uint64_t key):
    return _dense(2, addr, start, stop, key)


def _dense_at4(uintptr_t addr, int64_t start, int64_t stop, uint64_t key):
    return _dense(4, addr, start, stop, key)


def _dense_at8(uintptr_t addr, int64_t start, int64_t stop, uint64_t key):
    return _dense(8, addr, start, stop, key)


cdef object _many(int w, addrs, counts, keys, out):
    cdef const uint64_t* a = <const uint64_t*>arr(addrs, 8, ADDRESS, False, "addrs")
    cdef const int64_t* c = <const int64_t*>arr(counts, 8, SIGNED, False, "counts")
    cdef const uint64_t* k = <const uint64_t*>arr(keys, 8, UNSIGNED, False, "keys")
    cdef uint64_t* o = <uint64_t*>arr(out, 8, UNSIGNED, True, "out")
    cdef Py_ssize_t n = size(addrs), t
    with nogil:
        for t in range(n):
            o[t] = _dense_at(w, <uintptr_t>a[t], 0, c[t], k[t])


def _many1(addrs, counts, keys, out):
    _many(1, addrs, counts, keys, out)


def _many2(addrs, counts, keys, out):
    _many(2, addrs, counts, keys, out)


def _many4(addrs, counts, keys, out):
    _many(4, addrs, counts, keys, out)


def _many8(addrs, counts, keys, out):
    _many(8, addrs, counts, keys, out)


cdef object _sparse(int w, uintptr_t paddr, uintptr_t baddr, int64_t start, int64_t stop, uint64_t key):
    cdef uint64_t total
    with nogil:
        total = _sparse_at(w, <const int64_t*>paddr, baddr, start, stop, key)
    return total


def _sparse_at1(uintptr_t paddr, uintptr_t baddr, int64_t start, int64_t stop, uint64_t key):
    return _sparse(1, paddr, baddr, start, stop, key)


def _sparse_at2(uintptr_t paddr, uintptr_t baddr, int64_t start, int64_t stop, uint64_t key):
    return _sparse(2, paddr, baddr, start, stop, key)


def _sparse_at4(uintptr_t paddr, uintptr_t baddr, int64_t start, int64_t stop, uint64_t key):
    return _sparse(4, paddr, baddr, start, stop, key)


def _sparse_at8(uintptr_t paddr, uintptr_t baddr, int64_t start, int64_t stop, uint64_t key):
    return _sparse(8, paddr, baddr, start, stop, key)
