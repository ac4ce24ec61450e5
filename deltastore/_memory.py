"""Keep the process's resident memory close to what it really holds (glibc only).

glibc serves a large ``malloc`` by ``mmap`` (given back at ``free``) only
above its *mmap threshold*, and it raises that threshold to the size of every
large block freed, up to 32 MiB. After a few publishes or pulls, the
temporaries of encoding and decoding (megabytes each) then come from the heaps
of worker threads' arenas, and what is freed at the top of those heaps stays
mapped: ``malloc_trim`` does not shrink them. Measured on a 1 GB bf16 model
(``bench/NOTES.md``), that kept 0.25–0.3× the model resident after a few
dither steps, on top of the mirror.

:func:`pin_allocator` fixes the threshold at :data:`MMAP_THRESHOLD` (which
also stops the sliding), once per process, when the first publisher or
subscriber is made, unless the application chose for itself: one of
glibc's threshold variables (``MALLOC_MMAP_THRESHOLD_`` and kin) or a
``glibc.malloc`` entry of ``GLIBC_TUNABLES`` in the environment, or
``DELTASTORE_PIN_MALLOC=0``. The setting is process-wide; blocks above 1 MiB
then cost an ``mmap`` each (no slower in ``bench/scale.py``: the page faults
of fresh memory are paid either way).
:func:`release_memory` drops the caches registered with :func:`on_release` and
returns free pages after each big operation. Both are no-ops where glibc is not
the allocator. :func:`discard` gives back the
unused tail of a buffer that is kept for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

import numpy as np

#: glibc's mmap threshold as pinned by :func:`pin_allocator`, in bytes
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_TUNING_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_libc: ctypes.CDLL | None = None
_looked = False
_pinned: bool | None = None
_lock = threading.Lock()


def c_library() -> ctypes.CDLL | None:
    """The C library, loaded once (``errno`` kept for :func:`ctypes.get_errno`); None where it cannot be."""
    global _libc, _looked
    if not _looked:
        _looked = True
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = None
    return _libc


def _glibc(name: str, *argtypes: type) -> ctypes._CFuncPtr | None:
    """glibc's function ``name`` with its argument types, or None where the C library lacks it."""
    f = getattr(c_library(), name, None)
    if f is not None:
        f.argtypes = list(argtypes)
    return f


def pin_allocator() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` once per process (see the module docstring).

    Returns whether it is pinned now by this module; False when the
    environment opted out or chose its own malloc tuning, or glibc is not
    there. Never raises.
    """
    global _pinned
    with _lock:
        if _pinned is None:
            tunables = os.environ.get("GLIBC_TUNABLES", "")
            chosen = os.environ.get("DELTASTORE_PIN_MALLOC", "1") == "0" or "glibc.malloc." in tunables or \
                any(v in os.environ for v in _TUNING_VARIABLES)
            mallopt = None if chosen else _glibc("mallopt", ctypes.c_int, ctypes.c_int)
            _pinned = bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
        return _pinned


#: what release_memory drops first: caches kept for the duration of one operation (idle codec contexts)
_droppers: list = []


def on_release(drop) -> None:  # noqa: ANN001 - a callable of no arguments
    """Have :func:`release_memory` call ``drop()`` first (a module's cache that may be rebuilt)."""
    _droppers.append(drop)


def release_memory() -> None:
    """Drop the caches registered with :func:`on_release`, then ``malloc_trim(0)`` on glibc (nothing more
    elsewhere). The trim costs about a millisecond per GB of free heap."""
    for drop in _droppers:
        drop()
    trim = _glibc("malloc_trim", ctypes.c_size_t)
    if trim is not None:
        trim(0)


_MADV_DONTNEED = 4  # sys/mman.h (Linux)


def discard(a: np.ndarray, start: int, stop: int) -> None:
    """Give the whole pages of elements ``[start, stop)`` of the contiguous array ``a`` back to the system.

    Their contents are lost (a later read sees zeros); the array stays valid and a later write
    faults a fresh page in. For the unused tail of a buffer kept for reuse. A no-op for less than
    a megabyte, off Linux, or where ``madvise`` is missing.
    """
    stop = min(stop, a.size)
    if stop - start <= 0 or not a.flags.c_contiguous or (stop - start) * a.itemsize < 1 << 20:
        return
    madvise = _glibc("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if madvise is None or not os.uname().sysname == "Linux":
        return
    page = mmap.PAGESIZE
    lo = -(-(a.ctypes.data + start * a.itemsize) // page) * page
    hi = (a.ctypes.data + stop * a.itemsize) // page * page
    if hi > lo:
        madvise(lo, hi - lo, _MADV_DONTNEED)
