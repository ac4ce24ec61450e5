"""Shared helpers for codec tests: build updates, round-trip, compare bits."""

from __future__ import annotations

import torch

from deltastore.codecs import Codec, TensorSpec, Update
from deltastore.tensors import bits_dtype

SPARSE = ["raw", "zstd", "ulp", "ctx", "auto"]
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def make_update(name: str, dtype: torch.dtype, shape: tuple[int, ...], old: torch.Tensor, new: torch.Tensor) -> Update:
    """Sparse update from two flat bit tensors of the same dtype (every field an encoder may read)."""
    pos = torch.ne(old, new).nonzero().squeeze(1)
    return Update(TensorSpec(name, dtype, shape), new[pos].clone(), pos, old[pos].clone(), old.clone())


def roundtrip(codec: Codec, updates: list[Update]) -> dict[str, Update]:
    olds = {u.spec.name: u.old_tensor for u in updates}

    def old(name: str, positions: torch.Tensor | None) -> torch.Tensor:
        return olds[name] if positions is None else olds[name][positions]

    return codec.decode(codec.encode(updates), [u.spec for u in updates], old)


def assert_same(updates: list[Update], decoded: dict[str, Update]) -> None:
    assert set(decoded) == {u.spec.name for u in updates}
    for u in updates:
        d = decoded[u.spec.name]
        assert d.positions is not None and d.positions.dtype == torch.int64
        assert torch.equal(d.positions, u.positions), u.spec.name
        assert d.bits.dtype == bits_dtype(u.spec.dtype)
        assert torch.equal(d.bits, u.bits), u.spec.name
