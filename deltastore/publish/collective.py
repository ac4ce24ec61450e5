"""One code path for one rank or many: the collective steps of a sharded publish.

Modelled on ``torch.distributed.checkpoint``'s ``_DistWrapper``. A
:class:`Collective` over a process group (or over this process alone, when
``torch.distributed`` is not initialised, or ``group`` is :data:`LOCAL`) runs
the one pattern a sharded publish needs, :meth:`Collective.reduce`:

1. every rank runs its local function; an exception there is caught, and the
   rank keeps taking part (a rank that left would leave the others waiting);
2. rank 0 gathers every rank's result (or error) and, when none failed, runs
   the reduction on the list;
3. rank 0 broadcasts the outcome; every rank returns the same value, or every
   rank raises: the rank whose own step failed re-raises its own exception,
   the others a :class:`CollectiveError` naming each failed rank and its error
   (a :class:`~deltastore.errors.DeltaStoreError` raised by the reduction on
   rank 0 reaches every rank as itself).

Values cross between ranks with ``torch.distributed``'s object collectives
(pickle, over the process group only: never through the store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import DeltaStoreError

T = TypeVar("T")
R = TypeVar("R")

#: ``Collective(LOCAL)``: this process alone, even where a default process group exists
LOCAL = object()


class CollectiveError(DeltaStoreError):
    """Another rank's step failed, so this rank's step was abandoned too (the message names the rank)."""


def describe(error: BaseException) -> str:
    """``"Type: message"`` of ``error``, as the other ranks see it."""
    return f"{type(error).__name__}: {error}"


class Collective:
    """The ranks of ``group`` (default: the default process group when one is initialised, else this process
    alone; :data:`LOCAL`: this process alone). ``rank`` and ``world`` say where this process stands."""

    def __init__(self, group: Any = None):
        self.local = group is LOCAL or not (dist.is_available() and dist.is_initialized())
        self.group = None if self.local else group
        self.rank = 0 if self.local else dist.get_rank(self.group)
        self.world = 1 if self.local else dist.get_world_size(self.group)

    def reduce(self, local: Callable[[], T], reduce: Callable[[list[T]], R], *, what: str) -> R:
        """``reduce`` (run on rank 0) of every rank's ``local()``, returned on every rank (see the module).

        ``what`` names the step in errors (``"version 7: upload"``). Raises, on every rank, the failure of
        any rank's ``local`` or of the reduction.
        """
        mine: BaseException | None = None
        try:
            item: tuple[Any, str] = (local(), "")
        except BaseException as e:  # noqa: BLE001 - keep taking part; raised below on every rank
            mine, item = e, (None, describe(e))
        gathered = self._gather(item)
        outcome: list[Any] = [None]
        if self.rank == 0:
            assert gathered is not None
            failed = "; ".join(f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err)
            if failed:
                outcome[0] = ("failed", failed, None)
            else:
                try:
                    outcome[0] = ("ok", reduce([v for v, _ in gathered]), None)
                except BaseException as e:  # noqa: BLE001 - never leave the other ranks waiting
                    mine = e
                    outcome[0] = ("failed", f"rank 0: {describe(e)}", e if isinstance(e, DeltaStoreError)
                                  else None)
        if not self.local:
            dist.broadcast_object_list(outcome, src=0, group=self.group)
        status, value, error = outcome[0]
        if status == "ok":
            return value
        if mine is not None:
            raise mine
        if isinstance(error, BaseException):
            raise error
        raise CollectiveError(f"{what} aborted: {value}")

    def _gather(self, item: Any) -> list[Any] | None:
        if self.local:
            return [item]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(item, out, dst=0, group=self.group)
        return out
