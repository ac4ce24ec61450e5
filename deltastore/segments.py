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
:class:`Change` out of it (views, no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .kernels import diff as _k
from .kernels import merge as _m
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
    return np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.int64, count=len(tensors))


def lengths(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter(map(torch.Tensor.numel, tensors), dtype=np.int64, count=len(tensors))


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


def one_range(bounds: np.ndarray, idx: np.ndarray) -> tuple[int, int, np.ndarray] | None:
    """``(start, stop, bounds of idx from 0)`` when rows ``idx`` of a stream laid out by ``bounds`` are one
    range of it (in order, with only empty rows between them); else None."""
    if not idx.size or not bool((np.diff(idx) > 0).all()) or \
            not bool((bounds[idx[1:]] == bounds[idx[:-1] + 1]).all()):
        return None
    a, b = int(bounds[idx[0]]), int(bounds[idx[-1] + 1])
    return a, b, np.append(bounds[idx], b) - a


@dataclass
class Change:
    """The elements of one tensor whose bits changed.

    positions: int64, 1-D, strictly increasing flat positions (CPU).
    new_bits: the new raw bits at those positions (integer view dtype, CPU).
    old_bits: the previous raw bits at those positions (CPU).
    """

    positions: torch.Tensor
    new_bits: torch.Tensor
    old_bits: torch.Tensor

    @property
    def count(self) -> int:  # asked several times per tensor on the publish path: cached (a Change is never modified)
        got = self.__dict__.get("_count")
        if got is None:
            got = self.__dict__["_count"] = int(self.positions.numel())
        return got


@dataclass
class FlatChanges:
    """The changed elements of several tensors, back to back in tensor order.

    The stream is held in ``parts`` (one per buffer the compare filled, no
    concatenation): each a triple of int64 local (per-tensor) flat positions,
    new bits and old bits (integer view dtype). ``bounds[i]:bounds[i + 1]`` is
    tensor ``i``'s range in the whole stream, ``starts[k]`` where part ``k``
    begins; ``sums[i]`` is tensor ``i``'s checksum delta (mod 2**64).
    """

    bounds: np.ndarray
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    starts: np.ndarray
    sums: np.ndarray

    def count(self, i: int) -> int:
        return int(self.bounds[i + 1] - self.bounds[i])

    def change(self, i: int) -> Change:
        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        k = int(np.searchsorted(self.starts, a, side="right")) - 1
        base = int(self.starts[k])
        pos, new, old = self.parts[k]
        if b - base <= pos.numel():  # inside one part: views
            return Change(pos[a - base:b - base], new[a - base:b - base], old[a - base:b - base])
        pieces = []  # straddles parts (at most one tensor per part boundary): join its slices
        while a < b:
            base = int(self.starts[k])
            pos, new, old = self.parts[k]
            e = min(b, base + pos.numel())
            pieces.append((pos[a - base:e - base], new[a - base:e - base], old[a - base:e - base]))
            a, k = e, k + 1
        return Change(cat([p for p, _, _ in pieces]), cat([q for _, q, _ in pieces]),
                      cat([o for _, _, o in pieces]))

    def changes(self) -> list[Change]:
        """Every tensor's :class:`Change` (views into the parts; ``torch.split`` per part)."""
        counts = np.diff(self.bounds)
        if len(self.parts) == 1:
            pos, new, old = self.parts[0]
            sizes = counts.tolist()
            return [Change(p, q, o) for p, q, o in zip(pos.split(sizes), new.split(sizes), old.split(sizes))]
        splits = []
        for k, (pos, new, old) in enumerate(self.parts):
            sizes = np.diff(self.part_bounds(k)).tolist()
            splits.append((pos.split(sizes), new.split(sizes), old.split(sizes)))
        lo = self.bounds[:-1]
        home = np.searchsorted(self.starts, lo, side="right") - 1  # the part each tensor starts in
        ends = self.starts + np.array([p.numel() for p, _, _ in self.parts])
        inside = (self.bounds[1:] <= ends[home]).tolist()
        out = []
        for i, (k, one) in enumerate(zip(home.tolist(), inside)):
            if one:
                sp = splits[k]
                out.append(Change(sp[0][i], sp[1][i], sp[2][i]))
            else:
                out.append(self.change(i))
        return out

    def select(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
        """``(positions, new bits, old bits, bounds)`` of tensors ``idx`` (any order) back to back: views
        when they are one range of the stream (in order, with only unchanged tensors between them) inside
        one part, else one kernel copy per array."""
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        run = one_range(self.bounds, idx)
        if run is not None:
            a, b, bounds = run
            k = int(np.searchsorted(self.starts, a, side="right")) - 1
            base = int(self.starts[k])
            pos, new, old = self.parts[k]
            if b - base <= pos.numel():
                return pos[a - base:b - base], new[a - base:b - base], old[a - base:b - base], bounds
        got = [take_parts([p[j] for p in self.parts], self.starts, self.bounds, idx) for j in range(3)]
        return got[0][0], got[1][0], got[2][0], got[0][1]

    def part_bounds(self, k: int) -> np.ndarray:
        """``bounds`` relative to part ``k`` (empty ranges for tensors outside it): for per-part kernels."""
        base = int(self.starts[k])
        return np.clip(self.bounds - base, 0, self.parts[k][0].numel())


def diff_segments(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], keys: np.ndarray, *,
                  hint: float = 1 / 64, advance: bool = False) -> FlatChanges:
    """Changed elements of ``news[i]`` against ``olds[i]`` for every ``i``, in one pass per thread.

    ``olds`` / ``news``: flat contiguous CPU tensors, pairwise of equal size,
    all of one element width. ``keys``: the tensors' checksum keys (uint64).
    ``hint``: the expected changed fraction (sizes the first output buffers;
    more are added when it is exceeded, and every buffer is shrunk in place
    to what it holds). ``advance``: also write the new bits into ``olds`` in
    the same pass (they then hold ``news``); if the call fails part way (an
    output buffer cannot be allocated), what it wrote is written back first.
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
    found_by_run: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def run(i0: int, i1: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        elems = int((istop[i0:i1] - istart[i0:i1]).sum())
        cap = min(elems, int(elems * hint) + 4096)
        out = found_by_run[i0] = []
        i, e = i0, 0
        while True:
            pos, new, old = np.empty(cap, np.int64), np.empty(cap, udt), np.empty(cap, udt)
            c, i_next, e_next = _k.diff_items(lk, optr, nptr, lens, keys, iseg, istart, istop, i, i1, e,
                                              pos, new, old, counts, sums, advance)
            if c:  # noted at once: a failure later in this call still knows what to put back
                out.append((pos, new, old))
            if c < cap:  # give the unused tail back (realloc shrinks in place)
                for a in (pos, new, old):
                    a.resize(c, refcheck=False)
            if i_next >= i1:
                return out
            # the buffers filled up: size the next ones from the density seen so far
            done = int((istop[i0:i_next] - istart[i0:i_next]).sum()) + int(e_next - istart[i_next])
            left = max(1, elems - done)
            found = sum(p.size for p, _, _ in out)
            cap = min(left + 8, int(left * 1.25 * found / max(1, done)) + 4096)
            i, e = int(i_next), int(e_next)

    try:
        found = [p for chunk in _parallel(runs, run) for p in chunk]
    except BaseException:
        if advance:  # every run has stopped (each() waits for them all): put back what they advanced
            _put_back(olds, runs, found_by_run, iseg, counts)
        raise
    parts = [(torch.from_numpy(p), to_bits(q), to_bits(o)) for p, q, o in found]
    if not parts:
        parts = [(torch.empty(0, dtype=torch.int64), to_bits(np.zeros(0, udt)), to_bits(np.zeros(0, udt)))]
    starts = np.zeros(len(parts), np.int64)
    if len(parts) > 1:
        np.cumsum([p.numel() for p, _, _ in parts[:-1]], out=starts[1:])
    seg_counts = np.bincount(iseg, weights=counts, minlength=n).astype(np.int64) if iseg.size else \
        np.zeros(n, np.int64)
    seg_sums = np.zeros(n, np.uint64)
    if iseg.size:
        np.add.at(seg_sums, iseg, sums)
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(seg_counts, out=bounds[1:])
    return FlatChanges(bounds, parts, starts, seg_sums)


def _put_back(olds: Sequence[torch.Tensor], runs: list[tuple[int, int]],
              found_by_run: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]], iseg: np.ndarray,
              counts: np.ndarray) -> None:
    """Write the old bits of what an advancing :func:`diff_segments` found back into ``olds``: each run's buffers
    hold its items' changes in order, ``counts[i]`` of them item ``i``'s (a failure path: nothing large is
    allocated)."""
    for i0, i1 in runs:
        parts, k, at = found_by_run.get(i0, []), 0, 0
        for i in range(i0, i1):
            need = int(counts[i])
            dst = unsigned(olds[int(iseg[i])])
            while need:
                pos, _, old = parts[k]
                take = min(need, pos.size - at)
                dst[pos[at:at + take]] = old[at:at + take]
                need -= take
                at += take
                if at == pos.size:
                    k, at = k + 1, 0


def is_zero(t: torch.Tensor) -> bool:
    """Whether every bit of the flat contiguous tensor ``t`` is zero (one pass; CPU tensors by kernel)."""
    if t.numel() == 0:
        return True
    if not t.is_cpu:
        return not bool(t.view(torch.uint8).any())
    return bool(_k.all_zero(like(t.element_size()), t.data_ptr(), t.numel()))


def zero_flags_at(width: int, addresses: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Whether each of the ranges of ``counts[i]`` elements of ``width`` bytes at ``addresses[i]`` (int64
    arrays; memory the caller keeps alive) holds only zero bits, as a bool array (one kernel call)."""
    out = np.zeros(len(addresses), np.bool_)
    if len(addresses):
        _k.zero_flags(like(width), addresses, counts, out)
    return out


def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of 1-D CPU tensors of one dtype; a few big pieces go through numpy (one memcpy each,
    no OpenMP hand-off: torch's parallel copy stalls when the cores are busy with other work)."""
    if len(tensors) == 1:
        return tensors[0]
    if tensors[0].dtype == torch.bool or len(tensors) > 64:  # many small pieces: torch's loop is cheaper
        return torch.cat(list(tensors))
    return torch.from_numpy(np.concatenate([t.detach().numpy() for t in tensors]))


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`cat` for reading only: a view when the pieces lie back to back in one buffer (no copy).

    Decoders hand out many tensors' positions and bits as consecutive slices
    of one array; joining them again then costs nothing. Otherwise a new
    tensor, as :func:`cat`. The caller must not write into the result.
    """
    if len(tensors) > 1:
        first = tensors[0]
        end = first.data_ptr()
        for t in tensors:
            n = t.numel()
            if t.dtype != first.dtype or t.dim() != 1:
                return cat(tensors)
            if n:  # an empty piece has no address (0): it sits anywhere
                if t.data_ptr() != end or not t.is_contiguous():
                    return cat(tensors)
                end += n * t.element_size()
        if not first.numel():
            return cat(tensors)
        storage = first.untyped_storage()
        if first.is_cpu and storage.data_ptr() <= first.data_ptr() and end <= storage.data_ptr() + storage.nbytes():
            offset = (first.data_ptr() - storage.data_ptr()) // first.element_size()
            n = (end - first.data_ptr()) // first.element_size()
            return first.new_empty(0).set_(storage, offset, (n,))
    return cat(tensors)


def _bounds_of(sizes: Sequence[int]) -> np.ndarray:
    b = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=b[1:])
    return b


def take_parts(parts: Sequence[torch.Tensor], starts: np.ndarray, bounds: np.ndarray, idx: np.ndarray
               ) -> tuple[torch.Tensor, np.ndarray]:
    """Segments ``idx`` (any order) of a flat stream held in CPU ``parts`` (part ``k`` holds the stream's
    elements from ``starts[k]``; segment ``i`` is elements ``bounds[i]:bounds[i + 1]``), back to back, and
    the bounds of the result: one kernel copy, no index array."""
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    b = np.ascontiguousarray(bounds, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    out_bounds = np.zeros(idx.size + 1, np.int64)
    np.cumsum(b[idx + 1] - b[idx], out=out_bounds[1:])
    first = parts[0].numpy()
    out = np.empty(int(out_bounds[-1]), first.dtype)
    if out.size:
        home = np.searchsorted(starts, b[idx], side="right") - 1
        _k.take_stream(np.empty(0, first.dtype), pointers(parts), lengths(parts), starts, b, idx, home, out)
    return torch.from_numpy(out), out_bounds


def take(arrays: Sequence[torch.Tensor], bounds: np.ndarray, idx: np.ndarray
         ) -> tuple[list[torch.Tensor], np.ndarray]:
    """:func:`take_parts` of each flat CPU array (all laid out by the same ``bounds``)."""
    zero = np.zeros(1, np.int64)
    got = [take_parts([a], zero, bounds, idx) for a in arrays]
    return [t for t, _ in got], (got[0][1] if got else np.zeros(len(idx) + 1, np.int64))


def gather(tensors: Sequence[torch.Tensor], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
    """Bits of ``tensors[i]`` at ``positions[bounds[i]:bounds[i + 1]]`` for every ``i``, back to back."""
    width = tensors[0].element_size() if len(tensors) else 2
    ptr, lens = pointers(tensors), lengths(tensors)
    pos = positions.numpy()
    out = np.empty(pos.size, _UNSIGNED[width])
    lk = like(width)
    runs = _k.segment_runs(bounds, threads())
    bad = [i for i in _parallel(runs, lambda s0, s1: int(_k.gather_items(lk, ptr, lens, pos, bounds, s0, s1, out)))
           if i >= 0]
    if bad:
        raise IndexError(f"gather: position {int(pos[min(bad)])} is outside its tensor")
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
    if len(srcs):
        copy_at(srcs[0].element_size(), pointers(srcs), pointers(dsts), lengths(srcs))


def copy_at(width: int, sources: np.ndarray, destinations: np.ndarray, counts: np.ndarray) -> None:
    """Copy ``counts[i]`` elements of ``width`` bytes from address ``sources[i]`` to ``destinations[i]`` for
    every ``i`` (int64 arrays; memory the caller keeps alive, ranges that do not overlap), on every kernel
    thread."""
    iseg, istart, istop, runs = _k.split_items(counts, threads(), MIN_CHUNK)
    lk = like(width)
    _parallel(runs, lambda i0, i1: _k.copy_items(lk, sources, destinations, iseg, istart, istop, i0, i1))


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
    pos, numels = positions.numpy(), np.ascontiguousarray(numels, dtype=np.int64)
    runs = _k.segment_runs(bounds, threads())
    bad = [b for b in _parallel(runs, lambda s0, s1: int(_k.check_segments(pos, bounds, numels, s0, s1))) if b >= 0]
    return min(bad) if bad else -1


def merge_staged(staged: tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray], positions: torch.Tensor,
                 bits: torch.Tensor, before: torch.Tensor, bounds: np.ndarray
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """Lay one delta (``bits`` at ``positions``, ``before``: the bits it replaces) over ``staged`` changes
    (positions, final bits, original bits, bounds), segment by segment: per segment the sorted union of
    positions, the delta's bits where it has the position else the staged ones, the staged originals where
    staged else ``before``; and the union's bounds. Positions must be strictly increasing per segment on both
    sides (the caller's contract). Two linear passes (:mod:`deltastore.kernels.merge`), on every kernel thread."""
    spos, sbits, sorig, sbounds = staged
    sbounds, bounds = np.ascontiguousarray(sbounds, np.int64), np.ascontiguousarray(bounds, np.int64)
    sp, pos = spos.contiguous().numpy(), positions.contiguous().numpy()
    n = bounds.size - 1
    counts = np.zeros(n, np.int64)
    runs = _k.segment_runs(sbounds + bounds, threads())
    _parallel(runs, lambda s0, s1: _m.union_counts(sp, sbounds, pos, bounds, s0, s1, counts))
    ubounds = _bounds_of(counts)
    size = int(ubounds[-1])
    sb, so, nb, bf = (unsigned(t.contiguous()) for t in (sbits, sorig, bits, before))
    upos, ubits, uorig = np.empty(size, np.int64), np.empty(size, sb.dtype), np.empty(size, sb.dtype)
    _parallel(runs, lambda s0, s1: _m.merge_segments(sp, sb, so, sbounds, pos, nb, bf, bounds, ubounds, s0, s1,
                                                     upos, ubits, uorig))
    return torch.from_numpy(upos), to_bits(ubits), to_bits(uorig), ubounds


def overlay_staged(staged: tuple[torch.Tensor, torch.Tensor, np.ndarray], positions: torch.Tensor,
                   bounds: np.ndarray, old: torch.Tensor) -> bool:
    """Write the staged bits into ``old`` (bits at ``positions``, laid out by ``bounds``) where a segment's
    position is staged (``staged``: positions, bits, bounds). False, with ``old`` partly done, when some
    segment's ``positions`` are not strictly increasing: the caller then searches another way."""
    spos, sbits, sbounds = staged
    sbounds, bounds = np.ascontiguousarray(sbounds, np.int64), np.ascontiguousarray(bounds, np.int64)
    sp, pos, sb, out = spos.contiguous().numpy(), positions.contiguous().numpy(), unsigned(sbits.contiguous()), \
        unsigned(old)
    runs = _k.segment_runs(sbounds + bounds, threads())
    return all(b < 0 for b in _parallel(runs, lambda s0, s1: int(_m.overlay_segments(sp, sb, sbounds, pos, bounds,
                                                                                    s0, s1, out))))


bounds_of = _bounds_of
