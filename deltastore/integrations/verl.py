"""verl checkpoint-engine backend ``"deltastore"``: the actor publishes, rollout workers pull.

verl (0.9.1, ``verl/checkpoint_engine/base.py``) moves weights from the actor
to rollout replicas through a ``CheckpointEngine`` chosen by name from its
``CheckpointEngineRegistry``; ``checkpoint_engine.custom_backend_module`` names
a module verl imports on every worker before instantiating the backend, so a
third-party backend registers itself there. This module is that backend::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltastore
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=deltastore.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltastore.uri=s3://bucket/run

Contract, as verl drives it per update (``CheckpointEngineManager.update_weights``):
``prepare()`` on every worker, ``build_topology`` (nothing to wire: the store
is the rendezvous), ``init_process_group`` (each worker learns its role and
rank), then every actor rank runs ``send_weights(weights, global_steps)`` and
every rollout worker ``receive_weights(global_steps)``, then ``finalize()``.

* ``send_weights``: actor rank 0 publishes the streamed ``(name, tensor)``
  pairs as version ``global_steps`` (the other actor ranks drain the
  generator: under FSDP producing each full tensor is a collective). Returns
  metrics (``deltastore/kind``, ``changed``, ``bytes``).
* ``receive_weights``: pulls version ``global_steps`` (bit-exact, verified,
  anchor or deltas) into this worker's host copy and yields every tensor, in
  the store's order, for verl's server adapter to load. The host copy is
  updated in place, so after the first pull only the changed bits cross the
  network. On any error the typed deltastore error is raised and the host copy
  keeps its previous version.

verl calls ``receive_weights`` right after the actor side returns (the actor
and rollout calls are gathered together), so a rollout worker waits for the
version to appear, up to ``wait_s`` seconds. Importing this module imports verl.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # type: ignore[import-not-found]
from verl.workers.rollout.utils import ensure_async_iterator  # type: ignore[import-not-found]

from ..errors import VersionNotFoundError
from ..publish.publisher import Publisher, VersionInfo
from ..pull.subscriber import Subscriber


@CheckpointEngineRegistry.register("deltastore")
class DeltaStoreCheckpointEngine(CheckpointEngine):
    """verl ``CheckpointEngine`` over a deltastore store.

    Args:
        bucket_size: verl's transfer bucket (unused: objects are sized by the Publisher).
        uri: the store (``engine_kwargs.deltastore.uri``).
        storage_options: passed to the store backend.
        wait_s: how long ``receive_weights`` waits for version ``global_steps`` to appear.
        changed_only: after the first pull, yield only the tensors the pull changed (for a
            server adapter that loads a subset in place; verl's vLLM and SGLang adapters are
            given every tensor by default).
        dtype: publish floating-point weights in this dtype (default bf16; None: as they are).
        trusted_keys, max_latest_age: the rollout side's :class:`~deltastore.Subscriber` options: pull only
            versions signed by one of these public keys (paths or PEM/OpenSSH text), and refuse a signed latest
            older than ``max_latest_age`` seconds (``docs/security.md``).
        **publisher_options: any other :class:`~deltastore.Publisher` keyword argument (``signing_key``:
            sign every version).
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, *, uri: str, storage_options: dict[str, Any] | None = None,
                 wait_s: float = 600.0, changed_only: bool = False, dtype: torch.dtype | str | None = torch.bfloat16,
                 trusted_keys: Any = None, max_latest_age: float | None = None, **publisher_options: Any) -> None:
        self.bucket_size = bucket_size
        self.uri = uri
        self.storage_options = dict(storage_options or {})
        self.wait_s = float(wait_s)
        self.changed_only = changed_only
        self.trusted_keys, self.max_latest_age = trusted_keys, max_latest_age
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.publisher_options = dict(publisher_options, dtype=dtype)
        self.role = "actor"
        self.rank = 0
        self.publisher: Publisher | None = None
        self.subscriber: Subscriber | None = None
        self.state: dict[str, torch.Tensor] | None = None  # the rollout worker's host copy
        self.last: VersionInfo | None = None

    # -- topology: the store is the rendezvous ------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return ({"role": ["actor"] * actor_wg_world_size, "rank": list(range(actor_wg_world_size))},
                {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size))})

    def init_process_group(self, role: str = "actor", rank: int = 0, **kwargs: Any) -> None:
        self.role, self.rank = role, int(rank)

    def finalize(self) -> None:
        if self.publisher is not None:
            self.publisher.flush()

    # -- the two sides -------------------------------------------------------------------------------
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, Any]:
        """Publish ``weights`` as version ``global_steps`` (actor rank 0); drain them elsewhere."""
        if global_steps is None:
            raise ValueError("the deltastore checkpoint engine needs global_steps (the version to publish)")
        if self.role != "actor" or self.rank != 0:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        state = {}
        async for name, t in ensure_async_iterator(weights):
            state[name] = t.detach()
        if self.publisher is None:
            self.publisher = Publisher(self.uri, storage_options=self.storage_options,
                                       metadata={"trainer": "verl"}, **self.publisher_options)
        info = await asyncio.to_thread(self.publisher.publish, state, step=int(global_steps))
        del state
        assert isinstance(info, VersionInfo), "a background Publisher is not supported here"
        self.last = info
        return {"deltastore/kind": info.kind, "deltastore/changed": info.changed, "deltastore/bytes": info.nbytes}

    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Pull version ``global_steps`` (default: latest) into the host copy and yield every tensor."""
        if self.subscriber is None:
            self.subscriber = Subscriber(self.uri, storage_options=self.storage_options,
                                         trusted_keys=self.trusted_keys, max_latest_age=self.max_latest_age)
        sub = self.subscriber
        if global_steps is not None:
            deadline = time.monotonic() + self.wait_s
            while int(global_steps) not in sub.versions():
                if time.monotonic() > deadline:
                    raise VersionNotFoundError(f"version {global_steps} did not appear in {sub.store.uri} "
                                               f"within {self.wait_s:.0f}s")
                await asyncio.sleep(0.05)
        step = None if global_steps is None else int(global_steps)
        first = self.state is None
        res = await asyncio.to_thread(sub.pull, self.state, step=step)
        if first:
            self.state = res.state
        assert self.state is not None
        for name, t in self.state.items():
            if first or not self.changed_only or res.written.get(name):
                yield name, t
