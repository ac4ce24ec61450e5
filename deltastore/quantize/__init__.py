"""Quantized served weights: what a Publisher turns the trainer's weights into before diffing.

A quantizer (``Publisher(uri, quantize=...)``) maps a normalised state to the
tensors the servers hold (e.g. ``fp8_block128``: e4m3 weights plus fp32 block
scales); the diff, codecs and checksums then work on those bits like on any
other tensor. Every version records its scheme in the manifest field
``quantization``; :func:`check_record` is what a reader runs on it: an unknown
scheme is :class:`UnsupportedFormatError` (a reader never serves bits it cannot
interpret), a record that does not match the tensors is :class:`ManifestError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ManifestError, UnsupportedFormatError
from . import fp8_record

if TYPE_CHECKING:
    from .fp8 import Fp8Block128

#: scheme name -> validator of its manifest record
SCHEMES = {fp8_record.SCHEME: fp8_record.check_record}

__all__ = ["Fp8Block128", "SCHEMES", "check_record", "get_quantizer", "served_config_json"]


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
    if spec == fp8_record.SCHEME:
        return Fp8Block128()
    if isinstance(spec, str):
        raise UnsupportedFormatError(f"unknown quantization scheme {spec!r}; known: {sorted(SCHEMES)}")
    if hasattr(spec, "apply") and hasattr(spec, "record") and getattr(spec, "scheme", None) in SCHEMES:
        return spec
    raise TypeError(f"quantize must be None, a scheme name or a quantizer, got {type(spec).__name__}")


def check_record(doc: Any, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a manifest's ``quantization`` field against its tensors (``{name: TensorRecord}``).

    Returns ``doc``. Raises :class:`UnsupportedFormatError` for a scheme this
    library does not read and :class:`ManifestError` for a malformed record.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("scheme"), str):
        raise ManifestError("manifest field 'quantization' must be an object with a string 'scheme'")
    check = SCHEMES.get(doc["scheme"])
    if check is None:
        raise UnsupportedFormatError(
            f"this version holds weights quantized as {doc['scheme']!r}, which this deltastore does not read "
            f"(it reads {sorted(SCHEMES)}); refusing rather than serving them as unquantized weights")
    check(doc, tensors)
    return doc


def served_config_json(data: bytes, record: Mapping[str, Any]) -> bytes:
    """A recorded ``config.json`` with the ``quantization_config`` of ``record``'s scheme, so that the
    materialised folder loads as quantized weights (vLLM, transformers). Raises ``ValueError`` when
    ``data`` is not a JSON object."""
    import json

    config = json.loads(data)
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    if record.get("scheme") == fp8_record.SCHEME:
        config = fp8_record.served_config(config)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
