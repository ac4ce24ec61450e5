"""GC never loses a committed version: every interleaving of a publish that reuses objects with a GC pass,
staged deterministically with pause hooks on the backends' calls (events, no sleeps as synchronisation),
on local disk and on the SeaweedFS S3 server. The protocol is in docs/format.md ("Garbage collection and
concurrent publishers").

Each case: versions 0 and 1 are committed (different tensors, so version 0's objects are GC candidates
once it is deleted); a publisher then commits version 2 with exactly version 0's objects (a chain
restarted from the same checkpoint), while GC deletes version 0 and collects its objects.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch

import deltastore as ds
from conftest import bits_equal
from deltastore.errors import ObjectNotFoundError
from deltastore.gc import delete_unreferenced
from deltastore.manifest import Manifest
from deltastore.store import DeltaStore
from deltastore.testing.faults import Fault, FaultyBackend

GRACE = 1.0


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(3)}


A, B = _state(1), _state(2)


@dataclasses.dataclass
class Case:
    uri: str
    blobs: dict[str, bytes]   # version 0's objects: digest -> bytes
    manifest: Manifest        # version 0's manifest, recommitted as step 2
    candidates: list[str]     # version 0's objects that version 1 does not name


def _prepare(where, name: str) -> Case:
    uri = where.fresh(name)
    with ds.Publisher(where.store(uri), anchor_every=1) as pub:
        pub.publish(A, step=0)
        pub.publish(B, step=1)
    store = where.store(uri)
    m0, m1 = store.manifest(0), store.manifest(1)
    blobs = {o.digest: store.get_object(o.digest, o.size) for o in m0.objects}
    kept = {o.digest for o in m1.objects}
    return Case(uri, blobs, m0, sorted(d for d in blobs if d not in kept))


def _age(where, cases: list[Case]) -> None:
    """Make the prepared objects older than GC's grace (plus the S3 mtime resolution)."""
    if where.kind == "local":
        old = time.time() - 100
        for case in cases:
            for root, _, files in os.walk(os.path.join(case.uri, "objects")):
                for f in files:
                    os.utime(os.path.join(root, f), (old, old))
    else:  # S3 LastModified cannot be set: let them age (this is not synchronisation)
        time.sleep(GRACE + 2.5)


def _publisher(where, case: Case, rules=()) -> DeltaStore:
    store = DeltaStore(FaultyBackend(where.backend(case.uri), rules=list(rules)), case.uri)
    store.delete_window = 0.0  # the test orders GC's deletes itself (joins it) before the commit's check
    return store


def _republish(store: DeltaStore, case: Case) -> None:
    for blob in case.blobs.values():
        store.put_object(blob)
    store.commit(dataclasses.replace(case.manifest, step=2, created=time.time()))


def _gc(where, case: Case, rules=()) -> list[str]:
    g = DeltaStore(FaultyBackend(where.backend(case.uri), rules=list(rules)), case.uri)
    g.delete_version(0)
    return delete_unreferenced(g, case.candidates, grace=GRACE)


def _pause(op: str, prefix: str, reached: threading.Event, go: threading.Event) -> Fault:
    def hook(_op: str, _key: str) -> None:
        reached.set()
        assert go.wait(60), "the interleaving stalled"

    return Fault("pause", ops=op, prefix=prefix, limit=1, hook=hook)


def _assert_pulls(where, case: Case) -> None:
    store = where.store(case.uri)
    assert store.versions() == [1, 2]
    assert bits_equal(ds.Subscriber(store).pull(step=2).state, A)
    assert bits_equal(ds.Subscriber(where.store(case.uri)).pull(step=1).state, B)


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_gc_never_loses_a_committed_version(where):
    cases = {n: _prepare(where, n) for n in ("control", "check-gc-touch", "touch-gc-commit", "stat-touch-delete")}
    _age(where, list(cases.values()))

    # control: nobody reuses the objects; GC deletes every old candidate (the rule is not vacuous)
    c = cases["control"]
    assert c.candidates and sorted(_gc(where, c)) == c.candidates

    # 1. the publisher finds an object present, GC deletes it (list, stat, delete), then the publisher
    #    refreshes it: the refresh finds it gone and uploads it again
    c = cases["check-gc-touch"]
    at_touch, gc_done = threading.Event(), threading.Event()
    pub = _publisher(where, c, [_pause("touch", "objects/", at_touch, gc_done)])
    t, out = _in_thread(lambda: _republish(pub, c))
    assert at_touch.wait(60)
    assert sorted(_gc(where, c)) == c.candidates  # GC deleted them while the publish held them "present"
    gc_done.set()
    t.join()
    assert out == [None], out
    _assert_pulls(where, c)

    # 2. the publisher refreshes every object, GC runs completely (clock, list, stat), then the commit:
    #    the refreshed objects are younger than GC's clock minus grace, so GC spares them
    c = cases["touch-gc-commit"]
    at_commit, gc_done = threading.Event(), threading.Event()
    pub = _publisher(where, c, [_pause("put", "versions/", at_commit, gc_done)])
    t, out = _in_thread(lambda: _republish(pub, c))
    assert at_commit.wait(60)
    if where.kind == "local":  # the GC machine's clock plays no part: skew it by an hour both ways
        DeltaStore(where.backend(c.uri), c.uri).delete_version(0)
        real = time.time
        for skew in (3600.0, -3600.0):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(time, "time", lambda: real() + skew)
                assert delete_unreferenced(DeltaStore(where.backend(c.uri), c.uri), c.candidates, grace=GRACE) == []
    assert _gc(where, c) == []
    gc_done.set()
    t.join()
    assert out == [None], out
    _assert_pulls(where, c)

    # 3. GC stats an old object, the publisher refreshes it, then GC's delete lands
    c = cases["stat-touch-delete"]
    at_delete, touched = threading.Event(), threading.Event()
    g, gout = _in_thread(lambda: _gc(where, c, [_pause("delete", "objects/", at_delete, touched)]))
    assert at_delete.wait(60)
    pub = _publisher(where, c)
    for blob in c.blobs.values():
        pub.put_object(blob)
    touched.set()
    g.join()
    if where.kind == "local":
        # conditional delete: the object was renamed aside, found refreshed, and put back
        assert gout == [[]], gout
        pub.commit(dataclasses.replace(c.manifest, step=2, created=time.time()))
    else:
        # S3 has no conditional delete: the delete landed; the commit's check finds the hole, commits nothing
        assert len(gout[0]) == 1, gout
        with pytest.raises(ObjectNotFoundError, match="deleted by a concurrent GC before version 2 was committed"):
            pub.commit(dataclasses.replace(c.manifest, step=2, created=time.time()))
        assert where.store(c.uri).versions() == [1]
        _republish(pub, c)  # publishing the step again uploads the missing object
    _assert_pulls(where, c)
