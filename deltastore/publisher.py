"""Trainer side: find the bit-changed elements, store them, commit a version.

Lifecycle of :meth:`Publisher.publish` (data first, metadata last):

1. check the step (above the last one, not yet committed);
2. diff every tensor against the CPU mirror of the last published bits;
3. encode and store the objects (content-addressed, idempotent);
4. commit the manifest create-only;
5. only then update the mirror, checksums and chain state.

A failure before step 4 leaves the store without the version (stray objects
are garbage, never half a version) and the Publisher unchanged, so the same
step can be retried.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._version import __version__
from .anchors import AnchorPolicy, ChainState, Every, get_anchor_policy
from .checksum import format_checksum, full_checksum, updated_checksum
from .codecs import Codec, TensorSpec, Update, get_codec
from .diff import DEFAULT_CHUNK_ELEMS, Change, find_changes
from .errors import ManifestError, StepOrderError, TargetMismatchError, VersionExistsError
from .manifest import MAX_STEP, Manifest, ObjectRecord, TensorRecord, VersionRef, check_tensor_name
from .store import DeltaStore, open_store
from .tensors import StateLike, bits_view, dtype_name, named_tensors

DEFAULT_MAX_OBJECT_BYTES = 1 << 30


@dataclass(frozen=True)
class VersionInfo:
    """What :meth:`Publisher.publish` committed.

    kind: ``"anchor"`` (full objects written, plus a delta when there is a parent) or ``"delta"``.
    changed / total: elements whose bits changed since the previous version / all elements.
    nbytes: bytes stored for this version (its objects and its manifest).
    digest: sha256 of the manifest bytes, the version's identity.
    """

    step: int
    kind: str
    changed: int
    total: int
    nbytes: int
    digest: str
    created: float

    @property
    def fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0


class Publisher:
    """Publish successive versions of a model's weights to a store.

    Args:
        uri: where to publish (path, ``file://``, ``memory://``, or any registered scheme).
        codec: codec for delta objects (a name, a codec record dict or a Codec).
        anchor_every: anchor interval in versions (used when ``anchor`` is None).
        storage_options: passed to the backend (credentials, endpoint, ...).
        metadata: JSON-serialisable dict recorded in every manifest (run id, lr, ...).
        resume: on a store that already has versions, rebuild the mirror from
            the latest one so the chain continues; with False the first publish
            starts a new chain with an anchor.
        anchor: an anchor policy (object, registered name or config dict);
            overrides ``anchor_every``.
        anchor_codec: codec for whole tensors (anchors, and delta tensors whose
            sparse encoding would be larger than a dense one).
        max_object_bytes: objects are split so none is much larger than this.
        chunk_elems: elements compared per chunk when diffing.
        dtype: publish every floating-point tensor in this dtype (e.g.
            ``torch.bfloat16`` for an fp32 master); cast chunk by chunk.

    Raises :class:`UnknownCodecError` for an unknown codec and ``TypeError``
    for metadata that is not JSON-serialisable.
    """

    def __init__(self, uri: Any, *, codec: str | dict[str, Any] | Codec = "raw", anchor_every: int = 10,
                 storage_options: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                 resume: bool = True, anchor: AnchorPolicy | str | dict[str, Any] | None = None,
                 anchor_codec: str | dict[str, Any] | Codec = "dense",
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                 dtype: torch.dtype | None = None):
        self.store: DeltaStore = open_store(uri, **(storage_options or {}))
        self.codec = get_codec(codec)
        self.anchor_codec = get_codec(anchor_codec)
        if self.codec.dense:
            raise ValueError(f"codec {self.codec.codec_id!r} stores whole tensors; pass it as anchor_codec")
        if not self.anchor_codec.dense:
            raise ValueError(f"anchor_codec {self.anchor_codec.codec_id!r} does not store whole tensors")
        self.policy = get_anchor_policy(anchor) if anchor is not None else Every(anchor_every)
        self.metadata = dict(metadata or {})
        json.dumps(self.metadata, allow_nan=False)  # fail now, not at the first commit
        self.max_object_bytes = max_object_bytes
        self.chunk_elems = chunk_elems
        self.dtype = dtype
        if dtype is not None:
            dtype_name(dtype)
        self.writer_id = uuid.uuid4().hex
        self._mirror: dict[str, torch.Tensor] | None = None
        self._specs: dict[str, TensorSpec] = {}
        self._aliases: dict[str, str] = {}
        self._checksums: dict[str, int] = {}
        self._last: VersionRef | None = None
        self._last_step: int | None = None
        self._chain = ChainState(0, 0, 0)
        self._closed = False
        latest = self.store.latest()
        self._last_step = latest
        if resume and latest is not None:
            self._resume(latest)

    # -- public ------------------------------------------------------------------
    @property
    def last(self) -> VersionRef | None:
        """The last version this Publisher committed or resumed from."""
        return self._last

    def publish(self, state: StateLike, *, step: int) -> VersionInfo:
        """Commit ``state`` as version ``step``.

        ``state`` is an ``nn.Module``, a mapping or an iterable of
        ``(name, tensor)``, on any device. Raises :class:`VersionExistsError`
        if ``step`` is already committed, :class:`StepOrderError` if it is not
        above the last step, :class:`TargetMismatchError` for an unsupported
        tensor. On any error nothing is committed and the Publisher is unchanged.
        """
        if self._closed:
            raise RuntimeError("Publisher is closed")
        self._check_step(step)
        aliases: dict[str, str] = {}
        tensors = named_tensors(state, aliases)
        specs = {}
        for name, t in tensors.items():
            try:
                check_tensor_name(name)
            except ManifestError as e:
                raise TargetMismatchError(str(e)) from None
            specs[name] = TensorSpec(name, self._dtype_of(t), tuple(t.shape))
            dtype_name(specs[name].dtype)
        for alias in aliases:
            try:
                check_tensor_name(alias)
            except ManifestError as e:
                raise TargetMismatchError(str(e)) from None
        same_layout = self._mirror is not None and specs == self._specs and aliases == self._aliases
        is_anchor = not same_layout or self.policy.should_anchor(self._chain)
        parent = self._last if same_layout else None

        changes: dict[str, Change] = {}
        # A new chain needs a private host copy of every tensor anyway (the next mirror).
        fresh = None if same_layout else {name: self._host_bits(t, specs[name]) for name, t in tensors.items()}
        if same_layout:
            assert self._mirror is not None
            for name, t in tensors.items():
                changes[name] = find_changes(self._mirror[name], t, chunk_elems=self.chunk_elems,
                                             dtype=specs[name].dtype)

        objects: list[ObjectRecord] = []
        delta_of: dict[str, int] = {}
        full_of: dict[str, int] = {}
        if parent is not None:
            self._write_delta_objects(specs, changes, objects, delta_of)
        if is_anchor:
            self._write_full_objects(specs, tensors, fresh, objects, full_of)

        checksums = self._new_checksums(changes, fresh)
        records = []
        for name, spec in specs.items():
            changed = changes[name].count if same_layout else spec.numel
            records.append(TensorRecord(name, dtype_name(spec.dtype), spec.shape, changed,
                                        format_checksum(checksums[name]), delta_of.get(name), full_of.get(name)))
        created = time.time()
        manifest = Manifest(step=step, kind="anchor" if is_anchor else "delta", parent=parent,
                            tensors=tuple(records), objects=tuple(objects), created=created,
                            producer=self._producer(), metadata=self.metadata, aliases=aliases)
        data, digest = self.store.commit(manifest)

        # Committed: now (and only now) move the mirror and the chain state forward.
        if fresh is None:
            assert self._mirror is not None
            for name, ch in changes.items():
                if ch.count:
                    self._mirror[name][ch.positions] = ch.new_bits
        else:
            self._mirror = fresh
            self._specs = specs
            self._aliases = aliases
        self._checksums = checksums
        self._last = VersionRef(step, digest)
        self._last_step = step
        delta_bytes = manifest.object_bytes(manifest.delta_objects)
        if is_anchor:
            self._chain = ChainState(0, 0, manifest.object_bytes(manifest.full_objects))
        else:
            c = self._chain
            self._chain = ChainState(c.versions_since_anchor + 1, c.delta_bytes_since_anchor + delta_bytes,
                                     c.anchor_bytes)
        return VersionInfo(step=step, kind=manifest.kind, changed=manifest.changed, total=manifest.total,
                           nbytes=manifest.object_bytes() + len(data), digest=digest, created=created)

    def close(self) -> None:
        """Release the mirror and the store connection; further publishes raise."""
        if not self._closed:
            self._closed = True
            self._mirror = None
            self.store.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steps -------------------------------------------------------------------
    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise StepOrderError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
        if self.store.has_version(step):
            raise VersionExistsError(f"version {step} already exists in {self.store.uri}")
        if self._last_step is not None and step <= self._last_step:
            raise StepOrderError(f"step {step} is not above the last published step {self._last_step}")

    # -- objects -----------------------------------------------------------------
    def _write_delta_objects(self, specs: Mapping[str, TensorSpec], changes: Mapping[str, Change],
                             objects: list[ObjectRecord], delta_of: dict[str, int]) -> None:
        sparse: list[tuple[int, Update]] = []
        dense: list[tuple[int, Update]] = []
        for name, ch in changes.items():
            if not ch.count:
                continue
            spec = specs[name]
            item_bytes = spec.bits_dtype.itemsize
            sparse_bytes = ch.count * (item_bytes + (4 if spec.numel < 2**31 else 8))
            if sparse_bytes < spec.numel * item_bytes:
                sparse.append((sparse_bytes, Update(spec, ch.new_bits, ch.positions, ch.old_bits)))
            else:  # dense is smaller: store the whole new tensor, from the mirror plus the change
                assert self._mirror is not None
                bits = self._mirror[name].clone()
                bits[ch.positions] = ch.new_bits
                dense.append((spec.numel * item_bytes, Update(spec, bits)))
        for codec, items in ((self.codec, sparse), (self.anchor_codec, dense)):
            for group in self._groups(items):
                self._store_object(codec, group, objects, delta_of)

    def _write_full_objects(self, specs: Mapping[str, TensorSpec], tensors: Mapping[str, torch.Tensor],
                            host: Mapping[str, torch.Tensor] | None, objects: list[ObjectRecord],
                            full_of: dict[str, int]) -> None:
        # Without ready host copies, copy one group at a time: host memory holds one object's worth.
        sized = [(s.numel * s.bits_dtype.itemsize, name) for name, s in specs.items()]
        for group in self._groups(sized):
            updates = [Update(specs[n], host[n] if host is not None else self._host_bits(tensors[n], specs[n]))
                       for n in group]
            self._store_object(self.anchor_codec, updates, objects, full_of)

    def _groups(self, items: list[tuple[int, Any]]) -> Iterator[list[Any]]:
        group: list[Any] = []
        size = 0
        for nbytes, item in items:
            if group and size + nbytes > self.max_object_bytes:
                yield group
                group, size = [], 0
            group.append(item)
            size += nbytes
        if group:
            yield group

    def _store_object(self, codec: Codec, updates: list[Update], objects: list[ObjectRecord],
                      index_of: dict[str, int]) -> None:
        data = codec.encode(updates)
        digest = self.store.put_object(data)
        objects.append(ObjectRecord(digest, len(data), codec.describe()))
        for u in updates:
            index_of[u.spec.name] = len(objects) - 1

    # -- checksums and resume ------------------------------------------------------
    def _new_checksums(self, changes: Mapping[str, Change], fresh: Mapping[str, torch.Tensor] | None
                       ) -> dict[str, int]:
        if fresh is not None:
            return {name: full_checksum(name, bits) for name, bits in fresh.items()}
        out = {}
        for name, ch in changes.items():
            before = self._checksums[name]
            out[name] = updated_checksum(name, before, ch.positions, ch.old_bits, ch.new_bits) if ch.count else before
        return out

    def _resume(self, latest: int) -> None:
        from .subscriber import Subscriber  # the reader's path rebuilds the state bit-exactly

        result = Subscriber(self.store).pull(step=latest)
        manifest = self.store.manifest(latest)
        self._mirror = {name: bits_view(t) for name, t in result.state.items()}
        self._specs = {t.name: t.spec for t in manifest.tensors}
        self._aliases = dict(manifest.aliases)
        self._checksums = {t.name: int(t.checksum, 16) for t in manifest.tensors}
        self._last = self.store.ref(latest)
        # Rebuild the chain state back to the last anchor for the policy.
        since, delta_bytes, m = 0, 0, manifest
        while m.kind != "anchor" and m.parent is not None:
            since += 1
            delta_bytes += m.object_bytes(m.delta_objects)
            m = self.store.manifest(m.parent.step)
        self._chain = ChainState(since, delta_bytes, m.object_bytes(m.full_objects))

    def _dtype_of(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    @staticmethod
    def _host_bits(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """A private CPU copy of ``t``'s bits in the published dtype."""
        if t.dtype == spec.dtype:
            return bits_view(t).to("cpu", copy=True)
        return bits_view(t.detach().to("cpu", spec.dtype).contiguous())

    def _producer(self) -> dict[str, Any]:
        return {"library": "deltastore", "version": __version__, "writer": self.writer_id,
                "host": socket.gethostname(), "pid": os.getpid()}
