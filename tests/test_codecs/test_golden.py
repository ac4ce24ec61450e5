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
    assert {e["codec"]["version"] for e in INDEX if e["codec"]["id"] == "dense"} == {"1.0", "2.0", "2.1"}


def _written_now(entry) -> bool:
    """The codec, configured as recorded, still writes this entry's format version (older ones are only read)."""
    return get_codec(entry["codec"]).describe()["version"] == entry["codec"]["version"]


def _contents(data: bytes, codec_id: str) -> dict:
    """An object's header metadata and each tensor's dtype, shape and bytes; the parts an ``auto`` object
    nests (``part.<codec>``, whole safetensors objects) unpacked the same way. safetensors writes header
    metadata in arbitrary order, so file bytes are not comparable, contents are."""
    from deltastore.codecs._common import unpack_meta

    tensors, meta = unpack_meta(data, codec_id)
    out: dict = {"__metadata__": meta}
    for k, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if codec_id == "auto" and k.startswith("part."):
            out[k] = _contents(raw, k.removeprefix("part."))
        else:
            out[k] = (str(t.dtype), tuple(t.shape), raw)
    return out


@pytest.mark.parametrize("entry", [e for e in INDEX if _written_now(e)], ids=lambda e: e["file"])
def test_encoder_still_writes_the_golden_bytes(entry):
    """Encoders are deterministic: same input, same contents (catches silent layout changes). Every codec,
    ``raw`` and ``auto`` (its choices and nested parts) included."""
    from .make_golden import cases, whole

    ups = cases()[entry["case"]]
    codec = get_codec(entry["codec"])
    got = _contents(codec.encode(whole(ups) if codec.dense else ups), codec.codec_id)
    want = _contents((GOLDEN / entry["file"]).read_bytes(), codec.codec_id)
    assert got == want


def test_byte_stability_covers_every_codec():
    checked = {e["codec"]["id"] for e in INDEX if _written_now(e)}
    assert {"raw", "zstd", "ulp", "ctx", "auto", "dense"} <= checked
