"""Bad inputs and faults: unknown schemes, missing extras, wrong credentials, missing buckets,
network errors mid-upload, conflicting writers."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import deltastore as ds
from deltastore.backends import open_backend
from deltastore.backends.fsspec import FsspecBackend
from deltastore.backends.retry import RetryPolicy, is_transient
from deltastore.errors import AccessDeniedError, BucketNotFoundError
from deltastore.errors import (BackendError, KeyExistsError, MissingDependencyError, UnknownBackendError,
                               VersionExistsError)
from deltastore.registry import Registry

from .conftest import NETWORK_KINDS, target_for
from .faultproxy import FaultProxy

FAST_RETRY = {"attempts": 4, "base_delay": 0.01, "max_delay": 0.05}


def _state(seed: int, n: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g).bfloat16(), "b": torch.randn(64, generator=g).bfloat16()}


# -- URIs and extras ------------------------------------------------------------------
def test_unknown_scheme_is_typed():
    with pytest.raises(UnknownBackendError, match="nosuch"):
        open_backend("nosuch://bucket/x")
    with pytest.raises(UnknownBackendError) as e:  # the typed error, which is also a LookupError
        ds.Subscriber("nosuch://bucket/x")
    assert isinstance(e.value, LookupError)


def test_missing_fsspec_implementation_names_the_extra(monkeypatch):
    import fsspec.registry  # noqa: F401 - the module; `fsspec.registry` the attribute is a read-only view

    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(MissingDependencyError, match=r"deltastore\[s3\]"):
        open_backend("s3://bucket/run")


def test_missing_hf_extra_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "deltastore.backends.hf", raising=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    reg = Registry("backend", "deltastore.test-none", UnknownBackendError)
    reg.register("hf", "deltastore.backends.hf:HfBucketBackend", install_hint="pip install 'deltastore[hf]'")
    with pytest.raises(MissingDependencyError, match=r"deltastore\[hf\]"):
        reg.get("hf")


def test_bad_hf_uris():
    from deltastore.backends.hf import parse_bucket_uri

    assert parse_bucket_uri("hf://buckets/org/b/run/1") == ("org/b", "run/1")
    assert parse_bucket_uri("hf://buckets/org/b") == ("org/b", "")
    for bad in ("hf://org/model", "hf://buckets/org", "hf://buckets//b", "hf://buckets/o/b/../x"):
        with pytest.raises(ValueError):
            parse_bucket_uri(bad)


def test_transient_classification():
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError())
    assert not is_transient(PermissionError())
    assert not is_transient(KeyExistsError("x"))
    calls = []

    def flaky(attempt):
        calls.append(attempt)
        if attempt < 2:
            raise ConnectionResetError("reset")
        return "ok"

    assert RetryPolicy(attempts=5, base_delay=0.001).call(flaky) == "ok" and calls == [0, 1, 2]
    with pytest.raises(ConnectionResetError):  # out of attempts: the last error comes through
        RetryPolicy(attempts=2, base_delay=0.001).call(lambda attempt: flaky(0))


# -- credentials and buckets ------------------------------------------------------------
def test_wrong_credentials_s3(seaweed_server, request, tmp_path):
    target = target_for("s3-seaweedfs", request, tmp_path)
    bad = {**target.options, "secret": "not-the-secret", "skip_instance_cache": True, "retry": FAST_RETRY}
    with pytest.raises(AccessDeniedError):
        open_backend(target.uri, **bad)
    with pytest.raises(AccessDeniedError) as e:
        ds.Subscriber(target.uri, storage_options=bad)
    assert isinstance(e.value, PermissionError)
    b = open_backend(target.uri, **bad, check_bucket=False)
    with pytest.raises(AccessDeniedError):
        b.get("deltastore.json")
    with pytest.raises(AccessDeniedError):
        b.put("x", b"1")


def test_wrong_credentials_hf(hf_server, request, tmp_path):
    target = target_for("hf", request, tmp_path)
    bad = {**target.options, "token": "hf_wrong", "retry": FAST_RETRY}
    with pytest.raises(AccessDeniedError):
        open_backend(target.uri, **bad)
    b = open_backend(target.uri, **bad, check_bucket=False)
    with pytest.raises(AccessDeniedError):
        b.put("x", b"1")


@pytest.mark.parametrize("kind", NETWORK_KINDS)
def test_missing_bucket(kind, request, tmp_path):
    target = target_for(kind, request, tmp_path)
    missing = target.uri.replace(target.bucket, target.bucket[:-4] + "zzzz")
    opts = {**target.options, "retry": FAST_RETRY}
    with pytest.raises(BucketNotFoundError, match="zzzz"):
        open_backend(missing, **opts)
    with pytest.raises(BucketNotFoundError, match="zzzz") as e:
        ds.Publisher(missing, storage_options=opts)
    assert isinstance(e.value, FileNotFoundError)
    with pytest.raises(BucketNotFoundError, match="zzzz"):
        ds.Subscriber(missing, storage_options=opts)


def test_hf_create_bucket_option(hf_server, request, tmp_path):
    target = target_for("hf", request, tmp_path)
    uri = target.uri.replace(target.bucket, target.bucket + "-new")
    b = open_backend(uri, **target.options, create_bucket=True)
    b.put("k", b"v")
    assert b.get("k") == b"v"


# -- network faults -----------------------------------------------------------------
@pytest.fixture
def proxied_s3(seaweed_server, request, tmp_path):
    """A store on SeaweedFS reached through a fault-injecting proxy."""
    target = target_for("s3-seaweedfs", request, tmp_path)
    proxy = FaultProxy(seaweed_server.port)
    opts = {**target.options, "endpoint_url": proxy.endpoint, "skip_instance_cache": True, "retry": FAST_RETRY,
            # only our retry layer (a refused manifest write must fail fast here)
            "retries": 1, "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}
    yield target, proxy, opts
    proxy.close()


def test_upload_cut_midway_is_retried(proxied_s3):
    target, proxy, opts = proxied_s3
    pub = ds.Publisher(target.uri, storage_options=opts)
    pub.publish(_state(0), step=0)
    proxy.add("PUT ", "cut_request", count=3)  # the next three uploads break mid-body
    s1 = _state(1)
    pub.publish(s1, step=1)
    assert [a for a, _ in proxy.fired].count("cut_request") == 3
    res = ds.Subscriber(target.uri, storage_options=target.options).pull()
    assert res.step == 1 and all(torch.equal(res.state[k].view(torch.int16), s1[k].view(torch.int16)) for k in s1)


def test_lost_answer_to_a_create_is_not_a_conflict(proxied_s3):
    target, proxy, opts = proxied_s3
    b = open_backend(target.uri, **opts)
    proxy.add("/versions/", "drop_response", count=1)  # the manifest lands, its answer is lost
    b.put("versions/000000000001.json", b"manifest", mode="create")
    assert proxy.fired and proxy.fired[0][0] == "drop_response"
    assert b.get("versions/000000000001.json") == b"manifest"
    with pytest.raises(KeyExistsError):  # a genuinely second create still conflicts
        b.put("versions/000000000001.json", b"manifest", mode="create")


def test_failed_commit_leaves_no_half_version(proxied_s3):
    target, proxy, opts = proxied_s3
    pub = ds.Publisher(target.uri, storage_options=opts)
    pub.publish(_state(0), step=0)
    proxy.add("/versions/", "refuse", count=-1)  # every manifest write fails, however often retried
    with pytest.raises(BackendError):
        pub.publish(_state(1), step=1)
    sub = ds.Subscriber(target.uri, storage_options=target.options)
    assert sub.versions() == [0]  # objects may be there; the version is not
    res = sub.pull()
    assert res.step == 0
    proxy.clear()
    s1 = _state(1)
    pub.publish(s1, step=1)  # the same step again, once the network is back
    res = sub.pull(res.state)
    assert res.step == 1 and torch.equal(res.state["w"].view(torch.int16), s1["w"].view(torch.int16))


def test_hf_transient_errors_are_retried(hf_server, request, tmp_path):
    target = target_for("hf", request, tmp_path)
    b = open_backend(target.uri, **target.options, retry=FAST_RETRY)
    hf_server.server.fail_next("batch", 2, 0)  # two dropped connections
    b.put("versions/000000000001.json", b"m", mode="create")
    hf_server.server.fail_next("paths-info", 1, 0)
    assert b.get("versions/000000000001.json") == b"m"
    hf_server.server.fail_next("tree", 1, 0)
    assert list(b.list("versions/")) == ["versions/000000000001.json"]


# -- conflicting writers ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["s3-seaweedfs", "s3-moto", "gcs"])
def test_racing_publishers_exactly_one_wins(kind, request, tmp_path):
    target = target_for(kind, request, tmp_path)
    ds.Publisher(target.uri, storage_options=target.options).publish(_state(0), step=0)
    pubs = [ds.Publisher(target.uri, storage_options=target.options) for _ in range(4)]
    barrier = threading.Barrier(len(pubs))
    outcome: dict[int, str] = {}

    def run(i: int) -> None:
        state = _state(100 + i)
        barrier.wait()
        try:
            pubs[i].publish(state, step=1)
            outcome[i] = "won"
        except VersionExistsError:
            outcome[i] = "lost"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pubs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcome.values()) == ["lost", "lost", "lost", "won"]
    winner = next(i for i, o in outcome.items() if o == "won")
    res = ds.Subscriber(target.uri, storage_options=target.options).pull()
    assert res.step == 1 and torch.equal(res.state["w"].view(torch.int16), _state(100 + winner)["w"].view(torch.int16))


def test_hf_second_writer_gets_typed_error(hf_server, request, tmp_path):
    target = target_for("hf", request, tmp_path)
    a = ds.Publisher(target.uri, storage_options=target.options)
    b = ds.Publisher(target.uri, storage_options=target.options)
    a.publish(_state(0), step=0)
    with pytest.raises(VersionExistsError):
        b.publish(_state(1), step=0)


def test_hf_verification_catches_an_overwrite(hf_server, request, tmp_path, monkeypatch):
    """A writer whose value is replaced between its write and its read-back reports the conflict."""
    target = target_for("hf", request, tmp_path)
    b = open_backend(target.uri, **target.options)
    other = open_backend(target.uri, **target.options)
    real_download = b.inner._download  # b is the retry layer around the HF backend

    def download_after_rival(paths):
        other.put("versions/000000000005.json", b"rival", mode="overwrite")
        return real_download(paths)

    monkeypatch.setattr(b.inner, "_download", download_after_rival)
    with pytest.raises(KeyExistsError, match="concurrently"):
        b.put("versions/000000000005.json", b"mine", mode="create")
    assert other.get("versions/000000000005.json") == b"rival"


def test_progress_callback_and_batches(seaweed_server, request, tmp_path):
    target = target_for("s3-seaweedfs", request, tmp_path)
    seen: list[tuple[str, str, int]] = []
    b = open_backend(target.uri, **target.options, progress=lambda op, key, n: seen.append((op, key, n)),
                     max_workers=8)
    assert isinstance(b.inner, FsspecBackend)
    b.put_many({f"k{i}": bytes(i) for i in range(10)})
    assert b.get_many([f"k{i}" for i in range(10)]) == {f"k{i}": bytes(i) for i in range(10)}
    assert sorted(seen) == sorted([("put", f"k{i}", i) for i in range(10)] + [("get", f"k{i}", i) for i in range(10)])
