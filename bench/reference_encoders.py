"""Reference encodings of one step's changes, as peers store them, and the independent-position bound.

Each function takes ``changes`` = ``{name: (positions int64, new_bits, old_bits, shape, dtype)}``
and returns the bytes it would store. Sizes are of real serialisations
(safetensors files, zstd frames), measured in the same run as our codecs.

* :func:`trl_raw`: TRL bucket sync: ``<name>.indices`` int32 + ``<name>.values`` bf16 (6 B/element).
* :func:`trl_gap16`: TRL's later variant: gaps as uint16 + values; a gap above
  65535 is written as 65535 followed by the rest (a 65535 entry carries no value).
* :func:`pulse`: PULSE / grail: per tensor (row, col) positions, rows delta-coded,
  columns delta-coded within a row (reset at each new row), each stream cast to
  uint8 when it fits else uint16, all zstd level 1; new values raw.
* :func:`independent_bound`: per tensor ``numel * H(k / numel)`` bits for the
  positions (Shannon, positions independent and uniform) plus the order-0
  entropy of the ulp step over all changed elements of the step.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import zstandard
from safetensors.torch import save

from deltastore.codecs._bits import ordered


def trl_raw(changes) -> int:
    t = {}
    for name, (pos, new, _old, _shape, dtype) in changes.items():
        t[name + ".indices"] = torch.from_numpy(pos.astype(np.int32))
        t[name + ".values"] = torch.from_numpy(new).view(dtype)
    return len(save(t))


def _gap16(pos: np.ndarray) -> np.ndarray:
    gaps = np.diff(pos, prepend=0)
    reps = gaps // 65535
    out = np.repeat(np.minimum(gaps, 65535), 1)  # placeholder for the common case
    if reps.any():
        parts = []
        for g in gaps.tolist():
            while g > 65535:
                parts.append(65535)
                g -= 65535
            parts.append(g)
        out = np.array(parts)
    return out.astype(np.uint16)


def trl_gap16(changes) -> int:
    t = {}
    for name, (pos, new, _old, _shape, dtype) in changes.items():
        t[name + ".gaps"] = torch.from_numpy(_gap16(pos).view(np.int16))
        t[name + ".values"] = torch.from_numpy(new).view(dtype)
    return len(save(t))


def _narrow(a: np.ndarray) -> bytes:
    return (a.astype(np.uint8) if a.size == 0 or a.max() < 256 else a.astype(np.uint16)).tobytes()


def pulse(changes) -> int:
    streams, values = [], []
    for _name, (pos, new, _old, shape, _dtype) in changes.items():
        cols = shape[-1] if len(shape) >= 2 else max(1, int(np.prod(shape)) if shape else 1)
        r, c = pos // cols, pos % cols
        dr = np.diff(r, prepend=0)
        dc = np.where(dr == 0, np.diff(c, prepend=0), c)
        dc[0] = c[0] if c.size else 0
        streams += [_narrow(dr), _narrow(dc)]
        values.append(new.tobytes())
    z = zstandard.ZstdCompressor(level=1).compress(b"".join(streams))
    return len(z) + sum(len(v) for v in values) + 16 * len(changes)  # + a small per-tensor header


def _h(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def independent_bound(changes) -> float:
    bits = 0.0
    steps = []
    for _name, (pos, new, old, shape, dtype) in changes.items():
        n = int(np.prod(shape)) if shape else 1
        bits += n * _h(pos.size / n)
        f = dtype.is_floating_point
        steps.append(ordered(new, f) - ordered(old, f))
    d = np.concatenate(steps) if steps else np.zeros(0)
    if d.size:
        _, cnt = np.unique(d, return_counts=True)
        p = cnt / d.size
        bits += float(-(cnt * np.log2(p)).sum())
    return bits / 8
