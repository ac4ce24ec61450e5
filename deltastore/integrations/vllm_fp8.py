"""FP8 versions (``fp8_block128``) onto a vLLM FP8 block-quantized model: which engine may take them, and where.

vLLM serves a block-FP8 checkpoint (``quantization_config.quant_method: fp8``,
``weight_block_size: [128, 128]``; what ``deltastore materialize`` writes for a
quantized version) with ``Fp8LinearMethod``: each linear layer holds ``weight``
(``float8_e4m3fn``) and ``weight_scale_inv`` (fp32, one entry per 128x128
block), and its loaders put a checkpoint's ``<x>_proj.weight`` /
``<x>_proj.weight_scale_inv`` into the fused ``qkv_proj`` / ``gate_up_proj``
parameters at row (weights) and block-row (scales) offsets.

* :func:`check_served` refuses (``TargetMismatchError``) a version whose scheme
  is not the engine's: FP8 bytes into a bf16 engine (its loader would cast them
  to bf16 and serve garbage) or bf16 weights into an FP8 engine.
* :func:`fp8_param_map` learns, through the model's own loader
  (:func:`deltastore.integrations.vllm.mapping.probe`, nothing written), where
  every published tensor lives, and checks that each e4m3 weight lands only in
  FP8 ``weight`` parameters and each scale only in fp32 ``weight_scale_inv``
  ones. The resulting ``ParamMap`` gathers and writes bits like any other
  (``uint8`` views for e4m3, ``int32`` for the scales).

No vLLM import: plain torch, unit-tested on a vLLM-shaped fake model.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import TargetMismatchError
from ..manifest import Manifest
from ..quantization import BLOCK, SCALE_SUFFIX, SCHEME
from .vllm.mapping import ParamMap, probe

__all__ = ["check_served", "fp8_param_map", "served_scheme"]


def served_scheme(model: torch.nn.Module, vllm_config: Any = None) -> str | None:
    """The scheme of the checkpoint tensors the engine's loader expects: ``"fp8_block128"``, another
    quantization method's name, or None (weights as trained).

    From ``vllm_config`` when given: a quantization method whose checkpoint is
    not pre-quantized (``--quantization fp8`` on a bf16 checkpoint:
    ``is_checkpoint_fp8_serialized`` False) quantizes on load, so it expects
    weights as trained (None). Without it, from the parameters: a module
    holding a ``float8_e4m3fn`` ``weight`` and a ``weight_scale_inv``.
    """
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None:
        method = getattr(mc, "quantization", None)
        qc = getattr(vllm_config, "quant_config", None)
        if not method or getattr(qc, "is_checkpoint_fp8_serialized", True) is False:
            return None
        block = getattr(qc, "weight_block_size", None)
        return SCHEME if method == "fp8" and block is not None and list(block) == [BLOCK, BLOCK] else str(method)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        if name.endswith("weight") and p.dtype is torch.float8_e4m3fn:
            return SCHEME if name + SCALE_SUFFIX in params else "fp8"
    return None


def check_served(manifest: Manifest, model: torch.nn.Module, vllm_config: Any = None) -> None:
    """Raise :class:`TargetMismatchError` unless version ``manifest`` is in the scheme the engine serves."""
    have = (manifest.quantization or {}).get("scheme")
    serves = served_scheme(model, vllm_config)
    if have != serves:
        raise TargetMismatchError(
            f"version {manifest.step} holds {have or 'unquantized'} weights but the engine serves "
            f"{serves or 'unquantized'} weights; start vLLM from a checkpoint of the same scheme "
            f"(`deltastore materialize` writes the quantization_config of a {SCHEME} version)")


def fp8_param_map(model: torch.nn.Module, manifest: Manifest) -> ParamMap:
    """Where each tensor of a ``fp8_block128`` version lives among the model's parameters.

    Raises :class:`TargetMismatchError` when the engine does not serve the
    scheme (:func:`check_served`), when the loader cannot map a tensor, or when
    an e4m3 weight or a scale would land in anything but an FP8 ``weight`` /
    fp32 ``weight_scale_inv`` parameter.
    """
    check_served(manifest, model)
    params = dict(model.named_parameters(remove_duplicate=False))
    specs = {t.name: (t.spec.dtype, tuple(t.shape)) for t in manifest.tensors}
    with torch.no_grad():
        pmap = probe(model.load_weights, params, specs)
    pmap.check_layout((n, d, s) for n, (d, s) in specs.items())
    weights = set(manifest.quantization["weights"]) if manifest.quantization else set()
    for name in weights:
        for tensor, suffix, dtype in ((name, "weight", torch.float8_e4m3fn),
                                      (name + SCALE_SUFFIX, "weight" + SCALE_SUFFIX, torch.float32)):
            blocks = pmap.blocks.get(tensor) or []
            if not blocks:
                raise TargetMismatchError(f"the engine's loader puts {tensor!r} nowhere")
            for b in blocks:
                p = params[b.param]
                if not b.param.endswith(suffix) or p.dtype is not dtype:
                    raise TargetMismatchError(f"{tensor!r} would land in {b.param!r} ({p.dtype}), not in an "
                                              f"{dtype} '{suffix}' parameter")
    return pmap
