"""refs/index.json (deltastore.index 1.0): written after each commit, bounded, pruned by GC, parsed strictly;
a failed write is a PostCommitWarning; the signing seams run where docs/format.md says."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

import deltastore as ds
import deltastore.signing  # noqa: F401 - ds.signing
from deltastore.backends.memory import MemoryBackend
from deltastore.errors import PostCommitWarning, StoreIndexError, UnsupportedFormatError
from deltastore.gc import Retention, collect_garbage
from deltastore.index import (ANCHORS, INDEX_KEY, WINDOW, IndexEntry, bounded, index_bytes, latest_step, merged,
                              parse_index)
from deltastore.manifest import sha256_digest
from deltastore.store import DeltaStore, version_key
from deltastore.testing.faults import Fault, FaultyBackend

DIGEST = "sha256:" + "ab" * 32


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g).to(torch.bfloat16)}


def _publish(store, steps, **kwargs):
    w = _model()
    with ds.Publisher(store, **kwargs) as pub:
        for s in steps:
            w["w"][s % 16, s % 8] += 1
            pub.publish(w, step=s)
    return w


def _entry(step, kind="delta", parent=-1):
    return IndexEntry(step, kind, DIGEST, 100, step - 1 if parent == -1 and step else None)


def test_written_after_each_commit():
    backend = MemoryBackend(uuid.uuid4().hex)
    store = DeltaStore(backend)
    _publish(store, range(5), anchor_every=2)
    index = store.read_index()
    assert index.steps == [0, 1, 2, 3, 4] == store.versions()
    for e in index.entries:
        data = backend.get(version_key(e.step))
        m = store.manifest(e.step)
        assert e.digest == sha256_digest(data) and e.size == len(data)
        assert e.kind == m.kind and e.parent == (m.parent.step if m.parent else None)
    assert json.loads(backend.get(INDEX_KEY))["format_version"] == "1.0"


def test_bounded_to_the_window_and_the_last_anchors():
    entries = [_entry(s, "anchor" if s % 10 == 0 else "delta") for s in range(200)]
    kept = bounded(entries)
    steps = [e.step for e in kept]
    assert steps[-WINDOW:] == list(range(200 - WINDOW, 200))
    assert [s for s in steps if s < 200 - WINDOW] == [s for s in range(0, 200 - WINDOW, 10)][-ANCHORS:]
    assert len(index_bytes(kept)) < 16 << 10
    again = merged(parse_index(index_bytes(kept)), [_entry(200)], drop=[199])
    assert 199 not in [e.step for e in again] and again[-1].step == 200


def test_a_long_run_keeps_the_index_small():
    store = DeltaStore(MemoryBackend(uuid.uuid4().hex))
    _publish(store, range(WINDOW + 10), anchor_every=20)
    index = store.read_index()
    assert index.steps[-WINDOW:] == list(range(10, WINDOW + 10)) and 0 in index.steps
    assert len(index.steps) == WINDOW + 1


def test_index_write_failure_is_a_post_commit_warning():
    inner = MemoryBackend(uuid.uuid4().hex)
    faulty = FaultyBackend(inner, rules=[Fault("permanent", ops="put", prefix=INDEX_KEY)])
    with pytest.warns(PostCommitWarning, match="refs/index.json"):
        w = _publish(DeltaStore(faulty), [1, 2])
    assert DeltaStore(inner).versions() == [1, 2] and not inner.exists(INDEX_KEY)
    pulled = ds.Subscriber(DeltaStore(inner)).pull().state
    assert torch.equal(pulled["w"].view(torch.int16), w["w"].view(torch.int16))


def test_gc_takes_deleted_versions_out():
    # a grace of 0 is allowed only where no refresh window is needed (one process, no concurrent writer)
    store = DeltaStore(MemoryBackend(uuid.uuid4().hex), refresh_window=0)
    _publish(store, range(12), anchor_every=4)
    collect_garbage(store, Retention(keep_last=2, keep_anchors=1), grace=0)
    assert set(store.read_index().steps) <= set(store.versions())
    assert store.read_index().steps == store.versions()
    store2 = DeltaStore(MemoryBackend(uuid.uuid4().hex), refresh_window=0)
    _publish(store2, range(12), anchor_every=4, retention=Retention(keep_last=2, keep_anchors=1), gc_grace=0)
    assert store2.read_index().steps == store2.versions()


def _doc(**change):
    doc = json.loads(index_bytes([_entry(1, "anchor", None), _entry(2)]))
    for k, v in change.items():
        if k.startswith("v_"):
            doc["versions"][1][k[2:]] = v
        else:
            doc[k] = v
    return json.dumps(doc).encode()


@pytest.mark.parametrize("data, match", [
    (b"{", "not valid JSON"),
    (b'{"format":"deltastore.index","format":"x"}', "duplicate"),
    (_doc(format="other"), "not a deltastore.index"),
    (_doc(format_version="1"), "MAJOR.MINOR"),
    (_doc(updated="now"), "updated"),
    (_doc(versions={}), "versions"),
    (_doc(v_step=-1), "step"),
    (_doc(v_step=1, v_parent=None), "ascending"),
    (_doc(v_kind="full"), "kind"),
    (_doc(v_digest="sha256:xyz"), "digest"),
    (_doc(v_size=0), "size"),
    (_doc(v_parent=2), "parent"),
    (b" " * ((1 << 20) + 1), "bound"),
])
def test_malformed_index(data, match):
    with pytest.raises(StoreIndexError, match=match):
        parse_index(data)


def test_other_major_version_and_unknown_fields():
    with pytest.raises(UnsupportedFormatError):
        parse_index(_doc(format_version="2.0"))
    doc = json.loads(_doc(format_version="1.7", extra={"x": 1}))
    doc["versions"][0]["future"] = True
    assert parse_index(json.dumps(doc).encode()).steps == [1, 2]


def test_signed_index():
    """A signing publisher signs the index; a follower with trusted keys refuses a signed index that does not
    verify (or is signed by another key) and reads an unsigned one (it only lists versions)."""
    from deltastore.errors import SignatureError, UntrustedKeyError
    from deltastore.signing import SigningKey

    key, other = SigningKey.generate(), SigningKey.generate()
    backend = MemoryBackend(uuid.uuid4().hex)
    _publish(DeltaStore(backend), [1, 2], signing_key=key)
    data = backend.get(INDEX_KEY)
    assert json.loads(data)["signature"]["key_id"] == key.key_id
    reader = DeltaStore(backend)
    reader.trust = ds.signing.Trust([key.public])
    assert reader.read_index().steps == [1, 2] and reader.read_index().signature is not None
    backend.put(INDEX_KEY, data.replace(b'"step":2', b'"step":3'))
    with pytest.raises(SignatureError):
        reader.read_index()
    store = DeltaStore(backend)
    store.signer = other
    store.update_index(add=[_entry(5)])
    with pytest.raises(UntrustedKeyError):
        reader.read_index()
    backend.put(INDEX_KEY, index_bytes([_entry(1, "anchor", None)]))
    assert reader.read_index().steps == [1]


@pytest.mark.parametrize("data, step", [(b"12", 12), (b"12\n", 12), (b'{"step": 7, "digest": "x"}', 7),
                                        (b"x", None), (b'{"step": true}', None), (b"1" * 13, None)])
def test_latest_step(data, step):
    assert latest_step(data) == step
