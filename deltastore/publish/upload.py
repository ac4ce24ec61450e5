"""Encode and upload object jobs with a bounded number in flight.

A *job* is one future object: its codec, a function that builds the
``(offset, update)`` pairs it holds, or one :class:`~deltastore.codecs.UpdateBatch`
of sparse tensors (called on the worker, so the inputs exist only while that
object is encoded), and the ``name -> [Part]`` index where
its parts are noted. :func:`store_jobs` submits jobs to a thread pool, at most
``inflight`` at a time, so an anchor streams through memory object by object:
build the updates (views of the mirror), encode, upload, drop the bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from .. import progress
from ..codecs import Codec, Update, UpdateBatch
from ..codecs.base import encode_batched
from ..manifest import ObjectRecord, Part
from ..store import DeltaStore

Job = tuple[Codec, Callable[[], list[tuple[int, Update]] | UpdateBatch], dict[str, list[Part]]]


def store_jobs(pool: ThreadPoolExecutor, store: DeltaStore, jobs: Sequence[Job], *, inflight: int,
               first_index: int = 0) -> list[ObjectRecord]:
    """Encode and upload every job; returns the object records in job order and notes each job's parts.

    Object ``i`` of the result gets manifest index ``first_index + i``. At
    most ``inflight`` jobs are built, encoded or uploaded at once. On the
    first failure no further job starts; the error is raised once the jobs
    already running have finished.
    """

    def run(job: Job) -> tuple[ObjectRecord, list[tuple[str, int, int]]]:
        codec, make, _ = job
        made = make()
        if isinstance(made, UpdateBatch):
            parts = [(s.name, 0, s.numel) for s in made.specs]
            data = encode_batched(codec, made)
        else:
            parts = [(u.spec.name, offset, u.spec.numel) for offset, u in made]
            data = codec.encode([u for _, u in made])
        del made
        record = ObjectRecord(store.put_object(data), len(data), codec.describe())
        return record, parts

    bar = progress.current()  # read here: the done-callbacks run on the workers
    progress.grow(bar, len(jobs))
    if len(jobs) == 1 or inflight <= 1:  # one at a time anyway: on this thread, no hand-off to a worker
        results = []
        for job in jobs:
            results.append(run(job))
            progress.advance(bar)
        return _records(jobs, results, first_index)
    slots = threading.BoundedSemaphore(max(1, inflight))
    failed = threading.Event()
    futures: list[Future] = []

    def release(f: Future) -> None:
        if f.exception() is not None:
            failed.set()
        else:
            progress.advance(bar)
        slots.release()

    for job in jobs:
        slots.acquire()
        if failed.is_set():
            slots.release()
            break
        fut = pool.submit(run, job)
        fut.add_done_callback(release)
        futures.append(fut)
    error: BaseException | None = None
    results = []
    for fut in futures:
        try:
            results.append(fut.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after every started job finished
            if error is None:
                error = e
    if error is not None:
        raise error
    return _records(jobs, results, first_index)


def _records(jobs: Sequence[Job], results: list[tuple[ObjectRecord, list[tuple[str, int, int]]]],
             first_index: int) -> list[ObjectRecord]:
    """The object records of ``results`` (one per job, in order), each job's parts noted in its index."""
    objects = []
    touched: dict[int, dict[str, list[Part]]] = {}
    for (_, _, index_of), (record, parts) in zip(jobs, results):
        objects.append(record)
        for name, offset, numel in parts:
            index_of.setdefault(name, []).append(Part(first_index + len(objects) - 1, offset, numel))
        touched[id(index_of)] = index_of
    for index_of in touched.values():
        for plist in index_of.values():
            plist.sort(key=lambda p: p.offset)
    return objects


class Uploader:
    """:func:`store_jobs` into ``store`` on a pool of its own ``workers`` threads (a publisher's, or one
    rank's); :meth:`close` waits for the threads."""

    def __init__(self, store: DeltaStore, workers: int):
        self.store = store
        self.workers = max(1, workers)
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="deltastore-put")

    def run(self, jobs: Sequence[Job], *, inflight: int | None = None, first_index: int = 0) -> list[ObjectRecord]:
        """:func:`store_jobs` of ``jobs``, at most ``inflight`` (default: every worker) at once."""
        return store_jobs(self._pool, self.store, jobs, inflight=inflight or self.workers, first_index=first_index)

    def close(self) -> None:
        """Wait for the running jobs and stop the threads."""
        self._pool.shutdown(wait=True)
