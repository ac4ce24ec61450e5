"""The http(s):// read path against real servers: Debian's nginx (plain and TLS) and Python's http.server.

A publisher writes a store folder on local disk; the server serves it; Subscribers read it through
``http://`` with no listing API, finding versions through ``refs/index.json``. The hostile servers are in
``test_http_hostile.py``.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
import uuid

import pytest
import torch

import deltastore as ds
from deltastore.backends import open_backend
from deltastore.backends.http import HttpBackend
from deltastore.backends.local import LocalBackend
from deltastore.errors import (AccessDeniedError, BackendUnavailableError, BadResponseError, KeyNotFoundError,
                               ReadOnlyStoreError, UnknownOptionError)
from deltastore.index import INDEX_KEY
from deltastore.store import version_key
from deltastore.testing import ReadOnlyBackendConformance

from .http_servers import FileServer, Nginx, parse_access_log_uri
from .servers import ServerStartError


def _start(server):
    try:
        return server.start()
    except ServerStartError as e:
        pytest.fail(f"{type(server).__name__} could not start: {e}", pytrace=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder, and nginx serving it (as docs/backends.md configures it)."""
    root = tmp_path_factory.mktemp("served")
    os.chmod(root, 0o755)
    server = _start(Nginx.static(root))
    yield root, server
    server.stop()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(96, 64, generator=g).to(torch.bfloat16),
            "b": torch.randn(300, generator=g).to(torch.bfloat16)}


def step_model(w: dict, step: int) -> None:
    w["w"][step % 96, : 8] += 1
    w["b"][step % 300] -= 1


class TestNginxConformance(ReadOnlyBackendConformance):
    @pytest.fixture
    def large_size(self) -> int:
        return 8 << 20

    @pytest.fixture
    def pair(self, served):
        root, server = served
        name = uuid.uuid4().hex
        reader = open_backend(f"{server.url}/{name}", deadline=5)
        yield reader, LocalBackend(root / name)
        reader.close()


class TestFileServerConformance(ReadOnlyBackendConformance):
    """Python's http.server: HTTP/1.0, no Range support (a ranged read falls back to a bounded whole read)."""

    @pytest.fixture
    def large_size(self) -> int:
        return 4 << 20

    @pytest.fixture
    def pair(self, tmp_path):
        server = FileServer(tmp_path).start()
        reader = open_backend(f"{server.url}/store", deadline=5)
        yield reader, LocalBackend(tmp_path / "store")
        reader.close()
        server.stop()


def test_follow_every_step_over_nginx(served):
    """Every step pulled through http:// is bit-exact; a joiner starts from the anchor; nothing is listed;
    the served headers make objects and manifests cacheable forever and refs/ briefly."""
    root, server = served
    name = uuid.uuid4().hex
    w = model()
    pub = ds.Publisher(str(root / name), anchor_every=4)
    pub.publish(w, step=1)
    sub = ds.Subscriber(f"{server.url}/{name}", storage_options={"deadline": 5})
    state = sub.pull().state
    for step in range(2, 11):
        step_model(w, step)
        pub.publish(w, step=step)
        result = sub.pull(state)
        assert result.step == step and same_bits(state, w)
    assert sub.versions() == list(range(1, 11)) == pub.store.versions()
    joiner = ds.Subscriber(f"{server.url}/{name}")
    joined = joiner.pull()
    assert joined.path == "anchor" and same_bits(joined.state, w)
    keys = [parse_access_log_uri(r[1], name) for r in server.requests() if f"/{name}/" in r[1]]
    assert not any(k.endswith("/") for k in keys)  # no folder (listing) request was ever made
    for key, expected in ((version_key(10), "immutable"), (INDEX_KEY, "max-age=1,"), ("refs/latest", "max-age=1,")):
        with urllib.request.urlopen(f"{server.url}/{name}/{key}") as r:
            assert expected in r.headers["Cache-Control"], key
    obj = next(k for k in pub.store.backend.list("objects/"))
    with urllib.request.urlopen(f"{server.url}/{name}/{obj}") as r:
        assert "immutable" in r.headers["Cache-Control"]
    pub.close()


def test_polling_uses_conditional_gets(served):
    """A follower polling an unchanged store gets 304s with no body; a new commit is seen at the next poll."""
    root, server = served
    name = uuid.uuid4().hex
    w = model(1)
    pub = ds.Publisher(str(root / name))
    pub.publish(w, step=1)
    time.sleep(1.1)  # the index's ETag is its mtime second and size: an answer made in a later second is a safe validator
    sub = ds.Subscriber(f"{server.url}/{name}")
    for _ in range(5):
        assert sub.versions() == [1]
    polls = [r for r in server.requests() if r[1] == f"/{name}/{INDEX_KEY}"]
    assert [r[2] for r in polls] == [200, 304, 304, 304, 304]
    assert all(r[3] == 0 for r in polls[1:])  # a 304 carries no body
    step_model(w, 2)
    pub.publish(w, step=2)
    assert sub.versions() == [1, 2]  # rewritten in another second or with another size: a new ETag
    pub.publish(w, step=3)  # right after: same second, maybe same size
    assert sub.versions() == [1, 2, 3]
    pub.close()


def test_store_without_index(served):
    """A store written before the index (no refs/index.json): a reader without listing finds the latest
    through refs/latest and pulls it."""
    root, server = served
    name = uuid.uuid4().hex
    w = model(2)
    with ds.Publisher(str(root / name)) as pub:
        pub.publish(w, step=1)
        step_model(w, 2)
        pub.publish(w, step=2)
    os.remove(root / name / "refs" / "index.json")
    sub = ds.Subscriber(f"{server.url}/{name}")
    assert sub.versions() == [2]
    assert same_bits(sub.pull().state, w)


def test_listing_readers_ignore_the_index(tmp_path):
    """On a listing backend the listing is the source of truth: an index naming other versions changes
    nothing (and is never read), so an old reader, which does not know it, reads the same store."""
    w = model(3)
    with ds.Publisher(str(tmp_path / "s")) as pub:
        for step in (1, 2, 3):
            step_model(w, step)
            pub.publish(w, step=step)
    (tmp_path / "s" / "refs" / "index.json").write_bytes(b"not json at all")
    sub = ds.Subscriber(str(tmp_path / "s"))
    assert sub.versions() == [1, 2, 3]
    assert same_bits(sub.pull().state, w)


def test_options_and_urls():
    with pytest.raises(UnknownOptionError, match="read_timeot"):
        open_backend("http://127.0.0.1:9/x", read_timeot=3)
    with pytest.raises(ValueError, match="credentials"):
        open_backend("https://user:secret@example.invalid/store")
    with pytest.raises(ValueError, match="query"):
        open_backend("https://example.invalid/store?x=1")
    with pytest.raises(ValueError, match="min_speed"):
        open_backend("http://127.0.0.1:9/x", min_speed=0)
    with pytest.raises(BackendUnavailableError, match="Connection refused"):  # nothing listens there
        open_backend("http://127.0.0.1:9/x", deadline=0.5, retry=2)
    with pytest.raises(ReadOnlyStoreError):
        HttpBackend("http://127.0.0.1:9/x").put("refs/latest", b"1")


def _self_signed(folder) -> tuple[str, str]:
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_https(tmp_path):
    """TLS through nginx: trusted with ca_file; an untrusted certificate is AccessDeniedError; a redirect
    from https to http is refused (BadResponseError)."""
    os.chmod(tmp_path, 0o755)
    cert, key = _self_signed(tmp_path)
    w = model(4)
    with ds.Publisher(str(tmp_path / "s")) as pub:
        pub.publish(w, step=1)
    server = _start(Nginx.static(tmp_path, "location /down/ { return 301 http://127.0.0.1:9/s/; }", tls=(cert, key)))
    try:
        sub = ds.Subscriber(f"{server.url}/s", storage_options={"ca_file": cert, "deadline": 2})
        assert same_bits(sub.pull().state, w)
        with pytest.raises(AccessDeniedError, match="certificate"):
            ds.Subscriber(f"{server.url}/s", storage_options={"deadline": 2})
        with pytest.raises(BadResponseError, match="downgrade"):
            open_backend(f"{server.url}/down", ca_file=cert, deadline=2)
        with pytest.raises(KeyNotFoundError):
            open_backend(f"{server.url}/s", ca_file=cert).get("no/such/key")
    finally:
        server.stop()


def test_cli_over_http(served, capsys):
    """ls/verify read an http:// store through its index; a URL with no store there is exit 3."""
    from deltastore.cli import main

    root, server = served
    name = uuid.uuid4().hex
    with ds.Publisher(str(root / name)) as pub:
        pub.publish(model(5), step=1)
    assert main(["ls", f"{server.url}/{name}"]) == 0
    assert main(["verify", f"{server.url}/{name}"]) == 0
    assert main(["ls", f"{server.url}/{uuid.uuid4().hex}"]) == 3
    assert "not a deltastore store" in capsys.readouterr().err
