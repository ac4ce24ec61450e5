"""Serve the newest LoRA adapter version from a store in vLLM, keeping the last K versions loaded.

The trainer publishes with ``Publisher(uri, adapter_only=True)``. A
:class:`LoraFollower` polls the store; for each new version it writes the
adapter folder (``deltastore.pull.materialize``: ``adapter_model.safetensors`` +
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

import http.client
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
from ..errors import ApplyError, EngineUnavailableError, TargetMismatchError
from ..pull.materialize import materialize
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

    ``alias``: also re-point the stable name itself at each version. Requests
    naming it then reach the newest version without knowing its step, but a
    request still running on the previous version shares its name with new
    ones, which vLLM's batching treats as one adapter: use it only where
    overlapping versions are acceptable; requests that must finish on their
    version name ``<name>@<step>``. The alias is re-loaded in place
    (``load_inplace``; on a vLLM without in-place loads it is unloaded, then
    loaded). When that fails, it is pointed back at the folder it had, so the
    server serves what it served before; a :meth:`load` that fails also
    unloads the ``<name>@<step>`` it loaded, then raises.

    Errors: :class:`ApplyError` when the server refuses (its status and
    answer in the message), :class:`EngineUnavailableError` (also a
    ``ConnectionError``) when it cannot be reached or does not answer within
    ``timeout`` seconds.
    """

    _LOAD, _UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"

    def __init__(self, base_url: str, *, alias: bool = False, timeout: float = 120.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.alias = alias
        self.timeout = timeout
        self.api_key = api_key
        self._alias_path: str | None = None  # the folder the stable name was last pointed at
        self._stale: set[str] = set()  # names a failed load may have left loaded, unloaded at the next load

    def _post(self, route: str, body: dict[str, Any]) -> tuple[int, str]:
        """POST ``body`` to ``route``: the answer's status and (the start of) its text. Raises
        :class:`EngineUnavailableError` when no answer comes."""
        req = urllib.request.Request(self.base_url + route, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, r.read(500).decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read(500).decode(errors="replace")
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out (URLError is an OSError)
            reason = getattr(e, "reason", e)
            raise EngineUnavailableError(f"{self.base_url}{route}: no answer from the vLLM server "
                                         f"({type(reason).__name__}: {reason}; timeout {self.timeout} s)") from e

    def _require(self, route: str, answer: tuple[int, str], *, ok_missing: bool = False) -> None:
        status, detail = answer
        if 200 <= status < 300 or (ok_missing and status == 404):
            return
        if status == 404 and '"error"' not in detail:  # no such route (vLLM's own errors are {"error": ...})
            raise ApplyError(f"{self.base_url}{route}: 404, no such route (start the server with --enable-lora and "
                             f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): {detail}")
        raise ApplyError(f"{self.base_url}{route} answered {status}: {detail}")

    def load(self, name: str, path: str) -> str:
        """Load folder ``path`` as adapter ``name`` (and, with ``alias``, point the stable name at it).
        Returns ``name``; on a failure nothing this call loaded stays loaded (when the server cannot be
        reached to unload it, the next call unloads it first)."""
        for stale in sorted(self._stale):
            self._unload_quietly(stale)
        answer: tuple[int, str] | None = None
        try:
            answer = self._post(self._LOAD, {"lora_name": name, "lora_path": path})
            self._require(self._LOAD, answer)
            if self.alias:
                self._point_alias(name.rsplit("@", 1)[0], path)
        except BaseException:
            if answer is None or not 400 <= answer[0] < 500:  # it may be loaded (or is): take it back
                self._unload_quietly(name)
            raise
        return name

    def _point_alias(self, stable: str, path: str) -> None:
        """Point the stable name at ``path``; on a failure point it back at the folder it had (when this
        control knows one) and raise."""
        previous = self._alias_path
        try:
            self._repoint(stable, path)
        except BaseException as e:
            if previous is not None:  # a refused in-place load keeps it, but a late one may have landed
                try:
                    self._repoint(stable, previous)
                except Exception as again:
                    raise ApplyError(f"re-pointing adapter {stable!r} at {path} failed ({e}) and pointing it back "
                                     f"at {previous} failed too ({again}): {stable!r} may not be served") from e
            raise
        self._alias_path = path

    def _repoint(self, stable: str, path: str) -> None:
        answer = self._post(self._LOAD, {"lora_name": stable, "lora_path": path, "load_inplace": True})
        if answer[0] == 400 and "already been loaded" in answer[1]:  # a vLLM without in-place loads
            self._require(self._UNLOAD, self._post(self._UNLOAD, {"lora_name": stable}), ok_missing=True)
            answer = self._post(self._LOAD, {"lora_name": stable, "lora_path": path})
        self._require(self._LOAD, answer)

    def _unload_quietly(self, name: str) -> None:
        try:
            status, _ = self._post(self._UNLOAD, {"lora_name": name})
        except EngineUnavailableError as e:
            status = 0
            log.warning("deltastore: could not unload adapter %r after a failed load (tried again at the next "
                        "load): %s", name, e)
        if status in (200, 404):
            self._stale.discard(name)
        else:
            self._stale.add(name)

    def unload(self, handle: Any) -> None:
        self._require(self._UNLOAD, self._post(self._UNLOAD, {"lora_name": handle}), ok_missing=True)


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
