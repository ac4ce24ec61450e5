"""Fixtures for the backend tests: real servers (session scope) and fresh stores on each backend kind.

A server that cannot start fails the tests that need it, with its log tail
in the message (never a skip), in CI and locally alike.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from deltastore.backends import open_backend  # noqa: E402

from .servers import FakeGcs, HfStandin, Moto, Seaweed, ServerStartError  # noqa: E402

NETWORK_KINDS = ["s3-seaweedfs", "s3-moto", "gcs", "hf"]
ALL_KINDS = ["local", "memory", *NETWORK_KINDS]


def _start(server_cls: type) -> Any:
    server = server_cls()
    try:
        return server.start()
    except ServerStartError as e:
        ci = " (CI=true)" if os.environ.get("CI") == "true" else ""
        pytest.fail(f"test server {server_cls.name} could not start{ci}: {e}", pytrace=False)


@pytest.fixture(scope="session")
def seaweed_server():
    server = _start(Seaweed)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server():
    server = _start(Moto)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    server = _start(FakeGcs)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_server():
    server = _start(HfStandin)
    yield server
    server.stop()


_SERVER_FIXTURE = {"s3-seaweedfs": "seaweed_server", "s3-moto": "moto_server", "gcs": "gcs_server",
                   "hf": "hf_server"}


@dataclass
class StoreTarget:
    """Where a test's store lives: ``uri`` plus ``options`` (storage options) on backend ``kind``."""

    kind: str
    uri: str
    options: dict = field(default_factory=dict)
    server: Any = None
    bucket: str = ""

    def open(self, **extra: Any):
        return open_backend(self.uri, **{**self.options, **extra})

    def with_uri(self, uri: str) -> StoreTarget:
        return StoreTarget(self.kind, uri, dict(self.options), self.server, self.bucket)


def make_bucket(kind: str, server: Any) -> str:
    """Create a fresh bucket on ``server`` and return its name."""
    name = f"ds-{uuid.uuid4().hex[:16]}"
    if kind.startswith("s3"):
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options()).mkdir(name)
    elif kind == "gcs":
        import gcsfs

        gcsfs.GCSFileSystem(skip_instance_cache=True, **server.storage_options()).mkdir(name)
    elif kind == "hf":
        from huggingface_hub import HfApi

        name = f"deltastore-tests/{name}"
        HfApi(endpoint=server.endpoint, token=server.token).create_bucket(name)
    return name


def target_for(kind: str, request: pytest.FixtureRequest, tmp_path) -> StoreTarget:
    """A fresh, empty store on ``kind`` (a new bucket per test on the network kinds)."""
    if kind == "local":
        return StoreTarget(kind, str(tmp_path / "store"))
    if kind == "memory":
        return StoreTarget(kind, f"memory://{uuid.uuid4().hex}")
    server = request.getfixturevalue(_SERVER_FIXTURE[kind])
    bucket = make_bucket(kind, server)
    scheme = {"s3-seaweedfs": "s3", "s3-moto": "s3", "gcs": "gs", "hf": "hf"}[kind]
    uri = f"hf://buckets/{bucket}/run-1" if kind == "hf" else f"{scheme}://{bucket}/runs/run-1"
    return StoreTarget(kind, uri, server.storage_options(), server, bucket)


@pytest.fixture(params=ALL_KINDS)
def store_target(request, tmp_path) -> StoreTarget:
    """A fresh store on every backend kind in turn."""
    return target_for(request.param, request, tmp_path)


@pytest.fixture(params=NETWORK_KINDS)
def network_target(request, tmp_path) -> StoreTarget:
    """A fresh store on every network backend kind in turn."""
    return target_for(request.param, request, tmp_path)
