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

Callers pass int64 positions and unsigned bit arrays of one width, and validate bounds.
"""

from __future__ import annotations

from .jit import njit


@njit(nogil=True, cache=True)
def union_counts(spos, sbounds, pos, bounds, s0, s1, out):  # noqa: ANN001, ANN201
    """``out[s]`` = size of the union of segment ``s``'s staged and new positions, for ``s0 <= s < s1``."""
    for s in range(s0, s1):
        i, ie, j, je = sbounds[s], sbounds[s + 1], bounds[s], bounds[s + 1]
        n = 0
        while i < ie and j < je:
            a, c = spos[i], pos[j]
            if a <= c:
                i += 1
            if c <= a:
                j += 1
            n += 1
        out[s] = n + (ie - i) + (je - j)


@njit(nogil=True, cache=True)
def merge_segments(spos, sbits, sorig, sbounds, pos, bits, before, bounds, ubounds, s0, s1,  # noqa: ANN001, ANN201
                   upos, ubits, uorig):
    """Write segment ``s``'s union into ``u*[ubounds[s]:ubounds[s + 1]]`` for ``s0 <= s < s1``: positions in
    order; bits: the new ones where the delta has the position, else the staged ones; originals: the staged
    ones where staged, else ``before`` (the bits the delta replaced: the target's own there)."""
    for s in range(s0, s1):
        i, ie, j, je, k = sbounds[s], sbounds[s + 1], bounds[s], bounds[s + 1], ubounds[s]
        while i < ie and j < je:
            a, c = spos[i], pos[j]
            if a < c:
                upos[k], ubits[k], uorig[k] = a, sbits[i], sorig[i]
                i += 1
            elif c < a:
                upos[k], ubits[k], uorig[k] = c, bits[j], before[j]
                j += 1
            else:
                upos[k], ubits[k], uorig[k] = a, bits[j], sorig[i]
                i += 1
                j += 1
            k += 1
        while i < ie:
            upos[k], ubits[k], uorig[k] = spos[i], sbits[i], sorig[i]
            i += 1
            k += 1
        while j < je:
            upos[k], ubits[k], uorig[k] = pos[j], bits[j], before[j]
            j += 1
            k += 1


@njit(nogil=True, cache=True)
def overlay_segments(spos, sbits, sbounds, pos, bounds, s0, s1, old):  # noqa: ANN001, ANN201
    """``old[j] = staged bits`` where segment ``s``'s position ``pos[j]`` is staged, for ``s0 <= s < s1``.
    Returns the first segment whose positions are not strictly increasing (left partly done), or -1."""
    for s in range(s0, s1):
        i, ie, j, je = sbounds[s], sbounds[s + 1], bounds[s], bounds[s + 1]
        for q in range(j + 1, je):
            if pos[q] <= pos[q - 1]:
                return s
        while i < ie and j < je:
            a, c = spos[i], pos[j]
            if a < c:
                i += 1
            elif c < a:
                j += 1
            else:
                old[j] = sbits[i]
                i += 1
                j += 1
    return -1
