"""bench/position_models.py: its per-tensor model plus zero-order steps is the independent-position bound of
bench/codecs.py (two implementations, one number), and a context never costs more than no context."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, _trace_module

sys.path.insert(0, str(ROOT / "bench"))

import position_models  # noqa: E402
import reference_encoders  # noqa: E402


@pytest.mark.parametrize("run", ["cold-lr1e-6", "dither-lr1e-5"])
def test_position_models_agree_with_the_bound(run):
    _trace_module()  # skips without the trace locally; fails under CI=true
    tr = position_models._trace.load(run)  # the loader the benchmark itself uses
    bits, changed, numel = position_models.measure(tr, range(3, 4))

    old = tr.state(2)
    changes = {}
    for name, (idx, new) in tr.changes(3).items():
        before = old[name].reshape(-1).view(torch.int16)[idx]
        changes[name] = (idx.numpy(), new.numpy(), before.numpy(), tuple(old[name].shape), torch.bfloat16)
    # tensors the step left alone cost nothing in either
    assert changed == sum(c[0].size for c in changes.values()) > 0
    assert numel == sum(t.numel() for t in old.values())
    assert (bits["tensor"] + bits["steps"]) / 8 == pytest.approx(reference_encoders.independent_bound(changes),
                                                                 rel=1e-9)
    for model in ("old exponent", "previous step", "block 16384"):
        assert 0 < bits[model]
    assert bits["old exponent"] < bits["tensor"]  # conditioning on a class: never above, here well below
    assert bits["previous step"] <= bits["tensor"] * (1 + 1e-12)
    assert 0 < bits["steps by exponent"] <= bits["steps"] * (1 + 1e-12)
    assert np.isfinite(list(bits.values())).all()
