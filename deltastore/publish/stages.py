"""The stages every publisher composes, configured once from the arguments :class:`~deltastore.Publisher`
documents.

:meth:`PublishStages.open` checks the configuration (codecs, anchor policy,
metadata, dtype), opens the store and builds, for one writer: the object
:class:`~deltastore.publish.objects.ObjectPlanner`, the chain's
:class:`~deltastore.publish.chain.ChainHead`, the
:class:`~deltastore.publish.upload.Uploader`, the retention
:class:`~deltastore.publish.commit.Retainer` and the version files recorded
from ``source_dir`` (and, with ``anchor_copy_dir``, the
:class:`~deltastore.publish.anchor_copy.AnchorCopy`). :class:`~deltastore.Publisher` adds capture and the
background writer on top; :class:`~deltastore.ShardedPublisher` opens one per
rank. :meth:`PublishStages.close` releases what :meth:`open` acquired.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from .._memory import pin_allocator
from .anchor_copy import AnchorCopy
from .anchors import AnchorPolicy, Every, get_anchor_policy
from ..codecs import Codec, get_codec
from .diff import DEFAULT_CHUNK_ELEMS
from ..errors import GraceTooShortError
from ..gc import Retention, check_grace
from ..signing import load_signing_key
from ..manifest_cache import ManifestCache
from ..store import DeltaStore, open_store
from ..tensors import available_device, dtype_name
from .chain import ChainHead
from .commit import Retainer
from .objects import ObjectPlanner
from .upload import Uploader

DEFAULT_MAX_OBJECT_BYTES = 1 << 30
#: anchors: exponent and mantissa byte planes, zstd-compressed (~68 % of raw bf16)
DEFAULT_ANCHOR_CODEC: dict[str, Any] = {"id": "dense", "config": {"planes": True}}
#: files copied from ``source_dir`` so that ``materialize`` writes a loadable model folder.
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                "chat_template.jinja", "preprocessor_config.json")


@dataclass
class PublishStages:
    """One writer's configured stages (see the module docstring); fields as :class:`~deltastore.Publisher`
    documents its arguments."""

    store: DeltaStore
    planner: ObjectPlanner
    head: ChainHead
    uploader: Uploader
    retainer: Retainer | None
    metadata: dict[str, Any]
    chunk_elems: int
    dtype: torch.dtype | None
    mirror_device: torch.device | None
    #: version files recorded in every manifest (``source_dir``'s config and tokenizer)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    writer_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: the last anchor's bits on local disk, for differentials (``anchor_copy_dir``); None: read back from the store
    anchor_copy: AnchorCopy | None = None

    @classmethod
    def open(cls, uri: Any, *, codec: str | dict[str, Any] | Codec = "auto", anchor_every: int | None = None,
             storage_options: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
             anchor: AnchorPolicy | str | dict[str, Any] | None = None,
             anchor_codec: str | dict[str, Any] | Codec = DEFAULT_ANCHOR_CODEC,
             max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
             dtype: torch.dtype | None = None, retention: Retention | None = None, gc_grace: float = 30.0,
             source_dir: str | os.PathLike[str] | None = None, max_workers: int = 4,
             mirror_device: str | torch.device | None = None, signing_key: Any = None,
             anchor_copy_dir: str | os.PathLike[str] | None = None) -> PublishStages:
        """Check the configuration, open the store, build the stages.

        Raises :class:`~deltastore.errors.UnknownCodecError` for an unknown codec or anchor policy,
        ``TypeError`` for metadata that is not JSON-serialisable, ``ValueError`` for an unsupported dtype,
        ``FileNotFoundError`` for a ``source_dir`` holding none of :data:`SOURCE_FILES`,
        :class:`~deltastore.errors.DeviceUnavailableError` for a ``mirror_device`` this process does not
        have, :class:`~deltastore.errors.GraceTooShortError` for a ``gc_grace`` not longer than the store's
        :attr:`~deltastore.store.DeltaStore.min_gc_grace`, and what opening the store raises; for
        ``signing_key`` (which then signs every commit, :mod:`deltastore.signing`)
        :class:`~deltastore.errors.SigningKeyError` and :class:`~deltastore.errors.MissingDependencyError`.
        """
        signer = load_signing_key(signing_key) if signing_key is not None else None
        planner_codecs = get_codec(codec), get_codec(anchor_codec)
        if anchor is not None:
            policy = get_anchor_policy(anchor)
        elif anchor_every is not None:
            policy = Every(anchor_every)
        else:
            policy = get_anchor_policy("adaptive")
        metadata = dict(metadata or {})
        json.dumps(metadata, allow_nan=False)  # fail now, not at the first commit
        if dtype is not None:
            dtype_name(dtype)
        mirror = available_device(mirror_device, "mirror_device") if mirror_device is not None else None
        pin_allocator()  # freed temporaries go back to the OS (deltastore._memory)
        store = open_store(uri, **(storage_options or {}))
        try:
            check_grace(store, gc_grace, "gc_grace")
        except GraceTooShortError:
            if store is not uri:  # opened here
                store.close()
            raise
        # a writer needs its parent's manifest only (the next commit's checks): every one more it kept would be
        # resident between versions (1.6 MB parsed for 4,070 tensors)
        store.manifest_cache = ManifestCache(max_entries=1, keep=1)
        store.signer = signer
        planner = ObjectPlanner(*planner_codecs, max_object_bytes=max_object_bytes, max_workers=max_workers)
        stages = cls(store, planner, ChainHead(policy), Uploader(store, planner.max_workers),
                     Retainer(store, retention, gc_grace) if retention is not None else None, metadata,
                     chunk_elems, dtype, mirror)
        if anchor_copy_dir is not None:
            stages.anchor_copy = AnchorCopy(anchor_copy_dir)
        if source_dir is not None:
            stages.files = source_files(store, source_dir)
        return stages

    def close(self) -> None:
        """Finish deferred deletions whose grace has passed, stop the uploads, close the store."""
        if self.retainer is not None:
            self.retainer.collect_due()
        self.uploader.close()
        if self.anchor_copy is not None:
            self.anchor_copy.drop()
        self.store.close()


def source_files(store: DeltaStore, source_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Store ``source_dir``'s :data:`SOURCE_FILES` as objects: ``{file name: {"digest", "size"}}``.
    ``FileNotFoundError`` when it holds none of them."""
    files = {}
    for fname in SOURCE_FILES:
        path = os.path.join(source_dir, fname)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read()
            files[fname] = {"digest": store.put_object(data), "size": len(data)}
    if not files:
        raise FileNotFoundError(f"source_dir {source_dir} holds none of {', '.join(SOURCE_FILES[:3])}, ...")
    return files


__all__ = ["DEFAULT_ANCHOR_CODEC", "DEFAULT_MAX_OBJECT_BYTES", "PublishStages", "SOURCE_FILES", "source_files"]
