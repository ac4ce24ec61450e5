"""Every sparse codec is bit-exact on the real trace; ctx stays well below the independent-position bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deltastore.codecs import TensorSpec, Update, get_codec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def _step(tr, step):
    state = tr.state(step - 1)
    ups, changes = [], {}
    for name, (idx, bits) in tr.changes(step).items():
        old = state[name].contiguous().view(torch.int16).reshape(-1)
        spec = TensorSpec(name, torch.bfloat16, tuple(state[name].shape))
        ups.append(Update(spec, bits, idx, old[idx].clone(), old))
        changes[name] = (idx.numpy(), bits.numpy(), old[idx].numpy(), spec.shape, torch.bfloat16)
    return ups, changes


@pytest.mark.parametrize("step", [1, 3])
def test_trace_bit_exact_and_small(trace, step):
    import reference_encoders as ref

    ups, changes = _step(trace, step)
    olds = {u.spec.name: u.old_tensor for u in ups}
    sizes = {}
    for cid in ("raw", "zstd", "ulp", "ctx", "auto"):
        codec = get_codec(cid)
        data = codec.encode(ups)
        sizes[cid] = len(data)
        out = codec.decode(data, [u.spec for u in ups], lambda n, p: olds[n] if p is None else olds[n][p])
        for u in ups:
            assert torch.equal(out[u.spec.name].positions, u.positions)
            assert torch.equal(out[u.spec.name].bits.view(torch.int16), u.bits.view(torch.int16))
    bound = ref.independent_bound(changes)
    assert sizes["ctx"] <= 0.95 * bound
    assert sizes["ctx"] * 2.5 <= ref.pulse(changes)
    assert sizes["ctx"] * 4.5 <= ref.trl_raw(changes)
    assert sizes["ulp"] < sizes["zstd"]
