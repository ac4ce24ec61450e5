"""``fp8_block128``: 128x128 block-wise ``float8_e4m3fn`` weights with fp32 scales (DeepSeek/vLLM layout).

For a 2-D weight ``w`` of shape ``[rows, cols]`` and each block
``B = w[128i : 128(i+1), 128j : 128(j+1)]`` (edge blocks by their real extent),
computed in fp32:

* ``scale[i, j] = max(|B|) / 448`` (448 is the largest e4m3 value); a block of
  zeros gets ``scale = 1``;
* ``q[B] = (B.float() / scale[i, j]).to(torch.float8_e4m3fn)``.

The published tensors are ``<name>`` (e4m3, the weight's shape) and
``<name>_scale_inv`` (fp32, ``[ceil(rows/128), ceil(cols/128)]``, holding
``scale``: the factor that turns ``q`` back into ``w``, the name vLLM and
DeepSeek-V3 checkpoints use). A NaN or infinity in a block would make its
scale, and every value served from it, NaN: such a weight is refused
(:class:`~deltastore.errors.NonFiniteWeightError` naming the tensor and the block).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import NonFiniteWeightError, TargetMismatchError
from ..quantization import BLOCK, SCALE_SUFFIX, SCHEME, scale_shape

__all__ = ["FP8_MAX", "Fp8Block128", "default_rule", "dequantize_block128", "quantize_block128"]

FP8_MAX = 448.0
#: substrings (case-insensitive) that keep a ``.weight`` out of the default rule: not linear layers
EXCLUDE = ("embed", "lm_head", "norm")
#: elements quantized at once (whole row-blocks, at least one): the fp32 temporaries (~6 B/element) stay in cache
_CHUNK_ELEMS = 1 << 18

Rule = Callable[[str, torch.Tensor], bool]


def default_rule(name: str, t: torch.Tensor) -> bool:
    """The weights of linear layers: names ending in ``.weight`` without embed / lm_head / norm."""
    low = name.lower()
    return name.endswith(".weight") and not any(s in low for s in EXCLUDE)


def quantize_block128(w: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a 2-D floating tensor by the formula above, on ``w``'s device.

    Vectorised over a few row-blocks at a time (about ``_CHUNK_ELEMS``
    elements, so the temporaries stay in cache): per-row maxima of each column
    block, then of each block, then one broadcast division per chunk (whole
    column blocks as ``[rows, blocks, 128]``, the edge block apart). Operations
    stay on plain 2-D/3-D layouts (torch is 10-100x slower on the strided 4-D
    block view). ``torch.div`` promotes ``w`` to fp32 exactly, as
    ``w.float() / scale`` does. Raises :class:`TargetMismatchError` (a
    ``ValueError``) for a tensor that is not 2-D floating point and
    :class:`NonFiniteWeightError` (a ``ValueError``) naming ``name`` and the
    first block for a NaN or infinity, which would make the block's scale,
    and so every value served from it, NaN.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise TargetMismatchError(f"fp8_block128 quantizes 2-D floating tensors, {name!r} is "
                                  f"{w.dtype}{tuple(w.shape)}")
    w = w.contiguous()
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(scale_shape((rows, cols)), dtype=torch.float32, device=w.device)
    full_c = cols // BLOCK * BLOCK
    nfc = full_c // BLOCK
    per = max(1, _CHUNK_ELEMS // max(1, cols * BLOCK)) * BLOCK  # whole row-blocks per chunk
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        wc = w[r0:r1]
        s = _block_scales(wc)
        scale[r0 // BLOCK:r0 // BLOCK + s.shape[0]] = s
        srow = s.repeat_interleave(BLOCK, 0)[:r1 - r0]  # each row's scale per column block
        if nfc:
            q[r0:r1, :full_c].unflatten(1, (nfc, BLOCK)).copy_(
                torch.div(wc[:, :full_c].unflatten(1, (nfc, BLOCK)), srow[:, :nfc, None]))
        if full_c < cols:
            q[r0:r1, full_c:] = torch.div(wc[:, full_c:], srow[:, -1:])
    bad = ~torch.isfinite(scale)  # a block's scale is finite exactly when all its values are
    if bool(bad.any()):  # (one device sync per tensor)
        raise _non_finite(w, bad, name)
    return q, scale


def _non_finite(w: torch.Tensor, bad: torch.Tensor, name: str) -> NonFiniteWeightError:
    i, j = (int(x) for x in bad.nonzero()[0])
    rows, cols = w.shape
    r1, c1 = min(rows, (i + 1) * BLOCK), min(cols, (j + 1) * BLOCK)
    block = w[i * BLOCK:r1, j * BLOCK:c1]
    return NonFiniteWeightError(
        f"{name!r} holds non-finite values: block ({i}, {j}) (rows {i * BLOCK}-{r1 - 1}, columns {j * BLOCK}-"
        f"{c1 - 1}) has {int(block.isnan().sum())} NaN and {int(block.isinf().sum())} infinite value(s) "
        f"({int(bad.sum())} of {bad.numel()} blocks are affected); fp8_block128 would serve all "
        f"{block.numel()} values of such a block as NaN, so nothing is published")


def _block_scales(w: torch.Tensor) -> torch.Tensor:
    """fp32 scales of the blocks of ``w`` (contiguous rows; edge blocks by their real extent)."""
    rows, cols = w.shape
    nr, nc = scale_shape((rows, cols))
    full_c, full_r = cols // BLOCK * BLOCK, rows // BLOCK * BLOCK
    a = w.abs()  # exact: |x| and max are exact in any float dtype
    col_max = torch.empty((rows, nc), dtype=w.dtype, device=w.device)
    if full_c:
        col_max[:, :full_c // BLOCK] = a[:, :full_c].unflatten(1, (full_c // BLOCK, BLOCK)).amax(-1)
    if full_c < cols:
        col_max[:, -1] = a[:, full_c:].amax(-1)
    amax = torch.empty((nr, nc), dtype=w.dtype, device=w.device)
    if full_r:
        amax[:full_r // BLOCK] = col_max[:full_r].unflatten(0, (full_r // BLOCK, BLOCK)).amax(1)
    if full_r < rows:
        amax[-1] = col_max[full_r:].amax(0)
    amax = amax.float()
    return torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)


def dequantize_block128(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * scale`` per block in fp32, cast to ``dtype`` (what an FP8 kernel multiplies by)."""
    rows, cols = q.shape
    s = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (q.float() * s).to(dtype)


class Fp8Block128:
    """The ``fp8_block128`` quantizer of :class:`deltastore.Publisher` (``quantize="fp8_block128"``).

    Args:
        include: which 2-D floating tensors to quantize: None (the default rule:
            names ending in ``.weight`` containing none of embed / lm_head /
            norm, case-insensitive), a callable ``(name, tensor) -> bool``, or a
            list of ``fnmatch`` patterns matched against the full name.
    """

    scheme = SCHEME

    def __init__(self, include: Rule | Iterable[str] | None = None):
        if include is None:
            self.rule: Rule = default_rule
        elif callable(include):
            self.rule = include
        else:
            patterns = list(include)
            if not all(isinstance(p, str) for p in patterns):
                raise TypeError("include must be a callable or a list of name patterns (str)")
            self.rule = lambda name, t: any(fnmatch.fnmatchcase(name, p) for p in patterns)

    def apply(self, tensors: Mapping[str, torch.Tensor], aliases: dict[str, str] | None = None,
              cast: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], set[str]]:
        """Quantize the selected tensors of a normalised state.

        Returns the new state (``<name>`` replaced by its e4m3 tensor,
        ``<name>_scale_inv`` inserted after it, other tensors unchanged) and
        the set of names it produced (which a dtype cast must leave alone).
        Raises :class:`NonFiniteWeightError` for a tensor to quantize that holds NaN or infinity.
        ``cast``: quantize ``w.to(cast)`` (a Publisher's ``dtype``: the bits the
        trainer would publish unquantized). ``aliases`` (dropped -> kept) gains
        the scale of a quantized tensor's aliases. Raises
        :class:`TargetMismatchError` when a scale name is already taken.
        """
        out: dict[str, torch.Tensor] = {}
        produced: set[str] = set()
        for name, t in tensors.items():
            if t.dim() == 2 and t.is_floating_point() and t.dtype is not torch.float8_e4m3fn and self.rule(name, t):
                sname = name + SCALE_SUFFIX
                if sname in tensors:
                    raise TargetMismatchError(f"cannot quantize {name!r}: the state already has {sname!r}")
                w = t.detach()
                q, s = quantize_block128(w.to(cast) if cast is not None else w, name)
                out[name], out[sname] = q, s
                produced.update((name, sname))
            else:
                out[name] = t
        if aliases:
            for dropped, kept in list(aliases.items()):
                if kept in produced:
                    aliases[dropped + SCALE_SUFFIX] = kept + SCALE_SUFFIX
        return out, produced

    def record(self, specs: Mapping[str, Any]) -> dict[str, Any] | None:
        """The manifest's ``quantization`` field for a layout (``{name: TensorSpec}``), or None if nothing
        in it is quantized."""
        weights = sorted(n for n, s in specs.items()
                         if s.dtype is torch.float8_e4m3fn and n + SCALE_SUFFIX in specs)
        if not weights:
            return None
        return {"scheme": SCHEME, "block": [BLOCK, BLOCK], "scale_suffix": SCALE_SUFFIX, "weights": weights}
