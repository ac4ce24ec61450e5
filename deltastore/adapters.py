"""PEFT adapters as versions: what ``Publisher(uri, adapter_only=True)`` publishes, and the folder it rebuilds.

A version of an adapter holds the adapter's tensors under the names PEFT's
``save_pretrained`` writes (``peft.get_peft_model_state_dict``: e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) and records
``adapter_config.json`` (written by PEFT's own ``PeftConfig.save_pretrained``,
as ``save_pretrained`` would) as a version file. :func:`write_adapter_folder`
turns a pulled version back into ``adapter_model.safetensors`` +
``adapter_config.json``: the folder ``peft.PeftModel.from_pretrained`` and
vLLM's ``--enable-lora`` / ``load_lora_adapter`` read.
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import save_file

from .errors import MissingDependencyError, TargetMismatchError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter(files: Mapping[str, Any]) -> bool:
    """Whether a version's recorded files mark it as a PEFT adapter."""
    return ADAPTER_CONFIG in files


def peft_adapter(model: Any, adapter_name: str | None = None) -> tuple[dict[str, torch.Tensor], bytes]:
    """``(tensors, adapter_config.json bytes)`` of a PEFT model's adapter, as ``save_pretrained`` writes them.

    The tensors are the live (detached) parameters, not copies. ``adapter_name``
    defaults to the model's active adapter. Raises :class:`TargetMismatchError`
    for a model that is not a PEFT model or lacks the adapter, and
    :class:`deltastore.errors.MissingDependencyError` without ``peft``.
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs or not hasattr(model, "base_model"):
        raise TargetMismatchError(f"adapter_only=True needs a PEFT model (peft.PeftModel), got {type(model).__name__}")
    try:
        import peft  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise MissingDependencyError(f"adapter_only=True needs peft: pip install 'deltastore[peft]' ({e})") from e
    name = adapter_name or getattr(model, "active_adapter", None) or next(iter(configs))
    if name not in configs:
        raise TargetMismatchError(f"the PEFT model has no adapter {name!r} (it has {sorted(configs)})")
    tensors = peft.get_peft_model_state_dict(model, adapter_name=name)
    tensors = {k: v.detach() for k, v in tensors.items()}
    return tensors, _config_bytes(model, configs[name])


def _config_bytes(model: Any, config: Any) -> bytes:
    """``adapter_config.json`` exactly as ``PeftModel.save_pretrained`` writes it (inference mode, base path)."""
    original, config = config, copy.deepcopy(config)
    for key, value in vars(original).items():
        # PEFT writes a set as list(deepcopy(it)) of the live config; a set copied twice may iterate otherwise
        if isinstance(value, set):
            setattr(config, key, list(copy.deepcopy(value)))
    if config.base_model_name_or_path is None:
        inner = model.base_model if config.is_prompt_learning else getattr(model.base_model, "model", model.base_model)
        config.base_model_name_or_path = inner.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None and hasattr(model, "_get_base_model_class"):
        cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d, auto_mapping_dict=auto_mapping)
        with open(os.path.join(d, ADAPTER_CONFIG), "rb") as f:
            return f.read()


def record_config(store: Any, files: dict[str, dict[str, Any]], data: bytes) -> dict[str, dict[str, Any]]:
    """``files`` with ``adapter_config.json`` = ``data`` (stored once: the object is content-addressed)."""
    rec = files.get(ADAPTER_CONFIG)
    if rec is not None and rec["digest"] == "sha256:" + hashlib.sha256(data).hexdigest():
        return files
    return {**files, ADAPTER_CONFIG: {"digest": store.put_object(data), "size": len(data)}}


def write_adapter_folder(state: Mapping[str, torch.Tensor], out_dir: str | os.PathLike[str], step: int) -> list[str]:
    """Write ``adapter_model.safetensors`` (one file, as PEFT saves it) into ``out_dir``; returns its name.

    ``adapter_config.json`` is written by the caller with the other recorded files.
    """
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, ADAPTER_WEIGHTS),
              metadata={"format": "pt", "deltastore_step": str(step)})
    return [ADAPTER_WEIGHTS]
