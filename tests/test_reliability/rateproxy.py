"""A :class:`FaultProxy` that faults a seeded random fraction of requests instead of counted ones."""

from __future__ import annotations

import random

from test_backends.faultproxy import FaultProxy

ACTIONS = ("cut_request", "drop_response", "refuse")


class RateFaultProxy(FaultProxy):
    """Each HTTP request gets, with probability ``rate``, one of ``actions`` (uniformly, seeded):
    an upload cut mid-body, an answer dropped after the request was served, or a refused connection.
    ``fired`` lists ``(action, request line)`` of every injected fault."""

    def __init__(self, target_port: int, *, rate: float, seed: int = 0, actions: tuple[str, ...] = ACTIONS):
        super().__init__(target_port)
        self.rate = rate
        self.actions = actions
        self.rng = random.Random(seed)
        self.requests = 0

    def _rule_for(self, chunk: bytes) -> str | None:
        line = chunk.split(b"\r\n", 1)[0].decode("latin-1", "replace")
        if line.split(" ", 1)[0] not in ("GET", "PUT", "POST", "HEAD", "DELETE"):
            return None
        with self.lock:
            self.requests += 1
            if self.rng.random() >= self.rate:
                return None
            action = self.rng.choice(self.actions)
            self.fired.append((action, line))
            return action
