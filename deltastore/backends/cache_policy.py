"""How long an HTTP cache (a CDN, a caching proxy, a browser) may keep each key of a store.

The store's layout makes this a rule on the key alone: objects are named by
the sha256 of their bytes and manifests are written once (create-only), so
both can be cached forever; ``refs/`` (the latest hint and the index) change
with every commit and are kept only briefly, and a cache revalidates them with
a conditional GET (``If-None-Match``). The publisher sends the matching
``Cache-Control`` on every write where the service stores it (S3, GCS;
docs/backends.md, "Serving a store over HTTP"), and the nginx configuration in
that page sets the same headers for a store on local disk.
"""

from __future__ import annotations

IMMUTABLE = "public, max-age=31536000, immutable"
"""Objects and manifests: one year, never revalidated (their bytes cannot change under the key)."""
MUTABLE = "public, max-age=1, must-revalidate"
"""``refs/`` and the store marker: one second, then revalidated (a 304 when unchanged)."""

_IMMUTABLE_PREFIXES = ("objects/", "versions/")
_MUTABLE_PREFIXES = ("refs/",)
_MUTABLE_KEYS = ("deltastore.json",)


def cache_control(key: str) -> str | None:
    """The ``Cache-Control`` value a publisher sets on ``key``, or None for keys no follower reads (``gc/``)."""
    if key.startswith(_IMMUTABLE_PREFIXES):
        return IMMUTABLE
    if key.startswith(_MUTABLE_PREFIXES) or key in _MUTABLE_KEYS:
        return MUTABLE
    return None


def is_mutable(key: str) -> bool:
    """Whether ``key``'s bytes change over the store's life (a reader polls it with conditional GETs)."""
    return key.startswith(_MUTABLE_PREFIXES) or key in _MUTABLE_KEYS


_JSON_KEYS = ("refs/index.json", "deltastore.json")


def content_type(key: str) -> str:
    """The ``Content-Type`` a publisher sets on ``key``: JSON documents as such, everything else bytes."""
    if key.startswith("versions/") or key in _JSON_KEYS:
        return "application/json"
    return "application/octet-stream"
