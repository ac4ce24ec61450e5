"""Write one version as a Hugging Face-style safetensors checkpoint."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from .progress import ProgressArg
from .adapters import is_adapter, write_adapter_folder
from .quantize import served_config_json
from .store import DeltaStore
from .subscriber import Subscriber

DEFAULT_SHARD_BYTES = 5 << 30


def materialize(store: DeltaStore, step: int, out_dir: str | os.PathLike[str], *,
                shard_bytes: int = DEFAULT_SHARD_BYTES, progress: ProgressArg = None) -> list[str]:
    """Rebuild version ``step`` and write it to ``out_dir`` as safetensors.

    One ``model.safetensors`` when the model fits in ``shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json`` (the layout ``transformers`` and vLLM
    load). Files the Publisher recorded from its ``source_dir``
    (``config.json``, tokenizer files) are written beside them, so the folder
    loads with ``transformers`` and vLLM; for a quantized version (``fp8_block128``)
    ``config.json`` gains the matching ``quantization_config``. A version
    published with ``adapter_only=True`` is written as a PEFT adapter folder
    (``adapter_model.safetensors`` + ``adapter_config.json``). Returns the file names written; each
    has the mode any new file gets (0666 less the umask). ``progress`` is passed to
    :meth:`Subscriber.pull`. Raises what :meth:`Subscriber.pull` raises.
    """
    names = _materialize(store, step, out_dir, shard_bytes, progress)
    _follow_umask(out_dir, names)
    return names


def _follow_umask(out_dir: str | os.PathLike[str], names: list[str]) -> None:
    """Give the written files the mode any new file gets (0666 less the umask): safetensors writes 0600,
    which a server running as another user (a vLLM container on a shared volume) cannot read."""
    mode = 0o666 & ~current_umask()
    for name in names:
        os.chmod(os.path.join(out_dir, name), mode)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``); elsewhere
    by setting and restoring it (a file another thread creates in between gets mode 0666/0777)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _materialize(store: DeltaStore, step: int, out_dir: str | os.PathLike[str], shard_bytes: int,
                 progress: ProgressArg) -> list[str]:
    state = Subscriber(store).pull(step=step, progress=progress).state
    os.makedirs(out_dir, exist_ok=True)
    extra = []
    manifest = store.manifest(step)
    for fname, rec in manifest.files.items():
        data = store.get_object(rec["digest"], rec["size"])
        if fname == "config.json" and manifest.quantization is not None:  # load as the quantized model it is
            data = served_config_json(data, manifest.quantization)
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(data)
        extra.append(fname)
    if is_adapter(manifest.files):  # a PEFT adapter folder: adapter_model.safetensors + adapter_config.json
        return write_adapter_folder(state, out_dir, step) + extra
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt", "deltastore_step": str(step)}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return ["model.safetensors", *extra]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, Any] = {}
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + ["model.safetensors.index.json", *extra]
