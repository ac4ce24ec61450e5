"""The applier's transaction on CPU tensors, without vLLM: the native path's NaN handling and read-back,
undo on a failed write, and a failed restore reported as ``ApplyError(restored=False)``.

vLLM's own ``load_checkpoint_weight_patches`` runs on the real engine in
``engine_check.py``; here it is replaced by loaders that misbehave on purpose
(write part of the patches then raise, write wrong bits) — the failures the
transaction must survive, which the real loader cannot be made to produce.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import deltastore as ds
from deltastore.errors import ApplyError
from deltastore.integrations.vllm import VllmApplier
from deltastore.integrations.vllm.mapping import ParamMap

from .fake_vllm_model import loaded_model, perturb, random_checkpoint
from .test_mapping import bits, same_params, snapshot

NORM = "model.layers.0.input_layernorm.weight"


class Patch(NamedTuple):  # the fields of vLLM's CheckpointWeightPatch
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None


def _with(ck, name, index, value_bits):
    t = ck[name].reshape(-1).clone().view(torch.int16)
    t[index] = value_bits - 0x10000 if value_bits >= 0x8000 else value_bits
    return dict(ck, **{name: t.view(torch.bfloat16).reshape(ck[name].shape)})


def _setup(tmp_path, versions):
    uri = str(tmp_path / "store")
    with ds.Publisher(uri, anchor_every=100) as pub:
        for step, ck in enumerate(versions):
            pub.publish(ck, step=step)
    served = loaded_model(versions[0])
    ap = VllmApplier(served, None)
    ap.allow_cpu_sparse = True
    ap.identify(uri, 0)
    return uri, served, ap


def _map_loader(ap, seen):
    """Writes each patch through the probed map, as vLLM's loader would (and records what it got)."""
    def load(model, patches):
        for p in patches:
            seen.append(p)
            ap.pmap.write(p.name, p.indices.cpu(), p.values.cpu().view(torch.int16))
        return {p.name for p in patches}
    return load


def test_native_path_lands_nan_values_bit_exactly(tmp_path):
    v0 = random_checkpoint(3)
    v1 = _with(_with(v0, NORM, 0, 0x7FC0), NORM, 3, 0xFFC1)  # two NaNs (one negative, with payload)
    v2 = perturb(_with(v1, NORM, 0, 0x3F80), 0.02, 5)
    uri, served, ap = _setup(tmp_path, [v0, v1, v2])
    seen: list = []
    ap.native = (Patch, _map_loader(ap, seen))
    r = ap.pull(uri, 1)
    assert r["path"] == "native" and r["route"] == "delta"
    assert all(not bool(torch.isnan(p.values).any()) for p in seen)  # vLLM's loader never sees a NaN
    assert same_params(served, loaded_model(v1))
    r = ap.pull(uri, 2)
    assert r["path"] == "native" and same_params(served, loaded_model(v2))
    assert ap.verify_local()["ok"] is True


def test_native_path_undoes_a_partial_write(tmp_path):
    v0 = random_checkpoint(4)
    uri, served, ap = _setup(tmp_path, [v0, perturb(v0, 0.05, 6)])
    writes: list = []

    def half_then_fail(model, patches):
        _map_loader(ap, writes)(model, patches[: len(patches) // 2])
        raise RuntimeError("loader died")
    ap.native = (Patch, half_then_fail)
    snap = snapshot(served)
    with pytest.raises(ApplyError) as ei:
        ap.pull(uri, 1)
    assert ei.value.restored is not False and "restored" in str(ei.value) and writes
    assert all(torch.equal(snap[n][1], bits(p)) for n, p in served.named_parameters())
    assert ap.describe()["step"] == 0


def test_native_path_refuses_a_loader_that_writes_other_bits(tmp_path):
    v0 = random_checkpoint(5)
    uri, served, ap = _setup(tmp_path, [v0, perturb(v0, 0.05, 7)])

    def off_by_one(model, patches):
        for p in patches:
            ap.pmap.write(p.name, p.indices, p.values.view(torch.int16) + 1)
    ap.native = (Patch, off_by_one)
    snap = snapshot(served)
    with pytest.raises(ApplyError, match="differently from the staged bits"):
        ap.pull(uri, 1)
    assert all(torch.equal(snap[n][1], bits(p)) for n, p in served.named_parameters())


def test_a_failed_restore_is_reported_and_the_version_becomes_unknown(tmp_path, monkeypatch):
    v0 = random_checkpoint(6)
    vs = [v0, perturb(v0, 0.05, 8), perturb(v0, 0.05, 9)]
    uri, served, ap = _setup(tmp_path, vs)

    def fail(model, patches):
        raise RuntimeError("loader died")
    ap.native = (Patch, fail)
    monkeypatch.setattr(ParamMap, "write", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no restore")))
    with pytest.raises(ApplyError, match="refused the restore") as ei:
        ap.pull(uri, 1)
    assert ei.value.restored is False
    assert ap.describe() is None  # unknown: the next pull must load an anchor
    monkeypatch.undo()
    ap.native = None
    r = ap.pull(uri, 2)
    assert r["route"] == "anchor" and same_params(served, loaded_model(vs[2]))


def test_reload_path_failed_restore_is_reported(tmp_path):
    v0 = random_checkpoint(7)
    uri = str(tmp_path / "store")
    with ds.Publisher(uri) as pub:
        pub.publish(v0, step=0)
        pub.publish(perturb(v0, 0.05, 10), step=1)
    calls = []

    def reload_fn(weights):
        calls.append([n for n, _ in weights])
        if len(calls) > 1:
            raise RuntimeError("reload failed")
    ap = VllmApplier(loaded_model(v0), None, reload_fn=reload_fn, path="reload")
    assert ap.pull(uri, 0)["route"] == "anchor"
    with pytest.raises(ApplyError, match="refused the restore") as ei:
        ap.pull(uri, 1)
    assert ei.value.restored is False and ap.describe() is None and len(calls) == 3
