"""Typed errors in bounded time (issue 12) and the backend items of issue 13: unreachable endpoints,
read-only and full stores, misspelt options, file modes, a clean import, HF listings of absent prefixes,
one DEBUG line per retry."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore.backends import open_backend
from deltastore.backends.local import LocalBackend
from deltastore.errors import (BackendError, BackendUnavailableError, ReadOnlyStoreError,
                               StoreFullError, UnknownOptionError, VersionNotFoundError)
from deltastore.testing.faults import Fault, FaultyBackend
from deltastore.backends.retry import RetryingBackend

from .conftest import target_for
from .faultproxy import FaultProxy
from .servers import free_port

DEADLINE = 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2048, generator=g).bfloat16()}


# -- unreachable endpoints: typed, within the deadline -------------------------------------------
@pytest.mark.parametrize("uri,options", [
    ("s3://bucket-x/run", lambda ep: {"endpoint_url": ep, "key": "k", "secret": "s"}),
    ("gs://bucket-x/run", lambda ep: {"endpoint_url": ep, "token": "anon"}),
    ("hf://buckets/ns/b/run", lambda ep: {"endpoint": ep, "token": "hf_x"}),
], ids=["s3", "gcs", "hf"])
def test_unreachable_endpoint_fails_typed_within_the_deadline(uri, options):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens: connections are refused
    opts = {**options(endpoint), "deadline": DEADLINE}
    for open_it in (lambda: ds.Subscriber(uri, storage_options=opts), lambda: ds.Publisher(uri, storage_options=opts)):
        start = time.monotonic()
        # a refused connection to a store not reached yet is not retried (nothing listens: a wrong endpoint)
        with pytest.raises(BackendUnavailableError, match=r"store unreachable: connection refused \(not retried") as e:
            open_it()
        took = time.monotonic() - start
        # no retry at all; the clients' own retries would multiply the deadline (33-200 s before)
        assert took < DEADLINE + 5, f"took {took:.1f} s"
        assert isinstance(e.value, BackendError) and isinstance(e.value, ConnectionError)
        assert "127.0.0.1" in str(e.value)


def test_server_down_mid_run_fails_typed_then_the_same_step_publishes(seaweed_server, request, tmp_path):
    target = target_for("s3-seaweedfs", request, tmp_path)
    proxy = FaultProxy(seaweed_server.port)
    opts = {**target.options, "endpoint_url": proxy.endpoint, "deadline": DEADLINE, "skip_instance_cache": True}
    try:
        pub = ds.Publisher(target.uri, storage_options=opts)
        pub.publish(_state(0), step=0)
        sub = ds.Subscriber(target.uri, storage_options=opts)
        held = sub.pull().state
        pub.publish(_state(1), step=1)
        proxy.add("", "refuse", count=-1)  # the server is down: every connection is closed at once
        before = {k: v.clone() for k, v in held.items()}
        for what, call in (("pull", lambda: sub.pull(held)), ("publish", lambda: pub.publish(_state(2), step=2))):
            start = time.monotonic()
            with pytest.raises(BackendUnavailableError, match="store unreachable after"):
                call()
            assert time.monotonic() - start < DEADLINE + 5, what
        assert bits_equal(held, before)  # the target is untouched
        proxy.clear()  # the server is back: the same step publishes, the follower moves on
        pub.publish(_state(2), step=2)
        assert sub.pull(held).step == 2 and bits_equal(held, _state(2))
        assert ds.Subscriber(target.uri, storage_options=target.options).versions() == [0, 1, 2]
    finally:
        proxy.close()


_USER_RETRIES = [{"max_attempts": 10, "mode": "standard"}, {"total_max_attempts": 20, "mode": "adaptive"},
                 {"max_attempts": 8, "mode": "legacy"}]


@pytest.mark.parametrize("retries", _USER_RETRIES, ids=["standard-10", "adaptive-20", "legacy-8"])
def test_a_botocore_retry_setting_is_merged_and_the_deadline_holds(retries, caplog):
    """s3fs users pass ``config_kwargs={"retries": {...}}``: botocore would retry inside every try of the
    retry layer (55 s against a 3 s deadline). Merged instead: one botocore try, their mode kept, a warning."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    opts = {"endpoint_url": endpoint, "key": "k", "secret": "s", "deadline": DEADLINE,
            "config_kwargs": {"retries": dict(retries)}}
    with caplog.at_level(logging.WARNING, logger="deltastore.backends"):
        start = time.monotonic()
        with pytest.raises(BackendUnavailableError, match=r"store unreachable: connection refused"):
            ds.Subscriber("s3://bucket-x/run", storage_options=opts)
        assert time.monotonic() - start < DEADLINE + 5
    ignored = [r.getMessage() for r in caplog.records if "config_kwargs retries" in r.getMessage()]
    assert ignored and all("ignored" in m for m in ignored), ignored
    backend = open_backend("s3://bucket-x/run", **{**opts, "check_bucket": False})
    got = dict(backend.inner.fs.config_kwargs["retries"])
    assert got == {**{k: v for k, v in retries.items() if k != "max_attempts"}, "total_max_attempts": 1}, got


def test_a_botocore_retry_setting_makes_one_request_per_try_on_seaweedfs(seaweed_server, request, tmp_path):
    """The same on the real S3 server gone down behind a proxy: the HTTP requests the client sends are the
    retry layer's tries (none of botocore's own), and the typed error comes within the deadline."""
    target = target_for("s3-seaweedfs", request, tmp_path)
    proxy = FaultProxy(seaweed_server.port)
    opts = {**target.options, "endpoint_url": proxy.endpoint, "deadline": DEADLINE, "skip_instance_cache": True,
            "config_kwargs": {"retries": {"max_attempts": 10, "mode": "standard"}}}
    try:
        pub = ds.Publisher(target.uri, storage_options=opts)
        pub.publish(_state(0), step=0)
        sub = ds.Subscriber(target.uri, storage_options=opts)
        held = sub.pull().state
        before = {k: v.clone() for k, v in held.items()}
        pub.publish(_state(1), step=1)
        proxy.add("", "refuse", count=-1)
        proxy.fired.clear()
        start = time.monotonic()
        with pytest.raises(BackendUnavailableError, match=r"store unreachable after (\d+) tries") as e:
            sub.pull(held)
        assert time.monotonic() - start < DEADLINE + 5
        tries = int(re.search(r"after (\d+) tries", str(e.value)).group(1))
        # botocore retried nothing itself: at most the one resend of a request whose pooled connection was
        # closed (aiohttp's, also without the setting), not 10 tries per try
        assert tries <= len(proxy.fired) <= 2 * tries, (proxy.fired, str(e.value))
        assert bits_equal(held, before)
        proxy.clear()
        assert sub.pull(held).step == 1 and bits_equal(held, _state(1))
        assert ds.Subscriber(target.uri, storage_options=target.options).versions() == [0, 1]
    finally:
        proxy.close()


def test_retry_logs_one_line_per_retry_with_its_cause_the_first_at_info(caplog, tmp_path):
    inner = FaultyBackend(LocalBackend(tmp_path), rules=[Fault("transient", ops="get", limit=2)])
    b = RetryingBackend(inner, {"attempts": 5, "base_delay": 0.001, "max_delay": 0.002})
    b.put("k", b"v")
    with caplog.at_level(logging.DEBUG, logger="deltastore.backends"):
        assert b.get("k") == b"v"
    lines = [r for r in caplog.records if r.name == "deltastore.backends.retry"]
    # the first retry since the store last answered at INFO (what, why, the deadline), the others at DEBUG
    assert [r.levelno for r in lines] == [logging.INFO, logging.DEBUG]
    assert all("injected transient fault on get 'k'" in r.getMessage() for r in lines), [r.getMessage() for r in lines]
    assert "retrying for up to" in lines[0].getMessage() and "'deadline'" in lines[0].getMessage()
    inner.rules = [Fault("transient", ops="get", limit=1)]  # a new outage after a success: announced again
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="deltastore.backends"):
        assert b.get("k") == b"v"
    assert [r.levelno for r in caplog.records if r.name == "deltastore.backends.retry"] == [logging.INFO]


# -- local stores: permissions, read-only mounts, full disks ----------------------------------
_READ_ONLY_CHILD = r"""
import os, sys, json
import torch, deltastore as ds
from deltastore.errors import AccessDeniedError
uri, uid = sys.argv[1], int(sys.argv[2])
ds.Subscriber(uri).pull()  # as root: every module a pull imports is loaded (the interpreter lives under /root)
if uid >= 0:
    os.setgid(uid); os.setuid(uid)
sub = ds.Subscriber(uri)                       # another user can read the store (0644 / 0755)
state = sub.pull().state
out = {"read": int(state["w"].view(torch.int16).sum())}
try:
    ds.Publisher(uri).publish({"w": torch.zeros(2048, dtype=torch.bfloat16)}, step=5)
except AccessDeniedError as e:
    out["error"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def test_local_store_modes_and_another_user():
    base = tempfile.mkdtemp(prefix="deltastore-modes-")  # pytest's tmp_path is 0700: no other user gets in
    os.chmod(base, 0o755)
    uri = os.path.join(base, "store")
    old = os.umask(0o022)
    try:
        with ds.Publisher(uri, anchor_every=2) as pub:
            pub.publish(_state(0), step=0)
            pub.publish(_state(1), step=1)
    finally:
        os.umask(old)
    modes = {}
    for root, dirs, files in os.walk(uri):
        for d in dirs:
            modes[os.path.join(root, d)] = stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode)
        for f in files:
            modes[os.path.join(root, f)] = stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode)
    assert any("/objects/" in p for p in modes) and any(p.endswith(".json") for p in modes)
    for path, mode in modes.items():
        assert mode == (0o755 if os.path.isdir(path) else 0o644), (path, oct(mode))
    # a different uid reads it, and a write there is refused as AccessDeniedError
    uid = 65534 if os.geteuid() == 0 else -1
    if uid < 0:
        os.chmod(uri, 0o555)  # not root: the same user, a store it may not write
        for root, dirs, _ in os.walk(uri):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o555)
    try:
        env = {**os.environ, "PYTHONPATH": ROOT}
        out = subprocess.run([sys.executable, "-c", _READ_ONLY_CHILD, uri, str(uid)], env=env, capture_output=True,
                             text=True, timeout=120)
        for root, dirs, _ in os.walk(uri):
            os.chmod(root, 0o755)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["read"] == int(_state(1)["w"].view(torch.int16).sum())
        assert got["error"][0] == "AccessDeniedError" and "permission denied" in got["error"][1]
        assert ds.Subscriber(uri).versions() == [0, 1]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("code,cls,words", [(errno.EROFS, ReadOnlyStoreError, "read-only"),
                                            (errno.ENOSPC, StoreFullError, "no space left")])
def test_read_only_mount_and_full_disk_are_typed(tmp_path, monkeypatch, code, cls, words):
    uri = str(tmp_path / "store")
    with ds.Publisher(uri, anchor_every=2) as pub:
        pub.publish(_state(0), step=0)
        real_open = os.open

        def failing_open(path, flags, *args, **kw):  # what the kernel answers on such a file system
            if flags & os.O_CREAT:
                raise OSError(code, os.strerror(code), path)
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(os, "open", failing_open)
        with pytest.raises(cls, match=words) as e:
            pub.publish(_state(1), step=1)
        assert isinstance(e.value, BackendError) and "objects/" in str(e.value)
        monkeypatch.setattr(os, "open", real_open)
    sub = ds.Subscriber(uri)
    assert sub.versions() == [0] and bits_equal(sub.pull().state, _state(0))
    with pytest.raises(VersionNotFoundError):
        sub.pull(step=1)


# -- options ------------------------------------------------------------------------------------
def test_misspelt_options_name_the_key_and_the_valid_ones(tmp_path):
    with pytest.raises(UnknownOptionError, match=r"'fsynk'.*did you mean 'fsync'\? Valid: deadline, fsync, retry") as e:
        ds.Publisher(str(tmp_path / "s"), storage_options={"fsynk": True})
    assert isinstance(e.value, ValueError)
    with pytest.raises(UnknownOptionError, match=r"\['atempts'\].*valid: \['attempts', 'base_delay'"):
        open_backend(str(tmp_path / "s"), retry={"atempts": 3})
    with pytest.raises(ValueError, match="deadline"):
        open_backend(str(tmp_path / "s"), deadline="soon")
    with pytest.raises(UnknownOptionError, match=r"unknown storage option 'x' for memory://m; valid: deadline, retry"):
        open_backend("memory://m", x=1)


# -- a clean import -------------------------------------------------------------------------------
def test_import_and_open_leave_the_environment_alone(tmp_path):
    code = ("import os, json; before = dict(os.environ)\n"
            "import deltastore, deltastore.backends.fsspec, deltastore.backends.hf\n"
            "from deltastore.backends import open_backend\n"
            "open_backend('s3://b/x', endpoint_url='http://127.0.0.1:9', key='k', secret='s', check_bucket=False)\n"
            "open_backend('gs://b/x', endpoint_url='http://127.0.0.1:9', token='anon', check_bucket=False)\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "GCSFS_"))} | {"PYTHONPATH": ROOT, "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


# -- HF buckets: a fresh store lists nothing, whatever the server answers ---------------------------
@pytest.mark.parametrize("answer", [200, 404], ids=["empty-page", "404"])
def test_hf_absent_prefix_lists_nothing(hf_server, request, tmp_path, answer):
    target = target_for("hf", request, tmp_path)
    hf_server.server.absent_prefix_status = answer
    try:
        b = open_backend(target.uri, **target.options)
        assert list(b.list("versions/")) == []
        with ds.Publisher(target.uri, storage_options=target.options) as pub:  # failed with KeyNotFoundError
            pub.publish(_state(0), step=0)
        store = ds.Subscriber(target.uri, storage_options=target.options).store
        assert store.versions() == [0]
        assert list(b.list("nothing-here/")) == []
        # no atomic create on HF buckets: the commit says so in the manifest
        assert store.manifest(0).producer["commit"] == "check-then-write"
    finally:
        hf_server.server.absent_prefix_status = 200
