"""Each codec's own size estimate (what the Publisher compares) stays near what it really writes."""

from __future__ import annotations

import itertools

import pytest
import torch

from deltastore.codecs import TensorSpec, Update, get_codec
from deltastore.tensors import bits_view


_CACHE: dict[str, list[Update]] = {}


def _updates(trace, step):
    key = f"{trace.run}:{step}" if hasattr(trace, "run") else f"{id(trace)}:{step}"
    if key in _CACHE:
        return _CACHE[key]
    states = [s for _, s in itertools.islice(trace.iter_states(), step + 1)]
    old, new = states[step - 1], states[step]
    ups = []
    for name, t in new.items():
        o, n = bits_view(old[name]), bits_view(t)
        pos = torch.ne(o, n).nonzero().squeeze(1)
        if pos.numel():
            ups.append(Update(TensorSpec(name, t.dtype, tuple(t.shape)), n[pos].clone(), pos, o[pos].clone(), o))
    _CACHE[key] = ups
    return ups


@pytest.mark.parametrize("cid", ["raw", "zstd", "ulp", "ctx", "auto"])
def test_estimate_is_within_a_factor_two(trace, cid):
    codec = get_codec(cid)
    ups = _updates(trace, 4)
    real = len(codec.encode(ups))
    estimate = sum(codec.estimate_size(u.spec, u.count) for u in ups)
    assert real / 2 <= estimate <= real * 2, (real, estimate)


def test_default_estimate_is_the_raw_layout():
    spec = TensorSpec("w", torch.bfloat16, (10, 10))
    assert get_codec("raw").estimate_size(spec, 7) == 7 * (2 + 4)
    assert get_codec("dense").estimate_size(spec, 0) == 200


def test_auto_asks_for_the_old_tensor_only_where_it_may_read_it():
    from deltastore.codecs.auto import AutoCodec
    big = TensorSpec("w", torch.bfloat16, (4096, 4096))
    fast = AutoCodec(link_mbps=1000.0)
    assert fast.needs_for(big, 1000) == "old_bits"              # ulp: old bits at the positions suffice
    assert fast.needs_for(big, big.numel // 2) == "old_tensor"  # dense part possible
    assert AutoCodec(link_mbps=None).needs_for(big, 1000) == "old_tensor"  # bytes first: ctx
    assert get_codec("ulp").needs_for(big, 1000) == "old_bits"
    assert get_codec("ctx").needs_for(big, 1000) == "old_tensor"
