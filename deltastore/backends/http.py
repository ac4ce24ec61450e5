"""Read-only stores over plain HTTP(S): ``https://HOST[:PORT]/PREFIX`` (and ``http://``).

The store's keys are URLs under the prefix (``https://cdn.example/run-1/versions/000000000012.json``),
served by anything that answers GET: a static file server (nginx serving a store folder), a CDN, a
public bucket's HTTPS endpoint, a mirror (``deltastore mirror``). GET and ranged GET only: no listing (a
reader finds versions through ``refs/index.json``, :mod:`deltastore.index`), no writes (each raises
:class:`ReadOnlyStoreError`), no credentials (``headers`` can carry one for a server that wants it).

The client is the standard library's ``http.client`` (docs/backends.md says why): persistent
connections, a pool per host, and every byte read under bounds a hostile or broken server cannot stretch:

* **time**: a connection gets ``connect_timeout`` s; the status line and headers must arrive within
  ``read_timeout`` s; the body must then keep an average of ``min_speed`` bytes/s after a grace of
  ``read_timeout`` s (a watchdog cuts the socket when it falls behind: :class:`TransferTooSlowError`);
* **memory**: a read with a bound (``get_bounded``: a manifest's or an object's size) refuses a declared
  ``Content-Length`` over it before reading, and stops reading an undeclared body at the bound plus one
  byte (:class:`ValueTooLargeError`); a read without one takes at most ``max_read`` bytes;
* **protocol**: a body shorter than its ``Content-Length`` (a dropped connection) is
  :class:`BackendUnavailableError`, retried by the retry layer within its deadline; a ``Content-Range``
  other than the one asked for, conflicting ``Content-Length`` headers, a malformed status line, more than
  ``max_redirects`` redirects, a redirect loop or a redirect from ``https`` to ``http`` are
  :class:`BadResponseError`. Above this layer every object is checked against the size and sha256 its
  manifest gives, so nothing a server sends is applied unless it is exactly what the publisher stored.

Statuses: 404/410 :class:`KeyNotFoundError` (and 403 with ``forbidden_is_missing=True``, for an S3
bucket whose anonymous users may read but not list: S3 then answers 403 for a missing key), 401/403
:class:`AccessDeniedError`, 408/425/429/5xx :class:`BackendUnavailableError` (retried), any other
:class:`BadResponseError`.

Mutable keys (``refs/``, :mod:`~deltastore.backends.cache_policy`) are polled with conditional GETs:
the ``ETag`` of the last answer goes out as ``If-None-Match`` and a 304 returns the bytes held. A file
server's ETag is its file's modification second and size, which a rewrite within the same second can
keep; such an answer is not used as a validator (:func:`_validator_safe`), so a poll never holds on to a
replaced ``refs/index.json``.

Options: ``timeout`` (sets ``connect_timeout`` and ``read_timeout``), ``connect_timeout`` (5 s),
``read_timeout`` (30 s), ``min_speed`` (bytes/s, default 64 KiB/s), ``max_redirects`` (5), ``headers``
(a dict sent with every request; dropped on a redirect to another host), ``ca_file`` (a CA bundle for
https), ``forbidden_is_missing`` (False), ``max_read`` (bytes, default 1 GiB), ``max_connections``
(idle connections kept per host, 16), ``progress``; and the retry layer's ``retry`` and ``deadline``.
"""

from __future__ import annotations

import email.utils
import heapq
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from ..errors import (AccessDeniedError, BackendError, BackendUnavailableError, BadResponseError, KeyNotFoundError,
                      ListingUnsupportedError, ReadOnlyStoreError, TransferTooSlowError, ValueTooLargeError)
from .base import Backend, Capabilities, KeyInfo, PutMode
from .cache_policy import is_mutable
from .options import check_options
from .retry import Progress, ProgressCallback

CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 30.0
MIN_SPEED = 64 << 10
MAX_REDIRECTS = 5
MAX_READ = 1 << 30
_CHUNK = 1 << 20
_MAX_HELD = 1 << 20  # the most bytes of a mutable key kept for conditional GETs
_DISCARD = 64 << 10  # a redirect's or an error's body is read (and dropped) up to this, else the connection closed
_REDIRECTS = (301, 302, 303, 307, 308)
_TRANSIENT = (408, 425, 429, 500, 502, 503, 504)
_OPTIONS = ("timeout", "connect_timeout", "read_timeout", "min_speed", "max_redirects", "headers", "ca_file",
            "forbidden_is_missing", "max_read", "max_connections", "progress")
# a reused keep-alive connection the server closed meanwhile fails like this before any answer: try a new one
_STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)


class _Watchdog:
    """One daemon thread that shuts down the socket of a request past its deadline (the blocked read then
    returns, and the request sees ``token.fired``). Deadlines move as a body arrives (:meth:`arm` again)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Token]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._count = 0

    def arm(self, token: _Token, deadline: float) -> None:
        with self._cond:
            token.deadline = deadline
            self._count += 1
            heapq.heappush(self._heap, (deadline, self._count, token))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="deltastore-http-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0][2] is token:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and (not self._heap[0][2].active or self._heap[0][0] != self._heap[0][2].deadline):
                    heapq.heappop(self._heap)  # disarmed, or armed again with a later deadline
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                token = heapq.heappop(self._heap)[2]
                token.fire()


_WATCHDOG = _Watchdog()


class _Token:
    """A request's deadline on its socket."""

    def __init__(self, sock: socket.socket | None):
        self.sock = sock
        self.deadline = 0.0
        self.active = True
        self.fired = False

    def fire(self) -> None:
        self.fired = True
        self.active = False
        if self.sock is not None:
            try:  # the plain socket's shutdown, also for TLS: the reader thread still owns the TLS state
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def disarm(self) -> None:
        self.active = False


@dataclass
class _Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes
    url: str


class _Connections:
    """Idle keep-alive connections by (scheme, host, port), each used by one request at a time."""

    def __init__(self, connect_timeout: float, read_timeout: float, ca_file: str | None, keep: int):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keep = keep
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(self, scheme: str, netloc: str, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to ``netloc`` and whether it was used before (idle, kept alive)."""
        if not fresh:
            with self._lock:
                idle = self._idle.get((scheme, netloc))
                if idle:
                    return idle.pop(), True
        if scheme == "https":
            context = self._ssl or ssl.create_default_context()
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(netloc, timeout=self.connect_timeout,
                                                                           context=context)
        else:
            conn = http.client.HTTPConnection(netloc, timeout=self.connect_timeout)
        return conn, False

    def give(self, scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
        if conn.sock is None:
            return
        with self._lock:
            idle = self._idle.setdefault((scheme, netloc), [])
            if len(idle) < self.keep:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()


class HttpBackend(Backend):
    """The keys under ``base`` (``http(s)://HOST[:PORT]/PREFIX``), read with GET; see the module docstring."""

    capabilities = Capabilities(atomic_create=False, listing=False, ranged_reads=True, remote=True)

    def __init__(self, base: str, *, timeout: float | None = None, connect_timeout: float | None = None,
                 read_timeout: float | None = None, min_speed: float = MIN_SPEED, max_redirects: int = MAX_REDIRECTS,
                 headers: dict[str, str] | None = None, ca_file: str | None = None, forbidden_is_missing: bool = False,
                 max_read: int = MAX_READ, max_connections: int = 16, progress: ProgressCallback | None = None):
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) store URL (http[s]://HOST[:PORT]/PREFIX): {base!r}")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"{parts.scheme}:// store URL with credentials in it: pass headers= instead "
                             "(the URL is logged and shown in errors)")
        if parts.query or parts.fragment:
            raise ValueError(f"{parts.scheme}:// store URL with a query or fragment: {base!r}")
        self.uri = base.rstrip("/")
        self.scheme, self.netloc = parts.scheme, parts.netloc
        self.prefix = parts.path.rstrip("/")
        connect = float(connect_timeout if connect_timeout is not None else timeout or CONNECT_TIMEOUT)
        read = float(read_timeout if read_timeout is not None else timeout or READ_TIMEOUT)
        for name, value in (("connect_timeout", connect), ("read_timeout", read), ("min_speed", min_speed)):
            if not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name, value in (("max_redirects", max_redirects), ("max_read", max_read),
                            ("max_connections", max_connections)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if headers is not None and not (isinstance(headers, dict)
                                        and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())):
            raise ValueError("headers must be a dict of strings")
        self.read_timeout = read
        self.min_speed = float(min_speed)
        self.max_redirects = max_redirects
        self.max_read = max_read
        self.headers = dict(headers or {})
        self.forbidden_is_missing = bool(forbidden_is_missing)
        self.progress = Progress(progress)
        self._conns = _Connections(connect, read, ca_file, max_connections)
        self._held: dict[str, tuple[str, bytes]] = {}  # mutable key -> (ETag, bytes) of its last answer
        self._held_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HttpBackend({self.uri!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> HttpBackend:
        """Open ``http(s)://HOST[:PORT]/PREFIX``; :class:`UnknownOptionError` for an option not in the module
        docstring's list, ValueError for a malformed URL or option value."""
        check_options(options, _OPTIONS, uri)
        return cls(uri, **options)

    # -- requests --------------------------------------------------------------------------
    def _url(self, key: str) -> str:
        return f"{self.scheme}://{self.netloc}{self.prefix}/{quote(key, safe='/')}"

    def _request(self, method: str, key: str, headers: dict[str, str], limit: int, prefix: bool = False) -> _Answer:
        """``method`` on ``key``'s URL, following redirects; the answer's body read up to ``limit + 1`` bytes
        (a longer one is :class:`ValueTooLargeError`), or with ``prefix`` its first ``limit`` bytes (a server
        that ignores a Range header sends the whole value). Errors per the module docstring."""
        url = self._url(key)
        seen = [url]
        send = {"Accept-Encoding": "identity", **self.headers, **headers}
        while True:
            answer = self._once(method, key, url, send, limit, prefix)
            if answer.status not in _REDIRECTS:
                return answer
            location = answer.headers.get("Location")
            if not location:
                raise BadResponseError(f"{method} {url}: {answer.status} redirect without a Location")
            target = urljoin(url, location.strip())
            parts = urlsplit(target)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise BadResponseError(f"{method} {url}: redirect to {target!r}, not an http(s) URL")
            if urlsplit(url).scheme == "https" and parts.scheme == "http":
                raise BadResponseError(f"{method} {url}: redirect from https to {target} refused (a downgrade)")
            if target in seen:
                raise BadResponseError(f"{method} {self._url(key)}: redirect loop ({' -> '.join(seen + [target])})")
            if len(seen) > self.max_redirects:
                raise BadResponseError(f"{method} {self._url(key)}: more than {self.max_redirects} redirects "
                                       f"(last to {target})")
            if parts.netloc != urlsplit(url).netloc:  # the caller's headers were for the store's host
                send = {"Accept-Encoding": "identity", **headers}
            seen.append(target)
            url = target

    def _once(self, method: str, key: str, url: str, headers: dict[str, str], limit: int, prefix: bool) -> _Answer:
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        fresh = False
        while True:
            conn, reused = self._conns.take(parts.scheme, parts.netloc, fresh)
            token = _Token(None)
            try:
                try:
                    if conn.sock is None:
                        conn.connect()
                    conn.sock.settimeout(self.read_timeout)
                    token.sock = conn.sock
                    started = time.monotonic()
                    _WATCHDOG.arm(token, started + self.read_timeout)
                    conn.request(method, path, headers=headers)
                    response = conn.getresponse()
                except _STALE:
                    if reused and not token.fired:
                        conn.close()
                        fresh = True
                        continue  # a keep-alive connection the server had closed: once more on a new one
                    raise
                answer = self._read(method, url, conn, response, token, limit, prefix)
            except BaseException as e:
                token.disarm()
                conn.close()
                typed = self._translate(e, method, url, token)
                if typed is e:
                    raise
                raise typed from e
            token.disarm()
            if response.will_close:
                conn.close()
            else:
                self._conns.give(parts.scheme, parts.netloc, conn)
            return answer

    def _read(self, method: str, url: str, conn: http.client.HTTPConnection, response: http.client.HTTPResponse,
              token: _Token, limit: int, prefix: bool) -> _Answer:
        """The answer with its body: the whole body of a 200/206 up to ``limit + 1`` bytes (with ``prefix``, a
        200's first ``limit`` bytes), a small one of anything else (a longer one is not read: the connection
        is closed)."""
        status = response.status
        lengths = {v.strip() for v in response.headers.get_all("Content-Length") or []}
        if len(lengths) > 1 or (lengths and not next(iter(lengths)).isdigit()):
            raise BadResponseError(f"{method} {url}: Content-Length {sorted(lengths)} is not one number")
        declared = int(next(iter(lengths))) if lengths and not response.chunked else None
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            response.read()  # nothing to read: marks the answer done so the connection can be reused
            return _Answer(status, response.headers, b"", url)
        ok = status in (200, 206)
        cap = limit if ok else _DISCARD
        if prefix and status == 200:
            return self._read_prefix(method, url, conn, response, token, limit, declared)
        if declared is not None and declared > cap:
            conn.close()  # the body is not read
            if ok:
                raise ValueTooLargeError(f"{url} holds {declared} bytes, more than {limit}", size=declared)
            return _Answer(status, response.headers, b"", url)
        body = self._body(method, url, response, token, cap + 1 if declared is None else min(cap + 1, declared),
                          declared)
        if len(body) > cap:
            response.close()
            conn.close()
            if ok:
                raise ValueTooLargeError(f"{url} holds more than {limit} bytes (not read whole)", size=declared)
            return _Answer(status, response.headers, b"", url)
        if declared is not None and len(body) != declared:
            raise self._truncated(method, url, len(body), declared, token)
        response.read()  # nothing left: marks the answer done so the connection can be reused
        return _Answer(status, response.headers, bytes(body), url)

    def _read_prefix(self, method: str, url: str, conn: http.client.HTTPConnection,
                     response: http.client.HTTPResponse, token: _Token, limit: int, declared: int | None) -> _Answer:
        """The first ``limit`` bytes of a 200 body (all of a shorter one); the connection is closed unless the
        body was read to its end."""
        body = self._body(method, url, response, token, limit, declared)
        if declared is not None and len(body) < min(limit, declared):
            raise self._truncated(method, url, len(body), declared, token)
        if declared is not None and len(body) == declared:
            response.read()
        else:
            conn.close()
        return _Answer(200, response.headers, bytes(body), url)

    def _body(self, method: str, url: str, response: http.client.HTTPResponse, token: _Token, most: int,
              declared: int | None) -> bytearray:
        """Up to ``most`` bytes of the body (fewer where it ends), each chunk under the watchdog's deadline: the
        body must average ``min_speed`` after a ``read_timeout`` grace (:class:`TransferTooSlowError`)."""
        body = bytearray()
        started = time.monotonic()
        while len(body) < most:
            want = min(_CHUNK, most - len(body))
            _WATCHDOG.arm(token, started + self.read_timeout + (len(body) + want) / self.min_speed)
            try:
                chunk = response.read1(want)
            except http.client.IncompleteRead as e:
                raise self._truncated(method, url, len(body) + len(e.partial), declared, token) from None
            if token.fired:
                raise self._slow(method, url, len(body), declared)
            if not chunk:
                break
            body += chunk
        return body

    def _slow(self, method: str, url: str, got: int, declared: int | None) -> TransferTooSlowError:
        of = f" of {declared}" if declared is not None else ""
        return TransferTooSlowError(f"{method} {url}: cut off after {got}{of} bytes: slower than min_speed="
                                    f"{self.min_speed:g} B/s after a {self.read_timeout:g} s grace")

    def _truncated(self, method: str, url: str, got: int, declared: int | None, token: _Token) -> Exception:
        if token.fired:
            return self._slow(method, url, got, declared)
        return BackendUnavailableError(f"{method} {url}: the body ended after {got} of the {declared} bytes its "
                                       "Content-Length declares (a dropped connection or a truncating server)")

    def _translate(self, e: BaseException, method: str, url: str, token: _Token) -> BaseException:
        """A transport failure as a typed error (deltastore's own pass through)."""
        if isinstance(e, (BackendError, KeyNotFoundError, ValueTooLargeError)) or not isinstance(e, Exception):
            return e
        if token.fired:
            return TransferTooSlowError(f"{method} {url}: no answer within read_timeout={self.read_timeout:g} s "
                                        "(status line and headers)")
        if isinstance(e, (socket.timeout, TimeoutError)):
            return TransferTooSlowError(f"{method} {url}: nothing received for {self.read_timeout:g} s")
        if isinstance(e, ssl.SSLCertVerificationError):
            return AccessDeniedError(f"{method} {url}: the server's TLS certificate is not trusted ({e.verify_message})")
        if isinstance(e, (http.client.BadStatusLine, http.client.LineTooLong, http.client.HTTPException)) and \
                not isinstance(e, http.client.RemoteDisconnected):
            return BadResponseError(f"{method} {url}: not a valid HTTP answer ({type(e).__name__}: {e})")
        if isinstance(e, (OSError, http.client.HTTPException)):
            return BackendUnavailableError(f"{method} {url}: {type(e).__name__}: {e}")
        return e

    def _checked(self, answer: _Answer, method: str, key: str) -> _Answer:
        """``answer`` when it is a success; else the typed error of its status."""
        status = answer.status
        if status in (200, 206, 304, 416):
            return answer
        where = f"{method} {answer.url}"
        if status in (404, 410) or (status == 403 and self.forbidden_is_missing):
            raise KeyNotFoundError(f"{key!r} not found in {self.uri} ({status})")
        if status in (401, 403):
            raise AccessDeniedError(f"{where}: access denied ({status})")
        if status in _TRANSIENT:
            raise BackendUnavailableError(f"{where}: the server answered {status}")
        raise BadResponseError(f"{where}: unexpected status {status}")

    def _fetch(self, key: str, limit: int) -> bytes:
        """GET ``key`` whole, at most ``limit + 1`` bytes of it; conditional for a mutable key."""
        headers = {}
        held = self._held.get(key) if is_mutable(key) else None
        if held is not None:
            headers["If-None-Match"] = held[0]
        answer = self._checked(self._request("GET", key, headers, limit), "GET", key)
        if answer.status == 304 and held is not None:
            data = held[1]
        elif answer.status == 200:
            data = answer.body
            etag = answer.headers.get("ETag")
            if is_mutable(key) and etag and len(data) <= _MAX_HELD and _validator_safe(answer.headers):
                with self._held_lock:
                    self._held[key] = (etag, data)
            elif held is not None:
                with self._held_lock:
                    self._held.pop(key, None)
        else:
            raise BadResponseError(f"GET {answer.url}: status {answer.status} to a plain GET")
        self.progress("get", key, len(data))
        return data

    # -- Backend hooks ------------------------------------------------------------------------
    def _get(self, key: str) -> bytes:
        data = self._fetch(key, self.max_read)
        if len(data) > self.max_read:
            raise ValueTooLargeError(f"{self._url(key)} holds more than max_read={self.max_read} bytes", size=None)
        return data

    def _get_bounded(self, key: str, limit: int) -> bytes:
        return self._fetch(key, limit)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            if not self._exists(key):
                raise KeyNotFoundError(f"{key!r} not found in {self.uri}")
            return b""
        answer = self._checked(self._request("GET", key, {"Range": f"bytes={start}-{end - 1}"}, end, prefix=True),
                               "GET", key)
        if answer.status == 416:
            return b""  # the range starts at or past the end
        if answer.status == 200:  # the server ignored the range: at most ``end`` bytes were kept
            data = answer.body[start:end]
        elif answer.status == 206:
            data = answer.body
            first, last = _content_range(answer.headers.get("Content-Range"))
            if first != start or last is None or last > end - 1 or len(data) != last - first + 1:
                raise BadResponseError(f"GET {answer.url}: asked for bytes {start}-{end - 1}, got Content-Range "
                                       f"{answer.headers.get('Content-Range')!r} with {len(data)} bytes")
        else:
            raise BadResponseError(f"GET {answer.url}: status {answer.status} to a ranged GET")
        self.progress("get", key, len(data))
        return data

    def _head(self, key: str) -> _Answer:
        return self._checked(self._request("HEAD", key, {}, 0), "HEAD", key)

    def _exists(self, key: str) -> bool:
        try:
            self._head(key)
        except KeyNotFoundError:
            return False
        return True

    def _stat(self, key: str) -> KeyInfo:
        answer = self._head(key)
        size, modified = answer.headers.get("Content-Length"), answer.headers.get("Last-Modified")
        if size is None or not size.strip().isdigit() or modified is None:
            raise BackendError(f"HEAD {answer.url}: no Content-Length or Last-Modified to stat by")
        try:
            mtime = email.utils.parsedate_to_datetime(modified).timestamp()
        except (TypeError, ValueError):
            raise BackendError(f"HEAD {answer.url}: Last-Modified {modified!r} is not an HTTP date") from None
        return KeyInfo(int(size), mtime)

    def check_access(self) -> None:
        """Reach the server once (HEAD of the store marker; absent is fine: no version published yet)."""
        self._exists("deltastore.json")

    def close(self) -> None:
        self._conns.close()

    # -- read-only -----------------------------------------------------------------------------
    def _refuse(self, what: str, key: str) -> ReadOnlyStoreError:
        return ReadOnlyStoreError(f"{what} {key!r}: {self.uri} is read-only (an http(s):// store is read with "
                                  "GET; publish to the bucket or folder it serves)")

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        raise self._refuse("put", key)

    def _put_many(self, items: dict[str, bytes], mode: PutMode) -> None:
        raise self._refuse("put", next(iter(items), ""))

    def _delete(self, key: str) -> None:
        raise self._refuse("delete", key)

    def _touch(self, key: str) -> None:
        raise self._refuse("touch", key)

    def _delete_if_unmodified(self, key: str, seen: KeyInfo) -> bool:
        raise self._refuse("delete", key)

    def _list(self, prefix: str) -> Iterator[str]:
        raise ListingUnsupportedError(f"{self.uri} cannot list keys (plain HTTP); versions are found through "
                                      "refs/index.json")


def _validator_safe(headers: http.client.HTTPMessage) -> bool:
    """Whether the answer's ``ETag`` changes with every later write of the key. A file server's ETag is its
    file's modification time in whole seconds and its size (nginx, Apache): a rewrite with the same size in
    the same second keeps it. It is safe when the answer was made (``Date``) in a later second than the
    bytes were written (``Last-Modified``), or when there is no ``Last-Modified`` (a content hash, as from S3).
    """
    modified, date = headers.get("Last-Modified"), headers.get("Date")
    if modified is None:
        return True
    try:
        return date is not None and email.utils.parsedate_to_datetime(date) > \
            email.utils.parsedate_to_datetime(modified)
    except (TypeError, ValueError):
        return False


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """``(first, last)`` of ``Content-Range: bytes first-last/total``; Nones when malformed."""
    if not value or not value.startswith("bytes "):
        return None, None
    span = value[6:].partition("/")[0]
    first, _, last = span.partition("-")
    if not (first.strip().isdigit() and last.strip().isdigit()):
        return None, None
    return int(first), int(last)


__all__ = ["HttpBackend"]
