"""The background writer: captured versions written and committed in order, on one thread.

Lifecycle (what :class:`~deltastore.Publisher` does with ``background=True``):

1. :meth:`BackgroundWriter.submit` queues one captured version with the
   future its caller holds; it blocks while ``max_pending`` versions wait
   (back-pressure when the store is slower than training).
2. The thread writes each in turn with the ``write`` it was given. Success:
   ``committed(item)`` runs (the owner lets go of what only the capture side
   needed), the heap is trimmed, then the future gets the result. Failure:
   the future gets the exception, the writer keeps it as :attr:`error`, and
   every version queued behind it fails without being written (its future
   gets :class:`~deltastore.errors.VersionDroppedError`, whose ``__cause__``
   is that failure) until the owner calls :meth:`take_error`.
3. :meth:`join` waits until everything queued is handled; :meth:`close`
   drains the queue, stops the thread and returns the error nobody took.
4. At interpreter exit, a writer its owner did not close is drained (what
   it holds is committed) with an :class:`~deltastore.errors.UnclosedPublisherWarning`,
   before ``concurrent.futures`` shuts its pools down (a ``threading``
   exit hook, the kind those pools use, registered after theirs so it runs first).

Nothing of a written version is kept after its future is set.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from .._memory import release_memory
from ..errors import UnclosedPublisherWarning, VersionDroppedError
from .info import VersionInfo

Item = TypeVar("Item")


class BackgroundWriter(Generic[Item]):
    """One writer thread over a bounded queue of ``(step, item, future)``.

    ``write(item)`` writes and commits one version (raising on failure);
    ``committed(item)`` runs after a successful write, before the future is
    set. Not for use after :meth:`close`.
    """

    def __init__(self, write: Callable[[Item], VersionInfo], committed: Callable[[Item], None], *,
                 max_pending: int):
        self._write, self._committed = write, committed
        self._queue: queue.Queue[tuple[int, Item, Future[VersionInfo]] | None] = queue.Queue(
            maxsize=max(1, max_pending))
        #: the failure that stopped the writing, until :meth:`take_error`
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deltastore-writer", daemon=True)
        self._thread.start()
        _drained_at_exit(self)

    def submit(self, step: int, item: Item, future: Future[VersionInfo]) -> None:
        """Queue version ``step``; blocks while ``max_pending`` versions already wait."""
        self._queue.put((step, item, future))

    def is_writer_thread(self) -> bool:
        """Whether the caller runs on this writer's thread (where waiting for the queue would deadlock)."""
        return threading.current_thread() is self._thread

    def join(self) -> None:
        """Wait until every queued version is committed or failed."""
        self._queue.join()

    def take_error(self) -> BaseException | None:
        """After the queue has drained: the failure that stopped the writing (None if none); the writer then
        writes what is submitted next again."""
        self._queue.join()
        error, self.error = self.error, None
        return error

    def close(self) -> BaseException | None:
        """Drain the queue, stop the thread; the failure not yet taken, if any."""
        _open.discard(self)
        self._queue.join()
        self._queue.put(None)
        self._thread.join()
        error, self.error = self.error, None
        return error

    def _close_at_exit(self) -> None:
        queued = self._queue.unfinished_tasks
        if queued:
            warnings.warn(UnclosedPublisherWarning(
                f"deltastore: a background Publisher was not closed: committing its {queued} queued version(s) "
                "at interpreter exit (call close(), or use it in a with block)"), stacklevel=1)
        error = self.close()
        if error is not None:
            _log.error("deltastore: a background publish failed at interpreter exit: %s: %s",
                       type(error).__name__, error)

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            committed: tuple[Future[VersionInfo], VersionInfo] | None = None
            try:
                if entry is None:
                    return
                step, item, future = entry
                if self.error is not None:
                    dropped = VersionDroppedError(f"version {step} was dropped: an earlier background publish "
                                                  f"failed ({type(self.error).__name__}: {self.error})")
                    dropped.__cause__ = self.error
                    future.set_exception(dropped)
                    continue
                try:
                    info = self._write(item)
                except BaseException as e:  # surfaced to the owner by take_error, and to this version's caller
                    self.error = e
                    future.set_exception(e)
                else:
                    self._committed(item)
                    committed = (future, info)
            finally:
                entry = item = future = None  # nothing of a written version waits here for the next
                if committed is not None:  # told once the version's changes are freed and the heap trimmed,
                    release_memory()       # so what a caller measures after wait() or flush() is settled
                    committed[0].set_result(committed[1])
                    committed = None
                self._queue.task_done()


_log = logging.getLogger("deltastore.publisher")
_open: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()  # writers not closed yet
_hooked = False
_hook_lock = threading.Lock()


def _drained_at_exit(writer: BackgroundWriter) -> None:
    """Have ``writer`` drained at interpreter exit unless it is closed before."""
    global _hooked
    with _hook_lock:
        _open.add(writer)
        if _hooked:
            return
        register = getattr(threading, "_register_atexit", None)  # run before concurrent.futures' own hook
        try:
            if register is None:
                raise RuntimeError("no threading exit hook")
            register(_drain_all)
        except RuntimeError:  # interpreter already shutting down, or an interpreter without the hook
            import atexit

            atexit.register(_drain_all)
        _hooked = True


def _drain_all() -> None:
    for writer in list(_open):
        writer._close_at_exit()


__all__ = ["BackgroundWriter"]
