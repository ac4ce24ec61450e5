"""Registering the ``"deltastore"`` weight-transfer backend with vLLM (no vLLM import until called)."""

from __future__ import annotations


def register_weight_transfer_backend() -> bool:
    """Register the ``"deltastore"`` weight-transfer backend with vLLM's factory (idempotent).

    Called by vLLM itself in every vLLM process through the
    ``vllm.general_plugins`` entry point when deltastore is installed, and when
    :mod:`deltastore.integrations.vllm.worker` is imported in a vLLM process
    (``--worker-extension-cls``). Returns False when the installed vLLM has no
    weight-transfer API.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # type: ignore
    except ImportError:
        return False
    if "deltastore" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("deltastore", "deltastore.integrations.vllm.engine",
                                                    "DeltaStoreWeightTransferEngine")
    return True
