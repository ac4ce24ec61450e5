"""Decoded versions staged before the target is touched.

* from an anchor: whole tensors on the host (:class:`FullState`; what
  :meth:`Subscriber.stage` hands integrations, and what a pull without a
  target returns). A pull into a live target streams the anchor in instead,
  under an undo journal (:mod:`deltastore.pull.anchor`, :mod:`deltastore.pull.undo`);
* from the target's current version: per tensor, the union of changed
  positions with their final bits and the target's original bits there
  (:class:`SparseOverlay`), O(changed) memory, checked against the target's
  own bits with the O(changed) checksum.

:mod:`deltastore.pull.apply` then writes an overlay's net changes into the
target.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np
import torch

from .. import segments
from ..checksum import full_checksum, tensor_keys, updated_checksum
from ..codecs import InPlace, OldBits, Update, WrittenBatch, read_old_bits
from ..errors import ChecksumMismatchError, CorruptObjectError
from ..kernels.gather import gather
from ..manifest import Manifest, TensorRecord
from ..tensor_spec import TensorSpec
from ..tensors import bits_dtype, bits_view, plain_cpu, plain_cpu_tensors
from .decoded import DecodedUpdates

_DTYPE, _NAME = operator.attrgetter("dtype"), operator.attrgetter("name")


def _expect(rec: TensorRecord, actual: int, step: int, what: str) -> None:
    if actual != int(rec.checksum, 16):
        raise ChecksumMismatchError(
            f"version {step}, tensor {rec.name!r}: checksum after {what} does not match the manifest "
            f"(the base it was applied to differs from the publisher's, or the data is corrupt)")


class FullState:
    """Whole tensors on the host, as flat bits: an anchor plus any deltas after it."""

    def __init__(self, manifest: Manifest, updates: Mapping[str, Update], *, verify: bool = True):
        self.specs: dict[str, TensorSpec] = {r.name: r.spec for r in manifest.tensors}
        self.bits: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, int] = {}
        for rec in manifest.tensors:
            b = updates[rec.name].bits
            if verify:
                cs = full_checksum(rec.name, b)
                _expect(rec, cs, manifest.step, "decoding the anchor")
            self.checksums[rec.name] = int(rec.checksum, 16)
            self.bits[rec.name] = b

    @classmethod
    def from_bits(cls, manifest: Manifest, bits: Mapping[str, torch.Tensor]) -> FullState:
        """A state over already verified flat bits (an anchor streamed in); the tensors are used, not copied."""
        self = cls.__new__(cls)
        self.specs = {r.name: r.spec for r in manifest.tensors}
        self.bits = {r.name: bits[r.name] for r in manifest.tensors}
        self.checksums = dict(manifest.checksum_values)
        return self

    def old_bits(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        """Bits at ``positions``; ``None``: the whole flat tensor (read-only for the caller)."""
        return self.bits[name] if positions is None else gather(self.bits[name], positions)

    def old_bits_many(self, names: list[str], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
        """:meth:`old_bits` of many tensors at once (see :func:`deltastore.codecs.read_old_bits`)."""
        tensors = [self.bits[n] for n in names]
        if tensors and all(plain_cpu(t) for t in tensors):
            got = _gather_checked(tensors, positions, bounds)
            if got is not None:
                return got
        return read_old_bits(self.old_bits, names, positions, bounds)

    @property
    def old(self) -> OldBits:
        """What a decoder reads: :meth:`old_bits`, batched through :meth:`old_bits_many`."""
        return StagedBits(self)

    def apply(self, manifest: Manifest, updates: Mapping[str, Update]) -> None:
        """Apply one delta version, checking every touched tensor's checksum first.

        A :class:`DecodedUpdates` batch of plain CPU tensors is checked and
        written by one gather, one checksum pass and one scatter (cost follows
        its elements, not its tensor count); anything else tensor by tensor.
        """
        batched = []
        loose: Mapping[str, Update] = updates
        if isinstance(updates, DecodedUpdates):
            loose = dict(updates.loose)
            for b in updates.batches:
                names = [s.name for s in b.specs]
                tensors = [self.bits[n] for n in names]
                old = _gather_checked(tensors, b.positions, b.bounds) if all(map(plain_cpu, tensors)) else None
                if not names or old is None:
                    loose.update((u.spec.name, u) for u in b.updates())
                    continue
                sums = _checked_sums(manifest, names, self.checksums, b.positions, old, b.bits, b.bounds,
                                     "applying the delta")
                batched.append((names, tensors, b, sums))
        staged = []
        for rec in manifest.tensors:
            u = loose.get(rec.name)
            if u is None:
                continue
            cur = self.bits[rec.name]
            if u.positions is None:
                cs = full_checksum(rec.name, u.bits)
            else:
                cs = updated_checksum(rec.name, self.checksums[rec.name], u.positions, cur[u.positions], u.bits)
            _expect(rec, cs, manifest.step, "applying the delta")
            staged.append((rec.name, u, cs))
        for names, tensors, b, sums in batched:
            segments.scatter(tensors, b.positions, b.bounds, b.bits)
            self.checksums.update(zip(names, sums))
        for name, u, cs in staged:
            if u.positions is None:
                self.bits[name].copy_(u.bits)  # in place: the bits may be a caller's buffer
            else:
                self.bits[name][u.positions] = u.bits
            self.checksums[name] = cs

    def relayout(self, manifest: Manifest, updates: Mapping[str, Update]) -> None:
        """Apply version ``manifest``'s layout change: drop its dropped tensors, take its new ones whole.

        ``updates`` holds the whole bits of every tensor in ``manifest.new_tensors``
        (checked against their checksums here). The layout step itself was
        validated beforehand (:func:`deltastore.layout.check_step`).
        """
        for name in manifest.dropped_tensors:
            for d in (self.specs, self.bits, self.checksums):
                d.pop(name, None)
        records = manifest.tensor_map()
        for name in manifest.new_tensors:
            rec = records[name]
            bits = _whole_bits(updates, rec, manifest.step)
            self.specs[name], self.bits[name], self.checksums[name] = rec.spec, bits, int(rec.checksum, 16)
        order = [r.name for r in manifest.tensors]
        self.specs = {n: self.specs[n] for n in order}
        self.bits = {n: self.bits[n] for n in order}

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """Fresh tensors in their own dtype and shape."""
        return {n: b.view(self.specs[n].dtype).reshape(self.specs[n].shape) for n, b in self.bits.items()}


def _whole_bits(updates: Mapping[str, Update], rec: TensorRecord, step: int) -> torch.Tensor:
    """The verified whole bits of a tensor a version stores whole (its ``new_tensors``)."""
    u = updates.get(rec.name)
    if u is None or u.positions is not None or u.count != rec.numel:
        raise CorruptObjectError(f"version {step}, tensor {rec.name!r}: its whole content is not in its objects")
    _expect(rec, full_checksum(rec.name, u.bits), step, "decoding the whole tensor")
    return u.bits


@dataclass
class _Pending:
    positions: torch.Tensor  # sorted union of changed positions (CPU int64)
    bits: torch.Tensor       # final bits there
    original: torch.Tensor   # the target's bits there before the pull


#: a first-touch batch: (names, positions, final bits, original bits, bounds), flat
_Batch = tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]


class _PendingMap(MutableMapping[str, _Pending]):
    """``name -> _Pending``; the tensors of a first-touch batch get their :class:`_Pending` (views into
    the batch's arrays) only when one is asked for, so staging them costs no object per tensor."""

    def __init__(self) -> None:
        self._items: dict[str, _Pending] = {}
        self._lazy: dict[str, tuple[_Batch, int]] = {}
        # :meth:`flat` results until the staged changes next change: a batch touching tensors again is read
        # for its decoder and then merged, with nothing staged in between
        self._flats: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray] | None] = {}

    def add_batch(self, batch: _Batch) -> None:
        names = batch[0]
        self._flats.clear()
        for n in names:
            self._items.pop(n, None)
        self._lazy.update(zip(names, ((batch, i) for i in range(len(names)))))

    def counts(self) -> dict[str, int]:
        """Changed elements per name (from the batches' bounds, no object made)."""
        out = {n: p.positions.numel() for n, p in self._items.items()}
        sizes: dict[int, list[int]] = {}
        for n, (batch, i) in self._lazy.items():
            got = sizes.get(id(batch))
            if got is None:
                got = sizes[id(batch)] = np.diff(batch[4]).tolist()
            out[n] = got[i]
        return out

    def flat(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray] | None:
        """The staged changes of ``names`` back to back, in that order (a name without any: none), as
        ``(positions, bits, original, bounds)``; None when they have none. One kernel copy per array
        (:func:`segments.take_parts` over the batches and entries holding them), no call per name; the same
        ``names`` again before anything is staged: the same arrays (the caller only reads them)."""
        key = tuple(names)
        if key not in self._flats:
            self._flats[key] = self._flat(names)
        return self._flats[key]

    def _flat(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray] | None:
        sources: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]] = []
        seen: dict[int, int] = {}  # id(batch) -> its index in sources
        which = np.full(len(names), -1, dtype=np.int64)  # source of each name (-1: nothing staged)
        local = np.zeros(len(names), dtype=np.int64)  # its segment in that source
        for j, n in enumerate(names):
            got = self._lazy.get(n)
            if got is not None:
                batch, local[j] = got
                k = seen.get(id(batch))
                if k is None:
                    k = seen[id(batch)] = len(sources)
                    sources.append(batch[1:])
            else:
                p = self._items.get(n)
                if p is None:
                    continue
                k = len(sources)
                sources.append((p.positions, p.bits, p.original, np.array([0, p.positions.numel()], np.int64)))
            which[j] = k
        if not sources:
            return None
        # one stream over every source: its elements back to back, its segments' bounds joined, then an empty one
        ends = segments.bounds_of([int(src[3][-1]) for src in sources])
        starts, total = ends[:-1], int(ends[-1])
        first_segment = segments.bounds_of([len(src[3]) - 1 for src in sources])[:-1]
        bounds = np.concatenate([src[3][:-1] + at for src, at in zip(sources, starts)] + [np.array([total, total])])
        idx = np.where(which >= 0, first_segment[which] + local, len(bounds) - 2)
        out = [segments.take_parts([src[a] for src in sources], starts, bounds, idx) for a in range(3)]
        got_bounds = out[0][1]
        if not got_bounds[-1]:
            return None
        return out[0][0], out[1][0], out[2][0], got_bounds

    def __getitem__(self, name: str) -> _Pending:
        p = self._items.get(name)
        if p is not None:
            return p
        (_, pos, bits, orig, bounds), i = self._lazy.pop(name)
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        p = self._items[name] = _Pending(pos[lo:hi], bits[lo:hi], orig[lo:hi])
        return p

    def __setitem__(self, name: str, value: _Pending) -> None:
        self._flats.clear()
        self._lazy.pop(name, None)
        self._items[name] = value

    def __delitem__(self, name: str) -> None:
        self._flats.clear()
        if self._lazy.pop(name, None) is None:
            del self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._lazy

    def holds_any(self, names: list[str]) -> bool:
        """Whether any of ``names`` is staged (C-level passes, no call per name)."""
        return any(map(self._lazy.__contains__, names)) or any(map(self._items.__contains__, names))

    def __iter__(self) -> Iterator[str]:
        yield from list(self._items)
        yield from list(self._lazy)

    def __len__(self) -> int:
        return len(self._items) + len(self._lazy)


Reader = Callable[[str, "torch.Tensor | None"], torch.Tensor]
"""``reader(name, positions) -> bits`` a target holds at flat ``positions`` (CPU, integer view);
``positions=None`` asks for the whole flat tensor on the CPU, which the caller only reads (a view of a
CPU target's own storage, or a copy)."""


def mapping_reader(target: Mapping[str, torch.Tensor]) -> Reader:
    """A :data:`Reader` over a mapping of tensors (any device); whole CPU tensors are given as views."""

    flats: dict[str, torch.Tensor] = {}

    def read(name: str, positions: torch.Tensor | None) -> torch.Tensor:
        flat = flats.get(name)
        if flat is None:
            flat = flats[name] = bits_view(target[name])
        if positions is None:
            return flat if flat.is_cpu else flat.cpu()
        return gather(flat, positions).cpu()

    return read


def _gather_checked(tensors: list[torch.Tensor], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor | None:
    """:func:`segments.gather` once the bounds are in order and cover ``positions`` and the tensors share
    an element width (the kernel checks each position against its tensor and raises ``IndexError``);
    None otherwise (the caller then reads tensor by tensor)."""
    width = tensors[0].element_size()
    if (bounds.size != len(tensors) + 1 or int(bounds[0]) != 0 or int(bounds[-1]) != positions.numel()
            or bool((np.diff(bounds) < 0).any()) or positions.dtype != torch.int64
            or not positions.is_contiguous() or any(t.element_size() != width for t in tensors)):
        return None
    return segments.gather(tensors, positions, bounds)


def _keys(positions: torch.Tensor, bounds: np.ndarray, starts: np.ndarray) -> torch.Tensor:
    """``starts[i] + position`` for the positions of tensor ``i`` (``bounds[i]:bounds[i + 1]``): one sorted
    key space over several tensors when each tensor's positions are sorted."""
    return positions + torch.repeat_interleave(torch.from_numpy(starts), torch.from_numpy(np.diff(bounds)))


def _checked_sums(manifest: Manifest, names: list[str], checksums: Mapping[str, int], positions: torch.Tensor,
                  old: torch.Tensor, new: torch.Tensor, bounds: np.ndarray, doing: str) -> list[int]:
    """The checksums of ``names`` after their changes (tensor ``i``: ``old``/``new`` bits at ``positions``
    ``bounds[i]:bounds[i + 1]``, from ``checksums[name]``), in one pass; :class:`ChecksumMismatchError`
    naming the first tensor whose result is not ``manifest``'s."""
    keys = tensor_keys(names, len(names))
    return _expect_sums(manifest, names, checksums, segments.mix_delta(positions, old, new, bounds, keys), doing)


def _expect_sums(manifest: Manifest, names: list[str], checksums: Mapping[str, int], delta: np.ndarray,
                 doing: str) -> list[int]:
    """``checksums[name] + delta[i]`` for each of ``names`` (uint64, wrapping as the checksum does), or
    :class:`ChecksumMismatchError` naming the first that is not ``manifest``'s."""
    n = len(names)
    before = np.fromiter(map(checksums.__getitem__, names), dtype=np.uint64, count=n)
    after = before + delta  # wraps mod 2**64, as the checksum
    want = np.fromiter(map(manifest.checksum_values.__getitem__, names), dtype=np.uint64, count=n)
    off = np.flatnonzero(after != want)
    if off.size:
        k = int(off[0])
        _expect(manifest.tensor_map()[names[k]], int(after[k]), manifest.step, doing)
    return after.tolist()


class StagedBits:
    """A staged state's bits as a decoder's :data:`~deltastore.codecs.OldBits` (with the batched ``many``)."""

    __slots__ = ("state",)

    def __init__(self, state: FullState | SparseOverlay):
        self.state = state

    def __call__(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        return self.state.old_bits(name, positions)

    def many(self, names: list[str], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
        return self.state.old_bits_many(names, positions, bounds)

    def in_place(self, names: list[str], bounds: np.ndarray) -> InPlace | None:
        offer = getattr(self.state, "in_place", None)
        return offer(names, bounds) if offer is not None else None


@dataclass(frozen=True)
class TargetAddresses:
    """Where a target's tensors lie, as a caller that checked them knows it (:class:`SparseOverlay`'s
    ``addresses``): for tensor ``i`` of ``names`` (the overlay's ``tensors``, in their order, every one a
    plain CPU tensor of one element width: the overlay takes the caller's word for it), ``lengths[i]`` elements of numpy ``dtype`` (that width's bits
    view) at ``pointers[i]``, and its checksum key ``keys[i]`` (:func:`~deltastore.checksum.tensor_keys`)."""

    names: list[str]
    pointers: np.ndarray
    lengths: np.ndarray
    dtype: np.dtype
    keys: np.ndarray

    @functools.cached_property
    def row(self) -> dict[str, int]:
        """``name -> i``."""
        return {n: i for i, n in enumerate(self.names)}

    def rows(self, names: list[str]) -> np.ndarray | None:
        """``i`` of each of ``names`` (read-only), or None when one is not among :attr:`names`; the last answer
        is kept, since a follower's decoder asks for the same names in the same order pull after pull."""
        last = self.__dict__.get("_last_rows")
        if last is not None and last[0] == names:
            return last[1]
        try:
            got = np.fromiter(map(self.row.__getitem__, names), dtype=np.int64, count=len(names))
        except KeyError:
            return None
        got.flags.writeable = False
        self.__dict__["_last_rows"] = (list(names), got)
        return got


class SparseOverlay:
    """Net effect of a run of deltas on a live target, without touching it.

    ``reader`` gives the bits the target holds now; ``base`` is the manifest
    of the version it holds (its checksums start the O(changed) checks).
    ``tensors`` (optional): the target's contiguous tensors (or flat bit views
    of them) by name; for plain CPU tensors among them, the old bits of every
    tensor a delta touches first are gathered, and the checksums checked, in
    one kernel pass per element width instead of a call per tensor (the
    kernels read and write them by address: no view per tensor is made).

    ``addresses`` (optional, :class:`TargetAddresses`): ``tensors``' addresses, lengths and keys as the
    caller checked them; :meth:`in_place` then offers all of them at once without a pass per tensor.
    ``table`` (optional, with ``addresses``): a list of names (compared by identity) that ``tensors``
    follow row for row; names asked as rows of that list (:class:`~deltastore.codecs.base.RowNames`) are
    then found by row, not by name.

    With ``write_through`` (for a path of one delta, whose changes are each
    staged once), a decoder may write a first touch of such tensors straight
    into the target as it decodes (:meth:`in_place`): the overlay is then no
    longer free of writes, and the caller must call :meth:`undo_in_place` if
    the version fails before it is written whole. Those changes are not
    staged: :meth:`apply` checks their checksums from what the decoder
    summed, and :attr:`written_in_place` counts them.
    """

    def __init__(self, reader: Reader, base: Manifest, tensors: Mapping[str, torch.Tensor] | None = None,
                 write_through: bool = False, addresses: TargetAddresses | None = None,
                 table: list[str] | None = None):
        self.reader = reader
        self.write_through = write_through
        # in-place writes made by decoders, oldest first: (names, tensors, their InPlace)
        self._in_place: list[tuple[list[str], list[torch.Tensor], InPlace]] = []
        #: changed elements per tensor that decoders wrote in place (checked by :meth:`apply`)
        self.written_in_place: dict[str, int] = {}
        self.checksums: dict[str, int] = dict(base.checksum_values)
        self.pending = _PendingMap()
        same = addresses is not None and tensors is not None and list(tensors) == addresses.names
        self._fast = dict(tensors) if same else plain_cpu_tensors(tensors) if tensors is not None else {}
        # what :meth:`in_place` offers for all of ``tensors`` at once, when the caller knows it already
        self._addresses = addresses if (addresses is not None and len(self._fast) == len(addresses.names)
                                        and list(self._fast) == addresses.names) else None
        self._table = table if self._addresses is not None else None
        # changes of plain CPU tensors staged as batches: (names, positions, bits, original, bounds); a batch
        # is written by one scatter while it holds the staged changes of every name in it (``_batched``: name
        # -> index of the batch that holds its changes)
        self.batches: list[_Batch] = []
        self._batched: dict[str, int] = {}
        # layout changes: tensors held whole on the host (final flat bits, written or inserted at the end)
        # and tensors to delete from the target
        self.whole: dict[str, torch.Tensor] = {}
        self.whole_specs: dict[str, TensorSpec] = {}
        self.dropped: set[str] = set()
        # batched reads handed to decoders since the last apply, per element width: (names, positions, bits);
        # apply() takes the old bits of a first touch from here instead of gathering them again
        self._read: dict[int, list[tuple[list[str], torch.Tensor, torch.Tensor]]] = {}

    def hold(self, name: str, spec: TensorSpec, bits: torch.Tensor, checksum: int) -> None:
        """Keep ``name`` whole on the host from now on (verified flat ``bits``), not in the target."""
        self.pending.pop(name, None)
        self._batched.pop(name, None)
        self.dropped.discard(name)
        self.whole[name], self.whole_specs[name], self.checksums[name] = bits, spec, checksum

    def relayout(self, manifest: Manifest, updates: Mapping[str, Update]) -> None:
        """Version ``manifest``'s layout change (see :meth:`FullState.relayout`), staged, nothing written."""
        for name in manifest.dropped_tensors:
            for d in (self.pending, self.whole, self.whole_specs, self.checksums):
                d.pop(name, None)
            self._batched.pop(name, None)
            self.dropped.add(name)
        records = manifest.tensor_map()
        for name in manifest.new_tensors:
            rec = records[name]
            self.hold(name, rec.spec, _whole_bits(updates, rec, manifest.step), int(rec.checksum, 16))

    def _target_bits(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        return self.reader(name, positions)

    def old_bits(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        """Bits at ``positions`` as of the deltas applied so far.

        ``None``: the whole flat tensor, read-only: the target's own bits (a
        view for a CPU target) when no staged delta touched it yet, else a
        copy with the staged bits in.
        """
        held = self.whole.get(name)
        if held is not None:
            return held if positions is None else held[positions]
        p = self.pending.get(name)
        if positions is None:
            whole = self.reader(name, None)
            if p is not None and p.positions.numel():
                whole = whole.clone()
                whole[p.positions] = p.bits
            return whole
        old = self._target_bits(name, positions)
        if p is not None and p.positions.numel():
            loc = torch.searchsorted(p.positions, positions).clamp_(max=p.positions.numel() - 1)
            hit = p.positions[loc] == positions
            old[hit] = p.bits[loc[hit]]
        return old

    def old_bits_many(self, names: list[str], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
        """:meth:`old_bits` of many tensors at once (see :func:`deltastore.codecs.read_old_bits`).

        Plain CPU tensors of the target are gathered in one kernel pass, their
        staged changes laid over by one search (:meth:`_old_many`), and the
        result is kept for :meth:`apply`.
        """
        if names and self._touch(names) is not None:
            old = self._old_many(names, positions, bounds)
            if old is not None:
                self._read.setdefault(old.element_size(), []).append((names, positions, old))
                return old
        return read_old_bits(self.old_bits, names, positions, bounds)

    def _old_many(self, names: list[str], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor | None:
        """Bits of plain CPU target tensors ``names`` at ``positions`` (laid out by ``bounds``) as of the deltas
        staged so far, or None where :func:`_gather_checked` refuses the layout. O(elements), no call per
        tensor: the staged changes are found by one search over keys ``offset of the tensor + position``."""
        tensors = [self._fast[n] for n in names]
        old = _gather_checked(tensors, positions, bounds)
        staged = self.pending.flat(names) if old is not None else None
        if staged is None:
            return old
        spos, sbits, _, sbounds = staged
        if segments.overlay_staged((spos, sbits, sbounds), positions, bounds, old):
            return old
        # a decoder read positions out of order: one search over keys ``tensor offset + position`` instead
        starts = segments.bounds_of(segments.lengths(tensors))[:-1]  # where each tensor starts, end to end
        skeys, keys = _keys(spos, sbounds, starts), _keys(positions, bounds, starts)
        loc = torch.searchsorted(skeys, keys).clamp_(max=skeys.numel() - 1)
        hit = skeys[loc] == keys
        old[hit] = sbits[loc[hit]]
        return old

    @property
    def old(self) -> OldBits:
        """What a decoder reads: :meth:`old_bits`, batched through :meth:`old_bits_many`."""
        return StagedBits(self)

    def in_place(self, names: list[str], bounds: np.ndarray) -> InPlace | None:
        """Target tensors ``names`` for a decoder to update in place (:func:`deltastore.codecs.write_in_place`):
        only with ``write_through``, and only when each is a plain CPU tensor of the target that no staged
        delta touched yet, all of one element width; else None. Kept for :meth:`undo_in_place`."""
        if not self.write_through or not names or len(bounds) != len(names) + 1:
            return None
        known = self._addresses
        if known is not None and not self.pending and not self.whole:
            # tensors of the target, none touched yet: rows of the arrays the caller checked (one pass)
            n = len(names)
            given = getattr(names, "rows", None)
            if given is not None and self._table is not None and getattr(names, "table", None) is self._table:
                rows = given  # rows of the list the target's tensors follow (RowNames)
                tensors = list(map(list(self._fast.values()).__getitem__, given.tolist()))
            elif names == known.names:
                rows, tensors = slice(None), list(self._fast.values())
            else:
                rows = known.rows(names)  # None: not the target's tensors, checked one by one below
                tensors = list(map(self._fast.__getitem__, names)) if rows is not None else []
            if rows is not None:
                target = InPlace(np.array(known.pointers[rows]), np.array(known.lengths[rows]), known.dtype,
                                 np.zeros(n, np.bool_), np.array(known.keys[rows]), np.zeros(n, np.uint64))
                self._in_place.append((names, tensors, target))
                return target
        if self._touch(names) is not True:
            return None
        tensors = list(map(self._fast.__getitem__, names))
        width = tensors[0].element_size()
        if len(set(map(_DTYPE, tensors))) > 1 and any(t.element_size() != width for t in tensors):
            return None
        n = len(names)
        dtype = torch.empty(0, dtype=bits_dtype(tensors[0].dtype)).numpy().dtype
        target = InPlace(segments.pointers(tensors), segments.lengths(tensors), dtype, np.zeros(n, np.bool_),
                         tensor_keys(names, n), np.zeros(n, np.uint64))
        self._in_place.append((names, tensors, target))  # before any write: undoable from now on
        return target

    def tensors_written_in_place(self) -> list[list[torch.Tensor]]:
        """The target tensors decoders wrote in place, one list per write."""
        return [tensors for _, tensors, _ in self._in_place]

    def undo_in_place(self) -> int:
        """Put back what decoders wrote in place (newest first, each by the ``undo`` its decoder set, for the
        tensors it finished); returns how many writes refused. Afterwards nothing is left to undo."""
        failed = 0
        for _, _, target in reversed(self._in_place):
            try:
                if target.undo is not None and bool(target.done.any()):
                    target.undo()
            except Exception:  # noqa: BLE001 - counted; the caller reports the target as unknown
                failed += 1
        self._in_place.clear()
        self.written_in_place.clear()
        return failed

    def _touch(self, names: list[str]) -> bool | None:
        """None unless every one of ``names`` is a plain CPU tensor of the target (not held on the host);
        else whether none of them is touched by a staged delta yet (a first touch)."""
        if not all(map(self._fast.__contains__, names)) or any(map(self.whole.__contains__, names)):
            return None
        return not self.pending.holds_any(names)

    @staticmethod
    def _recall(read: list[tuple[list[str], torch.Tensor, torch.Tensor]], names: list[str],
                positions: torch.Tensor) -> torch.Tensor | None:
        """The old bits of ``names`` at ``positions`` if exactly those were read for the decoder (one read,
        or all of them joined), else None."""
        for ns, p, o in read:  # a decoder's batch is usually one of its reads, by the same arrays
            if p.data_ptr() == positions.data_ptr() and p.numel() == positions.numel() and ns == names:
                return o
        if [n for ns, _, _ in read for n in ns] != names:
            return None
        pos = segments.joined([p for _, p, _ in read])
        same = pos.numel() == positions.numel() and (pos.data_ptr() == positions.data_ptr() or
                                                     torch.equal(pos, positions))
        return segments.joined([o for _, _, o in read]) if same else None

    def apply(self, manifest: Manifest, updates: Mapping[str, Update]) -> None:
        """Stage version ``manifest``'s ``updates`` (a :class:`DecodedUpdates` is read batch by batch),
        checking every touched tensor's checksum before anything is staged."""
        staged = []
        held = []
        read, self._read = self._read, {}
        # every tensor's record, made only for a version with changes not written in place already
        written_only = isinstance(updates, DecodedUpdates) and not updates.loose and all(
            isinstance(b, WrittenBatch) for b in updates.batches)
        records = {} if written_only else manifest.tensor_map()
        # changes of plain CPU tensors, flat: (records, positions, new bits, bounds); first touches in
        # ``groups``, batches touching a tensor again in ``again`` (merged with what is staged)
        groups: list[tuple[list[TensorRecord], torch.Tensor, torch.Tensor, np.ndarray]] = []
        again: list[tuple[list[TensorRecord], torch.Tensor, torch.Tensor, np.ndarray]] = []
        loose: Mapping[str, Update] = updates
        written: list[tuple[list[str], WrittenBatch]] = []  # in the target already (see in_place)
        if isinstance(updates, DecodedUpdates):
            loose = dict(updates.loose)
            for b in updates.batches:
                names = list(map(_NAME, b.specs))
                if isinstance(b, WrittenBatch):
                    written.append((names, b))
                    continue
                touch = self._touch(names) if names else None
                if touch is not None:
                    (groups if touch else again).append(([records[n] for n in names], b.positions, b.bits, b.bounds))
                else:
                    loose.update((u.spec.name, u) for u in b.updates())
        batch: dict[int, list[tuple[TensorRecord, Update]]] = {}
        batch_again: dict[int, list[tuple[TensorRecord, Update]]] = {}
        for name, u in loose.items():  # in decoding order: a batch's arrays then often lie back to back
            rec = records[name]
            if rec.name in self.whole:  # held on the host since a layout change: updated there
                cur = self.whole[rec.name]
                cs = full_checksum(rec.name, u.bits) if u.positions is None else \
                    updated_checksum(rec.name, self.checksums[rec.name], u.positions, cur[u.positions], u.bits)
                _expect(rec, cs, manifest.step, "applying the delta")
                held.append((rec.name, u, cs))
                continue
            if u.positions is not None and rec.name in self._fast:
                to = batch if rec.name not in self.pending else batch_again
                to.setdefault(u.bits.element_size(), []).append((rec, u))
                continue
            positions = u.positions if u.positions is not None else torch.arange(rec.numel)
            old = self.old_bits(rec.name, positions)
            cs = updated_checksum(rec.name, self.checksums[rec.name], positions, old, u.bits)
            _expect(rec, cs, manifest.step, "applying the delta to the target")
            staged.append((rec.name, positions, u.bits, old, cs))
        for into, joining in ((groups, batch), (again, batch_again)):
            for group in joining.values():
                positions = segments.joined([u.positions for _, u in group])  # type: ignore[misc]
                into.append(([r for r, _ in group], positions, segments.joined([u.bits for _, u in group]),
                             segments.bounds_of([u.count for _, u in group])))
        written_sums = [_expect_sums(manifest, names, self.checksums, b.target.sums, "applying the delta to the target")
                        for names, b in written]
        firsts = [self._check_touches(manifest, *g, read.get(g[2].element_size(), [])) for g in groups]
        seconds = [self._check_touches(manifest, *g, read.get(g[2].element_size(), [])) for g in again]
        # merged before anything is staged: the staged changes their decoders read are then reused
        merged = [(self._merged(*entry), sums) for entry, sums in seconds]
        for name, positions, bits, old, cs in staged:
            self._merge(name, positions, bits, old)
            self.checksums[name] = cs
        for name, u, cs in held:
            if u.positions is None:
                self.whole[name] = u.bits.clone()
            else:
                self.whole[name][u.positions] = u.bits
            self.checksums[name] = cs
        for (names, b), sums in zip(written, written_sums):
            self.checksums.update(zip(names, sums))
            self.written_in_place.update(zip(names, np.diff(b.bounds).tolist()))
        # first touches are staged as they are; a batch touching tensors again is merged with what they hold
        for entry, sums in firsts + merged:
            self._batched.update(dict.fromkeys(entry[0], len(self.batches)))
            self.batches.append(entry)
            self.pending.add_batch(entry)
            self.checksums.update(zip(entry[0], sums))

    def _check_touches(self, manifest: Manifest, recs: list[TensorRecord], pos: torch.Tensor, new: torch.Tensor,
                       bounds: np.ndarray, read: list[tuple[list[str], torch.Tensor, torch.Tensor]]
                       ) -> tuple[_Batch, list[int]]:
        """One read of the bits before this delta (the decoder's, or a gather with the staged changes laid
        over) and one checksum pass over a batch of plain CPU target tensors; the batch of this delta's
        changes (with those bits as ``original``) and the new checksums, or :class:`ChecksumMismatchError`
        naming the first tensor that is off."""
        names = [r.name for r in recs]
        old = self._recall(read, names, pos)
        if old is None:
            old = self._old_many(names, pos, bounds)
        if old is None:
            raise CorruptObjectError(f"version {manifest.step}: decoded positions do not fit their tensors")
        sums = _checked_sums(manifest, names, self.checksums, pos, old, new, bounds, "applying the delta to the target")
        return (names, pos, new, old, bounds), sums

    def _merged(self, names: list[str], positions: torch.Tensor, bits: torch.Tensor, before: torch.Tensor,
                bounds: np.ndarray) -> _Batch:
        """The batch of the staged changes of ``names`` with one delta's (``bits`` at ``positions``, strictly
        increasing per tensor; ``before``: the bits there until now) laid over: per tensor the sorted union of
        positions, the latest bits, and the target's own bits as ``original``. Linear in the elements
        (:func:`segments.merge_staged`), no call per tensor."""
        staged = self.pending.flat(names)
        if staged is None:  # none of them touched yet: the bits before this delta are the target's own
            return names, positions, bits, before, bounds
        return (names, *segments.merge_staged(staged, positions, bits, before, bounds))

    def _merge(self, name: str, positions: torch.Tensor, bits: torch.Tensor, old: torch.Tensor) -> None:
        p = self.pending.get(name)
        if p is None:  # first touch: the bits before this delta are the target's own
            self.pending[name] = _Pending(positions, bits, old)
            return
        self._batched.pop(name, None)  # its batch entry is stale now: written from ``pending``
        union, inverse = torch.unique(torch.cat([p.positions, positions]), sorted=True, return_inverse=True)
        merged = torch.empty(union.numel(), dtype=bits.dtype)
        original = torch.empty(union.numel(), dtype=bits.dtype)
        n_old = p.positions.numel()
        merged[inverse[:n_old]] = p.bits
        original[inverse[:n_old]] = p.original
        new_loc = inverse[n_old:]
        merged[new_loc] = bits  # later delta wins
        fresh = torch.ones(union.numel(), dtype=torch.bool)
        fresh[inverse[:n_old]] = False
        if bool(fresh.any()):
            original[fresh] = self._target_bits(name, union[fresh])
        self.pending[name] = _Pending(union, merged, original)
