"""Trainer side: find the bit-changed elements, store them, commit a version.

Lifecycle of :meth:`Publisher.publish` (data first, metadata last):

1. check the step (above the last one, not yet committed);
2. diff every tensor against the mirror of the last published bits
   (:mod:`deltastore.publish.mirror`: one fused kernel pass per thread over
   every CPU tensor);
3. ask the anchor policy whether this version also gets full objects
   (an anchor) or a differential (anchor -> now);
4. encode and store the objects (content-addressed, in parallel): sparse
   deltas against the mirror as it is, then — the mirror advanced to this
   version — differentials, whole tensors and anchors from views of it,
   streamed a bounded number of objects at a time
   (:mod:`deltastore.publish.upload`);
5. commit the manifest create-only;
6. only then move the checksums and chain state forward, and apply retention.

A failure before step 5 leaves the store without the version (stray objects
are garbage, never half a version), moves the mirror back and leaves the
Publisher unchanged, so the same step can be retried.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
import queue
import warnings
import threading
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ._gc import paused
from ._memory import pin_allocator, release_memory
from . import progress as _progress
from ._version import __version__
from .adapters import peft_adapter, record_config
from .anchors import AnchorPolicy, ChainState, Every, get_anchor_policy
from .checksum import format_checksum
from .codecs import Codec, TensorSpec, Update, UpdateBatch, get_codec
from .diff import DEFAULT_CHUNK_ELEMS, Change, find_changes
from .drift import DriftTracker
from .errors import ManifestError, PostCommitWarning, StepOrderError, TargetMismatchError, VersionExistsError
from .gc import Retention, delete_unreferenced, delete_versions, plan_gc
from .manifest import (COLUMNS_FORMAT_VERSION, MAX_STEP, Manifest, Part, TensorRecord, VersionRef,
                       check_tensor_name, sha256_digest)
from .publish.info import PendingVersionInfo, VersionInfo
from .publish.mirror import Diff, Mirror, Pending
from .publish.stream import diff_stream
from .publish.upload import Job, store_jobs
from .pull.anchor import stream_anchor
from .quantize import get_quantizer
from .store import DeltaStore, open_store, version_key
from .tensors import StateLike, dtype_name, named_tensors

_log = logging.getLogger(__name__)
DEFAULT_MAX_OBJECT_BYTES = 1 << 30
#: whole tensors (anchors) are cut into objects of about model / 64 bytes, within these bounds, so that
#: an anchor streams through memory (encode, upload, free) a few objects at a time
ANCHOR_OBJECT_MIN = 16 << 20
ANCHOR_OBJECT_MAX = 256 << 20
#: changed elements of a version above which its objects break where the compare's buffers do
#: (``Diff.part_breaks``): below, one object's copy (12 B a change) costs less than the bytes a
#: follower downloads for another object (a cold 1 GB step: 1.42 -> 1.55 B a change, ``docs/benchmarks.md``)
_SPLIT_AT_BUFFERS_ABOVE = 1 << 22
_M64 = (1 << 64) - 1
#: anchors: exponent and mantissa byte planes, zstd-compressed (~68 % of raw bf16)
DEFAULT_ANCHOR_CODEC: dict[str, Any] = {"id": "dense", "config": {"planes": True}}
#: files copied from ``source_dir`` so that ``materialize`` writes a loadable model folder.
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                "chat_template.jinja", "preprocessor_config.json")


@dataclass
class _Captured:
    """What publish() captured: everything the write half needs, no reference to the caller's tensors.

    ``mirror`` is the mirror this version was compared against (``diff`` set),
    or, for a new chain (``diff`` None), a new mirror holding this version.
    """

    step: int
    specs: dict[str, TensorSpec]
    aliases: dict[str, str]
    mirror: Mirror
    diff: Diff | None
    captured: float
    #: a layout change against the parent: (tensors stored whole, tensors dropped); the mirror is then a
    #: new one in this version's layout, holding the parent's bits for the other tensors
    layout: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    @property
    def fresh(self) -> bool:
        return self.diff is None


def _post_commit(message: str) -> str:
    warnings.warn(message, PostCommitWarning, stacklevel=3)
    return message


def _check_name(name: str) -> None:
    try:
        check_tensor_name(name)
    except ManifestError as e:
        raise TargetMismatchError(str(e)) from None


class Publisher:
    """Publish successive versions of a model's weights to a store.

    Args:
        uri: where to publish (path, ``file://``, ``memory://``, or any registered scheme).
        codec: codec for delta objects (a name, a codec record dict or a Codec);
            ``auto`` picks the smallest encoding per tensor (see ``docs/codecs.md``).
        anchor_every: a fixed anchor interval in versions (``every(n)``);
            ignored when ``anchor`` is given. Without either, ``adaptive``.
        storage_options: passed to the backend (credentials, endpoint, ...).
        metadata: JSON-serialisable dict recorded in every manifest (run id, lr, ...).
        resume: on a store that already has versions, rebuild the mirror from
            the latest one so the chain continues; with False the first publish
            starts a new chain with an anchor.
        anchor: an anchor policy (object, registered name or config dict).
        anchor_codec: codec for whole tensors (anchors, and delta tensors whose
            sparse encoding would be larger than a dense one).
        max_object_bytes: objects are split so none is much larger than this
            (anchors are cut smaller still, about model / 64 bytes each, so they
            stream through memory a few objects at a time).
        chunk_elems: elements compared per chunk when diffing.
        dtype: publish every floating-point tensor in this dtype (e.g.
            ``torch.bfloat16`` for an fp32 master); cast chunk by chunk.
        retention: keep the store bounded (see :class:`deltastore.gc.Retention`);
            applied after every commit.
        gc_grace: seconds between deleting a manifest and deleting its objects.
        source_dir: a model folder whose ``config.json`` and tokenizer files are
            recorded, so ``deltastore materialize`` writes a loadable model.
        max_workers: parallel encode/upload workers.
        background: make ``publish()`` return once the changes are captured,
            with a pending :class:`VersionInfo`; encoding, upload and commit run
            in a background writer (see :meth:`publish`). The writer and the capture share one mirror; the
            queued versions' changes are held until they are written.
        max_pending: versions the background writer may have queued before
            ``publish()`` blocks (back-pressure when the store is slower than training).
        mirror_device: where the previous bits are kept for the compare:
            ``"cpu"`` (default; pinned when CUDA is present) or a CUDA device
            to diff on the GPU (costs the published model's size in GPU memory;
            only changed positions cross to the host).
        quantize: publish quantized served weights: ``"fp8_block128"`` or a
            quantizer (:mod:`deltastore.quantize`); the manifest records the scheme.
        adapter_only: ``publish(peft_model)`` publishes only its adapter's tensors
            (PEFT names) and records ``adapter_config.json`` (:mod:`deltastore.adapters`);
            a model that is not a PEFT model is a :class:`TargetMismatchError`.

    Raises :class:`UnknownCodecError` for an unknown codec and ``TypeError``
    for metadata that is not JSON-serialisable.
    """

    def __init__(self, uri: Any, *, codec: str | dict[str, Any] | Codec = "auto", anchor_every: int | None = None,
                 storage_options: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                 resume: bool = True, anchor: AnchorPolicy | str | dict[str, Any] | None = None,
                 anchor_codec: str | dict[str, Any] | Codec = DEFAULT_ANCHOR_CODEC,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                 dtype: torch.dtype | None = None, retention: Retention | None = None, gc_grace: float = 30.0,
                 source_dir: str | os.PathLike[str] | None = None, max_workers: int = 4,
                 background: bool = False, max_pending: int = 2,
                 mirror_device: str | torch.device | None = None, quantize: Any = None,
                 adapter_only: bool = False):
        pin_allocator()  # freed temporaries go back to the OS (deltastore._memory)
        self.store: DeltaStore = open_store(uri, **(storage_options or {}))
        self.codec = get_codec(codec)
        self.anchor_codec = get_codec(anchor_codec)
        if self.codec.dense:
            raise ValueError(f"codec {self.codec.codec_id!r} stores whole tensors; pass it as anchor_codec")
        if not self.anchor_codec.dense:
            raise ValueError(f"anchor_codec {self.anchor_codec.codec_id!r} does not store whole tensors")
        if anchor is not None:
            self.policy = get_anchor_policy(anchor)
        elif anchor_every is not None:
            self.policy = Every(anchor_every)
        else:
            self.policy = get_anchor_policy("adaptive")
        self.metadata = dict(metadata or {})
        json.dumps(self.metadata, allow_nan=False)  # fail now, not at the first commit
        self.max_object_bytes = max_object_bytes
        self.chunk_elems = chunk_elems
        self.dtype = dtype
        if dtype is not None:
            dtype_name(dtype)
        self.retention = retention
        self.gc_grace = gc_grace
        self.writer_id = uuid.uuid4().hex
        self.max_workers = max(1, max_workers)
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="deltastore-put")
        self._mirror: Mirror | None = None  # the committed version's bits (the writer's, in background mode)
        self._specs: dict[str, TensorSpec] = {}
        self._aliases: dict[str, str] = {}
        self._checksums: dict[str, int] = {}
        self._last: VersionRef | None = None
        self._anchor: VersionRef | None = None
        self._chain = ChainState()
        self._drift = DriftTracker()
        self._relaid_since_anchor = False  # a layout change since the last anchor (no drift, no differentials)
        self._files: dict[str, dict[str, Any]] = {}
        self._gc_pending: list[tuple[float, list[str]]] = []
        self._closed = False
        self.mirror_device = torch.device(mirror_device) if mirror_device is not None else None
        self.quantizer = get_quantizer(quantize)
        self.adapter_only = adapter_only
        # Background mode: the capture side compares against the same mirror object (which the
        # writer advances after each commit) corrected by what the queued versions changed.
        self._capture_mirror: Mirror | None = None
        self._pending = Pending()
        self._capture_specs: dict[str, TensorSpec] = {}
        self._capture_aliases: dict[str, str] = {}
        self._bg_error: BaseException | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, max_pending))
        self._writer: threading.Thread | None = None
        self._last_step = self.store.latest()
        if resume and self._last_step is not None:
            self._resume(self._last_step)
        if source_dir is not None:
            self._files = self._record_files(source_dir)
        self._capture_specs, self._capture_aliases = self._specs, self._aliases
        if background:
            self._capture_mirror = self._mirror
            self._writer = threading.Thread(target=self._run_writer, name="deltastore-writer", daemon=True)
            self._writer.start()

    # -- public ------------------------------------------------------------------
    @property
    def last(self) -> VersionRef | None:
        """The last version this Publisher committed or resumed from."""
        return self._last

    @property
    def chain(self) -> ChainState:
        """The measured chain state since the last anchor (what the anchor policy sees)."""
        return self._chain

    @paused
    def publish(self, state: StateLike, *, step: int, progress: _progress.ProgressArg = None) -> VersionInfo:
        """Commit ``state`` as version ``step``.

        ``state`` is an ``nn.Module``, a mapping or an iterable of
        ``(name, tensor)``, on any device. Raises :class:`VersionExistsError`
        if ``step`` is already committed (by this or another writer),
        :class:`StepOrderError` if it is not above the last step,
        :class:`TargetMismatchError` for an unsupported tensor.

        Synchronous (default): returns the :class:`VersionInfo` once the
        version is committed; on any error nothing is committed and the
        Publisher is unchanged, so the same step can be retried. An iterator
        (not a mapping or module) on a chain whose layout the Publisher knows
        is compared piece by piece as it is consumed, so each tensor may be
        produced just in time and dropped (``deltastore/publish/stream.py``).

        With ``background=True``: returns a :class:`PendingVersionInfo` (a
        ``VersionInfo``) as soon as the changes are captured (the bit-compare is
        all the caller waits for, plus back-pressure when ``max_pending``
        versions are already queued). Its ``step``, ``changed`` and ``total``
        are known at once; ``committed`` says whether the writer has committed
        it, ``wait(timeout=None)`` blocks for the commit and returns the
        committed info or re-raises the background error, and the other fields
        wait for the commit when read. (The ``Future`` calls earlier releases
        returned, ``result()``, ``done()``, ``exception()``,
        ``add_done_callback()``, still work.) Versions commit in ``publish()``
        order. A failure in the background is also raised by the next
        ``publish()``, ``flush()`` or ``close()``; the versions queued behind it
        are dropped (their ``wait()`` raises too) and the next publish starts a
        new chain with an anchor.

        Either way, nothing after the commit point raises: a failure there
        (the store marker, retention) is a :class:`PostCommitWarning` and an
        entry of ``VersionInfo.warnings``. Non-contiguous tensors are read in
        row-major order. A step that adds, drops, reshapes or re-types a
        tensor stays on the chain (``docs/format.md``, "Layout changes").

        ``progress``: ``True`` for a bar on stderr, or an fsspec ``Callback``
        (see :mod:`deltastore.progress`); it counts objects stored (not
        reported in background mode).
        """
        if progress is not None and progress is not False:
            with _progress.reporting(progress, desc=f"publish {step}", unit="objects"):
                return self.publish(state, step=step)
        if self._closed:
            raise RuntimeError("Publisher is closed")
        if self._writer is not None:
            self._raise_background_error()
        self._check_step(step)
        if (self._writer is None and self._mirror is not None and self.quantizer is None and not self.adapter_only
                and not isinstance(state, (Mapping, torch.nn.Module))):
            # an iterator on a known chain: compared piece by piece as it arrives (publish/stream.py)
            streamed = diff_stream(state, self._mirror, self._specs, self._aliases, self.dtype,
                                   chunk_elems=self.chunk_elems)
            if streamed.diff is not None:
                return self._write_sync(_Captured(step, self._specs, self._aliases, self._mirror, streamed.diff,
                                                  time.time()))
            state = streamed.pairs  # it left the layout: the ordinary capture below
        tensors, specs, aliases = self._normalise(state)
        background = self._writer is not None
        mirror = self._capture_mirror if background else self._mirror
        same_layout = mirror is not None and specs == self._capture_specs and aliases == self._capture_aliases
        if not same_layout and mirror is not None and aliases == self._capture_aliases:
            # a layout change (a tensor added, dropped, reshaped or re-typed): the version stays on the chain
            if background:  # wait until the writer's mirror holds the last captured version
                self._queue.join()
                self._raise_background_error()
                self._pending.clear()
            fresh, new, dropped = mirror.relayout(specs, tensors)
            diff = fresh.diff(tensors, chunk_elems=self.chunk_elems)
            captured = _Captured(step, specs, aliases, fresh, diff, time.time(), (new, dropped))
        elif same_layout:
            assert mirror is not None
            diff = mirror.diff(tensors, chunk_elems=self.chunk_elems, pending=self._pending if background else None)
            captured = _Captured(step, specs, aliases, mirror, diff, time.time())
        else:  # a new chain: a private copy of every tensor, which becomes the mirror
            if background:
                self._capture_mirror = self._mirror = None  # queued versions keep what they need
            fresh = Mirror.capture(tensors, specs, self.mirror_device)
            fresh.version = step
            captured = _Captured(step, specs, aliases, fresh, None, time.time())
        if not background:
            return self._write_sync(captured)
        self._capture_specs, self._capture_aliases = specs, aliases
        self._last_step = step
        # Background: note what this version changed (the writer advances the mirror after its commit).
        if captured.diff is None or captured.layout is not None:
            self._capture_mirror = captured.mirror
            self._pending.clear()
        if captured.diff is not None:
            self._pending.add(captured.diff, step)
        future: Future[VersionInfo] = Future()
        total = sum(sp.numel for sp in specs.values())
        changed = total if captured.diff is None else captured.diff.changed + sum(
            specs[n].numel for n in (captured.layout[0] if captured.layout is not None else ()))
        info = PendingVersionInfo(step, changed, total, future)
        self._queue.put((captured, future))  # blocks while max_pending versions wait: back-pressure
        return info

    def _write_sync(self, captured: _Captured) -> VersionInfo:
        """Write ``captured`` now; on any error the Publisher is as it was before this publish()."""
        self._capture_specs, self._capture_aliases = captured.specs, captured.aliases
        self._last_step = captured.step
        try:
            return self._write(captured)
        except BaseException:
            self._last_step = self._last.step if self._last is not None else self.store.latest()
            self._capture_specs, self._capture_aliases = self._specs, self._aliases
            raise

    def flush(self) -> None:
        """Wait until every queued version is committed; raise a background error if one occurred."""
        if self._writer is not None:
            self._queue.join()
            self._raise_background_error()

    def close(self) -> None:
        """Drain queued versions, finish deferred deletions whose grace has passed, release everything.

        Raises a background error after closing, if one occurred.
        """
        if self._closed:
            return
        error = None
        if self._writer is not None:
            self._queue.join()
            self._queue.put(None)
            self._writer.join()
            error, self._bg_error = self._bg_error, None
        self._closed = True
        self._collect_pending()
        self._pool.shutdown(wait=True)
        self._mirror = self._capture_mirror = None
        self.store.close()
        if error is not None:
            raise error

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------
    @paused
    def _write(self, c: _Captured) -> VersionInfo:
        """Decide, encode, upload and commit one captured version; then move the committed state forward.

        Sparse deltas (they need the parent's bits) are encoded first, against
        the mirror as it is; then the mirror is advanced to this version and
        what needs its bits (differentials, anchors, tensors stored whole) is
        encoded from views of it; if anything fails before the commit, the
        mirror is moved back.
        """
        step, specs, aliases, mirror = c.step, c.specs, c.aliases, c.mirror
        same_layout = c.diff is not None  # on the chain (a parent), possibly with a layout change
        new, dropped = c.layout if c.layout is not None else ((), ())
        relaid = set(new)
        counts = c.diff.counts() if c.diff is not None else {}
        total = sum(s.numel for s in specs.values())
        # drift and differentials are measured against the anchor's layout: off from a layout change to the next anchor
        tracks = self.policy.tracks_drift and c.layout is None and not self._relaid_since_anchor
        proposed = self._drift.propose(c.diff) if c.diff is not None and tracks else None
        drift_elements = DriftTracker.count(proposed) if proposed is not None else 0
        chain_now = ChainState(**{**self._chain.__dict__, "drift": drift_elements / max(total, 1),
                                  "drift_elements": drift_elements})
        is_anchor = not same_layout or self.policy.should_anchor(chain_now)
        with_diff = (proposed is not None and not is_anchor and self._anchor is not None
                     and self.policy.should_differential(chain_now))

        delta_of: dict[str, list[Part]] = {}
        full_of: dict[str, list[Part]] = {}
        diff_of: dict[str, list[Part]] = {}
        diff_counts: dict[str, int] = {}
        whole: list[tuple[str, dict[str, list[Part]]]] = []  # tensors stored whole, and in which role
        jobs: list[Job] = []
        if same_layout:
            jobs += self._sparse_jobs(specs, c.diff, mirror, delta_of, whole, base=None)
        objects = store_jobs(self._pool, self.store, jobs, inflight=self.max_workers)
        advanced = False
        try:
            if c.diff is not None:
                mirror.advance(c.diff)  # from here on the mirror holds this version
                advanced = True
            later: list[Job] = []
            object_bytes, inflight = self._anchor_streaming(specs)
            if with_diff:  # anchor -> now, read from the mirror (which holds "now")
                assert proposed is not None
                differential = Diff({}, DriftTracker.differential_flat(proposed, mirror.view)) \
                    if mirror.device.type == "cpu" else Diff({}, loose=DriftTracker.differential(proposed, mirror.gather))
                diff_counts = differential.counts()
                # the drift can be a large part of the model: objects no larger than an anchor's, read from
                # the drift as each is encoded, so memory follows the objects in flight
                later += self._sparse_jobs(specs, differential, mirror, diff_of, whole, base=proposed,
                                           limit=object_bytes)
            for role_index in {id(ix): ix for _, ix in whole}.values():
                names = [n for n, ix in whole if ix is role_index]
                later += self._dense_jobs(specs, names, mirror, role_index, object_bytes)
            if new:  # stored whole, in objects of their own (a follower reads them and nothing else whole)
                later += self._dense_jobs(specs, list(new), mirror, full_of, object_bytes)
            if is_anchor:
                later += self._dense_jobs(specs, [n for n in specs if n not in relaid], mirror, full_of,
                                          object_bytes)
            objects += store_jobs(self._pool, self.store, later, inflight=inflight, first_index=len(objects))
            checksums = self._new_checksums(c)
            records = []
            for name, spec in specs.items():
                changed = counts[name] if same_layout and name not in relaid else spec.numel
                dc = diff_counts.get(name, 0)
                records.append(TensorRecord(name, dtype_name(spec.dtype), spec.shape, changed,
                                            format_checksum(checksums[name]), tuple(delta_of.get(name, ())),
                                            tuple(full_of.get(name, ())), tuple(diff_of.get(name, ())), dc))
            manifest = Manifest(step=step, kind="anchor" if is_anchor else "delta",
                                parent=self._last if same_layout else None, tensors=tuple(records),
                                objects=tuple(objects), created=time.time(),
                                producer={**self._producer(), "captured": c.captured},
                                metadata=self.metadata, aliases=aliases,
                                differential=self._anchor if with_diff else None, files=self._files,
                                new_tensors=new, dropped_tensors=dropped,
                                format_version=COLUMNS_FORMAT_VERSION,
                                quantization=self.quantizer.record(specs) if self.quantizer is not None else None)
            data, digest, notes = self._commit(manifest)
        except BaseException:
            if advanced:
                assert c.diff is not None
                mirror.revert(c.diff)
            raise

        # Committed: now (and only now) the chain state moves forward.
        mirror.version = step
        if c.fresh or c.layout is not None:
            self._specs, self._aliases = specs, aliases
        self._relaid_since_anchor = not is_anchor and (self._relaid_since_anchor or c.layout is not None)
        self._mirror = mirror
        self._checksums = checksums
        self._last = VersionRef(step, digest)
        self._advance_chain(manifest, is_anchor, with_diff, proposed, drift_elements, total)
        _log.info("committed version %d (%s): %d of %d elements changed, %d B stored, %.3f s", step, manifest.kind,
                  manifest.changed, manifest.total, manifest.object_bytes() + len(data), time.time() - c.captured)
        if self.retention is not None:
            try:
                self._apply_retention()
            except Exception as e:  # noqa: BLE001 - after the commit point: reported, never raised
                notes.append(_post_commit(f"retention after version {step} failed: {e!r}"))
        release_memory()
        return VersionInfo(step=step, kind=manifest.kind, changed=manifest.changed, total=manifest.total,
                           nbytes=manifest.object_bytes() + len(data), digest=digest, created=manifest.created,
                           differential=with_diff, warnings=tuple(notes))

    def _commit(self, manifest: Manifest) -> tuple[bytes, str, list[str]]:
        """Commit ``manifest``; returns its bytes, digest and what failed after the commit point.

        The commit point is the create-only write of the manifest. If
        :meth:`DeltaStore.commit` raises after it (the store marker, the
        ``refs/latest`` hint), the manifest is read back: when it is ours (this
        writer's id and creation time; the store may add to the producer
        record) the version is committed and the failure is returned as a
        warning; otherwise (another writer's version, nothing there, the read
        fails too) the error stands and nothing moves forward.
        """
        try:
            data, digest = self.store.commit(manifest)
            return data, digest, []
        except VersionExistsError:
            raise
        except Exception as e:
            try:  # ours: this writer's id and creation time (the store may add to the producer record)
                data = self.store.backend.get(version_key(manifest.step))
                theirs = Manifest.from_json(data)
                landed = theirs.producer.get("writer") == self.writer_id and theirs.created == manifest.created
            except Exception:  # noqa: BLE001 - cannot tell: the commit's own error stands
                landed = False
            if not landed:
                raise
            return data, sha256_digest(data), [_post_commit(f"version {manifest.step} is committed, but a step "
                                                            f"after its commit point failed: {e!r}")]

    def _run_writer(self) -> None:
        """Background thread: commit queued versions in order; after a failure, fail the rest."""
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                captured, future = item
                if self._bg_error is not None:
                    future.set_exception(RuntimeError(
                        f"version {captured.step} was dropped: an earlier background publish failed"))
                    continue
                try:
                    info = self._write(captured)
                except BaseException as e:  # surfaced to the caller by the next publish/flush/close
                    self._bg_error = e
                    future.set_exception(e)
                else:
                    self._pending.prune(captured.step)  # the mirror holds it now: the capture needs it no more
                    future.set_result(info)
            finally:
                self._queue.task_done()
                item = captured = future = None  # nothing of a written version waits here for the next

    def _raise_background_error(self) -> None:
        error = self._bg_error
        if error is None:
            return
        # The capture side ran ahead of what was committed: restart from the committed state.
        self._queue.join()
        self._bg_error = None
        self._capture_mirror = None
        self._mirror = None
        self._pending.clear()
        self._drift.reset()
        self._last_step = self.store.latest()
        raise error

    # -- inputs ------------------------------------------------------------------
    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise StepOrderError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
        if self.store.has_version(step):
            raise VersionExistsError(f"version {step} already exists in {self.store.uri}")
        if self._last_step is not None and step <= self._last_step:
            raise StepOrderError(f"step {step} is not above the last published step {self._last_step}")

    def _normalise(self, state: StateLike
                   ) -> tuple[dict[str, torch.Tensor], dict[str, TensorSpec], dict[str, str]]:
        aliases: dict[str, str] = {}
        if self.adapter_only:  # the adapter's tensors, and its config as a version file
            state, config = peft_adapter(state)
            self._files = record_config(self.store, self._files, config)
        tensors = named_tensors(state, aliases)
        produced: set[str] = set()  # quantized tensors and their scales: never cast
        if self.quantizer is not None:
            tensors, produced = self.quantizer.apply(tensors, aliases, cast=self.dtype)
        prev = self._capture_specs  # the last layout: its specs are reused (names already checked)
        specs = {}
        cast = self.dtype
        for name, t in tensors.items():
            dt = cast if cast is not None and t.is_floating_point() and name not in produced else t.dtype
            sp = prev.get(name)
            if sp is None or sp.dtype is not dt or sp.shape != t.shape:
                _check_name(name)
                sp = TensorSpec(name, dt, tuple(t.shape))
                dtype_name(dt)
            specs[name] = sp
        for name in aliases:
            _check_name(name)
        return tensors, specs, aliases

    def _dtype_of(self, t: torch.Tensor) -> torch.dtype:  # noqa: D102 - also used by ShardedPublisher
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    # -- objects -----------------------------------------------------------------
    def _sparse_jobs(self, specs: Mapping[str, TensorSpec], changes: Mapping[str, Change] | Diff, mirror: Mirror,
                     index_of: dict[str, list[Part]], whole: list[tuple[str, dict[str, list[Part]]]],
                     base: Any, limit: int | None = None) -> list[Job]:
        """Jobs that encode ``changes`` against the parent's bits (``base`` None) or against the anchor.

        For a delta ``mirror`` still holds the parent version; for a
        differential (``base``: the drift) it holds this version. A tensor whose
        sparse form would be larger than the whole tensor is added to
        ``whole`` instead (stored with the anchor codec once the mirror holds
        this version). A group of tensors that lie in one flat group of
        ``changes`` (a :class:`Diff`: the compare, or a differential from the
        drift) is handed to the codec as one :class:`UpdateBatch`
        (:meth:`Codec.encode_batch`) with the old tensors only of those whose
        encoding reads them, not as an :class:`Update` per tensor. ``limit``: the estimated bytes
        of one object (default ``max_object_bytes``).
        """
        diff = changes if isinstance(changes, Diff) else None
        counts = diff.counts() if diff is not None else {n: ch.count for n, ch in changes.items()}
        sparse: list[tuple[int, str]] = []
        codec, dense = self.codec, self.anchor_codec
        for name, count in counts.items():
            if not count:
                continue
            spec = specs[name]
            sparse_bytes = codec.estimate_size(spec, count)  # each codec sizes its own layout
            if sparse_bytes < dense.estimate_size(spec, count):
                sparse.append((sparse_bytes, name))
            else:
                whole.append((name, index_of))

        def old_tensor(name: str) -> torch.Tensor:
            if base is None:
                return mirror.host_view(name)  # a view of the parent's bits: the codec only reads it
            # the anchor's tensor: the mirror (this version) with the anchor's bits where they differ
            since = base.get(name)
            return mirror.at_anchor(name, since.positions, since.anchor_bits) if since is not None \
                else mirror.host_view(name)

        def needs_old(name: str) -> bool:  # what the encoder reads for this tensor (auto: only some)
            return codec.needs_for(specs[name], counts[name]) == "old_tensor"

        jobs: list[Job] = []
        # an object per compare buffer only where the copy it saves outweighs an object's fixed bytes
        breaks = diff.part_breaks() if diff is not None and diff.changed >= _SPLIT_AT_BUFFERS_ABOVE else set()
        for group in self._groups(sparse, limit or self.max_object_bytes, breaks):
            def make(group: list[str] = group) -> list[tuple[int, Update]] | UpdateBatch:
                olds = [needs_old(n) for n in group]
                if diff is not None:  # in name order, the order the built-in layouts store (no reorder there)
                    batch = diff.batch([specs[n] for n in sorted(group)],
                                       {n: old_tensor(n) for n, o in zip(group, olds) if o})
                    if batch is not None:
                        return batch
                ch = diff.changes if diff is not None else changes
                return [(0, Update(specs[n], ch[n].new_bits, ch[n].positions, ch[n].old_bits,
                                   old_tensor(n) if o else None)) for n, o in zip(group, olds)]
            jobs.append((codec, make, index_of))
        return jobs

    def _dense_jobs(self, specs: Mapping[str, TensorSpec], names: list[str], mirror: Mirror,
                    index_of: dict[str, list[Part]], object_bytes: int) -> list[Job]:
        """Whole tensors (views of the mirror) with the anchor codec; a tensor larger than an object is cut
        into flat slices."""
        items: list[tuple[int, tuple[str, int, int]]] = []
        for name in names:
            spec = specs[name]
            item = spec.bits_dtype.itemsize
            step = max(1, object_bytes // item)
            if spec.numel <= step:
                items.append((spec.numel * item, (name, 0, spec.numel)))
                continue
            for offset in range(0, spec.numel, step):
                numel = min(step, spec.numel - offset)
                items.append((numel * item, (name, offset, numel)))

        def make(group: list[tuple[str, int, int]]) -> list[tuple[int, Update]]:
            out = []
            for name, offset, numel in group:
                spec = specs[name]
                bits = mirror.host_view(name)
                if numel == spec.numel:
                    out.append((0, Update(spec, bits)))
                else:
                    out.append((offset, Update(TensorSpec(name, spec.dtype, (numel,)), bits[offset:offset + numel])))
            return out

        return [(self.anchor_codec, lambda group=group: make(group), index_of)
                for group in self._groups(items, object_bytes)]

    def _anchor_streaming(self, specs: Mapping[str, TensorSpec]) -> tuple[int, int]:
        """``(object bytes, objects in flight)`` for whole tensors: small enough objects, few enough at once
        that an anchor streams through a bounded amount of memory (about a tenth of the model; at least two
        objects, so that one encodes while another uploads)."""
        total = sum(s.numel * s.bits_dtype.itemsize for s in specs.values())
        object_bytes = min(self.max_object_bytes, max(ANCHOR_OBJECT_MIN, min(ANCHOR_OBJECT_MAX, total // 64)))
        inflight = max(min(2, self.max_workers), min(self.max_workers, int(0.1 * total) // max(1, object_bytes)))
        return object_bytes, inflight

    @staticmethod
    def _groups(items: list[tuple[int, Any]], limit: int, breaks: Collection[Any] = ()) -> Iterator[list[Any]]:
        """Runs of ``items`` (in order) of about ``limit`` bytes; an item in ``breaks`` starts a new run."""
        group: list[Any] = []
        size = 0
        for nbytes, item in items:
            if group and (size + nbytes > limit or item in breaks):
                yield group
                group, size = [], 0
            group.append(item)
            size += nbytes
        if group:
            yield group

    # -- chain state -----------------------------------------------------------------
    def _new_checksums(self, c: _Captured) -> dict[str, int]:
        """Every tensor's checksum after version ``c`` (the mirror already holds it)."""
        if c.diff is None:
            return c.mirror.checksums()
        new = c.mirror.checksums(c.layout[0]) if c.layout is not None else {}
        return {name: new[name] if name in new else (self._checksums[name] + delta) & _M64
                for name, delta in c.diff.sums.items()}

    def _advance_chain(self, manifest: Manifest, is_anchor: bool, with_diff: bool, proposed: Any,
                       drift_elements: int, total: int) -> None:
        delta_bytes = manifest.object_bytes(manifest.step_objects)
        c = self._chain
        per_element = delta_bytes / manifest.changed if manifest.parent is not None and manifest.changed \
            else c.bytes_per_element
        if is_anchor:
            self._anchor = self._last
            self._drift.reset()
            self._chain = ChainState(anchor_bytes=manifest.object_bytes(manifest.full_objects),
                                     bytes_per_element=per_element)
            return
        if proposed is not None:
            self._drift.commit(proposed)
        self._chain = ChainState(
            versions_since_anchor=c.versions_since_anchor + 1,
            delta_bytes_since_anchor=c.delta_bytes_since_anchor + delta_bytes,
            anchor_bytes=c.anchor_bytes, drift=drift_elements / max(total, 1), drift_elements=drift_elements,
            delta_bytes_since_differential=0 if with_diff else c.delta_bytes_since_differential + delta_bytes,
            bytes_per_element=per_element)

    def _resume(self, latest: int) -> None:
        with self.store.manifest_cache.holding():  # the chain's manifests are read once, whatever their size
            self._resume_held(latest)
        release_memory()  # the decode's buffers go back to the system, as after a publish

    def _resume_held(self, latest: int) -> None:
        from .subscriber import Subscriber  # the reader's path rebuilds the state bit-exactly

        sub = Subscriber(self.store)
        manifest = self.store.manifest(latest)
        self._specs = {t.name: t.spec for t in manifest.tensors}
        self._mirror = Mirror(self._specs, self.mirror_device)
        sub._pull_scratch({n: self._mirror.view(n) for n in self._specs}, latest)
        self._mirror.version = latest
        self._aliases = dict(manifest.aliases)
        self._checksums = {t.name: int(t.checksum, 16) for t in manifest.tensors}
        self._files = dict(manifest.files)
        self._last = self.store.ref(latest)
        # Walk back to the last anchor to rebuild what the policy measures.
        since, delta_bytes, changed, since_diff, m = 0, 0, 0, None, manifest
        while m.kind != "anchor" and m.parent is not None:
            since += 1
            if since_diff is None and m.differential is not None:
                since_diff = delta_bytes
            self._relaid_since_anchor = self._relaid_since_anchor or m.changes_layout
            delta_bytes += m.object_bytes(m.step_objects)
            changed += m.changed
            m = self.store.manifest(m.parent.step)
        if m.kind != "anchor":
            return  # no anchor on the chain: the policy will ask for one
        self._anchor = self.store.ref(m.step)
        drift_elements = 0
        if self.policy.tracks_drift and since and not self._relaid_since_anchor:
            # the anchor streamed tensor by tensor against the mirror: a few objects in memory, not the model
            mirror = self._mirror
            changes: dict[str, Change] = {}
            stream_anchor(self.store, m, workers=sub.max_workers, ahead=1, verify=sub.verify_anchors,
                          sink=lambda name, bits: changes.__setitem__(name, find_changes(bits, mirror.view(name))))
            proposed = self._drift.propose({n: changes[n] for n in self._specs})
            self._drift.commit(proposed)
            drift_elements = DriftTracker.count(proposed)
        total = sum(s.numel for s in self._specs.values())
        self._chain = ChainState(
            versions_since_anchor=since, delta_bytes_since_anchor=delta_bytes,
            anchor_bytes=m.object_bytes(m.full_objects), drift=drift_elements / max(total, 1),
            drift_elements=drift_elements,
            delta_bytes_since_differential=delta_bytes if since_diff is None else since_diff,
            bytes_per_element=delta_bytes / changed if changed else 0.0)

    def _record_files(self, source_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
        files = {}
        for fname in SOURCE_FILES:
            path = os.path.join(source_dir, fname)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    data = f.read()
                files[fname] = {"digest": self.store.put_object(data), "size": len(data)}
        if not files:
            raise FileNotFoundError(f"source_dir {source_dir} holds none of {', '.join(SOURCE_FILES[:3])}, ...")
        return files

    # -- retention -------------------------------------------------------------------
    def _apply_retention(self) -> None:
        assert self.retention is not None
        plan = plan_gc(self.store, self.retention)
        delete_versions(self.store, plan.delete_versions)
        if plan.delete_objects:
            self._gc_pending.append((time.monotonic(), plan.delete_objects))
        self._collect_pending()

    def _collect_pending(self) -> None:
        now = time.monotonic()
        due = [d for t, ds in self._gc_pending if now - t >= self.gc_grace for d in ds]
        self._gc_pending = [(t, ds) for t, ds in self._gc_pending if now - t < self.gc_grace]
        if due:
            delete_unreferenced(self.store, due, grace=self.gc_grace)

    def _producer(self) -> dict[str, Any]:
        return {"library": "deltastore", "version": __version__, "writer": self.writer_id,
                "host": socket.gethostname(), "pid": os.getpid()}
