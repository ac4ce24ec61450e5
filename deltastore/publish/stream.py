"""A streamed capture: diff ``(name, tensor)`` pairs against the mirror as they arrive, holding none of them.

``Publisher.publish`` given an iterator (not a mapping or a module) on a chain
whose layout it knows hands it here, so the caller may produce each tensor
just in time (a gathered FSDP2 shard, a TRL ``send_weights`` stream) and
publish memory stays the mirror, one piece and the changes.

The contract of a streamed item: it is valid until the next item is
requested. A producer may recycle one buffer for every tensor, write into a
tensor after yielding it, or yield views of one flat buffer it refills. So
every item is compared, or copied, before the next is asked for: a tensor of
:data:`STREAM_COPY_BYTES` or more is compared at once (with the small ones
copied before it); a smaller one is copied (cast to its published dtype, on
the mirror's device) and compared with the other copies once
:data:`STREAM_PIECE_BYTES` of them are held, so small tensors still share
one fused compare.

When the stream leaves the known layout (a tensor added, dropped, reshaped,
re-typed, or a tied alias that no longer matches its primary),
:func:`diff_stream` gives the stream back whole for the ordinary capture
(layout change, new chain): the tensors already compared rebuilt from the
mirror and their changes, the rest copied as they arrive
(:func:`owned_items`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codecs import TensorSpec
from .diff import find_changes
from ..segments import Change
from ..errors import TargetMismatchError
from ..tensors import bits_view, check_item
from .mirror import DEFAULT_CHUNK_ELEMS, Diff, Mirror

#: copies of small tensors compared per kernel call (a piece): they share one fused compare
STREAM_PIECE_BYTES = 64 << 20
#: a tensor this large is compared as it arrives (no copy); a smaller one is copied into the piece
STREAM_COPY_BYTES = 1 << 20


@dataclass
class Streamed:
    """The outcome of :func:`diff_stream`: ``diff`` when the stream kept the layout, else ``pairs``."""

    diff: Diff | None = None
    pairs: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def _same_change(a: Change, b: Change) -> bool:
    return a.count == b.count and torch.equal(a.positions, b.positions) and torch.equal(a.new_bits, b.new_bits)


def diff_stream(items: Iterable[tuple[str, torch.Tensor]], mirror: Mirror, specs: dict[str, TensorSpec],
                aliases: dict[str, str], cast: torch.dtype | None, *,
                chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> Streamed:
    """Compare a stream of ``(name, tensor)`` with ``mirror`` (which holds ``specs``; ``aliases``: tied names).

    Each item is compared or copied before the next is requested (the
    module's contract). Returns a :class:`Streamed` whose ``diff`` covers every
    tensor of ``specs`` in their order when the stream matched the layout, or
    whose ``pairs`` gives the whole stream (compared tensors rebuilt, the
    rest copied as consumed) when it did not. Raises
    :class:`TargetMismatchError` for a non-string name, a non-tensor or a name given twice.
    """
    it: Iterator[tuple[str, torch.Tensor]] = iter(items)
    order: list[str] = []
    piece: dict[str, torch.Tensor] = {}  # copies of small tensors, and at most one live large one
    piece_bytes = 0
    changes: dict[str, Change] = {}
    sums: dict[str, int] = {}
    flat: list = []
    loose: dict[str, Change] = {}  # the tensors the mirror compared one by one (another dtype or device)
    alias_changes: dict[str, Change] = {}
    left: tuple[str, torch.Tensor] | None = None  # the item that left the layout (still valid: not yet past it)

    def flush() -> None:
        nonlocal piece_bytes
        if piece:
            d = mirror.diff(piece, chunk_elems=chunk_elems, only=piece.keys())
            changes.update(d.changes)
            sums.update(d.sums)
            flat.extend(d.flat)
            loose.update(d.loose)
            piece.clear()
            piece_bytes = 0

    for item in it:
        name, t = check_item(item)
        if name in changes or name in piece or name in alias_changes:
            raise TargetMismatchError(f"duplicate tensor name {name!r}")
        primary = aliases.get(name)
        sp = specs.get(primary if primary is not None else name)
        dt = cast if cast is not None and t.is_floating_point() else t.dtype
        if sp is None or sp.dtype is not dt or tuple(t.shape) != sp.shape or not t.is_contiguous():
            left = (name, t)  # the layout changed: hand everything to the ordinary capture
            break
        order.append(name)
        if primary is not None:  # tied: must equal its primary, checked once both are compared
            alias_changes[name] = find_changes(mirror.view(primary), t, chunk_elems=chunk_elems, dtype=sp.dtype)
            continue
        nbytes = t.numel() * t.element_size()
        if nbytes >= STREAM_COPY_BYTES:
            piece[name] = t
            flush()  # compared now, with the copies before it: it may change once the next item is asked for
        else:
            piece[name] = t.detach().to(device=mirror.device, dtype=sp.dtype, copy=True)
            piece_bytes += nbytes
            if piece_bytes >= STREAM_PIECE_BYTES:
                flush()
    if left is None:
        flush()
        if (set(changes) == set(specs) and set(alias_changes) == set(aliases)
                and all(_same_change(ch, changes[aliases[a]]) for a, ch in alias_changes.items())):
            return Streamed(diff=Diff({n: sums[n] for n in specs}, flat, loose,
                                      changes={n: changes[n] for n in specs}))
    rebuilt = {n: _rebuild(mirror, specs[n], changes[n]) for n in changes}
    for a, ch in alias_changes.items():
        rebuilt[a] = _rebuild(mirror, specs[aliases[a]], ch)
    rebuilt.update(piece)  # copies not compared yet
    pairs = [(n, rebuilt[n]) for n in order]
    if left is not None:
        pairs.extend(owned_items(_chain_first(left, it)))
    return Streamed(pairs=pairs)


def owned_items(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's items as private contiguous copies, each made before the next item is requested.

    For a capture that needs the whole stream at once (a new chain, a layout
    change, a quantized or adapter publish). Ties survive: an item at the
    address, layout and device of an earlier one, with the same bits as that
    one's copy, yields that same copy (so it is published as an alias); one with
    other bits is a recycled buffer and gets a copy of its own.
    """
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    for item in items:
        name, t = check_item(item)
        if t.numel() == 0:
            yield name, t.detach().clone()
            continue
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
        copy = seen.get(key)
        if copy is None or not torch.equal(bits_view(copy), bits_view(t.detach().contiguous())):
            copy = seen[key] = t.detach().clone(memory_format=torch.contiguous_format)
        yield name, copy


def _chain_first(first: tuple[str, torch.Tensor], rest: Iterator[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    yield first
    yield from rest


def _rebuild(mirror: Mirror, spec: TensorSpec, ch: Change) -> torch.Tensor:
    """The tensor a compared stream entry held: the mirror's bits with its changes in."""
    bits = mirror.view(spec.name).clone()
    if ch.count:
        bits[ch.positions.to(bits.device)] = ch.new_bits.to(bits.device)
    return bits.view(spec.dtype).reshape(spec.shape)
