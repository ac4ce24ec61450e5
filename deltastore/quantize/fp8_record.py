"""The ``fp8_block128`` scheme as a manifest records it: its names and shapes, the record check a reader
runs and the ``config.json`` it serves; no torch (reading a manifest needs none). The quantizer itself is
:mod:`deltastore.quantize.fp8`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import ManifestError

SCHEME = "fp8_block128"
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of the scale tensor of a weight of ``shape``."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def check_record(doc: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
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
