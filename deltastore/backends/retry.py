"""Transport helpers: the retry layer (exponential backoff, jitter, a total deadline), parallel
transfers and progress hooks.

Nothing here knows about a particular service: :func:`is_transient`
classifies an exception by its type, errno and HTTP status,
:class:`RetryPolicy` runs a call until it succeeds, fails for good, or runs
out of attempts or time, and :class:`RetryingBackend` wraps any backend in
that policy (the one retry layer: :func:`~deltastore.backends.open_backend`
puts every remote backend behind it, and the clients' own retries are turned
off so the layers do not multiply). A transient failure that outlives the
deadline becomes :class:`BackendUnavailableError`. The first retry of a store
in trouble (since its last success) is logged at INFO on
``deltastore.backends.retry`` with the operation, the cause and the deadline
(the command line shows it on a terminal), every later one at DEBUG.

A refused connection (nothing listens at the endpoint: a wrong host or port)
to a store this process has not reached yet is not retried: it fails at once,
where waiting out the deadline would only delay the same error. Once a store
has answered, a refused connection is a restart and is retried like any
transient failure.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import BackendUnavailableError, DeltaStoreError, KeyExistsError, KeyNotFoundError, UnknownOptionError
from .base import Backend, PutMode, WrapperBackend

log = logging.getLogger("deltastore.backends.retry")
DEFAULT_DEADLINE = 30.0
"""Seconds after a call's first try past which no retry starts (storage option ``deadline``)."""

T = TypeVar("T")
R = TypeVar("R")

ProgressCallback = Callable[[str, str, int], None]
"""``progress(op, key, nbytes)``: called once per finished transfer, ``op`` is ``"get"`` or ``"put"``.

Called from worker threads; it must be thread-safe and fast (a CLI adds
``nbytes`` to a progress bar under a lock).
"""

_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE, errno.ETIMEDOUT,
                     errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETRESET, errno.EIO}
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
# Exception class names (from aiohttp, botocore, httpx, urllib3, requests, ...) that mean a
# dropped or timed-out connection; matched by name so that no client library is imported here.
_TRANSIENT_NAMES = {
    "ClientConnectionError", "ClientOSError", "ServerDisconnectedError", "ClientPayloadError",
    "ServerTimeoutError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "IncompleteRead",
    "TransportError", "NetworkError", "TimeoutException", "RemoteProtocolError", "ProtocolError",
    "ChunkedEncodingError", "FSTimeoutError",
}
# ... except these, which some clients derive from their transport errors but which no retry can fix: a URL
# the client cannot use (a missing or unknown scheme, a malformed host)
_PERMANENT_NAMES = {"UnsupportedProtocol", "InvalidURL", "MissingSchema", "InvalidSchema", "InvalidUrlClientError"}
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
              ValueError, TypeError, KeyError, NotImplementedError)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status code an exception carries (``.response.status_code`` or botocore's metadata), if any."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None) or getattr(response, "status", None)
    if isinstance(status, int):
        return status
    if isinstance(response, Mapping):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


_REFUSED = re.compile(r"\b(401|403)\b.{0,3}(unauthorized|forbidden)", re.IGNORECASE)


def is_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is an authentication/authorisation refusal (HTTP 401/403), even when a client
    library reports it as a generic connection error with the status only in its message (hf_xet)."""
    if isinstance(exc, PermissionError) or http_status(exc) in (401, 403):
        return True
    return any(_REFUSED.search(str(e)) for e in _chain(exc))


def is_connection_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (anywhere in its cause chain) is a refused TCP connection (``ECONNREFUSED``)."""
    for e in _chain(exc):
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return True
        if isinstance(getattr(e, "os_error", None), ConnectionRefusedError):  # aiohttp's ClientConnectorError
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the call that raised ``exc`` may succeed.

    True for dropped connections, timeouts and HTTP 408/425/429/5xx (anywhere
    in the exception's cause chain); False for deltastore's own errors,
    missing keys or buckets, conflicts, permission and argument errors.
    """
    if isinstance(exc, DeltaStoreError):  # one a retry layer gave up on is final (layers do not multiply)
        return isinstance(exc, BackendUnavailableError) and not getattr(exc, "retried", False)
    if is_refused(exc):
        return False
    status = http_status(exc)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if isinstance(exc, _PERMANENT):
        return False
    if any(c.__name__ in _PERMANENT_NAMES for e in _chain(exc) for c in type(e).__mro__):
        return False
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        status = http_status(e)
        if status is not None:
            return status in _TRANSIENT_STATUS
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a transient failure.

    attempts: total tries per call (1 = no retry).
    base_delay / max_delay: the n-th retry sleeps a random time in
        ``[0, min(max_delay, base_delay * 2**n)]`` ("full jitter").
    deadline: seconds after the first try past which no retry ends (None: no limit):
        a retry that would, taking as long as the last try did, end later is
        not started and the call fails instead.
    """

    attempts: int = 8
    base_delay: float = 0.2
    max_delay: float = 8.0
    deadline: float | None = DEFAULT_DEADLINE

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise ValueError(f"retry attempts must be a positive integer, got {self.attempts!r}")
        for name in ("base_delay", "max_delay"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"retry {name} must be a non-negative number, got {getattr(self, name)!r}")
        if self.deadline is not None and (not isinstance(self.deadline, (int, float)) or self.deadline < 0):
            raise ValueError(f"retry deadline must be a non-negative number or None, got {self.deadline!r}")

    @classmethod
    def coerce(cls, value: RetryPolicy | Mapping[str, Any] | int | None) -> RetryPolicy:
        """A policy from a policy, a dict of its fields, an attempt count, or None (the default)."""
        if value is None:
            return cls()
        if isinstance(value, RetryPolicy):
            return value
        if isinstance(value, bool):
            raise TypeError("retry must be a RetryPolicy, a dict or an int")
        if isinstance(value, int):
            return cls(attempts=max(1, value))
        if isinstance(value, Mapping):
            fields = [f.name for f in dataclasses.fields(cls)]
            bad = sorted(str(k) for k in value if k not in fields)
            if bad:
                raise UnknownOptionError(f"unknown retry option(s) {bad}; valid: {fields}")
            return cls(**value)
        raise TypeError(f"retry must be a RetryPolicy, a dict or an int, got {type(value).__name__}")

    def delay(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based)."""
        return random.uniform(0, min(self.max_delay, self.base_delay * (2 ** retry)))

    def call(self, fn: Callable[[int], R], *, transient: Callable[[BaseException], bool] = is_transient,
             what: str = "call", on_retry: Callable[[int, float, BaseException], None] | None = None) -> R:
        """Run ``fn(attempt)`` (attempt = 0, 1, ...) until it returns; re-raise a permanent or the last error.

        ``on_retry(retry, pause, error)`` is called before each retry's pause (default: a DEBUG log line).
        Only ``Exception`` is retried: ``KeyboardInterrupt``/``SystemExit`` pass at once.
        """
        start = time.monotonic()
        for attempt in range(self.attempts):
            began = time.monotonic()
            try:
                return fn(attempt)
            except Exception as e:
                if attempt + 1 >= self.attempts or not transient(e):
                    raise
                pause = self.delay(attempt)
                now = time.monotonic()
                # no try starts that would, taking as long as the last one did, end past the deadline
                if self.deadline is not None and now + pause + (now - began) - start > self.deadline:
                    raise
                if on_retry is not None:
                    on_retry(attempt + 1, pause, e)
                else:
                    log.debug("retry %d/%d of %s in %.2f s after %s: %s", attempt + 1, self.attempts - 1, what,
                              pause, type(e).__name__, e)
                time.sleep(pause)
        raise AssertionError("unreachable")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def run_parallel(fn: Callable[[T], R], items: Iterable[T], max_workers: int) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``max_workers`` threads, results in input order.

    The first exception (in input order) is re-raised after every call has
    finished, so no transfer is left running behind the caller's back.
    """
    items = list(items)
    if max_workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]


class Progress:
    """An optional :data:`ProgressCallback`, called under a lock (one call at a time); None does nothing."""

    def __init__(self, callback: ProgressCallback | None):
        if callback is not None and not callable(callback):
            raise TypeError("progress must be callable as progress(op, key, nbytes)")
        self.callback = callback
        self._lock = threading.Lock()

    def __call__(self, op: str, key: str, nbytes: int) -> None:
        if self.callback is None:
            return
        with self._lock:
            self.callback(op, key, nbytes)


class RetryingBackend(WrapperBackend):
    """``inner`` with every call retried on transient errors under ``retry`` (a :class:`RetryPolicy`,
    a dict of its fields or an attempt count); the one retry layer (see the module docstring).

    A transient failure still there when the attempts or the deadline run out
    raises :class:`BackendUnavailableError` naming the operation, the key, the
    tries and the time spent. A create-only put retried after a transient
    error that then finds the key present compares the stored bytes with its
    own: equal means its earlier try landed and lost its answer (success),
    anything else is a real conflict (:class:`KeyExistsError`). ``retries``
    counts retried tries.
    """

    def __init__(self, inner: Backend, retry: RetryPolicy | Mapping[str, Any] | int | None = None):
        super().__init__(inner)
        self.retry = RetryPolicy.coerce(retry)
        self.retries = 0
        self._lock = threading.Lock()
        self._reached = False  # a call succeeded: a refused connection is a restart from now on
        self._troubled = False  # a retry was announced and no call has succeeded since

    def _call(self, op: str, key: str, fn: Callable[[], R]) -> R:
        start = time.monotonic()
        tries = [0]
        what = f"{op} {key!r} on {self.inner!r}" if key else f"{op} on {self.inner!r}"

        def attempt(n: int) -> R:
            tries[0] = n + 1
            if n:
                with self._lock:
                    self.retries += 1
            got = fn()
            self._reached = True
            self._troubled = False
            return got

        def worth_retrying(e: BaseException) -> bool:
            return is_transient(e) and (self._reached or not is_connection_refused(e))

        try:
            return self.retry.call(attempt, transient=worth_retrying, what=what,
                                   on_retry=lambda n, pause, e: self._announce(what, n, pause, e, start))
        except Exception as e:
            if not is_transient(e):
                raise
            cause = str(e) if isinstance(e, BackendUnavailableError) else f"{what}: {type(e).__name__}: {e}"
            if worth_retrying(e):
                final = BackendUnavailableError(
                    f"store unreachable after {tries[0]} {'try' if tries[0] == 1 else 'tries'} in "
                    f"{time.monotonic() - start:.1f} s (deadline {self.retry.deadline} s): {cause}")
            else:
                final = BackendUnavailableError(f"store unreachable: connection refused (not retried: this store "
                                                f"has not answered yet; check the endpoint): {cause}")
            final.retried = True  # type: ignore[attr-defined]
            raise final from e

    def _announce(self, what: str, retry: int, pause: float, error: BaseException, start: float) -> None:
        """Log a retry: at INFO the first one since the store last answered (what, why, the deadline), so
        that an operator sees at once that a store is unreachable; the others at DEBUG."""
        with self._lock:
            first, self._troubled = not self._troubled, True
        if first and log.isEnabledFor(logging.INFO):
            left = (f"for up to {max(self.retry.deadline - (time.monotonic() - start), 0.0):.0f} s more "
                    "(storage option 'deadline')") if self.retry.deadline is not None else "with no deadline"
            log.info("%s failed (%s: %s); retrying %s", what, type(error).__name__, _first_line(error), left)
        else:
            log.debug("retry %d/%d of %s in %.2f s after %s: %s", retry, self.retry.attempts - 1, what, pause,
                      type(error).__name__, error)

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        tried = [0]

        def once() -> None:
            tried[0] += 1
            try:
                self.inner.put(key, data, mode=mode)
            except KeyExistsError:
                if tried[0] == 1:
                    raise
                try:  # an earlier try may have landed and lost its answer
                    if self.inner.get(key) == bytes(data):
                        return
                except KeyNotFoundError:
                    pass
                raise

        self._call("put", key, once)
