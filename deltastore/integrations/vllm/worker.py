"""The worker extension: ``--worker-extension-cls deltastore.integrations.vllm.DeltaStoreWorkerExtension``.

vLLM appends it to the worker's bases (a name clash is refused), so every
method is prefixed ``deltastore_`` and is reached with
``collective_rpc("deltastore_...")``. Importing this module inside a vLLM
process also registers the ``"deltastore"`` weight-transfer backend, so
``--weight-transfer-config '{"backend": "deltastore"}'`` works without the
package's entry point (a source checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

import torch

from ._rpc import as_bool as _as_bool
from ._rpc import as_dict as _as_dict
from ._rpc import as_int as _as_int
from ._rpc import as_keys as _as_keys
from ._rpc import error_dict as _error_dict
from .applier import VllmApplier, applier_for
from .loaders import post_reload_resets
from .register import register_weight_transfer_backend

log = logging.getLogger("deltastore.vllm")


def _wlog() -> logging.Logger:
    """Inside vLLM, log under its ``vllm`` logger tree so messages reach the server's log."""
    return logging.getLogger("vllm.deltastore") if "vllm" in sys.modules else log


class DeltaStoreWorkerExtension:
    """Mixed into every vLLM worker by ``--worker-extension-cls``.

    Every method is prefixed ``deltastore_`` (vLLM refuses extension names
    that clash with the worker's). Arguments are plain data; strings are
    accepted everywhere so the HTTP ``/collective_rpc`` route works too.
    """

    def _deltastore_applier(self) -> VllmApplier:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        vllm_config = getattr(self, "vllm_config", None)

        def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            # the worker's own reload: vLLM's reload_weights plus the runner's resets
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]

        def resets() -> None:
            post_reload_resets(self.model_runner)  # type: ignore[attr-defined]

        return applier_for(model, vllm_config, reload, resets=resets, prefer=True)

    def deltastore_pull(self, uri: str, step: int | str | None = None, allow_anchor: bool | str = True,
                        path: str | None = None, storage_options: dict[str, Any] | str | None = None,
                        raise_errors: bool | str = True, trusted_keys: list[str] | str | None = None
                        ) -> dict[str, Any]:
        """Apply version ``step`` (default: latest) of the store at ``uri``; returns what was done.

        ``trusted_keys`` (OpenSSH lines or paths; the worker's ``DELTASTORE_TRUSTED_KEYS`` wins when set):
        only versions signed by one of them are applied (``docs/security.md``).

        With ``raise_errors=False`` an error comes back as ``{"error": {"type",
        "message"}}`` (exception types do not survive vLLM's RPC); the engine
        keeps its previous version either way.
        """
        try:
            out = self._deltastore_applier().pull(uri, _as_int(step), allow_anchor=_as_bool(allow_anchor),
                                                  path=path or None, storage_options=_as_dict(storage_options),
                                                  trusted_keys=_as_keys(trusted_keys))
            _wlog().info("deltastore: serving step %d (%s path, %s route, %d elements written, apply %.3fs)",
                     out["step"], out["path"], out["route"], out["elements_written"], out["apply_s"])
            return out
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            _wlog().warning("deltastore: pull of %s step %s failed, still serving the previous version: %s: %s",
                        uri, step, type(e).__name__, e)
            return {"error": _error_dict(e), "version": self._deltastore_applier().describe()}

    def deltastore_prefetch(self, uri: str, step: int | str | None = None, allow_anchor: bool | str = True,
                            path: str | None = None, storage_options: dict[str, Any] | str | None = None,
                            raise_errors: bool | str = True, trusted_keys: list[str] | str | None = None
                            ) -> dict[str, Any]:
        """Fetch and verify the way to ``step`` without touching the weights (no pause needed)."""
        try:
            return self._deltastore_applier().prefetch(uri, _as_int(step), allow_anchor=_as_bool(allow_anchor),
                                                       path=path or None, storage_options=_as_dict(storage_options),
                                                       trusted_keys=_as_keys(trusted_keys))
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            return {"error": _error_dict(e)}

    def deltastore_identify(self, uri: str, step: int | str, storage_options: dict[str, Any] | str | None = None,
                            checkpoint_dir: str | None = None, raise_errors: bool | str = True,
                            trusted_keys: list[str] | str | None = None) -> dict[str, Any]:
        """Declare (after checking checksums) that the engine was started from version ``step``."""
        try:
            return self._deltastore_applier().identify(uri, int(step), storage_options=_as_dict(storage_options),
                                                       checkpoint_dir=checkpoint_dir or None,
                                                       trusted_keys=_as_keys(trusted_keys))
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            return {"error": _error_dict(e)}

    def deltastore_version(self) -> dict[str, Any] | None:
        """``{"step", "digest", "uri", "path"}`` of the served version, or None if unknown."""
        return self._deltastore_applier().describe()

    def deltastore_verify(self, raise_errors: bool | str = True) -> dict[str, Any]:
        """Per-tensor checksums of the served weights against the manifest (see :meth:`VllmApplier.verify_local`)."""
        try:
            return self._deltastore_applier().verify_local()
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            return {"error": _error_dict(e)}



if "vllm" in sys.modules:
    try:
        register_weight_transfer_backend()
    except Exception:  # never break a worker over an optional backend
        log.debug("could not register the deltastore weight-transfer backend", exc_info=True)
