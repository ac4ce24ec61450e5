"""Checkpoint coordinates -> serving-parameter coordinates, learned from the model's own loader.

vLLM does not serve the checkpoint's tensors: ``q_proj``/``k_proj``/``v_proj``
live side by side in one fused ``qkv_proj`` parameter, ``gate_proj``/``up_proj``
in ``gate_up_proj``, tensor parallelism keeps one slice per rank and the
vocabulary is padded. Which element of which checkpoint tensor ends up where is
decided by the model's ``load_weights`` and the layers' weight loaders, which
differ per model and per vLLM version.

Rather than re-implementing that logic, :func:`probe` *asks* the loader: it
feeds each checkpoint tensor as a float64 tensor whose values are the flat
element positions (exact up to 2**53), and intercepts, with a
``TorchFunctionMode``, every in-place write that would land in a parameter's
storage. Nothing is written. Each intercepted ``dst.copy_(src)`` tells us the
parameter region (``dst``'s strides and offset inside the parameter) and which
checkpoint elements go there (``src``'s values). When those values are an
affine function of ``dst``'s index (they are for narrow/slice/fuse/shard, the
only things the stock loaders do), the region is kept as a :class:`Block`;
anything else (a transpose that copies, a dtype conversion, a permutation)
makes that tensor *unmappable* and the caller falls back to the reload path.

A :class:`ParamMap` then maps flat checkpoint positions to parameter
positions in O(positions), gathers the served bits there and writes new bits
in place (``index_put_`` into the existing storage: ``data_ptr`` is kept, so
CUDA graphs stay valid). No vLLM import: everything here is plain torch and is
unit-tested on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...checksum import sparse_sum, tensor_key
from ...errors import TargetMismatchError
from ...tensors import bits_dtype

_F64_EXACT = 1 << 53


@dataclass(frozen=True)
class Block:
    """One strided region: checkpoint elements ``hf_offset + sum(i_d * hf_strides[d])`` are
    parameter elements ``p_offset + sum(i_d * p_strides[d])`` for ``0 <= i_d < shape[d]``
    (flat positions in the checkpoint tensor and in the contiguous parameter)."""

    param: str
    shape: tuple[int, ...]
    hf_offset: int
    hf_strides: tuple[int, ...]
    p_offset: int
    p_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def _order(self) -> list[int]:
        return sorted((d for d in range(len(self.shape)) if self.shape[d] > 1),
                      key=lambda d: -self.hf_strides[d])

    def check(self) -> None:
        """Raise ValueError unless each checkpoint position lies in this block at most once
        and can be located by mixed-radix division (true for every sub-box of a
        row-major tensor)."""
        order = self._order()
        for d in order:
            if self.hf_strides[d] <= 0:
                raise ValueError(f"block into {self.param}: non-positive checkpoint stride {self.hf_strides[d]}")
        span = 0
        for d in reversed(order):
            if self.hf_strides[d] <= span:
                raise ValueError(f"block into {self.param}: checkpoint strides overlap")
            span += self.hf_strides[d] * (self.shape[d] - 1)

    @property
    def _shifted_copy(self) -> bool:
        """The block is the checkpoint tensor's first ``numel`` elements, laid out in the parameter with
        the same strides (a whole unsharded tensor, a fused part, a padded vocabulary): a position there
        is ``p_offset`` further on."""
        contiguous, n = [], 1
        for d in reversed(self.shape):
            contiguous.append(n)
            n *= d
        return self.hf_offset == 0 and self.hf_strides == self.p_strides == tuple(reversed(contiguous))

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For int64 checkpoint ``positions``: (indices into ``positions`` that fall in this
        block, their flat positions in the parameter)."""
        if self._shifted_copy:
            lo, hi = torch.aminmax(positions) if positions.numel() else (0, -1)
            if int(lo) >= 0 and int(hi) < self.numel:
                return torch.arange(positions.numel()), positions + self.p_offset
        r = positions - self.hf_offset
        ok = r >= 0
        p = torch.full_like(positions, self.p_offset)
        for d in self._order():
            a = self.hf_strides[d]
            i = torch.div(r, a, rounding_mode="floor")
            ok &= (i >= 0) & (i < self.shape[d])
            r = r - i * a
            p += i * self.p_strides[d]
        ok &= r == 0
        sel = ok.nonzero().squeeze(1)
        return sel, p[sel]

    def views(self, hf_flat: torch.Tensor, param_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views of this block into a flat checkpoint tensor and a flat parameter."""
        return (hf_flat.as_strided(self.shape, self.hf_strides, hf_flat.storage_offset() + self.hf_offset),
                param_flat.as_strided(self.shape, self.p_strides, param_flat.storage_offset() + self.p_offset))

    def hf_positions(self, device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
        """Every checkpoint position of the block (in block order), in chunks along the first dim."""
        if not self.shape:
            yield torch.tensor([self.hf_offset], dtype=torch.int64, device=device)
            return
        rest = self.shape[1:]
        base = torch.zeros(rest, dtype=torch.int64, device=device)
        for d, n in enumerate(rest):
            idx = torch.arange(n, dtype=torch.int64, device=device) * self.hf_strides[d + 1]
            base = base + idx.view([n if k == d else 1 for k in range(len(rest))])
        base = base.reshape(-1)
        step = max(1, (1 << 22) // max(1, base.numel()))
        for start in range(0, self.shape[0], step):
            rows = torch.arange(start, min(self.shape[0], start + step), dtype=torch.int64, device=device)
            yield (self.hf_offset + rows[:, None] * self.hf_strides[0] + base[None, :]).reshape(-1)


@dataclass
class ParamMap:
    """Where each checkpoint tensor lives among the serving parameters of one worker.

    params: parameter name -> the live parameter tensor (contiguous).
    blocks: checkpoint tensor name -> blocks (empty: this worker holds none of it).
    specs: checkpoint tensor name -> (dtype, shape).
    unmapped: checkpoint tensor name -> why the probe could not map it.
    """

    params: dict[str, torch.Tensor]
    blocks: dict[str, list[Block]]
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    unmapped: dict[str, str] = field(default_factory=dict)

    def _flat(self, param: str) -> torch.Tensor:
        t = self.params[param]
        return t.detach().reshape(-1).view(bits_dtype(t.dtype))

    def numel(self, name: str) -> int:
        n = 1
        for d in self.specs[name][1]:
            n *= d
        return n

    def check_layout(self, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """Every tensor of a version must be mapped with the same dtype and shape."""
        for name, dtype, shape in specs:
            if name in self.unmapped:
                raise TargetMismatchError(f"checkpoint tensor {name!r} cannot be mapped to the serving "
                                          f"parameters: {self.unmapped[name]}")
            have = self.specs.get(name)
            if have is None:
                raise TargetMismatchError(f"the serving model has no checkpoint tensor {name!r}")
            if have != (dtype, tuple(shape)):
                raise TargetMismatchError(f"checkpoint tensor {name!r} is {have[0]}{list(have[1])} on the server, "
                                          f"the version has {dtype}{list(shape)}")

    def gather(self, name: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(held mask, bits) at flat checkpoint ``positions`` (CPU int64) from the live parameters.

        Positions this worker does not hold have mask False and bits 0.
        """
        dtype = bits_dtype(self.specs[name][0])
        held = torch.zeros(positions.numel(), dtype=torch.bool)
        bits = torch.zeros(positions.numel(), dtype=dtype)
        for b in self.blocks.get(name, ()):
            flat = self._flat(b.param)
            sel, ppos = b.locate(positions)
            if sel.numel():
                bits[sel] = flat[ppos.to(flat.device)].cpu()
                held[sel] = True
        return held, bits

    def write(self, name: str, positions: torch.Tensor, bits: torch.Tensor) -> int:
        """Write new ``bits`` at flat checkpoint ``positions`` into every parameter copy that
        holds them, in place. Returns the number of parameter elements written."""
        n = 0
        for b in self.blocks.get(name, ()):
            flat = self._flat(b.param)
            sel, ppos = b.locate(positions)
            if sel.numel():
                flat.index_put_((ppos.to(flat.device),), bits[sel].to(flat.device))
                n += sel.numel()
        return n

    def write_full(self, name: str, bits: torch.Tensor) -> int:
        """Write a whole checkpoint tensor (flat bits) into the parameters, in place."""
        n = 0
        for b in self.blocks.get(name, ()):
            flat = self._flat(b.param)
            hv, pv = b.views(bits, flat)
            pv.copy_(hv.to(flat.device))
            n += b.numel
        return n

    def partial_checksum(self, name: str) -> tuple[int, int, int]:
        """(sum of the checksum terms over the positions this worker holds, how many, and a
        fingerprint of the position set) for combining across tensor-parallel ranks."""
        key = tensor_key(name)
        seen: list[torch.Tensor] = []
        for b in self.blocks.get(name, ()):
            seen.extend(b.hf_positions())
        if not seen:
            return 0, 0, 0
        allpos = torch.unique(torch.cat(seen))
        _, bits = self.gather(name, allpos)
        sums = sparse_sum(key, allpos, bits)
        count = allpos.numel()
        finger = sparse_sum(key ^ 0x5EED, allpos, torch.zeros_like(bits))
        return sums, count, finger


# -- probing -----------------------------------------------------------------------------------
class _Intercept(TorchFunctionMode):
    """Swallow every in-place write into a known parameter storage and record ``copy_``s."""

    def __init__(self, storages: Mapping[tuple[Any, int], str]):
        super().__init__()
        self.storages = storages
        self.copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.other_writes: list[str] = []

    def _param_of(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        try:
            key = (t.device, t.untyped_storage().data_ptr())
        except Exception:  # tensors without storage
            return None
        return self.storages.get(key)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.copy_:
            p = self._param_of(args[0])
            if p is not None:
                self.copies.append((p, args[0], args[1]))
                return args[0]
        elif func is torch.Tensor.__setitem__:
            p = self._param_of(args[0])
            if p is not None:
                with torch._C.DisableTorchFunction():
                    view = args[0][args[1]]
                if isinstance(args[2], torch.Tensor) and self._param_of(view) == p:
                    self.copies.append((p, view, args[2]))
                else:
                    self.other_writes.append(f"{p}: __setitem__")
                return None
        elif name == "__set__":  # Tensor.data = ... would swap the storage
            p = self._param_of(args[0])
            if p is not None:
                self.other_writes.append(f"{p}: .data assignment")
                return None
        elif name.endswith("_") and not name.startswith("_") and args:
            p = self._param_of(args[0])
            if p is not None:  # fill_, zero_, index_copy_, ...: suppressed
                self.other_writes.append(f"{p}: {name}")
                return args[0]
        return func(*args, **kwargs)


def _block_from_copy(param: torch.Tensor, pname: str, dst: torch.Tensor, src: torch.Tensor) -> Block:
    if not isinstance(src, torch.Tensor) or src.dtype != torch.float64:
        raise ValueError(f"the loader converted the tensor before writing it into {pname} "
                         f"({getattr(src, 'dtype', type(src))})")
    if dst.dtype != param.dtype:
        raise ValueError(f"{pname} was written through a {dst.dtype} view of a {param.dtype} parameter")
    with torch._C.DisableTorchFunction():
        vals = src.expand(dst.shape).to("cpu", torch.float64)
    if vals.numel() == 0:
        raise ValueError("empty write")
    v0 = int(vals.reshape(-1)[0])
    strides = []
    for d, n in enumerate(dst.shape):
        if n > 1:
            idx = [0] * dst.dim()
            idx[d] = 1
            strides.append(int(vals[tuple(idx)]) - v0)
        else:
            strides.append(0)
    expect = torch.full(dst.shape, float(v0), dtype=torch.float64)
    for d, n in enumerate(dst.shape):
        if n > 1:
            shape = [1] * dst.dim()
            shape[d] = n
            expect = expect + (torch.arange(n, dtype=torch.float64) * strides[d]).view(shape)
    if not torch.equal(expect, vals):
        raise ValueError(f"the loader rearranges elements into {pname} (not a strided slice)")
    block = Block(pname, tuple(dst.shape), v0, tuple(strides),
                  dst.storage_offset() - param.storage_offset(), tuple(dst.stride()))
    block.check()
    return block


def probe(load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
          params: Mapping[str, torch.Tensor],
          specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
          *, device: torch.device | str | None = None) -> ParamMap:
    """Learn, without writing anything, where ``load_weights`` puts each checkpoint tensor.

    ``params``: the serving parameters by name (contiguous). ``specs``: the
    checkpoint tensors to map, ``{name: (dtype, shape)}``. Tensors the loader
    rejects or rearranges are listed in ``ParamMap.unmapped`` with the reason.
    """
    storages: dict[tuple[Any, int], str] = {}
    for pname, t in params.items():
        if t.numel() and t.device.type != "meta":
            storages[(t.device, t.untyped_storage().data_ptr())] = pname
    if device is None:
        device = next((t.device for t in params.values() if t.numel()), torch.device("cpu"))
    before = {n: (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape)) for n, t in params.items()}
    blocks: dict[str, list[Block]] = {}
    unmapped: dict[str, str] = {}
    for name, (dtype, shape) in specs.items():
        numel = 1
        for d in shape:
            numel *= d
        if numel >= _F64_EXACT:
            unmapped[name] = "too many elements to probe"
            continue
        coords = torch.arange(numel, dtype=torch.float64, device=device).reshape(shape)
        mode = _Intercept(storages)
        try:
            with mode:
                load_weights([(name, coords)])
        except Exception as e:  # the loader refused the tensor (repacked/quantized parameter, ...)
            unmapped[name] = f"the model's loader failed on it: {type(e).__name__}: {e}"[:300]
            continue
        found = []
        try:
            for pname, dst, src in mode.copies:
                if dst.dtype != dtype:
                    raise ValueError(f"{pname} is {dst.dtype}, the checkpoint tensor is {dtype}")
                found.append(_block_from_copy(params[pname], pname, dst, src))
        except Exception as e:  # noqa: BLE001 - anything odd makes the tensor unmappable, never fatal
            unmapped[name] = f"{type(e).__name__}: {e}"[:300]
            continue
        if not found and mode.other_writes:
            unmapped[name] = f"written by other means: {mode.other_writes[:3]}"
            continue
        blocks[name] = _dedupe(found)
    after = {n: (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape)) for n, t in params.items()}
    if after != before:
        changed = [n for n in before if before[n] != after.get(n)]
        raise RuntimeError(f"probing the loader replaced serving parameters {changed[:5]}; "
                           "this model cannot use the sparse in-place path")
    return ParamMap(dict(params), blocks, {n: (d, tuple(s)) for n, (d, s) in specs.items()}, unmapped)


def _dedupe(blocks: list[Block]) -> list[Block]:
    out: list[Block] = []
    for b in blocks:
        if b not in out:
            out.append(b)
    return out


# -- grouping for the reload path -------------------------------------------------------------
def reload_groups(names: Iterable[str], packed_modules_mapping: Mapping[str, list[str]] | None,
                  served_modules: set[str] | None = None) -> dict[str, list[str]] | None:
    """Checkpoint tensors grouped by the serving module they load into.

    ``q_proj``/``k_proj``/``v_proj`` (weights and biases) share ``qkv_proj``,
    ``gate_proj``/``up_proj`` share ``gate_up_proj`` (from the model's
    ``packed_modules_mapping``). vLLM's layer-wise reload re-processes a
    module from what it was given, so every checkpoint tensor of a touched
    module must be sent together. Returns None when a name does not resolve to
    a module in ``served_modules`` (the caller then sends everything).
    """
    inverse: dict[str, str] = {}
    for fused, parts in (packed_modules_mapping or {}).items():
        for part in parts:
            inverse[part] = fused
    groups: dict[str, list[str]] = {}
    for name in names:
        module, _, _leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        fused = inverse.get(last)
        key = (parent + "." + fused if parent else fused) if fused else module
        if served_modules is not None and key not in served_modules:
            return None
        groups.setdefault(key, []).append(name)
    return groups
