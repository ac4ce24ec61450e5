"""The follower inside ``vllm serve``, without ``VLLM_SERVER_DEV_MODE``: ``--middleware``.

What vLLM 0.32 offers (checked in its source): no hook runs worker-extension
code between engine steps — vLLM appends the extension to the worker's bases
and refuses any name the worker already has (``v1/worker/worker_base.py``),
so it cannot wrap ``execute_model``; ``EngineCore.post_step`` only handles
draft tokens; ``vllm.general_plugins`` entry points run once at process start.
The HTTP routes a sidecar follower needs (``/collective_rpc``, ``/pause``,
``/resume``, the weight-transfer routes, ``/reset_prefix_cache``) are registered
only with ``VLLM_SERVER_DEV_MODE=1`` (``entrypoints/launchers/api_server/routers.py``).

What it does offer without dev mode: ``--middleware MODULE.CLASS`` (an ASGI
middleware the API server imports, a documented ``vllm serve`` option). Its
process holds the engine client (``app.state.engine_client``), whose
``pause_generation(mode="keep")``, ``collective_rpc``, ``reset_prefix_cache``
and ``update_weight_version`` the engine core services between steps. So::

    DELTASTORE_FOLLOW_URI=s3://bucket/run vllm serve ./base-model \\
        --worker-extension-cls deltastore.integrations.vllm.DeltaStoreWorkerExtension \\
        --middleware deltastore.integrations.vllm.serve_follower.FollowStore

runs :class:`~deltastore.integrations.vllm.follower.Follower` in a thread of
the API server, driving the engine through the engine client; no route is
added or needed. Configuration (environment): ``DELTASTORE_FOLLOW_URI``
(required), ``DELTASTORE_FOLLOW_POLL`` (seconds, default 5),
``DELTASTORE_FOLLOW_MAX_LAG`` (0), ``DELTASTORE_FOLLOW_MAX_WAIT``,
``DELTASTORE_FOLLOW_STORAGE_OPTIONS`` (JSON), ``DELTASTORE_FOLLOW_STATUS_FILE``,
``DELTASTORE_FOLLOW_VERIFY=1`` (after every apply, check the served weights'
checksums against the manifest and record the verdict in the apply result and
the status file: the only way to see them without the dev-mode routes),
``DELTASTORE_TRUSTED_KEYS`` (public keys: only versions they signed are applied,
by the follower and by every worker; ``docs/security.md``) with
``DELTASTORE_FOLLOW_MAX_LATEST_AGE`` (seconds: refuse a signed latest older than that).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from ._rpc import as_bool, as_dict, results
from ...signing import keys_from_env
from .client import combine_verify
from .follower import Follower

log = logging.getLogger("vllm.deltastore")


class EngineClientControl:
    """Follower control over vLLM's engine client, called from a thread other than the server's event loop."""

    def __init__(self, engine_client: Any, loop: asyncio.AbstractEventLoop, timeout: float = 600.0,
                 verify: bool = False):
        self.ec, self.loop, self.timeout, self.verify = engine_client, loop, timeout, verify

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)

    def _rpc(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        return results(self._run(self.ec.collective_rpc(method, kwargs=dict(kwargs, raise_errors=False))))

    def pause(self) -> None:
        self._run(self.ec.pause_generation(mode="keep", clear_cache=False))

    def resume(self) -> None:
        self._run(self.ec.resume_generation())

    def prefetch(self, uri: str, step: int, storage_options: dict[str, Any],
                 trusted_keys: list[str] | None = None) -> None:
        self._rpc("deltastore_prefetch", uri=uri, step=step, storage_options=storage_options,
                  trusted_keys=trusted_keys)

    def apply(self, uri: str, step: int, storage_options: dict[str, Any],
              trusted_keys: list[str] | None = None) -> dict[str, Any]:
        out = self._rpc("deltastore_pull", uri=uri, step=step, storage_options=storage_options,
                        trusted_keys=trusted_keys)[0]
        if self.verify:
            report = combine_verify(self._rpc("deltastore_verify"))
            out["verify"] = {"ok": report["ok"], "step": report.get("step"), "bad": report.get("bad", [])[:5],
                             "unproven": report.get("unproven", [])[:5]}
        return out

    def reset_prefix_cache(self) -> None:
        self._run(self.ec.reset_prefix_cache())

    def set_version(self, label: str) -> None:
        fn = getattr(self.ec, "update_weight_version", None)
        if fn is not None:
            self._run(fn(label))

    def served(self) -> dict[str, Any] | None:
        res = self._run(self.ec.collective_rpc("deltastore_version"))
        return res[0] if res else None


class FollowStore:
    """ASGI middleware (``vllm serve --middleware deltastore.integrations.vllm.serve_follower.FollowStore``):
    passes every request through untouched and, from server start to shutdown, keeps the engine on the
    newest version of ``DELTASTORE_FOLLOW_URI``. Raises ValueError at start when that variable is unset."""

    def __init__(self, app: Any):
        self.app = app
        self.follower: Follower | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def wrapped_receive() -> dict[str, Any]:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._start(scope["app"].state.engine_client, asyncio.get_running_loop())
            elif msg["type"] == "lifespan.shutdown":
                self.stop()
            return msg
        return await self.app(scope, wrapped_receive, send)

    def _start(self, engine_client: Any, loop: asyncio.AbstractEventLoop) -> None:
        uri = os.environ.get("DELTASTORE_FOLLOW_URI")
        if not uri:
            raise ValueError("FollowStore needs DELTASTORE_FOLLOW_URI (the store to follow)")
        max_wait = os.environ.get("DELTASTORE_FOLLOW_MAX_WAIT")
        opts = dict(poll_interval=float(os.environ.get("DELTASTORE_FOLLOW_POLL", "5")),
                    max_lag=int(os.environ.get("DELTASTORE_FOLLOW_MAX_LAG", "0")),
                    max_wait=float(max_wait) if max_wait else None,
                    storage_options=as_dict(os.environ.get("DELTASTORE_FOLLOW_STORAGE_OPTIONS")),
                    status_file=os.environ.get("DELTASTORE_FOLLOW_STATUS_FILE") or None,
                    trusted_keys=keys_from_env(),
                    max_latest_age=float(age) if (age := os.environ.get("DELTASTORE_FOLLOW_MAX_LATEST_AGE")) else None)
        control = EngineClientControl(engine_client, loop,
                                      verify=as_bool(os.environ.get("DELTASTORE_FOLLOW_VERIFY", "0")))

        def run() -> None:  # off the event loop: the control blocks on coroutines it submits to it
            self.follower = Follower(control, uri, **opts)
            self.follower._poll_log = log  # a refused version must reach the server's log: vLLM's logger tree
            log.info("deltastore: following %s (poll %.1fs, max_lag %d)", uri, opts["poll_interval"],
                     opts["max_lag"])
            if not self._stop.is_set():
                self.follower.run()  # errors are logged; the engine keeps its version

        self._thread = threading.Thread(target=run, name="deltastore-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.follower is not None:
            self.follower.stop()
