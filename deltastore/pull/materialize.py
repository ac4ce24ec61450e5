"""Write one version as a Hugging Face-style safetensors checkpoint."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .._gc import collector_paused
from ..adapters import is_adapter, write_adapter_folder
from ..errors import OutputWriteError
from ..manifest import Manifest
from ..progress import ProgressArg, reporting
from ..quantization import served_config_json
from ..store import DeltaStore
from .reader import VersionReader, log_pulled
from .staging import FullState

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
    has the mode any new file gets (0666 less the umask). ``progress``: as for
    :meth:`Subscriber.pull` (object bytes fetched).

    Every file is written into a hidden folder inside ``out_dir`` first and
    moved into place (a rename each) only once all are written, so a failure
    leaves the files ``out_dir`` held before as they were. Raises what
    :meth:`Subscriber.pull` raises, and :class:`OutputWriteError` (an
    ``OSError`` with the system's ``errno``) when writing fails (a full disk,
    a read-only or refused folder).
    """
    state = _read(store, step, progress)
    manifest = store.manifest(step)
    extra = {fname: store.get_object(rec["digest"], rec["size"]) for fname, rec in manifest.files.items()}
    stage = None
    try:
        os.makedirs(out_dir, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=".deltastore-partial-", dir=out_dir)
        written = _write_version(state, manifest, extra, stage, step, shard_bytes)
        _follow_umask(stage, written)  # before the files appear in out_dir
        for fname in written:
            os.replace(os.path.join(stage, fname), os.path.join(out_dir, fname))
    except (OSError, SafetensorError) as e:
        raise _write_error(e, step, out_dir) from e
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return written


def _read(store: DeltaStore, step: int, progress: ProgressArg) -> dict[str, torch.Tensor]:
    """Version ``step``'s tensors, read as a pull without a target reads them (around GC and corrupt
    objects, :meth:`VersionReader.replanning`)."""
    reader, t0 = VersionReader(store), time.perf_counter()
    with collector_paused(), reporting(progress, desc="pull"):
        staged = reader.replanning(lambda avoid: reader.stage(step, avoid=avoid, layout_changes=True))
    assert isinstance(staged.state, FullState)
    log_pulled(step, staged.path, staged.bytes_fetched, staged.versions_applied, t0)
    return staged.state.as_tensors()


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


def _write_error(e: OSError | SafetensorError, step: int, out_dir: str | os.PathLike[str]) -> OutputWriteError:
    """``e`` (raised writing files; safetensors reports its I/O errors as text) as :class:`OutputWriteError`."""
    if isinstance(e, OSError):
        code, what, path = e.errno or errno.EIO, e.strerror or str(e), e.filename
    else:
        found = re.search(r"os error (\d+)", str(e))
        code, what, path = int(found.group(1)) if found else errno.EIO, str(e), None
    return OutputWriteError(code, f"writing version {step} to {os.fspath(out_dir)} failed: {what}; the folder keeps "
                                  "the files it held", path)


def _write_version(state: dict[str, torch.Tensor], manifest: Manifest, extra: dict[str, bytes], out_dir: str,
                   step: int, shard_bytes: int) -> list[str]:
    """Write the version's files into ``out_dir``; their names, recorded files last."""
    for fname, data in extra.items():
        if fname == "config.json" and manifest.quantization is not None:  # load as the quantized model it is
            data = served_config_json(data, manifest.quantization)
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(data)
    if is_adapter(manifest.files):  # a PEFT adapter folder: adapter_model.safetensors + adapter_config.json
        return write_adapter_folder(state, out_dir, step) + list(extra)
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
