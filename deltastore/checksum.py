"""Per-tensor checksum that both roles can update in O(changed elements).

``checksum(T) = sum over flat positions p of mix(key(name), p, bits(T[p])) mod 2**64``

``mix`` is the splitmix64 finaliser over ``p``, the element's raw bits and a
per-tensor key (the first 8 bytes of sha256 of the name). Because the sum is
over independent terms, changing elements P from old bits to new bits moves the
checksum by ``sum(mix(p, new)) - sum(mix(p, old))`` over P only: the publisher
and the applier update it from the changed elements, so verifying a 1 %-density
step costs 1 % of a full hash. It detects accidental corruption and drift, not
an adversary (objects are protected by sha256 for that).

Where it runs: a CPU tensor is read in place (by address, no copy, no view)
by the nogil kernels of :mod:`deltastore.kernels.checksum`, in parallel over
contiguous chunks (:func:`deltastore.kernels.parallel.chunked`) when large;
:func:`full_checksums` hashes many small tensors in one kernel call. A tensor
on another device (CUDA) is hashed on that device with int64 torch ops
(:func:`torch_mix_sum`), which wrap mod 2**64 and give the same value.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable

import numpy as np
import torch

from .errors import TargetMismatchError
from .kernels import checksum as _k
from .kernels.parallel import chunked
from .tensors import bits_view

_M64 = (1 << 64) - 1
_SIGNED_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: elements per thread chunk (below two of these a tensor is hashed inline, no thread hop)
_MIN_CHUNK = 1 << 18
#: elements per torch (device) pass: at most three int64 temporaries of this many elements (96 MiB) at once
_TORCH_CHUNK = 1 << 22


#: names whose keys are kept (a model's tensors, asked on every publish and pull; ~200 B each)
_KEYS_KEPT = 1 << 17


@functools.lru_cache(maxsize=_KEYS_KEPT)
def tensor_key(name: str) -> int:
    """The per-tensor key mixed into every element hash (a sha256 per name, kept for the last names asked)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def tensor_keys(names: Iterable[str], count: int = -1) -> np.ndarray:
    """:func:`tensor_key` of each of ``names`` (``count`` of them, when known), as ``uint64``."""
    return np.fromiter(map(tensor_key, names), dtype=np.uint64, count=count)


def _signed(c: np.uint64) -> int:
    v = int(c)
    return v - (1 << 64) if v >= 1 << 63 else v


_T1, _T2, _T3 = _signed(_k.C1), _signed(_k.C2), _signed(_k.C3)


def _xor_srl(x: torch.Tensor, s: int) -> None:
    """``x ^= x >>> s`` in place on int64 ``x`` (logical shift: torch's ``>>`` is arithmetic, so mask it)."""
    t = x >> s
    t &= (1 << (64 - s)) - 1
    x ^= t


def torch_mix_sum(key: int, positions: torch.Tensor | None, bits: torch.Tensor, start: int = 0) -> int:
    """``sum(mix(key, p, b))`` with torch int64 ops on ``bits``' own device (the path for CUDA tensors).

    ``bits``: any tensor, read as raw bits; ``positions``: int tensor of the
    same length, or None for the dense case (position of ``bits[i]`` is
    ``start + i``). Multiplication and addition of int64 wrap mod 2**64 and
    logical shifts are masked arithmetic ones, so the value is the kernels'
    bit for bit. Works on any device, including ``"cpu"`` (how it is tested).
    """
    b = bits.detach().reshape(-1)
    width = b.element_size()
    if b.dtype != _SIGNED_BITS[width] and b.dtype != torch.uint8:
        b = b.view(_SIGNED_BITS[width])
    mask = (1 << (8 * width)) - 1
    n = b.numel()
    if positions is not None and positions.numel() != n:
        raise ValueError(f"{positions.numel()} positions for {n} bits")
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    k = key - (1 << 64) if key >= 1 << 63 else key
    for i in range(0, n, _TORCH_CHUNK):
        j = min(n, i + _TORCH_CHUNK)
        if positions is None:
            x = torch.arange(start + i, start + j, dtype=torch.int64, device=b.device)
        else:
            x = positions.detach().reshape(-1)[i:j].to(device=b.device, dtype=torch.int64, copy=True)
        x *= _T1
        v = b[i:j].to(torch.int64)
        if width < 8:
            v &= mask
        x ^= v
        del v
        x += k
        _xor_srl(x, 30)
        x *= _T2
        _xor_srl(x, 27)
        x *= _T3
        _xor_srl(x, 31)
        total += x.sum()
    return int(total.item()) & _M64


def sparse_sum(key: int, positions: torch.Tensor, bits: torch.Tensor) -> int:
    """``sum(mix(key, p, b))`` over paired flat positions and raw bits (any device, int view).

    CPU tensors are hashed in place (by address) by the nogil kernel, in
    parallel chunks when large; when ``bits`` lives on another device the sum
    runs there (positions are moved to it). Raises ``ValueError`` when the
    lengths differ.
    """
    if bits.device.type != "cpu":
        return torch_mix_sum(key, positions, bits)
    n = bits.numel()
    if positions.numel() != n:
        raise ValueError(f"{positions.numel()} positions for {n} bits")
    if n == 0:
        return 0
    if positions.device.type != "cpu" or positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.detach().to("cpu", torch.int64).contiguous()
    if not bits.is_contiguous():
        bits = bits.contiguous()
    fn, paddr, baddr, k = _k.SPARSE_AT[bits.element_size()], positions.data_ptr(), bits.data_ptr(), np.uint64(key & _M64)
    if n < 2 * _MIN_CHUNK:
        return int(fn(paddr, baddr, 0, n, k))
    parts = chunked(n, lambda s, e: fn(paddr, baddr, s, e, k), min_chunk=_MIN_CHUNK)
    return sum(int(x) for x in parts) & _M64


def _dense_cpu(key: int, flat: torch.Tensor) -> int:
    """The dense sum of a contiguous CPU tensor, read in place (parallel chunks when large)."""
    n = flat.numel()
    if n == 0:
        return 0
    fn, addr, k = _k.DENSE_AT[flat.element_size()], flat.data_ptr(), np.uint64(key)
    if n < 2 * _MIN_CHUNK:
        return int(fn(addr, 0, n, k))
    parts = chunked(n, lambda s, e: fn(addr, s, e, k), min_chunk=_MIN_CHUNK)
    return sum(int(x) for x in parts) & _M64


def full_checksum(name: str, tensor: torch.Tensor) -> int:
    """Checksum of a whole tensor (``tensor`` may be a float tensor or its bit view).

    ``tensor`` must be contiguous (:class:`TargetMismatchError` otherwise). A CPU
    tensor is read in place, on every kernel thread; a CUDA tensor is hashed on
    its device.
    """
    if not tensor.is_contiguous():
        raise TargetMismatchError("tensor is not contiguous; deltastore needs contiguous tensors")
    key = tensor_key(name)
    if tensor.device.type != "cpu":
        return torch_mix_sum(key, None, bits_view(tensor))
    return _dense_cpu(key, tensor)


def full_checksums(items: Iterable[tuple[str, torch.Tensor]]) -> list[int]:
    """``[full_checksum(name, t) for name, t in items]``, with the per-tensor cost of many small tensors removed.

    Small CPU tensors of one element width are hashed in one kernel call per
    group of them (by address, in parallel over tensors); large ones and
    device tensors go through :func:`full_checksum`. Same values, same errors.
    """
    items = list(items)
    out = [0] * len(items)
    small: dict[int, list[tuple[int, int, int, int]]] = {}  # width -> (index, address, numel, key); items keeps them alive
    for i, (name, t) in enumerate(items):
        n = t.numel()
        if t.device.type != "cpu" or n >= 2 * _MIN_CHUNK:
            out[i] = full_checksum(name, t)
            continue
        if not t.is_contiguous():
            raise TargetMismatchError("tensor is not contiguous; deltastore needs contiguous tensors")
        if n:
            small.setdefault(t.element_size(), []).append((i, t.data_ptr(), n, tensor_key(name)))
    for width, rows in small.items():
        addrs = np.array([r[1] for r in rows], np.uint64)
        counts = np.array([r[2] for r in rows], np.int64)
        keys = np.array([r[3] for r in rows], np.uint64)
        sums = np.empty(len(rows), np.uint64)
        fn = _k.MANY[width]
        per = max(1, -(-int(counts.sum()) // max(1, len(rows))))  # mean size: ~_MIN_CHUNK elements per piece
        chunked(len(rows), lambda s, e: fn(addrs[s:e], counts[s:e], keys[s:e], sums[s:e]),
                min_chunk=max(1, _MIN_CHUNK // per))
        for r, v in zip(rows, sums.tolist()):
            out[r[0]] = v
    return out


def updated_checksum(name: str, before: int, positions: torch.Tensor, old_bits: torch.Tensor,
                     new_bits: torch.Tensor) -> int:
    """The checksum after the elements at ``positions`` changed from ``old_bits`` to ``new_bits``."""
    key = tensor_key(name)
    return (before - sparse_sum(key, positions, old_bits) + sparse_sum(key, positions, new_bits)) & _M64


def format_checksum(value: int) -> str:
    """Manifest form: 16 lowercase hex digits."""
    return f"{value:016x}"
