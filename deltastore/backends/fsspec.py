"""Object stores through fsspec: ``s3://`` / ``s3a://`` and ``gs://`` / ``gcs://``.

Another fsspec protocol (``az://``, ``abfs://``, ...) is not registered: it
would get check-then-write creates and is untested. Register it yourself to
use it: ``deltastore.registry.backends.register("az", "deltastore.backends.fsspec:FsspecBackend")``.

URI form: ``PROTOCOL://BUCKET[/PREFIX]``. Keys live under ``BUCKET/PREFIX/``.
Storage options go to the fsspec filesystem unchanged (``endpoint_url``,
``key``/``secret``, ``token``, ``anon``, ...), except the transport options
this module consumes itself:

``max_workers``     parallel transfers in :meth:`get_many` / :meth:`put_many` (default 16)
``progress``        a :data:`ProgressCallback` ``progress(op, key, nbytes)``
``connect_timeout`` seconds to open a connection (default 5)
``read_timeout``    seconds a request may wait for data (default 30; GCS: the whole request)
``timeout``         sets both timeouts at once
``check_bucket``    check at open that the bucket exists and the credentials work (default True)
``atomic_create``   override the declared create-only atomicity (for an S3-compatible server
                    that ignores ``If-None-Match``, pass False)

(``retry`` and ``deadline`` are consumed by :func:`~deltastore.backends.open_backend`: the
retry layer wraps this backend.) The clients' own retries are off (botocore
``total_max_attempts=1``, s3fs ``retries=1``, gcsfs's request retry loop
bypassed) so that the one retry layer's deadline is the total time; a
botocore ``retries`` setting in ``config_kwargs`` is merged with that (its
``mode`` kept, its attempt counts replaced by one try, with a warning). The
S3 region comes from the usual places (``client_kwargs``, ``AWS_REGION``,
the AWS config) and is ``us-east-1`` when none names one; nothing is written
to ``os.environ``. GCS uses gcsfs's core filesystem (not the experimental
one, which probes a gRPC endpoint and stalls offline).

Client errors are translated in one place, :meth:`FsspecBackend._call`:
missing key :class:`KeyNotFoundError`, missing bucket
:class:`BucketNotFoundError`, refused credentials :class:`AccessDeniedError`,
a dropped or refused connection or a timeout :class:`BackendUnavailableError`
(retried by the retry layer), anything else :class:`BackendError`.

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

import datetime as _dt
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import (AccessDeniedError, BackendError, BackendUnavailableError, BucketNotFoundError, KeyExistsError,
                      KeyNotFoundError, MissingDependencyError, UnknownOptionError, ValueTooLargeError)
from .base import Backend, Capabilities, KeyInfo, PutMode
from .cache_policy import cache_control, content_type
from .credentials import credentials_error, missing_credentials
from .options import check_fsspec_options
from .retry import Progress, ProgressCallback, http_status, is_transient, run_parallel

_ATOMIC_CREATE = {"s3": True, "s3a": True, "gs": True, "gcs": True}
_GCS = {"gs", "gcs"}
_INSTALL_HINTS = {"s3": "pip install 'deltastore[s3]'", "s3a": "pip install 'deltastore[s3]'",
                  "gs": "pip install 'deltastore[gcs]'", "gcs": "pip install 'deltastore[gcs]'"}
_S3 = {"s3", "s3a"}
_log = logging.getLogger("deltastore.backends.fsspec")
_PUT_ID = "deltastore-put-id"  # object metadata: the id of the create-only put that wrote it
_TRANSPORT_OPTIONS = ("max_workers", "progress", "check_bucket", "atomic_create")
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 30.0


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


def _s3_region(options: dict[str, Any]) -> str | None:
    """The region the S3 client would use, or None when nothing (options, environment, AWS config) names one."""
    if (options.get("client_kwargs") or {}).get("region_name"):
        return options["client_kwargs"]["region_name"]
    try:
        import botocore.session

        return botocore.session.get_session().get_config_variable("region")
    except Exception:  # noqa: BLE001 - a broken AWS config: let the client report it
        return None


def _s3_filesystem(options: dict[str, Any], connect: float, read: float) -> Any:
    import s3fs

    config = dict(options.pop("config_kwargs", None) or {})
    config.setdefault("connect_timeout", connect)
    config.setdefault("read_timeout", read)
    config["retries"] = _one_botocore_try(config.get("retries"))
    client = dict(options.pop("client_kwargs", None) or {})
    if _s3_region({"client_kwargs": client}) is None:
        client["region_name"] = "us-east-1"
    fs = s3fs.S3FileSystem(config_kwargs=config, client_kwargs=client, **options)
    fs.retries = 1  # s3fs's own retry loop (an attribute): one try
    return fs


def _one_botocore_try(retries: Any) -> dict[str, Any]:
    """A user's botocore ``retries`` setting merged with ours: one try per call (``total_max_attempts=1``
    wins over ``total_max_attempts``/``max_attempts``), so the retry layer's deadline holds; ``mode`` and
    the rest are kept. A retry count given is logged as ignored (storage option ``retry`` sets ours)."""
    if retries is None:
        return {"total_max_attempts": 1}
    if not isinstance(retries, Mapping):
        raise UnknownOptionError(f"config_kwargs['retries'] must be a dict of botocore retry settings, "
                                 f"got {retries!r}")
    counts = {k: v for k, v in retries.items() if k in ("total_max_attempts", "max_attempts") and v != 1}
    if counts:
        _log.warning("deltastore: config_kwargs retries %s ignored: botocore makes one try per call so that the "
                     "deadline holds; deltastore's retry layer retries (storage options 'retry', 'deadline')",
                     counts)
    merged = {k: v for k, v in retries.items() if k != "max_attempts"}
    merged["total_max_attempts"] = 1
    return merged


def _gcs_filesystem(options: dict[str, Any], connect: float, read: float) -> Any:
    options.setdefault("requests_timeout", read)
    return _GcsNoRetry(**options)


_GcsNoRetry: Any = None


def _define_gcs() -> None:
    """gcsfs's core filesystem with its request retry loop (6 tries, up to 32 s sleeps) bypassed."""
    global _GcsNoRetry
    if _GcsNoRetry is not None:
        return
    import gcsfs.core

    base = gcsfs.core.GCSFileSystem
    undecorated = {name: getattr(base, name).__wrapped__ for name in
                   ("_request", "_get_file_request", "_get_file_concurrent")
                   if hasattr(getattr(base, name, None), "__wrapped__")}
    _GcsNoRetry = type("GCSFileSystemNoRetry", (base,), {**undecorated, "protocol": ("gs", "gcs")})


def _make_filesystem(protocol: str, options: dict[str, Any], connect: float, read: float) -> Any:
    import fsspec

    options.setdefault("use_listings_cache", False)  # other writers change the store
    if protocol in _S3:
        return _s3_filesystem(options, connect, read)
    if protocol in _GCS:
        _define_gcs()
        return _gcs_filesystem(options, connect, read)
    return fsspec.filesystem(protocol, **options)


def _timestamp(value: Any) -> float | None:
    if isinstance(value, _dt.datetime):
        return value.timestamp()
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


class FsspecBackend(Backend):
    """Keys under ``root`` (``BUCKET/PREFIX``) of an fsspec filesystem.

    ``fs`` is an fsspec ``AbstractFileSystem``; ``protocol`` selects the
    create-only strategy. Errors are typed as in the module docstring; this
    class does not retry (the retry layer around it does).
    """

    def __init__(self, fs: Any, root: str, *, protocol: str, uri: str = "", max_workers: int = 16,
                 progress: ProgressCallback | None = None, atomic_create: bool | None = None,
                 check_bucket: bool = True):
        self.fs = fs
        self.protocol = protocol
        self.root = root.strip("/")
        if not self.root:
            raise ValueError(f"{protocol}:// URI needs a bucket: {protocol}://BUCKET[/PREFIX]")
        self.bucket = self.root.split("/", 1)[0]
        self.uri = uri or f"{protocol}://{self.root}"
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive integer, got {max_workers!r}")
        self.max_workers = max_workers
        self.progress = Progress(progress)
        self._check_bucket = bool(check_bucket)
        atomic = _ATOMIC_CREATE.get(protocol, False) if atomic_create is None else bool(atomic_create)
        self.capabilities = Capabilities(atomic_create=atomic, listing=True, ranged_reads=True, remote=True,
                                         mtime_resolution=1.0 if protocol in _S3 else 0.001,
                                         batch_transfers=bool(getattr(fs, "async_impl", False)))

    def __repr__(self) -> str:
        return f"FsspecBackend({self.uri!r})"

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> FsspecBackend:
        """Open ``PROTOCOL://BUCKET[/PREFIX]``; see the module docstring for ``options``.

        Raises :class:`MissingDependencyError` (with the install hint) when the
        protocol's package is missing. The bucket is checked by
        :meth:`check_access` (``open_backend`` calls it).
        """
        protocol, sep, path = uri.partition("://")
        if not sep:
            raise ValueError(f"not a URI: {uri!r}")
        protocol = protocol.lower()
        check_fsspec_options(protocol, options, uri)  # before any client is built
        ours = {k: options.pop(k) for k in _TRANSPORT_OPTIONS if k in options}
        timeout = options.pop("timeout", None)
        connect = float(options.pop("connect_timeout", timeout if timeout is not None else CONNECT_TIMEOUT))
        read = float(options.pop("read_timeout", timeout if timeout is not None else READ_TIMEOUT))
        options.pop("retries", None)  # the clients' own retries stay off
        try:
            fs = _make_filesystem(protocol, options, connect, read)
        except ImportError as e:
            hint = _INSTALL_HINTS.get(protocol, "install the fsspec implementation of this protocol")
            raise MissingDependencyError(f"backend {protocol!r} needs a package that is not installed ({e}); "
                                         f"install it with: {hint}") from e
        return cls(fs, path, protocol=protocol, uri=uri, **ours)

    # -- helpers -------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _call(self, what: str, key: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn()``, translating the client's errors for ``key`` (the one place for this client)."""
        try:
            return fn()
        except (KeyExistsError, KeyNotFoundError, ValueTooLargeError, BackendError):
            raise
        except FileNotFoundError as e:
            if self._bucket_missing(e):
                raise BucketNotFoundError(f"bucket {self.bucket!r} does not exist ({self.uri})") from e
            raise KeyNotFoundError(f"{key!r} not found in {self.uri}") from None
        except PermissionError as e:
            raise AccessDeniedError(f"{what} {key!r} in {self.uri}: access denied ({e})") from e
        except Exception as e:
            if missing_credentials(e):
                raise credentials_error(self.protocol, self.uri, e) from e
            if http_status(e) in (401, 403):
                raise AccessDeniedError(f"{what} {key!r} in {self.uri}: access denied ({e})") from e
            if is_transient(e):
                raise BackendUnavailableError(f"{what} {key!r} in {self.uri}: {type(e).__name__}: {e}") from e
            if isinstance(e, OSError):
                raise BackendError(f"{what} {key!r} in {self.uri} failed: {e}") from e
            raise

    @staticmethod
    def _bucket_missing(e: BaseException) -> bool:
        return "bucket" in str(e).lower() and ("not exist" in str(e).lower() or "nosuchbucket" in str(e).lower())

    def check_access(self) -> None:
        """Raise :class:`BucketNotFoundError` / :class:`AccessDeniedError` unless the bucket is usable
        (nothing when opened with ``check_bucket=False``)."""
        if not self._check_bucket:
            return

        def probe() -> bool:
            if self.protocol in _S3:  # HEAD bucket: 404 missing, 403 refused
                try:
                    self.fs.call_s3("head_bucket", Bucket=self.bucket)
                    return True
                except FileNotFoundError:
                    return False
            return bool(self.fs.exists(self.bucket))

        if not self._call("open bucket", self.bucket, probe):
            raise BucketNotFoundError(f"bucket {self.bucket!r} does not exist ({self.uri})")

    # -- Backend hooks ---------------------------------------------------------------
    def _get(self, key: str) -> bytes:
        path = self._path(key)
        data = self._call("get", key, lambda: self.fs.cat_file(path))
        self.progress("get", key, len(data))
        return data

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        if end <= start:
            if not self._exists(key):
                raise KeyNotFoundError(f"{key!r} not found in {self.uri}")
            return b""
        def ranged() -> bytes | None:
            try:
                return self.fs.cat_file(path, start=start, end=end)
            except Exception as e:  # HTTP 416: the range starts at or past the end (an empty value)
                if getattr(e, "code", None) == 416 or http_status(e) == 416 or "not satisfiable" in str(e).lower():
                    return None
                raise

        data = self._call("get", key, ranged)
        if data is None:
            self._stat(key)  # missing -> KeyNotFoundError
            return b""
        return data

    def _put(self, key: str, data: bytes, mode: PutMode) -> None:
        path = self._path(key)
        data = bytes(data)
        put_id = uuid.uuid4().hex

        headers = self._http_headers(key)

        def attempt_put() -> None:
            if mode == "overwrite":
                self.fs.pipe_file(path, data, **headers)
                return
            if not self.capabilities.atomic_create or self.protocol not in _ATOMIC_CREATE:
                if self.fs.isfile(path):
                    raise KeyExistsError(f"{key!r} already exists in {self.uri}")
                self.fs.pipe_file(path, data, **headers)
                return
            kwargs: dict[str, Any] = {"mode": "create", **headers}
            if self.protocol in _GCS:  # preconditions hold on single-request uploads only
                kwargs["chunksize"] = max(len(data) + 1, 50 << 20)
                kwargs["metadata"] = {_PUT_ID: put_id}
            else:
                kwargs["Metadata"] = {_PUT_ID: put_id}
            try:
                self.fs.pipe_file(path, data, **kwargs)
            except Exception as e:
                if _is_precondition_failure(e):
                    # a client-internal resend of this very call may have landed (its answer lost)
                    if self._put_id(path) == put_id:
                        return
                    raise KeyExistsError(f"{key!r} already exists in {self.uri}") from None
                raise

        self._call("put", key, attempt_put)
        self.progress("put", key, len(data))

    def _http_headers(self, key: str) -> dict[str, Any]:
        """The ``Content-Type`` and ``Cache-Control`` the service stores with ``key`` and sends to HTTP readers
        (a CDN in front of the bucket caches objects and manifests forever and ``refs/`` briefly;
        :mod:`~deltastore.backends.cache_policy`), as the client's put arguments."""
        cc = cache_control(key)
        if self.protocol in _S3:
            return {"ContentType": content_type(key), **({"CacheControl": cc} if cc else {})}
        if self.protocol in _GCS:
            return {"content_type": content_type(key), **({"fixed_key_metadata": {"cache_control": cc}} if cc else {})}
        return {}

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

    def _exists(self, key: str) -> bool:
        path = self._path(key)
        return bool(self._call("exists", key, lambda: self.fs.isfile(path)))

    def _delete(self, key: str) -> None:
        path = self._path(key)

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", key, rm)

    def _stat(self, key: str) -> KeyInfo:
        path = self._path(key)

        def info() -> KeyInfo:
            self.fs.invalidate_cache(path)
            d = self.fs.info(path)
            if d.get("type") == "directory":
                raise FileNotFoundError(path)
            mtime = _timestamp(d.get("LastModified", d.get("mtime", d.get("updated"))))
            if mtime is None:
                raise BackendError(f"stat {key!r} in {self.uri}: the server reports no modification time")
            return KeyInfo(int(d.get("size", 0)), mtime)

        return self._call("stat", key, info)

    def _touch(self, key: str) -> None:
        if self.protocol not in _S3:
            return super()._touch(key)  # GCS and others: rewrite the bytes
        path = self._path(key)
        bucket, _, object_key = path.partition("/")

        def copy_onto_itself() -> None:  # a server-side copy: new LastModified, no bytes through us
            self.fs.call_s3("copy_object", Bucket=bucket, Key=object_key, MetadataDirective="REPLACE",
                            CopySource={"Bucket": bucket, "Key": object_key}, **self._http_headers(key))

        self._call("touch", key, copy_onto_itself)

    def _list(self, prefix: str) -> Iterator[str]:
        folder = prefix.rpartition("/")[0]
        base = f"{self.root}/{folder}" if folder else self.root
        cut = len(self.root) + 1

        def find() -> list[str]:
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
    def _get_many(self, keys: list[str], limits: dict[str, int]) -> dict[str, bytes]:
        """Async filesystems (s3fs, gcsfs) fetch the whole batch on their event loop in one ``cat``
        (``cat_ranges`` of ``limit + 1`` bytes for keys with a limit); a key that fails there is read
        alone. Raises :class:`KeyNotFoundError` when any key is missing."""
        paths = {self._path(k): k for k in keys}
        got: dict[str, Any] = {}
        if len(keys) > 1 and getattr(self.fs, "async_impl", False):
            try:
                if limits:
                    ranged = list(paths)
                    values = self.fs.cat_ranges(ranged, [0] * len(ranged),
                                                [limits.get(paths[p], 1 << 62) + 1 for p in ranged],
                                                on_error="return")
                    got = dict(zip(ranged, values))
                else:
                    got = self.fs.cat(list(paths), on_error="return")
            except Exception:  # noqa: BLE001 - fall back to one key at a time below
                got = {}
        out: dict[str, bytes] = {}
        missing = []
        for path, key in paths.items():
            value = got.get(path)
            if isinstance(value, bytes) and (key not in limits or len(value) <= limits[key]):
                out[key] = value
                self.progress("get", key, len(value))
            else:
                missing.append(key)
        if missing:
            def one(k: str) -> bytes:
                return self.get_bounded(k, limits[k]) if k in limits else self._get(k)

            out.update(zip(missing, run_parallel(one, missing, self.max_workers)))
        return {k: out[k] for k in keys}

    def _put_many(self, items: dict[str, bytes], mode: PutMode) -> None:
        """Overwrites on an async filesystem go out as one ``pipe`` batch (any failure: each key is
        written alone). With ``mode="create"`` every key is a create-only put; a present key raises
        :class:`KeyExistsError` after every transfer ended."""
        items = {k: bytes(v) for k, v in items.items()}
        paths = {self._path(k): k for k in items}
        same = len({str(self._http_headers(k)) for k in items}) == 1
        if mode == "overwrite" and same and len(items) > 1 and getattr(self.fs, "async_impl", False):
            try:
                self.fs.pipe({p: items[k] for p, k in paths.items()}, **self._http_headers(next(iter(items))))
            except Exception:  # noqa: BLE001 - fall back to one key at a time
                pass
            else:
                for k, v in items.items():
                    self.progress("put", k, len(v))
                return
        conflicts: list[str] = []

        def one(kv: tuple[str, bytes]) -> None:
            try:
                self._put(kv[0], kv[1], mode)
            except KeyExistsError:
                conflicts.append(kv[0])

        run_parallel(one, list(items.items()), self.max_workers)
        if conflicts:
            raise KeyExistsError(f"{len(conflicts)} key(s) already exist in {self.uri}: {sorted(conflicts)[:5]}")
