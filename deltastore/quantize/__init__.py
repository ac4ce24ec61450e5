"""Quantized served weights: what a Publisher turns the trainer's weights into before diffing.

A quantizer (``Publisher(uri, quantize=...)``) maps a normalised state to the
tensors the servers hold (e.g. ``fp8_block128``: e4m3 weights plus fp32 block
scales); the diff, codecs and checksums then work on those bits like on any
other tensor. Every version records its scheme in the manifest field
``quantization``, which a reader checks without this package
(:mod:`deltastore.quantization`: the format's side of each scheme).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedFormatError
from ..quantization import SCHEME as FP8_SCHEME, SCHEMES

if TYPE_CHECKING:
    from .fp8 import Fp8Block128

__all__ = ["Fp8Block128", "get_quantizer"]


def __getattr__(name: str) -> Any:
    if name == "Fp8Block128":  # the quantizer imports torch; reading a record does not
        from .fp8 import Fp8Block128

        return Fp8Block128
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_quantizer(spec: Any) -> Fp8Block128 | None:
    """A quantizer from ``None``, a scheme name (``"fp8_block128"``) or a quantizer object.

    Raises :class:`UnsupportedFormatError` for an unknown scheme name.
    """
    from .fp8 import Fp8Block128

    if spec is None or isinstance(spec, Fp8Block128):
        return spec
    if spec == FP8_SCHEME:
        return Fp8Block128()
    if isinstance(spec, str):
        raise UnsupportedFormatError(f"unknown quantization scheme {spec!r}; known: {sorted(SCHEMES)}")
    if hasattr(spec, "apply") and hasattr(spec, "record") and getattr(spec, "scheme", None) in SCHEMES:
        return spec
    raise TypeError(f"quantize must be None, a scheme name or a quantizer, got {type(spec).__name__}")
