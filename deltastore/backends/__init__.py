"""Transport plugins, chosen by URI scheme.

``open_backend("s3://bucket/run")`` looks the scheme up in the backend
registry (:data:`deltastore.registry.backends`); a bare path is a local-disk
store. Third-party backends register under the entry-point group
``deltastore.backends`` with their scheme as the name.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import UnknownOptionError
from ..registry import backends as _registry
from .base import Backend, Capabilities, KeyInfo, PutMode, WrapperBackend, check_key
from .retry import DEFAULT_DEADLINE, RetryingBackend, RetryPolicy

__all__ = ["Backend", "Capabilities", "KeyInfo", "PutMode", "WrapperBackend", "RetryingBackend", "RetryPolicy",
           "DEFAULT_DEADLINE", "check_key", "open_backend", "uri_scheme"]

_registry.register("file", "deltastore.backends.local:LocalBackend")
_registry.register("memory", "deltastore.backends.memory:MemoryBackend")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def uri_scheme(uri: str) -> str:
    """The URI's scheme, or ``"file"`` for a bare path."""
    m = _SCHEME.match(uri)
    return m.group(1).lower() if m else "file"


def open_backend(uri: str | Any, **storage_options: Any) -> Backend:
    """Open the backend for ``uri`` (a URI string, a path, or an already open :class:`Backend`).

    Two storage options are the retry layer's, for every scheme: ``retry`` (a
    :class:`RetryPolicy`, a dict of its fields, or an attempt count) and
    ``deadline`` (seconds; the total time a call may spend retrying, default
    :data:`DEFAULT_DEADLINE`). A remote backend (``capabilities.remote``), or
    any backend given one of them, is wrapped in :class:`RetryingBackend`; then
    the store is checked (:meth:`Backend.check_access`) under that layer.

    Raises :class:`UnknownBackendError` for an unregistered scheme,
    :class:`MissingDependencyError` when the scheme's plugin needs an extra,
    :class:`UnknownOptionError` for an option the backend does not know, and
    :class:`BackendUnavailableError` when the store cannot be reached within the deadline.
    """
    if isinstance(uri, Backend):
        if storage_options:
            raise UnknownOptionError(f"storage_options {sorted(storage_options)} cannot be applied to an already "
                                     "open backend; valid: none")
        return uri
    uri = os.fspath(uri) if not isinstance(uri, str) else uri
    cls = _registry.get(uri_scheme(uri))
    options = dict(storage_options)
    retry = options.pop("retry", None)
    deadline = options.pop("deadline", None)
    backend = cls.from_uri(uri, **options)
    if retry is None and deadline is None and not backend.capabilities.remote:
        return backend
    policy = RetryPolicy.coerce(retry)
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline < 0:
            raise ValueError(f"deadline must be a non-negative number of seconds, got {deadline!r}")
        policy = RetryPolicy(policy.attempts, policy.base_delay, policy.max_delay, float(deadline))
    wrapped = RetryingBackend(backend, policy)
    try:
        wrapped.check_access()
    except BaseException:
        backend.close()
        raise
    return wrapped

# Network backends (issue 5): fsspec protocols and Hugging Face Buckets, imported on first use.
for _scheme, _extra, _needs in (("s3", "s3", "s3fs"), ("s3a", "s3", "s3fs"), ("gs", "gcs", "gcsfs"),
                                ("gcs", "gcs", "gcsfs")):
    _registry.register(_scheme, "deltastore.backends.fsspec:FsspecBackend",
                       install_hint=f"pip install 'deltastore[{_extra}]'", requires=(_needs,))
_registry.register("hf", "deltastore.backends.hf:HfBucketBackend", install_hint="pip install 'deltastore[hf]'",
                   requires=("huggingface_hub", "hf_xet"))
