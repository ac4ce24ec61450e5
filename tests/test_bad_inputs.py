"""Every bad input gets a typed error, leaves the target at its last good version, loses no stored data."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import deltastore as ds
from conftest import chain_states, edit_tensor_columns, follower_at, publish_all
from deltastore.testing import bits_equal
from deltastore.errors import (ApplyError, ChecksumMismatchError, CorruptObjectError, DeltaStoreError,
                               InvalidStepError, ManifestError, ObjectNotFoundError, ParentMismatchError, TargetMismatchError,
                               UnknownBackendError, UnknownCodecError, UnsupportedFormatError,
                               VersionNotFoundError)
from deltastore.manifest import sha256_digest
from deltastore.store import object_key, version_key


def _states(n, shape=(64, 48), frac=0.02, seed=0):
    return chain_states(n, {"a": shape, "b": (shape[1],)}, changes=frac, seed=seed)


PUBLISHED = {"follower": 3}  # versions 0..4 (anchor at 0) of _states(5) and a follower at version 3


def _path(uri, key):
    return os.path.join(uri, *key.split("/"))


def _delta_object_path(uri, sub, step):
    m = sub.manifest(step)
    return _path(uri, object_key(m.objects[min(m.delta_objects)].digest))


def _snapshot(uri):
    out = {}
    for root, _, files in os.walk(uri):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, uri)] = fh.read()
    return out


def _assert_nothing_lost(uri, before):
    after = _snapshot(uri)
    for key in before:
        assert key in after, f"{key} was deleted"


def _expect(sub, target, want, exc, **kw):
    version = sub.version_of(target)
    with pytest.raises(exc) as e:
        sub.pull(target, **kw)
    assert isinstance(e.value, DeltaStoreError)
    assert bits_equal(target, want), "target changed after a failed pull"
    assert sub.version_of(target) == version
    return e.value


def test_flipped_byte_in_object(published):
    uri, states, sub, target = published
    path = _delta_object_path(uri, sub, 4)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    before = _snapshot(uri)
    err = _expect(sub, target, states[3], CorruptObjectError, step=4)
    assert "sha256" in str(err) and isinstance(err, ValueError)
    _assert_nothing_lost(uri, before)
    assert bits_equal(sub.pull(step=3).state, states[3])  # the rest of the store still serves


def test_corrupt_delta_is_routed_around_through_an_anchor(tmp_path):
    uri = str(tmp_path / "s")
    states = _states(5)
    with ds.Publisher(uri, anchor_every=2) as pub:  # anchors at 0, 2, 4 (each with its delta too)
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    sub = ds.Subscriber(uri)
    target = sub.pull(step=0).state
    sub.pull(target, step=3)
    path = _delta_object_path(uri, sub, 4)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x40
    open(path, "wb").write(bytes(data))
    res = sub.pull(target, step=4)  # the delta is corrupt: the anchor's full objects are not
    assert res.path == "anchor" and res.versions_applied == [4] and sub.replans == 1
    assert bits_equal(target, states[4])
    # a server that refuses anchors gets the typed corruption error, target unchanged
    other = sub.pull(step=3).state
    sub.pull(other, step=3)
    _expect(sub, other, states[3], CorruptObjectError, step=4, allow_anchor=False)


def test_truncated_object(published):
    uri, states, sub, target = published
    path = _delta_object_path(uri, sub, 4)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 3])
    err = _expect(sub, target, states[3], CorruptObjectError, step=4)
    assert "truncated" in str(err)


def test_manifest_naming_a_missing_object(published):
    uri, states, sub, target = published
    os.unlink(_delta_object_path(uri, sub, 4))
    err = _expect(sub, target, states[3], ObjectNotFoundError, step=4)
    assert isinstance(err, FileNotFoundError)


def _rewrite_manifest(uri, step, edit):
    """Replace a committed manifest (a hostile or buggy writer); returns the new bytes."""
    path = _path(uri, version_key(step))
    doc = json.loads(open(path, "rb").read())
    edit(doc)
    data = json.dumps(doc).encode()
    open(path, "wb").write(data)
    return data


def test_unknown_codec_id(published):
    uri, states, sub, target = published

    def edit(doc):
        for o in doc["objects"]:
            o["codec"]["id"] = "no-such-codec"

    _rewrite_manifest(uri, 4, edit)
    sub = ds.Subscriber(uri)  # no cached manifest
    err = _expect(sub, target, states[3], UnknownCodecError, step=4)
    assert "no-such-codec" in str(err) and isinstance(err, LookupError)


def test_unknown_codec_major_version(published):
    uri, states, sub, target = published

    def edit(doc):
        for o in doc["objects"]:
            o["codec"]["version"] = "9.0"

    _rewrite_manifest(uri, 4, edit)
    _expect(ds.Subscriber(uri), target, states[3], UnsupportedFormatError, step=4)


def test_delta_whose_parent_is_not_the_target_version(published, tmp_path):
    uri, states, sub, target = published
    # Another run (another store) whose step 4 has a different parent chain.
    other = str(tmp_path / "other")
    with ds.Publisher(other) as pub:
        for i, s in enumerate(_states(5, seed=1)):
            pub.publish(s, step=i)
    other_sub = ds.Subscriber(other)
    err = _expect(other_sub, target, states[3], ParentMismatchError, step=4, allow_anchor=False)
    assert "version 3" in str(err)
    # allowed to start from an anchor, the same pull is correct
    other_sub.pull(target, step=4)
    assert bits_equal(target, _states(5, seed=1)[4])


def test_target_changed_behind_our_back_is_detected(published):
    uri, states, sub, target = published
    # Corrupt one element the next delta touches: the O(changed) checksum must catch it.
    name = "a"
    touched = (states[4][name].view(torch.int16) != states[3][name].view(torch.int16)).reshape(-1).nonzero()
    flat = target[name].view(torch.int16).reshape(-1)
    flat[touched[0]] ^= 0x10
    tampered = {k: v.clone() for k, v in target.items()}
    _expect(sub, target, tampered, ChecksumMismatchError, step=4)


@pytest.mark.parametrize("mutate", ["shape", "dtype", "missing", "noncontiguous", "strided"])
def test_target_with_wrong_layout(published, mutate):
    uri, states, sub, _ = published
    target = {k: v.clone() for k, v in states[3].items()}
    if mutate == "shape":
        target["a"] = target["a"][:-1].clone()
    elif mutate == "dtype":
        target["a"] = target["a"].half()
    elif mutate == "missing":
        del target["b"]
    elif mutate == "strided":  # its own shape and values, laid out column-major
        target["a"] = target["a"].t().contiguous().t()
        assert target["a"].shape == states[3]["a"].shape and not target["a"].is_contiguous()
    else:
        target["a"] = target["a"].t()
    before = {k: v.clone() for k, v in target.items()}
    err = _expect(sub, target, before, TargetMismatchError, step=4)
    assert isinstance(err, ValueError) and ("'a'" in str(err) or "'b'" in str(err))


_WRITES = (torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_put_)


class _SecondTensorFails(torch.Tensor):
    """In-place writes into the first tensor written land; writes into any other tensor fail (a device error
    in the middle of an apply), every time (``once=False``: the restore is refused too) or only the first time.

    Whatever order the library writes tensors in, one tensor has been written when another fails, so the
    restore has something to undo (``landed`` and ``failed`` prove it).
    """

    first: int | None = None
    once = False
    landed = 0
    failed = 0

    @classmethod
    def reset(cls, once: bool) -> None:
        cls.first, cls.once, cls.landed, cls.failed = None, once, 0, 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _WRITES:
            with torch._C.DisableTorchFunctionSubclass():
                ptr = args[0].untyped_storage().data_ptr()
            cls.first = ptr if cls.first is None else cls.first
            if ptr != cls.first and not (cls.once and cls.failed):
                cls.failed += 1
                raise RuntimeError("injected write failure")
            if ptr == cls.first:
                cls.landed += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _subclassed(target):
    return {k: v.as_subclass(_SecondTensorFails) for k, v in target.items()}


def _plain(target):
    return {k: v.as_subclass(torch.Tensor) for k, v in target.items()}


def test_interrupted_write_restores_the_target(published):
    uri, states, sub, _ = published
    target = sub.pull(step=0).state
    sub.pull(target, step=3)
    target.update(_subclassed(target))  # same storages, writes go through torch (and fail on the second tensor)
    _SecondTensorFails.reset(once=False)
    with pytest.raises(ApplyError) as e:
        sub.pull(target, step=4)
    assert isinstance(e.value, RuntimeError) and "injected" in str(e.value)
    assert _SecondTensorFails.landed >= 1 and _SecondTensorFails.failed >= 1  # one tensor written, then a failure
    assert bits_equal(_plain(target), states[3])  # the written tensor was restored
    # the failing tensor refused its restore as it refused the write, so its state is not provable
    assert e.value.restored is False and sub.version_of(target) is None
    # the anchor path restores too
    fresh = _subclassed({k: torch.zeros_like(v) for k, v in states[3].items()})
    _SecondTensorFails.reset(once=False)
    with pytest.raises(ApplyError):
        sub.pull(fresh, step=4)
    assert _SecondTensorFails.landed >= 1 and _SecondTensorFails.failed >= 1
    assert not any(bool(v.view(torch.int16).any()) for v in _plain(fresh).values())


def test_interrupted_write_with_successful_restore_keeps_the_version(published):
    uri, states, sub, _ = published
    target = sub.pull(step=0).state
    sub.pull(target, step=3)
    target.update(_subclassed(target))
    _SecondTensorFails.reset(once=True)
    with pytest.raises(ApplyError) as e:
        sub.pull(target, step=4)
    assert _SecondTensorFails.landed >= 1 and _SecondTensorFails.failed == 1
    assert e.value.restored is True and sub.version_of(target).step == 3
    assert bits_equal(_plain(target), states[3])
    res = sub.pull(target, step=4)  # and the retry goes through the delta
    assert res.path == "delta"
    assert bits_equal(_plain(target), states[4])


def test_interrupted_write_of_plain_cpu_tensors_is_undone(store_uri, monkeypatch):
    """Plain CPU tensors are written by the library's batched scatter, not through torch, when the codec
    does not write in place (``raw``): a failure right after a write landed must be undone, and so must the
    deltas written before it on the same pull (two behind: each delta is written before the next is read)."""
    import deltastore.pull.apply as writing

    states = _states(5)
    publish_all(store_uri, states, anchor_every=100, codec="raw")
    sub, target = follower_at(store_uri, 2)
    real = writing.segments.scatter
    calls = []

    def scatter_then_fail(*args, **kwargs):
        calls.append(len(calls))
        real(*args, **kwargs)
        if len(calls) == 2:  # the second delta's write
            raise RuntimeError("injected failure after the write landed")

    monkeypatch.setattr(writing.segments, "scatter", scatter_then_fail)
    with pytest.raises(ApplyError) as e:
        sub.pull(target, step=4)
    assert len(calls) >= 4  # both writes, then both undone
    assert e.value.restored is True and sub.version_of(target).step == 2
    assert bits_equal(target, states[2])
    monkeypatch.undo()
    assert sub.pull(target, step=4).path == "delta" and bits_equal(target, states[4])


@pytest.mark.parametrize("behind", [1, 2])
@pytest.mark.parametrize("failure", ["decoder", "checksum", "interrupt"])
def test_a_failure_after_the_in_place_write_is_undone(published, monkeypatch, failure, behind):
    """Each delta behind, the decoder writes each change into the target as it decodes it. Whatever fails
    after that write of the last delta (the decoder itself, the checksum check after it, an interrupt),
    the target is put back bit for bit, with every delta the pull wrote before it, and keeps its version."""
    from deltastore.pull import staging
    from deltastore.kernels import bitstream
    from deltastore.pull.reader import VersionReader

    uri, states, sub, target = published
    start = 4 - behind
    if start != 3:
        sub.pull(target, step=start, allow_anchor=True)
    real, real_advance = bitstream.StepsInPlace.run, VersionReader.advance
    real_sums = staging._expect_sums
    at, landed = [], []

    def write_then_fail(self):
        got = real(self)
        landed.append(bool(self.done.all()))  # every tensor written
        if at[-1] == 4 and failure == "decoder":
            raise RuntimeError("injected failure after the in-place write")
        if at[-1] == 4 and failure == "interrupt":
            raise KeyboardInterrupt
        return got

    monkeypatch.setattr(VersionReader, "advance", lambda self, state, m, role="delta":
                        (at.append(m.step), real_advance(self, state, m, role))[1])
    monkeypatch.setattr(bitstream.StepsInPlace, "run", write_then_fail)
    if failure == "checksum":
        monkeypatch.setattr(staging, "_expect_sums", lambda manifest, names, *a:
                            _raise_mismatch(names) if manifest.step == 4 else real_sums(manifest, names, *a))
    expected = {"decoder": CorruptObjectError, "checksum": ChecksumMismatchError, "interrupt": KeyboardInterrupt}
    with pytest.raises(expected[failure]):
        sub.pull(target, step=4, allow_anchor=False)
    assert at == list(range(start + 1, 5))
    assert len(landed) >= behind and all(landed)  # the writes had landed before the failure
    assert sub.version_of(target).step == start
    assert bits_equal(target, states[start])
    monkeypatch.undo()
    assert sub.pull(target, step=4, allow_anchor=False).path == "delta" and bits_equal(target, states[4])


def _forged_ulp_delta(uri, states, step, forge):
    """Replace version ``step``'s one delta object by a well-hashed ``ulp`` object of its changes from
    ``step - 1`` as ``forge(name, positions, bits)`` alters them (a hostile or buggy writer)."""
    from deltastore.codecs import TensorSpec, Update
    from deltastore.codecs.ulp import UlpCodec

    sub = ds.Subscriber(uri)
    m = sub.manifest(step)
    assert len(m.delta_objects) == 1
    ups = []
    for name in sorted(states[step]):
        old = states[step - 1][name].view(torch.int16).reshape(-1)
        new = states[step][name].view(torch.int16).reshape(-1)
        pos = torch.ne(old, new).nonzero().squeeze(1)
        pos, bits = forge(name, pos, new[pos].clone())
        spec = TensorSpec(name, torch.bfloat16, tuple(states[step][name].shape))
        old_at = old[pos.clamp(max=old.numel() - 1)]
        ups.append(Update(spec, bits, pos, old_at))
    data = UlpCodec().encode(ups)
    digest = sub.store.put_object(data)

    def edit(doc):
        for o in doc["objects"]:
            o.update(digest=digest, size=len(data), codec=UlpCodec().describe())

    _rewrite_manifest(uri, step, edit)
    sub.close()


@pytest.mark.parametrize("forgery", ["position past the tensor", "wrong value"])
def test_a_hostile_ulp_object_met_while_writing_in_place_leaves_the_target_at_its_version(store_uri, forgery):
    """One delta behind, a ``ulp`` delta is written into the target as its gap stream is read. A position
    past a tensor that comes after others were written (a typed CorruptObjectError), or a value the
    manifest's checksum refutes (ChecksumMismatchError, found after every write): either way the target is
    stepped back bit for bit and keeps its version."""
    g = torch.Generator().manual_seed(5)
    states = [{n: torch.randn(256, 96, generator=g).bfloat16() for n in ("a", "b", "c")}]
    for _ in range(2):
        states.append({k: (v.view(torch.int16) + (torch.rand(v.shape, generator=g) < 0.02)).view(torch.bfloat16)
                       for k, v in states[-1].items()})
    with ds.Publisher(store_uri, anchor_every=100, codec="ulp") as pub:
        for i, st in enumerate(states):
            pub.publish(st, step=i)
    last = sorted(states[2])[-1]  # tensors lie in name order in the object: this one is met last

    def forge(name, pos, bits):
        if name != last:
            return pos, bits
        if forgery == "position past the tensor":
            pos = pos.clone()
            pos[-1] = states[2][name].numel()
        else:
            bits[len(bits) // 2] += 1
        return pos, bits

    _forged_ulp_delta(store_uri, states, 2, forge)
    sub = ds.Subscriber(store_uri)
    target = sub.pull(step=0).state
    sub.pull(target, step=1)
    before = {k: v.clone() for k, v in target.items()}
    exc = CorruptObjectError if forgery == "position past the tensor" else ChecksumMismatchError
    with pytest.raises(exc, match="beyond the tensor" if exc is CorruptObjectError else None):
        sub.pull(target, step=2, allow_anchor=False)
    assert bits_equal(target, before) and sub.version_of(target).step == 1
    sub.close()


def _raise_mismatch(names):
    raise ChecksumMismatchError(f"injected: tensor {names[0]!r} is off")


def test_hostile_object_header(published):
    uri, states, sub, target = published
    # A well-hashed object whose safetensors header claims an absurd length.
    evil = struct.pack("<Q", 1 << 60) + b"{}"
    digest = sub.store.put_object(evil)

    def edit(doc):
        doc["objects"][0].update(digest=digest, size=len(evil))

    _rewrite_manifest(uri, 4, edit)
    _expect(ds.Subscriber(uri), target, states[3], CorruptObjectError, step=4)


@pytest.mark.parametrize("payload, exc", [
    (b"{not json", ManifestError),
    (b'{"format": "deltastore.manifest", "format_version": "1.0", "step": 4, "step": 5}', ManifestError),
    (b"[]", ManifestError),
    (b'{"format": "deltastore.manifest", "format_version": "7.0"}', UnsupportedFormatError),
    (b"\xff\xfe garbage", ManifestError),
    (b"[" * 100000 + b"]" * 100000, ManifestError),
])
def test_hostile_manifest_bytes(published, payload, exc):
    uri, states, sub, target = published
    open(_path(uri, version_key(4)), "wb").write(payload)
    _expect(ds.Subscriber(uri), target, states[3], exc, step=4)


@pytest.mark.parametrize("field, value, says", [
    ("step", 10**30, "'step'"), ("step", -1, "'step'"), ("kind", "weird", "kind"), ("created", 1e999, "Infinity"),
    ("tensors.name", "../../etc/passwd", "tensor name"), ("tensors.name", "a/b", "tensor name"),
    ("tensors.shape", [-1, 4], "shape"), ("tensors.shape", [2**40, 2**40], "elements"),
    ("tensors.dtype", "complex64", "dtype"), ("tensors.delta", 99, "object index"),
    ("tensors.checksum", "zz", "checksum"), ("objects.digest", "sha256:../../x", "digest"),
    ("parent.step", 9, "parent"), ("tensors.changed", 10**9, "'changed'"),
])
def test_hostile_manifest_fields(published, field, value, says):
    """Each hostile field is refused by the manifest parser itself, with a message naming what is wrong."""
    uri, states, sub, target = published

    def edit(doc):
        if "." in field:
            head, key = field.split(".")
            if head == "tensors" and isinstance(doc[head], dict):  # format 1.2 on: the first entry of a column
                edit_tensor_columns(uri, doc, lambda columns: columns[key].__setitem__(0, value))
                return
            entry = doc[head][0] if isinstance(doc[head], list) else doc[head]
            entry[key] = value
        else:
            doc[field] = value

    _rewrite_manifest(uri, 4, edit)
    err = _expect(ds.Subscriber(uri), target, states[3], ManifestError, step=4)
    assert says in str(err), str(err)


def test_missing_version_and_empty_store(published, tmp_path):
    uri, states, sub, target = published
    _expect(sub, target, states[3], VersionNotFoundError, step=77)
    with pytest.raises(VersionNotFoundError):
        ds.Subscriber(str(tmp_path / "empty")).pull()


def test_unknown_scheme_and_codec_names(tmp_path):
    with pytest.raises(UnknownBackendError) as e:
        ds.open_store("nosuch://bucket/x")
    assert "nosuch" in str(e.value)
    with pytest.raises(UnknownCodecError):
        ds.Publisher(str(tmp_path / "s"), codec="nope")


def test_digest_helper_matches_store_layout(published):
    uri, states, sub, target = published
    m = sub.manifest(4)
    o = m.objects[0]
    data = open(_path(uri, object_key(o.digest)), "rb").read()
    assert sha256_digest(data) == o.digest and len(data) == o.size


@pytest.mark.parametrize("step", ["3", 3.0, True, [3]])
def test_step_of_the_wrong_type_is_typed(published, step):
    uri, states, sub, target = published
    err = _expect(sub, target, states[3], InvalidStepError, step=step)
    assert isinstance(err, TypeError) and "step must be an integer" in str(err) and repr(step) in str(err)
    for call in (lambda: sub.stage(step), lambda: sub.identify(target, step), lambda: sub.plan(step)):
        with pytest.raises(InvalidStepError):
            call()


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_non_contiguous_tensors_are_accepted_at_every_step(store_uri, dtype):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(48, 32, generator=g)  # an fp32 master held transposed
    if dtype is None:
        master = master.bfloat16()
    pub = ds.Publisher(store_uri, dtype=dtype, anchor_every=100)
    sub = ds.Subscriber(store_uri)
    for step in range(3):
        state = {"w": master.t(), "b": master[:, 0]}  # both views are non-contiguous
        assert not state["w"].is_contiguous() and not state["b"].is_contiguous()
        pub.publish(state, step=step)
        want = {k: v.contiguous().to(torch.bfloat16) for k, v in state.items()}
        assert bits_equal(sub.pull(step=step).state, want)
        with torch.no_grad():
            master.view(-1)[step::7] += 1
    pub.close()
    assert [sub.manifest(s).kind for s in range(3)] == ["anchor", "delta", "delta"]


def test_extreme_created_time_is_readable(published):
    uri, states, sub, target = published
    assert sub.manifest(4).created_at.year >= 2024
    for created in (1e300, -1e300, 2.0 ** 63):
        _rewrite_manifest(uri, 4, lambda doc: doc.update(created=created))
        m = ds.Manifest.from_json(open(_path(uri, version_key(4)), "rb").read())
        assert m.created == created and m.created_at is None  # no OverflowError / ValueError / OSError
    sub.store.forget(4)
    assert sub.pull(target, step=4).age == 0.0  # created in the far future: age clamps at 0
