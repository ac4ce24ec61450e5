"""Per-tensor checksum that both roles can update in O(changed elements).

``checksum(T) = sum over flat positions p of mix(key(name), p, bits(T[p])) mod 2**64``

``mix`` is the splitmix64 finaliser over ``p``, the element's raw bits and a
per-tensor key (the first 8 bytes of sha256 of the name). Because the sum is
over independent terms, changing elements P from old bits to new bits moves the
checksum by ``sum(mix(p, new)) - sum(mix(p, old))`` over P only: the publisher
and the applier update it from the changed elements, so verifying a 1 %-density
step costs 1 % of a full hash. It detects accidental corruption and drift, not
an adversary (objects are protected by sha256 for that).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .tensors import bits_view

_M64 = (1 << 64) - 1
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_CHUNK = 1 << 22
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def tensor_key(name: str) -> int:
    """The per-tensor key mixed into every element hash."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def _mix_sum(key: int, positions: np.ndarray, bits: np.ndarray) -> int:
    x = positions.astype(np.uint64) * _C1
    x ^= bits.view(_UNSIGNED[bits.dtype.itemsize]).astype(np.uint64)
    x += np.uint64(key)
    x ^= x >> _S30
    x *= _C2
    x ^= x >> _S27
    x *= _C3
    x ^= x >> _S31
    return int(x.sum(dtype=np.uint64))


def sparse_sum(key: int, positions: torch.Tensor, bits: torch.Tensor) -> int:
    """``sum(mix(key, p, b))`` over paired flat positions and raw bits (any device, int view)."""
    pos = positions.detach().to("cpu", torch.int64).numpy()
    b = bits.detach().cpu().numpy()
    total = 0
    for i in range(0, pos.size, _CHUNK):
        total += _mix_sum(key, pos[i:i + _CHUNK], b[i:i + _CHUNK])
    return total & _M64


def full_checksum(name: str, tensor: torch.Tensor) -> int:
    """Checksum of a whole tensor (``tensor`` may be a float tensor or its bit view)."""
    flat = bits_view(tensor)
    key = tensor_key(name)
    total = 0
    for i in range(0, flat.numel(), _CHUNK):
        chunk = flat[i:i + _CHUNK].cpu().numpy()
        total += _mix_sum(key, np.arange(i, i + chunk.size, dtype=np.uint64), chunk)
    return total & _M64


def updated_checksum(name: str, before: int, positions: torch.Tensor, old_bits: torch.Tensor,
                     new_bits: torch.Tensor) -> int:
    """The checksum after the elements at ``positions`` changed from ``old_bits`` to ``new_bits``."""
    key = tensor_key(name)
    return (before - sparse_sum(key, positions, old_bits) + sparse_sum(key, positions, new_bits)) & _M64


def format_checksum(value: int) -> str:
    """Manifest form: 16 lowercase hex digits."""
    return f"{value:016x}"
