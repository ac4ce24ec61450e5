"""The interleavings of a publish that reuses objects with a GC pass, staged with pause hooks on the
backends' calls (events, no sleeps as synchronisation). Shared by ``test_gc_safety.py`` and
``bench/faults.py``; the protocol they check is in docs/format.md ("Garbage collection and concurrent
publishers").

Each case: versions 0 and 1 are committed (different tensors, so version 0's objects are GC candidates
once it is deleted); a publisher then commits version 2 with exactly version 0's objects (a chain
restarted from the same checkpoint), while GC deletes version 0 and collects its objects. Every
``run_*`` function raises AssertionError when the protocol is broken and returns the objects GC deleted.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable

import pytest
import torch

import deltastore as ds
from deltastore.errors import ObjectNotFoundError
from deltastore.gc import delete_unreferenced
from deltastore.manifest import Manifest
from deltastore.store import DeltaStore, object_key
from deltastore.testing import bits_equal
from deltastore.testing.faults import Fault, FaultyBackend

GRACE = {"local": 1.0, "s3": 4.0}
"""GC's grace per backend: on S3 (whole-second mtimes) it leaves room for a slow machine between a refresh
and GC's clock reading."""
WINDOW = {"local": 0.5, "s3": 2.0}
"""The refresh window of the publishers and GC of these cases: the grace exceeds it plus the timestamp
resolution (``DeltaStore.min_gc_grace``), as the protocol requires."""


def store_of(case: Any, rules=()) -> DeltaStore:
    """A store on the case's URI with the cases' refresh window (and ``rules`` injected)."""
    return DeltaStore(FaultyBackend(case.where.backend(case.uri), rules=list(rules)), case.uri,
                      refresh_window=WINDOW[case.where.kind])


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(3)}


A, B = state(1), state(2)


@dataclasses.dataclass
class Case:
    where: Any
    uri: str
    blobs: dict[str, bytes]   # version 0's objects: digest -> bytes
    manifest: Manifest        # version 0's manifest, recommitted as step 2
    candidates: list[str]     # version 0's objects that version 1 does not name


def prepare(where, name: str) -> Case:
    uri = where.fresh(name)
    with ds.Publisher(where.store(uri), anchor_every=1) as pub:
        pub.publish(A, step=0)
        pub.publish(B, step=1)
    store = where.store(uri)
    m0, m1 = store.manifest(0), store.manifest(1)
    blobs = {o.digest: store.get_object(o.digest, o.size) for o in m0.objects}
    kept = {o.digest for o in m1.objects}
    return Case(where, uri, blobs, m0, sorted(d for d in blobs if d not in kept))


def age(where, cases: list[Case]) -> None:
    """Make the prepared objects older than GC's grace (plus the S3 mtime resolution)."""
    if where.kind == "local":
        old = time.time() - 100
        for case in cases:
            for root, _, files in os.walk(os.path.join(case.uri, "objects")):
                for f in files:
                    os.utime(os.path.join(root, f), (old, old))
        return
    # S3 LastModified cannot be set: wait until the store's own clock says they are old enough (a condition
    # read from the server, not a guess at how long that takes)
    for case in cases:
        store = store_of(case)
        newest = max(store.backend.stat(object_key(d)).mtime for d in case.blobs)
        limit = newest + GRACE[where.kind] + store.backend.capabilities.mtime_resolution
        deadline = time.monotonic() + 60
        while store.clock() <= limit:
            assert time.monotonic() < deadline, "the store's clock did not advance past the grace"
            time.sleep(0.2)


def _publisher(case: Case, rules=()) -> DeltaStore:
    store = store_of(case, rules)
    store.delete_window = 0.0  # the cases order GC's deletes themselves (join it) before the commit's check
    return store


def _step2(case: Case) -> Manifest:
    return dataclasses.replace(case.manifest, step=2, created=time.time())


def _republish(store: DeltaStore, case: Case) -> None:
    for blob in case.blobs.values():
        store.put_object(blob)
    store.commit(_step2(case))


def gc(case: Case, rules=(), store: DeltaStore | None = None) -> list[str]:
    g = store or store_of(case, rules)
    g.delete_version(0)
    return delete_unreferenced(g, case.candidates, grace=GRACE[case.where.kind])


def _pause(op: str, prefix: str, reached: threading.Event, go: threading.Event) -> Fault:
    def hook(_op: str, _key: str) -> None:
        reached.set()
        assert go.wait(60), "the interleaving stalled"

    return Fault("pause", ops=op, prefix=prefix, limit=1, hook=hook)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def assert_pulls(case: Case) -> None:
    """Versions 1 and 2 are listed and pull bit-exactly (nothing committed was lost)."""
    store = case.where.store(case.uri)
    assert store.versions() == [1, 2], store.versions()
    assert bits_equal(ds.Subscriber(store).pull(step=2).state, A), "version 2 pulled wrong bits"
    assert bits_equal(ds.Subscriber(case.where.store(case.uri)).pull(step=1).state, B), "version 1 pulled wrong bits"


def run_control(case: Case) -> list[str]:
    """Nobody reuses the objects: GC deletes every old candidate (the age rule is not vacuous)."""
    deleted = gc(case)
    assert case.candidates and sorted(deleted) == case.candidates, (deleted, case.candidates)
    return deleted


def run_check_gc_touch(case: Case) -> list[str]:
    """The publisher finds an object present, GC deletes it (list, stat, delete), then the publisher refreshes
    it: the refresh finds it gone and uploads it again."""
    at_touch, gc_done = threading.Event(), threading.Event()
    pub = _publisher(case, [_pause("touch", "objects/", at_touch, gc_done)])
    t, out = _in_thread(lambda: _republish(pub, case))
    assert at_touch.wait(60)
    deleted = gc(case)
    assert sorted(deleted) == case.candidates, deleted  # GC deleted them while the publish held them "present"
    gc_done.set()
    t.join()
    assert out == [None], out
    assert_pulls(case)
    return deleted


def run_touch_gc_commit(case: Case, skews: tuple[float, ...] = ()) -> list[str]:
    """The publisher refreshes every object, GC runs completely (clock, list, stat), then the commit: the
    refreshed objects are younger than GC's clock minus grace, so GC spares them. With ``skews`` (local
    disk), GC runs first with the process clock moved by each skew: the outcome must not change."""
    at_commit, gc_done = threading.Event(), threading.Event()
    pub = _publisher(case, [_pause("put", "versions/", at_commit, gc_done)])
    t, out = _in_thread(lambda: _republish(pub, case))
    assert at_commit.wait(60)
    if skews:
        store_of(case).delete_version(0)
        real = time.time
        for skew in skews:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(time, "time", lambda: real() + skew)
                spared = delete_unreferenced(store_of(case), case.candidates, grace=GRACE[case.where.kind])
            assert spared == [], f"GC with its clock {skew:+.0f} s off deleted {spared}"
    deleted = gc(case)
    assert deleted == [], deleted
    gc_done.set()
    t.join()
    assert out == [None], out
    assert_pulls(case)
    return deleted


def run_stat_touch_delete(case: Case) -> list[str]:
    """GC stats an old object, the publisher refreshes it, then GC's delete lands. Local disk (conditional
    delete): the object is renamed aside, found refreshed and put back. S3: the delete lands; the commit's
    check finds the hole and commits nothing; publishing the step again uploads the object."""
    at_delete, touched = threading.Event(), threading.Event()
    g, gout = _in_thread(lambda: gc(case, [_pause("delete", "objects/", at_delete, touched)]))
    assert at_delete.wait(60)
    pub = _publisher(case)
    for blob in case.blobs.values():
        pub.put_object(blob)
    touched.set()
    g.join()
    if case.where.kind == "local":
        assert gout == [[]], gout
        pub.commit(_step2(case))
    else:
        assert len(gout[0]) == 1, gout
        with pytest.raises(ObjectNotFoundError, match="deleted by a concurrent GC before version 2 was committed"):
            pub.commit(_step2(case))
        assert case.where.store(case.uri).versions() == [1]
        _republish(pub, case)
    assert_pulls(case)
    return gout[0]


INTERLEAVINGS: dict[str, Callable[[Case], list[str]]] = {
    "check-gc-touch": run_check_gc_touch,
    "touch-gc-commit": run_touch_gc_commit,
    "stat-touch-delete": run_stat_touch_delete,
}
