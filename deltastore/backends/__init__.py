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

from ..registry import backends as _registry
from .base import Backend, Capabilities, PutMode, check_key

__all__ = ["Backend", "Capabilities", "PutMode", "check_key", "open_backend", "uri_scheme"]

_registry.register("file", "deltastore.backends.local:LocalBackend")
_registry.register("memory", "deltastore.backends.memory:MemoryBackend")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def uri_scheme(uri: str) -> str:
    """The URI's scheme, or ``"file"`` for a bare path."""
    m = _SCHEME.match(uri)
    return m.group(1).lower() if m else "file"


def open_backend(uri: str | Any, **storage_options: Any) -> Backend:
    """Open the backend for ``uri`` (a URI string, a path, or an already open :class:`Backend`).

    Raises :class:`UnknownBackendError` for an unregistered scheme and
    :class:`MissingDependencyError` when the scheme's plugin needs an extra.
    """
    if isinstance(uri, Backend):
        if storage_options:
            raise TypeError("storage_options cannot be applied to an already open backend")
        return uri
    uri = os.fspath(uri) if not isinstance(uri, str) else uri
    cls = _registry.get(uri_scheme(uri))
    return cls.from_uri(uri, **storage_options)

# Network backends (issue 5): fsspec protocols and Hugging Face Buckets, imported on first use.
_registry.register("s3", "deltastore.backends.fsspec:FsspecBackend", install_hint="pip install 'deltastore[s3]'")
_registry.register("s3a", "deltastore.backends.fsspec:FsspecBackend", install_hint="pip install 'deltastore[s3]'")
_registry.register("gs", "deltastore.backends.fsspec:FsspecBackend", install_hint="pip install 'deltastore[gcs]'")
_registry.register("gcs", "deltastore.backends.fsspec:FsspecBackend", install_hint="pip install 'deltastore[gcs]'")
_registry.register("hf", "deltastore.backends.hf:HfBucketBackend", install_hint="pip install 'deltastore[hf]'")
