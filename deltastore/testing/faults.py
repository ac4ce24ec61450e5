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

A rule matches an operation in ``ops`` (``get``, ``get_range``, ``put``,
``exists``, ``list``, ``delete``; ``"*"`` for all) whose key starts with
``prefix``; ``skip`` matching calls are let through first, at most ``limit``
faults are injected, and each remaining matching call draws against ``rate``.
The first rule (in order) that fires decides; ``latency`` combines with the others.

:class:`RetryingBackend` retries transient errors with a
:class:`~deltastore.backends.retry.RetryPolicy`, the way the network
backends do internally (local and memory stores have no retry layer of their
own). A retried create-only put that finds the key holding exactly its bytes
counts as its own write (the answer to an earlier try was lost).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..backends.base import Backend, PutMode
from ..backends.retry import RetryPolicy, is_transient
from ..errors import KeyExistsError, KeyNotFoundError

__all__ = ["Fault", "FaultyBackend", "RetryingBackend", "corrupt_bytes", "OPS", "KINDS"]

OPS = ("get", "get_range", "put", "exists", "list", "delete")
KINDS = ("transient", "permanent", "latency", "partial", "drop", "corrupt", "kill")


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


class FaultyBackend(Backend):
    """``inner`` with faults injected by ``rules`` from a generator seeded with ``seed`` (thread-safe).

    ``injected`` counts injections by kind, ``calls`` counts operations by name;
    ``log`` (when ``keep_log=True``) records ``(kind, op, key)`` for each injection.
    ``enabled = False`` turns every rule off.
    """

    def __init__(self, inner: Backend, *, seed: int = 0, rules: Iterable[Fault] = (), keep_log: bool = False):
        self.inner = inner
        self.rules = list(rules)
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.log: list[tuple[str, str, str]] | None = [] if keep_log else None
        self.enabled = True
        self._lock = threading.Lock()
        self.capabilities = inner.capabilities

    def __repr__(self) -> str:
        return f"FaultyBackend({self.inner!r}, rules={len(self.rules)})"

    @property
    def total_injected(self) -> int:
        return sum(self.injected.values())

    # -- machinery ------------------------------------------------------------------
    def _decide(self, op: str, key: str) -> tuple[list[Fault], float]:
        """The rules that fire for this call (one non-latency rule at most) and the latency to add."""
        with self._lock:
            self.calls[op] += 1
            if not self.enabled:
                return [], 0.0
            fired: list[Fault] = []
            latency = 0.0
            for rule in self.rules:
                if rule.kind == "latency":
                    if rule._draw(op, key, self.rng):
                        latency += self.rng.uniform(0, rule.delay) if rule.jitter else rule.delay
                        self._note("latency", op, key)
                elif not fired and rule._draw(op, key, self.rng):
                    fired.append(rule)
                    self._note(rule.kind, op, key)
            return fired, latency

    def _note(self, kind: str, op: str, key: str) -> None:
        self.injected[kind] += 1
        if self.log is not None:
            self.log.append((kind, op, key))

    def _run(self, op: str, key: str, call: Callable[[], Any], *, data: bytes | None = None,
             mode: PutMode = "overwrite") -> Any:
        fired, latency = self._decide(op, key)
        if latency:
            time.sleep(latency)
        rule = fired[0] if fired else None
        kind = rule.kind if rule else None
        if kind == "kill" and rule is not None and rule.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "transient":
            with self._lock:
                cls = ConnectionResetError if self.rng.random() < 0.5 else TimeoutError
            raise cls(f"injected transient fault on {op} {key!r}")
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
        result = call()
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "drop":
            raise ConnectionResetError(f"injected dropped answer on {op} {key!r} (the call went through)")
        if kind == "corrupt" and isinstance(result, bytes):
            with self._lock:
                result = corrupt_bytes(result, self.rng)
        return result

    # -- Backend ----------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self._run("get", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._run("get_range", key, lambda: self.inner.get_range(key, start, end))

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        self._run("put", key, lambda: self.inner.put(key, data, mode=mode), data=data, mode=mode)

    def exists(self, key: str) -> bool:
        return self._run("exists", key, lambda: self.inner.exists(key))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from self._run("list", prefix, lambda: list(self.inner.list(prefix)))

    def close(self) -> None:
        self.inner.close()


class RetryingBackend(Backend):
    """``inner`` with every call retried on transient errors under ``retry`` (a :class:`RetryPolicy`,
    a dict of its fields or an attempt count).

    What the network backends do internally, as a wrapper for stores without
    a retry layer (local, memory) or for faults injected outside one. A
    create-only put whose earlier try may have landed (a retry after a
    transient error) and that then finds the key present compares the stored
    bytes with its own: equal means its own write (success), anything else a
    real conflict (:class:`KeyExistsError`). ``retries`` counts retried calls.
    """

    def __init__(self, inner: Backend, retry: RetryPolicy | dict | int | None = None):
        self.inner = inner
        self.retry = RetryPolicy.coerce(retry)
        self.capabilities = inner.capabilities
        self.retries = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RetryingBackend({self.inner!r})"

    def _call(self, fn: Callable[[int], Any]) -> Any:
        def attempt(n: int) -> Any:
            if n:
                with self._lock:
                    self.retries += 1
            return fn(n)

        return self.retry.call(attempt, transient=is_transient)

    def get(self, key: str) -> bytes:
        return self._call(lambda n: self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._call(lambda n: self.inner.get_range(key, start, end))

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        def attempt(n: int) -> None:
            try:
                self.inner.put(key, data, mode=mode)
            except KeyExistsError:
                if n == 0:
                    raise
                try:  # an earlier try may have landed and lost its answer
                    if self.inner.get(key) == data:
                        return
                except KeyNotFoundError:
                    pass
                raise

        self._call(attempt)

    def exists(self, key: str) -> bool:
        return self._call(lambda n: self.inner.exists(key))

    def delete(self, key: str) -> None:
        self._call(lambda n: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from self._call(lambda n: list(self.inner.list(prefix)))

    def close(self) -> None:
        self.inner.close()
