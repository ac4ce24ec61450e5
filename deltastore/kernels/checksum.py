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

The loops are compiled (``_checksum.pyx``, vectorised in ``_simd.h``) and run
without the GIL.

``bits`` must be an unsigned integer array (uint8/16/32/64: the element's raw
bits, so widening zero-extends); ``positions`` int32/int64 (a negative value
wraps to its two's complement, as numpy's ``astype(uint64)`` does). The kernels
check nothing: callers pass in-range ``start <= stop <= len``.
"""

from __future__ import annotations

import numpy as np

from ._checksum import (  # noqa: F401 - mix_sum_dense / mix_sum_sparse are this module's API
    _dense_at1, _dense_at2, _dense_at4, _dense_at8, _many1, _many2, _many4, _many8, _sparse_at1, _sparse_at2,
    _sparse_at4, _sparse_at8, mix_sum_dense, mix_sum_sparse)

C1 = np.uint64(0x9E3779B97F4A7C15)
C2 = np.uint64(0xBF58476D1CE4E5B9)
C3 = np.uint64(0x94D049BB133111EB)

# ``addr`` is a tensor's ``data_ptr()``: the caller keeps the tensor alive and in-range during the call.
#: by element width: ``f(addr, start, stop, key)`` = :func:`mix_sum_dense` of the elements at ``addr``
DENSE_AT = {1: _dense_at1, 2: _dense_at2, 4: _dense_at4, 8: _dense_at8}
#: by element width: ``f(addrs, counts, keys, out)``: ``out[t]`` = the whole-array sum of tensor ``t``
MANY = {1: _many1, 2: _many2, 4: _many4, 8: _many8}
#: by bits width: ``f(positions_addr (int64), bits_addr, start, stop, key)`` = :func:`mix_sum_sparse`
SPARSE_AT = {1: _sparse_at1, 2: _sparse_at2, 4: _sparse_at4, 8: _sparse_at8}
