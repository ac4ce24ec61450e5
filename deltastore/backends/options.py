"""Storage options: which ones each built-in backend takes, checked before any client is built.

A misspelt option (``endpoint`` for ``endpoint_url``) is :class:`UnknownOptionError` naming it, the
closest valid one and every valid one, instead of reaching a client library that ignores it (gcsfs) or
fails far from the cause (aiobotocore: ``AioSession.__init__() got an unexpected keyword argument``).
The S3 and GCS lists are read from the installed s3fs / gcsfs signatures (importing the module, building
nothing), so a newer client's options are accepted without a release of this package.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import UnknownOptionError

#: the retry layer's options, taken by every backend (:func:`~deltastore.backends.open_backend` consumes them)
RETRY_OPTIONS = ("retry", "deadline")
#: what :class:`~deltastore.backends.fsspec.FsspecBackend` consumes itself, for every protocol
FSSPEC_TRANSPORT_OPTIONS = ("max_workers", "progress", "check_bucket", "atomic_create", "timeout", "connect_timeout",
                            "read_timeout", "retries")
#: fsspec's own filesystem options (instance and listings caches) that s3fs and gcsfs pass on to it
_FSSPEC_BASE = ("skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths")


def check_options(options: Iterable[str], valid: Iterable[str], where: str) -> None:
    """Raise :class:`UnknownOptionError` for the first of ``options`` that is not in ``valid`` (or one of
    :data:`RETRY_OPTIONS`): the message names it, the closest valid option (when one is close) and every
    valid one; ``where`` names the store (``"s3://bucket/run"``). The error has ``option``,
    ``suggestion`` (or None) and ``valid`` (sorted) attributes."""
    known = sorted(set(valid) | set(RETRY_OPTIONS))
    for name in options:
        if name in known:
            continue
        close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}? Valid:" if close else "; valid:"
        error = UnknownOptionError(f"unknown storage option {name!r} for {where}{hint} {', '.join(known)}")
        error.option, error.valid = name, known  # type: ignore[attr-defined]
        error.suggestion = close[0] if close else None  # type: ignore[attr-defined]
        raise error


def parameters(fn: Callable[..., Any], *, skip: Iterable[str] = ("self",)) -> list[str]:
    """The named keyword parameters of ``fn`` (not ``*args``/``**kwargs``, not ``skip``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    skipped = set(skip)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds and p.name not in skipped]


def fsspec_options(protocol: str) -> list[str] | None:
    """The options an ``s3``/``s3a``/``gs``/``gcs`` store takes (None for another protocol: its client's
    options are not known here, and they are passed on unchecked). Raises ``ImportError`` when the
    protocol's package is missing."""
    if protocol in ("s3", "s3a"):
        import aiobotocore.session
        import s3fs

        # s3fs hands its unnamed keywords to aiobotocore's session (``profile``, ...)
        client = parameters(s3fs.S3FileSystem.__init__) + parameters(aiobotocore.session.AioSession.__init__)
    elif protocol in ("gs", "gcs"):
        import gcsfs.core

        client = parameters(gcsfs.core.GCSFileSystem.__init__) + ["batch_size"]  # the rest goes to fsspec
    else:
        return None
    return sorted(set(client) | set(_FSSPEC_BASE) | set(FSSPEC_TRANSPORT_OPTIONS))


def check_fsspec_options(protocol: str, options: Mapping[str, Any], uri: str) -> None:
    """:func:`check_options` of an fsspec store's options (nothing for a protocol :func:`fsspec_options`
    does not know, or whose package is missing: opening it fails next, with the install hint)."""
    try:
        valid = fsspec_options(protocol)
    except ImportError:
        return
    if valid is not None:
        check_options(options, valid, uri)
