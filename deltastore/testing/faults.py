"""Fault injection for testing a deltastore setup: a :class:`Backend` wrapper that misbehaves on purpose.

:class:`FaultyBackend` wraps any backend and, driven by a seeded random
generator, injects faults on chosen operations, key prefixes and rates::

    from deltastore.testing.faults import FaultyBackend, Fault, RetryingBackend
    from deltastore.store import DeltaStore

    inner = open_backend("./store")
    faulty = FaultyBackend(inner, seed=7, rules=[
        Fault("transient", rate=0.2),                          # ConnectionError / TimeoutError before the call
        Fault("drop", ops="put", rate=0.05),                   # the write lands, the caller gets an error
        Fault("corrupt", ops="get", prefix="objects/", rate=0.01),   # bit flips / truncation in returned bytes
        Fault("latency", rate=1.0, delay=0.002),
    ])
    pub = ds.Publisher(DeltaStore(RetryingBackend(faulty)))
    ...
    print(faulty.injected)       # Counter({"transient": 41, "drop": 3, ...})

Fault kinds (``Fault.kind``):

``transient``   raise ``ConnectionError``/``TimeoutError`` instead of doing the call (retryable)
``permanent``   raise ``PermissionError`` (or ``Fault.error``) instead of doing the call (not retryable)
``latency``     sleep ``delay`` seconds (uniform in ``[0, delay]`` with ``jitter=True``), then do the call
``partial``     (put) store a truncated value, then raise ``ConnectionError``. Violates the Backend
                contract ("a reader never sees a partial value"): simulates a non-atomic store.
``drop``        do the call, then raise ``ConnectionError``: the write lands (or the read happens)
                but the caller never learns it
``corrupt``     (get, get_range) return the bytes with bits flipped or truncated
``kill``        ``os.kill(os.getpid(), SIGKILL)``: before the call (``when="before"``) or after it
                landed (``when="after"``); for crash tests in a child process
``enospc``      raise ``OSError(ENOSPC)`` instead of doing the call (a full disk)
``erofs``       raise ``OSError(EROFS)`` instead of doing the call (a read-only mount)
``unreachable`` raise ``ConnectionRefusedError`` instead of doing the call (an endpoint that is down)
``pause``       call ``Fault.hook(op, key)`` before the call, then do it: a test's hook blocks on
                an event to hold this call at an exact point of an interleaving (no sleeps)

A rule matches an operation in ``ops`` (``get``, ``get_range``, ``put``,
``exists``, ``list``, ``delete``, ``stat``, ``touch``; ``"*"`` for all) whose key starts with
``prefix``; ``skip`` matching calls are let through first, at most ``limit``
faults are injected, and each remaining matching call draws against ``rate``.
The first rule (in order) that fires decides; ``latency`` and ``pause`` combine with the others.

:class:`FaultyBackend` is a :class:`~deltastore.backends.base.WrapperBackend`;
:class:`RetryingBackend` (the retry layer, re-exported from
:mod:`deltastore.backends.retry`) stacks on top of it the same way.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..backends.base import Backend, PutMode, WrapperBackend
from ..backends.retry import RetryingBackend
from ..errors import KeyExistsError

__all__ = ["Fault", "FaultyBackend", "RetryingBackend", "corrupt_bytes", "OPS", "KINDS"]

OPS = ("get", "get_range", "put", "exists", "list", "delete", "stat", "touch")
KINDS = ("transient", "permanent", "latency", "partial", "drop", "corrupt", "kill", "enospc", "erofs",
         "unreachable", "pause")
_PASSIVE = ("latency", "pause")  # they combine with the one other rule that may fire


@dataclass
class Fault:
    """One injection rule (see the module docstring).

    kind: one of :data:`KINDS`.
    ops: an op name, a tuple of op names, or ``"*"``.
    prefix: only keys starting with this (``"versions/"``, ``"objects/"``); ``list`` matches on its prefix.
    rate: probability that a matching call gets the fault.
    skip: matching calls let through before the rule may fire.
    limit: at most this many injections (None: no limit).
    delay: seconds of latency (``latency``).
    error: exception factory for ``permanent`` (default ``PermissionError``).
    when: ``kill`` before the call or after it.
    hook: ``pause``: called as ``hook(op, key)`` before the call.
    """

    kind: str
    ops: str | tuple[str, ...] = "*"
    prefix: str = ""
    rate: float = 1.0
    skip: int = 0
    limit: int | None = None
    delay: float = 0.01
    jitter: bool = True
    error: Callable[[str], BaseException] | None = None
    when: str = "before"
    hook: Callable[[str, str], None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        ops = OPS if self.ops == "*" else (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        bad = set(ops) - set(OPS)
        if bad:
            raise ValueError(f"unknown operations {sorted(bad)}; known: {OPS}")
        self.ops = ops
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")
        if self.when not in ("before", "after"):
            raise ValueError("when must be 'before' or 'after'")
        self._seen = 0
        self._fired = 0

    def _draw(self, op: str, key: str, rng: random.Random) -> bool:
        if op not in self.ops or not key.startswith(self.prefix):
            return False
        self._seen += 1
        if self._seen <= self.skip or (self.limit is not None and self._fired >= self.limit):
            return False
        if self.rate < 1.0 and rng.random() >= self.rate:
            return False
        self._fired += 1
        return True


def corrupt_bytes(data: bytes, rng: random.Random) -> bytes:
    """``data`` with 1-8 random bits flipped, or (one time in three) truncated; never equal to ``data``."""
    if not data:
        return b"\x00"
    if rng.random() < 1 / 3:
        return data[: rng.randrange(len(data))]
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    if bytes(out) == data:  # an even number of flips on one bit
        out[0] ^= 1
    return bytes(out)


class FaultyBackend(WrapperBackend):
    """``inner`` with faults injected by ``rules`` from a generator seeded with ``seed`` (thread-safe).

    ``injected`` counts injections by kind, ``calls`` counts operations by name;
    ``log`` (when ``keep_log=True``) records ``(kind, op, key)`` for each injection.
    ``enabled = False`` turns every rule off.
    """

    def __init__(self, inner: Backend, *, seed: int = 0, rules: Iterable[Fault] = (), keep_log: bool = False):
        super().__init__(inner)
        self.rules = list(rules)
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.log: list[tuple[str, str, str]] | None = [] if keep_log else None
        self.enabled = True
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultyBackend({self.inner!r}, rules={len(self.rules)})"

    @property
    def total_injected(self) -> int:
        return sum(self.injected.values())

    # -- machinery ------------------------------------------------------------------
    def _decide(self, op: str, key: str) -> tuple[Fault | None, float, list[Fault]]:
        """The rule that fires for this call (one at most), the latency to add and the pause hooks to call."""
        with self._lock:
            self.calls[op] += 1
            if not self.enabled:
                return None, 0.0, []
            fired: Fault | None = None
            latency = 0.0
            pauses: list[Fault] = []
            for rule in self.rules:
                if rule.kind in _PASSIVE:
                    if rule._draw(op, key, self.rng):
                        if rule.kind == "latency":
                            latency += self.rng.uniform(0, rule.delay) if rule.jitter else rule.delay
                        else:
                            pauses.append(rule)
                        self._note(rule.kind, op, key)
                elif fired is None and rule._draw(op, key, self.rng):
                    fired = rule
                    self._note(rule.kind, op, key)
            return fired, latency, pauses

    def _note(self, kind: str, op: str, key: str) -> None:
        self.injected[kind] += 1
        if self.log is not None:
            self.log.append((kind, op, key))

    def _call(self, op: str, key: str, fn: Callable[[], Any], *, data: bytes | None = None,
              mode: PutMode = "overwrite") -> Any:
        rule, latency, pauses = self._decide(op, key)
        for p in pauses:
            if p.hook is not None:
                p.hook(op, key)
        if latency:
            time.sleep(latency)
        kind = rule.kind if rule else None
        if kind == "kill" and rule is not None and rule.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "transient":
            with self._lock:
                cls = ConnectionResetError if self.rng.random() < 0.5 else TimeoutError
            raise cls(f"injected transient fault on {op} {key!r}")
        if kind == "unreachable":
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"injected: endpoint unreachable on {op} {key!r}")
        if kind in ("enospc", "erofs"):
            code = errno.ENOSPC if kind == "enospc" else errno.EROFS
            raise OSError(code, f"injected {os.strerror(code)} on {op} {key!r}")
        if kind == "permanent":
            assert rule is not None
            raise (rule.error or PermissionError)(f"injected permanent fault on {op} {key!r}")
        if kind == "partial" and op == "put" and data is not None:
            with self._lock:
                cut = self.rng.randrange(len(data)) if data else 0
            try:
                self.inner.put(key, data[:cut], mode=mode)
            except KeyExistsError:
                pass
            raise ConnectionResetError(f"injected partial write on {key!r}: {cut} of {len(data)} bytes landed")
        result = fn()
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "drop":
            raise ConnectionResetError(f"injected dropped answer on {op} {key!r} (the call went through)")
        if kind == "corrupt" and isinstance(result, bytes):
            with self._lock:
                result = corrupt_bytes(result, self.rng)
        return result

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        self._call("put", key, lambda: self.inner.put(key, data, mode=mode), data=bytes(data), mode=mode)

    def _get_bounded(self, key: str, limit: int) -> bytes:
        return self._call("get", key, lambda: self.inner.get_bounded(key, limit))

    def _get_many(self, keys: list[str], limits: dict[str, int]) -> dict[str, bytes]:
        # one call per key, so rules see each key (a batch would hide them behind its first key)
        return {k: (self.get_bounded(k, limits[k]) if k in limits else self._get(k)) for k in keys}

    def _put_many(self, items: dict[str, bytes], mode: PutMode) -> None:
        Backend._put_many(self, items, mode)
