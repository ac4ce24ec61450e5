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

``bits`` must be an unsigned integer array (uint8/16/32/64: the element's raw
bits, so widening zero-extends); ``positions`` int32/int64 (a negative value
wraps to its two's complement, as numpy's ``astype(uint64)`` does). The kernels
check nothing: callers pass in-range ``start <= stop <= len``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

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
