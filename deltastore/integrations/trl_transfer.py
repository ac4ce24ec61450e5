"""TRL's weight-sync plug point, served by a store: :class:`DeltaStoreWeightTransfer`.

TRL's ``trl.experimental.async_grpo.AsyncGRPOTrainer(weight_transfer=...)``
takes any object with TRL's ``WeightTransferProtocol`` methods
(``init_weight_transfer``, ``pause``, ``send_weights(iterator of (name,
tensor))``, ``resume``, ``destroy``; TRL 1.16, ``async_grpo_trainer.py``) and
calls them, on the main process, at train begin and every
``weight_sync_steps`` optimizer steps::

    from deltastore.integrations.trl import DeltaStoreWeightTransfer
    trainer = AsyncGRPOTrainer(..., weight_transfer=DeltaStoreWeightTransfer("s3://bucket/run"))

Each ``send_weights`` publishes the streamed tensors as one version. Its step
is the model version TRL tags the following rollouts with: TRL bumps
``trainer.model_version`` right after ``resume()``, so on a fresh store the
k-th sync is version k. Without :meth:`attach` the steps continue the store's
chain (its latest step + 1), which matches TRL's count only on a fresh store;
after resuming a run, ``attach(trainer)`` reads ``trainer.model_version``. Servers follow the store on their own
(``deltastore.integrations.vllm``: worker extension, weight-transfer backend or
Follower), so ``pause``/``resume`` do nothing by default; with ``control=`` (a
``deltastore.integrations.vllm`` ``HTTPControl``/``LLMControl``) the sync is a
synchronous swap instead: pause the server, publish, apply that version on it,
resume.

Memory: the tensors are streamed into ``Publisher.publish`` as TRL yields them;
on a chain whose layout the Publisher knows it compares them piece by piece
(64 MiB, ``deltastore/publish/stream.py``) and drops each piece, so besides its
mirror it holds one piece and the changes, also under FSDP2 (where TRL yields a
freshly gathered ``full_tensor()`` per parameter). The first version (an anchor
that becomes the mirror) and a version that changes the layout still take every
tensor at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

from ..publish.publisher import Publisher, VersionInfo
from ..signing import key_texts


class DeltaStoreWeightTransfer:
    """TRL ``WeightTransferProtocol`` implementation that publishes each sync to a deltastore store.

    Args:
        uri: the store URI, or a ready :class:`~deltastore.Publisher`.
        control: optional server control (``pause``/``resume``/``apply``/``reset_prefix_cache``/
            ``set_version``, as in :mod:`deltastore.integrations.vllm.follower`): makes the
            sync a synchronous swap on that server.
        dtype: publish floating-point weights in this dtype (default bf16; None: as they are).
        trusted_keys: with ``control``, the public keys the server checks each applied version against
            (default: the public half of ``signing_key`` when the Publisher signs; ``docs/security.md``).
        **publisher_options: any other :class:`~deltastore.Publisher` keyword argument (``signing_key``
            signs every version).

    Attributes:
        published: the steps published, in order. last: the last VersionInfo (or Future).
    """

    def __init__(self, uri: Any, *, control: Any = None, dtype: torch.dtype | None = torch.bfloat16,
                 trusted_keys: Any = None, **publisher_options: Any) -> None:
        self._given = uri if isinstance(uri, Publisher) else None
        self.uri = None if self._given is not None else uri
        self.control = control
        self.trusted_keys = trusted_keys
        self.publisher_options = dict(publisher_options, dtype=dtype)
        self.publisher: Publisher | None = None
        self.trainer: Any = None
        self.published: list[int] = []
        self.last: VersionInfo | Future[VersionInfo] | None = None
        self._sends = 0

    def attach(self, trainer: Any) -> DeltaStoreWeightTransfer:
        """Read the step from ``trainer.model_version`` (+1: TRL bumps it after the sync). Returns self."""
        self.trainer = trainer
        return self

    # -- WeightTransferProtocol ------------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Open the Publisher (resuming the store's chain). Called once at train begin."""
        if self.publisher is None:
            self.publisher = self._given or Publisher(self.uri, metadata={"trainer": "trl.AsyncGRPOTrainer"},
                                                      **self.publisher_options)

    def pause(self) -> None:
        if self.control is not None:
            self.control.pause()

    def next_step(self) -> int:
        """The version the next ``send_weights`` publishes."""
        if self.trainer is not None:
            return int(self.trainer.model_version) + 1
        self.init_weight_transfer()
        assert self.publisher is not None
        last = self.publisher.last
        return (last.step if last is not None else 0) + 1 if self._sends == 0 else self.published[-1] + 1

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish ``(name, tensor)`` pairs as version :meth:`next_step`; with a control, apply it there."""
        self.init_weight_transfer()
        assert self.publisher is not None
        step = self.next_step()
        # a generator: on a known chain the Publisher diffs the tensors as they stream and drops them
        # (deltastore/publish/stream.py), so a gathered FSDP2 model is never held whole
        self.last = self.publisher.publish(((name, t.detach()) for name, t in iterator), step=step)
        self._sends += 1
        self.published.append(step)
        if self.control is not None:
            if isinstance(self.last, Future):
                self.last.result()
            uri = self.publisher.store.uri
            signer = self.publisher.store.signer
            keys = key_texts(self.trusted_keys if self.trusted_keys is not None or signer is None else [signer])
            self.control.apply(uri, step, {}, **({"trusted_keys": keys} if keys else {}))
            self.control.reset_prefix_cache()
            self.control.set_version(str(step))

    def resume(self) -> None:
        if self.control is not None:
            self.control.resume()

    def destroy(self) -> None:
        """Flush and close the Publisher (one passed in is flushed, not closed). Called at train end."""
        pub, self.publisher = self.publisher, None
        if pub is None:
            return
        pub.flush()
        if pub is not self._given:
            pub.close()
