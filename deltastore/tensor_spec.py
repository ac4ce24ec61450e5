"""What a published tensor is (:class:`TensorSpec`) and the dtypes a manifest may name, without importing torch.

Reading a store (``deltastore ls``, ``inspect``, ``stats``, ``gc``, a manifest parse) needs names, dtype
names, shapes and element sizes, not tensors, so none of it imports torch (about a second of start-up).
A :class:`TensorSpec` made from a manifest holds its dtype's name and resolves the ``torch.dtype`` on
first read of :attr:`TensorSpec.dtype` (importing torch then); in a process that has imported torch
already, specs are made with the dtype resolved (:func:`spec_from_name`), so the hot paths read a
plain attribute as before.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: the dtypes that can be published, by their manifest name, with their element size in bytes
#: (:data:`deltastore.tensors.DTYPES` maps the same names to torch dtypes)
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2, "int32": 4,
    "int64": 8, "bool": 1, "float8_e4m3fn": 1,
}

_TORCH_DTYPES: dict[str, Any] | None = None


def torch_dtypes_if_loaded() -> dict[str, torch.dtype] | None:
    """:data:`deltastore.tensors.DTYPES` when torch is imported already (then it costs nothing), else None."""
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None and "torch" in sys.modules:
        from .tensors import DTYPES

        _TORCH_DTYPES = DTYPES
    return _TORCH_DTYPES


class _Numel:
    """``TensorSpec.numel``, the element count: worked out on first use and kept in the (frozen) instance's
    ``__dict__`` under the same name, where every later read finds it as a plain attribute, with no call
    (a non-data descriptor; a property would run on every read, and it is read per tensor on hot paths,
    often through a C-level ``operator.attrgetter``)."""

    def __get__(self, spec: TensorSpec | None, owner: type | None = None) -> Any:
        if spec is None:
            return self
        got = spec.__dict__["numel"] = math.prod(spec.shape)
        return got


class _Dtype:
    """``TensorSpec.dtype`` of a spec made from a dtype name (:func:`spec_from_name` before torch was
    imported): the ``torch.dtype``, looked up (importing torch) on first read and then kept in the
    instance's ``__dict__`` like :class:`_Numel`. A spec made by ``TensorSpec(name, dtype, shape)`` holds
    its dtype in ``__dict__`` from the start and never reaches this."""

    def __get__(self, spec: TensorSpec | None, owner: type | None = None) -> Any:
        if spec is None:
            return self
        from .tensors import DTYPES

        got = spec.__dict__["dtype"] = DTYPES[spec.__dict__["dtype_name"]]
        return got


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one published tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    numel = _Numel()  # the element count, an int (see _Numel); not a field

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements."""
        return self.numel * self.bits_dtype.itemsize

    @property
    def bits_dtype(self) -> torch.dtype:
        got = self.__dict__.get("_bits_dtype")
        if got is None:
            from .tensors import bits_dtype

            got = self.__dict__["_bits_dtype"] = bits_dtype(self.dtype)
        return got


TensorSpec.dtype = _Dtype()  # type: ignore[assignment]  # after @dataclass, so that dtype stays a field


def spec_from_name(name: str, dtype_name: str, shape: tuple[int, ...], numel: int,
                   torch_dtypes: dict[str, torch.dtype] | None) -> TensorSpec:
    """``TensorSpec(name, <the dtype named dtype_name>, shape)`` with its element count, made with one
    ``__dict__`` (not a frozen dataclass's per-field ``object.__setattr__``: made per tensor of every
    layout). ``torch_dtypes`` is :func:`torch_dtypes_if_loaded`'s answer (asked once per batch of specs):
    with it the dtype is resolved now, without it on first read. ``dtype_name`` must be a key of
    :data:`DTYPE_SIZES` (the caller checked it)."""
    got = TensorSpec.__new__(TensorSpec)
    fields = {"name": name, "dtype_name": dtype_name, "shape": shape, "numel": numel}
    if torch_dtypes is not None:
        fields["dtype"] = torch_dtypes[dtype_name]
    object.__setattr__(got, "__dict__", fields)
    return got
