"""``auto`` stores a densely changed tensor whole. (Round trips of every codec, dtype, shape, density and edge
value: the conformance kit, ``test_conformance.py``.)"""

from __future__ import annotations

import json

import numpy as np
import torch

from deltastore.codecs import TensorSpec, get_codec
from deltastore.codecs._common import unpack_meta
from deltastore.testing.codecs import Change, check_roundtrip


def test_auto_picks_dense_for_a_dense_tensor():
    rng = np.random.default_rng(0)
    old = (torch.randn(10_000) * 0.02).to(torch.bfloat16).view(torch.int16)
    new = (torch.from_numpy(rng.standard_normal(10_000)) * 0.02).to(torch.bfloat16).view(torch.int16)
    data = check_roundtrip(get_codec("auto"), [Change.between(TensorSpec("w", torch.bfloat16, (10_000,)), old, new)])
    _, meta = unpack_meta(data, "auto")
    assert json.loads(meta["deltastore.auto.choice"]) == {"default": "dense", "other": {}}
