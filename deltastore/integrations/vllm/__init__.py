"""vLLM integration: pull versions from a store into a running engine, bit-exactly.

Ways in, one applier underneath (see ``docs/vllm.md``):

* the worker extension :class:`DeltaStoreWorkerExtension` (:mod:`.worker`),
  called with ``llm.collective_rpc("deltastore_pull", ...)`` or :func:`pull`;
* the weight-transfer backend ``"deltastore"`` (:mod:`.engine`), driven by
  vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``
  with ``update_info={"uri": ..., "step": ...}``;
* the pull-only :class:`Follower` (:mod:`.follower`) with a server control:
  :class:`LLMControl` (in-process ``LLM``) or :class:`HTTPControl` (a
  ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1``, which is what
  registers the routes it uses), as a sidecar (``python -m
  deltastore.integrations.vllm follow ...``, :mod:`.cli`).

Modules: :mod:`.applier` (the transaction and the three apply paths),
:mod:`.loaders` (vLLM's reload and native sparse loader, per version),
:mod:`.mapping` (checkpoint -> parameter coordinates), :mod:`.stage` (a pull
staged and verified before any write), :mod:`.checkpoint`, :mod:`.client`,
:mod:`._rpc`. Importing this package imports no vLLM.
"""

from ._rpc import raise_error
from .applier import PATHS, VllmApplier, applier_for
from .client import combine_verify, pull, verify, version
from .follower import Follower, HTTPControl, LLMControl
from .loaders import native_patch_loader, post_reload_resets, reload_weights_fn, vllm_reload_fn
from .register import register_weight_transfer_backend
from .worker import DeltaStoreWorkerExtension

__all__ = [
    "PATHS", "DeltaStoreWorkerExtension", "Follower", "HTTPControl", "LLMControl", "VllmApplier", "applier_for",
    "combine_verify", "native_patch_loader", "post_reload_resets", "pull", "raise_error",
    "register_weight_transfer_backend", "reload_weights_fn", "verify", "version", "vllm_reload_fn",
]
