"""The manifest's ``quantization`` record: the schemes a reader knows, each checked against the tensors.

A version of quantized served weights records its scheme; :func:`check_record`
is what a reader runs on it: an unknown scheme is :class:`UnsupportedFormatError`
(a reader never serves bits it cannot interpret), a record that does not match
the tensors is :class:`ManifestError`. The ``fp8_block128`` scheme as a
manifest records it: its names and shapes, its record check and the
``config.json`` it serves. No torch (reading a manifest needs none): the
quantizers themselves are :mod:`deltastore.quantize`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ManifestError, UnsupportedFormatError

SCHEME = "fp8_block128"
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of the scale tensor of a weight of ``shape``."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def check_fp8_record(doc: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """Validate an ``fp8_block128`` record against the manifest's tensors (``{name: TensorRecord}``).

    Raises :class:`ManifestError` when a listed weight is missing, not a 2-D
    ``float8_e4m3fn`` tensor, or lacks its fp32 scale of the right shape.
    """
    if doc.get("block") != [BLOCK, BLOCK] or doc.get("scale_suffix") != SCALE_SUFFIX:
        raise ManifestError(f"fp8_block128 record: block must be [128, 128] and scale_suffix {SCALE_SUFFIX!r}")
    weights = doc.get("weights")
    if not isinstance(weights, list) or not weights or len(set(map(str, weights))) != len(weights):
        raise ManifestError("fp8_block128 record: 'weights' must be a non-empty list of distinct names")
    for name in weights:
        rec = tensors.get(name) if isinstance(name, str) else None
        if rec is None or rec.dtype != "float8_e4m3fn" or len(rec.shape) != 2:
            raise ManifestError(f"fp8_block128 record names {name!r}, which is not a 2-D float8_e4m3fn tensor")
        srec = tensors.get(name + SCALE_SUFFIX)
        if srec is None or srec.dtype != "float32" or tuple(srec.shape) != scale_shape(rec.shape):
            raise ManifestError(f"fp8_block128: {name!r} needs a float32 {name + SCALE_SUFFIX!r} of shape "
                                f"{list(scale_shape(rec.shape))}")


def served_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A model ``config.json`` with the ``quantization_config`` that makes vLLM / transformers load the
    published tensors as block-FP8 weights (``quant_method: fp8``, ``weight_block_size: [128, 128]``)."""
    out = dict(config)
    out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    return out


#: scheme name -> validator of its manifest record
SCHEMES = {SCHEME: check_fp8_record}


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
    if record.get("scheme") == SCHEME:
        config = served_config(config)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
