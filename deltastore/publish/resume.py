"""A publisher picking up a chain from the store: its mirror and chain head rebuilt from the latest version.

:func:`resume_chain` reads the latest version through the reader's own path
(bit-exact, checksums verified) into a new :class:`~deltastore.publish.mirror.Mirror`,
and walks the chain back to its anchor to rebuild what the anchor policy
measures (:class:`~deltastore.publish.anchors.ChainState`) and, where the policy
tracks it, the drift since the anchor. :func:`differential_from_anchor` is
that drift measured exactly (the anchor streamed back and compared with the
mirror), also what a version with a sampled drift writes as its differential.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .anchors import ChainState
from ..codecs import TensorSpec
from .diff import find_changes
from ..segments import Change
from .drift import DriftTracker
from ..pull.anchor import stream_anchor
from ..pull.reader import VersionReader
from ..store import DeltaStore
from .chain import ChainHead
from .mirror import Mirror


@dataclass
class ResumedChain:
    """What a publisher continues from: the latest version's bits, layout, tied names and version files."""

    mirror: Mirror
    specs: dict[str, TensorSpec]
    aliases: dict[str, str]
    files: dict[str, dict[str, Any]]


def resume_chain(store: DeltaStore, head: ChainHead, latest: int, *, mirror_device: torch.device | None,
                 workers: int) -> ResumedChain:
    """Rebuild the chain ending at version ``latest``: returns its mirror and layout, and sets ``head`` (parent,
    anchor, checksums, drift, chain state) as if this publisher had written it. Raises what a pull raises
    (a missing or corrupt version or object, :class:`~deltastore.errors.ChecksumMismatchError`)."""
    manifest = store.manifest(latest)
    specs = {t.name: t.spec for t in manifest.tensors}
    mirror = Mirror(specs, mirror_device)
    VersionReader(store).fill({n: mirror.view(n) for n in specs}, step=latest)  # the pull's own path: bit-exact
    mirror.version = latest
    resumed = ResumedChain(mirror, specs, dict(manifest.aliases), dict(manifest.files))
    head.checksums = {t.name: int(t.checksum, 16) for t in manifest.tensors}
    head.last = store.ref(latest)
    # Walk back to the last anchor to rebuild what the policy measures.
    since, delta_bytes, changed, since_diff, m = 0, 0, 0, None, manifest
    while m.kind != "anchor" and m.parent is not None:
        since += 1
        if since_diff is None and m.differential is not None:
            since_diff = delta_bytes
        head.relaid_since_anchor = head.relaid_since_anchor or m.changes_layout
        delta_bytes += m.object_bytes(m.step_objects)
        changed += m.changed
        m = store.manifest(m.parent.step)
    if m.kind != "anchor":
        return resumed  # no anchor on the chain: the policy will ask for one
    head.anchor = store.ref(m.step)
    drift_elements = 0
    if head.tracks_drift() and since:
        changes = differential_from_anchor(store, head, mirror, workers=workers)
        proposed = head.drift.propose({n: changes[n] for n in specs}, budget_bytes=head.drift_budget(specs))
        head.drift.commit(proposed)
        drift_elements = DriftTracker.count(proposed)
    total = sum(s.numel for s in specs.values())
    head.state = ChainState(
        versions_since_anchor=since, delta_bytes_since_anchor=delta_bytes,
        anchor_bytes=m.object_bytes(m.full_objects), drift=drift_elements / max(total, 1),
        drift_elements=drift_elements,
        delta_bytes_since_differential=delta_bytes if since_diff is None else since_diff,
        bytes_per_element=delta_bytes / changed if changed else 0.0)
    return resumed


def differential_from_anchor(store: DeltaStore, head: ChainHead, mirror: Mirror, *, workers: int
                             ) -> dict[str, Change]:
    """The differential (``head``'s anchor -> the version ``mirror`` holds) by streaming the anchor back from
    the store and comparing it with the mirror, tensor by tensor (a few anchor objects in memory; the
    differential itself, 12 B per drifted element, while it is used). Raises what an anchor pull raises
    (:class:`~deltastore.errors.ChecksumMismatchError`, a corrupt object)."""
    assert head.anchor is not None
    am = store.manifest(head.anchor.step)
    changes: dict[str, Change] = {}
    stream_anchor(store, am, workers=workers, ahead=1, verify=True,
                  sink=lambda name, bits: changes.__setitem__(name, find_changes(bits, mirror.view(name))))
    return changes


__all__ = ["ResumedChain", "differential_from_anchor", "resume_chain"]
