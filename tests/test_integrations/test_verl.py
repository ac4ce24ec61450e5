"""The ``"deltastore"`` verl checkpoint-engine backend against the real ``verl`` package (0.9.1, PyPI).

verl finds the backend the way it does in training: ``import_external_libs``
of ``checkpoint_engine.custom_backend_module`` registers it, and
``CheckpointEngineRegistry.new(backend, bucket_size=..., **engine_kwargs)``
builds it, configured through verl's own ``CheckpointEngineConfig``. The test
then plays ``CheckpointEngineManager.update_weights``'s part without Ray
(verl's manager needs a Ray cluster and rollout replicas): prepare on every
worker, ``build_topology``, ``init_process_group`` with its kwargs, the actor
ranks' ``send_weights`` gathered with the rollout worker's ``receive_weights``,
``finalize``. The rollout side is a plain tensor dict; after every step it must
equal the actor's weights bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import require_module
from deltastore.testing import bits_equal

require_module("verl.checkpoint_engine.base")

from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.config import CheckpointEngineConfig  # noqa: E402

import deltastore as ds  # noqa: E402
from deltastore.errors import CorruptObjectError, UnsignedVersionError, VersionNotFoundError  # noqa: E402


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16)
            for i in range(3)} | {"model.norm.weight": torch.ones(32, dtype=torch.bfloat16)}


def _step(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in w.items():
        b = t.reshape(-1).view(torch.int16).clone()
        idx = torch.randint(0, b.numel(), (max(1, b.numel() // 50),), generator=g)
        b[idx] += 1
        out[n] = b.view(torch.bfloat16).reshape(t.shape)
    return out


def _engines(uri: str, actors: int = 2, rollouts: int = 1):
    cfg = CheckpointEngineConfig(backend="deltastore", custom_backend_module="deltastore.integrations.verl",
                                 engine_kwargs={"deltastore": {"uri": uri, "wait_s": 120, "anchor_every": 100}})
    import_external_libs(cfg.custom_backend_module)  # what CheckpointEngineWorker / Manager do
    cls = CheckpointEngineRegistry.get(cfg.backend)
    bucket = cfg.update_weights_bucket_megabytes << 20
    kwargs = cfg.engine_kwargs.get(cfg.backend, {})
    actor = [CheckpointEngineRegistry.new(cfg.backend, bucket_size=bucket, **kwargs) for _ in range(actors)]
    rollout = [CheckpointEngineRegistry.new(cfg.backend, bucket_size=bucket, **kwargs) for _ in range(rollouts)]
    metadata = [e.prepare() for e in actor + rollout]
    a_kw, r_kw = cls.build_topology(actors, rollouts, metadata)
    for group, kw in ((actor, a_kw), (rollout, r_kw)):
        assert all(len(v) == len(group) for v in kw.values())
        for i, e in enumerate(group):
            e.init_process_group(**{k: v[i] for k, v in kw.items()})
    return actor, rollout


def _update(actor, rollout, weights: dict[str, torch.Tensor], step: int) -> tuple[list, list[dict]]:
    async def receive(e):
        return {n: t.clone() for n, t in [x async for x in e.receive_weights(global_steps=step)]}

    async def run():
        sends = [e.send_weights(iter(list(weights.items())), global_steps=step) for e in actor]
        return await asyncio.gather(*sends, *[receive(e) for e in rollout])

    res = asyncio.run(run())
    for e in actor + rollout:
        e.finalize()
    return res[:len(actor)], res[len(actor):]


def test_verl_backend_moves_every_step_bit_exactly(tmp_path):
    uri = str(tmp_path / "store")
    actor, rollout = _engines(uri)
    assert type(actor[0]).__name__ == "DeltaStoreCheckpointEngine"
    w = _weights(0)
    kinds = []
    for step in range(1, 5):
        metrics, received = _update(actor, rollout, w, step)
        kinds.append(metrics[0]["deltastore/kind"])
        assert metrics[1] == {}  # only actor rank 0 publishes
        assert received[0].keys() == w.keys()
        assert bits_equal(received[0], w), step
        w = _step(w, step)
    assert kinds == ["anchor", "delta", "delta", "delta"]


def test_verl_backend_refuses_bad_versions_and_keeps_the_rollout_copy(tmp_path):
    uri = str(tmp_path / "store")
    actor, rollout = _engines(uri)
    w0 = _weights(1)
    _update(actor, rollout, w0, 1)
    with pytest.raises(ValueError, match="global_steps"):
        asyncio.run(actor[0].send_weights(iter(w0.items())))
    before = {n: t.clone() for n, t in rollout[0].state.items()}
    rollout[0].wait_s = 0.2

    async def drain(step):
        return [x async for x in rollout[0].receive_weights(global_steps=step)]
    with pytest.raises(VersionNotFoundError):
        asyncio.run(drain(7))
    w1 = _step(w0, 9)
    asyncio.run(actor[0].send_weights(iter(w1.items()), global_steps=2))
    from deltastore.store import object_key
    m = rollout[0].subscriber.manifest(2)
    for o in m.objects:
        p = tmp_path / "store" / object_key(o.digest)
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x5A
        p.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError):
        asyncio.run(drain(2))
    assert bits_equal(rollout[0].state, before)


def test_verl_rollout_refuses_unsigned_versions(tmp_path):
    from deltastore.integrations.verl import DeltaStoreCheckpointEngine
    from deltastore.signing import SigningKey

    key = SigningKey.generate()
    (tmp_path / "k").write_bytes(key.private_pem())
    (tmp_path / "k.pub").write_bytes(key.public.pem())
    uri = str(tmp_path / "s")
    actor = DeltaStoreCheckpointEngine(uri=uri, signing_key=str(tmp_path / "k"), anchor_every=10)
    rollout = DeltaStoreCheckpointEngine(uri=uri, trusted_keys=[str(tmp_path / "k.pub")], wait_s=5)
    rollout.init_process_group(role="rollout", rank=0)
    vs = []
    st = {"w": torch.randn(32, 32, generator=torch.Generator().manual_seed(3)).bfloat16()}
    for i in range(3):
        st = {"w": st["w"].clone()}
        st["w"][i, :4] += 1
        vs.append(st)

    async def drain(step):
        return {n: t.clone() async for n, t in rollout.receive_weights(global_steps=step)}

    asyncio.run(actor.send_weights(iter(vs[0].items()), global_steps=1))
    got = asyncio.run(drain(1))
    assert torch.equal(got["w"].view(torch.int16), vs[0]["w"].view(torch.int16))
    with ds.Publisher(uri) as pub:  # someone without the key commits version 2
        pub.publish(vs[1], step=2)
    before = rollout.state["w"].clone()
    with pytest.raises(UnsignedVersionError):  # refused before any object is fetched; the state kept
        asyncio.run(drain(2))
    assert torch.equal(rollout.state["w"].view(torch.int16), before.view(torch.int16))
