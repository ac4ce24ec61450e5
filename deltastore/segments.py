"""Many tensors in one kernel call: compare, gather, scatter and checksum deltas by address.

The publish and pull paths touch every tensor of a model once per version. A
torch or numpy call per tensor costs microseconds of Python, which dominates
for models with many small tensors (MoE experts, norms, biases). These
helpers hand a whole list of CPU tensors (flat bit views) to one
:mod:`deltastore.kernels.diff` kernel call per thread, by data pointer, so the
cost follows elements, not tensor count. Every function here takes flat,
contiguous CPU tensors of one element width and trusts the caller on sizes
(the callers validate shapes against the manifest or the mirror first).

Changes of many tensors come back *flat* (:class:`FlatChanges`): one
positions / new bits / old bits array for all of them, in tensor order, with
per-tensor bounds; :meth:`FlatChanges.change` slices one tensor's
:class:`~deltastore.diff.Change` out of it (views, no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .kernels import diff as _k
from .kernels.parallel import chunked, threads

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_EMPTY_POS = torch.empty(0, dtype=torch.int64)
#: minimum elements per thread (below, one thread does everything: no thread hop)
MIN_CHUNK = 1 << 18


def like(width: int) -> np.ndarray:
    """The zero-length unsigned array that selects a kernel's element type."""
    return np.empty(0, _UNSIGNED[width])


def pointers(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter((t.data_ptr() for t in tensors), dtype=np.int64, count=len(tensors))


def lengths(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter((t.numel() for t in tensors), dtype=np.int64, count=len(tensors))


def unsigned(t: torch.Tensor) -> np.ndarray:
    """A flat unsigned numpy view of a CPU tensor's bits (no copy)."""
    n = t.detach().reshape(-1)
    if n.dtype == torch.bool:
        n = n.view(torch.uint8)
    return n.numpy().view(_UNSIGNED[n.element_size()])


def to_bits(a: np.ndarray) -> torch.Tensor:
    """The torch integer-view tensor (``uint8``/``int16``/``int32``/``int64``) over an unsigned array."""
    return torch.from_numpy(a.view(_SIGNED_NP[a.itemsize]))


def _parallel(runs: list, fn):  # noqa: ANN001, ANN202
    if len(runs) <= 1:
        return [fn(*r) for r in runs]
    return [x for part in chunked(len(runs), lambda s, e: [fn(*runs[i]) for i in range(s, e)], min_chunk=1,
                                  pieces=len(runs)) for x in part]


@dataclass
class FlatChanges:
    """The changed elements of several tensors, back to back in tensor order.

    positions: int64 local (per-tensor) flat positions; new_bits / old_bits: the
    bits there (integer view dtype). ``bounds[i]:bounds[i + 1]`` is tensor
    ``i``'s slice; ``sums[i]`` its checksum delta (mod 2**64).
    """

    bounds: np.ndarray
    positions: torch.Tensor
    new_bits: torch.Tensor
    old_bits: torch.Tensor
    sums: np.ndarray

    def count(self, i: int) -> int:
        return int(self.bounds[i + 1] - self.bounds[i])

    def change(self, i: int):  # noqa: ANN201 - Change (import cycle)
        from .diff import Change

        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        return Change(self.positions[a:b], self.new_bits[a:b], self.old_bits[a:b])


def diff_segments(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], keys: np.ndarray, *,
                  hint: float = 1 / 64) -> FlatChanges:
    """Changed elements of ``news[i]`` against ``olds[i]`` for every ``i``, in one pass per thread.

    ``olds`` / ``news``: flat contiguous CPU tensors, pairwise of equal size,
    all of one element width. ``keys``: the tensors' checksum keys (uint64).
    ``hint``: the expected changed fraction (sizes the first output buffers;
    they grow when it is exceeded).
    """
    n = len(olds)
    width = olds[0].element_size() if n else 2
    lk = like(width)
    optr, nptr, lens = pointers(olds), pointers(news), lengths(olds)
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    iseg, istart, istop, runs = _k.split_items(lens, threads(), MIN_CHUNK)
    counts = np.zeros(iseg.size, np.int64)
    sums = np.zeros(iseg.size, np.uint64)
    udt = _UNSIGNED[width]

    def run(i0: int, i1: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        elems = int((istop[i0:i1] - istart[i0:i1]).sum())
        cap = min(elems, int(elems * hint) + 4096)
        out = []
        i, e = i0, 0
        while True:
            pos, new, old = np.empty(cap, np.int64), np.empty(cap, udt), np.empty(cap, udt)
            c, i_next, e_next = _k.diff_items(lk, optr, nptr, lens, keys, iseg, istart, istop, i, i1, e,
                                              pos, new, old, counts, sums)
            if c < cap // 2:  # do not keep a mostly empty buffer alive
                pos, new, old = pos[:c].copy(), new[:c].copy(), old[:c].copy()
            else:
                pos, new, old = pos[:c], new[:c], old[:c]
            out.append((pos, new, old))
            if i_next >= i1:
                return out
            # the buffers filled up: size the next ones from the density seen so far
            done = int((istop[i0:i_next] - istart[i0:i_next]).sum()) + int(e_next - istart[i_next])
            left = max(1, elems - done)
            found = sum(p.size for p, _, _ in out)
            cap = min(left + 8, int(left * 1.25 * found / max(1, done)) + 4096)
            i, e = int(i_next), int(e_next)

    parts = [p for chunk in _parallel(runs, run) for p in chunk]
    if len(parts) == 1:
        pos, new, old = parts[0]
    elif parts:
        pos = np.concatenate([p for p, _, _ in parts])
        new = np.concatenate([q for _, q, _ in parts])
        old = np.concatenate([o for _, _, o in parts])
    else:
        pos, new, old = np.zeros(0, np.int64), np.zeros(0, udt), np.zeros(0, udt)
    seg_counts = np.bincount(iseg, weights=counts, minlength=n).astype(np.int64) if iseg.size else \
        np.zeros(n, np.int64)
    seg_sums = np.zeros(n, np.uint64)
    if iseg.size:
        np.add.at(seg_sums, iseg, sums)
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(seg_counts, out=bounds[1:])
    return FlatChanges(bounds, torch.from_numpy(pos), to_bits(new), to_bits(old), seg_sums)


def _bounds_of(sizes: Sequence[int]) -> np.ndarray:
    b = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=b[1:])
    return b


def gather(tensors: Sequence[torch.Tensor], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
    """Bits of ``tensors[i]`` at ``positions[bounds[i]:bounds[i + 1]]`` for every ``i``, back to back."""
    width = tensors[0].element_size() if len(tensors) else 2
    ptr, lens = pointers(tensors), lengths(tensors)
    pos = positions.numpy()
    out = np.empty(pos.size, _UNSIGNED[width])
    lk = like(width)
    runs = _k.segment_runs(bounds, threads())
    _parallel(runs, lambda s0, s1: _k.gather_items(lk, ptr, lens, pos, bounds, s0, s1, out))
    return to_bits(out)


def scatter(tensors: Sequence[torch.Tensor], positions: torch.Tensor, bounds: np.ndarray,
            bits: torch.Tensor) -> None:
    """Write ``bits[bounds[i]:bounds[i + 1]]`` into ``tensors[i]`` at the matching positions, for every ``i``."""
    if not len(tensors):
        return
    width = tensors[0].element_size()
    ptr, lens = pointers(tensors), lengths(tensors)
    pos, vals = positions.numpy(), unsigned(bits)
    lk = like(width)
    runs = _k.segment_runs(bounds, threads())
    _parallel(runs, lambda s0, s1: _k.scatter_items(lk, ptr, lens, pos, bounds, s0, s1, vals))


def copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
    """``dsts[i][:] = srcs[i]`` for every ``i`` (flat, same sizes, one element width), on every kernel thread."""
    if not len(srcs):
        return
    width = srcs[0].element_size()
    sp, dp, lens = pointers(srcs), pointers(dsts), lengths(srcs)
    iseg, istart, istop, runs = _k.split_items(lens, threads(), MIN_CHUNK)
    lk = like(width)
    _parallel(runs, lambda i0, i1: _k.copy_items(lk, sp, dp, iseg, istart, istop, i0, i1))


def full_sums(tensors: Sequence[torch.Tensor], keys: np.ndarray) -> np.ndarray:
    """The whole-tensor checksum of every tensor (``keys``: their checksum keys), uint64, in one pass."""
    n = len(tensors)
    out = np.zeros(n, np.uint64)
    if not n:
        return out
    width = tensors[0].element_size()
    ptr, lens = pointers(tensors), lengths(tensors)
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    iseg, istart, istop, runs = _k.split_items(lens, threads(), MIN_CHUNK)
    per = np.zeros(iseg.size, np.uint64)
    lk = like(width)
    _parallel(runs, lambda i0, i1: _k.mix_full_items(lk, ptr, lens, keys, iseg, istart, istop, i0, i1, per))
    if iseg.size:
        np.add.at(out, iseg, per)
    return out


def mix_delta(positions: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor, bounds: np.ndarray,
              keys: np.ndarray) -> np.ndarray:
    """Per segment ``i``: ``sum mix(new) - sum mix(old)`` over its changes (the checksum delta, uint64)."""
    n = bounds.size - 1
    out = np.zeros(n, np.uint64)
    if n <= 0 or positions.numel() == 0:
        return out
    pos, old, new = positions.numpy(), unsigned(old_bits), unsigned(new_bits)
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    runs = _k.segment_runs(bounds, threads())
    _parallel(runs, lambda s0, s1: _k.mix_delta_segments(pos, old, new, bounds, keys, s0, s1, out))
    return out


def check_positions(positions: torch.Tensor, bounds: np.ndarray, numels: np.ndarray) -> int:
    """Index of the first segment whose positions are not strictly increasing within ``[0, numel)``, or -1."""
    if positions.numel() == 0:
        return -1
    return int(_k.check_segments(positions.numpy(), bounds, np.ascontiguousarray(numels, dtype=np.int64)))


bounds_of = _bounds_of
