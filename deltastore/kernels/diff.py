"""Kernels of the publish and pull paths: fused compare, gather, scatter and checksum over many tensors.

The tensors a kernel reads are given by address (``int64`` arrays of data
pointers, one per *segment* = tensor), so one call covers any number of
tensors without concatenating them and without a per-tensor Python call.
Work is described as *items*: ``(segment, start, stop)`` element ranges, a
big tensor cut into several items, many small tensors one item each; a thread
takes a contiguous run of items (:func:`split_items`).

* :func:`diff_items` — compare a mirror against new bits and, in the same
  pass, gather the changed elements' positions, new and old bits and add up
  each item's checksum delta (``sum mix(new) - sum mix(old)``, the
  :mod:`deltastore.checksum` formula through its own kernel). Narrow
  elements are compared 8 bytes at a time where both addresses allow it.
* :func:`gather_items` / :func:`scatter_items` — read or write bits at
  per-segment positions.
* :func:`mix_delta_segments` — the checksum delta of given changes, per segment;
  :func:`mix_full_items` — whole-tensor checksums.
* :func:`check_segments` — positions strictly increasing and in range, per segment.
* :func:`take_stream` — chosen segments of a stream held in parts, in any order, back to back
  (a reorder or a subset with no index array).
* :func:`drift_merge_rows` / :func:`drift_merge_rows_in_place` — a version's changes merged into the
  drift tracker's rows (:mod:`deltastore.drift`), branch-free; :func:`merge_runs` cuts the rows into
  runs for several threads.

Callers validate addresses and sizes (the kernels trust them) and pass
unsigned bit arrays (``np.uint8/16/32/64``), so widening zero-extends as the
checksum requires.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .checksum import mix_sum_dense, mix_sum_sparse
from .jit import njit


@intrinsic
def _voidptr(typingctx, addr):  # noqa: ANN001, ANN202 - numba intrinsic
    """An integer address as a ``void*`` (for ``numba.carray``)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(addr), codegen


@intrinsic
def _prefetch_for_write(typingctx, addr):  # noqa: ANN001, ANN202 - numba intrinsic
    """A hint to fetch the cache line at an integer address for writing (``llvm.prefetch``; never faults)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # (address, write, high temporal locality, data cache)
        builder.call(fn, [builder.inttoptr(args[0], cgutils.voidptr_t), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(addr), codegen


@njit(nogil=True, cache=True, inline="always")
def _at(addr, n, like):  # noqa: ANN001, ANN202
    return numba.carray(_voidptr(addr), (n,), like.dtype)


@njit(nogil=True, cache=True, inline="always")
def _at64(addr, n):  # noqa: ANN001, ANN202
    return numba.carray(_voidptr(addr), (n,), np.uint64)


@njit(nogil=True, cache=True)
def diff_items(like, optr, nptr, lens, keys, iseg, istart, istop, i0, i1, e_resume, pos, new, old, counts, sums):
    """Compare items ``i0 .. i1 - 1`` (the first from element ``e_resume``, if above its start).

    Segment ``s``: ``lens[s]`` elements at ``optr[s]`` (old) and ``nptr[s]``
    (new), of ``like``'s unsigned dtype; ``keys[s]`` its checksum key. Writes
    the changed elements' local positions, new and old bits into ``pos``,
    ``new``, ``old`` from index 0, adds each item's count to ``counts[i]`` and
    its checksum delta to ``sums[i]``. Stops early (at a word boundary) when the
    buffers could overflow. Returns ``(written, next item, next element)``:
    ``next item == i1`` when every item is done.
    """
    width = like.itemsize
    k = 8 // width
    cap = pos.size
    c = 0
    for i in range(i0, i1):
        s = iseg[i]
        a = istart[i]
        if i == i0 and e_resume > a:
            a = e_resume
        b = istop[i]
        o = _at(optr[s], lens[s], like)
        n = _at(nptr[s], lens[s], like)
        c0 = c
        j = a
        if k > 1 and (optr[s] - nptr[s]) % 8 == 0:
            while j < b and (optr[s] + j * width) % 8 != 0:  # head up to an 8-byte boundary
                if c == cap:
                    break
                if o[j] != n[j]:
                    pos[c] = j
                    new[c] = n[j]
                    old[c] = o[j]
                    c += 1
                j += 1
            nw = (b - j) // k
            if nw > 0 and c + k <= cap:
                ow = _at64(optr[s] + j * width, nw)
                vw = _at64(nptr[s] + j * width, nw)
                w = 0
                while w < nw:
                    if ow[w] != vw[w]:
                        if c + k > cap:
                            break
                        e = j + w * k
                        for q in range(e, e + k):  # branch-free: store always, advance on a change
                            pos[c] = q
                            new[c] = n[q]
                            old[c] = o[q]
                            c += o[q] != n[q]
                    w += 1
                j += w * k
        while j < b:  # tail (or everything, when the addresses do not allow words)
            if c == cap:
                break
            if o[j] != n[j]:
                pos[c] = j
                new[c] = n[j]
                old[c] = o[j]
                c += 1
            j += 1
        if c > c0:
            counts[i] += c - c0
            sums[i] += mix_sum_sparse(pos, new, c0, c, keys[s]) - mix_sum_sparse(pos, old, c0, c, keys[s])
        if j < b:
            return c, i, j
    return c, i1, 0


@njit(nogil=True, cache=True)
def gather_items(like, ptr, lens, pos, bounds, s0, s1, out):
    """``out[i] = segment s's bits at pos[i]`` for ``i`` in ``bounds[s] .. bounds[s + 1]``, segments ``s0 .. s1 - 1``.

    Returns -1, or the first ``i`` whose position lies outside its segment (nothing is read there: a
    caller's bad position costs a compare, never a read out of bounds)."""
    for s in range(s0, s1):
        n = lens[s]
        a = _at(ptr[s], n, like)
        for i in range(bounds[s], bounds[s + 1]):
            p = pos[i]
            if p < 0 or p >= n:
                return i
            out[i] = a[p]
    return -1


_SCATTER_AHEAD = 32


@njit(nogil=True, cache=True)
def scatter_items(like, ptr, lens, pos, bounds, s0, s1, vals):
    """``segment s's bits at pos[i] = vals[i]`` for ``i`` in ``bounds[s] .. bounds[s + 1]``, segments ``s0 .. s1 - 1``."""
    width = like.itemsize
    for s in range(s0, s1):
        a = _at(ptr[s], lens[s], like)
        end = bounds[s + 1]
        for i in range(bounds[s], end):
            # Sparse positions defeat the hardware prefetcher, and each store waits for its line:
            # asking for the line _SCATTER_AHEAD items ahead cuts a real dither step's write by a
            # fifth (bench/kernels.py); a gather gains nothing from it (its loads already overlap).
            if i + _SCATTER_AHEAD < end:
                _prefetch_for_write(ptr[s] + pos[i + _SCATTER_AHEAD] * width)
            a[pos[i]] = vals[i]
    return 0


@njit(nogil=True, cache=True)
def take_stream(like, ptrs, lens, starts, bounds, idx, home, out):
    """``out`` = segments ``idx[0], idx[1], ...`` (any order) of a stream held in parts, back to back.

    Part ``k``: ``lens[k]`` elements at address ``ptrs[k]``, the stream's elements from ``starts[k]``;
    segment ``s`` is stream elements ``bounds[s] .. bounds[s + 1]``, beginning in part ``home[j]`` for
    ``s = idx[j]`` (it may continue into the next parts). Returns the elements written. Callers size
    ``out`` and keep every index in range."""
    o = 0
    for j in range(idx.size):
        a, b, k = bounds[idx[j]], bounds[idx[j] + 1], home[j]
        while a < b:
            src = _at(ptrs[k], lens[k], like)
            e = min(b, starts[k] + lens[k])
            for x in range(a - starts[k], e - starts[k]):
                out[o] = src[x]
                o += 1
            a = e
            k += 1
    return o


@njit(nogil=True, cache=True)
def copy_items(like, src, dst, iseg, istart, istop, i0, i1):
    """Copy elements ``[istart[i], istop[i])`` of segment ``iseg[i]`` from ``src`` to ``dst`` addresses."""
    for i in range(i0, i1):
        s = iseg[i]
        n = istop[i]
        a = _at(src[s], n, like)
        b = _at(dst[s], n, like)
        for j in range(istart[i], n):
            b[j] = a[j]
    return 0


@njit(nogil=True, cache=True)
def mix_full_items(like, ptr, lens, keys, iseg, istart, istop, i0, i1, out):
    """``out[i] = sum mix(key, p, bits[p])`` over elements ``[istart[i], istop[i])`` of segment ``iseg[i]``."""
    for i in range(i0, i1):
        s = iseg[i]
        out[i] = mix_sum_dense(_at(ptr[s], lens[s], like), istart[i], istop[i], keys[s])
    return 0


@njit(nogil=True, cache=True)
def mix_delta_segments(pos, old, new, bounds, keys, s0, s1, out):
    """``out[s] = sum mix(key_s, p, new) - sum mix(key_s, p, old)`` over segment ``s``'s changes (mod 2**64)."""
    for s in range(s0, s1):
        a = bounds[s]
        b = bounds[s + 1]
        if b > a:
            out[s] = mix_sum_sparse(pos, new, a, b, keys[s]) - mix_sum_sparse(pos, old, a, b, keys[s])
    return 0


@njit(nogil=True, cache=True)
def check_segments(pos, bounds, numels, s0, s1):
    """The first of segments ``s0 .. s1 - 1`` whose positions are not strictly increasing in ``[0, numel)``,
    or -1."""
    for s in range(s0, s1):
        last = -1
        n = numels[s]
        for i in range(bounds[s], bounds[s + 1]):
            p = pos[i]
            if p <= last or p >= n:
                return s
            last = p
    return -1


@njit(nogil=True, cache=True)
def all_zero(like, ptr, n):
    """Whether the ``n`` elements at ``ptr`` are all zero (8 bytes at a time where aligned)."""
    a = _at(ptr, n, like)
    width = like.itemsize
    j = 0
    while j < n and (ptr + j * width) % 8 != 0:
        if a[j] != 0:
            return False
        j += 1
    k = 8 // width
    nw = (n - j) // k if k > 0 else 0
    if nw > 0:
        w = _at64(ptr + j * width, nw)
        acc = np.uint64(0)
        for i in range(nw):
            acc |= w[i]
            if (i & 4095) == 4095 and acc != 0:
                return False
        if acc != 0:
            return False
        j += nw * k
    while j < n:
        if a[j] != 0:
            return False
        j += 1
    return True


@njit(nogil=True, cache=True)
def zero_flags(like, ptrs, lens, out):
    """``out[i]`` = whether the ``lens[i]`` elements at ``ptrs[i]`` are all zero."""
    for i in range(ptrs.size):
        out[i] = all_zero(like, ptrs[i], lens[i])


@njit(nogil=True, cache=True, inline="always")
def _merge_up(p_pos, p_anchor, i, n_p, cp, co, cn, j, j1, out_pos, out_anchor, c, write):
    """Changes ``j .. j1 - 1`` of one part merged with the row's previous elements from ``i`` (below ``n_p``)
    that lie below them; returns the new ``(i, c)``. Each step emits one element (a previous one below
    the change, or the change itself, dropped when it is back at the anchor's bits) without a branch on
    the data: the comparisons select what is written and advance the indices. The element is written at
    ``out[c]`` even when dropped (``c`` does not move): that slot is free."""
    while j < j1:
        if i >= n_p:  # the row's previous elements are used up: the rest are first changes
            for jj in range(j, j1):
                if write:
                    out_pos[c] = cp[jj]
                    out_anchor[c] = co[jj]
                c += 1
            return i, c
        a = np.int64(p_pos[i])
        x = cp[j]
        anc = p_anchor[i]
        lt = np.int64(a < x)
        le = np.int64(a <= x)
        keep = np.int64(a != x) | np.int64(anc != cn[j])
        if write:
            out_pos[c] = a if lt else x
            out_anchor[c] = anc if le else co[j]
        c += keep
        i += le
        j += 1 - lt
    return i, c


@njit(nogil=True, cache=True)
def drift_merge_rows(like, lpos, p_bounds, p_pos, p_anchor, c_bounds, c_pos_at, c_old_at, c_new_at, c_lens,
                     out_bounds, out_pos, out_anchor, write, k0, k1, q0, base0, c0):
    """Merge one version's changes into the positions that differ from the anchor, rows ``k0 .. k1 - 1``.

    Rows are tensors; within a row positions are sorted. Row ``k`` of the previous table is
    ``p_pos/p_anchor[p_bounds[k]:p_bounds[k + 1]]``; of the version's changes, elements
    ``c_bounds[k]:c_bounds[k + 1]`` of a stream held in parts (the compare's buffers, never joined):
    part ``q`` is ``c_lens[q]`` int64 positions (``lpos``'s dtype) and old and new bits (``like``'s
    dtype, the table's) at the addresses ``c_pos_at/c_old_at/c_new_at[q]``, back to back in stream
    order; part ``q0``, whose first element is element ``base0`` of the stream, holds (or comes
    before the part holding) row ``k0``'s first change. Both tables have the same rows. Writes the
    merged rows to ``out_*`` from element ``c0`` on (``out_bounds``: same length as the inputs', its
    entries ``k0 .. k1``) and returns how many elements they hold; with ``write`` false, only counts
    (the ``out_*`` arrays are not touched). An element that changes back to the anchor's bits leaves
    the set. Disjoint row ranges can run on several threads at once.
    """
    c = c0
    q = q0
    base = base0  # stream index of part q's first element
    if write:
        out_bounds[k0] = c0
    for k in range(k0, k1):
        i, n_p = p_bounds[k], p_bounds[k + 1]
        j, j_end = c_bounds[k], c_bounds[k + 1]
        while j < j_end:  # the row's changes, a part at a time
            while j - base >= c_lens[q]:
                base += c_lens[q]
                q += 1
            stop = min(j_end, base + c_lens[q])
            cp, co, cn = _at(c_pos_at[q], c_lens[q], lpos), _at(c_old_at[q], c_lens[q], like), \
                _at(c_new_at[q], c_lens[q], like)
            i, c = _merge_up(p_pos, p_anchor, i, n_p, cp, co, cn, j - base, stop - base, out_pos, out_anchor,
                             c, write)
            j = stop
        if write:
            for e in range(n_p - i):
                out_pos[c + e] = p_pos[i + e]
                out_anchor[c + e] = p_anchor[i + e]
        c += n_p - i
        if write:
            out_bounds[k + 1] = c
    return c - c0


def merge_runs(p_bounds: np.ndarray, c_bounds: np.ndarray, c_lens: np.ndarray, pieces: int,
               min_work: int = 1 << 18) -> list[tuple[int, int, int, int]]:
    """Row ranges of about equal work (previous elements plus changes) for :func:`drift_merge_rows` on
    ``pieces`` threads: ``(k0, k1, q0, base0)`` each, in row order, covering every row."""
    rows = p_bounds.size - 1
    work = p_bounds + c_bounds  # cumulative, per row boundary
    total = int(work[-1])
    pieces = max(1, min(pieces, rows, total // max(1, min_work)))
    cuts = np.unique(np.concatenate([[0], np.searchsorted(work, np.arange(1, pieces) * (total / pieces)), [rows]]))
    starts = np.zeros(c_lens.size, np.int64)
    np.cumsum(c_lens[:-1], out=starts[1:])
    out = []
    for k0, k1 in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        q0 = max(0, int(np.searchsorted(starts, c_bounds[k0], side="right")) - 1)
        out.append((k0, k1, q0, int(starts[q0])))
    return out


@njit(nogil=True, cache=True, inline="always")
def _merge_down(pos, anchor, i, i0, cp, co, cn, j, j0, w):
    """:func:`_merge_up` from the top: changes ``j`` down to ``j0`` of one part merged with the row's
    previous elements from ``i`` down to ``i0`` that lie above them, written downwards below ``w``;
    returns the new ``(i, w)``. The slot ``w - 1`` is always above ``i`` (the room left above the
    previous table is at least the changes still to merge), so it is written even for a dropped element."""
    while j >= j0:
        if i < i0:  # the row's previous elements are used up: the rest are first changes
            for jj in range(j, j0 - 1, -1):
                w -= 1
                pos[w] = cp[jj]
                anchor[w] = co[jj]
            return i, w
        a = np.int64(pos[i])
        x = cp[j]
        anc = anchor[i]
        gt = np.int64(a > x)
        ge = np.int64(a >= x)
        keep = np.int64(a != x) | np.int64(anc != cn[j])
        pos[w - 1] = a if gt else x
        anchor[w - 1] = anc if ge else co[j]
        w -= keep
        i -= ge
        j -= 1 - gt
    return i, w


@njit(nogil=True, cache=True)
def drift_merge_rows_in_place(like, lpos, p_bounds, pos, anchor, c_bounds, c_pos_at, c_old_at, c_new_at, c_lens,
                              out_bounds):
    """:func:`drift_merge_rows` (writing) with the merged table written over the previous one.

    ``pos`` / ``anchor`` hold the previous table in ``[0, p_bounds[-1])`` and have room for
    ``p_bounds[-1] + c_bounds[-1]`` elements. Rows are merged from the last element back to the
    first into the end of that room (a write never lands on an element not yet read), then moved
    to the front. Returns the merged count; ``out_bounds`` gets its row bounds.
    """
    nrows = p_bounds.size - 1
    end = p_bounds[nrows] + c_bounds[nrows]
    w = end  # the next element is written at w - 1
    q = c_lens.size - 1
    base = c_bounds[nrows] - c_lens[q]  # stream index of part q's first element
    for k in range(nrows - 1, -1, -1):
        out_bounds[k + 1] = w
        i, i0 = p_bounds[k + 1] - 1, p_bounds[k]
        j, j_start = c_bounds[k + 1] - 1, c_bounds[k]
        while j >= j_start:  # the row's changes, a part at a time, from the last
            while j < base:
                q -= 1
                base -= c_lens[q]
            first = max(j_start, base)
            cp, co, cn = _at(c_pos_at[q], c_lens[q], lpos), _at(c_old_at[q], c_lens[q], like), \
                _at(c_new_at[q], c_lens[q], like)
            i, w = _merge_down(pos, anchor, i, i0, cp, co, cn, j - base, first - base, w)
            j = first - 1
        while i >= i0:
            w -= 1
            pos[w] = pos[i]
            anchor[w] = anchor[i]
            i -= 1
    out_bounds[0] = w
    used = end - w
    for e in range(used):  # to the front (forward: the source lies after the destination)
        pos[e] = pos[w + e]
        anchor[e] = anchor[w + e]
    for k in range(nrows + 1):
        out_bounds[k] -= w
    return used


def split_items(lens: np.ndarray, pieces: int, min_chunk: int = 1 << 18
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Items covering every segment (big segments cut to about ``total / pieces``) and per-thread item runs.

    Returns ``(iseg, istart, istop, runs)``; ``runs`` is a list of ``(i0, i1)``
    contiguous item ranges of about equal element counts (one per thread).
    Zero-length segments get no item.
    """
    lens = lens.astype(np.int64, copy=False)
    total = int(lens.sum())
    if total == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, []
    pieces = max(1, min(pieces, total // max(1, min_chunk)))
    piece = -(-total // pieces)
    nsplit = np.where(lens > 0, -(-lens // piece), 0)
    iseg = np.repeat(np.arange(lens.size, dtype=np.int64), nsplit)
    first = np.repeat(np.cumsum(nsplit) - nsplit, nsplit)
    istart = (np.arange(iseg.size, dtype=np.int64) - first) * piece
    istop = np.minimum(istart + piece, lens[iseg])
    if pieces == 1:
        return iseg, istart, istop, [(0, int(iseg.size))]
    ends = np.cumsum(istop - istart)
    cuts = np.searchsorted(ends, np.arange(1, pieces, dtype=np.int64) * piece, side="left") + 1
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < iseg.size)), int(iseg.size)]
    return iseg, istart, istop, [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def segment_runs(bounds: np.ndarray, pieces: int, min_chunk: int = 1 << 16) -> list[tuple[int, int]]:
    """Contiguous segment ranges of about equal element counts (``bounds``: cumulative, length segments + 1)."""
    nseg = bounds.size - 1
    total = int(bounds[-1]) if nseg > 0 else 0
    pieces = max(1, min(pieces, total // max(1, min_chunk), nseg))
    if pieces <= 1:
        return [(0, nseg)] if nseg > 0 else []
    cuts = np.searchsorted(bounds, np.arange(1, pieces, dtype=np.int64) * (total // pieces), side="left")
    edges = [0, *sorted(set(int(c) for c in cuts if 0 < c < nseg)), nseg]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
