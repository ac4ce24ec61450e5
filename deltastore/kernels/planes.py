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
The loops are compiled (``_planes.pyx``, vectorised in ``_simd.h``) and run
without the GIL; callers run them on kernel threads
(:mod:`deltastore.kernels.parallel`). The functions here check every argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _planes

_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


def unsigned(a: np.ndarray) -> np.ndarray:
    """``a`` (flat, contiguous, any 1/2/4/8-byte integer dtype) viewed as the same-width unsigned dtype."""
    return a.view(_UNSIGNED[a.dtype.itemsize])


def _check_planes(planes: Sequence[np.ndarray], width: int, n: int, what: str) -> None:
    if width not in _UNSIGNED:
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
        _planes.split_array(u, rotate, [p[:u.size] for p in planes])


def join(planes: Sequence[np.ndarray], rotate: bool, out: np.ndarray) -> None:
    """Inverse of :func:`split`: ``out[i]`` from byte ``i`` of each plane (then rotated right if ``rotate``).

    ``planes``: ``width`` uint8 arrays (read-only allowed) of at least
    ``out.size`` bytes; ``out``: flat contiguous integer array of width 1, 2,
    4 or 8 bytes, written in place. Raises ``ValueError`` otherwise.
    """
    u = unsigned(out)
    _check_planes(planes, u.dtype.itemsize, u.size, "join")
    if u.size:
        _planes.join_array([p[:u.size] for p in planes], rotate, u)


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
        _planes.split_at(width, rotate, addrs, counts, starts, list(planes))


def join_segments(width: int, rotate: bool, planes: Sequence[np.ndarray], starts: np.ndarray, counts: np.ndarray,
                  addrs: np.ndarray) -> None:
    """For each segment ``k``: join ``planes[j][starts[k]:starts[k] + counts[k]]`` into the ``counts[k]``
    elements of ``width`` bytes at address ``addrs[k]`` (same contract as :func:`split_segments`)."""
    _segments(addrs, counts, starts, planes, width, "join_segments")
    if addrs.size:
        _planes.join_at(width, rotate, list(planes), starts, counts, addrs)
