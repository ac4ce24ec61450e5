"""FP8 served weights (``Publisher(quantize="fp8_block128")``): the formula, bit for bit, and refusals.

The reference below is a plain per-block loop written from the issue's formula,
independent of the vectorised quantizer in ``deltastore/quantize/fp8.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore.pull.materialize import materialize
from deltastore.errors import ManifestError, TargetMismatchError, UnsupportedFormatError
from deltastore.quantize.fp8 import Fp8Block128, dequantize_block128, quantize_block128
from deltastore.store import version_key

CODECS = ["raw", "zstd", "ulp", "ctx", "auto"]
#: a subset of the trace (all versions), to stay fast: two attention weights with edge blocks on both
#: axes (576 = 4.5 blocks, 192 = 1.5), a norm and an embedding slice (both published as bf16)
SUBSET = ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.k_proj.weight",
          "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight")


def reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The issue's formula, block by block."""
    rows, cols = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty((math.ceil(rows / 128), math.ceil(cols / 128)), dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            b = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float()
            amax = b.abs().max()
            s = torch.tensor(1.0) if amax == 0 else amax / 448
            scale[i, j] = s
            q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = (b / s).to(torch.float8_e4m3fn)
    return q, scale


def expected(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if t.dim() == 2 and name.endswith(".weight") and "embed" not in name:
            out[name], out[name + "_scale_inv"] = reference(t)
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (129, 130), (300, 64), (64, 300)])
def test_vectorised_quantizer_is_the_formula(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(torch.bfloat16)
    if shape[0] > 128:
        w[:128, :128] = 0  # a block of zeros: scale 1, zeros
        w[128:, :1] = -w[128:, :1].abs() * 1e4  # a block whose amax is a negative outlier
    q, s = quantize_block128(w)
    rq, rs = reference(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))
    if shape[0] > 128:
        assert s[0, 0] == 1 and not q[:128, :128].view(torch.uint8).any()
    assert not torch.isnan(q.float()).any()  # max |w| / scale lands on 448, never past it
    err = (dequantize_block128(q, s, torch.float32) - w.float()).abs()
    assert bool((err <= s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]] * 16).all())


def test_rules_default_callable_patterns():
    t = torch.ones(4, 4, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": t, "lm_head.weight": t, "model.layers.0.input_layernorm.weight": t,
             "model.layers.0.mlp.up_proj.weight": t, "model.layers.0.mlp.up_proj.bias": t[0],
             "model.layers.0.q_norm.weight": t, "model.layers.0.attn.o_proj.weight": t, "conv.weight": t[None]}
    out, produced = Fp8Block128().apply(state)
    assert produced == {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv",
                        "model.layers.0.attn.o_proj.weight", "model.layers.0.attn.o_proj.weight_scale_inv"}
    assert list(out)[3:5] == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv"]
    _, produced = Fp8Block128(include=["*.mlp.*"]).apply(state)
    assert produced == {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv"}
    _, produced = Fp8Block128(include=lambda n, t: n.startswith("lm_head")).apply(state)
    assert produced == {"lm_head.weight", "lm_head.weight_scale_inv"}
    with pytest.raises(TargetMismatchError, match="already has"):
        Fp8Block128().apply({"a.weight": t, "a.weight_scale_inv": t})


def _publish_all(tr, uris):
    pubs = {c: ds.Publisher(uri, codec=c, anchor_every=7, quantize="fp8_block128") for c, uri in uris.items()}
    want = {}
    for step, state in tr.iter_states():
        sub = {n: state[n] for n in SUBSET}
        sub["model.embed_tokens.weight"] = sub["model.embed_tokens.weight"][:256]
        want[step] = expected(sub)
        for pub in pubs.values():
            pub.publish(sub, step=step)
    for pub in pubs.values():
        pub.close()
    return want


def test_every_version_of_both_traces_through_every_codec(trace, tmp_path):
    uris = {c: f"memory://fp8-{c}-{tmp_path.name}" for c in CODECS}
    want = _publish_all(trace, uris)
    last = max(want)
    for codec, uri in uris.items():
        sub = ds.Subscriber(uri)
        follower = {n: torch.zeros_like(t) for n, t in want[0].items()}
        for step in sorted(want):
            res = sub.pull(follower, step=step)
            assert bits_equal(follower, want[step]), (codec, step)
            if step:
                assert res.versions_applied == [step]
            m = sub.manifest(step)
            assert m.quantization["scheme"] == "fp8_block128"
            assert m.quantization["weights"] == sorted(n for n in want[step] if n + "_scale_inv" in want[step])
            assert m.tensor_map()["model.layers.0.self_attn.o_proj.weight"].dtype == "float8_e4m3fn"
        assert bits_equal(sub.pull(step=last).state, want[last]), codec  # from the nearest anchor
        if codec != "raw":
            assert sub.manifest(1).object_bytes(sub.manifest(1).delta_objects) < \
                ds.Subscriber(uris["raw"]).manifest(1).object_bytes(ds.Subscriber(uris["raw"]).manifest(1).delta_objects)


def test_fp32_master_cast_then_quantized_and_resumed(tmp_path):
    g = torch.Generator().manual_seed(0)
    master = {"l.weight": torch.randn(200, 130, generator=g), "l.bias": torch.randn(200, generator=g)}
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, dtype=torch.bfloat16, quantize="fp8_block128") as pub:
        pub.publish(master, step=0)
    master["l.weight"] += 1e-2 * torch.randn(200, 130, generator=g)
    with ds.Publisher(uri, dtype=torch.bfloat16, quantize="fp8_block128") as pub:  # resumes the chain
        info = pub.publish(master, step=1)
    assert info.kind == "delta"
    got = ds.Subscriber(uri).pull(step=1).state
    q, s = reference(master["l.weight"].to(torch.bfloat16))
    assert got["l.bias"].dtype == torch.bfloat16 and got["l.weight_scale_inv"].dtype == torch.float32
    assert bits_equal(got, {"l.weight": q, "l.weight_scale_inv": s, "l.bias": master["l.bias"].to(torch.bfloat16)})


def _state():
    g = torch.Generator().manual_seed(1)
    return {"l.weight": torch.randn(130, 140, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(140, dtype=torch.bfloat16)}


def _tamper(uri: str, step: int, edit) -> None:
    store = ds.open_store(uri)
    doc = json.loads(store.backend.get(version_key(step)))
    edit(doc)
    store.backend.put(version_key(step), json.dumps(doc).encode(), mode="overwrite")


def test_reader_without_the_scheme_refuses(tmp_path):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, quantize="fp8_block128") as pub:
        pub.publish(_state(), step=0)
    _tamper(uri, 0, lambda d: d["quantization"].update(scheme="mxfp4_block32"))
    with pytest.raises(UnsupportedFormatError, match="mxfp4_block32"):
        ds.Subscriber(uri).pull(step=0)


def test_record_that_does_not_match_the_tensors_is_refused(tmp_path):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, quantize="fp8_block128") as pub:
        pub.publish(_state(), step=0)
    _tamper(uri, 0, lambda d: d["quantization"]["weights"].append("norm.weight"))
    with pytest.raises(ManifestError, match="norm.weight"):
        ds.Subscriber(uri).pull(step=0)


def test_reader_without_fp8_support_refuses_the_dtype(tmp_path, monkeypatch):
    """A deltastore from before FP8 has no ``float8_e4m3fn`` dtype: the manifest fails validation."""
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, quantize="fp8_block128") as pub:
        pub.publish(_state(), step=0)
    import deltastore.manifest as manifest_mod

    older = {k: v for k, v in manifest_mod.DTYPE_SIZES.items() if "float8" not in k}
    monkeypatch.setattr(manifest_mod, "DTYPE_SIZES", older)
    with pytest.raises(ManifestError, match="float8_e4m3fn"):
        ds.Subscriber(uri).pull(step=0)


def test_bf16_target_refuses_quantized_version_and_keeps_its_bits(tmp_path):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, quantize="fp8_block128") as pub:
        pub.publish(_state(), step=0)
    target = {n: t.clone() for n, t in _state().items()}
    before = {n: t.clone() for n, t in target.items()}
    with pytest.raises(TargetMismatchError, match="l.weight"):
        ds.Subscriber(uri).pull(target, step=0)
    assert bits_equal(target, before)


def test_unknown_scheme_name_is_refused_at_construction(tmp_path):
    with pytest.raises(UnsupportedFormatError, match="int4"):
        ds.Publisher(str(tmp_path / "s"), quantize="int4")


def test_materialized_fp8_folder_declares_its_quantization(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, quantize="fp8_block128", source_dir=src) as pub:
        pub.publish(_state(), step=0)
    out = tmp_path / "out"
    materialize(ds.open_store(uri), 0, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    q, s = reference(_state()["l.weight"])
    assert bits_equal(got, {"l.weight": q, "l.weight_scale_inv": s, "norm.weight": _state()["norm.weight"]})


def test_background_writer_and_tied_weights(tmp_path):
    """The pending overlay (background mode) on 1-byte and fp32 tensors; a tied quantized weight's scale is
    aliased too."""
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(300, 130, generator=g).to(torch.bfloat16)
    state = {"embed.weight": emb, "head.weight": emb, "l.weight": torch.randn(140, 260, generator=g).to(torch.bfloat16)}
    uri = str(tmp_path / "s")
    want = []
    with ds.Publisher(uri, background=True, quantize=Fp8Block128(include=["*.weight"])) as pub:
        for step in range(4):
            for n in ("embed.weight", "l.weight"):
                t = state[n].view(torch.int16)
                t[torch.randint(0, t.shape[0], (40,), generator=g), 7] += 1  # a few 1-ulp moves (a shared storage)
            want.append({n: reference(state[n]) for n in ("embed.weight", "l.weight")})
            pub.publish(state, step=step)
        pub.flush()
    sub = ds.Subscriber(uri)
    assert sub.manifest(0).aliases == {"head.weight": "embed.weight",
                                       "head.weight_scale_inv": "embed.weight_scale_inv"}
    for step, w in enumerate(want):
        got = sub.pull(step=step).state
        assert bits_equal(got, {k: v for n, (q, s) in w.items() for k, v in ((n, q), (n + "_scale_inv", s))}), step


def test_e4m3_bits_order_like_their_values_in_the_codecs():
    """ctx models e4m3 by magnitude: the ordered image of its uint8 bits follows the float order, both ways."""
    import numpy as np

    from deltastore.codecs import _bits as B

    bits = np.arange(256, dtype=np.uint8)
    o = B.ordered(bits, True)
    assert np.array_equal(B.unordered(o, np.uint8, True), bits)
    finite = (bits & 0x7F) != 0x7F  # 0x7F / 0xFF are NaN
    vals = torch.from_numpy(bits[finite].copy()).view(torch.float8_e4m3fn).float().numpy()
    ob = o[finite]
    order = np.lexsort((ob, vals))  # by value; -0 and +0 tie
    assert np.all(np.diff(ob[order]) > 0)
    with pytest.raises(ds.errors.CorruptObjectError):
        B.unordered(np.array([128]), np.uint8, True)


def test_ctx_round_trips_every_e4m3_pattern():
    g = torch.Generator().manual_seed(5)
    old = torch.randint(0, 256, (64, 300), generator=g, dtype=torch.uint8)
    new = old.clone()
    pos = torch.randperm(old.numel(), generator=g)[:3000].sort().values
    new.view(-1)[pos] = torch.randint(0, 256, (3000,), generator=g, dtype=torch.uint8)
    pos = pos[new.view(-1)[pos] != old.view(-1)[pos]]
    from deltastore.codecs import TensorSpec, Update, get_codec

    spec = TensorSpec("w", torch.float8_e4m3fn, (64, 300))
    for codec in (get_codec("ctx"), get_codec({"id": "ctx", "config": {"buckets": 16}})):
        data = codec.encode([Update(spec, new.view(-1)[pos].clone(), pos, old.view(-1)[pos].clone(), old.view(-1))])
        out = codec.decode(data, [spec], lambda n, p: old.view(-1) if p is None else old.view(-1)[p])["w"]
        assert torch.equal(out.positions, pos) and torch.equal(out.bits, new.view(-1)[pos])
