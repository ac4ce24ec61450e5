"""publish() never raises after its commit point: marker and retention failures become warnings."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

import deltastore as ds
from conftest import chain_states
from deltastore.testing import bits_equal
from deltastore.backends import open_backend
from deltastore.backends.memory import MemoryBackend
from deltastore.errors import PostCommitWarning
from deltastore.gc import Retention
from deltastore.store import STORE_MARKER, DeltaStore
from deltastore.testing.faults import Fault, FaultyBackend
from test_backends.conftest import seaweed_server  # noqa: F401 - the suite's real S3 server (SeaweedFS)


def _states(n, seed=0):
    return chain_states(n, {"w": (64, 32), "b": (32,)}, changes=0.05, seed=seed)


@pytest.fixture(params=["memory", "s3"])
def make_faulty(request):
    """``make_faulty(*rules) -> (inner backend, faulty wrapper)`` on a memory store and on SeaweedFS's S3 API."""

    def make(*rules):
        if request.param == "memory":
            inner = MemoryBackend(uuid.uuid4().hex)
        else:
            import s3fs

            server = request.getfixturevalue("seaweed_server")
            bucket = f"pc-{uuid.uuid4().hex[:16]}"
            opts = {**server.storage_options(), "skip_instance_cache": True}
            s3fs.S3FileSystem(**opts).mkdir(bucket)
            inner = open_backend(f"s3://{bucket}", **opts)
        return inner, FaultyBackend(inner, rules=list(rules))

    return make


def _check_pulls(inner, states, steps):
    sub = ds.Subscriber(DeltaStore(inner))
    for s in steps:
        assert bits_equal(sub.pull(step=s).state, states[s])
    target = sub.pull(step=steps[0]).state
    sub.identify(target, steps[0])
    for s in steps[1:]:
        assert sub.pull(target, step=s).path == "delta"  # the chain kept moving: a follower takes deltas
        assert bits_equal(target, states[s])


@pytest.mark.parametrize("background", [False, True])
def test_marker_failure_after_commit_is_a_warning(make_faulty, background):
    inner, faulty = make_faulty(Fault("permanent", ops="put", prefix=STORE_MARKER))
    states = _states(4)
    pub = ds.Publisher(DeltaStore(faulty), anchor_every=100, background=background)
    with pytest.warns(PostCommitWarning, match="committed"):
        infos = [pub.publish(s, step=i) for i, s in enumerate(states)]
        infos = [i.result() for i in infos]
        pub.close()
    assert faulty.injected["permanent"] >= 1
    assert [i.step for i in infos] == [0, 1, 2, 3]
    assert all(i.warnings and "PermissionError" in i.warnings[0] for i in infos)
    m = DeltaStore(inner).manifest(3)
    assert m.parent is not None and m.parent.step == 2 and m.kind == "delta"
    assert not inner.exists(STORE_MARKER)
    _check_pulls(inner, states, [0, 1, 2, 3])


@pytest.mark.parametrize("background", [False, True])
def test_retention_failure_after_commit_is_a_warning(make_faulty, background):
    inner, faulty = make_faulty(Fault("permanent", ops="delete"))
    states = _states(6)
    pub = ds.Publisher(DeltaStore(faulty, refresh_window=0.0), anchor_every=2,
                       retention=Retention(keep_last=2, keep_anchors=1), gc_grace=1.5, background=background)
    with pytest.warns(PostCommitWarning, match="retention"):
        infos = [pub.publish(s, step=i) for i, s in enumerate(states)]
        infos = [i.result() for i in infos]
        pub.close()
    assert faulty.injected["permanent"] >= 1
    assert [i.step for i in infos] == list(range(6))
    assert any(w.startswith("retention after version") for i in infos for w in i.warnings)
    assert DeltaStore(inner).versions() == list(range(6))  # nothing could be deleted, nothing was lost
    _check_pulls(inner, states, [4, 5])


def test_failed_manifest_write_still_raises_and_can_be_retried(make_faulty):
    inner, faulty = make_faulty(Fault("permanent", ops="put", prefix="versions/", skip=1, limit=1))
    states = _states(3)
    pub = ds.Publisher(DeltaStore(faulty), anchor_every=100)
    assert not pub.publish(states[0], step=0).warnings
    with pytest.raises(PermissionError):
        pub.publish(states[1], step=1)  # before the commit point: an error, nothing committed
    assert DeltaStore(inner).versions() == [0]
    assert pub.publish(states[1], step=1).step == 1
    pub.publish(states[2], step=2)
    pub.close()
    _check_pulls(inner, states, [0, 1, 2])


def test_marker_failure_on_a_store_without_atomic_create():
    """The store adds ``"commit": "check-then-write"`` to the producer there: the read-back still knows it."""
    inner = MemoryBackend(uuid.uuid4().hex)
    inner.capabilities = dataclasses.replace(inner.capabilities, atomic_create=False)
    faulty = FaultyBackend(inner, rules=[Fault("permanent", ops="put", prefix=STORE_MARKER)])
    states = _states(2)
    with pytest.warns(PostCommitWarning):
        with ds.Publisher(DeltaStore(faulty), anchor_every=100) as pub:
            infos = [pub.publish(s, step=i) for i, s in enumerate(states)]
    store = DeltaStore(inner)
    assert store.manifest(1).producer["commit"] == "check-then-write"
    assert [i.digest for i in infos] == [store.ref(0).digest, store.ref(1).digest]
    _check_pulls(inner, states, [0, 1])


def test_verify_notes_check_then_write_commits():
    from deltastore.pull.verify import verify_store
    inner = MemoryBackend(uuid.uuid4().hex)
    inner.capabilities = dataclasses.replace(inner.capabilities, atomic_create=False)
    with ds.Publisher(DeltaStore(inner), anchor_every=100) as pub:
        for i, s in enumerate(_states(2)):
            pub.publish(s, step=i)
    report = verify_store(DeltaStore(inner))
    assert report.ok and [step for step, _ in report.notes] == [0, 1]
    assert all("check-then-write" in msg for _, msg in report.notes)
    atomic = MemoryBackend(uuid.uuid4().hex)
    with ds.Publisher(DeltaStore(atomic), anchor_every=100) as pub:
        pub.publish(_states(1)[0], step=0)
    assert verify_store(DeltaStore(atomic)).notes == []
