"""Anchor policies: when the Publisher writes a full anchor instead of only a delta.

A policy sees the state of the chain since the last anchor and answers
:meth:`AnchorPolicy.should_anchor`. ``every(n)`` is the fixed schedule;
richer policies register in :data:`deltastore.registry.anchor_policies`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from .registry import anchor_policies as _registry


@dataclass(frozen=True)
class ChainState:
    """What a policy knows when a new version is about to be written.

    versions_since_anchor: versions committed after the last anchor.
    delta_bytes_since_anchor: bytes of their delta objects.
    anchor_bytes: bytes of the last anchor's full objects.
    """

    versions_since_anchor: int
    delta_bytes_since_anchor: int
    anchor_bytes: int


class AnchorPolicy(abc.ABC):
    """Decides whether the next version is an anchor."""

    name: str = ""

    @abc.abstractmethod
    def should_anchor(self, chain: ChainState) -> bool:
        """True to write the next version as an anchor (a delta is still written for followers)."""

    def get_config(self) -> dict[str, Any]:
        return {}


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

    def __repr__(self) -> str:
        return f"every({self.n})"


def every(n: int) -> Every:
    """An anchor every ``n`` versions."""
    return Every(n)


_registry.register("every", Every)


def get_anchor_policy(policy: AnchorPolicy | str | dict[str, Any]) -> AnchorPolicy:
    """A policy object from an instance, a registered name, or ``{"name": ..., **config}``."""
    if isinstance(policy, AnchorPolicy):
        return policy
    if isinstance(policy, str):
        return _registry.get(policy)()
    if isinstance(policy, dict) and isinstance(policy.get("name"), str):
        config = {k: v for k, v in policy.items() if k != "name"}
        return _registry.get(policy["name"])(**config)
    raise TypeError(f"anchor policy must be an AnchorPolicy, a name or a config dict, got {policy!r}")
