"""The codec contract.

A codec turns the updates of a group of tensors into the bytes of one stored
object and back. It is named (``codec_id``), versioned (``format_version``,
``"MAJOR.MINOR"``: a reader refuses another major) and configured by a JSON
dict (``get_config`` / ``from_config``), so a reader rebuilds the decoder from
the manifest alone.

Two shapes of update exist:

* dense (``positions is None``): every element of the tensor, for anchors;
* sparse: the changed elements only, ``positions`` strictly increasing.

A codec declares which it handles (``dense``) and what the decoder needs from
the receiver (``receiver_needs``): ``"nothing"``, or ``"old_bits"`` (the
receiver's current bits at the decoded positions, for codecs that store
differences). The library validates every decoded update against the manifest
(names, counts, position order and range, dtype) before anything is applied,
so a codec only has to encode and decode.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from ..tensors import bits_dtype

OldBits = Callable[[str, torch.Tensor], torch.Tensor]
"""``old(name, positions) -> raw bits`` the receiver holds at those flat positions."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one published tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bits_dtype(self) -> torch.dtype:
        return bits_dtype(self.dtype)


@dataclass
class Update:
    """One tensor's content in an object.

    bits: flat raw bits (integer view dtype, CPU): every element when
        ``positions`` is None, else the new bits at ``positions``.
    positions: int64 strictly increasing flat positions, or None (dense).
    old_bits: for encoders only, the previous bits at ``positions``.
    """

    spec: TensorSpec
    bits: torch.Tensor
    positions: torch.Tensor | None = None
    old_bits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return int(self.bits.numel())


class Codec(abc.ABC):
    """Encode a group of updates to one object's bytes and back."""

    codec_id: ClassVar[str]
    format_version: ClassVar[str] = "1.0"
    dense: ClassVar[bool] = False
    receiver_needs: ClassVar[Literal["nothing", "old_bits"]] = "nothing"

    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable constructor arguments (stored in the manifest)."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        """Rebuild the codec from :meth:`get_config`'s output."""
        return cls(**config)

    def describe(self) -> dict[str, Any]:
        """The manifest's codec record: id, format version and config."""
        return {"id": self.codec_id, "version": self.format_version, "config": self.get_config()}

    @abc.abstractmethod
    def encode(self, updates: Sequence[Update]) -> bytes:
        """Bytes of one object holding ``updates`` (all dense or all sparse, per ``self.dense``)."""

    @abc.abstractmethod
    def decode(self, data: bytes, specs: Sequence[TensorSpec], old: OldBits | None = None) -> dict[str, Update]:
        """Updates for exactly the tensors in ``specs`` from ``data``.

        Raises :class:`CorruptObjectError` when ``data`` cannot be decoded.
        """

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({cfg})"
