"""``auto``: per tensor, the built-in encoding that syncs fastest over the stated link.

Rules, per tensor (the sender decides; the choice is recorded in the object):

* density (changed / numel) above ``dense_above`` (default 0.15): encode the
  whole new tensor with ``dense`` and keep it if that is smaller than the
  sparse encoding; the decoder diffs it against the receiver's old tensor;
* otherwise ``ctx`` when the sender has the whole old tensor
  (``Update.old_tensor``) and ctx's smaller bytes save more transfer time at
  ``link_mbps`` than its O(tensor) passes cost (encode + decode, on this
  machine's kernel threads; see :func:`ctx_pays_off`), else ``ulp`` when the
  sender has the old bits at the changed positions, else ``zstd``.
  ``link_mbps=None`` means bytes first: ``ctx`` whenever it is possible.

``link_mbps`` is an encoder setting (how fast the store moves bytes to a
follower); decoding never needs it, and it is recorded only when it is not
the default. The default choice depends on the machine (its cores), so only
``link_mbps=None`` encodes the same bytes everywhere.

Object layout (format 1.2): safetensors with one uint8 tensor
``part.<codec id>`` per sub-codec used, each a complete object of that codec
holding its tensors, and the metadata key ``deltastore.auto.choice`` = JSON
``{"default": codec id, "other": {tensor name: codec id}}``: every tensor not
named in ``other`` is in the ``default`` part (the most used one), so a
version whose tensors all take one codec carries no name here (at 16,384
tensors the name map of 1.1 was about a quarter of the object).
Formats 1.0 and 1.1 (read as before) record every tensor instead, in
``deltastore.auto`` = JSON ``{tensor name: codec id}``; 1.1 differs from 1.0
only in the encoder's choice (the time model). A 1.1 reader refuses a 1.2
object (no ``deltastore.auto`` map: ``CorruptObjectError``); an object
naming a newer minor version is ``UnsupportedFormatError``.
``receiver_needs = "old_tensor"`` (a superset of what every part needs).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CorruptObjectError, UnsupportedFormatError
from ..kernels.gather import gather, scatter_
from ..kernels.parallel import threads
from ._common import pack_meta, u8, unpack_frames
from .base import (Codec, OldBits, TensorSpec, Update, UpdateBatch, WrittenBatch, batches_by_dtype, copy_specs,
                   decode_batched, encode_batched)

_PARTS = ("ctx", "ulp", "zstd", "dense")

#: default link rate of a follower's downloads, Mbit/s (a cloud object store to one server)
DEFAULT_LINK_MBPS = 1000.0
#: what ctx costs beyond ulp, encode + decode, one core: ns per element (its passes over the old tensor), ns per
#: changed element (its coding) and seconds per tensor (measured on both runs of both traces:
#: ``bench/ctx_model.py``, a least-squares fit over their steps: 0.39 ns, 51 ns, 25 us)
CTX_NS_PER_ELEMENT = 0.4
CTX_NS_PER_CHANGE = 50.0
CTX_TENSOR_SECONDS = 25e-6
#: bytes ctx saves against ulp per changed element (measured on the traces: 0.29-1.4, median 0.66; the low end
#: of the usual: ~0.35 at 2-3 % changed, ~1.0 below 0.5 %)
CTX_SAVES_PER_CHANGE = 0.55


def ctx_pays_off(numel: int, changed: int, link_mbps: float | None, cores: int) -> bool:
    """Whether ``ctx``'s smaller bytes save more transfer time than its extra passes and coding cost."""
    if link_mbps is None:
        return True
    saved_s = changed * CTX_SAVES_PER_CHANGE / (link_mbps * 1e6 / 8)
    spent_s = (numel * CTX_NS_PER_ELEMENT + changed * CTX_NS_PER_CHANGE) * 1e-9 / max(1, cores) + CTX_TENSOR_SECONDS
    return saved_s > spent_s


class AutoCodec(Codec):
    """Chooses per tensor (see module docstring).

    Config: ``dense_above`` (density threshold). Encoder setting: ``link_mbps``
    (default :data:`DEFAULT_LINK_MBPS`; None: smallest bytes). Raises
    ``ValueError`` for a value out of range.
    """

    codec_id = "auto"
    format_version = "1.2"
    receiver_needs = "old_tensor"

    def __init__(self, dense_above: float = 0.15, link_mbps: float | None = DEFAULT_LINK_MBPS):
        if not isinstance(dense_above, (int, float)) or isinstance(dense_above, bool) or not 0 <= dense_above <= 1:
            raise ValueError(f"dense_above must be in [0, 1], got {dense_above!r}")
        if link_mbps is not None and (not isinstance(link_mbps, (int, float)) or isinstance(link_mbps, bool)
                                      or not link_mbps > 0):
            raise ValueError(f"link_mbps must be a positive number or None, got {link_mbps!r}")
        self.dense_above = float(dense_above)
        self.link_mbps = None if link_mbps is None else float(link_mbps)
        from . import get_codec  # the parts are built-in codecs, found by name like any other

        self._codecs: dict[str, Codec] = {cid: get_codec(cid) for cid in ("ctx", "ulp", "zstd")}
        self._codecs["dense"] = get_codec({"id": "dense", "config": {"planes": True}})

    def get_config(self) -> dict[str, Any]:
        # link_mbps is recorded only when it is not the default (older readers know dense_above only)
        cfg: dict[str, Any] = {"dense_above": self.dense_above}
        if self.link_mbps != DEFAULT_LINK_MBPS:
            cfg["link_mbps"] = self.link_mbps
        return cfg

    def _ctx_pays(self, numel: int, changed: int) -> bool:
        """:func:`ctx_pays_off` on this machine's kernel threads; asked per tensor, so the common answer
        (a saving below ctx's fixed cost per tensor, which no number of cores beats) needs no thread count."""
        if self.link_mbps is not None and changed * CTX_SAVES_PER_CHANGE / (self.link_mbps * 1e6 / 8) \
                <= CTX_TENSOR_SECONDS:
            return False
        return ctx_pays_off(numel, changed, self.link_mbps, threads())

    def needs_for(self, spec: TensorSpec, changed: int) -> str:
        """The whole old tensor only where ctx or a dense part may be chosen; else the old bits."""
        dense = spec.numel and changed / spec.numel > self.dense_above
        if dense or self._ctx_pays(spec.numel, changed):
            return "old_tensor"
        return "old_bits"

    def estimate_size(self, spec: TensorSpec, changed: int) -> int:
        """The estimate of the part this tensor would get with the sender holding the old tensor."""
        pays = self._ctx_pays(spec.numel, changed)
        return self._codecs["ctx" if pays else "ulp"].estimate_size(spec, changed)

    def _sparse_choice(self, u: Update) -> str:
        if u.old_tensor is not None and (u.old_bits is None
                                         or self._ctx_pays(u.spec.numel, u.count)):
            return "ctx"
        return "ulp" if u.old_bits is not None else "zstd"

    def encode(self, updates: Sequence[Update]) -> bytes:
        choice, groups = self._choose(updates)
        return self._pack({cid: self._codecs[cid].encode(ups) for cid, ups in groups.items()}, choice)

    def encode_batch(self, batch: UpdateBatch) -> bytes:
        """:meth:`encode` of the batch, with the same bytes: a tensor without an old tensor is ``ulp`` by the
        rules (given the old bits), so only the tensors in ``batch.old_tensors`` are decided one by one, and
        every ``ulp`` tensor is encoded from the flat arrays."""
        if batch.old_bits is None or not batch.specs:
            return super().encode_batch(batch)
        choice = {s.name: "ulp" for s in batch.specs}
        groups: dict[str, list[Update]] = {}
        special = [i for i, s in enumerate(batch.specs) if s.name in batch.old_tensors]
        if special:
            decided, groups = self._choose(batch.updates(special))
            choice.update(decided)
            groups.pop("ulp", None)
        encoded = {cid: self._codecs[cid].encode(ups) for cid, ups in groups.items()}
        ulp = [i for i, s in enumerate(batch.specs) if choice[s.name] == "ulp"]
        if ulp:
            encoded["ulp"] = encode_batched(self._codecs["ulp"], batch.subset(ulp))
        return self._pack(encoded, choice)

    def _choose(self, updates: Sequence[Update]) -> tuple[dict[str, str], dict[str, list[Update]]]:
        """Each tensor's part codec (see the rules) and the updates each part holds."""
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
            scatter_(full, u.positions, u.bits)
            sparse_id = self._sparse_choice(u)
            d = len(self._codecs["dense"].encode([Update(u.spec, full)]))
            s = len(self._codecs[sparse_id].encode([u]))
            if d < s:
                groups.setdefault("dense", []).append(Update(u.spec, full))
                choice[u.spec.name] = "dense"
            else:
                groups.setdefault(sparse_id, []).append(u)
                choice[u.spec.name] = sparse_id
        return choice, groups

    def _pack(self, encoded: dict[str, bytes], choice: dict[str, str]) -> bytes:
        counts = collections.Counter(choice.values())
        default = min(counts, key=lambda c: (-counts[c], c)) if counts else "ulp"  # the most used (ties: by id)
        other = {n: c for n, c in choice.items() if c != default} if len(counts) > 1 else {}
        record = json.dumps({"default": default, "other": other}, sort_keys=True)
        return pack_meta({f"part.{cid}": u8(data) for cid, data in encoded.items()}, self.codec_id,
                         self.format_version, {"deltastore.auto.choice": record})

    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        return self._decode(data, specs, old, batched=False)[1]

    def decode_batch(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None
                     ) -> list[UpdateBatch | WrittenBatch]:
        batches, loose = self._decode(data, specs, old, batched=True)
        return batches + batches_by_dtype(list(loose.values()))

    def _decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None, *, batched: bool
                ) -> tuple[list[UpdateBatch | WrittenBatch], dict[str, Update]]:
        """The ``ulp`` and ``ctx`` parts as batches when ``batched``, everything else as updates by name."""
        raw, meta = unpack_frames(data, self.codec_id)
        by_codec = _parts_of(meta, specs)
        if set(raw) != {f"part.{c}" for c in by_codec}:
            raise CorruptObjectError(f"auto: object parts {sorted(raw)} do not match its choice map")
        out: dict[str, Update] = {}
        batches: list[UpdateBatch | WrittenBatch] = []
        for cid, sp in by_codec.items():
            if cid != "zstd" and old is None:
                raise ValueError("auto decoding needs the receiver's old tensors")
            part = raw[f"part.{cid}"]
            if batched and cid in ("ulp", "ctx"):  # as batches (written in place where the receiver lets them)
                batches += decode_batched(self._codecs[cid], part, sp, old)
                continue
            decoded = self._codecs[cid].decode(part, sp, old)
            if cid == "dense":
                assert old is not None
                for s in sp:
                    new = decoded[s.name].bits
                    before = old(s.name, None)
                    if before.numel() != s.numel:
                        raise CorruptObjectError(f"auto: old tensor {s.name!r} has the wrong size")
                    pos = torch.ne(before, new).nonzero().squeeze(1)
                    out[s.name] = Update(s, gather(new, pos), pos)
            else:
                out.update(decoded)
        return batches, out


def _parts_of(meta: dict[str, str], specs: Sequence[TensorSpec]) -> dict[str, list[TensorSpec]]:
    """``part codec -> its tensors`` (``specs`` order) from an object's metadata, its choice read as its
    format version writes it (see the module docstring); :class:`CorruptObjectError` naming what is wrong,
    :class:`UnsupportedFormatError` for a newer minor version."""
    version = meta.get("deltastore.codec_version", "1.0")
    major, _, minor = version.partition(".")
    if major != "1" or not minor.isdigit():
        raise CorruptObjectError(f"auto: object format {version!r} is not 1.x")
    if int(minor) > int(AutoCodec.format_version.partition(".")[2]):
        raise UnsupportedFormatError(f"auto: object format {version} is newer than the installed codec's "
                                     f"({AutoCodec.format_version}); upgrade deltastore")
    key = "deltastore.auto.choice" if int(minor) >= 2 else "deltastore.auto"
    try:
        choice = json.loads(meta[key])
    except (KeyError, ValueError) as e:
        raise CorruptObjectError(f"auto: object lacks a valid choice map ({e!r})") from None
    if int(minor) >= 2:
        if not isinstance(choice, dict) or choice.keys() != {"default", "other"}:
            raise CorruptObjectError("auto: object's choice record is not {'default', 'other'}")
        default, other = choice["default"], choice["other"]
        if not isinstance(other, dict):
            raise CorruptObjectError("auto: object's choice record has no map of other tensors")
        if other and not other.keys() <= {s.name for s in specs}:  # usually empty: no set of every name
            raise CorruptObjectError("auto: object's tensors differ from the manifest's")
        named = [default, *other.values()]
    else:
        if not isinstance(choice, dict) or len(choice) != len(specs) or choice.keys() != {s.name for s in specs}:
            raise CorruptObjectError("auto: object's tensors differ from the manifest's")
        default, other = None, choice
        named = list(choice.values())
    if not set(map(type, named)) <= {str}:
        raise CorruptObjectError("auto: object's choice map names a part codec by something not a string")
    used = set(named)
    if not used <= set(_PARTS):
        raise CorruptObjectError(f"auto: unknown part codec {sorted(used - set(_PARTS))[0]!r}")
    if not other:  # one codec for every tensor (the usual case): no pass per tensor
        return {default: copy_specs(specs)} if specs else {}
    if len(used) == 1:
        return {used.pop(): copy_specs(specs)}
    by_codec: dict[str, list[TensorSpec]] = {}
    for s in specs:
        by_codec.setdefault(other.get(s.name, default), []).append(s)
    return by_codec


__all__ = ["AutoCodec", "DEFAULT_LINK_MBPS", "ctx_pays_off"]
