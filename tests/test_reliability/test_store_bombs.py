"""Memory bombs at the store layer: an object whose stored bytes exceed the manifest's size, and a manifest
over the 64 MiB limit, are refused typed without being read whole. The reading process's peak RSS growth
(measured in a fresh interpreter, tests/test_reliability/storebomb.py) stays below twice the largest
legitimate tensor, on local disk (1 GiB sparse files) and on SeaweedFS's S3 API (65 MiB values)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import deltastore as ds
from deltastore.manifest import MAX_MANIFEST_BYTES
from deltastore.store import object_key, version_key

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMEL = 1 << 20  # the largest legitimate tensor: 1 Mi bf16 elements, 2 MiB
LIMIT_MB = 2 * NUMEL * 2 / (1 << 20)


def _state(numel: int = NUMEL) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(numel, generator=g).bfloat16(), "small": torch.randn(64, generator=g).bfloat16()}


def _measure(where, uri: str, warm: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS])}
    out = subprocess.run([sys.executable, "-m", "test_reliability.storebomb", uri, json.dumps(where.options), warm],
                         cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_oversized_object_and_manifest_are_not_read_whole(where):
    warm, uri = where.fresh("warm"), where.fresh("bombed")
    for u, numel in ((warm, 64), (uri, NUMEL)):
        with ds.Publisher(where.store(u), anchor_every=1) as pub:
            pub.publish(_state(numel), step=0)
    store = where.store(uri)
    m = store.manifest(0)
    victim = max(m.objects, key=lambda o: o.size)
    if where.kind == "local":  # sparse 1 GiB files: a whole read would allocate the full size
        sizes = {object_key(victim.digest): 1 << 30, version_key(1): 1 << 30}
        for key, size in sizes.items():
            path = os.path.join(uri, *key.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)
    else:  # uploads: an object 8x the legitimate limit, a manifest just over its limit
        store.backend.put(object_key(victim.digest), bytes(int(LIMIT_MB * 8) << 20))
        store.backend.put(version_key(1), bytes(MAX_MANIFEST_BYTES + 1))
    got = _measure(where, uri, warm)
    errors = got["errors"]
    assert not [e for e in errors if e.startswith("UNTYPED")], errors
    assert any(e.startswith("ManifestError") and "over the 67108864 byte manifest limit (not read)" in e
               for e in errors), errors
    assert any(e.startswith("CorruptObjectError") and victim.digest in e and f"manifest says {victim.size}" in e
               for e in errors), errors
    print(f"store bombs ({where.kind}): peak growth {got['growth_mb']} MB, limit {LIMIT_MB} MB")
    assert got["growth_mb"] < LIMIT_MB, got
