"""Trainer side: find the bit-changed elements, store them, commit a version.

Lifecycle of :meth:`Publisher.publish` (data first, metadata last):

1. check the step (above the last one, not yet committed);
2. capture: diff every tensor against the mirror of the last published bits
   (:mod:`deltastore.publish.mirror`: one fused kernel pass per thread over
   every CPU tensor), or start a new chain, or step to a new layout;

steps 3–6 are the write (:mod:`deltastore.publish.version`), at once or in
the background writer (:mod:`deltastore.publish.background`):

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

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from concurrent.futures import Future
from typing import Any

import torch

from .. import progress as _progress
from .._gc import paused
from .._memory import release_memory
from ..adapters import peft_adapter, record_config
from ..codecs import Codec, TensorSpec
from ..errors import ManifestError, ReentrantCallError, TargetMismatchError
from ..gc import Retention
from ..manifest import VersionRef, check_tensor_name
from ..quantize import get_quantizer
from ..tensors import StateLike, dtype_name, named_tensors
from .anchors import AnchorPolicy, ChainState
from .background import BackgroundWriter
from .chain import check_step
from .diff import DEFAULT_CHUNK_ELEMS
from .info import PendingVersionInfo, VersionInfo
from .mirror import Mirror, Pending
from .resume import resume_chain
from .stages import DEFAULT_ANCHOR_CODEC, DEFAULT_MAX_OBJECT_BYTES, PublishStages
from .stream import diff_stream, owned_items
from .version import Captured, write_version


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
        gc_grace: seconds between deleting a manifest and deleting its objects; it must exceed the
            store's refresh window plus its timestamp resolution (10 s on local disk, 11 s on S3), else
            :class:`GraceTooShortError` (a concurrent publish reusing an object could lose a version).
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
        signing_key: sign every committed version and ``refs/latest`` with this Ed25519 key (a path to a PEM
            file from ``deltastore keygen``, PEM bytes or a key object; needs ``deltastore[sign]``). Followers
            with ``trusted_keys`` accept only versions it signed (``docs/security.md``). Kept in memory only.
        anchor_copy_dir: a local directory where the last anchor's bits are kept in a file (the model's
            bf16 bytes of disk), so that a version carrying a differential compares against it instead of
            downloading and decoding the whole anchor from the store again, as it does without one once the
            drift outgrows its tracker's budget (0.1 % of the model's bytes: a few steps after an anchor at
            RL learning rates). Written on a thread after the anchor's ``publish()`` returns. Best on a local
            disk, not a tmpfs (that would be memory). A copy that cannot be written or read back intact is
            dropped with a warning (:mod:`deltastore.publish.anchor_copy`). Removed at :meth:`close` (or at
            interpreter exit).

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
                 adapter_only: bool = False, signing_key: Any = None,
                 anchor_copy_dir: str | os.PathLike[str] | None = None):
        #: the stages (also what :class:`~deltastore.ShardedPublisher` opens per rank): the store, object
        #: planning, the chain's committed head and the anchor policy's decision, uploads, retention after each
        #: commit, the configuration they share (``deltastore/publish/stages.py``)
        self.stages = stages = PublishStages.open(
            uri, codec=codec, anchor_every=anchor_every, storage_options=storage_options, metadata=metadata,
            anchor=anchor, anchor_codec=anchor_codec, max_object_bytes=max_object_bytes, chunk_elems=chunk_elems,
            dtype=dtype, retention=retention, gc_grace=gc_grace, source_dir=source_dir, max_workers=max_workers,
            mirror_device=mirror_device, signing_key=signing_key, anchor_copy_dir=anchor_copy_dir)
        self.store, self.planner, self.head, self.uploader, self.retainer = (
            stages.store, stages.planner, stages.head, stages.uploader, stages.retainer)
        self.metadata, self.chunk_elems, self.dtype, self.mirror_device, self.writer_id = (
            stages.metadata, stages.chunk_elems, stages.dtype, stages.mirror_device, stages.writer_id)
        self._mirror: Mirror | None = None  # the committed version's bits (the writer's, in background mode)
        self._specs: dict[str, TensorSpec] = {}
        self._aliases: dict[str, str] = {}
        #: version files recorded in every manifest (``source_dir``'s config and tokenizer, an adapter's config)
        self.files: dict[str, dict[str, Any]] = {}
        self._closed = False
        self._lock = threading.Lock()  # one publish/flush/close at a time (publish's docstring)
        self.quantizer = get_quantizer(quantize)
        self.adapter_only = adapter_only
        # Background mode: the capture side compares against the same mirror object (which the
        # writer advances after each commit) corrected by what the queued versions changed.
        self._capture_mirror: Mirror | None = None
        self._pending = Pending()
        self._capture_specs: dict[str, TensorSpec] = {}
        self._capture_aliases: dict[str, str] = {}
        self._writer: BackgroundWriter[Captured] | None = None
        self._last_step = self.store.latest()
        if resume and self._last_step is not None:
            self._resume(self._last_step)
        if stages.files:  # recorded from source_dir: they replace what the resumed chain recorded
            self.files = dict(stages.files)
        self._capture_specs, self._capture_aliases = self._specs, self._aliases
        if background:
            self._capture_mirror = self._mirror
            self._writer = BackgroundWriter(self._write, self._committed_in_background, max_pending=max_pending)

    # -- public ------------------------------------------------------------------
    @property
    def last(self) -> VersionRef | None:
        """The last version this Publisher committed or resumed from."""
        return self.head.last

    @property
    def chain(self) -> ChainState:
        """The measured chain state since the last anchor (what the anchor policy sees)."""
        return self.head.state

    @property
    def policy(self) -> AnchorPolicy:
        """The anchor policy."""
        return self.head.policy

    @property
    def codec(self) -> Codec:
        """The codec of delta objects."""
        return self.planner.codec

    @property
    def anchor_codec(self) -> Codec:
        """The codec of whole tensors (anchors)."""
        return self.planner.anchor_codec

    def publish(self, state: StateLike, *, step: int, progress: _progress.ProgressArg = None) -> VersionInfo:
        """Commit ``state`` as version ``step``.

        Thread-safe: calls from several threads are serialised (one runs at a
        time, in the order they take the Publisher's lock), and each is
        checked against the step the previous one published, so a step that
        is no longer above the last raises :class:`StepOrderError` and one
        already committed :class:`VersionExistsError`; ``flush()`` and
        ``close()`` wait for a publish in progress. Calling any of them from
        the background writer's own thread (a done-callback of a pending
        version) raises :class:`ReentrantCallError`.

        ``state`` is an ``nn.Module``, a mapping or an iterable of
        ``(name, tensor)``, on any device. Raises :class:`VersionExistsError`
        if ``step`` is already committed (by this or another writer),
        :class:`StepOrderError` if it is not above the last step,
        :class:`TargetMismatchError` for an unsupported tensor.

        Synchronous (default): returns the :class:`VersionInfo` once the
        version is committed; on any error nothing is committed and the
        Publisher is unchanged, so the same step can be retried. An iterable
        of pairs (not a mapping or module) is a stream: each item need only
        stay valid until the next one is requested (a producer may recycle one
        buffer, or refill a tensor after yielding it). On a chain whose layout
        the Publisher knows it is compared piece by piece as it is consumed,
        so each tensor may be produced just in time and dropped; otherwise (a
        new chain, a layout change, ``quantize``, ``adapter_only``, background
        mode) each item is copied before the next is requested
        (``deltastore/publish/stream.py``). A ``list`` or ``tuple`` of pairs is
        held by the caller and taken as it is.

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
        with self._serialised():
            if progress is not None and progress is not False:
                with _progress.reporting(progress, desc=f"publish {step}", unit="objects"):
                    return self._publish(state, step)
            return self._publish(state, step)

    @paused
    def _publish(self, state: StateLike, step: int) -> VersionInfo:
        if self._closed:
            raise RuntimeError("Publisher is closed")
        if self._writer is not None:
            self._raise_background_error()
        check_step(step, self.store, self._last_step)
        if self._writer is None and self.stages.anchor_copy is not None:
            self.stages.anchor_copy.settle()  # the last anchor's copy reads the mirror this compare advances
        if (self._writer is None and self._mirror is not None and self.quantizer is None and not self.adapter_only
                and not isinstance(state, (Mapping, torch.nn.Module))):
            # an iterator on a known chain: compared piece by piece as it arrives (publish/stream.py)
            streamed = diff_stream(state, self._mirror, self._specs, self._aliases, self.dtype,
                                   chunk_elems=self.chunk_elems)
            if streamed.diff is not None:
                return self._write_sync(Captured(step, self._specs, self._aliases, self._mirror, streamed.diff,
                                                  time.time()))
            state = streamed.pairs  # it left the layout: the ordinary capture below
        elif not isinstance(state, (Mapping, torch.nn.Module, list, tuple)):
            state = owned_items(state)  # a stream captured whole: each item copied before the next is produced
        tensors, specs, aliases = self._normalise(state)
        background = self._writer is not None
        mirror = self._capture_mirror if background else self._mirror
        same_layout = mirror is not None and specs == self._capture_specs and aliases == self._capture_aliases
        if not same_layout and mirror is not None and aliases == self._capture_aliases:
            # a layout change (a tensor added, dropped, reshaped or re-typed): the version stays on the chain
            if background:  # wait until the writer's mirror holds the last captured version
                assert self._writer is not None
                self._writer.join()
                self._raise_background_error()
                self._pending.clear()
            fresh, new, dropped = mirror.relayout(specs, tensors)
            diff = fresh.diff(tensors, chunk_elems=self.chunk_elems)
            captured = Captured(step, specs, aliases, fresh, diff, time.time(), (new, dropped))
        elif same_layout:
            assert mirror is not None
            # synchronous: the mirror moves to this version in the compare's own pass (the write moves it
            # back if the version fails); background: the writer advances it after each commit
            diff = mirror.diff(tensors, chunk_elems=self.chunk_elems, pending=self._pending if background else None,
                               advance=not background)
            captured = Captured(step, specs, aliases, mirror, diff, time.time())
        else:  # a new chain: a private copy of every tensor, which becomes the mirror
            if background:
                self._capture_mirror = self._mirror = None  # queued versions keep what they need
            fresh = Mirror.capture(tensors, specs, self.mirror_device)
            fresh.version = step
            captured = Captured(step, specs, aliases, fresh, None, time.time())
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
        assert self._writer is not None
        self._writer.submit(step, captured, future)  # blocks while max_pending versions wait: back-pressure
        return info

    def _write_sync(self, captured: Captured) -> VersionInfo:
        """Write ``captured`` now; on any error the Publisher is as it was before this publish()."""
        self._capture_specs, self._capture_aliases = captured.specs, captured.aliases
        self._last_step = captured.step
        try:
            info = self._write(captured)
        except BaseException:
            self._last_step = self.head.last.step if self.head.last is not None else self.store.latest()
            self._capture_specs, self._capture_aliases = self._specs, self._aliases
            raise
        release_memory()  # once _write's temporaries (a differential, encoded objects) are freed, not before
        return info

    def refresh_latest(self) -> None:
        """Sign ``refs/latest`` again, for the last committed version, with the time now.

        Followers that bound the age of the signed latest (``Subscriber(max_latest_age=...)``) take it as
        fresh again: call it while the trainer publishes nothing for longer than that bound (evaluation, a
        checkpoint). A no-op without a signing key or before the first commit. With ``background=True`` the
        queued versions are committed first (:meth:`flush`), so the ref never names an older version than
        the last commit's; call it from the thread that publishes.
        """
        self.flush()
        last = self.head.last
        if self.store.signer is not None and last is not None:
            self.store.write_latest(last.step, last.digest)

    def flush(self) -> None:
        """Wait until every queued version is committed; raise a background error if one occurred."""
        with self._serialised():
            if self._writer is not None:
                self._writer.join()
                self._raise_background_error()

    def close(self) -> None:
        """Drain queued versions, finish deferred deletions whose grace has passed, release everything.

        Raises a background error after closing, if one occurred.
        """
        with self._serialised():
            if self._closed:
                return
            error = self._writer.close() if self._writer is not None else None
            self._closed = True
            self._mirror = self._capture_mirror = None
            self.stages.close()
        if error is not None:
            raise error

    @contextmanager
    def _serialised(self) -> Iterator[None]:
        """Hold the Publisher's lock: one publish, flush or close at a time (see :meth:`publish`)."""
        if self._writer is not None and self._writer.is_writer_thread():
            raise ReentrantCallError("publish(), flush() and close() cannot be called from the Publisher's "
                                     "background writer thread (a pending version's callback): it would wait "
                                     "for itself; hand the call to another thread")
        with self._lock:
            yield

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------
    @paused
    def _write(self, c: Captured) -> VersionInfo:
        """Write and commit one captured version (:func:`~deltastore.publish.version.write_version`); then this
        Publisher's committed layout and mirror are the version's."""
        info = write_version(self.stages, c, files=self.files, quantizer=self.quantizer)
        if c.fresh or c.layout is not None:
            self._specs, self._aliases = c.specs, c.aliases
        self._mirror = c.mirror
        return info

    def _committed_in_background(self, captured: Captured) -> None:
        self._pending.prune(captured.step)  # the mirror holds it now: the capture needs it no more

    def _raise_background_error(self) -> None:
        """Raise the background writer's failure, if any, once the queue has drained; the capture side, which
        ran ahead of what was committed, then starts again from the store's latest version."""
        assert self._writer is not None
        if self._writer.error is None:
            return
        error = self._writer.take_error()
        self._capture_mirror = None
        self._mirror = None
        self._pending.clear()
        self.head.reset()
        self._last_step = self.store.latest()
        if error is not None:
            raise error

    # -- inputs ------------------------------------------------------------------
    def _normalise(self, state: StateLike
                   ) -> tuple[dict[str, torch.Tensor], dict[str, TensorSpec], dict[str, str]]:
        aliases: dict[str, str] = {}
        if self.adapter_only:  # the adapter's tensors, and its config as a version file
            state, config = peft_adapter(state)
            self.files = record_config(self.store, self.files, config)
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

    # -- chain state -----------------------------------------------------------------
    def _resume(self, latest: int) -> None:
        with self.store.manifest_cache.holding():  # the chain's manifests are read once, whatever their size
            got = resume_chain(self.store, self.head, latest, mirror_device=self.mirror_device,
                               workers=self.planner.max_workers)
        self._mirror, self._specs, self._aliases, self.files = got.mirror, got.specs, got.aliases, got.files
        release_memory()  # the decode's buffers go back to the system, as after a publish
