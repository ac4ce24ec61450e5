"""A real HTTP server answering vLLM's runtime LoRA routes as ``vllm serve`` does (for LoRA follower tests).

A real vLLM server (``tests/test_vllm/lora_check.py``) takes minutes to start
and cannot be told to fail one load; this one answers in milliseconds, with
the same routes, bodies, status codes and state rules, copied from vLLM's
``OpenAIServingModels`` (``vllm/entrypoints/openai/models/serving.py``):

* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}``:
  400 when a field is missing, 400 "has already been loaded" when the name is
  loaded and ``load_inplace`` is not set, then the engine's load (here: the
  folder must hold ``adapter_config.json`` and ``adapter_model.safetensors``,
  else 404 "No adapter found"); only after the engine's load succeeded is the
  name (re)pointed at the path, so a failed in-place load keeps the previous one;
* ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 404 "cannot be found" when
  not loaded;
* ``GET /v1/models``: the loaded adapters (``id``, ``root`` = path);
* one lock per name, held for the whole load or unload, as vLLM's
  ``lora_resolver_lock``.

``inplace=False`` answers as a vLLM release without in-place loads (the field
is ignored, a loaded name is refused). Faults (``fail``): the next matching
load answers 500 (``InternalServerError``) after reading the folder and before
changing anything, or blocks there until an event is set (a slow engine).
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Failure:
    """The next load (``route="unload"``: unload) of ``name`` (or any name: None) answers ``status`` (after
    ``block`` is set, if given; a status below 400 then goes on as usual)."""

    name: str | None
    status: int = 500
    block: threading.Event | None = None
    route: str = "load"
    fired: int = 0


@dataclass
class LoraServer:
    inplace: bool = True
    loaded: dict[str, str] = field(default_factory=dict)  # name -> path
    log: list[tuple[str, str, int]] = field(default_factory=list)  # (route, name, status)
    failures: list[Failure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._state = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, doc: Any) -> None:
                body = json.dumps(doc).encode() if not isinstance(doc, str) else doc.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    return self._answer(404, {"detail": "Not Found"})
                with server._state:
                    data = [{"id": n, "object": "model", "root": p} for n, p in sorted(server.loaded.items())]
                self._answer(200, {"object": "list", "data": data})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                route = {"/v1/load_lora_adapter": server._load, "/v1/unload_lora_adapter": server._unload}.get(self.path)
                if route is None:
                    return self._answer(404, {"detail": "Not Found"})
                status, doc = route(body)
                server.log.append((self.path, str(body.get("lora_name")), status))
                try:
                    self._answer(status, doc)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a timeout test)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @staticmethod
    def _error(status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
        return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}

    def fail(self, name: str | None = None, status: int = 500, block: threading.Event | None = None,
             route: str = "load") -> Failure:
        f = Failure(name, status, block, route)
        self.failures.append(f)
        return f

    def _load(self, body: dict[str, Any]) -> tuple[int, Any]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return self._error(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        with self._locks[name]:
            inplace = bool(body.get("load_inplace")) and self.inplace
            if not inplace and name in self.loaded:
                return self._error(400, "InvalidUserInput", f"The lora adapter '{name}' has already been loaded. "
                                   "If you want to load the adapter in place, set 'load_inplace' to True.")
            # the engine reads the folder, then adds the adapter (which may fail, or hang)
            if not all(os.path.isfile(os.path.join(path, f)) for f in ("adapter_config.json",
                                                                         "adapter_model.safetensors")):
                return self._error(404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}")
            failed = self._injected("load", name)  # the engine's add_lora fails
            if failed is not None:
                return failed
            with self._state:
                self.loaded[name] = path
            return 200, f"Success: LoRA adapter '{name}' added successfully."

    def _injected(self, route: str, name: str) -> tuple[int, Any] | None:
        for f in self.failures:
            if f.fired == 0 and f.route == route and f.name in (None, name):
                f.fired += 1
                if f.block is not None:
                    f.block.wait(60)
                if f.status >= 400:
                    return self._error(f.status, "InternalServerError", f"injected engine failure ({route} {name})")
        return None

    def _unload(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body.get("lora_name")
        if not name:
            return self._error(400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
        with self._locks[name]:
            failed = self._injected("unload", name)
            if failed is not None:
                return failed
            with self._state:
                if name not in self.loaded:
                    return self._error(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
                del self.loaded[name]
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
