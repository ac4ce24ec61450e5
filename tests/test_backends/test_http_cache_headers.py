"""The publisher sets Cache-Control (and Content-Type) on S3 and GCS writes: objects and manifests cacheable
forever, refs/ briefly, kept when S3 refreshes an object (a copy onto itself)."""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from deltastore.backends.cache_policy import IMMUTABLE, MUTABLE, cache_control
from deltastore.index import INDEX_KEY
from deltastore.store import version_key

from .conftest import target_for


@pytest.mark.parametrize("kind", ["s3-seaweedfs", "gcs"])
def test_publisher_sets_cache_control(kind, request, tmp_path):
    target = target_for(kind, request, tmp_path)
    w = {"w": torch.randn(32, 32).to(torch.bfloat16)}
    with ds.Publisher(target.uri, storage_options=target.options) as pub:
        pub.publish(w, step=1)
        w["w"][0] += 1
        pub.publish(w, step=2)
        backend = pub.store.backend
        obj = next(iter(backend.list("objects/")))
        if kind.startswith("s3"):
            backend.touch(obj)  # S3's refresh: a copy onto itself, which replaces the object's metadata
        keys = {version_key(2): IMMUTABLE, obj: IMMUTABLE, "refs/latest": MUTABLE, INDEX_KEY: MUTABLE}
        for key, expected in keys.items():
            path = f"{backend.root}/{key}"
            if kind.startswith("s3"):
                bucket, _, name = path.partition("/")
                head = backend.fs.call_s3("head_object", Bucket=bucket, Key=name)
                got, kind_of = head.get("CacheControl"), head.get("ContentType")
            else:
                info = backend.fs.info(path)
                got, kind_of = info.get("cacheControl"), info.get("contentType")
            assert got == expected, (key, got)
            assert kind_of == ("application/json" if key.startswith("versions/") or key == INDEX_KEY
                               else "application/octet-stream"), (key, kind_of)


def test_policy_by_key():
    assert cache_control("objects/sha256/ab/cd") == cache_control("versions/000000000001.json") == IMMUTABLE
    assert cache_control("refs/latest") == cache_control(INDEX_KEY) == cache_control("deltastore.json") == MUTABLE
    assert cache_control("gc/clock") is None
