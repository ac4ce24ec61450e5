"""decode(encode(x)) is bit-exact for every codec, dtype, shape, density and special value."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore.codecs import TensorSpec, Update, get_codec
from deltastore.codecs._common import unpack_meta
from deltastore.tensors import bits_dtype

from .helpers import FLOATS, SPARSE, assert_same, make_update, roundtrip

_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _specials(dtype: torch.dtype) -> list[int]:
    """Raw bit patterns of ±0, ±inf, NaNs with payloads, subnormals, extremes."""
    w = torch.empty((), dtype=dtype).element_size() * 8
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]
    sign = 1 << (w - 1)
    exp_all = ((1 << (w - 1 - mant)) - 1) << mant
    pats = [0, sign, exp_all, exp_all | sign, exp_all | 1, exp_all | sign | 3, exp_all | (1 << (mant - 1)),
            1, sign | 1, (1 << mant) - 1, exp_all - 1, sign | (exp_all - 1), 1 << mant]
    return [p - (1 << w) if p >= sign else p for p in pats]


def _bits(dtype: torch.dtype, values: list[int]) -> torch.Tensor:
    return torch.tensor(np.array(values, dtype=np.int64).astype(_NP[torch.empty((), dtype=dtype).element_size()]))


@st.composite
def tensor_pair(draw, dtype):
    n = draw(st.sampled_from([0, 1, 2, 7, 100, 1000, 70_000]))
    seed = draw(st.integers(0, 2**31))
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.3, 0.7, 1.0]))
    rng = np.random.default_rng(seed)
    w = torch.empty((), dtype=dtype).element_size()
    base = (torch.randn(n, dtype=torch.float64) * draw(st.sampled_from([1e-3, 0.02, 1.0, 1e4]))).to(dtype)
    old = base.view(bits_dtype(dtype)).clone()
    is_float = dtype.is_floating_point
    if n and is_float and draw(st.booleans()):  # sprinkle special values into the old tensor
        sp = _bits(dtype, _specials(dtype))
        idx = torch.from_numpy(rng.integers(0, n, size=min(n, sp.numel())))
        old[idx] = sp[: idx.numel()]
    new = old.clone()
    mask = torch.from_numpy(rng.random(n) < density)
    k = int(mask.sum())
    kind = draw(st.sampled_from(["ulp", "big", "special", "random"] if is_float else ["ulp", "big", "random"]))
    o = old[mask].numpy().astype(np.int64)
    if kind == "ulp":
        step = rng.choice([-3, -2, -1, 1, 1, 1, 2, 5], size=k)
        v = o + step
    elif kind == "big":
        v = o + rng.integers(-(1 << (8 * w - 2)), 1 << (8 * w - 2), size=k)
    elif kind == "special":
        v = rng.choice(np.array(_specials(dtype)), size=k)
    else:
        v = rng.integers(-(1 << (8 * w - 1)), (1 << (8 * w - 1)) - 1, size=k, dtype=np.int64)
    new[mask] = torch.from_numpy(v.astype(np.int64).astype(_NP[w]))  # wraps: any pattern is fine
    shape = draw(st.sampled_from(["flat", "2d"])) if n else "flat"
    shp = (n,) if shape == "flat" or n < 10 else (10, n // 10)
    if shp != (n,) and 10 * (n // 10) != n:
        shp = (n,)
    return shp, old, new


@pytest.mark.parametrize("codec_id", SPARSE)
@pytest.mark.parametrize("dtype", FLOATS + [torch.int16, torch.uint8])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sparse_roundtrip_bit_exact(codec_id, dtype, data):
    shape, old, new = data.draw(tensor_pair(dtype))
    u = make_update("t.weight", dtype, shape, old, new)
    u2 = make_update("a.other", dtype, shape, old, old.flip(0) if old.numel() else old)
    ups = [u, u2]
    assert_same(ups, roundtrip(get_codec(codec_id), ups))


@pytest.mark.parametrize("codec_id", SPARSE)
@pytest.mark.parametrize("dtype", FLOATS)
def test_zero_dim_and_empty(codec_id, dtype):
    old0 = torch.tensor(1.5, dtype=dtype).reshape(1).view(bits_dtype(dtype))
    new0 = torch.tensor(-0.0, dtype=dtype).reshape(1).view(bits_dtype(dtype))
    e = torch.zeros(0, dtype=bits_dtype(dtype))
    ups = [make_update("scalar", dtype, (), old0, new0), make_update("empty", dtype, (0, 3), e, e),
           make_update("same", dtype, (1,), old0, old0.clone())]
    assert_same(ups, roundtrip(get_codec(codec_id), ups))


@pytest.mark.parametrize("codec_id", SPARSE)
def test_every_special_transition_bf16(codec_id):
    sp = _bits(torch.bfloat16, _specials(torch.bfloat16))
    old = sp.repeat_interleave(sp.numel())
    new = sp.repeat(sp.numel())
    u = make_update("x", torch.bfloat16, (old.numel(),), old, new)
    assert u.count > 0
    assert_same([u], roundtrip(get_codec(codec_id), [u]))


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32])
def test_dense_planes_roundtrip(dtype):
    rng = np.random.default_rng(0)
    w = torch.empty((), dtype=dtype).element_size()
    for n in (0, 1, 1000, 70_001):
        bits = torch.from_numpy(rng.integers(-(1 << (8 * w - 1)), (1 << (8 * w - 1)) - 1, size=n, dtype=np.int64)
                                .astype(_NP[w]))
        spec = TensorSpec("w", dtype, (n,))
        for codec in (get_codec("dense"), get_codec({"id": "dense", "version": "2.0",
                                                     "config": {"planes": True, "chunk": 4096}})):
            out = codec.decode(codec.encode([Update(spec, bits)]), [spec])
            assert torch.equal(out["w"].bits, bits)


def test_auto_picks_dense_for_a_dense_tensor():
    rng = np.random.default_rng(0)
    old = (torch.randn(10_000) * 0.02).to(torch.bfloat16).view(torch.int16)
    new = (torch.from_numpy(rng.standard_normal(10_000)) * 0.02).to(torch.bfloat16).view(torch.int16)
    u = make_update("w", torch.bfloat16, (10_000,), old, new)
    codec = get_codec("auto")
    data = codec.encode([u])
    _, meta = unpack_meta(data, "auto")
    assert json.loads(meta["deltastore.auto.choice"]) == {"default": "dense", "other": {}}
    assert_same([u], roundtrip(codec, [u]))
