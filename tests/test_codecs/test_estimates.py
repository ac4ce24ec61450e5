"""The default size estimate and ``auto``'s per-tensor needs. (Each codec's estimate against what it writes, on
both runs of the trace: the conformance kit, ``test_conformance.py``.)"""

from __future__ import annotations

import torch

from deltastore.codecs import TensorSpec, get_codec


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
