"""What a pull checks about its target before it writes anything; nothing here writes.

Every tensor of the version must be in the target with its dtype and shape,
contiguous (:func:`check_layout`), or, across a layout change, laid out as the
new version wants or replaceable (:func:`check_target`, :func:`fits`,
:func:`holds_layout`); none may share storage where the version keeps two
tensors (:func:`check_tied`), overlap another or lie in read-only memory
(:func:`check_overlaps`). :func:`check_checksums` compares a whole target with
a version's full checksums (``Subscriber.verify`` and ``identify``). Each
refusal is a :class:`TargetMismatchError` (or :class:`ChecksumMismatchError`)
naming the tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, MutableMapping

import numpy as np
import torch

from .. import segments
from ..checksum import full_checksum, tensor_keys
from ..errors import ChecksumMismatchError, TargetMismatchError
from ..layout import describe, layout_diff, layout_of, same_spec
from ..manifest import Manifest, TensorRecord
from ..tensor_spec import TensorSpec
from ..tensors import bits_view, plain_cpu_groups
from .writable import in_read_only_memory


def check_layout(target: Mapping[str, torch.Tensor], manifest: Manifest) -> dict[str, list[str]]:
    """Every manifest tensor must exist in ``target`` with the same dtype and shape, contiguous.

    Returns ``primary name -> [alias names]`` for the manifest's aliases that
    the target holds as separate tensors (they receive the same writes).
    Raises :class:`TargetMismatchError` naming the first offending tensor.
    Other extra target tensors are allowed and left alone.
    """
    if not _layout_holds(target, manifest):
        for rec in manifest.tensors:  # names the first tensor that is off
            _check_tensor(target.get(rec.name), rec, rec.name, manifest.step)
    copies: dict[str, list[str]] = {}
    records = manifest.tensor_map() if manifest.aliases else {}
    for alias, primary in manifest.aliases.items():
        if alias in target:
            _check_tensor(target[alias], records[primary], alias, manifest.step)
            copies.setdefault(primary, []).append(alias)
    return copies


_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


def _layout_holds(target: Mapping[str, torch.Tensor], manifest: Manifest) -> bool:
    """Whether every tensor of ``manifest`` is in ``target`` with its dtype and shape, contiguous: one
    C-level pass per property (no call per tensor); False also for anything :func:`_check_tensor` would
    have to look at one by one."""
    names, dtypes, shapes = manifest.layout_columns
    try:
        ts = list(map(target.__getitem__, names))
        return (list(map(_DTYPE, ts)) == dtypes and list(map(_SHAPE, ts)) == shapes
                and all(map(torch.Tensor.is_contiguous, ts)))
    except (KeyError, AttributeError, TypeError):
        return False


def _check_tensor(t: torch.Tensor | None, rec: TensorRecord, name: str, step: int) -> None:
    if t is None:
        raise TargetMismatchError(f"target has no tensor {name!r} (version {step} has it)")
    if t.dtype is not rec.spec.dtype or t.shape != rec.shape:
        raise TargetMismatchError(f"target tensor {name!r} is {t.dtype}{tuple(t.shape)}, "
                                  f"version {step} has {rec.dtype}{list(rec.shape)}")
    if not t.is_contiguous():
        raise TargetMismatchError(f"target tensor {name!r} is not contiguous")


def check_checksums(tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """Every tensor of ``manifest`` (and each alias ``tensors`` holds apart) must hold the bits of its full
    checksum: :class:`ChecksumMismatchError` naming the ones that differ, :class:`TargetMismatchError` for
    a layout that is off (:func:`check_layout`). Plain CPU tensors in one kernel pass per element width."""
    copies = check_layout(tensors, manifest)
    pairs = [(r, dest) for r in manifest.tensors for dest in [r.name, *copies.get(r.name, [])]]
    sums = _full_checksums([(r.name, bits_view(tensors[dest])) for r, dest in pairs])
    bad = [dest for (r, dest), cs in zip(pairs, sums) if cs != int(r.checksum, 16)]
    if bad:
        raise ChecksumMismatchError(f"{len(bad)} tensor(s) differ from version {manifest.step}: {bad[:5]}")


def _full_checksums(items: list[tuple[str, torch.Tensor]]) -> list[int]:
    """Whole checksums of ``(name, flat bits)`` pairs; plain CPU tensors in one kernel pass per element width."""
    out: list[int | None] = [None] * len(items)
    groups, others = plain_cpu_groups([t for _, t in items])
    for i in others:
        out[i] = full_checksum(*items[i])
    for idx in groups.values():
        keys = tensor_keys([items[i][0] for i in idx], len(idx))
        for i, v in zip(idx, segments.full_sums([items[i][1] for i in idx], keys).tolist()):
            out[i] = v
    return out  # type: ignore[return-value]


def can_relayout(target: object) -> bool:
    """Whether a pull may add, replace and delete entries of ``target`` (a mapping; a Module may not)."""
    return isinstance(target, MutableMapping)


def check_target(target: object, tensors: Mapping[str, torch.Tensor], manifest: Manifest,
                 held: Manifest | None) -> tuple[dict[str, list[str]], list[str]]:
    """:func:`check_layout` for a target that holds version ``held`` (None: unknown), which may be laid out
    otherwise than ``manifest``; nothing is written. Returns the alias copies and the tensors to delete.

    The rule depends only on the two versions, never on the path a pull
    takes. A tensor whose dtype or shape differs between ``held`` and
    ``manifest`` (or that only ``manifest`` has) is written in place when the
    target already holds it as ``manifest`` wants; otherwise only a mapping
    target can take it (a new tensor under that name), and a fixed-layout
    target (a Module) raises :class:`TargetMismatchError` naming it. A tensor
    only ``held`` has is deleted from a mapping target; a fixed-layout target
    holding it raises. Every other tensor, and every tensor of a target whose
    version is unknown, must be in the target with its dtype and shape, as in
    :func:`check_layout`.
    """
    if held is None or held.layout_key == manifest.layout_key:
        return check_layout(tensors, manifest), []
    diff = layout_diff(held, manifest)
    changed = set(diff.whole)
    flexible = can_relayout(target)
    records = manifest.tensor_map()

    def check(name: str, rec: TensorRecord) -> None:
        if rec.name not in changed:
            _check_tensor(tensors.get(name), rec, name, manifest.step)
            return
        t = tensors.get(name)
        if fits(t, rec.spec):
            return  # already laid out as the version wants: written in place
        if not flexible:
            have = "lacks it" if t is None else f"holds {describe(_spec_of(t))}"
            raise TargetMismatchError(
                f"version {manifest.step} changes the layout of tensor {name!r} to {describe(rec.spec)} and the "
                f"target {have}; a {type(target).__name__} cannot add or re-lay tensors (pull into a dict, or "
                "change the model's layout first)")

    for rec in manifest.tensors:
        check(rec.name, rec)
    copies: dict[str, list[str]] = {}
    for alias, primary in manifest.aliases.items():
        if alias in tensors:
            check(alias, records[primary])
            copies.setdefault(primary, []).append(alias)
    drop = [n for n in diff.dropped if n in tensors and n not in manifest.aliases]
    if drop and not flexible:
        raise TargetMismatchError(f"version {manifest.step} drops tensor {drop[0]!r}, which the target holds; a "
                                  f"{type(target).__name__} cannot drop tensors")
    return copies, drop


def holds_layout(tensors: Mapping[str, torch.Tensor], held: Manifest | None, wanted: Manifest) -> bool:
    """False when ``tensors`` are laid out otherwise than version ``held`` (None: not known, True) where
    ``wanted``'s layout differs from it.

    (A model resized by its owner after its last pull: it no longer holds
    that version, and a delta from it would be read against the wrong
    layout.) Where both versions agree, a mismatch is left to the layout
    check, which names it.
    """
    if held is None or held.layout_key == wanted.layout_key:
        return True
    final = layout_of(wanted)
    for rec in held.tensors:
        if same_spec(final.get(rec.name), rec.spec):
            continue
        t = tensors.get(rec.name)
        if t is None or t.dtype != rec.spec.dtype or tuple(t.shape) != tuple(rec.shape):
            return False
    return True


def fits(t: torch.Tensor | None, spec: TensorSpec) -> bool:
    """Whether target tensor ``t`` can be written in place with a tensor of ``spec``."""
    return t is not None and t.dtype is spec.dtype and t.shape == tuple(spec.shape) and t.is_contiguous()


def check_tied(manifest: Manifest, tied: Mapping[str, str]) -> None:
    """Refuse a target holding two tensors ``manifest`` stores separately as one storage (tied weights).

    ``tied`` maps the target entries :func:`deltastore.tensors.named_tensors`
    dropped as exact aliases to the entry they alias. Raises
    :class:`TargetMismatchError` naming both.
    """
    if not tied:
        return
    records = manifest.tensor_map()
    for name, kept in tied.items():
        if name in records and kept in records:
            raise TargetMismatchError(f"target tensors {name!r} and {kept!r} share storage, but version "
                                      f"{manifest.step} stores them separately")


def check_overlaps(tensors: Mapping[str, torch.Tensor], manifest: Manifest, copies: Mapping[str, list[str]]) -> None:
    """Refuse a target whose tensors overlap in memory where ``manifest`` stores them separately.

    Writing one would change the other, so the pull would claim a version
    the target does not hold. The written tensors' byte ranges are sorted by
    address (CPU and CUDA pointers share one address space under unified
    addressing; tensors without storage, address 0, are skipped): one
    ``data_ptr``/``nbytes`` per tensor and a numpy sort, no pass over the
    data. Raises :class:`TargetMismatchError` naming both.

    Also refuses (:class:`TargetMismatchError` naming it) a CPU tensor that
    lies in read-only memory (a read-only memory mapping: ``numpy.memmap``
    opened ``"r"`` and wrapped by ``torch.from_numpy``, ...), where a write by
    address would kill the process with SIGSEGV: the same ranges against the
    process's read-only mappings (:mod:`deltastore.pull.writable`).
    """
    names = [r.name for r in manifest.tensors]
    if copies:
        names += [a for aliases in copies.values() for a in aliases]
    ts = [tensors.get(n) for n in names]
    starts = np.fromiter((t.data_ptr() if t is not None else 0 for t in ts), dtype=np.uint64, count=len(ts))
    sizes = np.fromiter((t.nbytes if t is not None else 0 for t in ts), dtype=np.uint64, count=len(ts))
    keep = np.flatnonzero((starts != 0) & (sizes != 0))
    for i in keep[in_read_only_memory(starts[keep], sizes[keep])]:
        t = ts[i]
        assert t is not None
        if t.device.type == "cpu":  # (an accelerator's addresses may share the range space)
            raise TargetMismatchError(
                f"target tensor {names[i]!r} lies in read-only memory (a read-only memory mapping, such as "
                "numpy.memmap(mode='r') or an mmap without PROT_WRITE): writing version "
                f"{manifest.step} into it would crash the process; pull into a writable copy (t.clone())")
    if keep.size < 2:
        return
    order = keep[np.argsort(starts[keep], kind="stable")]
    s, e = starts[order], starts[order] + sizes[order]
    reach = np.maximum.accumulate(e)
    bad = np.flatnonzero(s[1:] < reach[:-1])
    if bad.size:
        j = int(bad[0]) + 1
        i = int(np.flatnonzero(e[:j] > s[j])[0])  # an earlier range that reaches into range j
        raise TargetMismatchError(f"target tensors {names[order[i]]!r} and {names[order[j]]!r} overlap in memory, "
                                  f"but version {manifest.step} stores them separately (writing one would change "
                                  "the other)")


def _spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec("", t.dtype, tuple(t.shape))
