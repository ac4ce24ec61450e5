"""Writing a staged overlay into a live target: every write's undo noted first, nothing undone here.

:func:`write_sparse` writes an overlay's net changes (one kernel scatter per
element width for plain CPU tensors, torch index writes for the others) and
its layout changes (tensors held whole copied in or set, dropped tensors
deleted). The caller owns the undo steps it hands out and runs them, newest
first, when anything fails (:class:`deltastore.pull.transaction.UndoLog`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .. import segments
from ..tensors import bits_view, plain_cpu
from .checks import fits
from .staging import SparseOverlay, _Pending


def write_sparse(target: Mapping[str, torch.Tensor], overlay: SparseOverlay, undo: list[Callable[[], object]],
                 copies: Mapping[str, list[str]] | None = None, owner: Any = None,
                 drop: list[str] | None = None) -> None:
    """Write the overlay's net changes into ``target``, each write's undo step appended to ``undo`` first.

    Plain CPU tensors are written by one kernel scatter per element width
    (first touches staged as a batch are scattered straight from it);
    every other tensor (accelerator, subclass) through a torch index write.
    Then the layout changes (:attr:`SparseOverlay.whole`, ``drop``): a held
    tensor is copied into the target's tensor when that one has its dtype and
    shape, else set as a new tensor in ``owner`` (the caller's mapping;
    :func:`check_target` made sure it is one); the ``drop`` names are deleted
    from ``owner``. Nothing is undone here: whatever raises, the caller runs ``undo`` newest first (the
    tensor whose write failed is in it too: a write may land in part), as
    :class:`deltastore.pull.transaction.UndoLog` does.
    """
    direct: list[tuple[list[torch.Tensor], torch.Tensor, np.ndarray, torch.Tensor, torch.Tensor]] = []
    done: set[str] = set()
    fast = overlay._fast
    batched = overlay._batched
    for k, (names, pos, bits, orig, bounds) in enumerate(overlay.batches):
        # a batch is written as it is while it holds the staged changes of each of its tensors and each is
        # still the target's own (the same tensor object, or one over the same memory)
        if all(batched.get(n) == k for n in names) and all(fast.get(n) is target.get(n) or n in fast and
                                              fast[n].data_ptr() == target[n].data_ptr() for n in names):
            direct.append(([fast[n] for n in names], pos, bounds, bits, orig))
            done.update(names)
    with torch.no_grad():
        batch: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
        for name, dest in _pending_destinations(overlay.pending, copies, done):
            p = overlay.pending[name]
            if not p.positions.numel():
                continue
            t = target[dest]
            flat = bits_view(t)
            if plain_cpu(t):
                tl, pl, bl, ol = batch.setdefault(flat.element_size(), ([], [], [], []))
                tl.append(flat)
                pl.append(p.positions)
                bl.append(p.bits)
                ol.append(p.original if dest == name else flat[p.positions])
                continue
            pos = p.positions.to(flat.device)
            orig = p.original if dest == name else flat[pos].cpu()
            undo.append(lambda flat=flat, pos=pos, orig=orig: flat.index_put_((pos,), orig.to(flat.device)))
            flat[pos] = p.bits.to(flat.device)
        for tl, pl, bl, ol in batch.values():
            direct.append((tl, segments.cat(pl), segments.bounds_of([q.numel() for q in pl]), segments.cat(bl),
                           segments.cat(ol)))
        for tl, pos, bounds, bits, orig in direct:
            undo.append(lambda tl=tl, pos=pos, bounds=bounds, orig=orig: segments.scatter(tl, pos, bounds, orig))
            segments.scatter(tl, pos, bounds, bits)
            torch.autograd.graph.increment_version(tl)
        for tl in overlay.tensors_written_in_place():  # in the target already (the caller undoes them)
            torch.autograd.graph.increment_version(tl)
        if overlay.whole or drop:
            _write_layout(target, overlay, copies, owner, drop or [], undo)


_ABSENT = object()


def _write_layout(target: Mapping[str, torch.Tensor], overlay: SparseOverlay, copies: Mapping[str, list[str]] | None,
                  owner: Any, drop: list[str], undo: list[Callable[[], object]]) -> None:
    """The layout part of :func:`write_sparse` (whole tensors in, dropped tensors out), undoable."""
    device = next((t.device for t in target.values()), torch.device("cpu"))
    for name, bits, dest in _destinations(overlay.whole, copies):
        spec = overlay.whole_specs[name]
        t = target.get(dest)
        if fits(t, spec):
            flat = bits_view(t)
            backup = flat.to("cpu", copy=True)
            undo.append(lambda flat=flat, backup=backup: flat.copy_(backup.to(flat.device)))
            flat.copy_(bits.to(flat.device))
            continue
        where = t.device if t is not None else device
        new = bits.to(where, copy=True).view(spec.dtype).reshape(spec.shape)
        _replace(owner, dest, new, undo)
    for name in drop:
        if name in owner:
            _replace(owner, name, _ABSENT, undo)


def _replace(owner: Any, name: str, value: Any, undo: list[Callable[[], object]]) -> None:
    """``owner[name] = value`` (or delete it, for ``_ABSENT``) with its undo noted first."""
    prev = owner[name] if name in owner else _ABSENT

    def restore() -> None:
        if prev is _ABSENT:
            if name in owner:
                del owner[name]
        else:
            owner[name] = prev

    undo.append(restore)
    if value is _ABSENT:
        del owner[name]
    else:
        owner[name] = value


def _destinations(items: Mapping[str, Any], copies: Mapping[str, list[str]] | None
                  ) -> Iterator[tuple[str, Any, str]]:
    for name, item in items.items():
        yield name, item, name
        for alias in (copies or {}).get(name, ()):
            yield name, item, alias


def _pending_destinations(pending: Mapping[str, _Pending], copies: Mapping[str, list[str]] | None,
                          done: set[str]) -> Iterator[tuple[str, str]]:
    """``(name, destination)`` of every staged tensor still to write: its own name unless ``done`` (written
    from its batch), and its aliases."""
    for name in pending:
        if name not in done:
            yield name, name
        for alias in (copies or {}).get(name, ()):
            yield name, alias
