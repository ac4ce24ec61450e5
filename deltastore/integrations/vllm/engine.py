"""The ``"deltastore"`` weight-transfer backend for vLLM (imports vLLM; load it only inside vLLM).

Served with ``--weight-transfer-config '{"backend": "deltastore"}'`` (the
backend is registered by vLLM's ``vllm.general_plugins`` entry point when
deltastore is installed, and when :mod:`deltastore.integrations.vllm.worker` is
imported in the worker through ``--worker-extension-cls``). The standard routes then
pull from a store instead of receiving tensors::

    POST /init_weight_transfer_engine  {"init_info": {"uri": "s3://bucket/run"}}          (optional)
    POST /start_weight_update
    POST /update_weights               {"update_info": {"uri": "s3://bucket/run", "step": 120}}
    POST /finish_weight_update         {"weight_version": "120"}

``update_info`` fields: ``uri`` (default: the one from init), ``step``
(default: latest), ``allow_anchor`` (default true), ``path``
(``auto``/``sparse``/``reload``), ``storage_options``, ``trusted_keys`` (OpenSSH lines or paths: only
versions signed by one of them are applied; the worker's ``DELTASTORE_TRUSTED_KEYS`` wins when set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found]
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...errors import VersionNotFoundError
from ._rpc import as_keys
from .applier import applier_for
from .loaders import vllm_reload_fn


@dataclass
class DeltaStoreInitInfo(WeightTransferInitInfo):
    uri: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    trusted_keys: list[str] | None = None


@dataclass
class DeltaStoreUpdateInfo(WeightTransferUpdateInfo):
    uri: str | None = None
    step: int | None = None
    allow_anchor: bool = True
    path: str | None = None
    storage_options: dict[str, Any] | None = None
    trusted_keys: list[str] | None = None


class DeltaStoreWeightTransferEngine(WeightTransferEngine[DeltaStoreInitInfo, DeltaStoreUpdateInfo]):
    """Each ``update_weights`` call pulls one version from the store and applies it (all or nothing)."""

    init_info_cls = DeltaStoreInitInfo
    update_info_cls = DeltaStoreUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.uri: str | None = None
        self.storage_options: dict[str, Any] = {}
        self.trusted_keys: list[str] | None = None
        self.last_result: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: DeltaStoreInitInfo) -> None:
        self.uri = init_info.uri or None
        self.storage_options = dict(init_info.storage_options or {})
        self.trusted_keys = as_keys(init_info.trusted_keys)

    def start_weight_update(self) -> None:
        pass  # nothing to prepare: a pull stages and verifies everything before it writes

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DeltaStoreUpdateInfo) -> None:
        uri = update_info.uri or self.uri
        if not uri:
            raise VersionNotFoundError("no store: pass update_info={'uri': ...} or init_info={'uri': ...}")
        # vLLM's layer-wise reload_weights, imported from where this vLLM keeps it. The worker's
        # finish_weight_update resets the LoRA state afterwards (vLLM's own weight-transfer contract);
        # the encoder/multimodal caches are only reachable through the worker extension's runner.
        applier = applier_for(self.model, self.vllm_config, vllm_reload_fn(self.model, self.vllm_config))
        self.last_result = applier.pull(uri, update_info.step, allow_anchor=update_info.allow_anchor,
                                        path=update_info.path,
                                        storage_options=update_info.storage_options or self.storage_options,
                                        trusted_keys=as_keys(update_info.trusted_keys) or self.trusted_keys)

    def shutdown(self) -> None:
        pass
