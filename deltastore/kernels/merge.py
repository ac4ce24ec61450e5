"""Kernels that lay one delta over the changes already staged, tensor by tensor, in one linear pass.

A pull of several deltas at once keeps, per tensor, the sorted positions it
has staged with their final bits and the target's original bits. Each later
delta's positions (sorted per tensor: decoders validate that) are laid over
them by a two-pointer walk per *segment* (= tensor): no sort, no binary
search, no call per tensor. Segments are described by bounds arrays
(``bounds[s]:bounds[s + 1]`` of each flat array), the staged ones and the
delta's side by side; a thread takes a contiguous run of segments.

* :func:`union_counts` — per segment, the size of the union of both position lists;
* :func:`merge_segments` — the union itself: positions, bits (the delta's win) and originals
  (the staged ones where staged, else the bits the delta replaced);
* :func:`overlay_segments` — the staged bits laid over bits read from the target at the
  delta's positions (what the tensors hold "as of the staged deltas"); it reports a segment whose
  positions are not increasing, so the caller can fall back to a general search.

Callers pass int64 positions and unsigned bit arrays of one width, and validate bounds. The kernels are
compiled (``_merge.pyx``) and run without the GIL.
"""

from __future__ import annotations

from ._merge import merge_segments, overlay_segments, union_counts

__all__ = ["merge_segments", "overlay_segments", "union_counts"]
