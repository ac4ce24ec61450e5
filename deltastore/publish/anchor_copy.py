"""A local copy of the last anchor's bits, so that a differential never reads the anchor back from the store.

A differential (anchor -> now, ``docs/anchors.md``) needs the anchor's bits
wherever the model drifted from it. Within its memory budget the drift
tracker holds them; past it (any model above a few tens of millions of
elements, a few steps after an anchor) it holds a sample, and the
differential is rebuilt by comparing the whole anchor with the mirror.
Without a copy (the default) the anchor is streamed back from the store for
that: every full object downloaded, sha256-checked and decoded, once per
version that carries a differential.

With ``Publisher(anchor_copy_dir=DIR)`` the publisher writes the anchor's
bits into one file in ``DIR`` when the anchor commits (the mirror's flat
buffers, written as they are: the model's bytes, sequentially, on a thread
of its own that the publisher waits for before the mirror next changes: its
next ``publish()``, or in background mode the writer's next version), and a
differential compares the mirror with that file instead, read back a
bounded chunk at a time: a local read at disk or page-cache speed, nothing
from the store, nothing to decode. Each chunk's tensors are checked against
the anchor's checksums before they are compared.

Contract: :meth:`AnchorCopy.write`, :meth:`AnchorCopy.settle` and
:meth:`AnchorCopy.differential` never raise for the copy's own trouble. A
copy that cannot be written (a full or read-only disk; its note comes from
:meth:`AnchorCopy.take_note`), that was changed or truncated on disk, or that
no longer matches the mirror's layout is removed, and the caller gets a note
(a warning for a version's ``warnings``): the differential then comes from
the store, as without a copy. Only a host (CPU) mirror gets a
copy. The file is replaced at the next anchor and removed by
:meth:`AnchorCopy.drop` (``Publisher.close``), or at the latest when the
interpreter exits; only a process killed (a signal, ``os._exit``) leaves it
behind (its name starts with ``deltastore-anchor-``).
"""

from __future__ import annotations

import os
import threading
import uuid
import weakref
from pathlib import Path

import numpy as np
import torch

from .. import segments
from ..checksum import tensor_keys
from ..segments import Change
from ..store import VersionRef
from .mirror import Mirror

#: bytes read back per chunk (a tensor larger than this is read whole, alone)
CHUNK_BYTES = 64 << 20


class _Damaged(Exception):
    """The copy on disk does not hold what was written (or no longer fits the mirror)."""


class AnchorCopy:
    """The anchor's bits in a file of ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self.path: Path | None = None
        self.anchor: VersionRef | None = None
        #: element width -> [(name, byte offset in the file, numel)], in file order
        self._layout: dict[int, list[tuple[str, int, int]]] = {}
        self._checksums: dict[str, int] = {}
        self._writing: threading.Thread | None = None
        self._note: str | None = None
        # files this copy made, removed at the latest when it is collected or the interpreter exits (a script
        # that never closes its Publisher must not leave a model-sized file behind at every run)
        self._made: set[Path] = set()
        weakref.finalize(self, _unlink_all, self._made)

    def write(self, mirror: Mirror, anchor: VersionRef, checksums: dict[str, int]) -> None:
        """Replace the copy with ``mirror``'s bits, which must be those of ``anchor`` (every tensor's checksum
        in ``checksums``), on a thread of its own: the mirror must not change until :meth:`settle` returned
        (the publisher settles before its next compare or write). A host mirror only."""
        self.drop()
        if mirror.device.type != "cpu":
            return
        path = self.directory / f"deltastore-anchor-{os.getpid()}-{uuid.uuid4().hex[:12]}.bits"
        self._made.add(path)
        self._writing = threading.Thread(target=self._write_file,
                                         args=(path, mirror.regions(), mirror, anchor, checksums),
                                         name="deltastore-anchor-copy", daemon=True)
        self._writing.start()

    def settle(self) -> None:
        """Wait for a copy being written (then the mirror may change again)."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None

    def take_note(self) -> str | None:
        """Once :meth:`settle` returned: the note of a copy that could not be written, once; else None."""
        note, self._note = self._note, None
        return note

    def _write_file(self, path: Path, regions: list, mirror: Mirror, anchor: VersionRef,
                    checksums: dict[str, int]) -> None:
        layout: dict[int, list[tuple[str, int, int]]] = {}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb", buffering=0) as f:
                at = 0
                for width, buf, names in regions:
                    layout[width] = [(n, at + mirror.view(n).storage_offset() * width, mirror.view(n).numel())
                                     for n in names]
                    data = memoryview(buf.numpy()).cast("B")
                    while data:  # a raw write may take less than it was given
                        data = data[f.write(data):]
                    at += buf.numel() * width
        except Exception as e:  # noqa: BLE001 - the copy's own trouble: a note, the store path instead
            _unlink(path)
            self._note = (f"anchor copy for version {anchor.step} not written to {self.directory} ({e!r}); "
                          "differentials read the anchor back from the store")
            return
        self.path, self.anchor, self._layout = path, anchor, layout
        self._checksums = {n: checksums[n] for items in layout.values() for n, _, _ in items}

    def differential(self, mirror: Mirror, anchor: VersionRef, *, hint: float = 1 / 64
                     ) -> tuple[dict[str, Change] | None, str | None]:
        """``(changes, note)``: per tensor, where ``mirror`` differs from ``anchor`` (current bits new, the
        anchor's old), compared chunk by chunk with the copy; ``hint`` is the expected drifted fraction.
        ``(None, None)`` when there is no copy of ``anchor``; ``(None, note)`` when the copy was found
        damaged or out of layout (it is removed). Errors that are not the copy's own are raised."""
        if self._writing is not None or self.path is None or self.anchor != anchor or mirror.device.type != "cpu":
            return None, None
        changes: dict[str, Change] = {}
        chunks = [(width, chunk) for width, items in self._layout.items() for chunk in _chunks(items, width)]
        scratch = np.empty(max((_span(c, w) for w, c in chunks), default=0), np.uint8)  # one, reused
        try:
            with open(self.path, "rb", buffering=0) as f:
                for width, chunk in chunks:
                    changes.update(self._compare(f, mirror, width, chunk, hint, scratch))
        except (OSError, _Damaged) as e:
            note = (f"anchor copy {self.path} of version {anchor.step} is unusable ({e}); it is removed and the "
                    "differential is read back from the store")
            self.drop()
            return None, note
        return changes, None

    def _compare(self, f, mirror: Mirror, width: int, chunk: list[tuple[str, int, int]], hint: float,  # noqa: ANN001
                 scratch: np.ndarray) -> list[tuple[str, Change]]:
        """The changes of one chunk's tensors (consecutive in the file), read back into ``scratch`` in one call
        (the changes are the compare's own arrays: ``scratch`` may be reused once this returns)."""
        names = [n for n, _, _ in chunk]
        news = []
        for n, _, numel in chunk:
            v = mirror.view(n) if n in mirror.specs else None
            if v is None or v.numel() != numel or v.element_size() != width:
                raise _Damaged(f"tensor {n!r} is no longer {numel} elements of {width} bytes in the mirror")
            news.append(v)
        start = chunk[0][1]
        raw = scratch[:_span(chunk, width)]
        _read_at(f, start, memoryview(raw))
        bits = torch.from_numpy(raw).view(news[0].dtype)
        olds = [bits[(at - start) // width:(at - start) // width + numel] for _, at, numel in chunk]
        sums = segments.full_sums(olds, tensor_keys(names, len(names)))
        for n, s in zip(names, sums.tolist()):
            if s != self._checksums[n]:
                raise _Damaged(f"tensor {n!r} fails the anchor's checksum")
        fc = segments.diff_segments(olds, news, np.zeros(len(olds), np.uint64), hint=hint)
        return list(zip(names, fc.changes()))

    def drop(self) -> None:
        """Remove the copy (nothing held afterwards; a copy being written is waited for first)."""
        self.settle()
        _unlink_all(self._made)
        self.path, self.anchor, self._layout, self._checksums = None, None, {}, {}


def _chunks(items: list[tuple[str, int, int]], width: int) -> list[list[tuple[str, int, int]]]:
    """``items`` (consecutive in the file) in runs of at most :data:`CHUNK_BYTES` (a larger tensor alone)."""
    out: list[list[tuple[str, int, int]]] = []
    for item in items:
        if out and _span([out[-1][0], item], width) <= CHUNK_BYTES:
            out[-1].append(item)
        else:
            out.append([item])
    return out


def _span(chunk: list[tuple[str, int, int]], width: int) -> int:
    """Bytes of the file from a chunk's first tensor to the end of its last."""
    return chunk[-1][1] + chunk[-1][2] * width - chunk[0][1]


def _read_at(f, offset: int, into: memoryview) -> None:  # noqa: ANN001 - an unbuffered binary file
    """Fill ``into`` from ``offset`` of ``f`` (a raw read may return less than asked, e.g. above 2 GiB)."""
    f.seek(offset)
    done = 0
    while done < len(into):
        got = f.readinto(into[done:])
        if not got:
            raise _Damaged(f"the file ends {done} bytes into the {len(into)} at offset {offset}")
        done += got


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _unlink_all(paths: set[Path]) -> None:
    for p in list(paths):
        _unlink(p)
        paths.discard(p)


__all__ = ["AnchorCopy", "CHUNK_BYTES"]
