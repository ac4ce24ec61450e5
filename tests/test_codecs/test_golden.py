"""Committed objects of every codec and format version decode to the committed bits forever.

A failure here means a codec's byte layout drifted: bump its format version
and add golden files for the new version (``make_golden.py``) instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from safetensors import safe_open

from deltastore.codecs import TensorSpec, get_codec

GOLDEN = Path(__file__).parent / "golden"
INDEX = json.loads((GOLDEN / "index.json").read_text())


def _expected(case):
    path = GOLDEN / f"{case}.expected.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    specs = []
    for name, v in sorted(meta.items()):
        dtype, shape = json.loads(v)
        specs.append(TensorSpec(name, getattr(torch, dtype), tuple(shape)))
    return specs, tensors


@pytest.mark.parametrize("entry", INDEX, ids=[e["file"] for e in INDEX])
def test_golden_decodes(entry):
    specs, t = _expected(entry["case"])
    codec = get_codec(entry["codec"])
    data = (GOLDEN / entry["file"]).read_bytes()
    out = codec.decode(data, specs, lambda n, p: t[n + ".old"] if p is None else t[n + ".old"][p])
    for s in specs:
        u = out[s.name]
        if codec.dense:
            full = t[s.name + ".old"].clone()
            full[t[s.name + ".positions"]] = t[s.name + ".bits"]
            assert torch.equal(u.bits, full), s.name
        else:
            assert torch.equal(u.positions, t[s.name + ".positions"]), s.name
            assert torch.equal(u.bits, t[s.name + ".bits"]), s.name


def test_every_codec_has_golden_files():
    ids = {e["codec"]["id"] for e in INDEX}
    assert {"raw", "zstd", "ulp", "ctx", "auto", "dense"} <= ids
    assert {e["codec"]["version"] for e in INDEX if e["codec"]["id"] == "dense"} == {"1.0", "2.0"}


@pytest.mark.parametrize("entry", [e for e in INDEX if e["codec"]["id"] in ("zstd", "ulp", "ctx", "dense")],
                         ids=lambda e: e["file"])
def test_encoder_still_writes_the_golden_bytes(entry):
    """Encoders are deterministic: same input, same bytes (catches silent layout changes)."""
    from .make_golden import cases
    from deltastore.codecs import Update

    ups = cases()[entry["case"]]
    codec = get_codec(entry["codec"])
    if codec.dense:
        full = []
        for u in ups:
            b = u.old_tensor.clone()
            b[u.positions] = u.bits
            full.append(Update(u.spec, b))
        ups = full
    from deltastore.codecs._common import unpack_meta

    # safetensors orders header metadata arbitrarily, so compare contents, not file bytes
    got_t, got_m = unpack_meta(codec.encode(ups), codec.codec_id)
    want_t, want_m = unpack_meta((GOLDEN / entry["file"]).read_bytes(), codec.codec_id)
    assert got_m == want_m and got_t.keys() == want_t.keys()
    from deltastore.tensors import bits_view
    assert all(torch.equal(bits_view(got_t[k]), bits_view(want_t[k])) for k in got_t)
