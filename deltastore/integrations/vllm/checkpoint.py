"""The engine's own checkpoint files as flat bit tensors (the reload path's host mirror after ``identify``)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ...errors import TargetMismatchError, VersionNotFoundError
from ...tensors import bits_dtype

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def model_dir(vllm_config: Any) -> str:
    """The engine's local model directory; raises VersionNotFoundError when it is not one."""
    path = getattr(getattr(vllm_config, "model_config", None), "model", None)
    if not path or not os.path.isdir(path):
        raise VersionNotFoundError(f"the engine's model {path!r} is not a local directory; pass checkpoint_dir= "
                                   "or pull without identify (the first pull then loads a whole version)")
    return path


def read_checkpoint(path: str, specs: Specs) -> dict[str, torch.Tensor]:
    """Every tensor of ``specs`` from the ``*.safetensors`` files in ``path``, as flat bits.

    Raises TargetMismatchError when a tensor is missing or its dtype/size differs.
    """
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for name in st.keys():
                if name in specs:
                    t = st.get_tensor(name)
                    out[name] = t.contiguous().reshape(-1).view(bits_dtype(t.dtype)).clone()
    missing = [n for n in specs if n not in out]
    if missing:
        raise TargetMismatchError(f"checkpoint {path} lacks {len(missing)} tensor(s) of the version: {missing[:5]}")
    for n, (dtype, shape) in specs.items():
        if out[n].dtype != bits_dtype(dtype) or out[n].numel() != math.prod(shape):
            raise TargetMismatchError(f"checkpoint tensor {n!r} does not match the version's {dtype}{list(shape)}")
    return out
