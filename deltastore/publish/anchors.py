"""Anchor policies: when a version also gets full objects, and when a differential.

A policy sees :class:`ChainState` (measured by the Publisher) and answers two
questions before each version is written:

* :meth:`AnchorPolicy.should_anchor`: write every tensor whole as well, so a
  joiner can start here;
* :meth:`AnchorPolicy.should_differential`: write the union of changes since
  the last anchor ("anchor -> now"), so a joiner needs the anchor, this one
  differential and the deltas after it instead of the whole chain.

``every(n)`` is the fixed schedule. ``adaptive`` (the default) decides from
bytes and drift; its cost model is in ``docs/anchors.md``. Policies are
plugins: register more under the entry-point group ``deltastore.anchor_policies``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from ..registry import anchor_policies as _registry


@dataclass(frozen=True)
class ChainState:
    """What a policy knows when a new version is about to be written.

    versions_since_anchor: versions committed after the last anchor.
    delta_bytes_since_anchor: bytes of their delta objects.
    anchor_bytes: bytes of the last anchor's full objects.
    drift: fraction of all elements whose bits differ from the last anchor
        (a union over the chain, not a sum), after the version being written.
    drift_elements: the same as a count.
    delta_bytes_since_differential: delta bytes after the last differential
        (or the anchor when there is none): what a joiner replays after it.
    bytes_per_element: recent delta bytes per changed element (estimates a
        differential's size as ``drift_elements * bytes_per_element``).
    """

    versions_since_anchor: int = 0
    delta_bytes_since_anchor: int = 0
    anchor_bytes: int = 0
    drift: float = 0.0
    drift_elements: int = 0
    delta_bytes_since_differential: int = 0
    bytes_per_element: float = 0.0

    @property
    def differential_estimate(self) -> float:
        """Estimated bytes of a differential written now."""
        return self.drift_elements * self.bytes_per_element


class AnchorPolicy(abc.ABC):
    """Decides whether the next version is an anchor and whether it carries a differential."""

    name: str = ""

    @abc.abstractmethod
    def should_anchor(self, chain: ChainState) -> bool:
        """True to write the next version with full objects (followers still get a delta)."""

    def should_differential(self, chain: ChainState) -> bool:
        """True to also write the union of changes since the last anchor; default never."""
        return False

    @property
    def tracks_drift(self) -> bool:
        """Whether the Publisher must track changes since the anchor (costs host memory O(drift))."""
        return False

    def get_config(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{self.name}({args})"


class Every(AnchorPolicy):
    """An anchor every ``n`` versions: the anchor, then ``n - 1`` deltas, then the next anchor."""

    name = "every"

    def __init__(self, n: int = 10):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"anchor interval must be a positive integer, got {n!r}")
        self.n = n

    def should_anchor(self, chain: ChainState) -> bool:
        return chain.versions_since_anchor >= self.n - 1

    def get_config(self) -> dict[str, Any]:
        return {"n": self.n}


class Adaptive(AnchorPolicy):
    """Anchor when what a joiner downloads beyond the anchor gets too big.

    A joiner arriving now downloads the last anchor plus its *extra*: either
    the whole delta chain since the anchor, or (with differentials) the last
    differential plus the deltas after it, whichever is smaller. Writes an
    anchor when any of these holds:

    * ``extra >= budget * anchor_bytes``;
    * ``drift >= max_drift`` (bounds the Publisher's drift-tracking memory and
      keeps differentials small);
    * ``versions_since_anchor >= max_chain`` (a hard cap on chain length).

    With ``differentials`` on, it also writes a differential when the deltas
    replayed since the last differential cost ``differential_gain`` times the
    differential's estimated size: from then on a joiner reads one
    differential instead of them. The cost model is in ``docs/anchors.md``.
    """

    name = "adaptive"

    def __init__(self, budget: float = 0.15, max_drift: float = 0.25, max_chain: int = 1000,
                 differentials: bool = True, differential_gain: float = 1.0):
        if not budget > 0 or not 0 < max_drift <= 1 or max_chain < 1 or not differential_gain > 0:
            raise ValueError("adaptive: budget and differential_gain must be > 0, max_drift in (0, 1], "
                             "max_chain >= 1")
        self.budget = float(budget)
        self.max_drift = float(max_drift)
        self.max_chain = int(max_chain)
        self.differentials = bool(differentials)
        self.differential_gain = float(differential_gain)

    def joiner_extra(self, chain: ChainState) -> float:
        """Bytes a joiner downloads beyond the anchor if it joined after the next version."""
        if not self.differentials or chain.versions_since_anchor < 1:
            return chain.delta_bytes_since_anchor
        return min(chain.delta_bytes_since_anchor,
                   chain.differential_estimate + chain.delta_bytes_since_differential)

    def should_anchor(self, chain: ChainState) -> bool:
        return (chain.versions_since_anchor >= self.max_chain - 1
                or self.joiner_extra(chain) >= self.budget * chain.anchor_bytes
                or chain.drift >= self.max_drift)

    def should_differential(self, chain: ChainState) -> bool:
        if not self.differentials or chain.versions_since_anchor < 1:
            return False
        return chain.delta_bytes_since_differential >= self.differential_gain * chain.differential_estimate

    @property
    def tracks_drift(self) -> bool:
        return True

    def get_config(self) -> dict[str, Any]:
        return {"budget": self.budget, "max_drift": self.max_drift, "max_chain": self.max_chain,
                "differentials": self.differentials, "differential_gain": self.differential_gain}


def every(n: int) -> Every:
    """An anchor every ``n`` versions."""
    return Every(n)


def adaptive(**config: Any) -> Adaptive:
    """The adaptive policy (see :class:`Adaptive` for the knobs)."""
    return Adaptive(**config)


_registry.register("every", Every)
_registry.register("adaptive", Adaptive)


def get_anchor_policy(policy: AnchorPolicy | str | dict[str, Any]) -> AnchorPolicy:
    """A policy object from an instance, a registered name, or ``{"name": ..., **config}``.

    Raises :class:`UnknownPluginError` for an unknown name and ``TypeError``
    for anything else.
    """
    if isinstance(policy, AnchorPolicy):
        return policy
    if isinstance(policy, str):
        return _registry.get(policy)()
    if isinstance(policy, dict) and isinstance(policy.get("name"), str):
        config = {k: v for k, v in policy.items() if k != "name"}
        return _registry.get(policy["name"])(**config)
    raise TypeError(f"anchor policy must be an AnchorPolicy, a name or a config dict, got {policy!r}")
