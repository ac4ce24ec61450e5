"""Manifest format 1.3: the tensors' names, dtypes and shapes are one layout object, named by digest.

Publishers store it once per layout; readers fetch it once and know it again by its digest; GC keeps it
while a version names it; verify checks it; every bad layout object or reference is a typed error that
leaves the target as it was."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import deltastore as ds
import deltastore.manifest as M
from conftest import chain_states, quick_gc_store
from deltastore.testing import bits_equal
from deltastore.errors import (CorruptObjectError, DeltaStoreError, ManifestError, ObjectNotFoundError,
                               UnsupportedFormatError)
from deltastore.gc import Retention
from deltastore.manifest import sha256_digest
from deltastore.store import object_key, version_key
from deltastore.pull.verify import verify_store


def _states(n: int, tensors: int = 40, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return chain_states(n, {f"layers.{i}.weight": (8, 16) for i in range(tensors)}, changes=3, seed=seed)


# versions 0..4 of _states(5) (anchor at 0) and a follower at version 3, each test with no layout object parsed yet
PUBLISHED = {"shapes": {f"layers.{i}.weight": (8, 16) for i in range(40)}, "changes": 3, "follower": 3}


def _path(uri: str, key: str) -> str:
    return os.path.join(uri, *key.split("/"))


def _doc(uri: str, step: int) -> dict:
    with open(_path(uri, version_key(step))) as f:
        return json.load(f)


def _write_doc(uri: str, step: int, doc: dict) -> None:
    with open(_path(uri, version_key(step)), "w") as f:
        json.dump(doc, f)


def _store_object(uri: str, data: bytes, digest: str | None = None) -> str:
    """Write ``data`` as an object (under ``digest``, its own sha256 unless given: a hostile store)."""
    digest = digest or sha256_digest(data)
    path = _path(uri, object_key(digest))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return digest


@pytest.fixture(autouse=True)
def fresh_reader(monkeypatch):
    """No layout object parsed in this process yet (as in a new reader process)."""
    monkeypatch.setattr(M, "_LAYOUT_OBJECTS", {})


def test_a_manifest_names_one_layout_object_and_lists_no_tensor_name(published):
    uri, states, sub, _ = published
    refs = set()
    for step in range(5):
        doc = _doc(uri, step)
        assert doc["format_version"] == M.LAYOUT_OBJECT_FORMAT_VERSION and set(doc["tensors"]) == set(M.VALUE_FIELDS)
        raw = open(_path(uri, version_key(step)), "rb").read()
        assert b"layers.0.weight" not in raw
        refs.add((doc["layout"]["digest"], doc["layout"]["size"]))
    (digest, size), = refs  # one layout, one object
    data = open(_path(uri, object_key(digest)), "rb").read()
    assert len(data) == size and sha256_digest(data) == digest
    layout = json.loads(data)
    assert layout["format"] == M.LAYOUT_FORMAT and layout["name"] == list(states[0])
    assert layout["shape"] == [[8, 16]] * 40 and set(layout["dtype"]) == {"bfloat16"}
    m = sub.manifest(4)
    assert m.layout_ref == M.LayoutRef(digest, size) and m.layout_bytes == data  # canonical: one digest per layout
    assert m.references()[digest] == size


def test_a_follower_reads_the_layout_object_once_and_a_publisher_writes_it_once(store_uri, fresh_reader,
                                                                                 monkeypatch):
    states = _states(6)
    puts, reads = [], []
    put_object, read_object = ds.DeltaStore.put_object, ds.DeltaStore._read_object
    monkeypatch.setattr(ds.DeltaStore, "put_object", lambda self, data: puts.append(data) or put_object(self, data))
    monkeypatch.setattr(ds.DeltaStore, "_read_object",
                        lambda self, d, size: reads.append(d) or read_object(self, d, size))
    with ds.Publisher(store_uri, anchor_every=100) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    layouts = [p for p in puts if p.startswith(b'{"dtype"')]
    assert len(layouts) == 1  # stored by the first commit only
    digest = sha256_digest(layouts[0])
    monkeypatch.setattr(M, "_LAYOUT_OBJECTS", {})  # a new reader process
    sub = ds.Subscriber(store_uri)
    target = sub.pull(step=0).state
    for step in range(1, 6):
        sub.pull(target, step=step)
    assert bits_equal(target, states[5])
    assert reads.count(digest) == 1


def test_a_layout_change_writes_a_new_layout_object_and_gc_deletes_the_old_one(store_uri, fresh_reader):
    states = _states(4)
    grown = [dict(s, head=torch.full((4,), float(i), dtype=torch.bfloat16)) for i, s in enumerate(_states(4, seed=1))]
    with ds.Publisher(quick_gc_store(store_uri), anchor_every=2, retention=Retention(keep_last=2, keep_anchors=1),
                      gc_grace=0) as pub:
        for i, s in enumerate(states + grown):
            pub.publish(s, step=i)
    store = ds.open_store(store_uri)
    kept = store.versions()
    refs = {store.manifest(s).layout_ref.digest for s in kept}
    assert len(refs) == 1 and set(store.list_objects()) == {d for s in kept for d in store.manifest(s).references()}
    assert bits_equal(ds.Subscriber(store_uri).pull(step=kept[-1]).state, grown[-1])
    assert verify_store(store).ok


def test_a_commit_whose_layout_reference_is_not_its_tensors_layout_is_refused(store_uri, fresh_reader):
    states = _states(2)
    with ds.Publisher(store_uri) as pub:
        pub.publish(states[0], step=0)
    store = ds.open_store(store_uri)
    m = store.manifest(0)
    other = dataclasses.replace(m, step=1, parent=store.ref(0), kind="delta",
                                tensors=tuple(t._replace(changed=0, full=(), delta=()) for t in m.tensors),
                                objects=())
    other.__dict__["layout_ref"] = M.LayoutRef("sha256:" + "0" * 64, 10)
    with pytest.raises(ManifestError, match="not the layout of its tensors"):
        store.commit(other)
    assert store.versions() == [0]


def test_a_layout_object_is_needed_to_parse_a_manifest_outside_a_store(published, monkeypatch):
    uri, _, _, _ = published
    data = open(_path(uri, version_key(4)), "rb").read()
    monkeypatch.setattr(M, "_LAYOUT_OBJECTS", {})
    with pytest.raises(ManifestError, match="parse_manifest"):
        M.Manifest.from_json(data)
    assert ds.open_store(uri).parse_manifest(data).step == 4


def _expect(sub, target, want, exc, match, **kw):
    version = sub.version_of(target)
    with pytest.raises(exc, match=match) as e:
        sub.pull(target, **kw)
    assert isinstance(e.value, DeltaStoreError)
    assert bits_equal(target, want), "target changed after a failed pull"
    assert sub.version_of(target) == version


def _layout_doc(uri: str) -> dict:
    ref = _doc(uri, 4)["layout"]
    return json.loads(open(_path(uri, object_key(ref["digest"])), "rb").read())


def _named(uri: str, data: bytes, digest: str | None = None, size: int | None = None) -> None:
    """Make version 4 name ``data`` as its layout object (stored under ``digest``, default its own)."""
    digest = _store_object(uri, data, digest)
    doc = _doc(uri, 4)
    doc["layout"] = {"digest": digest, "size": len(data) if size is None else size}
    _write_doc(uri, 4, doc)


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _with(**changes):
    return lambda layout: _canonical({**layout, **changes})


def _edited(column: str, index: int, value):
    def make(layout):
        layout[column][index] = value
        return _canonical(layout)
    return make


@pytest.mark.parametrize("make, exc, match", [
    (lambda layout: b"{not json", ManifestError, "layout object .* not valid JSON"),
    (lambda layout: b"[]", ManifestError, "not a deltastore layout"),
    (_with(format="deltastore.manifest"), ManifestError, "not a deltastore layout"),
    (_with(format_version="2.0"), UnsupportedFormatError, "format 2.0"),
    (_with(extra=[1]), ManifestError, "columns"),
    (lambda layout: _canonical({k: v for k, v in layout.items() if k != "shape"}), ManifestError, "columns"),
    (_with(name="layers.0.weight"), ManifestError, "'name' is not a list"),
    (lambda layout: _canonical({**layout, "dtype": layout["dtype"][:-1]}), ManifestError, "'dtype' has 39"),
    (lambda layout: _canonical({k: v[:-1] if isinstance(v, list) else v for k, v in layout.items()}),
     ManifestError, "lists 39 tensors, the manifest's columns 40"),
    (_edited("name", 0, "../../etc/passwd"), ManifestError, "tensor name"),
    (_edited("name", 1, "layers.0.weight"), ManifestError, "layers.0.weight"),
    (_edited("dtype", 0, "complex64"), ManifestError, "dtype"),
    (_edited("shape", 0, [-8, 16]), ManifestError, "shape"),
    (_edited("shape", 0, [2**40, 2**40]), ManifestError, "elements"),
])
def test_a_malformed_layout_object_is_refused_naming_it(published, make, exc, match):
    uri, states, sub, target = published
    _named(uri, make(_layout_doc(uri)))
    _expect(sub, target, states[3], exc, match, step=4)
    assert bits_equal(sub.pull(step=3).state, states[3])  # the versions before still serve


def test_a_layout_reference_to_a_missing_corrupt_or_oversized_object_is_refused(published):
    uri, states, sub, target = published
    good = _canonical(_layout_doc(uri))
    other = good.replace(b'"layers.0.weight"', b'"layers.0.weighu"')
    doc = _doc(uri, 4)
    doc["layout"] = {"digest": sha256_digest(other), "size": len(other)}  # never stored
    _write_doc(uri, 4, doc)
    _expect(sub, target, states[3], ObjectNotFoundError, "missing", step=4)
    _named(uri, other, digest=sha256_digest(good.replace(b"layers.1.", b"layers.9.")))  # bytes not its digest
    _expect(sub, target, states[3], CorruptObjectError, "sha256", step=4)
    _named(uri, other, size=len(other) - 1)  # the manifest's size is not the object's
    _expect(sub, target, states[3], CorruptObjectError, "manifest says", step=4)
    _named(uri, other, size=M.MAX_MANIFEST_BYTES + 1)
    _expect(sub, target, states[3], ManifestError, "'size'", step=4)
    doc = _doc(uri, 4)
    doc["layout"] = {"digest": "sha256:../../x", "size": 10}
    _write_doc(uri, 4, doc)
    _expect(sub, target, states[3], ManifestError, "digest", step=4)
    del doc["layout"]
    _write_doc(uri, 4, doc)
    _expect(sub, target, states[3], ManifestError, "'layout'", step=4)


def test_a_joiner_without_the_layout_object_gets_a_typed_error_and_verify_reports_it(published, monkeypatch):
    uri, states, sub, _ = published
    digest = _doc(uri, 4)["layout"]["digest"]
    path = _path(uri, object_key(digest))
    data = open(path, "rb").read()
    os.chmod(path, 0o644)
    os.remove(path)
    report = verify_store(ds.open_store(uri))  # this process knows the layout: verify still looks for it
    assert not report.ok and any(digest in p for _, p in report.problems)
    monkeypatch.setattr(M, "_LAYOUT_OBJECTS", {})  # a new reader process
    with pytest.raises(ObjectNotFoundError, match=digest):
        ds.Subscriber(uri).pull(step=4)
    with open(path, "wb") as f:
        f.write(data.replace(b'"layers.5.', b'"layers.6.'))  # same length, other bytes
    with pytest.raises(CorruptObjectError, match="sha256"):
        ds.Subscriber(uri).pull(step=4)
    with open(path, "wb") as f:
        f.write(data)
    assert bits_equal(ds.Subscriber(uri).pull(step=4).state, states[4])
