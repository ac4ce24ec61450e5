"""A streamed capture: diff ``(name, tensor)`` pairs against the mirror as they arrive, holding few of them.

``Publisher.publish`` given an iterator (not a mapping or a module) on a chain
whose layout it knows hands it here: tensors are compared in pieces of about
:data:`STREAM_PIECE_BYTES` and dropped, so the caller may produce each tensor
just in time (a gathered FSDP2 shard, a TRL ``send_weights`` stream) and
publish memory stays the mirror, one piece and the changes. When the stream
leaves the known layout (a tensor added, dropped, reshaped, re-typed, out of
order, or a tied alias that no longer matches its primary), :func:`diff_stream`
gives the stream back whole, the tensors already compared rebuilt from the
mirror and their changes, so the ordinary capture (layout change, new chain)
takes over.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..codecs import TensorSpec
from ..diff import Change, find_changes
from ..errors import TargetMismatchError
from ..tensors import checked_pairs
from .mirror import DEFAULT_CHUNK_ELEMS, Diff, Mirror

#: tensors compared per kernel call (a piece): small tensors share one fused compare
STREAM_PIECE_BYTES = 64 << 20


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

    Returns a :class:`Streamed` whose ``diff`` covers every tensor of ``specs``
    in their order when the stream matched the layout, or whose ``pairs`` is the
    whole stream (compared tensors rebuilt) when it did not. Raises
    :class:`TargetMismatchError` for a non-string name, a non-tensor or a name given twice.
    """
    it: Iterator[tuple[str, torch.Tensor]] = checked_pairs(items)
    order: list[str] = []
    piece: dict[str, torch.Tensor] = {}
    piece_bytes = 0
    changes: dict[str, Change] = {}
    sums: dict[str, int] = {}
    flat: list = []
    alias_changes: dict[str, Change] = {}
    ok = True

    def flush() -> None:
        nonlocal piece_bytes
        if piece:
            d = mirror.diff(piece, chunk_elems=chunk_elems, only=piece.keys())
            changes.update(d.changes)
            sums.update(d.sums)
            flat.extend(d.flat)
            piece.clear()
            piece_bytes = 0

    for name, t in it:
        if not isinstance(name, str):
            raise TargetMismatchError(f"tensor names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TargetMismatchError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if name in changes or name in piece or name in alias_changes:
            raise TargetMismatchError(f"duplicate tensor name {name!r}")
        primary = aliases.get(name)
        sp = specs.get(primary if primary is not None else name)
        dt = cast if cast is not None and t.is_floating_point() else t.dtype
        if sp is None or sp.dtype is not dt or tuple(t.shape) != sp.shape or not t.is_contiguous():
            ok = False  # the layout changed: hand everything to the ordinary capture
            piece[name] = t
            order.append(name)
            break
        order.append(name)
        if primary is not None:  # tied: must equal its primary, checked once both are compared
            alias_changes[name] = find_changes(mirror.view(primary), t, chunk_elems=chunk_elems, dtype=sp.dtype)
            continue
        piece[name] = t
        piece_bytes += t.numel() * t.element_size()
        if piece_bytes >= STREAM_PIECE_BYTES:
            flush()
    if ok:
        flush()
        ok = (set(changes) == set(specs) and set(alias_changes) == set(aliases)
              and all(_same_change(ch, changes[aliases[a]]) for a, ch in alias_changes.items()))
    if ok:
        return Streamed(diff=Diff({n: sums[n] for n in specs}, flat, changes={n: changes[n] for n in specs}))
    rebuilt = {n: _rebuild(mirror, specs[n], changes[n]) for n in changes}
    for a, ch in alias_changes.items():
        rebuilt[a] = _rebuild(mirror, specs[aliases[a]], ch)
    rebuilt.update(piece)
    pairs = [(n, rebuilt[n]) for n in order]
    pairs.extend(it)
    return Streamed(pairs=pairs)


def _rebuild(mirror: Mirror, spec: TensorSpec, ch: Change) -> torch.Tensor:
    """The tensor a compared stream entry held: the mirror's bits with its changes in."""
    bits = mirror.view(spec.name).clone()
    if ch.count:
        bits[ch.positions.to(bits.device)] = ch.new_bits.to(bits.device)
    return bits.view(spec.dtype).reshape(spec.shape)
