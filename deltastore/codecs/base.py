"""The codec contract.

A codec turns the updates of a group of tensors into the bytes of one stored
object and back. It is named (``codec_id``), versioned (``format_version``,
``"MAJOR.MINOR"``: a reader refuses another major) and configured by a JSON
dict (``get_config`` / ``from_config``), so a reader rebuilds the decoder from
the manifest alone.

Two shapes of update exist:

* dense (``positions is None``): every element of the tensor, for anchors;
* sparse: the changed elements only, ``positions`` strictly increasing.

A codec declares which it handles (``dense``) and what the decoder needs from
the receiver (``receiver_needs``): ``"nothing"``, ``"old_bits"`` (the
receiver's current bits at the decoded positions, for codecs that store
differences) or ``"old_tensor"`` (the receiver's whole current tensor, for
codecs that model *where* changes happen from the current values; the
decoder calls ``old(name, None)``). A decoder that needs the old bits of
many tensors asks for them in one call, :func:`read_old_bits` (a receiver
that offers ``old.many`` answers with one pass over all of them); one whose
new values follow from the old ones element by element may instead take the
target tensors themselves, :func:`write_in_place`, and read, compute and write
each element in one pass (the receiver then undoes the writes if the version
fails later). An encoder of an ``"old_tensor"`` codec
reads the sender's copy of the previous bits from ``Update.old_tensor``. A sender with the sparse
updates of many tensors as flat arrays hands them over as one :class:`UpdateBatch`
(:meth:`Codec.encode_batch`: the same bytes as :meth:`Codec.encode`; the default splits the batch), and a
reader of a sparse object takes them back the same way (:meth:`Codec.decode_batch`; the default joins
what :meth:`Codec.decode` returns). The library calls both through :func:`encode_batched` and
:func:`decode_batched`, which use a codec's own batch method only where it is defined at or below the
class that defines the per-tensor one (a subclass that overrides ``decode`` alone is never bypassed).
The library validates every decoded update against the manifest
(names, counts, position order and range, dtype) before anything is applied,
so a codec only has to encode and decode (a decoder that writes in place,
:func:`write_in_place`, checks positions as it writes; the rest is checked
after, and the writes are undone if anything is off).
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

import numpy as np
import torch

from ..tensor_spec import TensorSpec

_SPEC_NAME = operator.attrgetter("name")

OldBits = Callable[[str, Optional[torch.Tensor]], torch.Tensor]
"""``old(name, positions) -> raw bits`` the receiver holds at those flat positions.

``positions`` is an int64 CPU tensor; ``None`` means the whole tensor (a flat
CPU tensor of the bits dtype, ``numel`` elements, which the decoder must not
modify). Only codecs with ``receiver_needs == "old_tensor"`` pass ``None``."""

RECEIVER_NEEDS = ("nothing", "old_bits", "old_tensor")


def read_old_bits(old: OldBits, names: Sequence[str], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
    """The receiver's bits of ``names[i]`` at ``positions[bounds[i]:bounds[i + 1]]`` for every ``i``, back to back.

    ``positions``: int64 CPU tensor (each tensor's flat positions in turn);
    ``bounds``: ``len(names) + 1`` int64 offsets into it. A receiver that has
    a ``many(names, positions, bounds)`` method answers in one call (one
    kernel pass over every tensor instead of one gather per tensor); any
    other :data:`OldBits` is asked tensor by tensor. All names must share one
    bits dtype. Raises whatever the receiver raises; :class:`ValueError` if it
    answers with the wrong number of elements.
    """
    many = getattr(old, "many", None)
    if many is not None:
        out = many(list(names), positions, bounds)
    else:
        b = bounds.tolist()
        out = torch.cat([old(n, positions[b[i]:b[i + 1]]).reshape(-1) for i, n in enumerate(names)]) if names \
            else positions.new_empty(0)
    if out.numel() != positions.numel():
        raise ValueError(f"the receiver gave {out.numel()} old values for {positions.numel()} positions")
    return out


@dataclass
class InPlace:
    """Target tensors a decoder updates where they lie (:func:`write_in_place`).

    Tensor ``i`` is ``lengths[i]`` elements of ``dtype`` (the bits view of its element width) at address
    ``pointers[i]``, memory the receiver keeps alive. ``sums[i]`` (uint64, zero at first) is for the change
    the writes make to tensor ``i``'s checksum (:mod:`deltastore.checksum`, tensor key ``keys[i]``);
    ``done[i]`` (bool, all False at first) is to be set once every position of tensor ``i`` is written.
    ``undo`` is for the decoder to set before its first write: a callable that puts back the bits the
    tensors marked done held before (the receiver calls it if the version fails).
    """

    pointers: np.ndarray
    lengths: np.ndarray
    dtype: np.dtype
    done: np.ndarray
    keys: np.ndarray
    sums: np.ndarray
    undo: Callable[[], None] | None = None


def write_in_place(old: OldBits, names: Sequence[str], bounds: np.ndarray) -> InPlace | None:
    """The target tensors ``names`` for a decoder to update in place, where the receiver allows it.

    ``bounds``: ``len(names) + 1`` int64 offsets, tensor ``i``'s changes being ``bounds[i]:bounds[i + 1]``
    (from the object's header; nothing is decoded yet). A receiver with an ``in_place(names, bounds)``
    method may answer (the Subscriber's does for a pull one delta behind, into plain CPU tensors); every
    other answers None, and the decoder reads the old bits with :func:`read_old_bits` instead. A decoder
    that takes an :class:`InPlace` must set its ``undo`` first, then for each tensor write its new bits at
    exactly its positions, recording the checksum change in ``sums``, the whole tensor or none of it (then
    ``done``), never touching anything outside the tensors (positions checked as it goes), and return a
    :class:`WrittenBatch` for those tensors: the receiver checks the counts and checksums and calls
    ``undo`` if anything fails.
    """
    get = getattr(old, "in_place", None)
    return get(names.copy() if isinstance(names, list) else list(names), bounds) if get is not None else None


@dataclass(frozen=True)
class WrittenBatch:
    """Sparse updates of several tensors that a decoder wrote into the receiver's tensors itself
    (:func:`write_in_place`): no positions or bits are kept, only each tensor's count (``bounds``, as in
    :class:`UpdateBatch`) and what the writes did (``target``: the checksum changes, ``done``, ``undo``)."""

    specs: list[TensorSpec]
    bounds: np.ndarray
    target: InPlace


class RowSpecs(list):  # type: ignore[type-arg]
    """A list of :class:`TensorSpec` that are rows of one table (a parsed manifest's layout), with what the
    reader knows of them as arrays, so that the built-in decoders' helpers need no pass per tensor.

    ``rows``: int64, each spec's row in ``table`` (the table's list of names, compared by identity);
    ``numels``: int64, each spec's element count; ``name_sorted``: the specs are in name order;
    ``one_dtype``: they all have one dtype. The facts are the maker's word (the read path makes them from the
    parsed layout, :func:`deltastore.pull.objects.decode_sparse_object`). To anything else it is the list it
    is: a codec may ignore the facts, and :meth:`copy` keeps them (a slice or ``list()`` does not).
    """

    __slots__ = ("rows", "table", "numels", "name_sorted", "one_dtype")

    def __init__(self, specs: Sequence[TensorSpec], rows: np.ndarray, table: list[str], numels: np.ndarray,
                 name_sorted: bool, one_dtype: bool):
        super().__init__(specs)
        self.rows, self.table, self.numels = rows, table, numels
        self.name_sorted, self.one_dtype = name_sorted, one_dtype

    def copy(self) -> RowSpecs:  # type: ignore[override]
        return RowSpecs(self, self.rows, self.table, self.numels, self.name_sorted, self.one_dtype)

    def names(self) -> RowNames:
        """The specs' names, carrying the same rows."""
        return RowNames(map(_SPEC_NAME, self), self.rows, self.table)


class RowNames(list):  # type: ignore[type-arg]
    """Tensor names that are rows ``rows`` (int64) of ``table`` (a list of names, compared by identity): a
    receiver that lays its tensors out as ``table`` finds them by row instead of by name
    (:meth:`deltastore.pull.staging.SparseOverlay.in_place`). Otherwise a plain list of names."""

    __slots__ = ("rows", "table")

    def __init__(self, names: Any, rows: np.ndarray, table: list[str]):
        super().__init__(names)
        self.rows, self.table = rows, table

    def copy(self) -> RowNames:  # type: ignore[override]
        return RowNames(self, self.rows, self.table)


def spec_names(specs: Sequence[TensorSpec]) -> list[str]:
    """The names of ``specs`` (a :class:`RowNames` when they are :class:`RowSpecs`)."""
    return specs.names() if isinstance(specs, RowSpecs) else list(map(_SPEC_NAME, specs))


def copy_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """A list of ``specs`` of the caller's own (a :class:`RowSpecs` keeps its facts)."""
    return specs.copy() if isinstance(specs, list) else list(specs)


@dataclass
class Update:
    """One tensor's content in an object.

    bits: flat raw bits (integer view dtype, CPU): every element when
        ``positions`` is None, else the new bits at ``positions``.
    positions: int64 strictly increasing flat positions, or None (dense).
    old_bits: for encoders only, the previous bits at ``positions``.
    old_tensor: for encoders only, the whole previous tensor as flat raw bits
        (what the receiver holds); required by ``"old_tensor"`` codecs.
    """

    spec: TensorSpec
    bits: torch.Tensor
    positions: torch.Tensor | None = None
    old_bits: torch.Tensor | None = field(default=None, repr=False)
    old_tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return int(self.bits.numel())


@dataclass
class UpdateBatch:
    """The sparse updates of several tensors of one bits dtype as flat arrays (no object per tensor).

    specs: the tensors, in the order their elements lie in the arrays.
    positions: int64 CPU tensor, each tensor's strictly increasing flat positions in turn.
    bounds: int64 numpy array of ``len(specs) + 1`` offsets: tensor ``i``'s elements are
        ``bounds[i]:bounds[i + 1]`` of every array.
    bits: the new bits at ``positions`` (integer view dtype, CPU).
    old_bits: for encoders only, the previous bits at ``positions``, or None.
    old_tensors: for encoders only, the whole previous tensor (flat raw bits) of the tensors whose
        encoding reads it (:meth:`Codec.needs_for`), by name; usually none or a few.
    """

    specs: list[TensorSpec]
    positions: torch.Tensor
    bounds: np.ndarray
    bits: torch.Tensor
    old_bits: torch.Tensor | None = field(default=None, repr=False)
    old_tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def updates(self, idxs: Sequence[int] | None = None) -> list[Update]:
        """One :class:`Update` per tensor (all, or those at ``idxs``): views into the arrays, a few
        microseconds per tensor."""
        b = self.bounds.tolist()
        return [self._update(i, b[i], b[i + 1]) for i in (range(len(self.specs)) if idxs is None else idxs)]

    def update(self, i: int) -> Update:
        """The :class:`Update` of tensor ``i`` alone (O(1): no pass over the bounds)."""
        return self._update(i, int(self.bounds[i]), int(self.bounds[i + 1]))

    def _update(self, i: int, lo: int, hi: int) -> Update:
        spec = self.specs[i]
        return Update(spec, self.bits[lo:hi], self.positions[lo:hi],
                      self.old_bits[lo:hi] if self.old_bits is not None else None, self.old_tensors.get(spec.name))

    @classmethod
    def join(cls, updates: Sequence[Update]) -> UpdateBatch:
        """One batch of sparse ``updates`` (one bits dtype, every one with positions), in their order: one
        copy per array (none when they lie back to back already; the batch is then read-only).
        Raises :class:`ValueError` for a dense update or mixed dtypes."""
        from ..segments import bounds_of, joined

        if any(u.positions is None for u in updates):
            raise ValueError("a batch holds sparse updates only")
        if len({u.bits.dtype for u in updates}) > 1:
            raise ValueError("a batch holds one bits dtype")
        if not updates:
            return cls([], torch.empty(0, dtype=torch.int64), bounds_of([]), torch.empty(0, dtype=torch.int16))
        bits = joined([u.bits.reshape(-1) for u in updates])
        positions = joined([u.positions for u in updates])  # type: ignore[misc]
        return cls([u.spec for u in updates], positions, bounds_of([u.count for u in updates]), bits)

    def subset(self, idxs: Sequence[int]) -> UpdateBatch:
        """The batch of the tensors at ``idxs``, in that order: one copy per array, or itself when it is
        every tensor in order."""
        if list(idxs) == list(range(len(self.specs))):
            return self
        from ..segments import take

        arrays = [self.positions, self.bits] + ([self.old_bits] if self.old_bits is not None else [])
        got, bounds = take(arrays, self.bounds, np.asarray(idxs, dtype=np.int64))
        specs = [self.specs[i] for i in idxs]
        return UpdateBatch(specs, got[0], bounds, got[1], got[2] if self.old_bits is not None else None,
                           {s.name: self.old_tensors[s.name] for s in specs if s.name in self.old_tensors})


class Codec(abc.ABC):
    """Encode a group of updates to one object's bytes and back."""

    codec_id: ClassVar[str]
    format_version: ClassVar[str] = "1.0"
    dense: ClassVar[bool] = False
    receiver_needs: ClassVar[Literal["nothing", "old_bits", "old_tensor"]] = "nothing"
    #: format majors this class can decode (default: only its own ``format_version``'s major)
    readable_majors: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def reads_major(cls, major: str) -> bool:
        """Whether objects written with format major ``major`` are decodable by this class."""
        return major == cls.format_version.split(".")[0] or major in cls.readable_majors

    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable constructor arguments (stored in the manifest)."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        """Rebuild the codec from :meth:`get_config`'s output."""
        return cls(**config)

    def describe(self) -> dict[str, Any]:
        """The manifest's codec record: id, format version and config."""
        return {"id": self.codec_id, "version": self.format_version, "config": self.get_config()}

    def needs_for(self, spec: TensorSpec, changed: int) -> Literal["nothing", "old_bits", "old_tensor"]:
        """What the encoder wants in the :class:`Update` of this tensor (default: ``receiver_needs``).

        A codec that reads the old tensor for some tensors only (``auto``)
        answers per tensor, so a sender whose previous bits live elsewhere (a
        GPU mirror) copies a whole tensor only when it will be read.
        """
        return self.receiver_needs

    def estimate_size(self, spec: TensorSpec, changed: int) -> int:
        """Bytes this codec is expected to store for one tensor of ``spec``.

        ``changed`` is the number of changed elements (sparse codecs); dense
        codecs store every element and may ignore it. Callers (the Publisher's
        sparse-or-whole choice) compare estimates instead of knowing any
        codec's layout. The default is the raw layout: the new bits plus an
        int32 (int64 past 2**31 elements) index per changed element, or the
        whole tensor's bits for a dense codec. It is an upper bound for the
        built-in codecs, not a measurement; codecs that compress override it.
        """
        item = spec.bits_dtype.itemsize
        if self.dense:
            return spec.numel * item
        return changed * (item + (4 if spec.numel < 2**31 else 8))

    @abc.abstractmethod
    def encode(self, updates: Sequence[Update]) -> bytes:
        """Bytes of one object holding ``updates`` (all dense or all sparse, per ``self.dense``)."""

    def encode_batch(self, batch: UpdateBatch) -> bytes:
        """:meth:`encode` of ``batch.updates()``: the same bytes, for a sparse codec.

        The default makes one :class:`Update` per tensor; a codec whose encoder works on flat arrays
        anyway overrides it, so that encoding many small tensors costs their elements, not their count.
        Raises what :meth:`encode` raises.
        """
        return self.encode(batch.updates())

    @abc.abstractmethod
    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        """Updates for exactly the tensors in ``specs`` from ``data``.

        Raises :class:`CorruptObjectError` when ``data`` cannot be decoded.
        """

    def decode_batch(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None
                     ) -> list[UpdateBatch | WrittenBatch]:
        """:meth:`decode` of a sparse codec's object as flat batches: every tensor of ``specs`` in exactly
        one batch, each batch of one bits dtype, the tensors in any order (a decoder that took tensors in
        place, :func:`write_in_place`, returns them as a :class:`WrittenBatch`).

        The default joins what :meth:`decode` returns (one copy per array, the tensors in ``specs``
        order); a codec whose decoder makes flat arrays anyway overrides it, so that decoding many
        small tensors costs their elements, not their count. Raises what :meth:`decode` raises, and
        :class:`CorruptObjectError` when it returns other tensors than ``specs`` or a dense update.
        """
        from ..errors import CorruptObjectError

        got = self.decode(data, specs, old)
        if len(got) != len(specs) or not all(s.name in got for s in specs):
            raise CorruptObjectError(f"{self.codec_id}: decoded tensors {sorted(got)[:5]}, expected "
                                     f"{[s.name for s in specs][:5]}")
        ups = []
        for s in specs:
            u = got[s.name]
            if u.positions is None:
                raise CorruptObjectError(f"{self.codec_id}: a sparse object decoded {s.name!r} as a dense update")
            ups.append(Update(s, u.bits, u.positions))
        return batches_by_dtype(ups)

    def decode_into(self, data: bytes, specs: Sequence[TensorSpec], dests: Sequence[torch.Tensor]) -> bool:
        """:meth:`decode` of a dense codec's object written straight into ``dests``, when the codec can.

        ``dests[i]`` receives the bits of ``specs[i]`` (a whole tensor): a contiguous CPU tensor of that
        many elements of the spec's element width. Returns False, having written nothing, when this
        codec (the default) or this object's format cannot place its output; the caller then decodes
        with :meth:`decode` and copies. A codec whose decoder writes into buffers it is handed
        overrides it, so that an anchor lands in its target with no second copy. Raises
        :class:`CorruptObjectError` when ``data`` cannot be decoded (``dests`` may then hold part of
        the object: the caller keeps what it needs to undo), ``ValueError`` when a destination does
        not fit its spec (nothing written).
        """
        return False

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({cfg})"


def batches_by_dtype(updates: Sequence[Update]) -> list[UpdateBatch]:
    """:meth:`UpdateBatch.join` of sparse ``updates``, one batch per bits dtype (in first-seen order)."""
    groups: dict[torch.dtype, list[Update]] = {}
    for u in updates:
        groups.setdefault(u.bits.dtype, []).append(u)
    return [UpdateBatch.join(g) for g in groups.values()]


def _defined_at_or_below(codec: Codec, batch: str, single: str) -> bool:
    """Whether the class defining ``codec.<batch>`` is the one defining ``codec.<single>`` or a subclass of it."""
    mro = type(codec).__mro__
    where = {name: next(i for i, c in enumerate(mro) if name in vars(c)) for name in (batch, single)}
    return where[batch] <= where[single]


def encode_batched(codec: Codec, batch: UpdateBatch) -> bytes:
    """``codec.encode_batch(batch)``, or the per-tensor default when a subclass overrides only ``encode``."""
    if _defined_at_or_below(codec, "encode_batch", "encode"):
        return codec.encode_batch(batch)
    return Codec.encode_batch(codec, batch)


def decode_placed(codec: Codec, data: bytes, specs: Sequence[TensorSpec], dests: Sequence[torch.Tensor]) -> bool:
    """``codec.decode_into(...)``, or False (nothing written) when a subclass overrides only ``decode``."""
    return _defined_at_or_below(codec, "decode_into", "decode") and codec.decode_into(data, specs, dests)


def decode_batched(codec: Codec, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None
                   ) -> list[UpdateBatch | WrittenBatch]:
    """``codec.decode_batch(...)``, or the per-tensor default when a subclass overrides only ``decode``."""
    if _defined_at_or_below(codec, "decode_batch", "decode"):
        return codec.decode_batch(data, specs, old)
    return Codec.decode_batch(codec, data, specs, old)
