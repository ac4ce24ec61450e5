"""The committed end of a publisher's chain, and the policy's decision for the next version.

A :class:`ChainHead` holds what the next version is written against: the
parent (``last``), the anchor, every tensor's checksum, the drift since the
anchor (:class:`~deltastore.publish.drift.DriftTracker`) and the measured
:class:`~deltastore.publish.anchors.ChainState` the anchor policy sees. It changes in
two moves only:

1. :meth:`ChainHead.decide` — before the objects are written: is the version an
   anchor, does it also get a differential (anchor -> now)? Pure: nothing moves.
2. :meth:`ChainHead.advance` — after the manifest is committed: parent,
   checksums, drift and chain state move forward together. A version that fails
   before its commit leaves the head as it was.

:class:`~deltastore.Publisher` owns one; :class:`~deltastore.ShardedPublisher`
keeps one per rank, decides on rank 0 from the ranks' summed drift and moves
the other ranks' heads with :meth:`ChainHead.adopt`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .anchors import AnchorPolicy, ChainState
from ..codecs import TensorSpec
from .drift import DriftTracker
from ..errors import StepOrderError, VersionExistsError
from ..manifest import MAX_STEP, Manifest, VersionRef
from ..store import DeltaStore


#: the drift tracker holds at most this fraction of the model's bytes (then it samples: ``deltastore.publish.drift``),
#: and never less than ``DRIFT_MEMORY_MIN`` bytes' worth exactly
DRIFT_MEMORY_FRACTION = 1 / 1024
DRIFT_MEMORY_MIN = 1 << 20


@dataclass(frozen=True)
class Decision:
    """What the policy chose for one version: full objects (``is_anchor``), a differential (``with_diff``)."""

    is_anchor: bool
    with_diff: bool


def check_step(step: Any, store: DeltaStore | None, last_step: int | None) -> None:
    """Raise :class:`StepOrderError` unless ``step`` is an integer in ``[0, MAX_STEP]`` above ``last_step``, and
    :class:`VersionExistsError` if ``store`` (None: not asked) already holds it."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise StepOrderError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    if store is not None and store.has_version(step):
        raise VersionExistsError(f"version {step} already exists in {store.uri}")
    if last_step is not None and step <= last_step:
        raise StepOrderError(f"step {step} is not above the last published step {last_step}")


class ChainHead:
    """Parent, anchor, checksums, drift and chain state of the last committed version (see the module)."""

    def __init__(self, policy: AnchorPolicy):
        self.policy = policy
        self.last: VersionRef | None = None
        self.anchor: VersionRef | None = None
        self.state = ChainState()
        self.drift = DriftTracker()
        #: tensor name -> checksum (int) of the last committed version
        self.checksums: dict[str, int] = {}
        #: a layout change since the last anchor: drift and differentials are off until the next anchor
        self.relaid_since_anchor = False
        self._budget_for: Mapping[str, TensorSpec] | None = None
        self._budget = DRIFT_MEMORY_MIN

    def drift_budget(self, specs: Mapping[str, TensorSpec]) -> int:
        """Bytes the drift may hold for a model of ``specs``: ``DRIFT_MEMORY_FRACTION`` of its bytes, at least
        ``DRIFT_MEMORY_MIN`` (sized once per layout)."""
        if self._budget_for is not specs:
            model = sum(s.nbytes for s in specs.values())
            self._budget_for, self._budget = specs, max(DRIFT_MEMORY_MIN, int(model * DRIFT_MEMORY_FRACTION))
        return self._budget

    def tracks_drift(self, relaid_now: bool = False) -> bool:
        """Whether the version being written measures drift: the policy asks for it and no layout change
        since the anchor (``relaid_now``: this version changes the layout) moved positions under it."""
        return self.policy.tracks_drift and not relaid_now and not self.relaid_since_anchor

    def decide(self, *, same_layout: bool, drift_elements: int, total: int, tracking: bool) -> Decision:
        """The policy's choice for the next version. ``same_layout``: it continues the chain (a parent);
        ``drift_elements`` of ``total``: elements that would differ from the anchor after it;
        ``tracking``: a drift proposal exists for it (a differential needs one). Moves nothing."""
        now = ChainState(**{**self.state.__dict__, "drift": drift_elements / max(total, 1),
                            "drift_elements": drift_elements})
        is_anchor = not same_layout or self.policy.should_anchor(now)
        with_diff = (tracking and not is_anchor and self.anchor is not None
                     and self.policy.should_differential(now))
        return Decision(is_anchor, with_diff)

    def advance(self, manifest: Manifest, digest: str, decision: Decision, *, checksums: dict[str, int],
                proposed: Any = None, drift_elements: int = 0, relaid: bool = False) -> None:
        """``manifest`` (digest ``digest``) is committed: it becomes the parent, ``checksums`` the tensors'
        checksums, ``proposed`` (from :meth:`DriftTracker.propose`) the drift; the anchor moves to it when
        it is one. ``relaid``: it changed the layout."""
        self.checksums = checksums
        self.relaid_since_anchor = not decision.is_anchor and (self.relaid_since_anchor or relaid)
        self.last = VersionRef(manifest.step, digest)
        delta_bytes = manifest.object_bytes(manifest.step_objects)
        c = self.state
        per_element = delta_bytes / manifest.changed if manifest.parent is not None and manifest.changed \
            else c.bytes_per_element
        if decision.is_anchor:
            self.anchor = self.last
            self.drift.reset()
            self.state = ChainState(anchor_bytes=manifest.object_bytes(manifest.full_objects),
                                    bytes_per_element=per_element)
            return
        if proposed is not None:
            self.drift.commit(proposed)
        self.state = ChainState(
            versions_since_anchor=c.versions_since_anchor + 1,
            delta_bytes_since_anchor=c.delta_bytes_since_anchor + delta_bytes,
            anchor_bytes=c.anchor_bytes, drift=drift_elements / max(manifest.total, 1),
            drift_elements=drift_elements,
            delta_bytes_since_differential=0 if decision.with_diff
            else c.delta_bytes_since_differential + delta_bytes,
            bytes_per_element=per_element)

    def adopt(self, last: VersionRef, anchor: VersionRef | None, decision: Decision, proposed: Any = None) -> None:
        """A version another rank committed (:class:`~deltastore.ShardedPublisher`): parent and anchor move to
        what it says, and this rank's share of the drift (``proposed``) is committed or, after an anchor, reset."""
        self.last, self.anchor = last, anchor
        if decision.is_anchor:
            self.drift.reset()
        elif proposed is not None:
            self.drift.commit(proposed)

    def reset(self) -> None:
        """Forget the drift (the next version starts a new chain, or the writer restarts from the store)."""
        self.drift.reset()
