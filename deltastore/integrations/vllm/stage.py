"""Stage a pull without writing: the net changes a target needs, verified, plus its original bits.

:meth:`deltastore.Subscriber.pull` writes into a mapping of checkpoint-named
tensors. A vLLM server has no such mapping (fused, sharded, repacked
parameters), so the vLLM applier needs the *net change* between the version
it serves and the wanted one — ``{name: (positions, new bits, old bits)}`` —
decoded and checksum-verified before anything is touched, and reads the old
bits through a callback (from the served parameters, or from a host mirror).

This module does that with the Subscriber's own planning, decoding and
checksum logic (``SparseOverlay`` / ``FullState``); only the source of the
old bits differs. (Upstream patch proposed: ``Subscriber.stage()``.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ...apply import FullState, SparseOverlay
from ...errors import ParentMismatchError, TargetMismatchError, VersionNotFoundError
from ...manifest import Manifest, VersionRef
from ...subscriber import Subscriber

#: ``reader(name, positions) -> bits`` the target holds at those flat positions (CPU, int view);
#: ``positions=None`` asks for the whole tensor (codecs whose decoder reads the old tensor).
Reader = Callable[[str, "torch.Tensor | None"], torch.Tensor]


class _ReaderTarget(Mapping[str, torch.Tensor]):
    """The target as a mapping, for code that asks for a whole tensor: ``reader(name, None)``."""

    def __init__(self, reader: Reader, names: list[str]):
        self._reader = reader
        self._names = names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._reader(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _ReaderOverlay(SparseOverlay):
    def __init__(self, reader: Reader, base: Manifest):
        super().__init__(_ReaderTarget(reader, [r.name for r in base.tensors]), base)
        self._reader = reader

    def _target_bits(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        return self._reader(name, positions)


@dataclass
class Staged:
    """A verified pull, not yet written.

    route: ``"anchor"`` (``full`` holds every tensor's flat bits), ``"delta"``
    (``pending`` holds the net changes: positions, new bits, the target's
    original bits) or ``"none"`` (already there).
    """

    ref: VersionRef
    manifest: Manifest
    route: Literal["anchor", "delta", "none"]
    full: dict[str, torch.Tensor] | None = None
    pending: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    bytes_fetched: int = 0
    versions_applied: list[int] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.ref.step

    def elements(self) -> int:
        if self.route == "anchor" and self.full is not None:
            return sum(b.numel() for b in self.full.values())
        return sum(p[0].numel() for p in self.pending.values())


def _overlay(reader: Reader, base: Manifest) -> SparseOverlay:
    params = list(inspect.signature(SparseOverlay.__init__).parameters)
    if len(params) > 1 and params[1] == "reader":
        return SparseOverlay(reader, base)
    return _ReaderOverlay(reader, base)


def _from_native(st: Any) -> Staged:
    """Our :class:`Staged` from ``Subscriber.stage()``'s result."""
    state = st.state
    plan = st.plan
    steps = list(getattr(plan, "steps", None) or
                 ([plan.anchor] if plan is not None and plan.anchor is not None else []) +
                 (list(plan.deltas) if plan is not None else []))
    if state is None:
        return Staged(st.ref, st.manifest, "none")
    if isinstance(state, FullState):
        return Staged(st.ref, st.manifest, "anchor", full=dict(state.bits), bytes_fetched=st.bytes_fetched,
                      versions_applied=steps)
    pending = {name: (p.positions, p.bits, p.original) for name, p in state.pending.items() if p.positions.numel()}
    return Staged(st.ref, st.manifest, "delta", pending=pending, bytes_fetched=st.bytes_fetched,
                  versions_applied=steps)


def _fetch(sub: Subscriber, manifest: Manifest, role: str, old):  # noqa: ANN001, ANN202
    fn = getattr(sub, "fetch_updates", None) or getattr(sub, "_decode")
    return fn(manifest, role, old)


def check_specs(manifest: Manifest, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None) -> None:
    """The version's tensors must match the server's checkpoint tensors (names, dtypes, shapes)."""
    if specs is None:
        return
    for rec in manifest.tensors:
        have = specs.get(rec.name)
        if have is None:
            raise TargetMismatchError(f"the served model has no tensor {rec.name!r} (version {manifest.step} has it)")
        if have != (rec.spec.dtype, tuple(rec.shape)):
            raise TargetMismatchError(f"served tensor {rec.name!r} is {have[0]}{list(have[1])}, "
                                      f"version {manifest.step} has {rec.dtype}{list(rec.shape)}")


def _replay(sub: Subscriber, steps: list[int], state: Any, applied: list[int]) -> int:
    """Fetch and apply the deltas ``steps`` onto ``state`` (a FullState or a SparseOverlay, both answering
    ``old`` and ``apply``), appending each to ``applied``; returns the bytes fetched."""
    fetched = 0
    for s in steps:
        dm = sub.store.manifest(s)
        updates, n = _fetch(sub, dm, "delta", state.old)
        fetched += n
        state.apply(dm, updates)
        applied.append(s)
    return fetched


def stage(sub: Subscriber, current: VersionRef | None, reader: Reader | None, step: int | None = None, *,
          allow_anchor: bool = True,
          specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None) -> Staged:
    """Plan, fetch, verify and decode the way from ``current`` to ``step`` (default: latest).

    ``reader`` gives the bits the target holds now (needed for a delta route:
    checksums and old-value codecs); with ``current`` None only an anchor route
    is possible. Raises the same typed errors as :meth:`Subscriber.pull`; the
    target is never touched.
    """
    if step is None:
        step = sub.latest()
        if step is None:
            raise VersionNotFoundError(f"{sub.store.uri} holds no versions yet")
    manifest, digest = sub.store.manifest_with_digest(step)
    ref = VersionRef(step, digest)
    check_specs(manifest, specs)
    if current == ref:
        return Staged(ref, manifest, "none")
    native = getattr(sub, "stage", None)
    if native is not None:  # the Subscriber stages by itself (deltastore >= the staging API)
        return _from_native(native(step, current if reader is not None else None, reader,
                                   allow_anchor=allow_anchor))
    plan = sub.plan(step, current if reader is not None else None)
    if plan.anchor is not None and not allow_anchor:
        held = "an unknown version" if current is None else f"version {current.step}"
        raise ParentMismatchError(f"the server holds {held}, which is not on the delta chain of version {step}; "
                                  "pull with allow_anchor=True to start from an anchor")
    fetched = 0
    applied: list[int] = []
    if plan.anchor is not None:
        am = sub.store.manifest(plan.anchor)
        updates, n = _fetch(sub, am, "full", None)
        fetched += n
        state = FullState(am, updates, verify=sub.verify_anchors)
        applied.append(am.step)
        fetched += _replay(sub, plan.deltas, state, applied)
        return Staged(ref, manifest, "anchor", full=dict(state.bits), bytes_fetched=fetched,
                      versions_applied=applied)
    assert current is not None and reader is not None
    overlay = _overlay(reader, sub.store.manifest(current.step))
    fetched += _replay(sub, plan.deltas, overlay, applied)
    pending = {name: (p.positions, p.bits, p.original) for name, p in overlay.pending.items()
               if p.positions.numel()}
    return Staged(ref, manifest, "delta", pending=pending, bytes_fetched=fetched, versions_applied=applied)
