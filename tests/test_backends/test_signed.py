"""Signed versions against a hostile store or relay, on local disk and on a real S3 server (SeaweedFS).

Each refusal is checked for its typed error (naming the version and the key id), for no object read from the
store (a counting backend under the follower's store), and for the target's bits and tracked version unchanged.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("cryptography")

import deltastore as ds  # noqa: E402
from deltastore.backends.base import WrapperBackend  # noqa: E402
from deltastore.errors import (RollbackError, SignatureError, StaleLatestError, UnsignedVersionError,  # noqa: E402
                               UntrustedKeyError, UntrustedVersionError)
from deltastore.signing import SigningKey, latest_bytes  # noqa: E402
from deltastore.store import DeltaStore, object_key, version_key  # noqa: E402

from .conftest import target_for  # noqa: E402

KINDS = ["local", "s3-seaweedfs"]


class Counting(WrapperBackend):
    """Records every key read (whole, ranged or batched)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.reads: list[str] = []

    def _call(self, op, key, fn):
        if op in ("get", "get_range"):
            self.reads.append(key)
        return fn()

    def _get_many(self, keys, limits):
        self.reads.extend(keys)
        return self.inner.get_many(keys, limits=limits)

    def objects_read(self) -> list[str]:
        return [k for k in self.reads if k.startswith("objects/")]


def states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(48, 64, generator=g).bfloat16(), "b": torch.randn(64, generator=g).bfloat16()}
    out = []
    for step in range(n):
        state = {k: v.clone() for k, v in state.items()}
        flat = state["w"].view(-1)
        idx = torch.randint(0, flat.numel(), (40,), generator=g)
        flat[idx] = (flat[idx].float() * 1.01 + 0.001).bfloat16()
        state["b"][step % 64] += 1
        out.append(state)
    return out


def bits(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().view(torch.int16) for k, v in state.items()}


def same_bits(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(params=KINDS)
def target(request, tmp_path):
    return target_for(request.param, request, tmp_path)


@pytest.fixture
def keys():
    return SigningKey.generate(), SigningKey.generate()


def publish(target, key, versions, start=0, **kw):
    with ds.Publisher(target.uri, storage_options=target.options, signing_key=key, **kw) as pub:
        for i, st in enumerate(versions):
            pub.publish(st, step=start + i)


def follower(target, trusted, **kw):
    backend = Counting(target.open())
    sub = ds.Subscriber(DeltaStore(backend, target.uri), trusted_keys=trusted, **kw)
    return sub, backend


def raw(target):
    return target.open()


def refused(sub, backend, tgt, exc, **pull):
    """Pull and expect ``exc``; no object read, the target's bits and version unchanged. Returns the error."""
    before, version = bits(tgt), sub.version_of(tgt)
    backend.reads.clear()
    with pytest.raises(exc) as info:
        sub.pull(tgt, **pull)
    assert backend.objects_read() == [], backend.objects_read()
    assert same_bits(bits(tgt), before)
    assert sub.version_of(tgt) == version
    return info.value


def at(target, trusted, step, **kw):
    """A follower whose dict target holds ``step`` (pulled by number)."""
    sub, backend = follower(target, trusted, **kw)
    tgt = {k: torch.zeros_like(v) for k, v in states(1)[0].items()}
    res = sub.pull(tgt, step=step)
    assert res.step == step
    return sub, backend, tgt


def test_signed_pull_checks_every_version(target, keys):
    a, _ = keys
    vs = states(6)
    publish(target, a, vs, anchor_every=3)
    sub, backend = follower(target, [a.public])
    tgt = {k: torch.zeros_like(v) for k, v in vs[0].items()}
    res = sub.pull(tgt, step=2)
    assert same_bits(bits(tgt), bits(vs[2])) and res.signed_by == a.key_id
    res = sub.pull(tgt)  # the latest: deltas 3..5
    assert res.step == 5 and res.path == "delta" and res.signed_by == a.key_id
    assert same_bits(bits(tgt), bits(vs[5]))
    assert res.latest_age is not None and 0 <= res.latest_age < 60
    assert all(sub.manifest(s).format_version == "1.4" for s in sub.versions())


def test_tampered_manifest_refused(target, keys):
    a, _ = keys
    vs = states(5)
    publish(target, a, vs, anchor_every=10)
    sub, backend, tgt = at(target, [a.public], 2)
    store = raw(target)
    doc = json.loads(store.get(version_key(4)))
    doc["metadata"]["lr"] = 1.0  # any change of the signed bytes
    store.put(version_key(4), json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    sub.store.forget_all()
    err = refused(sub, backend, tgt, SignatureError)
    assert err.step == 4 and err.key_id == a.key_id and "version 4" in str(err) and a.key_id in str(err)
    # a tampered delta in the middle of the path is refused too, not only the last version
    doc = json.loads(store.get(version_key(3)))
    doc["tensors"]["checksum"][0] = "0" * 16
    store.put(version_key(3), json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    sub.store.forget_all()
    err = refused(sub, backend, tgt, SignatureError, step=3)
    assert err.step == 3


def test_tampered_delta_on_the_path_refused(target, keys):
    a, _ = keys
    vs = states(6)
    publish(target, a, vs, anchor_every=10)
    sub, backend, tgt = at(target, [a.public], 2)
    store = raw(target)
    doc = json.loads(store.get(version_key(4)))
    doc["created"] += 1
    store.put(version_key(4), json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    sub.store.forget_all()
    before = bits(tgt)
    backend.reads.clear()
    with pytest.raises(SignatureError) as info:
        sub.pull(tgt)  # latest 5: the path 3, 4, 5 goes through the tampered 4
    assert info.value.step == 4 and info.value.key_id == a.key_id
    # only the layout object a verified manifest (5) names may have been read: no weight object
    assert set(backend.objects_read()) <= {object_key(sub.manifest(5).layout_ref.digest)}
    assert same_bits(bits(tgt), before) and sub.version_of(tgt).step == 2


def test_tampered_anchor_refused_for_a_joiner(target, keys):
    """A joiner's path starts at an anchor: a tampered anchor leaves no path, and its weights are never read."""
    a, _ = keys
    vs = states(4)
    publish(target, a, vs, anchor_every=10)  # the anchor is version 0, the latest a delta
    store = raw(target)
    doc = json.loads(store.get(version_key(0)))
    doc["tensors"]["checksum"][0] = "f" * 16
    store.put(version_key(0), json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    sub, backend = follower(target, [a.public])
    tgt = {k: torch.zeros_like(v) for k, v in vs[0].items()}
    before = bits(tgt)
    with pytest.raises(SignatureError) as info:
        sub.pull(tgt)
    assert info.value.step == 0 and info.value.key_id == a.key_id
    assert set(backend.objects_read()) <= {object_key(sub.manifest(3).layout_ref.digest)}  # metadata only
    assert same_bits(bits(tgt), before) and sub.version_of(tgt) is None


def test_oversized_latest_is_typed(target, keys):
    a, _ = keys
    publish(target, a, states(2))
    raw(target).put("refs/latest", b"{" + b" " * (128 << 10) + b"}")
    sub, backend = follower(target, [a.public])
    with pytest.raises(ds.errors.ManifestError, match="refs/latest is over"):
        sub.pull()
    assert backend.objects_read() == []


def test_swapped_objects_refused(target, keys):
    """A bucket writer who stores objects of their own and names them in a manifest: the signature fails
    (edited manifest), or the manifest is theirs (unsigned or another key)."""
    a, _ = keys
    vs = states(4)
    publish(target, a, vs, anchor_every=10)
    sub, backend, tgt = at(target, [a.public], 1)
    evil = states(4, seed=99)
    # the attacker's own store holds their version 3; its objects are copied into ours and our manifest of 3
    # is edited to name them
    other = target.with_uri(target.uri + "-evil")
    with ds.Publisher(other.uri, storage_options=other.options) as pub:
        pub.publish(evil[3], step=3)
    src, dst = other.open(), raw(target)
    for key in src.list("objects/"):
        dst.put(key, src.get(key))
    doc = json.loads(dst.get(version_key(3)))
    theirs = json.loads(src.get(version_key(3)))
    doc["objects"], doc["layout"] = theirs["objects"], theirs["layout"]
    doc["tensors"] = theirs["tensors"]
    dst.put(version_key(3), json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    sub.store.forget_all()
    err = refused(sub, backend, tgt, SignatureError)
    assert err.step == 3 and err.key_id == a.key_id
    # their manifest as is: unsigned
    dst.put(version_key(3), src.get(version_key(3)))
    sub.store.forget_all()
    err = refused(sub, backend, tgt, UnsignedVersionError)
    assert err.step == 3 and "version 3 is unsigned" in str(err)


def test_unknown_key_and_rotation(target, keys):
    a, b = keys
    vs = states(6)
    publish(target, a, vs[:3], anchor_every=3)
    publish(target, b, vs[3:], start=3, anchor_every=3)  # the trainer rotates to key b (resumes the chain)
    # trusting only a: version 5 (key b) is refused, naming b
    sub, backend, tgt = at(target, [a.public], 2)
    err = refused(sub, backend, tgt, UntrustedKeyError)
    assert err.key_id == b.key_id and b.key_id in str(err) and a.key_id in str(err)
    # trusting both: the deltas across the rotation apply, and old versions stay verifiable
    sub, backend, tgt = at(target, [a.public, b.public], 2)
    res = sub.pull(tgt)
    assert res.step == 5 and res.path == "delta" and res.signed_by == b.key_id
    assert same_bits(bits(tgt), bits(vs[5]))
    old = sub.pull(step=1)
    assert old.signed_by == a.key_id and same_bits(bits(old.state), bits(vs[1]))
    # trusting only b: a joiner starts from b's anchor; version 1 (key a) is refused
    sub, backend = follower(target, [b.public])
    res = sub.pull()
    assert res.step == 5 and res.versions_applied[0] >= 3 and same_bits(bits(res.state), bits(vs[5]))
    with pytest.raises(UntrustedKeyError) as info:
        sub.pull(step=1)
    assert info.value.step == 1 and info.value.key_id == a.key_id


def test_unsigned_versions_refused(target, keys):
    a, _ = keys
    vs = states(4)
    with ds.Publisher(target.uri, storage_options=target.options) as pub:  # no signing key
        for s in range(2):
            pub.publish(vs[s], step=s)
    sub, backend = follower(target, [a.public])
    tgt = {k: torch.zeros_like(v) for k, v in vs[0].items()}
    err = refused(sub, backend, tgt, UnsignedVersionError)  # refs/latest: the digits of an unsigned store
    assert err.what == "refs/latest"
    err = refused(sub, backend, tgt, UnsignedVersionError, step=1)
    assert err.step == 1
    # signing turned on (an anchor: a joiner's path must start at a signed version), then someone with write
    # access commits an unsigned version 3 and leaves the signed refs/latest as it was
    publish(target, a, vs[2:3], start=2, anchor_every=1)
    sub, backend, tgt = at(target, [a.public], 2)
    store = raw(target)
    signed_latest = store.get("refs/latest")
    with ds.Publisher(target.uri, storage_options=target.options) as pub:
        pub.publish(vs[3], step=3)
    assert store.get("refs/latest") == b"3"  # an unsigned publisher writes the digits: refused as above
    store.put("refs/latest", signed_latest)
    err = refused(sub, backend, tgt, UnsignedVersionError)
    assert err.step == 3 and "version 3 is unsigned" in str(err)
    err = refused(sub, backend, tgt, UnsignedVersionError, step=3)
    assert err.step == 3


def test_replayed_latest_refused(target, keys):
    """A relay serves an older signed refs/latest and hides the newer versions."""
    a, _ = keys
    vs = states(6)
    store = raw(target)
    publish(target, a, vs[:3], anchor_every=10)
    old_latest = store.get("refs/latest")
    publish(target, a, vs[3:], start=3, anchor_every=10)
    sub, backend, tgt = at(target, [a.public], 1)
    assert sub.pull(tgt).step == 5  # this follower saw the latest at 5
    hidden = {s: store.get(version_key(s)) for s in (3, 4, 5)}
    for s in hidden:
        store.delete(version_key(s))
    store.put("refs/latest", old_latest)
    sub.store.forget_all()
    err = refused(sub, backend, tgt, RollbackError)
    assert err.what == "refs/latest" and err.key_id == a.key_id
    # a follower that never saw a newer latest, holding 5: it does not move backward to 2
    fresh, fb = follower(target, [a.public])
    tracked_5 = {k: v.clone() for k, v in tgt.items()}
    for s, data in hidden.items():
        store.put(version_key(s), data)
    fresh.pull(tracked_5, step=5)
    for s in hidden:
        store.delete(version_key(s))
    fresh.store.forget_all()
    err = refused(fresh, fb, tracked_5, RollbackError)
    assert err.step == 2 and "below version 5" in str(err)
    assert fresh.pull(tracked_5, step=2).step == 2  # asked for explicitly: allowed
    assert same_bits(bits(tracked_5), bits(vs[2]))


def test_frozen_latest(target, keys):
    """A relay that keeps serving one signed latest: its age is reported, and refused past the bound."""
    a, _ = keys
    vs = states(3)
    publish(target, a, vs, anchor_every=10)
    store = raw(target)
    m = ds.Subscriber(target.uri, storage_options=target.options).store.manifest_with_digest(2)
    store.put("refs/latest", latest_bytes(2, m[1], a, issued=time.time() - 3600))  # signed an hour ago
    sub, backend, tgt = at(target, [a.public], 1, max_latest_age=600)
    err = refused(sub, backend, tgt, StaleLatestError)
    assert err.step == 2 and err.key_id == a.key_id and "max_latest_age=600" in str(err)
    assert isinstance(err, ds.errors.StaleVersionError)
    unbounded, _ = follower(target, [a.public])
    res = unbounded.pull(step=None)
    assert res.step == 2 and 3500 < res.latest_age < 3700  # reported
    # the trainer's heartbeat makes it fresh again
    with ds.Publisher(target.uri, storage_options=target.options, signing_key=a) as pub:
        pub.refresh_latest()
    assert sub.pull(tgt).step == 2 and same_bits(bits(tgt), bits(vs[2]))


def test_latest_hidden_by_listing_is_still_reached(target, keys):
    """A listing that hides the newest version does not lower the signed latest."""
    a, _ = keys
    vs = states(4)
    publish(target, a, vs, anchor_every=10)

    class HidingList(Counting):
        def _list(self, prefix):
            return (k for k in self.inner.list(prefix) if k != version_key(3))

    sub = ds.Subscriber(DeltaStore(HidingList(target.open()), target.uri), trusted_keys=[a.public])
    assert sub.versions()[-1] == 2
    res = sub.pull()
    assert res.step == 3 and same_bits(bits(res.state), bits(vs[3]))


def test_untrusted_errors_share_a_base():
    for cls in (SignatureError, UnsignedVersionError, UntrustedKeyError, RollbackError, StaleLatestError):
        assert issubclass(cls, UntrustedVersionError) and issubclass(cls, ValueError)
