"""Hostile and broken HTTP servers: each gets a typed error in bounded time and memory, and nothing is applied.

A real store is published on local disk and served by :class:`HostileServer` (Python's http.server,
HTTP/1.1 keep-alive). A follower pulls step 1 honestly; then the server breaks its answers for the keys
of step 2 (or the index) in one way per case, and the follower's pull of the latest must raise the typed
error the case names, within a time bound, with the target's bits and tracked version unchanged.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest
import torch

import deltastore as ds
from deltastore.pull import tracking
from deltastore.backends.http import HttpBackend
from deltastore.errors import (BackendUnavailableError, BadResponseError, CorruptObjectError, DeltaStoreError,
                               StoreIndexError, TransferTooSlowError, ValueTooLargeError)
from deltastore.index import INDEX_KEY
from deltastore.store import object_key, version_key

from .http_servers import HostileHandler, HostileServer

DEADLINE = 2.0
OPTIONS = {"deadline": DEADLINE, "read_timeout": 0.5, "connect_timeout": 1.0, "min_speed": 4096}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.fixture
def store(tmp_path):
    """A store with an anchor (step 1) and a delta (step 2) on disk; ``(root, step-1 weights, step-2 keys)``."""
    g = torch.Generator().manual_seed(5)
    w = {"w": torch.randn(256, 128, generator=g).to(torch.bfloat16)}
    with ds.Publisher(str(tmp_path / "store")) as pub:
        pub.publish(w, step=1)
        first = {k: v.clone() for k, v in w.items()}
        w["w"][::3, ::2] += 1
        pub.publish(w, step=2)
        m = pub.store.manifest(2)
        keys = [object_key(d) for d in m.references() if d != (m.layout_ref.digest if m.layout_ref else None)]
    return tmp_path, first, keys


@pytest.fixture
def server(store):
    root, _, _ = store
    s = HostileServer(root).start()
    yield s
    s.stop()


def on(keys, behave):
    """A misbehaviour for ``keys`` only (the rest is served honestly)."""
    keys = set(keys)

    def misbehave(h: HostileHandler, key: str, body: bytes) -> bool:
        if key not in keys:
            return False
        behave(h, body)
        return True

    return misbehave


def pull_against(server, store, misbehave, **options):
    """Pull step 1 honestly, then the latest with ``misbehave`` on: (the error, seconds it took, target)."""
    _, first, _ = store
    sub = ds.Subscriber(server.url, storage_options={**OPTIONS, **options})
    target = sub.pull(step=1).state
    held = tracking.get_version(target)
    assert torch.equal(bits(target["w"]), bits(first["w"]))
    server.hits.clear()
    server.set(misbehave)
    began = time.monotonic()
    with pytest.raises(DeltaStoreError) as info:
        sub.pull(target)
    took = time.monotonic() - began
    assert torch.equal(bits(target["w"]), bits(first["w"])), "bits changed"
    assert tracking.get_version(target) == held, "tracked version changed"
    return info.value, took


# -- the misbehaviours ----------------------------------------------------------------------------------
def short_length(h, body):  # declares fewer bytes than it sends (the rest stays on the connection)
    h.head_only(200, Content_Length=str(len(body) - 7))
    h.wfile.write(body)


def truncated(h, body):  # declares every byte, sends half, hangs up
    h.head_only(200, Content_Length=str(len(body)))
    h.wfile.write(body[: len(body) // 2])


def flipped(h, body):  # the right length, one bit changed
    h.head_only(200, Content_Length=str(len(body)))
    h.wfile.write(body[:-1] + bytes([body[-1] ^ 1]))


def huge_declared(h, body):  # a terabyte declared; a client that believed it would allocate it
    h.head_only(200, Content_Length=str(10**12))
    h.wfile.write(body)


def endless(h, body):  # no length: close-delimited, and it never ends
    h.head_only(200, Connection="close")
    h.server.sent = 0
    chunk = b"\0" * 65536
    try:
        while h.server.sent < 1 << 30:
            h.wfile.write(chunk)
            h.server.sent += len(chunk)
    except OSError:
        pass


def undeclared_honest(h, body):  # no length, the right bytes, then close: legal HTTP/1.1
    h.head_only(200, Connection="close")
    h.wfile.write(body)


def redirect_loop(h, body):  # A -> A?again -> A
    base, _, query = h.path.partition("?")
    h.head_only(302, Location=base if query else f"{base}?again", Content_Length="0")


def redirect_chain(h, body):  # every answer a redirect to a new URL: never a body
    n = int(h.path.rpartition("n=")[2]) if "n=" in h.path else 0
    h.head_only(307, Location=f"{h.path.split('?')[0]}?n={n + 1}", Content_Length="0")


def trickle_body(h, body):
    h.head_only(200, Content_Length=str(len(body)))
    try:
        for i in range(len(body)):
            h.wfile.write(body[i:i + 1])
            h.wfile.flush()
            time.sleep(0.02)
    except OSError:
        pass


def trickle_headers(h, body):
    try:
        for ch in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100000:
            h.wfile.write(bytes([ch]))
            h.wfile.flush()
            time.sleep(0.05)
    except OSError:
        pass


def silent(h, body):
    time.sleep(4)


def garbage(h, body):
    h.wfile.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")


def server_error(h, body):
    h.head_only(503, Content_Length="0")


HOSTILE = {
    # name: (misbehaviour, expected error, seconds the pull may take at most)
    "content-length-short": (short_length, CorruptObjectError, 5),
    "truncated-body": (truncated, BackendUnavailableError, DEADLINE + 5),
    "flipped-bit": (flipped, CorruptObjectError, 5),
    "terabyte-declared": (huge_declared, CorruptObjectError, 5),
    "endless-undeclared-body": (endless, CorruptObjectError, 10),
    "redirect-loop": (redirect_loop, BadResponseError, 5),
    "redirect-chain": (redirect_chain, BadResponseError, 5),
    "trickled-body": (trickle_body, BackendUnavailableError, DEADLINE + 5),
    "trickled-headers": (trickle_headers, BackendUnavailableError, DEADLINE + 5),
    "silent": (silent, BackendUnavailableError, DEADLINE + 5),
    "not-http": (garbage, BadResponseError, 5),
    "503": (server_error, BackendUnavailableError, DEADLINE + 5),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_object_answers(case, server, store):
    behave, expected, bound = HOSTILE[case]
    _, _, keys = store
    error, took = pull_against(server, store, on(keys, behave))
    assert isinstance(error, expected), f"{case}: {type(error).__name__}: {error}"
    assert took < bound, f"{case}: {took:.1f} s"
    if case in ("trickled-body", "trickled-headers", "silent"):
        assert isinstance(error.__cause__, TransferTooSlowError) or "min_speed" in str(error) \
            or "read_timeout" in str(error) or "nothing received" in str(error), str(error)


def test_undeclared_length_with_the_right_bytes_is_fine(server, store):
    """No Content-Length, close-delimited: legal, and the bytes check out."""
    _, first, keys = store
    sub = ds.Subscriber(server.url, storage_options=OPTIONS)
    target = sub.pull(step=1).state
    server.set(on(keys, undeclared_honest))
    assert sub.pull(target).step == 2


def test_endless_body_memory_is_bounded(server, store):
    """An endless body is read up to the size the manifest gives plus one byte; what this process allocates
    for it stays near that size, not near what the server sends."""
    root, _, keys = store
    server.set(on(keys, endless))
    backend = HttpBackend(server.url, **{k: v for k, v in OPTIONS.items() if k != "deadline"})
    size = (root / "store" / keys[0]).stat().st_size
    tracemalloc.start()
    try:
        with pytest.raises(ValueTooLargeError):
            backend.get_bounded(keys[0], size)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * size + (4 << 20), peak


def test_tampered_manifest_against_the_index(server, store):
    """A manifest whose bytes are not the ones the index names is refused before any object is read."""
    def swap(h, body):
        other = body.replace(b'"metadata":{}', b'"metadata":{"x":1}')
        assert other != body
        h.head_only(200, Content_Length=str(len(other)))
        h.wfile.write(other)

    error, _ = pull_against(server, store, on([version_key(2)], swap))
    assert isinstance(error, StoreIndexError), error
    assert server.hits and not any(k.startswith("objects/") for _, k in server.hits), server.hits


def test_oversized_index(server, store):
    def big(h, body):
        data = b" " * (2 << 20)
        h.head_only(200, Content_Length=str(len(data)))
        h.wfile.write(data)

    error, took = pull_against(server, store, on([INDEX_KEY], big))
    assert isinstance(error, StoreIndexError) and took < 5, error


def test_wrong_content_range(server, store):
    root, _, keys = store

    def wrong_range(h, body):
        h.head_only(206, Content_Length="10", Content_Range=f"bytes 5-14/{len(body)}")
        h.wfile.write(body[5:15])

    server.set(on(keys, wrong_range))
    backend = HttpBackend(server.url, **{k: v for k, v in OPTIONS.items() if k != "deadline"})
    with pytest.raises(BadResponseError, match="Content-Range"):
        backend.get_range(keys[0], 0, 10)
