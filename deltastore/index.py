"""The store index, ``refs/index.json``: how a reader without a listing API finds versions.

A plain HTTP server (a static file server, a CDN, a public bucket's web
endpoint) can GET a key but not list a prefix. The publisher therefore
writes, after each commit, a small JSON document naming the recent versions
and the last anchors with their kinds and manifest digests
(docs/format.md, "The store index"). A reader on a listing backend ignores
it and keeps listing ``versions/`` as the source of truth; a reader without
one takes its versions from the index, checks every manifest it reads
against the digest the index gives, and reaches versions below the window
through the parents' digests (a hash chain), so the index is a discovery aid,
never a way to make a reader apply other bytes.

The index is bounded: the last :data:`WINDOW` versions plus the last
:data:`ANCHORS` anchors below them (about 10 KB), so polling it costs the same at step
10 as at step 100,000. It is written after the manifest and ``refs/latest``
(the commit point is the manifest), and a failed write is a
:class:`~deltastore.errors.PostCommitWarning`, never a failed publish.

Signatures: a signing publisher signs the index like its manifests
(``sign(document) -> bytes``, :func:`deltastore.signing.sign_document`), and a
follower with trusted keys checks a signed one (``check(data, document)``);
an unsigned index is still read, because it only lists versions: each
manifest and the signed ``refs/latest`` are checked on their own
(:class:`~deltastore.store.DeltaStore` wires both).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import KeyNotFoundError, ManifestError, StoreIndexError, UnsupportedFormatError, ValueTooLargeError
from .manifest import MAX_MANIFEST_BYTES, MAX_STEP, Manifest, _json_document

INDEX_KEY = "refs/index.json"
INDEX_FORMAT = "deltastore.index"
INDEX_FORMAT_VERSION = "1.0"
WINDOW = 64
"""Versions the index names below and at the latest."""
ANCHORS = 8
"""Anchors the index names below the window (starting points for a pull of an older step)."""
MAX_INDEX_BYTES = 1 << 20
"""The most bytes a reader takes from ``refs/index.json`` (a written index is about 150 bytes a version)."""
MAX_ENTRIES = 4096
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_KINDS = ("anchor", "delta")
_FIELDS = ("step", "kind", "digest", "size", "parent")

Signer = Callable[[dict[str, Any]], bytes]
"""``sign(document) -> bytes``: the document's canonical bytes with a signature in them."""
Checker = Callable[[bytes, Any], object]
"""``check(data, document)``: raises when the document's signature is missing or wrong."""


@dataclass(frozen=True)
class IndexEntry:
    """One version: its ``step``, ``kind`` (``"anchor"``/``"delta"``), manifest ``digest`` and ``size`` in bytes,
    and its ``parent`` step (None at the start of a chain)."""

    step: int
    kind: str
    digest: str
    size: int
    parent: int | None

    @classmethod
    def of(cls, manifest: Manifest, digest: str, size: int) -> IndexEntry:
        """The entry of a committed ``manifest`` whose bytes have ``digest`` and ``size``."""
        return cls(manifest.step, manifest.kind, digest, size,
                   None if manifest.parent is None else manifest.parent.step)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "digest": self.digest, "size": self.size,
                "parent": self.parent}


@dataclass(frozen=True)
class StoreIndex:
    """A parsed index: ``entries`` in ascending step order, the writer's wall-clock ``updated`` time, the
    ``signature`` record when the writer signed it (checked only by a reader given a ``check``)."""

    entries: tuple[IndexEntry, ...]
    updated: float
    signature: dict[str, Any] | None = None
    _by_step: dict[int, IndexEntry] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_step.update((e.step, e) for e in self.entries)

    @property
    def steps(self) -> list[int]:
        return [e.step for e in self.entries]

    @property
    def latest(self) -> int | None:
        return self.entries[-1].step if self.entries else None

    def entry(self, step: int) -> IndexEntry | None:
        return self._by_step.get(step)


def bounded(entries: Iterable[IndexEntry], window: int = WINDOW, anchors: int = ANCHORS) -> tuple[IndexEntry, ...]:
    """``entries`` (one per step, the later one wins) cut to the last ``window`` versions and the last
    ``anchors`` anchors below them, ascending."""
    by_step = {e.step: e for e in entries}
    steps = sorted(by_step)
    recent = steps[-window:] if window > 0 else []
    below = [s for s in steps[: len(steps) - len(recent)] if by_step[s].kind == "anchor"]
    keep = set(recent) | set(below[-anchors:] if anchors > 0 else [])
    return tuple(by_step[s] for s in sorted(keep))


def merged(previous: StoreIndex | None, add: Iterable[IndexEntry] = (), drop: Iterable[int] = (), *,
           window: int = WINDOW, anchors: int = ANCHORS) -> tuple[IndexEntry, ...]:
    """The entries of ``previous`` with ``add`` put in (replacing an entry of the same step) and the steps in
    ``drop`` taken out, bounded (:func:`bounded`)."""
    gone = set(drop)
    entries = [e for e in (previous.entries if previous is not None else ()) if e.step not in gone]
    return bounded([*entries, *(e for e in add if e.step not in gone)], window, anchors)


def index_document(entries: Iterable[IndexEntry], updated: float | None = None) -> dict[str, Any]:
    """The JSON document of an index naming ``entries`` (written at ``updated``, default now)."""
    return {"format": INDEX_FORMAT, "format_version": INDEX_FORMAT_VERSION,
            "updated": time.time() if updated is None else updated,
            "versions": [e.to_dict() for e in sorted(entries, key=lambda e: e.step)]}


def index_bytes(entries: Iterable[IndexEntry], *, updated: float | None = None, sign: Signer | None = None) -> bytes:
    """The bytes of ``refs/index.json`` naming ``entries``: canonical JSON (keys sorted, compact), or what
    ``sign`` makes of the document."""
    doc = index_document(entries, updated)
    if sign is not None:
        return sign(doc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse_index(data: bytes, check: Checker | None = None) -> StoreIndex:
    """Parse and validate the bytes of ``refs/index.json``.

    ``check(data, document)`` runs on the document before anything else (a signature check) and raises
    what it raises. Raises :class:`StoreIndexError` for a malformed index (over :data:`MAX_INDEX_BYTES`,
    bad JSON, duplicate keys, a missing or ill-typed field, steps not strictly ascending, more than
    :data:`MAX_ENTRIES` versions) and :class:`UnsupportedFormatError` for another major format version.
    Unknown fields are ignored (a later minor version adds optional ones).
    """
    if len(data) > MAX_INDEX_BYTES:
        raise StoreIndexError(f"{INDEX_KEY} is {len(data)} bytes, over the {MAX_INDEX_BYTES} byte bound")
    try:
        doc = _json_document(data, INDEX_KEY)
    except ManifestError as e:
        raise StoreIndexError(str(e)) from None
    if check is not None:
        check(data, doc)
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        raise StoreIndexError(f"{INDEX_KEY} is not a {INDEX_FORMAT} document")
    version = doc.get("format_version")
    if not isinstance(version, str) or not re.match(r"^\d{1,4}\.\d{1,4}$", version):
        raise StoreIndexError(f"{INDEX_KEY} has format_version {version!r}, not 'MAJOR.MINOR'")
    if version.split(".")[0] != INDEX_FORMAT_VERSION.split(".")[0]:
        raise UnsupportedFormatError(f"{INDEX_KEY} is format {version}; this deltastore reads "
                                     f"{INDEX_FORMAT_VERSION.split('.')[0]}.x (upgrade the follower)")
    updated = doc.get("updated")
    if isinstance(updated, bool) or not isinstance(updated, (int, float)):
        raise StoreIndexError(f"{INDEX_KEY}: 'updated' is not a number")
    rows = doc.get("versions")
    if not isinstance(rows, list) or len(rows) > MAX_ENTRIES:
        raise StoreIndexError(f"{INDEX_KEY}: 'versions' is not a list of at most {MAX_ENTRIES} entries")
    entries = tuple(_entry(row, i) for i, row in enumerate(rows))
    if any(a.step >= b.step for a, b in zip(entries, entries[1:])):
        raise StoreIndexError(f"{INDEX_KEY}: the versions are not in strictly ascending step order")
    signature = doc.get("signature")
    return StoreIndex(entries, float(updated), signature if isinstance(signature, dict) else None)


def _int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _entry(row: Any, i: int) -> IndexEntry:
    where = f"{INDEX_KEY}: versions[{i}]"
    if not isinstance(row, dict) or not all(k in row for k in _FIELDS):
        raise StoreIndexError(f"{where} is not an object with the fields {', '.join(_FIELDS)}")
    step, kind, digest, size, parent = (row[k] for k in _FIELDS)
    if not _int(step, 0, MAX_STEP):
        raise StoreIndexError(f"{where}: step {step!r} is not an integer in [0, {MAX_STEP}]")
    if kind not in _KINDS:
        raise StoreIndexError(f"{where}: kind {kind!r} is not 'anchor' or 'delta'")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise StoreIndexError(f"{where}: digest {digest!r} is not 'sha256:<64 hex>'")
    if not _int(size, 1, MAX_MANIFEST_BYTES):
        raise StoreIndexError(f"{where}: size {size!r} is not a manifest size in [1, {MAX_MANIFEST_BYTES}]")
    if parent is not None and not _int(parent, 0, step - 1):
        raise StoreIndexError(f"{where}: parent {parent!r} is not a step below {step}")
    return IndexEntry(step, kind, digest, size, parent)


def latest_step(data: bytes) -> int | None:
    """The step ``refs/latest`` names: ASCII digits, or a JSON document with an integer ``step`` (a signed
    latest); None when it is neither."""
    text = data.strip()
    if text.isdigit() and len(text) <= 12:
        return int(text)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    step = doc.get("step") if isinstance(doc, dict) else None
    return step if _int(step, 0, MAX_STEP) else None


def read_bounded(backend: Any, key: str, limit: int) -> bytes | None:
    """The bytes under ``key`` (at most ``limit``), None when absent; :class:`StoreIndexError` when longer."""
    try:
        return backend.get_bounded(key, limit)
    except KeyNotFoundError:
        return None
    except ValueTooLargeError:
        raise StoreIndexError(f"{key} is over its {limit} byte bound (not read)") from None


__all__ = ["ANCHORS", "INDEX_FORMAT", "INDEX_FORMAT_VERSION", "INDEX_KEY", "IndexEntry", "MAX_INDEX_BYTES",
           "StoreIndex", "WINDOW", "bounded", "index_bytes", "index_document", "latest_step", "merged",
           "parse_index", "read_bounded"]
