"""vLLM's own loaders, found where the installed vLLM keeps them (imports vLLM only when called).

* layer-wise in-place reload (the reload path): ``reload_weights`` lives in
  ``vllm.model_executor.model_loader.reload.inplace`` (vLLM 0.32, checked in
  its source); the package ``reload/__init__.py`` does not export it. It
  leaves "state derived from the old weights" to the caller: vLLM's own
  ``GPUModelRunner.reload_weights`` then resets the LoRA state, the encoder
  cache and the multimodal cache, and so does :func:`post_reload_resets`.
* the native sparse in-place loader (the native path):
  ``load_checkpoint_weight_patches`` / ``CheckpointWeightPatch`` in
  ``vllm.model_executor.model_loader.checkpoint_weight_patch`` (vLLM 0.32):
  checkpoint coordinates through the model's own ``load_weights``, NaN as
  the "unchanged" sentinel, no rollback of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...errors import ApplyError

ReloadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


def reload_weights_fn() -> Callable[..., None]:
    """vLLM's ``reload_weights(vllm_config, model, weights_iterator, weights_path, is_checkpoint_format)``."""
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights  # type: ignore[import-not-found]
    except ImportError:
        try:  # a layout that re-exports it from the package
            from vllm.model_executor.model_loader.reload import reload_weights  # type: ignore[import-not-found]
        except ImportError as e:
            raise ApplyError("this vLLM has no layer-wise reload_weights (vllm.model_executor.model_loader.reload"
                             ".inplace); the reload path needs vLLM >= 0.32") from e
    return reload_weights


def post_reload_resets(runner: Any) -> None:
    """What vLLM's ``GPUModelRunner.reload_weights`` does after a reload: drop state derived from the old
    weights (LoRA state, encoder cache, multimodal cache). ``runner`` None: nothing to reach."""
    for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(runner, name, None)
        if callable(fn):
            fn()


def vllm_reload_fn(model: torch.nn.Module, vllm_config: Any, runner: Any = None) -> ReloadFn:
    """vLLM's layer-wise in-place reload of a subset of checkpoint tensors, then :func:`post_reload_resets`."""
    def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]

        fn = reload_weights_fn()
        with set_current_vllm_config(vllm_config):
            fn(vllm_config, model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)
        post_reload_resets(runner)
    return reload


def native_patch_loader() -> tuple[type, Callable[..., set[str]]] | None:
    """``(CheckpointWeightPatch, load_checkpoint_weight_patches)`` when the installed vLLM has them, else None."""
    try:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (  # type: ignore[import-not-found]
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )
    except ImportError:
        return None
    return CheckpointWeightPatch, load_checkpoint_weight_patches
