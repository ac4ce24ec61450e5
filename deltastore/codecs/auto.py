"""``auto``: per tensor, the smallest of the built-in sparse and dense encodings.

Rules, per tensor (the sender decides; the choice is recorded in the object):

* density (changed / numel) above ``dense_above`` (default 0.15): encode the
  whole new tensor with ``dense`` and keep it if that is smaller than the
  sparse encoding; the decoder diffs it against the receiver's old tensor;
* otherwise ``ctx`` when the sender has the whole old tensor
  (``Update.old_tensor``), else ``ulp`` when it has the old bits at the
  changed positions, else ``zstd``.

Object layout: safetensors with one uint8 tensor ``part.<codec id>`` per
sub-codec used, each a complete object of that codec holding its tensors, and
the metadata key ``deltastore.auto`` = JSON ``{tensor name: codec id}``.
``receiver_needs = "old_tensor"`` (a superset of what every part needs).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CorruptObjectError
from ._common import as_bytes, pack_meta, u8, unpack_meta
from .base import Codec, OldBits, TensorSpec, Update
from .ctx import CtxCodec
from .dense import DenseCodec
from .ulp import UlpCodec
from .zstd import ZstdCodec

_PARTS = ("ctx", "ulp", "zstd", "dense")


class AutoCodec(Codec):
    """Chooses per tensor (see module docstring). Config: ``dense_above`` (density threshold)."""

    codec_id = "auto"
    format_version = "1.0"
    receiver_needs = "old_tensor"

    def __init__(self, dense_above: float = 0.15):
        if not isinstance(dense_above, (int, float)) or isinstance(dense_above, bool) or not 0 <= dense_above <= 1:
            raise ValueError(f"dense_above must be in [0, 1], got {dense_above!r}")
        self.dense_above = float(dense_above)
        self._codecs: dict[str, Codec] = {"ctx": CtxCodec(), "ulp": UlpCodec(), "zstd": ZstdCodec(),
                                          "dense": DenseCodec(planes=True)}

    def get_config(self) -> dict[str, Any]:
        return {"dense_above": self.dense_above}

    def _sparse_choice(self, u: Update) -> str:
        if u.old_tensor is not None:
            return "ctx"
        return "ulp" if u.old_bits is not None else "zstd"

    def encode(self, updates: Sequence[Update]) -> bytes:
        groups: dict[str, list[Update]] = {}
        choice: dict[str, str] = {}
        dense_candidates = []
        for u in updates:
            if u.positions is None:
                raise ValueError("auto encodes sparse updates only")
            c = self._sparse_choice(u)
            if u.old_tensor is not None and u.spec.numel and u.count / u.spec.numel > self.dense_above:
                dense_candidates.append(u)
            else:
                groups.setdefault(c, []).append(u)
                choice[u.spec.name] = c
        for u in dense_candidates:  # compare actual sizes, tensor by tensor
            assert u.old_tensor is not None and u.positions is not None
            full = u.old_tensor.clone()
            full[u.positions] = u.bits
            sparse_id = self._sparse_choice(u)
            d = len(self._codecs["dense"].encode([Update(u.spec, full)]))
            s = len(self._codecs[sparse_id].encode([u]))
            if d < s:
                groups.setdefault("dense", []).append(Update(u.spec, full))
                choice[u.spec.name] = "dense"
            else:
                groups.setdefault(sparse_id, []).append(u)
                choice[u.spec.name] = sparse_id
        parts = {f"part.{cid}": u8(self._codecs[cid].encode(ups)) for cid, ups in groups.items()}
        return pack_meta(parts, self.codec_id, self.format_version,
                         {"deltastore.auto": json.dumps(choice, sort_keys=True)})

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        raw, meta = unpack_meta(data, self.codec_id)
        try:
            choice = json.loads(meta["deltastore.auto"])
        except (KeyError, ValueError) as e:
            raise CorruptObjectError(f"auto: object lacks a valid choice map ({e!r})") from None
        if not isinstance(choice, dict) or set(choice) != {s.name for s in specs}:
            raise CorruptObjectError("auto: object's tensors differ from the manifest's")
        by_codec: dict[str, list[TensorSpec]] = {}
        for s in specs:
            cid = choice[s.name]
            if cid not in _PARTS:
                raise CorruptObjectError(f"auto: unknown part codec {cid!r}")
            by_codec.setdefault(cid, []).append(s)
        if set(raw) != {f"part.{c}" for c in by_codec}:
            raise CorruptObjectError(f"auto: object parts {sorted(raw)} do not match its choice map")
        out: dict[str, Update] = {}
        for cid, sp in by_codec.items():
            if cid != "zstd" and old is None:
                raise ValueError("auto decoding needs the receiver's old tensors")
            part = as_bytes(raw[f"part.{cid}"], self.codec_id, cid)
            decoded = self._codecs[cid].decode(part, sp, old)
            if cid == "dense":
                assert old is not None
                for s in sp:
                    new = decoded[s.name].bits
                    before = old(s.name, None)
                    if before.numel() != s.numel:
                        raise CorruptObjectError(f"auto: old tensor {s.name!r} has the wrong size")
                    pos = torch.ne(before, new).nonzero().squeeze(1)
                    out[s.name] = Update(s, new[pos].clone(), pos)
            else:
                out.update(decoded)
        return out


__all__ = ["AutoCodec"]
