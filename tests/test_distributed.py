"""Sharded publishing over torch.distributed (gloo, CPU): identical to a single-process publish."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deltastore as ds
from conftest import chain_states
from deltastore.testing import bits_equal
from deltastore.publish.sharded import ShardedPublisher
from deltastore.errors import TargetMismatchError
from deltastore.publish.anchors import Adaptive
from deltastore.publish.collective import LOCAL, CollectiveError
from deltastore.pull.verify import verify_store


def _states(n=6, seed=0):  # rows of "emb" do not split evenly; "norm" is replicated on every rank
    return chain_states(n, {"emb": (37, 16), "w": (64, 24), "norm": (16,)}, changes=0.03, every_step={3: 0.5},
                        seed=seed)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, uri, mode, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pub = ShardedPublisher(uri, **kwargs)
        mesh = None
        if mode == "dtensor":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
        for step, state in enumerate(_states()):
            if mode == "dtensor":
                from torch.distributed.tensor import Replicate, Shard, distribute_tensor

                shards = {"emb": distribute_tensor(state["emb"], mesh, [Shard(0)]),
                          "w": distribute_tensor(state["w"], mesh, [Shard(0)]),
                          "norm": distribute_tensor(state["norm"], mesh, [Replicate()])}
            else:
                shards = []
                for name in ("emb", "w"):
                    rows = state[name].chunk(world)[rank] if rank < len(state[name].chunk(world)) else None
                    if rows is None:
                        continue
                    row0 = sum(c.shape[0] for c in state[name].chunk(world)[:rank])
                    shards.append((name, rows.contiguous(), row0 * state[name].shape[1], tuple(state[name].shape)))
                shards.append(("norm", state["norm"], 0))
            if mode == "bad" and step == 2:  # rank 1 hands a non-contiguous shard: every rank must fail
                if rank == 1:
                    shards[0] = (shards[0][0], shards[0][1].t(), *shards[0][2:])
                with pytest.raises(Exception) as err:
                    pub.publish(shards, step=step)
                if rank == 1:
                    assert isinstance(err.value, TargetMismatchError), err.value
                else:
                    assert isinstance(err.value, CollectiveError) and "rank 1: TargetMismatchError" in str(err.value)
                assert pub.store.latest() == 1  # nothing committed
                if rank == 1:
                    shards[0] = (shards[0][0], shards[0][1].t().contiguous(), *shards[0][2:])
            info = pub.publish(shards, step=step)
            assert info.step == step
        pub.close()
        # Every rank reaches the end before any tears down: rank 0 hosts the TCPStore, and a rank still
        # inside gloo when it leaves was seen to abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world, uri, mode="plain", **kwargs):
    mp.start_processes(_rank_main, args=(world, _free_port(), uri, mode, kwargs), nprocs=world, join=True,
                       start_method="spawn")


@pytest.mark.slow
@pytest.mark.parametrize("world, mode", [(2, "plain"), (4, "plain"), (2, "dtensor"), (4, "dtensor")])
def test_sharded_publish_equals_single_process(tmp_path, world, mode):
    sharded, single = str(tmp_path / "sharded"), str(tmp_path / "single")
    _run(world, sharded, mode, anchor_every=3, codec="auto")
    states = _states()
    with ds.Publisher(single, anchor_every=3, codec="auto") as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    a, b = ds.Subscriber(sharded), ds.Subscriber(single)
    assert a.versions() == b.versions() == list(range(6))
    follower = a.pull(step=0).state
    for i, s in enumerate(states):
        ma, mb = a.manifest(i), b.manifest(i)
        assert ma.kind == mb.kind
        assert sorted((t.name, t.changed, t.checksum) for t in ma.tensors) == sorted(
            (t.name, t.changed, t.checksum) for t in mb.tensors)
        assert bits_equal(a.pull(step=i).state, s)
        a.pull(follower, step=i)
        assert bits_equal(follower, s)
    full_parts = a.manifest(0).tensor_map()["w"].full
    assert len(full_parts) == world  # every rank uploaded its own slice
    assert verify_store(ds.open_store(sharded)).ok


@pytest.mark.slow
def test_sharded_adaptive_policy_with_differentials(tmp_path):
    uri = str(tmp_path / "s")
    _run(2, uri, "plain", anchor=Adaptive(differential_gain=0.2, budget=10.0))
    sub = ds.Subscriber(uri)
    states = _states()
    assert any(sub.manifest(i).differential is not None for i in sub.versions())
    for i, s in enumerate(states):
        assert bits_equal(sub.pull(step=i).state, s)


@pytest.mark.slow
def test_a_failing_rank_fails_the_version_on_every_rank_and_the_next_try_commits(tmp_path):
    uri = str(tmp_path / "s")
    _run(2, uri, "bad", anchor_every=3)  # the assertions run in the ranks: a failed one fails the spawn
    sub = ds.Subscriber(uri)
    assert sub.versions() == list(range(6))
    for i, s in enumerate(_states()):
        assert bits_equal(sub.pull(step=i).state, s)


@pytest.mark.parametrize("policy", [{"anchor_every": 3}, {"anchor": Adaptive(differential_gain=0.2,
                                                                                          budget=10.0)}])
def test_one_rank_without_a_process_group_runs_the_same_code_and_matches_a_publisher(tmp_path, policy):
    """No init_process_group (and ``group=LOCAL``): the Collective is this process alone; the versions equal
    a Publisher's, tensor for tensor, and the chain decisions are the same."""
    sharded, single = str(tmp_path / "sharded"), str(tmp_path / "single")
    states = _states()
    with ShardedPublisher(sharded, group=LOCAL, codec="auto", **policy) as spub, \
            ds.Publisher(single, codec="auto", **policy) as pub:
        assert (spub.rank, spub.world) == (0, 1)
        for i, s in enumerate(states):
            a = spub.publish(s, step=i)
            b = pub.publish(s, step=i)
            assert (a.kind, a.changed, a.total, a.differential) == (b.kind, b.changed, b.total, b.differential)
        for bad, error in ((2, ds.errors.VersionExistsError), (-1, ds.errors.StepOrderError)):
            with pytest.raises(error):
                spub.publish(states[-1], step=bad)
    a, b = ds.Subscriber(sharded), ds.Subscriber(single)
    for i, s in enumerate(states):
        ma, mb = a.manifest(i), b.manifest(i)
        assert (ma.kind, ma.differential is None) == (mb.kind, mb.differential is None)
        assert sorted((t.name, t.changed, t.checksum) for t in ma.tensors) == sorted(
            (t.name, t.changed, t.checksum) for t in mb.tensors)
        assert bits_equal(a.pull(step=i).state, s)
    if "anchor" in policy:
        assert any(a.manifest(i).differential is not None for i in a.versions())


@pytest.mark.parametrize("kwargs, match", [
    ({"background": True}, "background"),
    ({"max_pending": 4}, "background"),
    ({"resume": True}, "resume"),
    ({"quantize": "fp8_block128"}, "quantize"),
    ({"adapter_only": True}, "adapters"),
])
def test_publisher_arguments_a_sharded_publisher_cannot_honour_are_refused(tmp_path, kwargs, match):
    """Accepted and ignored, these would publish something else than asked (unquantized weights, say)."""
    with pytest.raises(ValueError, match=match):
        ShardedPublisher(str(tmp_path / "s"), group=LOCAL, **kwargs)
    assert not (tmp_path / "s").exists()  # refused before the store is opened


def test_a_sharded_publisher_takes_the_publisher_configuration(tmp_path):
    meta = {"run": "r1"}
    with ShardedPublisher(str(tmp_path / "s"), group=LOCAL, metadata=meta, anchor_every=7, resume=False,
                          background=False) as pub:
        pub.publish([("w", torch.arange(8, dtype=torch.bfloat16), 0)], step=0)
    m = ds.Subscriber(str(tmp_path / "s")).manifest(0)
    assert m.metadata == meta and m.kind == "anchor"
    with pytest.raises(TypeError):
        ShardedPublisher(str(tmp_path / "t"), group=LOCAL, not_an_argument=1)
