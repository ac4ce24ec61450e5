"""Version manifests and their JSON form (format ``deltastore.manifest`` 1.3, 1.4 when signed; 1.0 to 1.2 are read too).

A manifest is the only thing a reader trusts: it names every object of a
version by digest, the codec that decodes each, and every tensor's dtype,
shape and checksum after the version. See ``docs/format.md`` for the field
reference. :meth:`Manifest.from_json` validates strictly and raises
:class:`ManifestError` / :class:`UnsupportedFormatError` on anything off.

From 1.3 the tensors' names, dtypes and shapes are not in the manifest: they
are one *layout object* (JSON, content-addressed like every object) that the
manifest names by digest, written once per layout. A reader parses a layout
object once and knows it again by its digest (:data:`_LAYOUT_OBJECTS`), so a
follower of a model with 16,384 tensors downloads and parses about 0.6 MB of
manifest per version instead of 1.7 MB.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
import math
import operator
import re
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from .errors import ManifestError, UnsupportedFormatError
from .quantization import check_record as check_quantization
from .tensor_spec import DTYPE_SIZES, TensorSpec, spec_from_name, torch_dtypes_if_loaded

if TYPE_CHECKING:
    import torch

FORMAT = "deltastore.manifest"
FORMAT_VERSION = "1.0"
#: the minor version whose ``tensors`` section is columns (``{field: [value per tensor]}``) instead of one
#: object per tensor (1.0; 1.1 added the layout-change fields): what publishers write (at 16,384 tensors
#: about half the bytes and a quarter of the JSON parse of rows); ``docs/format.md`` has the versions
COLUMNS_FORMAT_VERSION = "1.2"
#: the minor version whose tensor columns leave the layout (names, dtypes, shapes) to a layout object named by
#: digest (the manifest's ``layout`` field): what publishers write
LAYOUT_OBJECT_FORMAT_VERSION = "1.3"
#: the format and version of a layout object
LAYOUT_FORMAT = "deltastore.layout"
LAYOUT_FORMAT_VERSION = "1.0"
#: the fields of a tensor record, in the order of :class:`TensorRecord`
TENSOR_FIELDS = ("name", "dtype", "shape", "changed", "checksum", "delta", "full", "diff", "diff_changed")
#: the fields a layout object holds as columns, and those a 1.3 manifest's ``tensors`` section keeps
LAYOUT_FIELDS, VALUE_FIELDS = TENSOR_FIELDS[:3], TENSOR_FIELDS[3:]
MAX_MANIFEST_BYTES = 64 << 20
MAX_STEP = 10**12 - 1
MAX_NUMEL = 1 << 48
MAX_DIMS = 16
MAX_PARTS = 1 << 16

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHECKSUM = re.compile(r"^[0-9a-f]{16}$")
_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,511}$")

Kind = Literal["anchor", "delta"]
Role = Literal["delta", "full", "diff"]


def sha256_digest(data: bytes) -> str:
    """``"sha256:<hex>"`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_tensor_name(name: object) -> str:
    """Return ``name`` if it is a safe tensor name (no ``/``, no ``..``), else raise :class:`ManifestError`."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise ManifestError(f"invalid tensor name {name!r}: use letters, digits and _ . : - (no '/' or '..')")
    return name


@dataclass(frozen=True)
class VersionRef:
    """A pointer to a committed version: its step and the sha256 of its manifest bytes."""

    step: int
    digest: str


@dataclass(frozen=True)
class ObjectRecord:
    """One stored object: digest, size in bytes and the codec record that decodes it."""

    digest: str
    size: int
    codec: dict[str, Any]


@dataclass(frozen=True)
class LayoutRef:
    """The layout object a manifest (format 1.3) names: the sha256 digest and size of its bytes."""

    digest: str
    size: int


#: reads the verified bytes of the layout object ``(digest, size)`` (a store's; raises its typed errors)
LayoutReader = Callable[[str, int], bytes]


@dataclass(frozen=True)
class Part:
    """Where one flat slice ``[offset, offset + numel)`` of a tensor is stored: in object ``object``.

    Inside that object the slice is stored under the tensor's name, as a 1-D
    tensor of ``numel`` elements (or with the tensor's own shape when the part
    is the whole tensor). Sparse parts hold positions relative to ``offset``.
    """

    object: int
    offset: int
    numel: int


Parts = tuple[Part, ...]


class _RecordFields(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    changed: int
    checksum: str
    delta: Parts
    full: Parts
    diff: Parts
    diff_changed: int
    numel: int
    spec: TensorSpec


_DELTA, _CHANGED = operator.attrgetter("delta"), operator.attrgetter("changed")


class TensorRecord(_RecordFields):
    """One tensor of a version.

    changed: elements whose bits differ from the parent version (all of them
        for a version without parent).
    checksum: :mod:`deltastore.checksum` of the whole tensor after this version.
    delta: parts that turn the parent's tensor into this one (empty when
        unchanged or when there is no parent).
    full: parts holding the whole tensor, covering it exactly (anchors only).
    diff: parts holding the changes from the manifest's ``differential``
        anchor to this version (empty when there is none or nothing differs).
    diff_changed: elements that differ from that anchor.
    numel, spec: the element count and :class:`TensorSpec`, worked out from
        name, dtype and shape when the record is made (not separate inputs).

    In JSON a role is ``null`` (no parts), an object index (one part: the
    whole tensor) or a list of ``{"object", "offset", "numel"}`` slices.

    An immutable tuple (every field a C-level read, and a parsed manifest's
    records made in one C call per tensor, :func:`_plain_columns`); raises
    ``ValueError`` for a dtype :data:`~deltastore.tensor_spec.DTYPE_SIZES` lacks.
    """

    __slots__ = ()

    def __new__(cls, name: str, dtype: str, shape: Sequence[int], changed: int, checksum: str,
                delta: Parts = (), full: Parts = (), diff: Parts = (), diff_changed: int = 0) -> TensorRecord:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        shape = tuple(shape)
        numel = math.prod(shape)
        return tuple.__new__(cls, (name, dtype, shape, changed, checksum, delta, full, diff, diff_changed, numel,
                                   spec_from_name(name, dtype, shape, numel, torch_dtypes_if_loaded())))

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy.copy / deepcopy
        return tuple(self)[:len(TENSOR_FIELDS)]

    def __repr__(self) -> str:
        return "TensorRecord(" + ", ".join(f"{k}={v!r}" for k, v in zip(TENSOR_FIELDS, self)) + ")"

    def _replace(self, **changes: Any) -> TensorRecord:  # type: ignore[override]
        """A copy with ``changes`` to the :data:`TENSOR_FIELDS` (numel and spec follow)."""
        return TensorRecord(**{**dict(zip(TENSOR_FIELDS, self)), **changes})

    def whole(self, index: int) -> Parts:
        """One part: the whole tensor in object ``index``."""
        return (Part(index, 0, self.numel),)

    def is_whole(self, part: Part) -> bool:
        return part.offset == 0 and part.numel == self.numel

    def role_json(self, parts: Parts) -> Any:
        if not parts:
            return None
        if len(parts) == 1 and self.is_whole(parts[0]):
            return parts[0].object
        return [{"object": p.object, "offset": p.offset, "numel": p.numel} for p in parts]


@dataclass(frozen=True)
class Manifest:
    """A committed version. ``kind == "anchor"`` means every tensor has a ``full`` object.

    ``aliases`` maps names that share storage with a listed tensor on the
    publisher (tied weights) to that tensor's name; a target holding a separate
    tensor under an alias name gets the same writes.

    Layout changes (format 1.1, ``docs/format.md``): ``new_tensors`` names the
    tensors that are not in the parent version with this dtype and shape
    (added, reshaped or re-typed); each is stored whole in this version
    (``full`` parts, no delta). ``dropped_tensors`` names the parent's tensors
    this version no longer has.
    ``quantization`` names the scheme of quantized served weights (absent from
    the JSON when None).
    """

    step: int
    kind: Kind
    parent: VersionRef | None
    tensors: tuple[TensorRecord, ...]
    objects: tuple[ObjectRecord, ...]
    created: float = 0.0
    producer: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    differential: VersionRef | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    format_version: str = FORMAT_VERSION
    new_tensors: tuple[str, ...] = ()
    dropped_tensors: tuple[str, ...] = ()
    #: how the tensors were quantized (``deltastore.quantize``), None for weights as trained
    quantization: dict[str, Any] | None = None
    #: format 1.4: ``{"alg", "key_id", "sig"}`` of the publisher's signature (:mod:`deltastore.signing`; a
    #: Subscriber with ``trusted_keys`` checks it on the bytes before parsing), None when unsigned
    signature: dict[str, str] | None = None

    @property
    def signed_by(self) -> str | None:
        """The key id the version names as its signer (checked only by a reader with trusted keys), or None."""
        return None if self.signature is None else self.signature.get("key_id")

    # -- derived figures -----------------------------------------------------
    @property
    def created_at(self) -> datetime.datetime | None:
        """``created`` as an aware UTC datetime; None when it is outside what a datetime can hold.

        ``created`` is any finite number (a hostile or broken writer may put
        ``1e300`` there); this never raises, so listings can show it as unknown.
        """
        try:
            return datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc)
        except (OverflowError, ValueError, OSError):
            return None

    # sums over every record, asked several times per version: cached in the (frozen) instance's __dict__
    @property
    def changed(self) -> int:
        got = self.__dict__.get("_changed")
        if got is None:
            got = self.__dict__["_changed"] = sum(t.changed for t in self.tensors)
        return got

    @property
    def total(self) -> int:
        got = self.__dict__.get("_total")
        if got is None:
            got = self.__dict__["_total"] = sum(t.numel for t in self.tensors)
        return got

    def object_bytes(self, indices: set[int] | None = None) -> int:
        """Bytes of the objects at ``indices`` (all objects when None)."""
        return sum(o.size for i, o in enumerate(self.objects) if indices is None or i in indices)

    @property
    def delta_objects(self) -> set[int]:
        return self.objects_for("delta")

    @property
    def full_objects(self) -> set[int]:
        return self.objects_for("full")

    @property
    def diff_objects(self) -> set[int]:
        return self.objects_for("diff")

    @functools.cached_property
    def has_delta(self) -> bool:
        """Whether a holder of the parent version can reach this one (its :attr:`step_objects`)."""
        if self.parent is None:
            return False
        # every record without delta parts unchanged (C-level passes) or new
        without = list(itertools.compress(self.tensors, map(operator.not_, map(_DELTA, self.tensors))))
        new = self.new_tensors
        return not any(map(_CHANGED, without)) or all(t.changed == 0 or t.name in new for t in without)

    @property
    def step_objects(self) -> set[int]:
        """Objects a holder of the parent version reads: the deltas and the whole new tensors."""
        out = self.objects_for("delta")
        if self.new_tensors:
            new = set(self.new_tensors)
            out |= {p.object for t in self.tensors if t.name in new for p in t.full}
        return out

    @property
    def changes_layout(self) -> bool:
        return bool(self.new_tensors or self.dropped_tensors)

    @functools.cached_property
    def checksum_values(self) -> dict[str, int]:
        """``name -> checksum`` as integers (parsed once per manifest; callers copy before changing it)."""
        return {t.name: int(t.checksum, 16) for t in self.tensors}

    @functools.cached_property
    def layout_key(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """``(name, dtype, shape)`` of every tensor, in order: equal keys mean equal layouts (one C compare)."""
        return tuple((t.name, t.dtype, t.shape) for t in self.tensors)

    @functools.cached_property
    def layout_columns(self) -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
        """Names, torch dtypes and shapes of the tensors, in order (read-only lists; for a parsed manifest
        the very lists of its :class:`RowLayout`, shared by every manifest of that layout). Imports torch."""
        layout = self.__dict__.get("_row_layout")
        if layout is not None:
            return layout.columns
        return [t.name for t in self.tensors], [t.spec.dtype for t in self.tensors], [t.shape for t in self.tensors]

    @functools.cached_property
    def layout_bytes(self) -> bytes:
        """The layout object of this manifest's tensors (canonical JSON: their names, dtype names and shapes
        as columns), whatever its format version."""
        doc = {"format": LAYOUT_FORMAT, "format_version": LAYOUT_FORMAT_VERSION,
               "name": [t.name for t in self.tensors], "dtype": [t.dtype for t in self.tensors],
               "shape": [list(t.shape) for t in self.tensors]}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @functools.cached_property
    def layout_ref(self) -> LayoutRef | None:
        """The layout object this manifest names (format 1.3 on; None before): as parsed, or for a manifest
        made here the digest and size of :attr:`layout_bytes`."""
        if not names_layout(self.format_version):
            return None
        data = self.layout_bytes
        return LayoutRef(sha256_digest(data), len(data))

    def references(self) -> dict[str, int]:
        """Digest -> size of every stored object this version names: its data objects, its recorded files
        and its layout object."""
        refs = {o.digest: o.size for o in self.objects}
        refs.update({f["digest"]: f["size"] for f in self.files.values()})
        if self.layout_ref is not None:
            refs[self.layout_ref.digest] = self.layout_ref.size
        return refs

    def tensor_map(self) -> dict[str, TensorRecord]:
        return {t.name: t for t in self.tensors}

    def count_column(self, role: Role) -> np.ndarray:
        """Each tensor's changed-element count for ``role`` (``diff_changed`` for "diff", else ``changed``),
        int64 in manifest order, read-only (worked out once)."""
        key = "_diff_counts" if role == "diff" else "_counts"
        got = self.__dict__.get(key)
        if got is None:
            attr = operator.attrgetter("diff_changed" if role == "diff" else "changed")
            got = np.fromiter(map(attr, self.tensors), dtype=np.int64, count=len(self.tensors))
            got.flags.writeable = False
            self.__dict__[key] = got
        return got

    @property
    def row_layout(self) -> RowLayout | None:
        """For a manifest parsed from plain columns (every role one whole object or none): the layout of its
        tensors, shared by every manifest parsed with the same columns, whose rows are its tensors in order;
        else None."""
        return self.__dict__.get("_row_layout")

    def objects_for(self, role: Role) -> set[int]:
        """Indices of the objects a reader fetches for ``role`` (a new set each call; worked out once)."""
        key = f"_objects_{role}"
        got = self.__dict__.get(key)
        if got is None:
            got = self.__dict__[key] = frozenset(p.object for t in self.tensors for p in getattr(t, role))
        return set(got)

    def object_parts(self, index: int, role: Role) -> list[tuple[TensorRecord, Part]]:
        """``(tensor, part)`` pairs stored in object ``index`` for ``role``, in manifest order."""
        return [(t, p) for t in self.tensors for p in getattr(t, role) if p.object == index]

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(self.tensors)

    # -- JSON ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        layout = {k: list(v) for k, v in (("new_tensors", self.new_tensors),
                                          ("dropped_tensors", self.dropped_tensors)) if v}
        doc = {**layout,
            "format": FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "kind": self.kind,
            "parent": None if self.parent is None else {"step": self.parent.step, "digest": self.parent.digest},
            "created": self.created,
            "producer": self.producer,
            "metadata": self.metadata,
            "aliases": self.aliases,
            "differential": None if self.differential is None else {"step": self.differential.step,
                                                                     "digest": self.differential.digest},
            "files": self.files,
            "stats": {"changed": self.changed, "total": self.total, "object_bytes": self.object_bytes()},
            "objects": [{"digest": o.digest, "size": o.size, "codec": o.codec} for o in self.objects],
            "tensors": self._tensors_json(),
        }
        if self.quantization is not None:
            doc["quantization"] = self.quantization
        if self.layout_ref is not None:
            doc["layout"] = {"digest": self.layout_ref.digest, "size": self.layout_ref.size}
        if self.signature is not None:
            doc["signature"] = self.signature
        return doc

    def _tensors_json(self) -> list[dict[str, Any]] | dict[str, list[Any]]:
        rows = [(t.name, t.dtype, list(t.shape), t.changed, t.checksum, t.role_json(t.delta), t.role_json(t.full),
                 t.role_json(t.diff), t.diff_changed) for t in self.tensors]
        if columnar(self.format_version):
            columns = dict(zip(TENSOR_FIELDS, map(list, zip(*rows) if rows else [()] * len(TENSOR_FIELDS))))
            return {k: columns[k] for k in VALUE_FIELDS} if names_layout(self.format_version) else columns
        return [dict(zip(TENSOR_FIELDS, r)) for r in rows]

    def to_json(self) -> bytes:
        """Canonical bytes (sorted keys, compact); the version digest is their sha256."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, layouts: LayoutReader | None = None,
                  check: Callable[[bytes, Any], object] | None = None) -> Manifest:
        """Parse and validate manifest bytes; ``layouts`` reads the layout object a 1.3 manifest names when
        this process has not parsed it yet (:meth:`DeltaStore.parse_manifest` passes the store's).
        ``check(data, document)`` runs on the JSON document before anything else is read or validated (a
        :class:`~deltastore.signing.Trust`'s signature check) and raises what it raises.

        Raises :class:`ManifestError` for malformed content (bad JSON, duplicate
        keys, wrong types, out-of-range numbers, unsafe names, dangling object
        indices, a malformed layout object, or a layout object to read and no
        ``layouts``), :class:`UnsupportedFormatError` for another major version,
        and what ``layouts`` raises (a store's :class:`ObjectNotFoundError`,
        :class:`CorruptObjectError`).
        """
        doc = _json_document(data, "manifest")
        if check is not None:
            check(data, doc)
        return _parse(doc, layouts)


def _json_document(data: bytes, what: str) -> Any:
    """The JSON document in ``data`` (at most :data:`MAX_MANIFEST_BYTES`; no duplicate keys, no NaN)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except ManifestError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{what} is not valid JSON: {e}") from None


def _minor(version: str) -> int:
    minor = version.partition(".")[2]
    return int(minor) if minor.isascii() and minor.isdigit() and len(minor) < 8 else 0


def columnar(version: str) -> bool:
    """Whether manifest format ``version`` (major 1) holds its tensors as columns (:data:`COLUMNS_FORMAT_VERSION`)."""
    return _minor(version) >= 2


def names_layout(version: str) -> bool:
    """Whether manifest format ``version`` (major 1) names a layout object instead of listing names, dtypes and
    shapes (:data:`LAYOUT_OBJECT_FORMAT_VERSION`)."""
    return _minor(version) >= 3


# -- validation ------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # a key given twice (one pass in C; the loop below only names it)
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ManifestError(f"duplicate key {k!r} in manifest")
            seen.add(k)
    return out


def _reject_constant(name: str) -> Any:
    raise ManifestError(f"manifest contains {name}, which JSON does not allow")


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str = "manifest") -> Any:
    if not isinstance(doc, dict) or key not in doc:
        raise ManifestError(f"{where} lacks field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ManifestError(f"{where} field {key!r} has type {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _int(doc: dict[str, Any], key: str, lo: int, hi: int, where: str = "manifest") -> int:
    value = _get(doc, key, int, where)
    if not lo <= value <= hi:
        raise ManifestError(f"{where} field {key!r} = {value} outside [{lo}, {hi}]")
    return value


def _digest(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise ManifestError(f"{where}: invalid digest {value!r}")
    return value


def _index(value: Any, n_objects: int, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_objects:
        raise ManifestError(f"{where}: object index {value!r} out of range (0..{n_objects - 1})")
    return value


def _parts(value: Any, n_objects: int, numel: int, where: str, *, cover: bool) -> Parts:
    """Parse a role: null, an object index (the whole tensor) or a list of slices.

    Slices must be non-empty, in increasing offset order, disjoint and inside
    the tensor; with ``cover`` they must tile it exactly.
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        return (Part(_index(value, n_objects, where), 0, numel),)
    if not value or len(value) > MAX_PARTS:
        raise ManifestError(f"{where}: a part list needs 1..{MAX_PARTS} entries")
    parts = []
    end = 0
    for i, doc in enumerate(value):
        w = f"{where} part {i}"
        part = Part(_index(doc.get("object") if isinstance(doc, dict) else None, n_objects, w),
                    _int(doc, "offset", 0, numel, w), _int(doc, "numel", 1, numel, w))
        if part.offset < end or part.offset + part.numel > numel or (cover and part.offset != end):
            raise ManifestError(f"{where}: parts overlap, leave gaps or run past the tensor's {numel} elements")
        end = part.offset + part.numel
        parts.append(part)
    if cover and end != numel:
        raise ManifestError(f"{where}: parts cover {end} of {numel} elements")
    return tuple(parts)


def _parse(doc: Any, layouts: LayoutReader | None = None) -> Manifest:
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"not a deltastore manifest (format={doc.get('format')!r})")
    version = _get(doc, "format_version", str)
    if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise UnsupportedFormatError(
            f"manifest format {version} is not readable by this deltastore (reads {FORMAT_VERSION.split('.')[0]}.x)")
    step = _int(doc, "step", 0, MAX_STEP)
    kind = _get(doc, "kind", str)
    if kind not in ("anchor", "delta"):
        raise ManifestError(f"unknown version kind {kind!r}")
    parent_doc = _get(doc, "parent", (dict, type(None)))
    parent = None
    if parent_doc is not None:
        parent = VersionRef(_int(parent_doc, "step", 0, MAX_STEP, "parent"),
                            _digest(parent_doc.get("digest"), "parent"))
        if parent.step >= step:
            raise ManifestError(f"parent step {parent.step} is not below step {step}")
    diff_doc = _get(doc, "differential", (dict, type(None))) if "differential" in doc else None
    differential = None
    if diff_doc is not None:
        differential = VersionRef(_int(diff_doc, "step", 0, MAX_STEP, "differential"),
                                  _digest(diff_doc.get("digest"), "differential"))
        if differential.step >= step:
            raise ManifestError(f"differential base step {differential.step} is not below step {step}")
    files = _get(doc, "files", dict) if "files" in doc else {}
    for fname, frec in files.items():
        if not isinstance(fname, str) or not _FILE.match(fname):
            raise ManifestError(f"invalid recorded file name {fname!r}")
        _digest(frec.get("digest") if isinstance(frec, dict) else None, f"files[{fname!r}]")
        _int(frec, "size", 0, MAX_NUMEL, f"files[{fname!r}]")
    created = _get(doc, "created", (int, float))
    if not math.isfinite(created):
        raise ManifestError(f"created time {created!r} is not finite")
    producer = _get(doc, "producer", dict)
    metadata = _get(doc, "metadata", dict)

    objects = []
    for i, o in enumerate(_get(doc, "objects", list)):
        where = f"objects[{i}]"
        codec = _get(o, "codec", dict, where)
        if not isinstance(codec.get("id"), str):
            raise ManifestError(f"{where}: codec record lacks a string 'id'")
        objects.append(ObjectRecord(_digest(o.get("digest") if isinstance(o, dict) else None, where),
                                    _int(o, "size", 0, MAX_NUMEL * 8, where), codec))

    new_tensors = _names(doc, "new_tensors")
    new_names = set(new_tensors)
    n_objects = len(objects)
    tensors: list[TensorRecord] | None = None
    layout: RowLayout | None = None
    used: set[int | None] | None = None
    role_objects: dict[str, frozenset[int]] = {}
    layout_ref = known = None
    if columnar(version):  # checked as columns; anything they refuse is named row by row below
        if names_layout(version):
            layout_ref = _layout_ref(doc)
            columns, known = _named_layout_columns(_get(doc, "tensors", dict), layout_ref, layouts)
        else:
            columns = _tensor_columns(_get(doc, "tensors", dict), TENSOR_FIELDS)
        got = _plain_columns(columns, n_objects, known)
        if got is not None:
            tensors, layout, checksum_ints, role_values = got
            if layout_ref is not None and known is None:
                _remember_layout_object(layout_ref.digest, layout)
        listed = [dict(zip(TENSOR_FIELDS, row)) for row in zip(*columns)] if tensors is None else []
    else:
        listed = _get(doc, "tensors", list)
    if tensors is None:
        plain = _plain_records(listed, n_objects)
        tensors = plain if all(plain) else [rec or _record(t, i, n_objects)  # type: ignore[misc]
                                            for i, (t, rec) in enumerate(zip(listed, plain))]
        holds = _roles_hold(tensors, kind, parent is not None, differential is not None, new_names)
    else:  # plain columns: every role is one whole object or none
        assert layout is not None
        _, _, _, changed, _, delta, full, diff, diff_changed = columns
        holds = _columns_hold_roles(changed, delta, full, diff, diff_changed, layout.names, kind, parent is not None,
                                    differential is not None, new_names)
        role_objects = {f"_objects_{role}": frozenset(values).difference((None,))  # for objects_for
                        for role, values in zip(("delta", "full", "diff"), role_values)}
        used = set().union(*role_objects.values())
    names = layout.name_set if layout is not None else {t.name for t in tensors}
    if len(names) != len(tensors) or not holds:
        _check_roles(tensors, kind, parent, differential, new_names)  # names the first tensor that is off
    aliases = _get(doc, "aliases", dict) if "aliases" in doc else {}
    for alias, primary in aliases.items():
        check_tensor_name(alias)
        if primary not in names or alias in names:
            raise ManifestError(f"alias {alias!r} -> {primary!r} must name a listed tensor and not be one")
    dropped = _names(doc, "dropped_tensors")
    if (new_tensors or dropped) and parent is None:
        raise ManifestError("a version without parent cannot add or drop tensors (it has no layout to change)")
    records = {t.name: t for t in tensors} if new_tensors else {}
    for name in new_tensors:
        t = records.get(name)
        if t is None:
            raise ManifestError(f"new tensor {name!r} is not listed")
        if not t.full or t.delta or t.diff or t.diff_changed or t.changed != t.numel:
            raise ManifestError(f"new tensor {name!r} must be stored whole (full parts, no delta, no diff, "
                                "every element changed)")
    for name in dropped:
        if name in names or name in aliases:
            raise ManifestError(f"dropped tensor {name!r} is still listed")
    quantization = doc.get("quantization")
    if quantization is not None:  # an unknown scheme: UnsupportedFormatError, never bits served as bf16
        check_quantization(quantization, {t.name: t for t in tensors})
    if used is None:
        used = {p.object for t in tensors for p in (*t.delta, *t.full, *t.diff)}
    for i in range(len(objects)):
        if i not in used:
            raise ManifestError(f"objects[{i}] is referenced by no tensor")
    m = Manifest(step=step, kind=kind, parent=parent, tensors=tuple(tensors), objects=tuple(objects),
                 created=float(created), producer=producer, metadata=metadata, aliases=aliases,
                 differential=differential, files=files, format_version=version, new_tensors=new_tensors,
                 dropped_tensors=dropped, quantization=quantization, signature=_signature(doc))
    if layout is not None:  # the cached properties, shared by every manifest of this layout
        m.__dict__.update(layout_key=layout.key, _row_layout=layout,
                          checksum_values=dict(zip(layout.names, checksum_ints)), **role_objects)
    if layout_ref is not None:
        m.__dict__["layout_ref"] = layout_ref
    return m


def _signature(doc: dict[str, Any]) -> dict[str, str] | None:
    """The ``signature`` record (format 1.4) as stored: its shape is checked here, the signature itself by a
    reader with trusted keys (:class:`deltastore.signing.Trust`), before parsing."""
    record = doc.get("signature")
    if record is None:
        return None
    if (not isinstance(record, dict) or set(record) != {"alg", "key_id", "sig"}
            or not all(isinstance(v, str) for v in record.values())):
        raise ManifestError("the signature field is not {\"alg\", \"key_id\", \"sig\"} strings")
    return record


def _layout_ref(doc: dict[str, Any]) -> LayoutRef:
    """The ``layout`` field of a 1.3 manifest."""
    ref = _get(doc, "layout", dict)
    if set(ref) != {"digest", "size"}:
        raise ManifestError(f"the layout field has {sorted(ref)}, not ['digest', 'size']")
    return LayoutRef(_digest(ref["digest"], "layout"), _int(ref, "size", 1, MAX_MANIFEST_BYTES, "layout"))


def _named_layout_columns(section: dict[str, Any], ref: LayoutRef, layouts: LayoutReader | None
                          ) -> tuple[tuple[list[Any], ...], RowLayout | None]:
    """The :data:`TENSOR_FIELDS` columns of a 1.3 manifest: its value columns after the columns of the layout
    object ``ref``, and that layout when this process parsed and checked it before (else None: the caller
    checks the columns read from the object)."""
    values = _tensor_columns(section, VALUE_FIELDS)
    known = _LAYOUT_OBJECTS.get(ref.digest)
    if known is not None and not set(known.dtypes) <= DTYPE_SIZES.keys():
        known = None  # the table of dtypes this reader knows decides, not the one it knew then
    if known is not None:
        layout_columns = known.columns_in
    elif layouts is None:
        raise ManifestError(f"the manifest names its layout object {ref.digest}: read it through a DeltaStore "
                            "(DeltaStore.parse_manifest), which fetches that object")
    else:
        layout_columns = _layout_object_columns(layouts(ref.digest, ref.size), ref.digest)
    if len(layout_columns[0]) != len(values[0]):
        raise ManifestError(f"layout object {ref.digest} lists {len(layout_columns[0])} tensors, the manifest's "
                            f"columns {len(values[0])}")
    return (*layout_columns, *values), known


def _layout_object_columns(data: bytes, digest: str) -> tuple[list[Any], ...]:
    """The name, dtype and shape columns of layout object ``digest`` (its verified bytes ``data``), as
    parsed: each a list, all of one length (their entries are checked with the manifest's records)."""
    what = f"layout object {digest}"
    doc = _json_document(data, what)
    if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT:
        raise ManifestError(f"{what} is not a deltastore layout")
    version = _get(doc, "format_version", str, what)
    if version.split(".")[0] != LAYOUT_FORMAT_VERSION.split(".")[0]:
        raise UnsupportedFormatError(f"{what} has format {version}; this deltastore reads "
                                     f"{LAYOUT_FORMAT_VERSION.split('.')[0]}.x")
    fields = set(doc) - {"format", "format_version"}
    if fields != set(LAYOUT_FIELDS):
        raise ManifestError(f"{what} has the columns {sorted(fields)}, not {sorted(LAYOUT_FIELDS)}")
    return _tensor_columns({k: doc[k] for k in LAYOUT_FIELDS}, LAYOUT_FIELDS)


def _roles_hold(tensors: list[TensorRecord], kind: str, has_parent: bool, has_differential: bool,
                new_names: set[str]) -> bool:
    """Whether every tensor keeps the rules :func:`_check_roles` names (one C-level pass per rule)."""
    if not has_differential and any(t.diff or t.diff_changed for t in tensors):
        return False
    if any(t.diff_changed > 0 and not t.diff for t in tensors):
        return False
    if kind == "anchor" and not all(t.full for t in tensors):
        return False
    if kind == "delta" and tensors and (not has_parent or any(t.full and t.name not in new_names for t in tensors)):
        return False
    return not any(t.changed > 0 and not t.delta and not t.full for t in tensors)


def _columns_hold_roles(changed: list[int], delta: list[int | None], full: list[int | None], diff: list[int | None],
                        diff_changed: list[int], names: list[str], kind: str, has_parent: bool, has_differential: bool,
                        new_names: set[str]) -> bool:
    """:func:`_roles_hold` on plain columns (a role is an object index or None): C-level passes, no record."""
    no_diff = list(map(operator.is_, diff, itertools.repeat(None)))
    if all(no_diff):
        if any(diff_changed):
            return False
    elif not has_differential or any(itertools.compress(diff_changed, no_diff)):
        return False
    no_full = list(map(operator.is_, full, itertools.repeat(None)))
    if kind == "anchor" and any(no_full):
        return False
    if kind == "delta" and names and (
            not has_parent or not new_names.issuperset(itertools.compress(names, map(operator.not_, no_full)))):
        return False
    # a changed tensor names an object: among those without a delta, none changed unless stored whole
    no_delta = list(map(operator.and_, map(operator.is_, delta, itertools.repeat(None)), no_full))
    return not any(itertools.compress(changed, no_delta))


def _check_roles(tensors: list[TensorRecord], kind: str, parent: Any, differential: Any, new_names: set[str]) -> None:
    """Raise :class:`ManifestError` for the first tensor listed twice or breaking a role rule."""
    names: set[str] = set()
    for rec in tensors:
        name = rec.name
        if name in names:
            raise ManifestError(f"tensor {name!r} listed twice")
        names.add(name)
        delta, full, diff, diff_changed = rec.delta, rec.full, rec.diff, rec.diff_changed
        if (diff or diff_changed) and differential is None:
            raise ManifestError(f"tensor {name!r} has a differential but the version names no base anchor")
        if diff_changed > 0 and not diff:
            raise ManifestError(f"tensor {name!r} differs from its differential base but names no diff object")
        if kind == "anchor" and not full:
            raise ManifestError(f"anchor tensor {name!r} has no full object")
        if kind == "delta" and (parent is None or (full and name not in new_names)):
            raise ManifestError(f"delta tensor {name!r} must have a parent and no full object "
                                "(unless the version lists it in new_tensors)")
        if rec.changed > 0 and not delta and not full:
            raise ManifestError(f"tensor {name!r} changed but names no object")
    raise AssertionError("_roles_hold refused a manifest _check_roles accepts")  # pragma: no cover


def _record(t: Any, i: int, n_objects: int) -> TensorRecord:
    """One tensor record, every field checked on its own (naming the first bad one)."""
    where = f"tensors[{i}]"
    name = check_tensor_name(_get(t, "name", str, where))
    dtype = _get(t, "dtype", str, where)
    if dtype not in DTYPE_SIZES:
        raise ManifestError(f"{where} ({name}): unsupported dtype {dtype!r}")
    shape_list = _get(t, "shape", list, where)
    if len(shape_list) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_NUMEL
                                             for d in shape_list):
        raise ManifestError(f"{where} ({name}): invalid shape {shape_list!r}")
    shape = tuple(shape_list)
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise ManifestError(f"{where} ({name}): {numel} elements is over the {MAX_NUMEL} limit")
    changed = _int(t, "changed", 0, numel, where)
    checksum = _get(t, "checksum", str, where)
    if not _CHECKSUM.match(checksum):
        raise ManifestError(f"{where} ({name}): invalid checksum {checksum!r}")
    delta = _parts(t.get("delta"), n_objects, numel, f"{where} delta", cover=False)
    full = _parts(t.get("full"), n_objects, numel, f"{where} full", cover=True)
    diff = _parts(t.get("diff"), n_objects, numel, f"{where} diff", cover=False)
    diff_changed = _int(t, "diff_changed", 0, numel, where) if "diff_changed" in t else 0
    return TensorRecord(name, dtype, shape, changed, checksum, delta, full, diff, diff_changed)


def _plain_record(t: Any, n_objects: int) -> TensorRecord | None:
    """:func:`_record` for the common shape of a record (every role null or one whole object), in a few
    type checks; None for anything else, which :func:`_record` then checks field by field. It accepts
    only what :func:`_record` accepts, with the same result (``tests/test_manifest_parse.py``)."""
    if type(t) is not dict:
        return None
    name, dtype, shape, changed, checksum = t.get("name"), t.get("dtype"), t.get("shape"), t.get("changed"), \
        t.get("checksum")
    if (type(name) is not str or type(dtype) is not str or type(shape) is not list or type(changed) is not int
            or type(checksum) is not str or dtype not in DTYPE_SIZES or len(shape) > MAX_DIMS
            or not _NAME.match(name) or ".." in name or not _CHECKSUM.match(checksum)):
        return None
    numel = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_NUMEL:
            return None
        numel *= d
    if numel > MAX_NUMEL or not 0 <= changed <= numel:
        return None
    roles = []
    for key in ("delta", "full", "diff"):
        v = t.get(key)
        if v is None:
            roles.append(())
        elif type(v) is int and 0 <= v < n_objects:
            roles.append((Part(v, 0, numel),))
        else:
            return None
    diff_changed = t.get("diff_changed", 0)
    if type(diff_changed) is not int or not 0 <= diff_changed <= numel:
        return None
    return TensorRecord(name, dtype, tuple(shape), changed, checksum, roles[0], roles[1], roles[2], diff_changed)


_NAME_LINES = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,511}\n)*")


_COLUMNS = operator.itemgetter(*TENSOR_FIELDS)


def _tensor_columns(section: dict[str, Any], fields: Sequence[str]) -> tuple[list[Any], ...]:
    """The columns of a ``tensors`` section (1.2: :data:`TENSOR_FIELDS`; 1.3: :data:`VALUE_FIELDS`) or of a
    layout object, in ``fields`` order: exactly those fields, each a list, all of one length;
    :class:`ManifestError` naming what is off."""
    if set(section) != set(fields):
        raise ManifestError(f"the tensor columns are {sorted(section)}, not {sorted(fields)}")
    columns = tuple(section[k] for k in fields)
    for k, c in zip(fields, columns):
        if type(c) is not list:
            raise ManifestError(f"tensor column {k!r} is not a list")
        if len(c) != len(columns[0]):
            raise ManifestError(f"tensor column {k!r} has {len(c)} entries, 'name' has {len(columns[0])}")
    return columns


def _plain_records(ts: list[Any], n_objects: int) -> list[TensorRecord | None]:
    """:func:`_plain_record` of every entry of ``ts``, column by column (C-level passes per field instead
    of one Python call per record, :func:`_plain_columns`) when every entry is plain; else entry by entry.
    Same results (``tests/test_manifest_parse.py``)."""
    if len(ts) < 64 or set(map(type, ts)) != {dict}:
        return [_plain_record(t, n_objects) for t in ts]
    try:  # one C call per entry, then one transpose (an entry lacking a field takes the slow path)
        columns = tuple(zip(*map(_COLUMNS, ts)))
    except KeyError:
        return [_plain_record(t, n_objects) for t in ts]
    got = _plain_columns(columns, n_objects)
    return [_plain_record(t, n_objects) for t in ts] if got is None else got[0]  # type: ignore[return-value]


def _plain_columns(columns: Sequence[Sequence[Any]], n_objects: int, layout: RowLayout | None = None
                   ) -> tuple[list[TensorRecord], RowLayout, tuple[int, ...], tuple[set[int | None], ...]] | None:
    """The records of tensor ``columns`` (:data:`TENSOR_FIELDS` order, equal lengths) when every entry is
    what :func:`_plain_record` accepts, checked a column at a time, their layout, their checksums as
    integers and the distinct values of each role column (delta, full, diff); None otherwise. ``layout``: the
    checked layout of the first three columns, when known."""
    names, dtypes, shapes, changed, checksums, delta, full, diff, diff_changed = columns
    n = len(names)
    if not n:
        return [], RowLayout.of([], [], [], []), (), (set(), set(), set())
    if layout is None:
        layout = _known_layout(names, dtypes, shapes)
    if layout is None:
        layout = _checked_layout(names, dtypes, shapes)
        if layout is None:
            return None
    numels = layout.numels
    sums = _checksum_ints(checksums)
    if sums is None:
        return None
    roles = (delta, full, diff)
    if (set(map(type, changed)) != {int} or set(map(type, diff_changed)) != {int}
            or min(changed) < 0 or min(diff_changed) < 0 or not all(map(operator.le, changed, numels))
            or not all(map(operator.le, diff_changed, numels))
            or not all(set(map(type, r)) <= {int, type(None)} for r in roles)):
        return None
    role_values = tuple(map(set, roles))  # each role's distinct values (types checked on every entry above)
    if not all(_indices_below(v, n_objects) for v in role_values):
        return None
    parts = []
    for role, (r, values) in enumerate(zip(roles, role_values)):  # Parts are immutable: one per (object, numel)
        if values == {None}:
            parts.append(itertools.repeat(()))
            continue
        seen = layout.role_parts.get(role)
        if seen is not None and seen[0] == r:  # the column the last manifest of this layout had
            parts.append(seen[1])
            continue
        table = layout.part_table
        try:
            built = list(map(table.__getitem__, zip(r, numels)))
        except KeyError:  # an (object, numel) no manifest of this layout had: added, then looked up again
            with _LAYOUTS_LOCK:
                if len(table) > 4 * n + 1024:  # bounded, whatever a store's manifests hold
                    table.clear()
                table.update({k: ((Part(k[0], 0, k[1]),) if k[0] is not None else ())
                              for k in set(zip(r, numels)).difference(table)})
            built = list(map(table.__getitem__, zip(r, numels)))
        layout.role_parts[role] = (list(r), built)
        parts.append(built)
    # one C call per record (tuple.__new__ skips TensorRecord.__new__: numel and spec come from the layout)
    out = list(map(tuple.__new__, itertools.repeat(TensorRecord),
                   zip(layout.names, layout.dtypes, layout.shapes, changed, checksums, *parts, diff_changed, numels,
                       layout.specs)))
    return out, layout, sums, role_values  # type: ignore[return-value]


def _checksum_ints(checksums: Sequence[Any]) -> tuple[int, ...] | None:
    """Each of ``checksums`` as an integer when every one is 16 lowercase hex digits (what a record's
    checksum must be), else None: one join and one ``bytes.fromhex`` instead of a parse per entry."""
    if set(map(type, checksums)) != {str} or set(map(len, checksums)) != {16}:
        return None
    joined = "".join(checksums)
    if joined != joined.lower():  # fromhex reads upper case too
        return None
    try:
        raw = bytes.fromhex(joined)
    except ValueError:
        return None
    if len(raw) != 8 * len(checksums):  # fromhex skips whitespace
        return None
    return struct.unpack(f">{len(checksums)}Q", raw)


@dataclass(frozen=True)
class RowLayout:
    """The checked layout columns of a parsed manifest (names, dtype names, shapes as parsed) and what
    follows from them (shape tuples, element counts, specs, the manifest's layout key and columns): made
    once per layout and shared by the records of every later manifest with the same columns. Its rows are
    those manifests' tensors in order (:attr:`Manifest.row_layout`)."""

    columns_in: tuple[list[str], list[str], list[list[int]]]
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    numels: list[int]
    specs: list[TensorSpec]
    #: role index -> (its column as last parsed, the parts made from it): successive manifests of one layout
    #: usually store every tensor in the same objects (compared as ints, so checked columns only)
    role_parts: dict[int, tuple[list[int | None], list[Parts]]] = field(default_factory=dict, compare=False)
    #: (object index or None, element count) -> the whole-tensor parts of that role entry, for the entries the
    #: manifests of this layout had so far (cleared beyond four per tensor)
    part_table: dict[tuple[int | None, int], Parts] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, names: list[str], dtypes: list[str], shapes: list[list[int]], numels: list[int]) -> RowLayout:
        names, dtypes = list(names), list(dtypes)  # copies of the columns as checked: the document is the caller's
        tuples = list(map(tuple, shapes))
        known = torch_dtypes_if_loaded()
        specs = [spec_from_name(nm, d, t, k, known) for nm, d, t, k in zip(names, dtypes, tuples, numels)]
        return cls((names, dtypes, [list(x) for x in shapes]), names, dtypes, tuples, numels, specs)

    @functools.cached_property
    def name_set(self) -> frozenset[str]:
        return frozenset(self.names)

    @functools.cached_property
    def name_rank(self) -> np.ndarray:
        """Each row's place in name order (int64, read-only)."""
        order = sorted(range(len(self.names)), key=self.names.__getitem__)
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order), dtype=np.int64)
        rank.flags.writeable = False
        return rank

    @functools.cached_property
    def numel_array(self) -> np.ndarray:
        """Each row's element count (int64, read-only)."""
        got = np.array(self.numels, dtype=np.int64)
        got.flags.writeable = False
        return got

    @functools.cached_property
    def one_dtype(self) -> bool:
        """Whether every row has one dtype."""
        return len(set(self.dtypes)) <= 1

    @functools.cached_property
    def key(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple(zip(self.names, self.dtypes, self.shapes))

    @functools.cached_property
    def columns(self) -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
        return self.names, [s.dtype for s in self.specs], self.shapes


#: the layouts of the manifests parsed last (a reader follows one model, a process few), by tensor count and
#: first and last name; a hit needs the very same columns
_LAYOUTS: dict[tuple[int, str, str], RowLayout] = {}
_MAX_LAYOUTS = 4
_LAYOUTS_LOCK = threading.Lock()


#: the layouts of the layout objects parsed last, by digest (an object's bytes are verified against its digest
#: when read, so a digest names one layout for good)
_LAYOUT_OBJECTS: dict[str, RowLayout] = {}


def _remember_layout_object(digest: str, layout: RowLayout) -> None:
    with _LAYOUTS_LOCK:
        if len(_LAYOUT_OBJECTS) >= _MAX_LAYOUTS:
            _LAYOUT_OBJECTS.pop(next(iter(_LAYOUT_OBJECTS)))
        _LAYOUT_OBJECTS[digest] = layout


def _known_layout(names: list[Any], dtypes: list[Any], shapes: list[Any]) -> RowLayout | None:
    """The layout already checked for exactly these columns, or None."""
    first, last = names[0], names[-1]
    if type(first) is not str or type(last) is not str:
        return None
    got = _LAYOUTS.get((len(names), first, last))
    if got is None:
        return None
    seen_names, seen_dtypes, seen_shapes = got.columns_in
    # equal lists of strings are the same strings; equal shapes could still hold 2.0 or True for 2 or 1; the
    # dtypes are looked up again (the table of dtypes this reader knows decides, not the one it knew then)
    if (names == seen_names and dtypes == seen_dtypes and shapes == seen_shapes
            and set(map(type, itertools.chain.from_iterable(shapes))) <= {int} and set(dtypes) <= DTYPE_SIZES.keys()):
        return got
    return None


def _checked_layout(names: list[Any], dtypes: list[Any], shapes: list[Any]) -> RowLayout | None:
    """The layout of these columns when every entry is what :func:`_plain_record` accepts (kept for
    :func:`_known_layout`), else None."""
    n = len(names)
    if not (set(map(type, names)) == set(map(type, dtypes)) == {str} and set(map(type, shapes)) == {list}
            and set(dtypes) <= DTYPE_SIZES.keys()):
        return None
    joined = "\n".join(names) + "\n"
    if (".." in joined or joined.count("\n") != n or _NAME_LINES.fullmatch(joined) is None
            or max(map(len, shapes)) > MAX_DIMS):
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and not (set(map(type, dims)) == {int} and min(dims) >= 0 and max(dims) <= MAX_NUMEL):
        return None
    numels = list(map(math.prod, shapes))
    if max(numels) > MAX_NUMEL:
        return None
    layout = RowLayout.of(names, dtypes, shapes, numels)
    with _LAYOUTS_LOCK:  # manifests are parsed on several threads
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[(n, names[0], names[-1])] = layout
    return layout


def _indices_below(values: Iterable[int | None], n: int) -> bool:
    """Whether every value that is not None lies in ``[0, n)``."""
    got = set(values)
    got.discard(None)
    return not got or (min(got) >= 0 and max(got) < n)  # type: ignore[type-var]


def _names(doc: dict[str, Any], key: str) -> tuple[str, ...]:
    """An optional list of distinct tensor names (``new_tensors``, ``dropped_tensors``)."""
    value = doc.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_PARTS * 16:
        raise ManifestError(f"manifest field {key!r} must be a list of tensor names")
    out = tuple(check_tensor_name(v) for v in value)
    if len(set(out)) != len(out):
        raise ManifestError(f"manifest field {key!r} lists a name twice")
    return out
