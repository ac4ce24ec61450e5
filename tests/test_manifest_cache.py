"""The manifest cache stays bounded over many steps, and one pull still reads each manifest of its path once."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

import deltastore as ds
from deltastore.manifest_cache import ManifestCache


def test_least_recently_used_entries_leave_beyond_the_bounds():
    c: ManifestCache[str] = ManifestCache(max_entries=3, max_bytes=100, keep=1)
    for s in range(5):
        c.put(s, f"m{s}", 10)
    assert len(c) == 3 and c.get(0) is None and c.get(1) is None and c.nbytes == 30
    assert c.get(2) == "m2"  # now the most recently used: 3 leaves next
    c.put(5, "m5", 10)
    assert c.get(3) is None and c.get(2) == "m2" and c.get(4) == "m4" and c.get(5) == "m5"
    c.put(6, "big", 95)  # over the byte bound alone: everything older leaves, the newest stays (keep=1)
    assert len(c) == 1 and c.get(6) == "big" and c.nbytes == 95
    c.put(6, "again", 5)  # replacing an entry counts its bytes once
    assert c.nbytes == 5
    c.pop(6)
    assert len(c) == 0 and c.nbytes == 0


def test_nothing_leaves_while_held_and_the_cache_is_trimmed_after():
    c: ManifestCache[int] = ManifestCache(max_entries=2, max_bytes=1 << 20, keep=1)
    with c.holding():
        with c.holding():  # nested
            for s in range(10):
                c.put(s, s, 1)
        assert len(c) == 10  # the outer hold still stands
        assert all(c.get(s) == s for s in range(10))
    assert len(c) == 2 and c.get(8) == 8 and c.get(9) == 9


def test_holds_from_several_threads():
    c: ManifestCache[int] = ManifestCache(max_entries=1, max_bytes=1 << 20, keep=0)
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with c.holding():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(10)
    with c.holding():
        for s in range(4):
            c.put(s, s, 1)
    assert len(c) == 4  # the other thread still holds it
    release.set()
    t.join(10)
    assert len(c) == 1  # trimmed when the last holder returned


@pytest.mark.parametrize("bounds", [dict(max_entries=1, keep=2), dict(max_bytes=-1), dict(keep=-1)])
def test_bad_bounds_are_refused(bounds):
    with pytest.raises(ValueError, match="manifest cache bounds"):
        ManifestCache(**bounds)


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(32, 32, generator=g).to(torch.bfloat16) for i in range(3)}


def _step(model: dict[str, torch.Tensor], s: int) -> None:
    for t in model.values():
        t.view(torch.int16)[s % 7::7] += 1


def test_a_long_run_keeps_a_bounded_number_of_manifests(tmp_path):
    model = _model()
    pub = ds.Publisher(str(tmp_path), anchor_every=10)
    sub = ds.Subscriber(str(tmp_path))
    target = None
    for s in range(30):
        _step(model, s)
        pub.publish(model, step=s)
        target = sub.pull(target, step=s).state if target is not None else sub.pull(step=s).state
        assert all(torch.equal(target[k].view(torch.int16), v.view(torch.int16)) for k, v in model.items())
    for store in (pub.store, sub.store):
        assert 0 < len(store.manifest_cache) <= store.manifest_cache.max_entries


def test_one_pull_reads_each_manifest_of_a_long_path_once(tmp_path):
    model = _model()
    pub = ds.Publisher(str(tmp_path), anchor_every=1000)
    sub = ds.Subscriber(str(tmp_path))
    pub.publish(model, step=0)
    target = sub.pull(step=0).state
    for s in range(1, 25):  # a chain much longer than the cache keeps between operations
        _step(model, s)
        pub.publish(model, step=s)
    sub.store.forget_all()
    reads: Counter[str] = Counter()
    get = sub.store.backend.get_bounded

    def counting(key, limit):  # noqa: ANN001, ANN202
        reads[key] += 1
        return get(key, limit)

    sub.store.backend.get_bounded = counting  # type: ignore[method-assign]
    res = sub.pull(target, step=24, allow_anchor=False)
    assert res.path == "delta" and len(res.versions_applied) == 24
    versions = {k: n for k, n in reads.items() if k.startswith("versions/")}
    assert len(versions) == 25 and set(versions.values()) == {1}, versions
    assert all(torch.equal(target[k].view(torch.int16), v.view(torch.int16)) for k, v in model.items())
    assert len(sub.store.manifest_cache) <= sub.store.manifest_cache.max_entries  # trimmed after the pull


def test_a_resuming_publisher_reads_each_manifest_of_its_chain_once(tmp_path):
    model = _model()
    with ds.Publisher(str(tmp_path), anchor_every=1000) as pub:
        for s in range(12):  # a chain longer than the cache keeps between operations
            _step(model, s)
            pub.publish(model, step=s)
    store = ds.open_store(str(tmp_path))
    reads: Counter[str] = Counter()
    get = store.backend.get_bounded

    def counting(key, limit):  # noqa: ANN001, ANN202
        reads[key] += 1
        return get(key, limit)

    store.backend.get_bounded = counting  # type: ignore[method-assign]
    with ds.Publisher(store, anchor_every=1000) as again:  # resumes: rebuilds the mirror, the chain, the drift
        versions = {k: n for k, n in reads.items() if k.startswith("versions/")}
        assert len(versions) == 12 and set(versions.values()) == {1}, versions
        _step(model, 12)
        assert again.publish(model, step=12).kind == "delta"


def test_verifying_a_store_keeps_a_bounded_number_of_manifests_alive(tmp_path):
    import gc
    import weakref

    from deltastore.pull.verify import verify_store

    model = _model()
    with ds.Publisher(str(tmp_path), anchor_every=5) as pub:
        for s in range(16):
            _step(model, s)
            pub.publish(model, step=s)
    store = ds.open_store(str(tmp_path))
    made: list[weakref.ref] = []
    parse = store.manifest_with_digest

    def watching(step):  # noqa: ANN001, ANN202
        got = parse(step)
        made.append(weakref.ref(got[0]))
        return got

    store.manifest_with_digest = watching  # type: ignore[method-assign]
    alive: list[int] = []

    def progress(_msg: str) -> None:
        gc.collect()
        alive.append(len({id(m) for m in (r() for r in made) if m is not None}))

    report = verify_store(store, progress=progress)
    assert report.ok and report.replayed == list(range(16)), report.problems
    assert max(alive) <= store.manifest_cache.max_entries + 2, alive  # not one per version of the store
