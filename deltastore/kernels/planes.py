"""Byte-plane kernels of the ``dense`` codec: rotate + split in one pass, and its inverse.

Plane ``j`` of an element is byte ``j`` of its raw bits *as a value*
(``(v >> 8 j) & 0xFF``, 0 = least significant), so the layout does not depend
on the machine's byte order. Float elements are first rotated left by one bit
(the sign moves to bit 0: for bf16, plane 1 is exactly the exponent and plane 0
sign + mantissa); joining rotates back.

Two shapes of call:

* :func:`split` / :func:`join`: one flat array ⇄ its planes (checked).
* :func:`split_segments` / :func:`join_segments`: many tensors ⇄ one run of
  planes, in **one** kernel call: the tensors are given by the addresses of
  their data (``torch.Tensor.data_ptr()``), so packing thousands of small
  tensors costs one dispatch, not one per tensor. The caller keeps every
  tensor alive during the call and checks every count and offset first.

Each call reads its input once and writes its output once (no temporaries).
The kernels are ``@njit(nogil=True, cache=True)``; callers run them on kernel
threads (:mod:`deltastore.kernels.parallel`). The kernels check nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from .jit import njit

_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


def _pointer_intrinsic(elem: types.Type):
    """An intrinsic turning a 64-bit integer address into a ``CPointer(elem)`` (for ``numba.carray``)."""

    @intrinsic
    def ptr(typingctx, addr):  # type: ignore[no-untyped-def]
        if not isinstance(addr, types.Integer) or addr.bitwidth != 64:
            return None
        sig = types.CPointer(elem)(addr)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return ptr


_p8 = _pointer_intrinsic(types.uint8)
_p16 = _pointer_intrinsic(types.uint16)
_p32 = _pointer_intrinsic(types.uint32)
_p64 = _pointer_intrinsic(types.uint64)


# --- element loops (inlined into the kernels below) --------------------------------------------------

@njit(nogil=True, cache=True, inline="always")
def _s1(src, p0):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        p0[i] = src[i]


@njit(nogil=True, cache=True, inline="always")
def _s2(src, rotate, p0, p1):  # type: ignore[no-untyped-def]
    if rotate:
        for i in range(src.size):
            v = np.uint32(src[i])
            r = (v << np.uint32(1)) | (v >> np.uint32(15))
            p0[i] = np.uint8(r & np.uint32(0xFF))
            p1[i] = np.uint8((r >> np.uint32(8)) & np.uint32(0xFF))
    else:
        for i in range(src.size):
            v = np.uint32(src[i])
            p0[i] = np.uint8(v & np.uint32(0xFF))
            p1[i] = np.uint8(v >> np.uint32(8))


@njit(nogil=True, cache=True, inline="always")
def _s4(src, rotate, p0, p1, p2, p3):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        v = np.uint64(src[i])
        if rotate:
            v = ((v << np.uint64(1)) | (v >> np.uint64(31))) & np.uint64(0xFFFFFFFF)
        p0[i] = np.uint8(v & np.uint64(0xFF))
        p1[i] = np.uint8((v >> np.uint64(8)) & np.uint64(0xFF))
        p2[i] = np.uint8((v >> np.uint64(16)) & np.uint64(0xFF))
        p3[i] = np.uint8((v >> np.uint64(24)) & np.uint64(0xFF))


@njit(nogil=True, cache=True, inline="always")
def _s8(src, rotate, p0, p1, p2, p3, p4, p5, p6, p7):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        v = np.uint64(src[i])
        if rotate:
            v = (v << np.uint64(1)) | (v >> np.uint64(63))
        p0[i] = np.uint8(v & np.uint64(0xFF))
        p1[i] = np.uint8((v >> np.uint64(8)) & np.uint64(0xFF))
        p2[i] = np.uint8((v >> np.uint64(16)) & np.uint64(0xFF))
        p3[i] = np.uint8((v >> np.uint64(24)) & np.uint64(0xFF))
        p4[i] = np.uint8((v >> np.uint64(32)) & np.uint64(0xFF))
        p5[i] = np.uint8((v >> np.uint64(40)) & np.uint64(0xFF))
        p6[i] = np.uint8((v >> np.uint64(48)) & np.uint64(0xFF))
        p7[i] = np.uint8((v >> np.uint64(56)) & np.uint64(0xFF))


@njit(nogil=True, cache=True, inline="always")
def _j1(p0, out):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        out[i] = p0[i]


@njit(nogil=True, cache=True, inline="always")
def _j2(p0, p1, rotate, out):  # type: ignore[no-untyped-def]
    if rotate:
        for i in range(out.size):
            r = np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8))
            out[i] = np.uint16(((r >> np.uint32(1)) | (r << np.uint32(15))) & np.uint32(0xFFFF))
    else:
        for i in range(out.size):
            out[i] = np.uint16(np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8)))


@njit(nogil=True, cache=True, inline="always")
def _j4(p0, p1, p2, p3, rotate, out):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        r = (np.uint64(p0[i]) | (np.uint64(p1[i]) << np.uint64(8)) | (np.uint64(p2[i]) << np.uint64(16))
             | (np.uint64(p3[i]) << np.uint64(24)))
        if rotate:
            r = ((r >> np.uint64(1)) | (r << np.uint64(31))) & np.uint64(0xFFFFFFFF)
        out[i] = np.uint32(r)


@njit(nogil=True, cache=True, inline="always")
def _j8(p0, p1, p2, p3, p4, p5, p6, p7, rotate, out):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        r = (np.uint64(p0[i]) | (np.uint64(p1[i]) << np.uint64(8)) | (np.uint64(p2[i]) << np.uint64(16))
             | (np.uint64(p3[i]) << np.uint64(24)) | (np.uint64(p4[i]) << np.uint64(32))
             | (np.uint64(p5[i]) << np.uint64(40)) | (np.uint64(p6[i]) << np.uint64(48))
             | (np.uint64(p7[i]) << np.uint64(56)))
        if rotate:
            r = (r >> np.uint64(1)) | (r << np.uint64(63))
        out[i] = r


# --- one array ---------------------------------------------------------------------------------------

@njit(nogil=True, cache=True)
def _split1(src, rotate, p0):  # type: ignore[no-untyped-def]
    _s1(src, p0)


@njit(nogil=True, cache=True)
def _split2(src, rotate, p0, p1):  # type: ignore[no-untyped-def]
    _s2(src, rotate, p0, p1)


@njit(nogil=True, cache=True)
def _split4(src, rotate, p0, p1, p2, p3):  # type: ignore[no-untyped-def]
    _s4(src, rotate, p0, p1, p2, p3)


@njit(nogil=True, cache=True)
def _split8(src, rotate, p0, p1, p2, p3, p4, p5, p6, p7):  # type: ignore[no-untyped-def]
    _s8(src, rotate, p0, p1, p2, p3, p4, p5, p6, p7)


@njit(nogil=True, cache=True)
def _join1(p0, rotate, out):  # type: ignore[no-untyped-def]
    _j1(p0, out)


@njit(nogil=True, cache=True)
def _join2(p0, p1, rotate, out):  # type: ignore[no-untyped-def]
    _j2(p0, p1, rotate, out)


@njit(nogil=True, cache=True)
def _join4(p0, p1, p2, p3, rotate, out):  # type: ignore[no-untyped-def]
    _j4(p0, p1, p2, p3, rotate, out)


@njit(nogil=True, cache=True)
def _join8(p0, p1, p2, p3, p4, p5, p6, p7, rotate, out):  # type: ignore[no-untyped-def]
    _j8(p0, p1, p2, p3, p4, p5, p6, p7, rotate, out)


# --- many tensors by address -------------------------------------------------------------------------
# addrs[k]: address of segment k's first element; counts[k]: its elements; starts[k]: where it sits in the planes

@njit(nogil=True, cache=True)
def _split1_seg(addrs, counts, starts, rotate, p0):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _s1(numba.carray(_p8(addrs[k]), (n,)), p0[s:s + n])


@njit(nogil=True, cache=True)
def _split2_seg(addrs, counts, starts, rotate, p0, p1):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _s2(numba.carray(_p16(addrs[k]), (n,)), rotate, p0[s:s + n], p1[s:s + n])


@njit(nogil=True, cache=True)
def _split4_seg(addrs, counts, starts, rotate, p0, p1, p2, p3):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _s4(numba.carray(_p32(addrs[k]), (n,)), rotate, p0[s:s + n], p1[s:s + n], p2[s:s + n], p3[s:s + n])


@njit(nogil=True, cache=True)
def _split8_seg(addrs, counts, starts, rotate, p0, p1, p2, p3, p4, p5, p6, p7):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _s8(numba.carray(_p64(addrs[k]), (n,)), rotate, p0[s:s + n], p1[s:s + n], p2[s:s + n], p3[s:s + n],
            p4[s:s + n], p5[s:s + n], p6[s:s + n], p7[s:s + n])


@njit(nogil=True, cache=True)
def _join1_seg(p0, rotate, starts, counts, addrs):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _j1(p0[s:s + n], numba.carray(_p8(addrs[k]), (n,)))


@njit(nogil=True, cache=True)
def _join2_seg(p0, p1, rotate, starts, counts, addrs):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _j2(p0[s:s + n], p1[s:s + n], rotate, numba.carray(_p16(addrs[k]), (n,)))


@njit(nogil=True, cache=True)
def _join4_seg(p0, p1, p2, p3, rotate, starts, counts, addrs):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _j4(p0[s:s + n], p1[s:s + n], p2[s:s + n], p3[s:s + n], rotate, numba.carray(_p32(addrs[k]), (n,)))


@njit(nogil=True, cache=True)
def _join8_seg(p0, p1, p2, p3, p4, p5, p6, p7, rotate, starts, counts, addrs):  # type: ignore[no-untyped-def]
    for k in range(addrs.size):
        n, s = counts[k], starts[k]
        _j8(p0[s:s + n], p1[s:s + n], p2[s:s + n], p3[s:s + n], p4[s:s + n], p5[s:s + n], p6[s:s + n],
            p7[s:s + n], rotate, numba.carray(_p64(addrs[k]), (n,)))


_SPLIT = {1: _split1, 2: _split2, 4: _split4, 8: _split8}
_JOIN = {1: _join1, 2: _join2, 4: _join4, 8: _join8}
_SPLIT_SEG = {1: _split1_seg, 2: _split2_seg, 4: _split4_seg, 8: _split8_seg}
_JOIN_SEG = {1: _join1_seg, 2: _join2_seg, 4: _join4_seg, 8: _join8_seg}


def unsigned(a: np.ndarray) -> np.ndarray:
    """``a`` (flat, contiguous, any 1/2/4/8-byte integer dtype) viewed as the same-width unsigned dtype."""
    return a.view(_UNSIGNED[a.dtype.itemsize])


def _check_planes(planes: Sequence[np.ndarray], width: int, n: int, what: str) -> None:
    if width not in _SPLIT:
        raise ValueError(f"{what}: element width {width} is not 1, 2, 4 or 8")
    if len(planes) != width or any(p.dtype != np.uint8 or p.ndim != 1 or p.size < n for p in planes):
        raise ValueError(f"{what}: need {width} 1-D uint8 planes of at least {n} bytes")


def split(src: np.ndarray, rotate: bool, planes: Sequence[np.ndarray]) -> None:
    """Write plane ``j`` of every element of ``src`` into ``planes[j][:src.size]`` (rotated left if ``rotate``).

    ``src``: flat contiguous integer array of width 1, 2, 4 or 8 bytes;
    ``planes``: ``width`` contiguous uint8 arrays of at least ``src.size``
    bytes. ``rotate`` is ignored for width 1. Raises ``ValueError`` otherwise.
    """
    u = unsigned(src)
    _check_planes(planes, u.dtype.itemsize, u.size, "split")
    if u.size:
        _SPLIT[u.dtype.itemsize](u, rotate, *[p[:u.size] for p in planes])


def join(planes: Sequence[np.ndarray], rotate: bool, out: np.ndarray) -> None:
    """Inverse of :func:`split`: ``out[i]`` from byte ``i`` of each plane (then rotated right if ``rotate``).

    ``planes``: ``width`` uint8 arrays (read-only allowed) of at least
    ``out.size`` bytes; ``out``: flat contiguous integer array of width 1, 2,
    4 or 8 bytes, written in place. Raises ``ValueError`` otherwise.
    """
    u = unsigned(out)
    _check_planes(planes, u.dtype.itemsize, u.size, "join")
    if u.size:
        _JOIN[u.dtype.itemsize](*[p[:u.size] for p in planes], rotate, u)


def _segments(addrs: np.ndarray, counts: np.ndarray, starts: np.ndarray, planes: Sequence[np.ndarray],
              width: int, what: str) -> None:
    if not (addrs.dtype == np.uint64 and counts.dtype == np.int64 and starts.dtype == np.int64
            and addrs.shape == counts.shape == starts.shape and addrs.ndim == 1):
        raise ValueError(f"{what}: addrs (uint64), counts and starts (int64) must be 1-D of one length")
    n = int((starts + counts).max()) if addrs.size else 0
    _check_planes(planes, width, n, what)
    if addrs.size and (int(counts.min()) < 0 or int(starts.min()) < 0 or 0 in addrs):
        raise ValueError(f"{what}: negative count or start, or a null address")


def split_segments(width: int, rotate: bool, addrs: np.ndarray, counts: np.ndarray, starts: np.ndarray,
                   planes: Sequence[np.ndarray]) -> None:
    """For each segment ``k``: split ``counts[k]`` elements read at address ``addrs[k]`` into
    ``planes[j][starts[k]:starts[k] + counts[k]]``.

    The memory at each address must hold that many contiguous elements of
    ``width`` bytes and stay alive during the call (the caller's contract:
    it cannot be checked here). Shapes and plane lengths are checked
    (``ValueError``).
    """
    _segments(addrs, counts, starts, planes, width, "split_segments")
    if addrs.size:
        _SPLIT_SEG[width](addrs, counts, starts, rotate, *planes)


def join_segments(width: int, rotate: bool, planes: Sequence[np.ndarray], starts: np.ndarray, counts: np.ndarray,
                  addrs: np.ndarray) -> None:
    """For each segment ``k``: join ``planes[j][starts[k]:starts[k] + counts[k]]`` into the ``counts[k]``
    elements of ``width`` bytes at address ``addrs[k]`` (same contract as :func:`split_segments`)."""
    _segments(addrs, counts, starts, planes, width, "join_segments")
    if addrs.size:
        _JOIN_SEG[width](*planes, rotate, starts, counts, addrs)
