"""Kernels of the per-tensor checksum (``deltastore.checksum``): one fused pass, no temporaries.

Both kernels compute, over a range of elements, the wrapping (mod 2**64) sum of

    mix(key, p, b) = fmix(p * 0x9E3779B97F4A7C15 ^ zero_extend(b) + key)

where ``fmix`` is the splitmix64 finaliser (xor-shift 30, multiply, xor-shift
27, multiply, xor-shift 31). ``docs/format.md`` is the normative statement;
``tests/test_kernels_checksum.py`` pins these kernels to the original numpy
formula bit for bit.

* :func:`mix_sum_dense` — positions are the element indices themselves
  (``p = i`` for ``bits[i]``), for a whole tensor: a range ``[start, stop)`` of
  the flat array, so threads can each take a contiguous chunk.
* :func:`mix_sum_sparse` — positions given next to the bits (changed elements).
* ``DENSE_AT`` / ``SPARSE_AT`` / ``MANY`` (by element width) — the same sums
  over memory given by address (``Tensor.data_ptr()``), so a call costs no
  numpy view, and ``MANY`` sums thousands of small tensors in one call.

``bits`` must be an unsigned integer array (uint8/16/32/64: the element's raw
bits, so widening zero-extends); ``positions`` int32/int64 (a negative value
wraps to its two's complement, as numpy's ``astype(uint64)`` does). The kernels
check nothing: callers pass in-range ``start <= stop <= len``.
"""

from __future__ import annotations

import numba
import numpy as np

from .jit import njit
from .planes import _p8, _p16, _p32, _p64  # 64-bit address -> typed pointer (for numba.carray)

C1 = np.uint64(0x9E3779B97F4A7C15)
C2 = np.uint64(0xBF58476D1CE4E5B9)
C3 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit(nogil=True, cache=True, inline="always")
def _fmix(x: np.uint64) -> np.uint64:
    x ^= x >> _S30
    x *= C2
    x ^= x >> _S27
    x *= C3
    x ^= x >> _S31
    return x


@njit(nogil=True, cache=True)
def mix_sum_dense(bits: np.ndarray, start: int, stop: int, key: np.uint64) -> np.uint64:
    """``sum(mix(key, i, bits[i]) for i in range(start, stop)) mod 2**64``."""
    total = np.uint64(0)
    for i in range(start, stop):
        x = np.uint64(i) * C1
        x ^= np.uint64(bits[i])
        x += key
        total += _fmix(x)
    return total


@njit(nogil=True, cache=True)
def mix_sum_sparse(positions: np.ndarray, bits: np.ndarray, start: int, stop: int, key: np.uint64) -> np.uint64:
    """``sum(mix(key, positions[i], bits[i]) for i in range(start, stop)) mod 2**64``."""
    total = np.uint64(0)
    for i in range(start, stop):
        x = np.uint64(positions[i]) * C1
        x ^= np.uint64(bits[i])
        x += key
        total += _fmix(x)
    return total


# --- the same sums over memory given by address (no numpy view per tensor: the many-small-tensors path) ----
# ``addr`` is a tensor's ``data_ptr()``: the caller keeps the tensor alive and in-range during the call.

@njit(nogil=True, cache=True)
def _dense_at1(addr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_dense(numba.carray(_p8(addr), (stop,)), start, stop, key)


@njit(nogil=True, cache=True)
def _dense_at2(addr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_dense(numba.carray(_p16(addr), (stop,)), start, stop, key)


@njit(nogil=True, cache=True)
def _dense_at4(addr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_dense(numba.carray(_p32(addr), (stop,)), start, stop, key)


@njit(nogil=True, cache=True)
def _dense_at8(addr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_dense(numba.carray(_p64(addr), (stop,)), start, stop, key)


@njit(nogil=True, cache=True)
def _many1(addrs, counts, keys, out):  # type: ignore[no-untyped-def]
    for t in range(addrs.size):
        out[t] = mix_sum_dense(numba.carray(_p8(addrs[t]), (counts[t],)), 0, counts[t], keys[t])


@njit(nogil=True, cache=True)
def _many2(addrs, counts, keys, out):  # type: ignore[no-untyped-def]
    for t in range(addrs.size):
        out[t] = mix_sum_dense(numba.carray(_p16(addrs[t]), (counts[t],)), 0, counts[t], keys[t])


@njit(nogil=True, cache=True)
def _many4(addrs, counts, keys, out):  # type: ignore[no-untyped-def]
    for t in range(addrs.size):
        out[t] = mix_sum_dense(numba.carray(_p32(addrs[t]), (counts[t],)), 0, counts[t], keys[t])


@njit(nogil=True, cache=True)
def _many8(addrs, counts, keys, out):  # type: ignore[no-untyped-def]
    for t in range(addrs.size):
        out[t] = mix_sum_dense(numba.carray(_p64(addrs[t]), (counts[t],)), 0, counts[t], keys[t])


@njit(nogil=True, cache=True)
def _sparse_at1(paddr, baddr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_sparse(numba.carray(_p64(paddr), (stop,)), numba.carray(_p8(baddr), (stop,)), start, stop, key)


@njit(nogil=True, cache=True)
def _sparse_at2(paddr, baddr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_sparse(numba.carray(_p64(paddr), (stop,)), numba.carray(_p16(baddr), (stop,)), start, stop, key)


@njit(nogil=True, cache=True)
def _sparse_at4(paddr, baddr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_sparse(numba.carray(_p64(paddr), (stop,)), numba.carray(_p32(baddr), (stop,)), start, stop, key)


@njit(nogil=True, cache=True)
def _sparse_at8(paddr, baddr, start, stop, key):  # type: ignore[no-untyped-def]
    return mix_sum_sparse(numba.carray(_p64(paddr), (stop,)), numba.carray(_p64(baddr), (stop,)), start, stop, key)


#: by element width: ``f(addr, start, stop, key)`` = :func:`mix_sum_dense` of the elements at ``addr``
DENSE_AT = {1: _dense_at1, 2: _dense_at2, 4: _dense_at4, 8: _dense_at8}
#: by element width: ``f(addrs, counts, keys, out)``: ``out[t]`` = the whole-array sum of tensor ``t``
MANY = {1: _many1, 2: _many2, 4: _many4, 8: _many8}
#: by bits width: ``f(positions_addr (int64), bits_addr, start, stop, key)`` = :func:`mix_sum_sparse`
SPARSE_AT = {1: _sparse_at1, 2: _sparse_at2, 4: _sparse_at4, 8: _sparse_at8}
