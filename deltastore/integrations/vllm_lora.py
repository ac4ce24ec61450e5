"""Serve the newest LoRA adapter version from a store in vLLM, keeping the last K versions loaded.

The trainer publishes with ``Publisher(uri, adapter_only=True)``. A
:class:`LoraFollower` polls the store; for each new version it writes the
adapter folder (``deltastore.materialize``: ``adapter_model.safetensors`` +
``adapter_config.json``) under ``work_dir`` and loads it through vLLM's own
LoRA API, then unloads (and deletes) versions beyond the newest ``keep``.

vLLM identifies an adapter by its *name* inside a batch (``LoRARequest``
hashes and compares by ``lora_name``), so two versions in flight at once must
not share a name: every version is loaded as ``"<name>@<step>"`` with its own
id. The stable name is the follower's: :meth:`LoraFollower.lora_request` (an
offline ``vllm.LLM``) or :meth:`LoraFollower.served_name` (a server) always give
the newest version, and a request started on a version keeps it until it
finishes, as long as fewer than ``keep`` newer versions arrived meanwhile:
choose ``keep >= the trainer's allowed staleness + 1`` and start vLLM with
``--enable-lora --max-loras >= keep --max-lora-rank >= r`` (a server also needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` for ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``).

Controls: :class:`EngineLoraControl` (``LLM.llm_engine.add_lora`` /
``remove_lora``) and :class:`HTTPLoraControl` (the two routes; with
``alias=True`` it also re-points the stable name itself, see its docstring).
No vLLM import at module level.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..adapters import is_adapter
from ..errors import ApplyError, TargetMismatchError
from ..materialize import materialize
from ..store import open_store
from ._polling import PollingLoop

log = logging.getLogger("deltastore.vllm_lora")

__all__ = ["EngineLoraControl", "HTTPLoraControl", "LoraFollower"]


class EngineLoraControl:
    """Adapters of an offline engine (``vllm.LLM`` built with ``enable_lora=True``)."""

    def __init__(self, llm: Any, first_id: int = 1):
        self.llm = llm
        self._ids = itertools.count(first_id)

    def load(self, name: str, path: str) -> Any:
        """Load the folder as a new adapter ``name``; returns its ``LoRARequest``. Raises :class:`ApplyError`."""
        from vllm.lora.request import LoRARequest

        req = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
        try:
            ok = self.llm.llm_engine.add_lora(req)
        except Exception as e:
            raise ApplyError(f"vLLM could not load adapter {name!r} from {path}: {type(e).__name__}: {e}") from e
        if not ok:
            raise ApplyError(f"vLLM refused adapter {name!r} from {path}")
        return req

    def unload(self, handle: Any) -> None:
        self.llm.llm_engine.remove_lora(handle.lora_int_id)

    def loaded(self) -> set[int]:
        return set(self.llm.llm_engine.list_loras())


class HTTPLoraControl:
    """Adapters of an OpenAI-compatible vLLM server (``vllm serve --enable-lora``,
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) through ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

    ``alias``: also (re)load the stable name itself on each version (unload,
    then load with the new path). Requests naming it then reach the newest
    version without knowing its step, but a request still running on the
    previous version shares its name with new ones, which vLLM's batching
    treats as one adapter: use it only where overlapping versions are
    acceptable; requests that must finish on their version name ``<name>@<step>``.
    """

    def __init__(self, base_url: str, *, alias: bool = False, timeout: float = 120.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.alias = alias
        self.timeout = timeout
        self.api_key = api_key

    def _post(self, route: str, body: dict[str, Any], ok_missing: bool = False) -> None:
        req = urllib.request.Request(self.base_url + route, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                r.read()
        except urllib.error.HTTPError as e:
            if ok_missing and e.code == 404:
                return
            detail = e.read().decode(errors="replace")[:500]
            if e.code == 404 and route == "/v1/load_lora_adapter":
                raise ApplyError(f"{self.base_url}{route}: 404 (start the server with --enable-lora and "
                                 f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): {detail}") from None
            raise ApplyError(f"{self.base_url}{route} answered {e.code}: {detail}") from None

    def load(self, name: str, path: str) -> str:
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if self.alias:
            stable = name.rsplit("@", 1)[0]
            self._post("/v1/unload_lora_adapter", {"lora_name": stable}, ok_missing=True)
            self._post("/v1/load_lora_adapter", {"lora_name": stable, "lora_path": path})
        return name

    def unload(self, handle: Any) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": handle}, ok_missing=True)


@dataclass
class _Loaded:
    step: int
    name: str
    path: str
    handle: Any


class LoraFollower(PollingLoop):
    """Keep a vLLM engine on the newest adapter version of a store, the last ``keep`` versions loaded.

    Args:
        control: :class:`EngineLoraControl` or :class:`HTTPLoraControl`.
        uri: the store the trainer publishes to with ``adapter_only=True``.
        work_dir: where adapter folders are written (the engine must read it).
        name: the stable adapter name; version ``k`` is loaded as ``"<name>@<k>"``.
        keep: versions kept loaded (>= the trainer's allowed staleness + 1; vLLM's
            ``--max-loras`` must be at least this).
        poll_interval: seconds between listings of the store (:meth:`run`).

    Raises :class:`TargetMismatchError` (from :meth:`apply`) for a version that is not an adapter.
    """

    _thread_name = "deltastore-lora-follower"
    _poll_failure = "deltastore: adapter follower could not load (still serving step %s): %s: %s"
    _poll_log = log

    def __init__(self, control: Any, uri: str, work_dir: str | os.PathLike[str], *, name: str = "policy",
                 keep: int = 2, poll_interval: float = 5.0, storage_options: dict[str, Any] | None = None):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        if "@" in name or "/" in name:
            raise ValueError(f"adapter name {name!r} may not contain '@' or '/'")
        self.control = control
        self.store = open_store(uri, **(storage_options or {}))
        self.work_dir = os.fspath(work_dir)
        self.name = name
        self.keep = keep
        self.poll_interval = poll_interval
        self.loaded: list[_Loaded] = []  # oldest first
        self.last_error: str | None = None
        self._init_polling()
        self._lock = threading.Lock()
        os.makedirs(self.work_dir, exist_ok=True)

    @property
    def served_step(self) -> int | None:
        return self.loaded[-1].step if self.loaded else None

    def served_name(self) -> str | None:
        """The name of the newest loaded version (``"<name>@<step>"``), or None."""
        return self.loaded[-1].name if self.loaded else None

    def lora_request(self) -> Any:
        """The handle of the newest loaded version (a ``LoRARequest`` with :class:`EngineLoraControl`)."""
        if not self.loaded:
            raise LookupError(f"no version of adapter {self.name!r} is loaded yet")
        return self.loaded[-1].handle

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "served_step": self.served_step, "served_name": self.served_name(),
                "loaded_steps": [x.step for x in self.loaded], "latest_step": self.store.latest(),
                "last_error": self.last_error}

    def poll_once(self) -> dict[str, Any] | None:
        """Load the newest version if it is newer than the one served; returns :meth:`status` or None."""
        latest = self.store.latest()
        if latest is None or (self.served_step is not None and latest <= self.served_step):
            return None
        return self.apply(latest)

    def apply(self, step: int) -> dict[str, Any]:
        """Write version ``step``'s folder, load it, then unload versions beyond ``keep``. On an error the
        engine keeps what it had loaded (the new folder is removed)."""
        with self._lock:
            if not is_adapter(self.store.manifest(step).files):
                raise TargetMismatchError(f"version {step} of {self.store.uri} is not a PEFT adapter "
                                          "(publish it with adapter_only=True)")
            name = f"{self.name}@{step}"
            path = os.path.join(self.work_dir, f"{self.name}-{step:012d}")
            tmp = path + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                materialize(self.store, step, tmp)
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)  # the engine only ever sees whole folders
                handle = self.control.load(name, path)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                if not any(x.path == path for x in self.loaded):
                    shutil.rmtree(path, ignore_errors=True)
                self.last_error = f"{type(e).__name__}: {e}"
                raise
            self.loaded.append(_Loaded(step, name, path, handle))
            while len(self.loaded) > self.keep:
                old = self.loaded.pop(0)
                try:
                    self.control.unload(old.handle)
                finally:
                    shutil.rmtree(old.path, ignore_errors=True)
            self.last_error = None
            log.info("deltastore: adapter %s serves step %d (%d loaded)", self.name, step, len(self.loaded))
            return self.status()
