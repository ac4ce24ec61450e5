"""An anchor, streamed object by object into its destination.

:func:`stream_anchor` fetches the anchor's full objects with a bounded
read-ahead, decodes each, writes its tensors (or parts of tensors) where they
go and drops the object, so a pull holds a few objects at a time. An object
of whole tensors bound for plain CPU tensors is decoded straight into them
when its codec can place its output (``dense`` format 2.1: no decode buffer,
no copy); any other is decoded, checked, then copied:

* into a live target (``dests``: per tensor the contiguous tensor to write, or a flat bit view of it;
  ``alias_dests``: the alias copies that get the same bits): each tensor's old bits are saved in
  an :class:`~deltastore.pull.undo.UndoJournal` before its first write, so the
  caller can put the target back if anything fails later;
* into new tensors (``dests`` None, or a tensor ``dests`` does not name: one
  whose layout changes later on the path): the decoded bits become the result,
  or, with a ``sink``, are handed to it tensor by tensor once verified and not
  kept (a reader that only compares, such as a resuming publisher measuring
  its drift, then holds a few objects, not the model).

Every tensor's full checksum is compared with the manifest once all its parts
are in (read back from where they were written), in one kernel pass per
object for CPU tensors.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping

import numpy as np
import torch

from .. import progress, segments
from ..checksum import full_checksum, tensor_keys
from ..errors import ChecksumMismatchError, ManifestError
from ..manifest import Manifest
from ..store import DeltaStore
from ..tensors import all_plain_cpu, bits_view, plain_cpu, plain_cpu_groups
from .objects import decode_object, decode_object_into, object_index, part_of, record_of, stream_objects
from .undo import SaveAhead, UndoJournal


class WriteFailed(Exception):
    """A write into the target raised (the cause is chained); the caller restores and reports it."""


def stream_anchor(store: DeltaStore, am: Manifest, *, workers: int, ahead: int,
                  dests: Mapping[str, torch.Tensor] | None = None,
                  alias_dests: Mapping[str, list[torch.Tensor]] | None = None, journal: UndoJournal | None = None,
                  verify: bool = True, sink: Callable[[str, torch.Tensor], None] | None = None
                  ) -> dict[str, torch.Tensor]:
    """Write anchor ``am``'s tensors into ``dests`` (per tensor a contiguous tensor, or a flat bit view of
    it, of the record's dtype and element count; ``alias_dests``: the alias copies that receive the same
    bits); return the others as new flat bit tensors, or, with ``sink``, call ``sink(name, flat bits)`` for
    each of them once it is complete and verified (then the result is empty). Raises what decoding
    raises, :class:`ChecksumMismatchError`, :class:`WriteFailed`, and what saving old bits into
    ``journal`` raises."""
    alias_dests = alias_dests or {}
    index = object_index(am, "full")
    placed = [_placeable(pairs, dests, alias_dests) for pairs in index.values()]
    # when every object is decoded straight into plain CPU tensors, the journal saves the next objects'
    # old bits on a thread of its own while this one decodes (nothing else saves into it meanwhile)
    saver = (journal.saving_ahead(placed) if journal is not None and all(f is not None for f in placed)
             else None)
    try:
        return _write(store, am, index, placed, saver, workers=workers, ahead=ahead, dests=dests,
                      alias_dests=alias_dests, journal=journal, verify=verify, sink=sink)
    finally:
        if saver is not None:
            saver.close()


def _write(store: DeltaStore, am: Manifest, index: dict[int, list], placed: list[list[torch.Tensor] | None],
           saver: SaveAhead | None, *, workers: int, ahead: int, dests: Mapping[str, torch.Tensor] | None,
           alias_dests: Mapping[str, list[torch.Tensor]], journal: UndoJournal | None, verify: bool,
           sink: Callable[[str, torch.Tensor], None] | None) -> dict[str, torch.Tensor]:
    """The body of :func:`stream_anchor`: ``placed[k]`` is what :func:`_placeable` found for the ``k``-th
    object of ``index``; with ``saver``, their old bits are being saved ahead into ``journal``."""
    records = am.tensor_map()
    received = dict.fromkeys(records, 0)
    out: dict[str, torch.Tensor] = {}
    bar = progress.current()
    progress.grow(bar, am.object_bytes(set(index)))
    for k, (i, data) in enumerate(stream_objects(store, am, list(index), workers=workers, ahead=ahead)):
        progress.advance(bar, len(data))
        pairs = index[i]
        flats = placed[k]
        if flats is not None:
            if saver is not None:
                saver.wait(k)
            elif journal is not None:
                journal.save_many(flats)
            if decode_object_into(am, i, data, pairs, flats):
                del data
                recs = list(map(record_of, pairs))
                complete = list(map(_NAME, recs))
                received.update(zip(complete, map(_NUMEL, recs)))
                if verify:
                    _verify(am, complete, flats)
                continue
        decoded = decode_object(am, i, data, pairs, "full", None)
        del data
        complete = []
        copies: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # plain CPU writes, by width
        for t, p, u in decoded:
            whole = t.is_whole(p)
            if dests is None or t.name not in dests:
                if whole:
                    out[t.name] = u.bits
                else:
                    buf = out.get(t.name)
                    if buf is None:
                        buf = out[t.name] = torch.empty(t.numel, dtype=u.bits.dtype)
                    buf[p.offset:p.offset + p.numel].copy_(u.bits)
            else:
                for flat in (bits_view(dests[t.name]), *alias_dests.get(t.name, ())):
                    if journal is not None:
                        journal.save(flat)
                    dst = flat if whole else flat[p.offset:p.offset + p.numel]
                    if plain_cpu(flat) and u.bits.is_cpu and u.bits.is_contiguous():
                        srcs, dsts = copies.setdefault(dst.element_size(), ([], []))
                        srcs.append(u.bits)
                        dsts.append(dst)
                        continue
                    try:
                        with torch.no_grad():
                            dst.copy_(u.bits)
                    except Exception as e:
                        raise WriteFailed(f"writing {t.name!r} into the target failed: {e!r}") from e
            received[t.name] += p.numel
            if received[t.name] == t.numel:
                complete.append(t.name)
        for srcs, dsts in copies.values():  # every tensor of the object in one kernel call per width
            try:
                segments.copy(srcs, dsts)
            except Exception as e:
                raise WriteFailed(f"writing {len(dsts)} tensors of object {i} into the target failed: {e!r}") from e
        del decoded, copies
        if verify and complete:
            _verify(am, complete, [dests[n] if dests is not None and n in dests else out[n] for n in complete])
        if sink is not None:
            for n in complete:
                if n in out:
                    sink(n, out.pop(n))
    missing = [n for n, got in received.items() if got != records[n].numel]
    if missing:
        raise ManifestError(f"anchor {am.step} does not hold every element of {missing[:5]}")
    return out


_NAME, _OFFSET, _NUMEL = operator.attrgetter("name"), operator.attrgetter("offset"), operator.attrgetter("numel")


def _placeable(pairs: list, dests: Mapping[str, torch.Tensor] | None,
               alias_dests: Mapping[str, list[torch.Tensor]]) -> list[torch.Tensor] | None:
    """The flat view each tensor of an object goes to, when a decoder may write them itself: every
    tensor whole, with one destination (no alias copies), a plain CPU tensor. None otherwise."""
    if dests is None:
        return None
    recs, parts = list(map(record_of, pairs)), list(map(part_of, pairs))
    names = list(map(_NAME, recs))
    out = list(map(dests.get, names))
    if (any(map(operator.is_, out, itertools.repeat(None))) or any(map(alias_dests.__contains__, names))
            or any(map(_OFFSET, parts)) or list(map(_NUMEL, parts)) != list(map(_NUMEL, recs))
            or not all_plain_cpu(out)):
        return None
    return out


def _verify(am: Manifest, names: list[str], tensors: list[torch.Tensor]) -> None:
    """Compare each named tensor's full checksum (of the bits of ``tensors[i]``, in ``names`` order) with
    the manifest's; plain CPU tensors in one kernel pass and one array compare per element width."""
    want = am.checksum_values
    groups, others = plain_cpu_groups(tensors)
    for i in others:
        if full_checksum(names[i], tensors[i]) != want[names[i]]:
            _mismatch(am, names[i])
    for at in groups.values():
        group = [names[i] for i in at]
        got = segments.full_sums([tensors[i] for i in at], tensor_keys(group, len(group)))
        off = np.flatnonzero(got != np.fromiter(map(want.__getitem__, group), dtype=np.uint64, count=len(group)))
        if off.size:
            _mismatch(am, group[int(off[0])])


def _mismatch(am: Manifest, name: str) -> None:
    raise ChecksumMismatchError(
        f"version {am.step}, tensor {name!r}: checksum after decoding the anchor does not match the manifest "
        f"(the base it was applied to differs from the publisher's, or the data is corrupt)")
