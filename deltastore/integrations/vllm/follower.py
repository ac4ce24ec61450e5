"""The pull-only follower and the two server controls it drives (in-process ``LLM``, ``vllm serve`` over HTTP)."""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import Any

from ...errors import ApplyError, DeltaStoreError
from ...manifest import VersionRef
from ...pull.subscriber import Subscriber
from .._polling import PollingLoop
from ._rpc import error_dict as _error_dict
from ._rpc import results as _results
from .client import _set_weight_version, pull, version

log = logging.getLogger("deltastore.vllm")


class LLMControl:
    """Follower control for an in-process ``vllm.LLM`` (call :meth:`Follower.poll_once` between
    ``generate`` calls, or run the follower thread while no other thread drives the engine)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def pause(self) -> None:  # an offline LLM runs nothing between generate() calls
        pass

    def resume(self) -> None:
        pass

    def prefetch(self, uri: str, step: int, storage_options: dict[str, Any],
                 trusted_keys: list[str] | None = None) -> None:
        _results(self.llm.collective_rpc("deltastore_prefetch", kwargs={
            "uri": uri, "step": step, "storage_options": storage_options, "raise_errors": False,
            "trusted_keys": trusted_keys}))

    def apply(self, uri: str, step: int, storage_options: dict[str, Any],
              trusted_keys: list[str] | None = None) -> dict[str, Any]:
        return pull(self.llm, uri, step, storage_options=storage_options, reset_prefix_cache=False,
                    trusted_keys=trusted_keys)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def set_version(self, label: str) -> None:
        _set_weight_version(self.llm, label)

    def served(self) -> dict[str, Any] | None:
        return version(self.llm)


class HTTPControl:
    """Follower control for a ``vllm serve`` process over its HTTP routes.

    transport ``"rpc"`` uses ``/collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``
    and the worker extension); ``"weight-transfer"`` uses the standard
    ``/start_weight_update`` / ``/update_weights`` / ``/finish_weight_update``
    routes (needs ``--weight-transfer-config '{"backend": "deltastore"}'``).
    """

    def __init__(self, base_url: str, *, transport: str = "rpc", timeout: float = 600.0,
                 api_key: str | None = None):
        if transport not in ("rpc", "weight-transfer"):
            raise ValueError("transport must be 'rpc' or 'weight-transfer'")
        self.base = base_url.rstrip("/")
        self.transport = transport
        self.timeout = timeout
        self.api_key = api_key or os.environ.get("VLLM_API_KEY")
        self._warned_cache = False

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + route, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        out = self._call("POST", "/collective_rpc", {"method": method, "kwargs": {
            k: (v if isinstance(v, str) else json.dumps(v)) for k, v in kwargs.items()}})
        return (out or {}).get("results", [])

    def pause(self) -> None:
        self._call("POST", "/pause?mode=keep")

    def resume(self) -> None:
        self._call("POST", "/resume")

    def prefetch(self, uri: str, step: int, storage_options: dict[str, Any],
                 trusted_keys: list[str] | None = None) -> None:
        if self.transport == "rpc":
            _results(self._rpc("deltastore_prefetch", {"uri": uri, "step": str(step),
                                                       "storage_options": storage_options, "raise_errors": "false",
                                                       "trusted_keys": trusted_keys or ""}))

    def apply(self, uri: str, step: int, storage_options: dict[str, Any],
              trusted_keys: list[str] | None = None) -> dict[str, Any]:
        if self.transport == "rpc":
            res = _results(self._rpc("deltastore_pull", {"uri": uri, "step": str(step),
                                                         "storage_options": storage_options,
                                                         "raise_errors": "false", "trusted_keys": trusted_keys or ""}))
            return res[0]
        self._call("POST", "/start_weight_update")
        try:
            self._call("POST", "/update_weights", {"update_info": {"uri": uri, "step": step,
                                                                   "storage_options": storage_options,
                                                                   "trusted_keys": trusted_keys}})
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:2000]
            try:  # vLLM already ended the session on the failure; make sure it is closed
                self._call("POST", "/finish_weight_update", {})
            except urllib.error.HTTPError:
                pass
            raise ApplyError(f"/update_weights failed ({e.code}); the server keeps its previous version: "
                             f"{body}") from e
        self._call("POST", "/finish_weight_update", {"weight_version": str(step)})
        return {"step": step}

    def reset_prefix_cache(self) -> None:
        try:
            self._call("POST", "/reset_prefix_cache")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            if not self._warned_cache:
                log.warning("deltastore: /reset_prefix_cache is not served (set VLLM_SERVER_DEV_MODE=1); "
                            "prefix-cache entries computed with older weights may be reused")
                self._warned_cache = True

    def set_version(self, label: str) -> None:
        try:
            self._call("POST", "/update_weight_version", {"new_version": label})
        except urllib.error.HTTPError:
            pass

    def served(self) -> dict[str, Any] | None:
        if self.transport != "rpc":
            return None
        res = self._rpc("deltastore_version", {})
        return res[0] if res else None


class Follower(PollingLoop):
    """Watch a store and keep an engine on its newest version. No trainer connection needed.

    Args:
        control: :class:`LLMControl` or :class:`HTTPControl` (anything with
            pause/resume/prefetch/apply/reset_prefix_cache/set_version).
        uri: the store.
        poll_interval: seconds between listings of the store.
        max_lag: versions the engine may trail the newest before it applies
            (0: apply every new version as soon as it is seen; 2: apply every
            third one, fewer pauses at the cost of staleness).
        max_wait: seconds a newer version may wait under ``max_lag`` before it is applied anyway.
        status_file: if set, the served version is written there as JSON after every apply.
        trusted_keys: public keys (paths, PEM/OpenSSH text); only versions they signed are applied (the
            engine's workers check them too), the latest is the signed ``refs/latest`` and the follower never
            moves backward (``docs/security.md``).
        max_latest_age: with ``trusted_keys``, refuse (and report in :meth:`status`) a signed latest older
            than this many seconds: a frozen store or relay.
    """

    _thread_name = "deltastore-follower"
    _poll_failure = "deltastore: follower could not apply (still serving step %s): %s: %s"
    _poll_log = log

    def __init__(self, control: Any, uri: str, *, poll_interval: float = 5.0, max_lag: int = 0,
                 max_wait: float | None = None, storage_options: dict[str, Any] | None = None,
                 status_file: str | None = None, trusted_keys: Any = None, max_latest_age: float | None = None):
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        if max_lag < 0:
            raise ValueError("max_lag must be >= 0")
        self.control = control
        self.uri = uri
        self.poll_interval = poll_interval
        self.max_lag = max_lag
        self.max_wait = max_wait
        self.storage_options = dict(storage_options or {})
        self.status_file = status_file
        self.sub = Subscriber(uri, storage_options=self.storage_options, trusted_keys=trusted_keys,
                              max_latest_age=max_latest_age)
        trust = self.sub.store.trust
        #: the keys passed on to the engine's workers (OpenSSH lines); None without trusted keys
        self.trusted_keys = trust.texts() if trust is not None else None
        self.served_step: int | None = None
        self.last_pause_s: float | None = None
        self.last_error: dict[str, str] | None = None
        self.applied = 0
        self._first_seen: dict[int, float] = {}
        self._init_polling()
        try:
            cur = control.served()
            if cur and cur.get("step") is not None:
                self.served_step = int(cur["step"])
        except Exception:
            log.debug("could not read the served version", exc_info=True)

    def status(self) -> dict[str, Any]:
        try:
            latest = self.sub.latest()
        except DeltaStoreError as e:  # a refused latest (unsigned, rolled back, frozen): reported, not raised
            latest, self.last_error = None, _error_dict(e)
        return {"uri": self.uri, "served_step": self.served_step, "latest_step": latest,
                "lag": self._lag(latest), "applied": self.applied, "last_pause_s": self.last_pause_s,
                "last_error": self.last_error, "latest_age": self.sub.latest_check.age}

    def _lag(self, latest: int | None) -> int:
        if latest is None:
            return 0
        steps = self.sub.versions()
        return sum(1 for s in steps if self.served_step is None or s > self.served_step)

    def poll_once(self) -> dict[str, Any] | None:
        """Apply the newest version if the lag rules say so; returns the apply result or None."""
        steps = self.sub.versions()
        if self.trusted_keys is not None:  # the signed latest: no rollback, no freeze past max_latest_age
            try:
                latest = self.sub.latest_check.resolve(self.sub.store, steps, self._served_ref())
            except Exception as e:
                self.last_error = _error_dict(e)
                raise
            if latest is None:
                return None
        elif not steps:
            return None
        else:
            latest = steps[-1]
        if self.served_step is not None and latest <= self.served_step:
            return None
        lag = sum(1 for s in steps if self.served_step is None or s > self.served_step)
        now = time.monotonic()
        self._first_seen.setdefault(latest, now)
        waited_out = self.max_wait is not None and now - min(self._first_seen.values()) >= self.max_wait
        if self.served_step is not None and lag <= self.max_lag and not waited_out:
            return None
        return self.apply(latest)

    def _served_ref(self) -> VersionRef | None:
        return None if self.served_step is None else VersionRef(self.served_step, "")

    def _keys(self) -> dict[str, Any]:
        """The control's ``trusted_keys`` argument (none without keys: a control may not take it)."""
        return {} if self.trusted_keys is None else {"trusted_keys": self.trusted_keys}

    def apply(self, step: int) -> dict[str, Any]:
        """Prefetch (engine running), then pause in keep mode, apply, reset the prefix cache, resume."""
        try:
            self.control.prefetch(self.uri, step, self.storage_options, **self._keys())
        except Exception as e:  # a bad version: keep serving, report
            self.last_error = _error_dict(e)
            raise
        t0 = time.perf_counter()
        self.control.pause()
        try:
            result = self.control.apply(self.uri, step, self.storage_options, **self._keys())
            self.control.reset_prefix_cache()
        except Exception as e:
            self.last_error = _error_dict(e)
            raise
        finally:
            self.control.resume()
            self.last_pause_s = time.perf_counter() - t0
        self.control.set_version(str(step))
        self.served_step = step
        self.applied += 1
        self.last_error = None
        self._first_seen = {s: t for s, t in self._first_seen.items() if s > step}
        log.info("deltastore: serving step %d from %s (paused %.3fs)", step, self.uri, self.last_pause_s)
        if self.status_file:
            tmp = self.status_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"served_step": step, "uri": self.uri, "pause_s": self.last_pause_s,
                           "time": time.time(), "result": result}, f)
            os.replace(tmp, self.status_file)
        return result

