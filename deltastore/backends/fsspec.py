"""Object stores through fsspec: ``s3://`` / ``s3a://`` and ``gs://`` / ``gcs://``.

Another fsspec protocol (``az://``, ``abfs://``, ...) is not registered: it
would get check-then-write creates and is untested. Register it yourself to
use it: ``deltastore.registry.backends.register("az", "deltastore.backends.fsspec:FsspecBackend")``.

URI form: ``PROTOCOL://BUCKET[/PREFIX]``. Keys live under ``BUCKET/PREFIX/``.
Storage options go to the fsspec filesystem unchanged (``endpoint_url``,
``key``/``secret``, ``token``, ``anon``, ...), except the transport options
this module consumes itself:

``retry``           a :class:`RetryPolicy`, a dict of its fields, or an attempt count
``max_workers``     parallel transfers in :meth:`get_many` / :meth:`put_many` (default 16)
``progress``        a :data:`ProgressCallback` ``progress(op, key, nbytes)``
``timeout``         seconds per request (S3: connect and read timeouts; GCS: ``requests_timeout``)
``retries``         (S3 only) tries of s3fs's inner retry loop, default 2 (botocore retries too)
``check_bucket``    check at open that the bucket exists and the credentials work (default True)
``atomic_create``   override the declared create-only atomicity (for an S3-compatible server
                    that ignores ``If-None-Match``, pass False)

Create-only writes:

* S3: ``If-None-Match: *`` on PUT (and on CompleteMultipartUpload); the
  service answers 412 to every writer but one. s3fs reports a lost race as
  ``FileExistsError`` on some servers and as ``OSError(EINVAL)`` on others
  (SeaweedFS): any 412 / ``PreconditionFailed`` in the cause chain is a conflict.
* GCS: ``ifGenerationMatch=0``, enforced on single-request uploads only, so
  every create is sent as one request whatever its size.
* Any other protocol: check-then-write (``atomic_create=False``).

Every create-only S3/GCS write carries a random put id in the object's
metadata. When a create conflicts, the stored object's put id is compared
with ours: equal means an earlier try of the same call landed and only its
answer was lost (a retry by s3fs, botocore, gcsfs or this module), so the
write succeeded; anything else is a real conflict (:class:`KeyExistsError`).
With check-then-write protocols, a retried create that finds the key holding
exactly its bytes counts as its own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import AccessDeniedError, BackendError, BucketNotFoundError, KeyExistsError, KeyNotFoundError, MissingDependencyError
from .base import Backend, Capabilities, PutMode, check_key
from .retry import (Progress, ProgressCallback, RetryPolicy, http_status,
                    is_transient, run_parallel)

_ATOMIC_CREATE = {"s3": True, "s3a": True, "gs": True, "gcs": True}
_GCS = {"gs", "gcs"}
_INSTALL_HINTS = {"s3": "pip install 'deltastore[s3]'", "s3a": "pip install 'deltastore[s3]'",
                  "gs": "pip install 'deltastore[gcs]'", "gcs": "pip install 'deltastore[gcs]'"}
_S3 = {"s3", "s3a"}
_PUT_ID = "deltastore-put-id"  # object metadata: the id of the create-only put that wrote it
_TRANSPORT_OPTIONS = ("retry", "max_workers", "progress", "timeout", "check_bucket", "atomic_create")


def _is_precondition_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or anything in its cause chain) is an HTTP 412 / PreconditionFailed."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FileExistsError) or http_status(e) == 412:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, Mapping) and response.get("Error", {}).get("Code") in (
                "PreconditionFailed", "412", "ConditionalRequestConflict"):
            return True
        text = str(e).lower()
        if "pre-condition" in text or "precondition" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def _prepare_protocol(protocol: str) -> None:
    """Environment defaults a protocol's client needs before it is imported."""
    if protocol in _GCS:
        # Otherwise gcsfs probes a gRPC endpoint on every call and stalls offline.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    if protocol in _S3 and not (os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")):
        os.environ["AWS_DEFAULT_REGION"] = "us-east-1"


class FsspecBackend(Backend):
    """Keys under ``root`` (``BUCKET/PREFIX``) of an fsspec filesystem.

    ``fs`` is an fsspec ``AbstractFileSystem``; ``protocol`` selects the
    create-only strategy. Every call is retried on transient errors with
    ``retry``; a missing key raises :class:`KeyNotFoundError`, a conflicting
    create :class:`KeyExistsError`, refused credentials
    :class:`AccessDeniedError`, and a transport failure that outlives the
    retries :class:`BackendError`.
    """

    def __init__(self, fs: Any, root: str, *, protocol: str, uri: str = "", retry: Any = None,
                 max_workers: int = 16, progress: ProgressCallback | None = None,
                 atomic_create: bool | None = None):
        self.fs = fs
        self.protocol = protocol
        self.root = root.strip("/")
        if not self.root:
            raise ValueError(f"{protocol}:// URI needs a bucket: {protocol}://BUCKET[/PREFIX]")
        self.bucket = self.root.split("/", 1)[0]
        self.uri = uri or f"{protocol}://{self.root}"
        self.retry = RetryPolicy.coerce(retry)
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive integer, got {max_workers!r}")
        self.max_workers = max_workers
        self.progress = Progress(progress)
        atomic = _ATOMIC_CREATE.get(protocol, False) if atomic_create is None else bool(atomic_create)
        self.capabilities = Capabilities(atomic_create=atomic, listing=True, ranged_reads=True)

    def __repr__(self) -> str:
        return f"FsspecBackend({self.uri!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> FsspecBackend:
        """Open ``PROTOCOL://BUCKET[/PREFIX]``; see the module docstring for ``options``.

        Raises :class:`MissingDependencyError` (with the install hint) when the
        protocol's package is missing, :class:`BucketNotFoundError` or
        :class:`AccessDeniedError` when ``check_bucket`` finds the bucket
        absent or the credentials refused.
        """
        import fsspec

        protocol, sep, path = uri.partition("://")
        if not sep:
            raise ValueError(f"not a URI: {uri!r}")
        protocol = protocol.lower()
        ours = {k: options.pop(k) for k in _TRANSPORT_OPTIONS if k in options}
        timeout = ours.pop("timeout", None)
        if timeout is not None:
            if protocol in _S3:
                config = dict(options.get("config_kwargs") or {})
                config.setdefault("connect_timeout", timeout)
                config.setdefault("read_timeout", timeout)
                options["config_kwargs"] = config
            elif protocol in _GCS:
                options.setdefault("requests_timeout", timeout)
        options.setdefault("use_listings_cache", False)  # other writers change the store
        s3_retries = options.pop("retries", 2) if protocol in _S3 else None
        _prepare_protocol(protocol)
        try:
            fs = fsspec.filesystem(protocol, **options)
        except ImportError as e:
            hint = _INSTALL_HINTS.get(protocol, "install the fsspec implementation of this protocol")
            raise MissingDependencyError(f"backend {protocol!r} needs a package that is not installed ({e}); "
                                         f"install it with: {hint}") from e
        if s3_retries is not None:  # s3fs's own retry loop (a class attribute); ``retry`` is the outer one
            fs.retries = max(1, int(s3_retries))
        check = ours.pop("check_bucket", True)
        backend = cls(fs, path, protocol=protocol, uri=uri, **ours)
        if check:
            backend.check_bucket()
        return backend

    # -- helpers -------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _call(self, what: str, key: str, fn: Any) -> Any:
        """Run ``fn(attempt)`` under the retry policy, translating errors for ``key``."""
        try:
            return self.retry.call(fn)
        except (KeyExistsError, KeyNotFoundError):
            raise
        except FileNotFoundError as e:
            if self._bucket_missing(e):
                raise BucketNotFoundError(f"bucket {self.bucket!r} does not exist ({self.uri})") from e
            raise KeyNotFoundError(f"{key!r} not found in {self.uri}") from None
        except PermissionError as e:
            raise AccessDeniedError(f"{what} {key!r} in {self.uri}: access denied ({e})") from e
        except OSError as e:
            if http_status(e) in (401, 403):
                raise AccessDeniedError(f"{what} {key!r} in {self.uri}: access denied ({e})") from e
            raise BackendError(f"{what} {key!r} in {self.uri} failed: {e}") from e
        except Exception as e:
            if is_transient(e):  # a client's own network error type (botocore, httpx, ...), retries spent
                raise BackendError(f"{what} {key!r} in {self.uri} failed after retries: {e}") from e
            raise

    @staticmethod
    def _bucket_missing(e: BaseException) -> bool:
        return "bucket" in str(e).lower() and ("not exist" in str(e).lower() or "nosuchbucket" in str(e).lower())

    def check_bucket(self) -> None:
        """Raise :class:`BucketNotFoundError` / :class:`AccessDeniedError` unless the bucket is usable."""
        def probe(attempt: int) -> bool:
            if self.protocol in _S3:  # HEAD bucket: 404 missing, 403 refused
                try:
                    self.fs.call_s3("head_bucket", Bucket=self.bucket)
                    return True
                except FileNotFoundError:
                    return False
            return bool(self.fs.exists(self.bucket))

        try:
            found = self.retry.call(probe)
        except PermissionError as e:
            raise AccessDeniedError(f"access to bucket {self.bucket!r} denied ({self.uri}): {e}") from e
        except OSError as e:
            if http_status(e) in (401, 403):
                raise AccessDeniedError(f"access to bucket {self.bucket!r} denied ({self.uri}): {e}") from e
            raise BackendError(f"cannot reach bucket {self.bucket!r} ({self.uri}): {e}") from e
        except Exception as e:
            if is_transient(e):  # botocore's EndpointConnectionError & co., retries spent
                raise BackendError(f"cannot reach bucket {self.bucket!r} ({self.uri}): {e}") from e
            raise
        if not found:
            raise BucketNotFoundError(f"bucket {self.bucket!r} does not exist ({self.uri})")

    # -- Backend -------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        path = self._path(key)
        data = self._call("get", key, lambda attempt: self.fs.cat_file(path))
        self.progress("get", key, len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        if end <= start:
            if not self.exists(key):
                raise KeyNotFoundError(f"{key!r} not found in {self.uri}")
            return b""
        return self._call("get", key, lambda attempt: self.fs.cat_file(path, start=start, end=end))

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
        path = self._path(key)
        data = bytes(data)
        put_id = uuid.uuid4().hex

        def attempt_put(attempt: int) -> None:
            if mode == "overwrite":
                self.fs.pipe_file(path, data)
                return
            if not self.capabilities.atomic_create or self.protocol not in _ATOMIC_CREATE:
                if self.fs.isfile(path):
                    self._conflict(key, path, data, attempt)
                    return
                self.fs.pipe_file(path, data)
                return
            kwargs: dict[str, Any] = {"mode": "create"}
            if self.protocol in _GCS:  # preconditions hold on single-request uploads only
                kwargs["chunksize"] = max(len(data) + 1, 50 << 20)
                kwargs["metadata"] = {_PUT_ID: put_id}
            else:
                kwargs["Metadata"] = {_PUT_ID: put_id}
            try:
                self.fs.pipe_file(path, data, **kwargs)
            except Exception as e:
                if _is_precondition_failure(e):
                    if self._put_id(path) == put_id:
                        return  # an earlier try of this very call landed (its answer was lost)
                    raise KeyExistsError(f"{key!r} already exists in {self.uri}") from None
                raise

        self._call("put", key, attempt_put)
        self.progress("put", key, len(data))

    def _put_id(self, path: str) -> str | None:
        """The put id recorded in the metadata of the object at ``path`` (None if absent or unreadable)."""
        try:
            if self.protocol in _GCS:
                meta = self.fs.info(path).get("metadata") or {}
            else:
                meta = self.fs.metadata(path)
        except (OSError, ValueError):
            return None
        return meta.get(_PUT_ID)

    def _conflict(self, key: str, path: str, data: bytes, attempt: int) -> None:
        """A create found ``key`` present: fine if an earlier attempt of this call wrote exactly ``data``."""
        if attempt > 0:
            try:
                if self.fs.cat_file(path) == data:
                    return
            except FileNotFoundError:
                pass
        raise KeyExistsError(f"{key!r} already exists in {self.uri}")

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return bool(self._call("exists", key, lambda attempt: self.fs.isfile(path)))

    def delete(self, key: str) -> None:
        path = self._path(key)

        def rm(attempt: int) -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", key, rm)

    def list(self, prefix: str = "") -> Iterator[str]:
        folder = prefix.rpartition("/")[0]
        if folder:
            check_key(folder)
        base = f"{self.root}/{folder}" if folder else self.root
        cut = len(self.root) + 1

        def find(attempt: int) -> list[str]:
            self.fs.invalidate_cache(base)
            try:
                return list(self.fs.find(base, withdirs=False))
            except FileNotFoundError as e:
                if self._bucket_missing(e):
                    raise
                return []

        for path in self._call("list", prefix or "/", find):
            path = path.lstrip("/")
            if path.startswith(self.protocol + "://"):
                path = path.split("://", 1)[1]
            key = path[cut:]
            if key and key.startswith(prefix) and not key.endswith("/"):
                yield key

    def close(self) -> None:
        """Nothing to release: fsspec filesystems are cached and shared per process."""

    # -- batch transfers -------------------------------------------------------------
    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """``{key: value}`` for every key, fetched concurrently.

        Async filesystems (s3fs, gcsfs) fetch the whole batch on their event
        loop in one ``cat``; a key that fails there is retried alone under the
        retry policy. Raises :class:`KeyNotFoundError` when any key is missing.
        """
        keys = list(dict.fromkeys(keys))
        paths = {self._path(k): k for k in keys}
        got: dict[str, Any] = {}
        if len(keys) > 1 and getattr(self.fs, "async_impl", False):
            try:
                got = self.fs.cat(list(paths), on_error="return")
            except Exception:  # noqa: BLE001 - fall back to one key at a time below
                got = {}
        out: dict[str, bytes] = {}
        missing = []
        for path, key in paths.items():
            value = got.get(path)
            if isinstance(value, bytes):
                out[key] = value
                self.progress("get", key, len(value))
            else:
                missing.append(key)
        if missing:
            out.update(zip(missing, run_parallel(self.get, missing, self.max_workers)))
        return {k: out[k] for k in keys}

    def put_many(self, items: Mapping[str, bytes], *, mode: PutMode = "overwrite") -> None:
        """Store every ``key -> value`` concurrently.

        Overwrites on an async filesystem go out as one ``pipe`` batch (any
        failure: each key is retried alone). With ``mode="create"`` every key
        is a create-only put and a present key raises :class:`KeyExistsError`
        after every transfer ended (the other keys are written).
        """
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
        items = {k: bytes(v) for k, v in items.items()}
        paths = {self._path(k): k for k in items}
        if mode == "overwrite" and len(items) > 1 and getattr(self.fs, "async_impl", False):
            try:
                self.fs.pipe({p: items[k] for p, k in paths.items()})
            except Exception:  # noqa: BLE001 - fall back to one key at a time (with retries)
                pass
            else:
                for k, v in items.items():
                    self.progress("put", k, len(v))
                return
        run_parallel(lambda kv: self.put(kv[0], kv[1], mode=mode), list(items.items()), self.max_workers)
