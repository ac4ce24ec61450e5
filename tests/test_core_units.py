"""Unit tests of the building blocks: diff, checksum, manifest, local/memory backends, registry."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore.backends import open_backend
from deltastore.backends.local import LocalBackend
from deltastore.backends.memory import MemoryBackend
from deltastore.checksum import full_checksum, updated_checksum
from deltastore.publish.diff import find_changes
from deltastore.errors import (DeltaStoreError, InvalidKeyError, KeyExistsError, KeyNotFoundError,
                               ManifestError, MissingDependencyError, PluginConflictError, UnknownPluginError)
from deltastore.manifest import Manifest, ObjectRecord, Part, TensorRecord, VersionRef
from deltastore.registry import Registry
from deltastore.tensors import bits_view

WIDTH = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_diff_finds_exactly_the_bit_changes(dtype, chunk):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(1000, generator=g).to(dtype)
    old[:6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-40, -1.0]).to(dtype)
    new = old.clone()
    nb = new.view(WIDTH[dtype])
    nb[0] ^= torch.tensor(1, dtype=nb.dtype) << (nb.element_size() * 8 - 1)  # +0 -> -0
    nb[2] ^= 1  # another NaN payload
    nb[[10, 500, 999]] += 1
    ch = find_changes(bits_view(old), new, chunk_elems=chunk)
    assert ch.positions.tolist() == [0, 2, 10, 500, 999]
    assert torch.equal(ch.new_bits, nb[ch.positions]) and torch.equal(ch.old_bits, bits_view(old)[ch.positions])
    assert find_changes(bits_view(old), old.clone(), chunk_elems=chunk).count == 0


def test_diff_with_cast_matches_diff_of_cast():
    master = torch.randn(4096)
    old = bits_view(master.bfloat16())
    master += 1e-3 * torch.randn(4096)
    a = find_changes(old, master, dtype=torch.bfloat16, chunk_elems=100)
    b = find_changes(old, master.bfloat16())
    assert torch.equal(a.positions, b.positions) and torch.equal(a.new_bits, b.new_bits)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**32), st.floats(0, 1))
def test_incremental_checksum_equals_full(n, seed, frac):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g).bfloat16()
    before = full_checksum("w", t)
    new = t.clone()
    mask = torch.rand(n, generator=g) < frac
    new.view(torch.int16)[mask] ^= 0x5A
    ch = find_changes(bits_view(t), new)
    assert updated_checksum("w", before, ch.positions, ch.old_bits, ch.new_bits) == full_checksum("w", new)
    if ch.count:
        assert full_checksum("w", new) != before
    assert full_checksum("w", t) != full_checksum("v", t)  # keyed by name


def _manifest(**kw):
    base = dict(step=3, kind="delta", parent=VersionRef(2, "sha256:" + "a" * 64),
                tensors=(TensorRecord("w", "bfloat16", (4, 2), 1, "0" * 16, (Part(0, 0, 8),)),),
                objects=(ObjectRecord("sha256:" + "b" * 64, 10, {"id": "raw", "version": "1.0", "config": {}}),),
                created=1.5, producer={"writer": "x"}, metadata={"lr": 1e-6})
    base.update(kw)
    return Manifest(**base)


def test_manifest_roundtrip_is_canonical():
    m = _manifest()
    data = m.to_json()
    again = Manifest.from_json(data)
    assert again == m and again.to_json() == data
    assert m.changed == 1 and m.total == 8 and m.has_delta and m.delta_objects == {0}


def _anchor_record(name, changed, delta=True):
    return TensorRecord(name, "bfloat16", (4, 2), changed, "0" * 16, (Part(0, 0, 8),) if delta else (),
                        (Part(0, 0, 8),))


@pytest.mark.parametrize("records, new, parent, reachable", [
    ([_anchor_record("w", 1), _anchor_record("v", 0, delta=False)], (), True, True),  # the unchanged need none
    ([_anchor_record("w", 1), _anchor_record("v", 3, delta=False)], (), True, False),  # 'v' only stored whole
    ([_anchor_record("w", 1), _anchor_record("v", 3, delta=False)], ("v",), True, True),  # ... as a new tensor
    ([_anchor_record("w", 0, delta=False)] * 1, (), True, True),
    ([_anchor_record("w", 1)], (), False, False),  # no parent to start from
])
def test_a_version_is_reachable_by_deltas_when_every_changed_tensor_has_one(records, new, parent, reachable):
    m = _manifest(kind="anchor", tensors=tuple(records), new_tensors=new,
                  parent=VersionRef(2, "sha256:" + "a" * 64) if parent else None)
    assert m.has_delta is reachable


@pytest.mark.parametrize("kw", [
    dict(objects=()),  # tensor references a missing object
    dict(kind="anchor"),  # anchor tensors need a full object
    dict(parent=None),  # a delta needs a parent
    dict(parent=VersionRef(3, "sha256:" + "a" * 64)),  # parent must be below
    dict(tensors=(TensorRecord("w", "bfloat16", (4, 2), 1, "0" * 16, (Part(0, 0, 8),)),) * 2),  # duplicate names
])
def test_manifest_rejects_inconsistent_content(kw):
    with pytest.raises(ManifestError):
        Manifest.from_json(_manifest(**kw).to_json())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_manifest_parser_fuzz_raises_only_typed_errors(data):
    try:
        Manifest.from_json(data)
    except DeltaStoreError:  # only deltastore's own errors: a raw JSONDecodeError/UnicodeDecodeError fails
        pass


@pytest.mark.parametrize("data", [b"{not json", b"\xff\xfe\x00garbage", b'{"a": 1', b"", b"[" * 100000])
def test_manifest_parser_wraps_decode_errors(data):
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


@pytest.fixture(params=["local", "memory"])
def backend(request, tmp_path):
    if request.param == "local":
        return LocalBackend(tmp_path / "b")
    return MemoryBackend(str(tmp_path))


def test_backend_contract(backend):
    assert not backend.exists("a/b")
    with pytest.raises(KeyNotFoundError):
        backend.get("a/b")
    backend.put("a/b", b"one")
    backend.put("a/c", b"")
    assert backend.get("a/b") == b"one" and backend.get("a/c") == b""
    assert backend.get_range("a/b", 1, 3) == b"ne"
    with pytest.raises(KeyExistsError):
        backend.put("a/b", b"two", mode="create")
    assert backend.get("a/b") == b"one"
    backend.put("a/b", b"two")
    assert backend.get("a/b") == b"two"
    assert sorted(backend.list("a/")) == ["a/b", "a/c"] and list(backend.list("zzz")) == []
    backend.delete("a/b")
    backend.delete("a/b")
    assert not backend.exists("a/b")
    for bad in ["", "/abs", "a/../b", "a//b", "..", "a\\b", "a/./b"]:
        with pytest.raises(InvalidKeyError):
            backend.put(bad, b"x")


def test_create_only_race_has_exactly_one_winner(backend):
    wins, losses = [], []
    barrier = threading.Barrier(8)

    def writer(i):
        barrier.wait()
        try:
            backend.put("race", str(i).encode(), mode="create")
            wins.append(i)
        except KeyExistsError:
            losses.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 7 and backend.get("race") == str(wins[0]).encode()


def test_local_backend_never_exposes_temp_files(tmp_path):
    b = LocalBackend(tmp_path)
    b.put("x/y", b"1" * 1000)
    assert os.listdir(tmp_path / "x") == ["y"] and list(b.list("")) == ["x/y"]
    assert isinstance(open_backend(str(tmp_path)), LocalBackend)
    assert isinstance(open_backend(f"file://{tmp_path}"), LocalBackend)
    assert open_backend(f"file://{tmp_path}").get("x/y") == b"1" * 1000


def test_registry_rules():
    class A: ...

    class B: ...

    reg = Registry("widget", "deltastore.test_widgets")
    reg.register("a", A)
    reg.register("a", A)  # same class again: fine
    with pytest.raises(PluginConflictError):
        reg.register("a", B)
    reg.register("a", B, clobber=True)
    assert reg.get("a") is B
    reg.register("lazy", "no_such_module_xyz:Thing", install_hint="pip install no-such-thing")
    with pytest.raises(MissingDependencyError) as e:
        reg.get("lazy")
    assert "pip install no-such-thing" in str(e.value) and isinstance(e.value, ImportError)
    with pytest.raises(UnknownPluginError):
        reg.get("nope")


def test_diff_on_unaligned_storage_falls_back_to_elementwise():
    big = torch.randn(1001).bfloat16()
    new = big[1:]  # storage offset 1: cannot be viewed as 8-byte words
    old = bits_view(new.clone())
    new.view(torch.int16)[[0, 3, 998, 999]] += 1
    assert find_changes(old, new).positions.tolist() == [0, 3, 998, 999]


def test_tensor_larger_than_an_object_is_stored_in_slices(memory_uri):
    import deltastore as ds

    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 100, generator=g).bfloat16()
    small = torch.randn(10, generator=g).bfloat16()
    pub = ds.Publisher(memory_uri, max_object_bytes=16_000, anchor_every=2, codec="raw")
    pub.publish({"big": big, "small": small}, step=0)
    m = ds.Subscriber(memory_uri).manifest(0)
    parts = m.tensor_map()["big"].full
    assert len(parts) == 4 and [p.offset for p in parts] == [0, 8000, 16000, 24000]
    assert len(m.full_objects) >= 4
    assert json.loads(m.to_json())["tensors"]["full"][0][1] == {"object": parts[1].object, "offset": 8000,
                                                                 "numel": 8000}
    nxt = big.clone()
    nxt.view(torch.int16).reshape(-1)[::2] += 1  # half the elements: stored whole, in slices, in the delta
    pub.publish({"big": nxt, "small": small}, step=1)
    m1 = ds.Subscriber(memory_uri).manifest(1)
    assert len(m1.tensor_map()["big"].delta) == 4
    sub = ds.Subscriber(memory_uri)
    target = sub.pull(step=0).state
    sub.pull(target, step=0)
    assert sub.pull(target, step=1).path == "delta"
    assert torch.equal(target["big"].view(torch.int16), nxt.view(torch.int16))
    assert torch.equal(sub.pull(step=1).state["big"].view(torch.int16), nxt.view(torch.int16))


@pytest.mark.parametrize("parts", [
    [{"object": 0, "offset": 0, "numel": 4}, {"object": 0, "offset": 2, "numel": 6}],   # overlap
    [{"object": 0, "offset": 0, "numel": 4}],                                          # gap (full must cover)
    [{"object": 0, "offset": 4, "numel": 8}],                                          # past the end
    [{"object": 0, "offset": 0, "numel": 0}],                                          # empty part
    [],                                                                                # empty list
    [{"object": 5, "offset": 0, "numel": 8}],                                          # dangling object
])
def test_manifest_rejects_bad_parts(parts):
    doc = json.loads(_manifest(kind="anchor", tensors=(
        TensorRecord("w", "bfloat16", (4, 2), 8, "0" * 16, (Part(0, 0, 8),), (Part(0, 0, 8),)),)).to_json())
    doc["tensors"][0]["full"] = parts
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(doc).encode())


def test_background_prefetch_hands_over_verified_bytes_and_typed_errors(tmp_path):
    """``prefetch(wait=False)`` reads and verifies on background threads; ``get_object`` takes the result, and
    an object that fails its check there still raises the typed error; what is not consumed can be dropped."""
    import threading

    from deltastore.errors import CorruptObjectError, ObjectNotFoundError
    from deltastore.store import object_key, open_store

    store = open_store(str(tmp_path / "s"))
    good, bad = store.put_object(b"good bytes" * 100), store.put_object(b"bad bytes" * 100)
    store.backend.put(object_key(bad), b"BAD bytes" * 100)  # same size, other content
    readers: list[str] = []
    real = store.backend.get_bounded

    def spy(key, limit):
        readers.append(threading.current_thread().name)
        return real(key, limit)

    store.backend.get_bounded = spy
    store.prefetch([(good, 1000), (bad, 900)], wait=False)
    assert store.get_object(good, 1000) == b"good bytes" * 100
    with pytest.raises(CorruptObjectError, match="sha256") as err:
        store.get_object(bad, 900)
    assert err.value.digest == bad
    assert readers[:2] and all(n.startswith("deltastore-fetch") for n in readers[:2])  # read in the background
    assert readers[2:] and not readers[2].startswith("deltastore-fetch")  # the bad one read again, here
    readers.clear()
    store.prefetch([(good, 1000)], wait=False)
    store.forget_prefetched()
    assert store.get_object(good, 1000) == b"good bytes" * 100 and readers[-1] == threading.current_thread().name
    missing = "sha256:" + "0" * 64
    store.prefetch([(missing, 5)], wait=False)  # a missing object: the read where it is used raises
    with pytest.raises(ObjectNotFoundError):
        store.get_object(missing, 5)
    store.close()


def test_a_second_prefetch_keeps_what_both_ask_for_and_drops_the_rest(tmp_path):
    """A pull may start a version's downloads before it has planned, then prefetch its plan: the objects both
    name are read once, the others dropped (read again where they are used)."""
    from deltastore.store import object_key, open_store

    store = open_store(str(tmp_path / "s"))
    a, b, c = (store.put_object(x * 100) for x in (b"aaaa", b"bbbb", b"cccc"))
    reads: list[str] = []
    real = store.backend.get_bounded
    store.backend.get_bounded = lambda key, limit: (reads.append(key), real(key, limit))[1]
    key = {d: object_key(d) for d in (a, b, c)}
    store.prefetch([(a, 400), (b, 400)], wait=False, max_workers=2)
    store.prefetch([(b, 400), (c, 400)], wait=False, max_workers=2)
    assert store.get_object(b, 400) == b"bbbb" * 100 and store.get_object(c, 400) == b"cccc" * 100
    assert reads.count(key[b]) == 1 and reads.count(key[c]) == 1  # b, asked for twice, read once
    before = reads.count(key[a])  # a may have been read in the background before it was dropped
    assert store.get_object(a, 400) == b"aaaa" * 100 and reads.count(key[a]) == before + 1  # read again here
    store.close()


def _prefetch_in_child(store, digest, conn):
    store.prefetch([(digest, 1000)], wait=False)  # the parent's fetch threads do not exist here
    conn.send(store.get_object(digest, 1000) == b"good bytes" * 100)


def test_background_prefetch_works_in_a_forked_child(tmp_path):
    """A store whose fetch threads were started before a fork makes new ones in the child (a pool copied
    by fork has no threads: its futures would never finish)."""
    import multiprocessing as mp

    from deltastore.store import open_store

    store = open_store(str(tmp_path / "s"))
    digest = store.put_object(b"good bytes" * 100)
    store.prefetch([(digest, 1000)], wait=False)
    assert store.get_object(digest, 1000) == b"good bytes" * 100
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_prefetch_in_child, args=(store, digest, there))
    child.start()
    got = here.recv() if here.poll(60) else None
    child.join(10)
    if child.is_alive():
        child.kill()
    assert got is True and child.exitcode == 0
    store.close()
