"""Inputs of the codec conformance kit (:mod:`deltastore.testing.codecs`): tensors' steps as raw bits.

A :class:`Change` is one tensor before and after a step; the builders here make the objects the kit
round-trips (:func:`edge_cases`, :func:`random_cases`, :func:`mixed_case`), the data a codec's size
estimate is held to (:func:`representative_changes`), and :func:`updates_for` turns changes into what a
Publisher hands a codec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs import Codec, TensorSpec, Update
from ..codecs.base import RECEIVER_NEEDS
from ..tensors import DTYPE_NAMES, DTYPES, bits_dtype

_NP_BITS = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
# float formats: (mantissa bits, has infinities); float8_e4m3fn has none, and one NaN pattern per sign
_FLOATS = {torch.bfloat16: (7, True), torch.float16: (10, True), torch.float32: (23, True),
           torch.float64: (52, True), torch.float8_e4m3fn: (3, False)}


@dataclass(frozen=True)
class Change:
    """One tensor's step: ``old`` its flat raw bits before (integer view), ``positions`` (int64, strictly
    increasing) where they changed, ``bits`` the new bits there."""

    spec: TensorSpec
    old: torch.Tensor
    positions: torch.Tensor
    bits: torch.Tensor

    @classmethod
    def between(cls, spec: TensorSpec, old: torch.Tensor, new: torch.Tensor) -> Change:
        """The change from flat bits ``old`` to ``new`` (same integer dtype and length)."""
        pos = torch.ne(old, new).nonzero().reshape(-1)
        return cls(spec, old, pos, new[pos].clone())

    def new(self) -> torch.Tensor:
        """The whole tensor after the step (flat raw bits)."""
        out = self.old.clone()
        out[self.positions] = self.bits
        return out


def edge_bits(dtype: torch.dtype) -> torch.Tensor:
    """Raw bit patterns (the dtype's integer view) of ``dtype``'s edge values.

    Floats: ±0, ±inf, NaNs with payloads (quiet, signalling, negative), the
    smallest and largest subnormals, the smallest normal, ±max, ±1. Integers:
    0, ±1, ±2, min, max and their neighbours; bool: False, True.
    """
    w = dtype.itemsize * 8
    if dtype == torch.bool:
        pats = [0, 1]
    elif dtype in _FLOATS:
        mant, has_inf = _FLOATS[dtype]
        sign, exp_all, mant_all = 1 << (w - 1), ((1 << (w - 1 - mant)) - 1) << mant, (1 << mant) - 1
        one = ((1 << (w - 2 - mant)) - 1) << mant
        nans = [exp_all | 1, exp_all | (1 << (mant - 1)), exp_all | mant_all, sign | exp_all | 3] if has_inf \
            else [exp_all | mant_all]
        top = exp_all - 1 if has_inf else (exp_all | mant_all) - 1
        pats = [0, 1, mant_all, 1 << mant, top, one] + ([exp_all] if has_inf else []) + nans
        pats += [p | sign for p in pats if p | sign not in pats]
    elif dtype == torch.uint8:
        pats = [0, 1, 2, 127, 128, 254, 255]
    else:  # signed integers
        lo, hi = -(1 << (w - 1)), (1 << (w - 1)) - 1
        pats = [0, 1, -1, 2, -2, hi, lo, hi - 1, lo + 1, int("55" * (w // 8), 16)]
    return _wrapped(pats, dtype)


def _wrapped(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Integers (any size) as ``dtype``'s raw bits, modulo the width."""
    w, b = dtype.itemsize * 8, bits_dtype(dtype)
    wrapped = [x % (1 << w) for x in values]
    if b != torch.uint8:  # signed views
        wrapped = [x - (1 << w) if x >= 1 << (w - 1) else x for x in wrapped]
    return torch.tensor(wrapped, dtype=b)


def _random_old(dtype: torch.dtype, n: int, rng: np.random.Generator, scale: float = 0.02) -> torch.Tensor:
    """``n`` plausible old values of ``dtype`` as raw bits: normal floats at ``scale``, integers over their
    whole range, bools 0/1."""
    b = bits_dtype(dtype)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n, dtype=np.uint8))
    if dtype.is_floating_point:
        return (torch.from_numpy(rng.standard_normal(n)) * scale).to(dtype).view(b).clone()
    return _random_bits(dtype, n, rng)


def _random_bits(dtype: torch.dtype, n: int, rng: np.random.Generator) -> torch.Tensor:
    """``n`` uniformly random bit patterns of ``dtype``'s width."""
    return torch.from_numpy(rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(_NP_BITS[bits_dtype(dtype)]))


def _stepped(dtype: torch.dtype, old: torch.Tensor, kind: str, rng: np.random.Generator) -> torch.Tensor:
    """New raw bits for ``old`` by ``kind``: ``ulp`` (±1..5 in the bits), ``big`` (up to ±2**(w-2)),
    ``sign`` (the top bit flipped: a sign crossing), ``edge`` (an edge pattern), ``random`` (any pattern);
    bool always flips. Wraps modulo the width."""
    n, w, b = old.numel(), dtype.itemsize * 8, bits_dtype(dtype)
    if dtype == torch.bool:
        return 1 - old
    o = old.numpy().astype(np.int64)
    if kind == "ulp":
        v = o + rng.choice([-5, -3, -2, -1, 1, 1, 2, 3], n)
    elif kind == "big":
        v = o + rng.integers(-(1 << (w - 2)), 1 << (w - 2), n, dtype=np.int64)  # wraps at 64 bits, as it should
    elif kind == "sign":
        v = o ^ np.int64(-(1 << 63) if w == 64 else 1 << (w - 1))
    elif kind == "edge":
        pats = edge_bits(dtype)
        return pats[torch.from_numpy(rng.integers(0, pats.numel(), n))]
    else:
        return _random_bits(dtype, n, rng)
    return torch.from_numpy(v.astype(_NP_BITS[b]))  # a C cast: modulo the width


KINDS = ("ulp", "big", "sign", "edge", "random")
SIZES = (0, 1, 2, 7, 100, 1000, 70_000)
DENSITIES = (0.0, 0.001, 0.01, 0.3, 0.7, 1.0)


def edge_cases(dtype: torch.dtype) -> dict[str, list[Change]]:
    """Named objects (lists of changes) of ``dtype``: ``transitions`` (every edge pattern to every other),
    ``steps`` (a 2-D tensor changed at both ends and throughout by every kind of step), ``shapes`` (empty,
    0-d, one-element, unchanged, one change, ends only, all changed, under unsorted names) and ``nothing``
    (an object in which nothing changed)."""
    rng = np.random.default_rng(sum(map(ord, DTYPE_NAMES[dtype])))
    b = bits_dtype(dtype)
    pats = edge_bits(dtype)
    k = pats.numel()
    out = {"transitions": [Change.between(TensorSpec("edges", dtype, (k * k,)), pats.repeat_interleave(k),
                                          pats.repeat(k))]}
    n = 17 * 241
    old = _random_old(dtype, n, rng)
    new = old.clone()
    where = np.sort(rng.choice(np.arange(1, n - 1), n // 10, replace=False))
    for i, kind in enumerate(KINDS):
        at = torch.from_numpy(where[i::len(KINDS)])
        new[at] = _stepped(dtype, old[at], kind, rng)
    ends = torch.tensor([0, n - 1])
    new[ends] = _stepped(dtype, old[ends], "ulp", rng)
    new[ends] = torch.where(new[ends] == old[ends], 1 - old[ends] if dtype == torch.bool else old[ends] + 1,
                            new[ends])
    out["steps"] = [Change.between(TensorSpec("layers.0.steps", dtype, (17, 241)), old, new)]

    def one(name: str, shape: tuple[int, ...], changed: Callable[[int], Any]) -> Change:
        numel = int(np.prod(shape, dtype=np.int64))
        o = _random_old(dtype, numel, rng)
        nw = o.clone()
        at = torch.as_tensor(changed(numel), dtype=torch.int64).reshape(-1)
        nw[at] = _stepped(dtype, o[at], "ulp", rng) if dtype != torch.bool else 1 - o[at]
        nw[at] = torch.where(nw[at] == o[at], o[at] ^ 1, nw[at])  # every chosen element really changes
        return Change.between(TensorSpec(name, dtype, shape), o, nw)

    out["shapes"] = [one("z.empty", (0,), lambda m: []), one("a.empty2d", (0, 3), lambda m: []),
                     one("m.scalar", (), lambda m: [0]), one("b.one", (1,), lambda m: [0]),
                     one("y.unchanged", (5, 7), lambda m: []), one("c.single", (64, 33), lambda m: [m // 2]),
                     one("x.ends", (64, 33), lambda m: [0, m - 1]), one("d.all", (37, 5), lambda m: range(m))]
    e = torch.zeros(0, dtype=b)
    same = _random_old(dtype, 300, rng)
    out["nothing"] = [Change.between(TensorSpec("same", dtype, (300,)), same, same.clone()),
                      Change.between(TensorSpec("empty", dtype, (0,)), e, e)]
    return out


def random_cases(dtype: torch.dtype, rounds: int = 8, seed: int = 0) -> Iterator[list[Change]]:
    """``rounds`` seeded random objects of ``dtype``, each of two tensors: the sizes of :data:`SIZES` and the
    step kinds of :data:`KINDS` in turn (every one within ``rounds >= 7``), a random density from
    :data:`DENSITIES`, flat or 2-D; the second tensor steps to the first's old values reversed."""
    rng = np.random.default_rng([seed, sum(map(ord, DTYPE_NAMES[dtype]))])
    first = int(rng.integers(len(SIZES)))
    for r in range(rounds):
        n, kind = SIZES[(first + r) % len(SIZES)], KINDS[(first + r) % len(KINDS)]
        density = float(rng.choice(DENSITIES))
        old = _random_old(dtype, n, rng, scale=float(rng.choice([1e-3, 0.02, 1.0, 1e4])))
        if dtype in _FLOATS and n and rng.random() < 0.5:  # edge values among the old ones
            pats = edge_bits(dtype)
            at = torch.from_numpy(rng.integers(0, n, min(n, pats.numel())))
            old[at] = pats[: at.numel()]
        new = old.clone()
        mask = torch.from_numpy(rng.random(n) < density)
        if int(mask.sum()):
            new[mask] = _stepped(dtype, old[mask], kind, rng)
        shape = (10, n // 10) if n >= 10 and n % 10 == 0 and rng.random() < 0.5 else (n,)
        yield [Change.between(TensorSpec("t.weight", dtype, shape), old, new),
               Change.between(TensorSpec("a.other", dtype, shape), old, old.flip(0))]


def mixed_case(seed: int = 1) -> list[Change]:
    """One object holding a changed tensor of every dtype, under names in no sorted order."""
    rng = np.random.default_rng(seed)
    out = []
    for i, dtype in enumerate(DTYPES.values()):
        n = 50 + 37 * i
        old = _random_old(dtype, n, rng)
        at = torch.from_numpy(np.sort(rng.choice(n, n // 4, replace=False)))
        new = old.clone()
        new[at] = _stepped(dtype, old[at], KINDS[i % len(KINDS)], rng)
        out.append(Change.between(TensorSpec(f"block.{(7 * i) % 11}.{DTYPE_NAMES[dtype]}", dtype, (n,)), old, new))
    return out


def representative_changes(seed: int = 0) -> list[Change]:
    """One optimizer step of the data deltastore is made for: bf16 weights ~N(0, 0.02) of which 0.5-3 %
    moved by 1-3 ulp (a few by more), and a norm vector of which a third moved."""
    rng = np.random.default_rng(seed)
    out = []
    for name, shape, density in (("layers.0.mlp.weight", (512, 384), 0.02), ("layers.0.attn.weight", (384, 384),
                                                                          0.005), ("layers.0.norm", (384,), 0.3)):
        n = int(np.prod(shape))
        old = _random_old(torch.bfloat16, n, rng)
        at = torch.from_numpy(np.sort(rng.choice(n, int(n * density), replace=False)))
        step = rng.choice([-3, -2, -1, -1, 1, 1, 2, 3, 40], at.numel())
        new = old.clone()
        new[at] = torch.from_numpy((old[at].numpy().astype(np.int64) + step).astype(np.int16))
        out.append(Change.between(TensorSpec(name, torch.bfloat16, shape), old, new))
    return out


def small_case(seed: int = 3) -> list[Change]:
    """A small object: bf16 weights (5,000) and an fp32 vector (300), 4 % of each moved by a few ulp."""
    rng = np.random.default_rng(seed)
    out = []
    for name, dtype, n in (("w", torch.bfloat16, 5000), ("b", torch.float32, 300)):
        old = _random_old(dtype, n, rng)
        at = torch.from_numpy(np.sort(rng.choice(n, n // 25, replace=False)))
        new = old.clone()
        new[at] = _stepped(dtype, old[at], "ulp", rng)
        out.append(Change.between(TensorSpec(name, dtype, (n,)), old, new))
    return out


def updates_for(codec: Codec, changes: Sequence[Change]) -> list[Update]:
    """What a Publisher hands ``codec`` for ``changes``: whole new tensors for a dense codec; else each
    tensor's positions, new and old bits, and its whole old tensor only where ``needs_for`` asks for it."""
    if codec.dense:
        return [Update(c.spec, c.new()) for c in changes]
    out = []
    for c in changes:
        need = codec.needs_for(c.spec, c.positions.numel())
        assert need in RECEIVER_NEEDS, f"needs_for({c.spec.name!r}) answered {need!r}, not one of {RECEIVER_NEEDS}"
        out.append(Update(c.spec, c.bits, c.positions, c.old[c.positions], c.old if need == "old_tensor" else None))
    return out


__all__ = ["DENSITIES", "KINDS", "SIZES", "Change", "edge_bits", "edge_cases", "mixed_case", "random_cases",
           "representative_changes", "small_case", "updates_for"]
