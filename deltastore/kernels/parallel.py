"""Thread parallelism over contiguous chunks for nogil kernels.

``each(n, fn)`` runs ``fn(0) .. fn(n - 1)`` on a shared thread pool;
``chunked(n, fn)`` splits ``range(n)`` into at most ``threads()`` contiguous
pieces of at least ``min_chunk`` elements and calls ``fn(start, stop)`` for
each on a shared thread pool; results come back in chunk order. With one
piece it runs inline (no thread hop), so small inputs pay no overhead.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def threads() -> int:
    """Threads for kernel work: env ``DELTASTORE_THREADS``, else every CPU this process may use.

    The CPU set is read once per value of the variable (hot paths ask per tensor; the system call is
    a microsecond or two): a process re-pinned to other CPUs later keeps the first count.
    """
    return _threads(os.environ.get("DELTASTORE_THREADS"))


@functools.lru_cache(maxsize=8)
def _threads(env: str | None) -> int:
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _pool(n: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    if _POOL is None or _POOL_SIZE < n:
        _POOL = ThreadPoolExecutor(n, thread_name_prefix="deltastore-kernel")
        _POOL_SIZE = n
    return _POOL


def bounds(n: int, min_chunk: int = 1 << 20, pieces: int | None = None) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n)`` in at most ``pieces`` (default: threads()) chunks."""
    k = max(1, min(pieces or threads(), n // max(1, min_chunk)))
    step = -(-n // k) if n else 0
    return [(s, min(n, s + step)) for s in range(0, n, step)] if n else []


def chunked(n: int, fn: Callable[[int, int], T], min_chunk: int = 1 << 20, pieces: int | None = None) -> list[T]:
    """``[fn(start, stop) for each chunk of range(n)]``, chunks run in parallel threads."""
    parts = bounds(n, min_chunk, pieces)
    return each(len(parts), lambda i: fn(*parts[i]))


def each(n: int, fn: Callable[[int], T]) -> list[T]:
    """``[fn(i) for i in range(n)]``, in parallel threads when ``n > 1``."""
    # A task started from a pool thread must not wait on the same pool (deadlock): run inline there.
    if n <= 1 or threading.current_thread().name.startswith("deltastore-kernel"):
        return [fn(i) for i in range(n)]
    # The caller runs the last piece itself: one thread fewer competing for the cores (and for a
    # trainer's spinning OpenMP workers), and no hand-off for it.
    futures = [_pool(threads()).submit(fn, i) for i in range(n - 1)]
    error: BaseException | None = None
    try:
        last = fn(n - 1)
    except BaseException as e:
        error = e
    # Every piece must have finished before anything is raised: kernels write into buffers the
    # caller frees as soon as the error unwinds it (a piece still running would write freed memory).
    results = []
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
    return results + [last]
