"""Which target memory a pull may write: the process's read-only mappings, from ``/proc/self/maps``.

A tensor over a read-only memory mapping (``numpy.memmap`` opened ``"r"`` and
wrapped by ``torch.from_numpy``, an ``mmap`` without ``PROT_WRITE``) cannot
say so through torch, and a write by address into it is a SIGSEGV that kills
the process. Linux lists every mapping with its permissions; a pull compares
its target's byte ranges with the read-only ones before writing anything
(:func:`deltastore.pull.checks.check_overlaps`). Elsewhere (no ``/proc``) nothing is
found and nothing refused.
"""

from __future__ import annotations

import re

import numpy as np

# a mapping line: "start-end perms ...", the second permission letter "-" when it is not writable
_READ_ONLY = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) .-", re.M)


def read_only_ranges() -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the process's mappings that cannot be written, ascending (empty without /proc)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read()
    except OSError:
        text = b""
    found = _READ_ONLY.findall(text)
    starts = np.fromiter((int(a, 16) for a, _ in found), dtype=np.uint64, count=len(found))
    ends = np.fromiter((int(b, 16) for _, b in found), dtype=np.uint64, count=len(found))
    return starts, ends


def in_read_only_memory(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Indices of the byte ranges ``[starts[i], starts[i] + sizes[i])`` (uint64, sizes > 0) that reach into a
    read-only mapping (one read of the mappings, then a vectorised search)."""
    if not starts.size:
        return np.empty(0, dtype=np.int64)
    lo, hi = read_only_ranges()
    if not lo.size:
        return np.empty(0, dtype=np.int64)
    # the first read-only mapping that ends after the range starts must start before the range ends
    k = np.searchsorted(hi, starts, side="right")
    inside = k < lo.size
    hit = np.zeros(starts.size, dtype=bool)
    hit[inside] = lo[k[inside]] < starts[inside] + sizes[inside]
    return np.flatnonzero(hit)
