"""Publish from a Hugging Face ``transformers`` / TRL trainer.

* :class:`DeltaStoreWeightTransfer` (:mod:`.trl_transfer`): TRL's own weight-sync
  plug point, ``AsyncGRPOTrainer(weight_transfer=...)``; it replaces TRL's NCCL sync.
* :class:`DeltaStoreCallback` (below): any ``transformers.Trainer``; it publishes
  next to whatever sync the trainer already does.

Three lines to adopt::

    from deltastore.integrations.trl import DeltaStoreCallback
    trainer = GRPOTrainer(..., callbacks=[DeltaStoreCallback("s3://bucket/run")])
    trainer.train()

TRL's trainers (``GRPOTrainer``, ``RLOOTrainer``, ``SFTTrainer``, ...) are
``transformers.Trainer`` subclasses, so one ``TrainerCallback`` serves them
all. The callback publishes after every optimizer step (``on_step_end``
fires once per optimizer step, after gradient accumulation), as version
``state.global_step``, on the main process only unless told otherwise, and
closes (flushes) its Publisher in ``on_train_end``.

Importing this module needs no ``transformers``: the callback class is built
on first access of ``DeltaStoreCallback``, which raises
:class:`~deltastore.errors.MissingDependencyError` (an ``ImportError``) with
the install hint ``pip install 'deltastore[trl]'`` when ``transformers`` is
not installed.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import MissingDependencyError
from ..publish.publisher import Publisher, VersionInfo
from ..tensors import StateLike
from .trl_transfer import DeltaStoreWeightTransfer

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerCallback as _TrainerCallbackBase
else:
    _TrainerCallbackBase = object

__all__ = ["DeltaStoreCallback", "DeltaStoreWeightTransfer", "unwrap_model", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'deltastore[trl]'"
_log = logging.getLogger("deltastore.integrations.trl")
_cls: type | None = None


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside distributed / compile wrappers, so parameter names match the inference model.

    Strips ``torch.compile``'s ``_orig_mod`` and any wrapper that exposes the
    real model as ``.module`` and owns no parameters of its own
    (``DistributedDataParallel``, ``DataParallel``, DeepSpeed's engine,
    accelerate's wrappers). A model that merely has a submodule called
    ``module`` next to other parameters is left alone.
    """
    m = model
    for _ in range(16):  # wrappers nest a few levels at most
        inner = getattr(m, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            m = inner
            continue
        inner = getattr(m, "module", None)
        if isinstance(inner, torch.nn.Module) and inner is not m:
            own = sum(1 for _ in m.parameters())
            if own == sum(1 for _ in inner.parameters()):
                m = inner
                continue
        break
    return m


def _make_class() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise MissingDependencyError(
            f"deltastore.integrations.trl needs the 'transformers' package ({e}); install it with: {INSTALL_HINT}"
        ) from e

    class DeltaStoreCallback(TrainerCallback):  # type: ignore[misc,valid-type]
        """A ``transformers.TrainerCallback`` that publishes the model after every optimizer step.

        Contract:

        * one :meth:`Publisher.publish <deltastore.Publisher.publish>` per
          optimizer step (``on_step_end``; gradient accumulation micro-steps
          publish nothing), as version ``state.global_step``; with
          ``every=n`` only steps divisible by ``n`` (and the last one) are published;
        * only on the world's main process (``state.is_world_process_zero``)
          unless ``main_process_only=False`` (then every process calls
          ``publish`` — for a Publisher that coordinates ranks itself);
        * the model given to the callback is unwrapped (:func:`unwrap_model`) and published,
          or ``state_fn(model)`` (the model as the trainer passed it) decides what is published (merged LoRA weights, a
          gathered FSDP / ZeRO-3 state dict): ``state_fn`` runs on **every** process at
          every publishing step, so it may use collectives; only publishing processes
          publish its result (other processes may return anything, e.g. ``{}``);
        * steps at or below the store's latest version (a run resumed from an
          older checkpoint, while the store already went further) are skipped
          with a warning until training passes that version; the chain then continues;
        * ``on_train_end`` flushes and closes a Publisher the callback created
          (one passed in is flushed, not closed); :meth:`close` does the same
          by hand, e.g. after a crash.

        Args:
            uri: the store URI (any form :class:`~deltastore.Publisher` takes), or a ready
                :class:`~deltastore.Publisher` (then the publisher options below are ignored).
            dtype: dtype floating-point weights are published in (default ``torch.bfloat16``;
                None publishes them as they are).
            codec, anchor, anchor_every, storage_options: passed to the Publisher.
            metadata: recorded in every manifest, on top of ``run_name``, ``learning_rate``,
                ``gradient_accumulation_steps``, ``seed`` and ``trainer`` taken from the
                ``TrainingArguments`` (your keys win).
            main_process_only: publish on the world's main process only (default True).
            every: publish every ``every`` optimizer steps (default 1: every step).
            publish_initial: also publish the weights at ``on_train_begin`` as version
                ``state.global_step`` (0 for a fresh run), so inference servers that loaded
                the same base checkpoint can ``Subscriber.identify(model, 0)`` and take only deltas.
            state_fn: ``model -> state`` (Module, mapping or iterable of ``(name, tensor)``)
                to publish instead of the unwrapped model; gets the model as the trainer passed it
                (call :func:`unwrap_model` if you need the bare one); called on every process.
            **publisher_kwargs: any other :class:`~deltastore.Publisher` keyword argument
                (``retention``, ``max_workers``, ``background``, ...). With ``background=True``
                the training loop waits only for the bit-compare; ``on_train_end`` waits for the uploads.

        Attributes:
            publisher: the Publisher (None before ``on_train_begin`` and on non-publishing processes).
            last: what the last ``publish`` returned: a :class:`~deltastore.publish.publisher.VersionInfo`
                (pending until its commit with a background Publisher: ``last.wait()``); None before.
            published: the steps this callback published, in order.
        """

        def __init__(self, uri: Any, *, dtype: torch.dtype | None = torch.bfloat16, codec: Any = None,
                     anchor: Any = None, anchor_every: int | None = None,
                     storage_options: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                     main_process_only: bool = True, every: int = 1, publish_initial: bool = False,
                     state_fn: Callable[[torch.nn.Module], StateLike] | None = None,
                     **publisher_kwargs: Any) -> None:
            if not isinstance(every, int) or every < 1:
                raise ValueError(f"every must be a positive integer, got {every!r}")
            self._given = uri if isinstance(uri, Publisher) else None
            self.uri = None if self._given is not None else uri
            kwargs: dict[str, Any] = dict(publisher_kwargs)
            kwargs["dtype"] = dtype
            if codec is not None:
                kwargs["codec"] = codec
            if anchor is not None:
                kwargs["anchor"] = anchor
            if anchor_every is not None:
                kwargs["anchor_every"] = anchor_every
            if storage_options is not None:
                kwargs["storage_options"] = storage_options
            self.publisher_kwargs = kwargs
            self.metadata = dict(metadata or {})
            self.main_process_only = main_process_only
            self.every = every
            self.publish_initial = publish_initial
            self.state_fn = state_fn
            self.publisher: Publisher | None = None
            self.last: VersionInfo | None = None
            self.published: list[int] = []
            self._warned_stale = False
            self._floor: int | None = None  # highest step in the store when opened, then the last published

        # -- helpers -------------------------------------------------------------
        def _is_publisher_process(self, args: Any, state: Any) -> bool:
            if not self.main_process_only:
                return True
            zero = getattr(state, "is_world_process_zero", None)
            if zero is not None:
                return bool(zero)
            return int(getattr(args, "process_index", 0)) == 0

        def _run_metadata(self, args: Any) -> dict[str, Any]:
            meta: dict[str, Any] = {"trainer": "transformers"}
            for key in ("run_name", "learning_rate", "gradient_accumulation_steps", "seed"):
                v = getattr(args, key, None)
                if isinstance(v, (str, int, float, bool)):
                    meta[key] = v
            meta.update(self.metadata)
            return meta

        def _open(self, args: Any) -> Publisher:
            if self.publisher is None:
                if self._given is not None:
                    self.publisher = self._given
                else:
                    self.publisher = Publisher(self.uri, metadata=self._run_metadata(args),
                                               **self.publisher_kwargs)
                last = self.publisher.last
                self._floor = last.step if last is not None else self.publisher.store.latest()
            return self.publisher

        def _publish(self, model: Any, step: int) -> VersionInfo | None:
            """Publish ``model`` as ``step`` on a publishing process; run ``state_fn`` on every process."""
            if model is None:
                raise ValueError("the trainer passed no model to DeltaStoreCallback")
            # state_fn may gather (FSDP / ZeRO-3): every process calls it, in the same steps, with the
            # model as the trainer holds it (a sharding wrapper is what a gather needs).
            state = self.state_fn(model) if self.state_fn is not None else unwrap_model(model)
            pub = self.publisher
            if pub is None:
                return None
            if self._floor is not None and step <= self._floor:
                if not self._warned_stale:
                    warnings.warn(f"deltastore: step {step} is not above the store's latest version {self._floor} "
                                  f"({pub.store.uri}); not publishing until training passes it", stacklevel=2)
                    self._warned_stale = True
                return None
            info = pub.publish(state, step=step)
            self.last = info
            self._floor = step
            self.published.append(step)
            if isinstance(info, VersionInfo):
                _log.debug("published step %d: %s, %d/%d changed, %d B", step, info.kind, info.changed,
                           info.total, info.nbytes)
            return info

        def close(self) -> None:
            """Flush pending uploads; close the Publisher if this callback created it. Idempotent."""
            pub, self.publisher = self.publisher, None
            if pub is None:
                return
            flush = getattr(pub, "flush", None)
            if callable(flush):
                flush()
            if pub is not self._given:
                pub.close()

        # -- events ----------------------------------------------------------------
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._is_publisher_process(args, state):
                self._open(args)
            elif self.state_fn is None:
                return
            if self.publish_initial:
                self._publish(kwargs.get("model"), int(state.global_step))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.publisher is None and self.state_fn is None:
                return  # a process that neither publishes nor takes part in a gather
            step = int(state.global_step)
            last_step = bool(getattr(state, "max_steps", 0)) and step >= state.max_steps
            if step % self.every == 0 or last_step:
                self._publish(kwargs.get("model"), step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.close()

    DeltaStoreCallback.__module__ = __name__
    return DeltaStoreCallback


def __getattr__(name: str) -> Any:
    """Build ``DeltaStoreCallback`` on first access (imports ``transformers``)."""
    global _cls
    if name == "DeltaStoreCallback":
        if _cls is None:
            _cls = _make_class()
        return _cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    class DeltaStoreCallback(_TrainerCallbackBase):
        def __init__(self, uri: Any, *, dtype: torch.dtype | None = ..., codec: Any = ..., anchor: Any = ...,
                     anchor_every: int | None = ..., storage_options: dict[str, Any] | None = ...,
                     metadata: dict[str, Any] | None = ..., main_process_only: bool = ..., every: int = ...,
                     publish_initial: bool = ..., state_fn: Callable[[torch.nn.Module], StateLike] | None = ...,
                     **publisher_kwargs: Any) -> None: ...
        publisher: Publisher | None
        last: VersionInfo | None
        published: list[int]
        def close(self) -> None: ...
