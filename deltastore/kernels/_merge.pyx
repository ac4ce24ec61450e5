# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled loops of :mod:`deltastore.kernels.merge` (that module states what each computes)."""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from ._arrays cimport ANY, SIGNED, arr, bits_t

cnp.import_array()


def union_counts(spos, sbounds, pos, bounds, int64_t s0, int64_t s1, out):
    """``out[s]`` = size of the union of segment ``s``'s staged and new positions, for ``s0 <= s < s1``."""
    cdef const int64_t* sp = <const int64_t*>arr(spos, 8, SIGNED, False, "spos")
    cdef const int64_t* sb = <const int64_t*>arr(sbounds, 8, SIGNED, False, "sbounds")
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef int64_t* po = <int64_t*>arr(out, 8, SIGNED, True, "out")
    cdef int64_t s, i, ie, j, je, n, a, c
    with nogil:
        for s in range(s0, s1):
            i = sb[s]
            ie = sb[s + 1]
            j = pb[s]
            je = pb[s + 1]
            n = 0
            while i < ie and j < je:  # branch-free: the comparisons advance the indices
                a = sp[i]
                c = pp[j]
                i += a <= c
                j += c <= a
                n += 1
            po[s] = n + (ie - i) + (je - j)


cdef void _merge_segments(const int64_t* spos, const bits_t* sbits, const bits_t* sorig, const int64_t* sbounds,
                          const int64_t* pos, const bits_t* bits, const bits_t* before, const int64_t* bounds,
                          const int64_t* ubounds, int64_t s0, int64_t s1, int64_t* upos, bits_t* ubits,
                          bits_t* uorig) noexcept nogil:
    cdef int64_t s, i, ie, j, je, k, a, c
    cdef bits_t sb, so, nb, bf
    for s in range(s0, s1):
        i = sbounds[s]
        ie = sbounds[s + 1]
        j = bounds[s]
        je = bounds[s + 1]
        k = ubounds[s]
        while i < ie and j < je:
            # branch-free (positions in random order defeat a predictor): a staged position below the delta's
            # takes the staged bits and original; a delta position below the staged one its bits and the bits
            # it replaced; one in both the delta's bits and the staged original
            a = spos[i]
            c = pos[j]
            sb = sbits[i]
            so = sorig[i]
            nb = bits[j]
            bf = before[j]
            upos[k] = a if a < c else c
            ubits[k] = sb if a < c else nb
            uorig[k] = bf if c < a else so
            i += a <= c
            j += c <= a
            k += 1
        while i < ie:
            upos[k] = spos[i]
            ubits[k] = sbits[i]
            uorig[k] = sorig[i]
            i += 1
            k += 1
        while j < je:
            upos[k] = pos[j]
            ubits[k] = bits[j]
            uorig[k] = before[j]
            j += 1
            k += 1


def merge_segments(spos, sbits, sorig, sbounds, pos, bits, before, bounds, ubounds, int64_t s0, int64_t s1, upos,
                   ubits, uorig):
    """Write segment ``s``'s union into ``u*[ubounds[s]:ubounds[s + 1]]`` for ``s0 <= s < s1``: positions in
    order; bits: the new ones where the delta has the position, else the staged ones; originals: the staged
    ones where staged, else ``before`` (the bits the delta replaced: the target's own there)."""
    cdef int w = sbits.itemsize if isinstance(sbits, cnp.ndarray) else 0
    cdef const int64_t* sp = <const int64_t*>arr(spos, 8, SIGNED, False, "spos")
    cdef const char* sbt = arr(sbits, w, ANY, False, "sbits")
    cdef const char* sor = arr(sorig, w, ANY, False, "sorig")
    cdef const int64_t* sb = <const int64_t*>arr(sbounds, 8, SIGNED, False, "sbounds")
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef const char* bt = arr(bits, w, ANY, False, "bits")
    cdef const char* bf = arr(before, w, ANY, False, "before")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef const int64_t* ub = <const int64_t*>arr(ubounds, 8, SIGNED, False, "ubounds")
    cdef int64_t* up = <int64_t*>arr(upos, 8, SIGNED, True, "upos")
    cdef char* ubt = arr(ubits, w, ANY, True, "ubits")
    cdef char* uor = arr(uorig, w, ANY, True, "uorig")
    with nogil:
        if w == 1:
            _merge_segments(sp, <const uint8_t*>sbt, <const uint8_t*>sor, sb, pp, <const uint8_t*>bt,
                            <const uint8_t*>bf, pb, ub, s0, s1, up, <uint8_t*>ubt, <uint8_t*>uor)
        elif w == 2:
            _merge_segments(sp, <const uint16_t*>sbt, <const uint16_t*>sor, sb, pp, <const uint16_t*>bt,
                            <const uint16_t*>bf, pb, ub, s0, s1, up, <uint16_t*>ubt, <uint16_t*>uor)
        elif w == 4:
            _merge_segments(sp, <const uint32_t*>sbt, <const uint32_t*>sor, sb, pp, <const uint32_t*>bt,
                            <const uint32_t*>bf, pb, ub, s0, s1, up, <uint32_t*>ubt, <uint32_t*>uor)
        else:
            _merge_segments(sp, <const uint64_t*>sbt, <const uint64_t*>sor, sb, pp, <const uint64_t*>bt,
                            <const uint64_t*>bf, pb, ub, s0, s1, up, <uint64_t*>ubt, <uint64_t*>uor)


cdef int64_t _overlay_segments(const int64_t* spos, const bits_t* sbits, const int64_t* sbounds,
                               const int64_t* pos, const int64_t* bounds, int64_t s0, int64_t s1,
                               bits_t* old) noexcept nogil:
    cdef int64_t s, i, ie, j, je, q, a, c
    for s in range(s0, s1):
        i = sbounds[s]
        ie = sbounds[s + 1]
        j = bounds[s]
        je = bounds[s + 1]
        for q in range(j + 1, je):
            if pos[q] <= pos[q - 1]:
                return s
        while i < ie and j < je:  # branch-free: the slot is written back as it was unless staged there
            a = spos[i]
            c = pos[j]
            old[j] = sbits[i] if a == c else old[j]
            i += a <= c
            j += c <= a
    return -1


def overlay_segments(spos, sbits, sbounds, pos, bounds, int64_t s0, int64_t s1, old):
    """``old[j] = staged bits`` where segment ``s``'s position ``pos[j]`` is staged, for ``s0 <= s < s1``.
    Returns the first segment whose positions are not strictly increasing (left partly done), or -1."""
    cdef int w = sbits.itemsize if isinstance(sbits, cnp.ndarray) else 0
    cdef const int64_t* sp = <const int64_t*>arr(spos, 8, SIGNED, False, "spos")
    cdef const char* sbt = arr(sbits, w, ANY, False, "sbits")
    cdef const int64_t* sb = <const int64_t*>arr(sbounds, 8, SIGNED, False, "sbounds")
    cdef const int64_t* pp = <const int64_t*>arr(pos, 8, SIGNED, False, "pos")
    cdef const int64_t* pb = <const int64_t*>arr(bounds, 8, SIGNED, False, "bounds")
    cdef char* po = arr(old, w, ANY, True, "old")
    cdef int64_t r
    with nogil:
        if w == 1:
            r = _overlay_segments(sp, <const uint8_t*>sbt, sb, pp, pb, s0, s1, <uint8_t*>po)
        elif w == 2:
            r = _overlay_segments(sp, <const uint16_t*>sbt, sb, pp, pb, s0, s1, <uint16_t*>po)
        elif w == 4:
            r = _overlay_segments(sp, <const uint32_t*>sbt, sb, pp, pb, s0, s1, <uint32_t*>po)
        else:
            r = _overlay_segments(sp, <const uint64_t*>sbt, sb, pp, pb, s0, s1, <uint64_t*>po)
    return r
