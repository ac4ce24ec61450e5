"""Tensor plumbing shared by both roles: dtype names, bit views, state normalisation."""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import torch

from .errors import DeviceUnavailableError, TargetMismatchError

#: dtypes that can be published, by their manifest name.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,  # FP8 served weights (deltastore.quantize)
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Same-width integer dtype used to compare and move raw bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

StateLike = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of ``dtype``; raises :class:`TargetMismatchError` for an unsupported one."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TargetMismatchError(f"unsupported dtype {dtype}; supported: {sorted(DTYPES)}") from None


def available_device(device: str | torch.device, what: str = "device") -> torch.device:
    """``torch.device(device)`` when this process can place tensors there.

    Raises :class:`DeviceUnavailableError` naming ``what`` (the argument) and the devices there are when
    ``device`` is not a device (``"cuda0"``), when torch has no CUDA or no GPU is visible (``"cuda"``), or
    when the index is past the last GPU (``"cuda:3"`` with two).
    """
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceUnavailableError(f"{what}={device!r} is not a device ({e})") from None
    if d.type in ("cpu", "meta"):
        return d
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this torch has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DeviceUnavailableError(f"{what}={device!r}: {why} (CUDA_VISIBLE_DEVICES="
                                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use 'cpu'")
        if d.index is not None and d.index >= count:
            raise DeviceUnavailableError(f"{what}={device!r}: this process sees {count} CUDA device(s), "
                                         f"cuda:0 to cuda:{count - 1}")
        return d
    try:  # another accelerator type (xpu, mps, ...): it is there when a tensor can be made on it
        torch.empty(0, device=d)
    except (AssertionError, RuntimeError, NotImplementedError) as e:
        reason = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:160]
        raise DeviceUnavailableError(f"{what}={device!r}: not available in this process "
                                     f"({type(e).__name__}: {reason}); use 'cpu'") from None
    return d


_BITS_OF: dict[torch.dtype, torch.dtype] = {}


def published_dtype(t: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` is published in: ``cast`` (a Publisher's ``dtype=``) for a floating-point tensor, else
    its own."""
    return cast if cast is not None and t.is_floating_point() else t.dtype


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype with the same element size as ``dtype``."""
    b = _BITS_OF.get(dtype)
    if b is None:
        b = _BITS_OF[dtype] = _BITS[dtype.itemsize]
    return b


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view sharing ``t``'s storage (``t`` must be contiguous)."""
    if not t.is_contiguous():
        raise TargetMismatchError("tensor is not contiguous; deltastore needs contiguous tensors")
    flat = (t.detach() if t.requires_grad else t).reshape(-1)  # detach costs a microsecond a tensor
    b = bits_dtype(t.dtype)
    return flat if flat.dtype is b else flat.view(b)


def named_tensors(state: StateLike, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Normalise a Module, a mapping or an iterable of ``(name, tensor)`` to an ordered dict.

    For a Module this is its ``state_dict`` (parameters and persistent buffers)
    as live tensors. Entries that alias an earlier entry (same storage, offset,
    shape and dtype: tied weights) are dropped, so each storage is published and
    written once; when ``aliases`` is given it receives ``dropped -> kept`` names.
    """
    if isinstance(state, torch.nn.Module):
        items: Iterable[tuple[str, Any]] = state.state_dict(keep_vars=True).items()
    elif isinstance(state, Mapping):
        plain = _distinct_tensors(state)
        if plain is not None:
            return plain
        items = state.items()
    else:
        items = map(check_item, state)
    out: dict[str, torch.Tensor] = {}
    # by address first (one call a tensor); layouts are compared only at an address two tensors share
    first: dict[int, tuple[str, torch.Tensor | None]] = {}
    keyed: dict[tuple[Any, ...], str] = {}
    for name, t in items:
        if not isinstance(name, str):
            raise TargetMismatchError(f"tensor names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TargetMismatchError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if name in out:
            raise TargetMismatchError(f"duplicate tensor name {name!r}")
        out[name] = t
        ptr = t.data_ptr()
        if ptr == 0 and t.is_meta:  # (only tensors without storage have address 0)
            raise TargetMismatchError(f"{name!r} is a meta tensor (no data): materialize the model first")
        if t.numel() == 0:  # no elements: never an alias
            continue
        got = first.get(ptr)
        if got is None:
            first[ptr] = (name, t)
            continue
        kept_name, kept = got
        if kept is not None:  # the second tensor at this address: the first one's layout is keyed now
            keyed.setdefault(_layout_key(kept), kept_name)
            first[ptr] = (kept_name, None)
        # same address, layout, dtype and device: the same elements (tied weights)
        alias = _layout_key(t)
        kept_name = keyed.get(alias)  # type: ignore[assignment]
        if kept_name is not None:
            del out[name]
            if aliases is not None:
                aliases[name] = kept_name
            continue
        keyed[alias] = name
    return out


def check_item(item: Any) -> tuple[str, torch.Tensor]:
    """``item`` as a ``(name, tensor)`` pair; :class:`TargetMismatchError` unless it is one (a string name, a
    tensor with storage)."""
    try:
        name, t = item
    except (TypeError, ValueError):
        raise TargetMismatchError(f"a published item must be a (name, tensor) pair, got {_short(item)}") from None
    if not isinstance(name, str):
        raise TargetMismatchError(f"tensor names must be strings, got {name!r}")
    if not isinstance(t, torch.Tensor):
        raise TargetMismatchError(f"{name!r} is a {type(t).__name__}, not a tensor")
    if t.is_meta:
        raise TargetMismatchError(f"{name!r} is a meta tensor (no data): materialize the model before publishing")
    return name, t


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _distinct_tensors(state: Mapping[Any, Any]) -> dict[str, torch.Tensor] | None:
    """``state`` as a dict when every key is a string and every value a tensor with data at an address of its
    own (then none can alias another), by a few C-level passes instead of a loop over the tensors; else None,
    and :func:`named_tensors` looks at each entry."""
    out = dict(state)
    values = list(out.values())
    if set(map(type, out)) - {str} or not all(issubclass(c, torch.Tensor) for c in set(map(type, values))):
        return None
    ptrs = set(map(torch.Tensor.data_ptr, values))
    if len(ptrs) != len(values) or 0 in ptrs:  # 0: no storage (empty, or meta: refused by the checks)
        return None
    return out


def _layout_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_IS_CPU = operator.attrgetter("is_cpu")


def plain_cpu(t: torch.Tensor) -> bool:
    """Whether the kernels may read and write ``t`` by address: a plain (not subclassed) CPU tensor.

    Subclasses (DTensor, fakes, instrumented tensors) always go through torch
    ops, so whatever they intercept still sees every write. Never cached: a cache keyed by the tensor
    would keep every tensor ever asked about (a whole model's targets) alive.
    """
    return type(t) in _PLAIN and t.is_cpu


def all_plain_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every one of ``tensors`` is :func:`plain_cpu` (two C-level passes, no call per tensor)."""
    return set(map(type, tensors)).issubset(_PLAIN) and all(map(_IS_CPU, tensors))


def plain_cpu_groups(tensors: Sequence[torch.Tensor]) -> tuple[dict[int, list[int]], list[int]]:
    """The positions in ``tensors`` of the :func:`plain_cpu` ones, grouped by element width, and of the
    others, each in order; when all are plain CPU tensors of one width (the common case), by C-level
    passes with no call per tensor."""
    if all_plain_cpu(tensors):
        widths = set(map(torch.Tensor.element_size, tensors))
        if len(widths) == 1:
            return {widths.pop(): list(range(len(tensors)))}, []
    groups: dict[int, list[int]] = {}
    others: list[int] = []
    for i, t in enumerate(tensors):
        if plain_cpu(t):
            groups.setdefault(t.element_size(), []).append(i)
        else:
            others.append(i)
    return groups, others


def plain_cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``tensors`` that are :func:`plain_cpu`, in order."""
    if all_plain_cpu(list(tensors.values())):
        return dict(tensors)
    return {n: t for n, t in tensors.items() if plain_cpu(t)}
