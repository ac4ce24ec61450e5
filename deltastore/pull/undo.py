"""Undo journal: the old bits of target tensors, saved before an anchor overwrites them.

An anchor pull into a live target writes every tensor whole. To keep the
pull all-or-nothing without holding a second copy of the model in memory,
each tensor's old bits are saved just before its first write and put back if
the pull fails (a corrupt object met half-way, a checksum mismatch, a failed
write). Where they are saved:

* a tensor that holds only zeros (a freshly allocated target) costs nothing:
  the journal notes "zeros" and restores with ``zero_()``;
* otherwise in memory up to ``memory_bytes`` in all, then in an unnamed
  temporary file (``directory``, default the system temp dir), written
  straight from and read straight back into a CPU tensor's storage.

So an anchor pull into a live target costs, beyond the decode buffers, at
most ``memory_bytes`` of RAM and the target's size in temporary disk space
(page cache), never a second resident copy. A tensor is saved once per
journal however many parts are written into it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import IO

import numpy as np
import torch

from .._memory import c_library
from ..segments import copy_at, is_zero, lengths, pointers, zero_flags_at
from ..tensors import bits_dtype, bits_view, plain_cpu_groups

#: old bits kept in RAM before the journal spills to disk
DEFAULT_MEMORY_BYTES = 32 << 20
#: buffers handed to one ``writev`` call (the system's IOV_MAX; 16, the POSIX floor, where it is not known)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16


@functools.cache
def _libc_writev() -> ctypes._CFuncPtr | None:
    f = getattr(c_library(), "writev", None)
    if f is not None:
        f.argtypes, f.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_ssize_t
    return f


def _pick(items: Sequence[torch.Tensor], indices: Iterable[int]) -> list[torch.Tensor]:
    """``[items[i] for i in indices]`` by C-level calls."""
    return list(map(items.__getitem__, indices))


def _writev(fd: int, iov: np.ndarray) -> int:
    """``writev(fd, iov)`` for rows ``(address, length)`` of a C-contiguous uint64 array: bytes written
    (possibly fewer than asked); ``OSError`` with the system's errno. Where libc has no ``writev``,
    one ``os.write`` of the first buffer."""
    writev = _libc_writev()
    while True:
        if writev is None:
            addr, size = int(iov[0, 0]), int(iov[0, 1])
            return os.write(fd, (ctypes.c_char * size).from_address(addr))
        n = writev(fd, iov.ctypes.data, len(iov))
        if n >= 0:
            return int(n)
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, f"undo journal: {os.strerror(err)}")


class UndoJournal:
    """Old bits of the tensors written so far; :meth:`restore` puts them back, newest first."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, memory_bytes: int = DEFAULT_MEMORY_BYTES):
        self.directory = directory
        self.memory_bytes = memory_bytes
        self._in_memory = 0
        self._file: IO[bytes] | None = None
        self._offset = 0
        self._entries: list[tuple[torch.Tensor, str, object]] = []
        self._saved: set[tuple[int, int]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def save(self, flat: torch.Tensor) -> None:
        """Remember the current bits of ``flat`` (a contiguous target tensor, or a flat bit view of one), once."""
        key = (flat.data_ptr(), flat.numel())
        if key in self._saved or flat.numel() == 0:
            return
        self._saved.add(key)
        flat = bits_view(flat)
        if is_zero(flat):
            self._entries.append((flat, "zeros", None))
            return
        nbytes = flat.numel() * flat.element_size()
        if self._in_memory + nbytes <= self.memory_bytes:
            self._entries.append((flat, "copy", (flat.to("cpu", copy=True), 0)))
            self._in_memory += nbytes
            return
        host = (flat if flat.is_cpu else flat.cpu()).contiguous()
        self._write(pointers([host]), np.array([nbytes], np.int64))
        self._entries.append((flat, "file", (self._offset - nbytes, nbytes)))

    def save_many(self, flats: Sequence[torch.Tensor]) -> None:
        """:meth:`save` of each of ``flats``; the plain CPU ones of one element width are checked for
        zeros in one kernel pass, then packed into memory by one copy kernel or written to the file
        by a few ``writev`` calls (by address: no view per tensor), so a target's many small tensors
        cost their bytes, not their count."""
        groups, others = plain_cpu_groups(flats)
        for i in others:
            self.save(flats[i])
        saved, add = self._saved, self._saved.add
        for width, at in groups.items():
            group = _pick(flats, at)
            ptrs, lens = pointers(group), lengths(group)
            # the first of each (address, length) not saved yet; an empty tensor has nothing to save
            fresh = [i for i, key in enumerate(zip(ptrs.tolist(), lens.tolist()))
                     if key[1] and key not in saved and not add(key)]
            if not fresh:
                continue
            if len(fresh) < len(group):
                ptrs, lens, group = ptrs[fresh], lens[fresh], _pick(group, fresh)
            zero = zero_flags_at(width, ptrs, lens)
            self._entries.extend(zip(_pick(group, np.flatnonzero(zero).tolist()), repeat("zeros"), repeat(None)))
            kept = np.flatnonzero(~zero)
            if kept.size:
                self._pack(_pick(group, kept.tolist()), ptrs[kept], lens[kept], width)

    def _pack(self, flats: list[torch.Tensor], addresses: np.ndarray, sizes: np.ndarray, width: int) -> None:
        """Save ``flats`` (plain CPU, not saved yet, at ``addresses``, ``sizes`` elements of ``width`` bytes
        each): packed into one buffer while the memory budget lasts, then written to the file straight from
        where they lie."""
        ends = np.cumsum(sizes)
        room = max(0, self.memory_bytes - self._in_memory) // width
        n_mem = int(np.searchsorted(ends, room, side="right"))
        if n_mem:
            buf = torch.empty(int(ends[n_mem - 1]), dtype=bits_dtype(flats[0].dtype))
            starts = ends[:n_mem] - sizes[:n_mem]
            copy_at(width, addresses[:n_mem], buf.data_ptr() + starts * width, sizes[:n_mem])
            self._in_memory += buf.numel() * width
            self._entries.extend(zip(flats[:n_mem], repeat("copy"), zip(repeat(buf), starts.tolist())))
        if n_mem < len(flats):  # the rest straight from the tensors to the file: no staging copy
            rest, base = flats[n_mem:], int(ends[n_mem - 1]) if n_mem else 0
            at = self._offset
            self._write(addresses[n_mem:], sizes[n_mem:] * width)  # by address: no object per tensor
            offsets = ((ends[n_mem:] - sizes[n_mem:] - base) * width + at).tolist()
            self._entries.extend(zip(rest, repeat("file"), zip(offsets, (sizes[n_mem:] * width).tolist())))

    def _write(self, addresses: np.ndarray, nbytes: np.ndarray) -> None:
        """Append the bytes at ``addresses`` (``nbytes`` each, memory the caller keeps alive) to the file:
        one ``writev`` per ``_IOV_MAX`` buffers, short writes resumed where the kernel stopped."""
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.directory, prefix="deltastore-undo-", buffering=0)
        fd = self._file.fileno()
        iov = np.empty((len(addresses), 2), np.uint64)
        iov[:, 0], iov[:, 1] = addresses, nbytes
        iov = iov[iov[:, 1] > 0]
        i = 0
        while i < len(iov):
            chunk = iov[i:i + _IOV_MAX]
            n = _writev(fd, chunk)
            if n <= 0:
                raise OSError(errno.EIO, "undo journal: a write to its temporary file made no progress")
            self._offset += n
            ends = np.cumsum(chunk[:, 1])
            k = int(np.searchsorted(ends, n, side="right"))  # the buffers written whole
            if k < len(chunk):  # resume inside the buffer the kernel cut short
                done = n - (int(ends[k - 1]) if k else 0)
                chunk[k, 0] += np.uint64(done)
                chunk[k, 1] -= np.uint64(done)
            i += k

    def _read(self, offset: int, into: memoryview) -> None:
        """Fill ``into`` from the file at ``offset`` (the unbuffered file reads at most ~2 GiB a call)."""
        assert self._file is not None
        self._file.seek(offset)
        got = 0
        while got < into.nbytes:
            n = self._file.readinto(into[got:])
            if not n:
                raise OSError("undo journal is truncated")
            got += n

    def restore(self) -> int:
        """Put every saved tensor back (newest first); returns how many refused."""
        failed = 0
        with torch.no_grad():
            for flat, kind, where in reversed(self._entries):
                try:
                    flat = bits_view(flat)  # a tensor saved by save_many is the caller's, as it was given
                    if kind == "zeros":
                        flat.zero_()
                    elif kind == "copy":
                        buf, start = where
                        flat.copy_(buf[start:start + flat.numel()].to(flat.device))
                    else:
                        assert self._file is not None and isinstance(where, tuple)
                        offset, nbytes = where
                        buf = np.empty(nbytes, np.uint8)
                        self._read(offset, memoryview(buf))
                        flat.copy_(torch.from_numpy(buf).view(flat.dtype).to(flat.device))
                except Exception:  # noqa: BLE001 - counted; the caller reports the target as unknown
                    failed += 1
        return failed

    def close(self) -> None:
        """Forget everything (after success or restore); deletes the temporary file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._entries = []
        self._saved = set()
        self._in_memory = self._offset = 0

    def saving_ahead(self, groups: Sequence[Sequence[torch.Tensor]]) -> SaveAhead:
        """A :class:`SaveAhead` that saves ``groups`` into this journal, one after another, on a thread."""
        return SaveAhead(self, groups)

    def __enter__(self) -> UndoJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SaveAhead:
    """Saves groups of tensors into an :class:`UndoJournal` on a thread of its own, group after group
    (:meth:`UndoJournal.save_many` of each), so that saving the tensors of the next object a pull writes
    overlaps decoding the current one (``writev`` and the copy kernels run without the GIL).

    :meth:`wait` ``(k)`` returns once group ``k`` is saved, or raises what saving it raised; the caller
    writes into a group's tensors only after that. :meth:`close` stops after the group being saved and
    joins the thread; call it before :meth:`UndoJournal.restore`. While it runs, nothing else
    may save into the journal.
    """

    def __init__(self, journal: UndoJournal, groups: Sequence[Sequence[torch.Tensor]]):
        self._journal, self._groups = journal, groups
        self._saved = 0  # groups saved so far
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="deltastore-undo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for group in self._groups:
                if self._stop:
                    return
                self._journal.save_many(group)
                with self._cond:
                    self._saved += 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting pull by wait()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def wait(self, k: int) -> None:
        """Return once group ``k`` is saved; raise what saving it (or a group before it) raised."""
        with self._cond:
            while self._saved <= k and self._error is None:
                self._cond.wait()
            if self._saved <= k:
                assert self._error is not None
                raise self._error

    def close(self) -> None:
        """Save no further group; return once the thread has stopped."""
        self._stop = True
        self._thread.join()
