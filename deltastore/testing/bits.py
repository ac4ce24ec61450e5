"""Bit-exact comparison for tests: integer views, never ``allclose``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_equal(a: torch.Tensor | Mapping[str, torch.Tensor], b: torch.Tensor | Mapping[str, torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` hold the same bits: two tensors of one dtype and shape whose integer views are
    equal, or two mappings of such tensors under the same names. Any device; a tensor subclass is compared
    as the plain tensor it holds. NaN payloads and signed zeros count (no float compare is made)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same(a, b)
    return set(a) == set(b) and all(_same(a[k], b[k]) for k in b)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    x = a.detach().as_subclass(torch.Tensor).cpu()
    y = b.detach().as_subclass(torch.Tensor).cpu()
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    w = _INT[x.element_size()]
    return bool(torch.equal(x.contiguous().view(w), y.contiguous().view(w)))
