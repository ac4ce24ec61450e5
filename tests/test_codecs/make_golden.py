"""Regenerate the golden codec objects: ``python tests/test_codecs/make_golden.py`` from the repo root.

Only run this when a codec's format version changes: add files for the new
version, never overwrite existing ones (old objects must stay decodable).
Each case is ``<codec>-<version>-<case>.bin`` (the encoded object) plus
``.expected.safetensors`` (specs' inputs and the expected decoded bits) and a
line in ``index.json`` with the codec record.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from deltastore.codecs import TensorSpec, Update, get_codec

GOLDEN = Path(__file__).parent / "golden"


def cases() -> dict[str, list[Update]]:
    """Small deterministic inputs: bf16 ulp steps, specials, fp32, fp16."""
    rng = np.random.default_rng(12345)
    out = {}
    old = (torch.from_numpy(rng.standard_normal(3000)) * 0.02).to(torch.bfloat16).view(torch.int16)
    new = old.clone()
    idx = torch.from_numpy(np.sort(rng.choice(3000, 90, replace=False)))
    new[idx] = new[idx] + torch.from_numpy(rng.choice([-2, -1, 1, 1, 3], 90).astype(np.int16))
    new[idx[:3]] = torch.tensor([0x7FC1, -32768, 0x0001], dtype=torch.int16)  # NaN payload, -0, subnormal
    o32 = torch.from_numpy(rng.standard_normal(500).astype(np.float32)).view(torch.int32)
    n32 = o32.clone()
    n32[::7] += 1
    o16 = torch.from_numpy(rng.standard_normal(64).astype(np.float16)).view(torch.int16)
    n16 = -o16.view(torch.float16)
    out["mixed"] = [_upd("bf.weight", torch.bfloat16, (30, 100), old, new),
                    _upd("f32.bias", torch.float32, (500,), o32, n32),
                    _upd("f16.scale", torch.float16, (8, 8), o16, n16.view(torch.int16))]
    return out


def whole(ups: list[Update]) -> list[Update]:
    """The cases' new tensors whole (what a dense codec encodes)."""
    out = []
    for u in ups:
        b = u.old_tensor.clone()
        b[u.positions] = u.bits
        out.append(Update(u.spec, b))
    return out


def _upd(name, dtype, shape, old, new):
    pos = torch.ne(old, new).nonzero().squeeze(1)
    return Update(TensorSpec(name, dtype, shape), new[pos].clone(), pos, old[pos].clone(), old.clone())


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    index_path = GOLDEN / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else []
    have = {e["file"] for e in index}
    records = [get_codec(c) for c in ("raw", "zstd", "ulp", "ctx")]
    # auto's default choice depends on the link rate and this machine's cores: pin it to bytes first
    records.append(get_codec({"id": "auto", "config": {"link_mbps": None}}))
    records.append(get_codec({"id": "dense", "config": {"planes": True, "chunk": 1000}}))
    records.append(get_codec("dense"))
    for name, ups in cases().items():
        for codec in records:
            rec = codec.describe()
            stem = f"{rec['id']}-{rec['version']}-{'planes-' if rec['config'].get('planes') else ''}{name}"
            if f"{stem}.bin" in have:
                continue
            data = codec.encode(whole(ups) if codec.dense else ups)
            (GOLDEN / f"{stem}.bin").write_bytes(data)
            index.append({"file": f"{stem}.bin", "codec": rec, "case": name})
        exp = {}
        for u in ups:
            exp[u.spec.name + ".old"] = u.old_tensor
            exp[u.spec.name + ".positions"] = u.positions
            exp[u.spec.name + ".bits"] = u.bits
        meta = {u.spec.name: json.dumps([str(u.spec.dtype).removeprefix("torch."), list(u.spec.shape)]) for u in ups}
        save_file(exp, str(GOLDEN / f"{name}.expected.safetensors"), metadata=meta)
    index_path.write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
