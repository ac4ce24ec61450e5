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


def _chain(seed, n):
    vs = [random_checkpoint(seed)]
    for i in range(1, n):
        vs.append(perturb(vs[-1], 0.05, seed * 100 + i))
    return vs


@pytest.mark.parametrize("path", ["sparse", "reload"])
def test_a_lagging_server_takes_each_delta_in_turn(tmp_path, monkeypatch, path):
    """Three deltas behind, each delta is staged against what the one before it wrote (no merged path), and
    the reload path reloads the changed groups once, at the end."""
    from deltastore.integrations.vllm import stage as stage_mod

    vs = _chain(21, 4)
    uri = str(tmp_path / "store")
    with ds.Publisher(uri, anchor_every=100) as pub:
        for step, ck in enumerate(vs):
            pub.publish(ck, step=step)
    reloads = []
    served = loaded_model(vs[0])

    def reload_fn(weights):
        items = list(weights)
        reloads.append([n for n, _ in items])
        with torch.no_grad():
            served.load_weights(items)
    ap = VllmApplier(served, None, reload_fn=reload_fn, path=path)
    ap.allow_cpu_sparse = True
    ap.pull(uri, 0)
    reloads.clear()
    pieces = []
    real = stage_mod.VersionReader.stage_each

    def counting(self, *a, **k):
        for st in real(self, *a, **k):
            pieces.append(st.versions_applied)
            yield st
    monkeypatch.setattr(stage_mod.VersionReader, "stage_each", counting)
    r = ap.pull(uri, 3)
    assert r["route"] == "delta" and r["versions_applied"] == [1, 2, 3] and pieces == [[1], [2], [3]]
    assert same_params(served, loaded_model(vs[3]))
    assert len(reloads) == (1 if path == "reload" else 0)
    assert ap.verify_local()["ok"] is True


@pytest.mark.parametrize("path", ["sparse", "reload"])
def test_a_lagging_server_whose_last_delta_fails_gets_every_delta_undone(tmp_path, monkeypatch, path):
    """A failure in the last of three deltas, after the first two were written (in place, or into the host
    mirror), puts back all of them: the engine keeps serving the version it had, bit for bit."""
    vs = _chain(22, 4)
    uri = str(tmp_path / "store")
    with ds.Publisher(uri, anchor_every=100) as pub:
        for step, ck in enumerate(vs):
            pub.publish(ck, step=step)
    served = loaded_model(vs[0])

    def reload_fn(weights):
        with torch.no_grad():
            served.load_weights(list(weights))
    ap = VllmApplier(served, None, reload_fn=reload_fn, path=path)
    ap.allow_cpu_sparse = True
    ap.pull(uri, 0)
    snap = snapshot(served)
    host = {n: t.clone() for n, t in (ap.host or {}).items()}
    real = VllmApplier._apply
    seen = []

    def failing_third(self, chosen, staged, log, names):
        seen.append(staged.ref.step)
        got = real(self, chosen, staged, log, names)
        if staged.ref.step == 3:
            raise RuntimeError("injected: the third delta fails after its write")
        return got
    monkeypatch.setattr(VllmApplier, "_apply", failing_third)
    with pytest.raises(ApplyError, match="injected") as ei:
        ap.pull(uri, 3)
    assert seen == [1, 2, 3] and ei.value.restored is True
    assert all(torch.equal(snap[n][1], bits(p)) for n, p in served.named_parameters())
    assert ap.describe()["step"] == 0
    assert all(torch.equal(host[n], ap.host[n]) for n in host)  # the host mirror is back too
    monkeypatch.undo()
    assert ap.pull(uri, 3)["versions_applied"] == [1, 2, 3] and same_params(served, loaded_model(vs[3]))
