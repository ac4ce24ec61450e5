"""FP8 versions onto a vLLM-shaped block-FP8 model (weight + weight_scale_inv), without vLLM; bits compared."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import deltastore as ds
from deltastore.errors import TargetMismatchError
from deltastore.integrations.vllm import VllmApplier
from deltastore.integrations.vllm_fp8 import check_served, fp8_param_map, served_scheme
from deltastore.quantize import Fp8Block128
from deltastore.tensors import bits_view

from .fake_vllm_fp8_model import FakeVllmFp8Model, random_checkpoint
from .fake_vllm_model import FakeVllmModel, perturb


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    vs = [random_checkpoint(0)]
    for i in range(1, n):
        v = perturb(vs[-1], 0.05, seed=i)
        if i == 2:  # the largest element of one block grows: that block's scale (and bytes) move
            w = v["model.layers.1.mlp.gate_proj.weight"].clone()
            blk = w[:128, :128].float().abs()
            r, c = divmod(int(blk.argmax()), 128)
            w[r, c] = w[r, c] * 1.5
            v["model.layers.1.mlp.gate_proj.weight"] = w
        vs.append(v)
    return vs


def _loaded(state: dict[str, torch.Tensor]) -> FakeVllmFp8Model:
    """What the engine holds when vLLM loads the quantized checkpoint itself (the reference)."""
    m = FakeVllmFp8Model()
    q, _ = Fp8Block128().apply(state)
    with torch.no_grad():
        m.load_weights(q.items())
    return m


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(bits_view(pa[n]), bits_view(pb[n])) for n in pa)


def _publish(uri: str, vs: list[dict[str, torch.Tensor]], **kw) -> None:
    with ds.Publisher(uri, anchor_every=100, **kw) as pub:
        for step, v in enumerate(vs):
            pub.publish(v, step=step)


def test_map_puts_e4m3_weights_and_scales_where_the_loader_does(tmp_path):
    uri = str(tmp_path / "s")
    vs = _versions(1)
    _publish(uri, vs, quantize="fp8_block128")
    sub = ds.Subscriber(uri)
    m = sub.manifest(0)
    model = FakeVllmFp8Model()
    pmap = fp8_param_map(model, m)
    qkv = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    assert [(b.param, b.p_offset) for b in pmap.blocks[qkv]] == [("model.layers.0.qkv_proj.weight_scale_inv", 2 * 2)]
    state = sub.pull(step=0).state
    with torch.no_grad():
        for name, t in state.items():
            pmap.write_full(name, bits_view(t))
    assert _same(model, _loaded(vs[0]))
    assert model.model.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn


def test_applier_follows_fp8_versions_in_place_bit_exactly(tmp_path):
    uri = str(tmp_path / "s")
    vs = _versions(5)
    _publish(uri, vs, quantize="fp8_block128")
    sub = ds.Subscriber(uri)
    assert sub.manifest(2).tensor_map()["model.layers.1.mlp.gate_proj.weight_scale_inv"].changed == 1
    served = _loaded(random_checkpoint(7))
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    ap = VllmApplier(served, None, path="sparse")
    ap.allow_cpu_sparse = True
    check_served(sub.manifest(0), served)
    assert ap.pull(uri, 0)["route"] == "anchor"
    assert _same(served, _loaded(vs[0]))
    for step in range(1, len(vs)):
        r = ap.pull(uri, step)
        assert r["route"] == "delta" and r["path"] == "sparse"
        assert _same(served, _loaded(vs[step])), step
    assert ptrs == {n: p.data_ptr() for n, p in served.named_parameters()}  # in place: CUDA graphs stay valid
    assert ap.verify_local()["ok"] is True


def test_engine_and_version_must_share_the_scheme(tmp_path):
    fp8_uri, bf16_uri = str(tmp_path / "fp8"), str(tmp_path / "bf16")
    vs = _versions(1)
    _publish(fp8_uri, vs, quantize="fp8_block128")
    _publish(bf16_uri, vs)
    fp8_version, bf16_version = ds.Subscriber(fp8_uri).manifest(0), ds.Subscriber(bf16_uri).manifest(0)
    with pytest.raises(TargetMismatchError, match="holds fp8_block128 weights but the engine serves unquantized"):
        check_served(fp8_version, FakeVllmModel())  # a bf16 engine: its loader would cast e4m3 to bf16
    with pytest.raises(TargetMismatchError, match="holds unquantized weights but the engine serves fp8_block128"):
        fp8_param_map(FakeVllmFp8Model(), bf16_version)
    cfg = SimpleNamespace(model_config=SimpleNamespace(quantization="fp8"),
                          quant_config=SimpleNamespace(weight_block_size=[128, 128]))
    assert served_scheme(FakeVllmModel(), cfg) == "fp8_block128"
    cfg.quant_config.weight_block_size = None  # per-tensor FP8: another scheme
    with pytest.raises(TargetMismatchError, match="engine serves fp8 weights"):
        check_served(fp8_version, FakeVllmFp8Model(), cfg)
    assert served_scheme(FakeVllmFp8Model(), SimpleNamespace(model_config=SimpleNamespace(quantization=None))) is None
    online = SimpleNamespace(model_config=SimpleNamespace(quantization="fp8"),  # bf16 checkpoint quantized on load
                             quant_config=SimpleNamespace(weight_block_size=None, is_checkpoint_fp8_serialized=False))
    check_served(bf16_version, FakeVllmModel(), online)  # expects weights as trained: accepted
    with pytest.raises(TargetMismatchError):
        check_served(fp8_version, FakeVllmModel(), online)


def test_applier_refuses_a_version_of_another_scheme_before_touching_the_engine(tmp_path):
    uri = str(tmp_path / "fp8")
    _publish(uri, _versions(1), quantize="fp8_block128")
    served = FakeVllmModel()  # a bf16 engine
    before = {n: bits_view(p).clone() for n, p in served.named_parameters()}
    ap = VllmApplier(served, None, path="sparse")
    ap.allow_cpu_sparse = True
    with pytest.raises(TargetMismatchError, match="holds fp8_block128 weights"):
        ap.pull(uri, 0)
    assert all(torch.equal(bits_view(p), before[n]) for n, p in served.named_parameters())
