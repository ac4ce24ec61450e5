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
* :func:`sample_stream` — the changes whose position a sampled drift keeps (its Fibonacci hash), in one pass.
* :func:`drift_merge_rows` / :func:`drift_merge_rows_in_place` — a version's changes merged into the
  drift tracker's rows (:mod:`deltastore.publish.drift`), branch-free; :func:`merge_runs` cuts the rows into
  runs for several threads.

Callers validate addresses and sizes (the kernels trust them) and pass
unsigned bit arrays (``np.uint8/16/32/64``), so widening zero-extends as the
checksum requires. The kernels are compiled (``_diff.pyx``) and run without
the GIL; the item and run splitting below is Python.
"""

from __future__ import annotations

import numpy as np

from ._diff import (  # noqa: F401 - the kernels of this module
    all_zero, check_segments, compare_isa, compare_range, copy_items, diff_items, drift_merge_rows, drift_merge_rows_in_place, gather_items,
    mix_delta_segments, mix_full_items, sample_stream, scatter_items, take_stream, zero_flags)


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
