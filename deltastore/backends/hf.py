"""Hugging Face Buckets through ``huggingface_hub``'s bucket API: ``hf://buckets/<ns>/<bucket>[/<prefix>]``.

Calls used: ``bucket_info`` / ``create_bucket`` (open), ``batch_bucket_files``
(put, put_many, delete), ``download_bucket_files`` (get, get_many),
``get_bucket_paths_info`` (exists, create checks), ``list_bucket_tree`` (list).
File contents travel through ``hf_xet``; the token comes from the usual HF
places (``token=`` option, ``HF_TOKEN``, the saved login), the endpoint from
``endpoint=`` or ``HF_ENDPOINT``.

Options: ``token``, ``endpoint``, ``create_bucket`` (create it when missing,
default False), ``private`` (for a created bucket),
``max_workers`` (unused: hf_xet parallelises a batch itself), ``progress``,
``verify_delay`` (seconds between a create-only write and its read-back,
default 0.5), ``verify_keys`` (a predicate: which create-only keys are read
back; default: all but content-addressed ``objects/...`` keys, whose bytes
are identical whoever writes them), ``check_bucket`` (default True).
(``retry`` and ``deadline`` go to the retry layer that
:func:`~deltastore.backends.open_backend` puts around this backend.)

Client errors are translated in one place, :meth:`HfBucketBackend._call`.
Listing a prefix that does not exist yields nothing, whether the server
answers an empty page or 404. Modification times are the server's
``uploadedAt``.

**Guarantees.** The native bucket API has no conditional write, so
``capabilities.atomic_create`` is False. ``put(mode="create")`` does the
strongest thing available without one:

1. check: the key must be absent (``get_bucket_paths_info``), else
   :class:`KeyExistsError`;
2. write;
3. wait ``verify_delay`` seconds, read the value back and compare bytes:
   another writer's value there means this writer lost, and it gets
   :class:`KeyExistsError`.

What this guarantees: a writer that finds the key present never writes; a
writer whose read-back shows another value reports the conflict; a reader
never sees a half-written value (a file appears in the bucket index whole).
What it does not: two writers whose check-write-verify windows interleave
exactly (both checks before either write, the second write landing after the
first writer's read-back) can both believe they won, and the later write
replaces the earlier one. deltastore's objects are content-addressed (a
replaced object has identical bytes), so only manifests are exposed, and a
manifest carries its writer's identity and digest, so the overwritten
writer's next publish or any subscriber detects the mismatch. Deployments
that need atomic manifest creation use the HF S3 gateway through ``s3://``
(``If-None-Match`` is honoured there), see docs/backends.md.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import huggingface_hub  # noqa: F401 - a missing extra fails here, so the registry reports its install hint

from ..errors import (AccessDeniedError, BackendError, BackendUnavailableError, BucketNotFoundError, KeyExistsError,
                      KeyNotFoundError, ValueTooLargeError)
from .base import Backend, Capabilities, KeyInfo, PutMode, check_key
from .credentials import credentials_error, missing_credentials
from .options import check_options
from .retry import Progress, ProgressCallback, http_status, is_refused, is_transient

_URI_PREFIX = "hf://buckets/"


def _not_content_addressed(key: str) -> bool:
    return not key.startswith("objects/")


def parse_bucket_uri(uri: str) -> tuple[str, str]:
    """``hf://buckets/NS/NAME[/PREFIX]`` -> (``"NS/NAME"``, ``"PREFIX"``); ValueError for anything else."""
    if not uri.startswith(_URI_PREFIX):
        raise ValueError(f"not an HF bucket URI (hf://buckets/<namespace>/<bucket>[/<prefix>]): {uri!r}")
    parts = uri[len(_URI_PREFIX):].strip("/").split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"HF bucket URI needs a namespace and a bucket name: {uri!r}")
    prefix = parts[2].strip("/") if len(parts) > 2 else ""
    if prefix:
        check_key(prefix)
    return f"{parts[0]}/{parts[1]}", prefix


class HfBucketBackend(Backend):
    """Keys under ``prefix`` of the HF bucket ``bucket_id`` (``"namespace/name"``).

    Raises :class:`KeyNotFoundError`, :class:`KeyExistsError`,
    :class:`BucketNotFoundError`, :class:`AccessDeniedError`, and
    :class:`BackendError` for a transport failure that outlives the retries.
    """

    capabilities = Capabilities(atomic_create=False, listing=True, ranged_reads=False, remote=True,
                                mtime_resolution=0.001, batch_transfers=True)

    def __init__(self, bucket_id: str, prefix: str = "", *, token: str | bool | None = None,
                 endpoint: str | None = None, progress: ProgressCallback | None = None,
                 verify_delay: float = 0.5, verify_keys: Callable[[str], bool] | None = None,
                 max_workers: int | None = None, uri: str = "", create_bucket: bool = False,
                 private: bool | None = None, check_bucket: bool = True):
        from huggingface_hub import HfApi

        self.bucket_id = bucket_id
        self.prefix = prefix.strip("/")
        self.uri = uri or f"{_URI_PREFIX}{bucket_id}" + (f"/{self.prefix}" if self.prefix else "")
        self.api = HfApi(endpoint=endpoint, token=token)
        self._open = (bool(create_bucket), private, bool(check_bucket))
        self.progress = Progress(progress)
        self.verify_delay = float(verify_delay)
        self.verify_keys = verify_keys or _not_content_addressed
        self._tmp = tempfile.mkdtemp(prefix="deltastore-hf-")

    def __repr__(self) -> str:
        return f"HfBucketBackend({self.uri!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> HfBucketBackend:
        """Open ``hf://buckets/NS/NAME[/PREFIX]`` (options: see the module docstring).

        Raises :class:`BucketNotFoundError` (missing bucket, unless
        ``create_bucket=True``) and :class:`AccessDeniedError` (token refused).
        """
        bucket_id, prefix = parse_bucket_uri(uri)
        valid = [p for p in inspect.signature(cls.__init__).parameters
                 if p not in ("self", "bucket_id", "prefix", "uri")]
        check_options(options, valid, uri)
        return cls(bucket_id, prefix, uri=uri, **options)

    def check_access(self) -> None:
        """Create the bucket (``create_bucket=True``) or check that it exists and the token is accepted."""
        create, private, check = self._open
        if create:
            self._call("create bucket", self.bucket_id,
                       lambda: self.api.create_bucket(self.bucket_id, private=private, exist_ok=True))
        elif check:
            self._call("open bucket", self.bucket_id, lambda: self.api.bucket_info(self.bucket_id))

    # -- helpers -------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn()``, translating huggingface_hub's and hf_xet's errors (the one place for this client)."""
        from huggingface_hub.errors import BucketNotFoundError as HfBucketNotFound, EntryNotFoundError

        try:
            return fn()
        except (KeyExistsError, KeyNotFoundError, ValueTooLargeError, BackendError):
            raise
        except HfBucketNotFound as e:
            raise BucketNotFoundError(f"HF bucket {self.bucket_id!r} does not exist or is not visible "
                                      f"with this token ({self.uri})") from e
        except EntryNotFoundError:
            raise KeyNotFoundError(f"{key!r} not found in {self.uri}") from None
        except Exception as e:
            if missing_credentials(e) or (is_refused(e) and not self._has_token()):
                raise credentials_error("hf", self.uri, e) from e
            if is_refused(e):
                raise AccessDeniedError(f"{what} {key!r} in {self.uri}: access denied ({e})") from e
            if is_transient(e):
                raise BackendUnavailableError(f"{what} {key!r} in {self.uri} (endpoint {self.api.endpoint}): "
                                              f"{type(e).__name__}: {e}") from e
            if isinstance(e, OSError):
                raise BackendError(f"{what} {key!r} in {self.uri} failed: {e}") from e
            raise

    def _has_token(self) -> bool:
        """Whether a token was given or found (``HF_TOKEN``, the saved login)."""
        if self.api.token is not None:
            return bool(self.api.token)
        from huggingface_hub import get_token

        return get_token() is not None

    def _download(self, paths: list[str]) -> dict[str, bytes]:
        """Fetch ``paths`` in one batch; raises EntryNotFoundError when any is missing."""
        folder = tempfile.mkdtemp(dir=self._tmp)
        try:
            files = [(p, os.path.join(folder, str(i))) for i, p in enumerate(paths)]
            self.api.download_bucket_files(self.bucket_id, files, raise_on_missing_files=True)
            out = {}
            for p, local in files:
                with open(local, "rb") as f:
                    out[p] = f.read()
            return out
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _present(self, paths: list[str]) -> set[str]:
        return {info.path for info in self.api.get_bucket_paths_info(self.bucket_id, paths)}

    def _infos(self, paths: list[str]) -> dict[str, Any]:
        return {info.path: info for info in self.api.get_bucket_paths_info(self.bucket_id, paths)}

    # -- Backend hooks ---------------------------------------------------------------
    def _get(self, key: str) -> bytes:
        path = self._path(key)
        data = self._call("get", key, lambda: self._download([path]))[path]
        self.progress("get", key, len(data))
        return data

    def _stat(self, key: str) -> KeyInfo:
        path = self._path(key)
        info = self._call("stat", key, lambda: self._infos([path])).get(path)
        if info is None:
            raise KeyNotFoundError(f"{key!r} not found in {self.uri}")
        when = getattr(info, "uploaded_at", None) or getattr(info, "mtime", None)
        if when is None:
            raise BackendError(f"stat {key!r} in {self.uri}: the server reports no upload time")
        return KeyInfo(int(info.size), when.timestamp())

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        path = self._path(key)
        data = bytes(data)
        if mode == "create" and self._call("exists", key, lambda: self._present([path])):
            raise KeyExistsError(f"{key!r} already exists in {self.uri}")
        self._call("put", key, lambda: self.api.batch_bucket_files(self.bucket_id, add=[(data, path)]))
        if mode == "create" and self.verify_keys(key):
            self._verify(key, path, data)
        self.progress("put", key, len(data))

    def _verify(self, key: str, path: str, data: bytes) -> None:
        """Read a create-only write back after ``verify_delay``; another value there means we lost."""
        if self.verify_delay > 0:
            time.sleep(self.verify_delay)
        try:
            stored = self._call("verify", key, lambda: self._download([path]))[path]
        except KeyNotFoundError:
            raise KeyExistsError(f"{key!r} in {self.uri} vanished right after a create-only write "
                                 "(a concurrent writer or GC deleted it)") from None
        if stored != data:
            raise KeyExistsError(f"{key!r} in {self.uri} was written concurrently by another writer; "
                                 "its value is kept, this write lost")

    def _exists(self, key: str) -> bool:
        path = self._path(key)
        return bool(self._call("exists", key, lambda: self._present([path])))

    def _delete(self, key: str) -> None:
        path = self._path(key)
        self._call("delete", key, lambda: self.api.batch_bucket_files(self.bucket_id, delete=[path]))

    def _list(self, prefix: str) -> Iterator[str]:
        from huggingface_hub.errors import BucketNotFoundError as HfBucketNotFound

        folder = prefix.rpartition("/")[0]
        tree_prefix = "/".join(p for p in (self.prefix, folder) if p)
        cut = len(self.prefix) + 1 if self.prefix else 0

        def tree() -> list[str]:
            try:
                return [item.path for item in self.api.list_bucket_tree(self.bucket_id, prefix=tree_prefix or None,
                                                                        recursive=True)
                        if getattr(item, "type", "file") == "file"]
            except HfBucketNotFound:
                raise
            except Exception as e:  # a prefix that does not exist (yet): the Hub may answer 404
                if http_status(e) == 404:
                    return []
                raise

        for path in self._call("list", prefix or "/", tree):
            if self.prefix and not path.startswith(self.prefix + "/"):
                continue
            key = path[cut:]
            if key.startswith(prefix):
                yield key

    def close(self) -> None:
        """Remove this backend's temporary download folder."""
        shutil.rmtree(self._tmp, ignore_errors=True)

    # -- batch transfers -------------------------------------------------------------
    def _get_many(self, keys: list[str], limits: dict[str, int]) -> dict[str, bytes]:
        """``{key: value}`` for every key in one ``download_bucket_files`` batch (hf_xet parallelises it);
        keys with a limit are checked against their stored sizes (one ``paths-info`` call) first.

        Raises :class:`KeyNotFoundError` when any key is missing.
        """
        if not keys:
            return {}
        paths = {self._path(k): k for k in keys}
        what = keys[0] if len(keys) == 1 else f"{len(keys)} keys"
        if limits:
            infos = self._call("stat", what, lambda: self._infos(list(paths)))
            for p, k in paths.items():
                if k in limits and p in infos and infos[p].size > limits[k]:
                    raise ValueTooLargeError(f"{k!r} holds {infos[p].size} bytes, more than {limits[k]}",
                                             size=infos[p].size)
        got = self._call("get", what, lambda: self._download(list(paths)))
        out = {paths[p]: v for p, v in got.items()}
        for k in keys:
            self.progress("get", k, len(out[k]))
        return out

    def _put_many(self, items: dict[str, bytes], mode: PutMode) -> None:
        """Store every ``key -> value`` in one ``batch_bucket_files`` call.

        With ``mode="create"`` keys already present are left alone and
        :class:`KeyExistsError` is raised after the others are written; each
        created key is verified as in :meth:`put`.
        """
        paths = {self._path(k): (k, bytes(v)) for k, v in items.items()}
        if not paths:
            return
        present: set[str] = set()
        if mode == "create":
            present = self._call("exists", f"{len(paths)} keys", lambda: self._present(list(paths)))
        add = [(v, p) for p, (k, v) in paths.items() if p not in present]
        if add:
            self._call("put", f"{len(add)} keys", lambda: self.api.batch_bucket_files(self.bucket_id, add=add))
        check = [p for _, p in add if self.verify_keys(paths[p][0])] if mode == "create" else []
        if check:
            if self.verify_delay > 0:
                time.sleep(self.verify_delay)
            stored = self._call("verify", f"{len(check)} keys", lambda: self._download(check))
            present |= {p for p in check if stored[p] != paths[p][1]}
        for p, (k, v) in paths.items():
            if p not in present:
                self.progress("put", k, len(v))
        if present:
            names = sorted(paths[p][0] for p in present)
            raise KeyExistsError(f"{len(names)} key(s) already exist in {self.uri}: {names[:5]}")
