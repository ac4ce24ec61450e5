"""The publish path's stages, each alone: the chain head's decision and advance, object planning, the
collective helper on one rank (``tests/test_distributed.py`` runs it over gloo ranks), the background writer,
resuming a chain, writing one version."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future

import pytest
import torch

import deltastore as ds
from deltastore.publish.anchors import Every
from deltastore.codecs import TensorSpec, get_codec
from deltastore.errors import DeltaStoreError, TargetMismatchError, VersionExistsError
from deltastore.publish.background import BackgroundWriter
from deltastore.publish.chain import ChainHead, Decision
from deltastore.publish.info import VersionInfo
from deltastore.publish.collective import LOCAL, Collective
from deltastore.publish.mirror import Mirror
from deltastore.publish.objects import ObjectPlanner
from deltastore.publish.resume import resume_chain
from deltastore.publish.stages import PublishStages
from deltastore.publish.version import Captured, write_version


def _manifests(uri: str, n: int) -> list:
    g = torch.Generator().manual_seed(0)
    s = {"a": torch.randn(4000, generator=g).bfloat16()}
    with ds.Publisher(uri, anchor_every=100) as pub:
        for i in range(n):
            pub.publish(s, step=i)
            bits = s["a"].view(torch.int16).clone()
            bits[i * 10:(i + 1) * 10] += 1
            s = {"a": bits.view(torch.bfloat16)}
    sub = ds.Subscriber(uri)
    return [sub.manifest(i) for i in range(n)]


def test_chain_head_decides_without_moving_and_advances_only_when_told():
    anchor, delta = _manifests(f"memory://{uuid.uuid4().hex}", 2)
    head = ChainHead(Every(3))
    assert head.decide(same_layout=False, drift_elements=0, total=10, tracking=False) == Decision(True, False)
    head.advance(anchor, "d0", Decision(True, False), checksums={"a": 1})
    assert head.last.step == 0 and head.anchor == head.last and head.checksums == {"a": 1}
    assert head.state.anchor_bytes == anchor.object_bytes(anchor.full_objects)
    before = (head.last, head.anchor, head.state, dict(head.checksums))
    d = head.decide(same_layout=True, drift_elements=5, total=10, tracking=False)
    assert d == Decision(False, False)
    assert (head.last, head.anchor, head.state, head.checksums) == before  # deciding moves nothing
    head.advance(delta, "d1", d, checksums={"a": 2}, drift_elements=5)
    assert head.last.step == 1 and head.anchor.step == 0 and head.state.versions_since_anchor == 1
    assert head.state.drift == 5 / delta.total
    # Every(3): the anchor and two deltas, then an anchor
    assert head.decide(same_layout=True, drift_elements=0, total=10, tracking=False).is_anchor is False
    head.advance(delta, "d2", Decision(False, False), checksums={"a": 3})
    assert head.decide(same_layout=True, drift_elements=0, total=10, tracking=False).is_anchor is True


def test_planner_sets_aside_what_is_cheaper_whole_and_cuts_whole_tensors_into_objects():
    specs = {"small": TensorSpec("small", torch.bfloat16, (64,)), "big": TensorSpec("big", torch.bfloat16, (5000,))}
    g = torch.Generator().manual_seed(1)
    tensors = {n: torch.randn(sp.shape, generator=g).bfloat16() for n, sp in specs.items()}
    mirror = Mirror.capture(tensors, specs, None)
    new = {"small": torch.randn(64, generator=g).bfloat16(),  # every element changed, to unrelated values
           "big": tensors["big"].clone()}
    new["big"].view(torch.int16)[:5] += 1
    diff = mirror.diff(new)
    # raw estimates 6 B a change: 64 changes of 64 elements are cheaper whole (dense estimates <= 2 B each)
    planner = ObjectPlanner(get_codec("raw"), get_codec("dense"), max_object_bytes=1 << 20, max_workers=2)
    delta_of: dict = {}
    whole: list = []
    jobs = planner.sparse_jobs(specs, diff, mirror, delta_of, whole)
    assert whole == [("small", delta_of)] and len(jobs) == 1  # all changed: the whole tensor is smaller
    full_of: dict = {}
    dense = planner.dense_jobs(specs, ["big"], mirror, full_of, object_bytes=4000)
    assert len(dense) == 3  # 10,000 B cut at 4,000 B
    pieces = [u for _, make, _ in dense for u in make()]
    assert [(off, u.spec.numel) for off, u in pieces] == [(0, 2000), (2000, 2000), (4000, 1000)]
    with pytest.raises(ValueError, match="whole tensors"):
        ObjectPlanner(get_codec("dense"), get_codec("dense"), max_object_bytes=1, max_workers=1)


def test_collective_on_one_rank_reduces_and_raises_the_failing_steps_own_error():
    coll = Collective(LOCAL)
    assert (coll.rank, coll.world, coll.local) == (0, 1, True)
    assert coll.reduce(lambda: 3, lambda xs: sum(xs) * 2, what="x") == 6

    def bad() -> int:
        raise TargetMismatchError("shard of 'w' is not contiguous")

    with pytest.raises(TargetMismatchError, match="not contiguous"):
        coll.reduce(bad, lambda xs: xs, what="x")

    def reduction_fails(xs: list) -> None:
        raise DeltaStoreError("rank 0 could not commit")

    with pytest.raises(DeltaStoreError, match="could not commit"):
        coll.reduce(lambda: 1, reduction_fails, what="x")


def _info(step: int) -> VersionInfo:
    return VersionInfo(step=step, kind="delta", changed=1, total=1, nbytes=1, digest=f"d{step}", created=0.0)


def test_background_writer_commits_in_order_and_fails_what_is_queued_behind_a_failure():
    written, committed = [], []
    gate = threading.Event()

    def write(step: int) -> VersionInfo:
        gate.wait(5)
        written.append(step)
        if step == 2:
            raise OSError("store went away")
        return _info(step)

    writer = BackgroundWriter(write, committed.append, max_pending=4)
    futures = {step: Future() for step in range(1, 5)}
    for step, fut in futures.items():
        writer.submit(step, step, fut)
    gate.set()
    writer.join()
    assert written == [1, 2] and committed == [1]  # 3 and 4 queued behind the failure: never written
    assert futures[1].result().step == 1
    with pytest.raises(OSError, match="went away"):
        futures[2].result()
    for step in (3, 4):
        with pytest.raises(RuntimeError, match=f"version {step} was dropped"):
            futures[step].result()
    assert isinstance(writer.take_error(), OSError) and writer.error is None
    again: Future[VersionInfo] = Future()
    writer.submit(5, 5, again)  # after the owner took the error, the writer writes again
    assert again.result(timeout=5).step == 5 and committed == [1, 5]
    assert writer.close() is None


def test_background_writer_blocks_the_submitter_at_max_pending_and_close_returns_an_untaken_error():
    gate = threading.Event()

    def write(step: int) -> VersionInfo:
        gate.wait(5)
        if step == 3:
            raise ValueError("bad version")
        return _info(step)

    writer = BackgroundWriter(write, lambda _: None, max_pending=1)
    writer.submit(1, 1, Future())  # taken by the thread, which waits at the gate
    time.sleep(0.05)
    writer.submit(2, 2, Future())  # fills the queue
    third = threading.Thread(target=writer.submit, args=(3, 3, Future()), daemon=True)
    third.start()
    third.join(0.2)
    assert third.is_alive()  # back-pressure: the third waits for room
    gate.set()
    third.join(5)
    assert not third.is_alive()
    assert isinstance(writer.close(), ValueError)


def test_resume_chain_rebuilds_the_mirror_and_the_head_the_writer_had():
    uri = f"memory://{uuid.uuid4().hex}"
    g = torch.Generator().manual_seed(3)
    s = {"a": torch.randn(4000, generator=g).bfloat16(), "b": torch.randn(300, generator=g).bfloat16()}
    with ds.Publisher(uri, anchor_every=100) as pub:
        for i in range(4):
            pub.publish(s, step=i)
            s = {k: (v.view(torch.int16) + (torch.arange(v.numel()) % (7 + i) == 0)).view(torch.bfloat16)
                 for k, v in s.items()}
        written = pub.head
        store = pub.store
        head = ChainHead(Every(100))
        got = resume_chain(store, head, 3, mirror_device=None, workers=2)
        assert (head.last, head.anchor, head.checksums) == (written.last, written.anchor, written.checksums)
        assert head.state.versions_since_anchor == written.state.versions_since_anchor == 3
        assert head.state.delta_bytes_since_anchor == written.state.delta_bytes_since_anchor
        assert head.state.anchor_bytes == written.state.anchor_bytes
        assert got.specs == pub._specs and got.aliases == {} and got.mirror.version == 3
        for name in got.specs:
            assert torch.equal(got.mirror.view(name), pub._mirror.view(name))


def test_write_version_commits_and_moves_the_head_or_leaves_both_as_they_were(monkeypatch):
    """The write stage alone, over stages opened as a Publisher opens them: an anchor, then a delta whose
    manifest another writer took first (VersionExistsError) leaves the mirror's bits and the head as they
    were, and the same capture is written once the step is free."""
    stages = PublishStages.open(f"memory://{uuid.uuid4().hex}", anchor_every=100)
    g = torch.Generator().manual_seed(5)
    first = {"a": torch.randn(3000, generator=g).bfloat16()}
    specs = {"a": TensorSpec("a", torch.bfloat16, (3000,))}
    mirror = Mirror.capture(first, specs, None)
    mirror.version = 0
    info = write_version(stages, Captured(0, specs, {}, mirror, None, time.time()), files={})
    assert info.kind == "anchor" and stages.head.last.step == 0
    bits = first["a"].view(torch.int16).clone()
    bits[::50] += 1
    second = {"a": bits.view(torch.bfloat16)}
    captured = Captured(1, specs, {}, mirror, mirror.diff(second, chunk_elems=1 << 20), time.time())
    before, head = mirror.view("a").clone(), (stages.head.last, dict(stages.head.checksums))
    real = stages.store.commit
    monkeypatch.setattr(stages.store, "commit", lambda m: (_ for _ in ()).throw(
        VersionExistsError("version 1 was committed by another writer")))
    with pytest.raises(VersionExistsError):
        write_version(stages, captured, files={})
    assert torch.equal(mirror.view("a"), before) and (stages.head.last, stages.head.checksums) == head
    monkeypatch.setattr(stages.store, "commit", real)
    info = write_version(stages, captured, files={})
    assert info.kind == "delta" and info.changed == 60 and stages.head.last.step == 1
    assert torch.equal(mirror.view("a"), bits)
    sub = ds.Subscriber(stages.store)
    assert torch.equal(sub.pull(None, step=1).state["a"].view(torch.int16), bits)
    stages.close()
