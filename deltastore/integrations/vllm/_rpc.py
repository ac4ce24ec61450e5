"""Plain-data coercions for worker RPCs (HTTP ``/collective_rpc`` passes strings only) and typed errors
across the RPC boundary (exception types do not survive vLLM's RPC: errors travel as ``{"type", "message"}``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ... import errors as _errors
from ...errors import ApplyError, DeltaStoreError


def as_int(v: Any) -> int | None:
    """``None``/``""``/``"none"``/``"latest"`` -> None, else ``int(v)``."""
    if v is None or v == "" or (isinstance(v, str) and v.lower() in ("none", "null", "latest")):
        return None
    return int(v)


def as_keys(v: Any) -> list[str] | None:
    """Trusted keys as sent over an RPC: None/"" -> None; a list; a JSON list string; else ``;``-separated
    OpenSSH lines or paths."""
    if v is None or v == "" or v == []:
        return None
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("["):
            v = json.loads(text)
        else:
            return [p.strip() for p in text.split(";") if p.strip()]
    if not isinstance(v, (list, tuple)) or not all(isinstance(k, str) for k in v):
        raise TypeError(f"trusted_keys must be a list of key texts or paths, got {type(v).__name__}")
    return list(v)


def as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def as_dict(v: Any) -> dict[str, Any]:
    """A dict, a JSON object string, or empty; raises TypeError for anything else."""
    if v is None or v == "":
        return {}
    if isinstance(v, str):
        v = json.loads(v)
    if not isinstance(v, dict):
        raise TypeError(f"storage_options must be a dict or a JSON object, got {type(v).__name__}")
    return dict(v)


def error_dict(e: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
    if getattr(e, "restored", None) is False:
        out["restored"] = False
    return out


def raise_error(err: Mapping[str, Any]) -> None:
    """Re-raise a worker's error (``{"type", "message"[, "restored"]}``) as the matching deltastore error type."""
    cls = getattr(_errors, str(err.get("type", "")), None)
    if not (isinstance(cls, type) and issubclass(cls, DeltaStoreError)):
        cls = ApplyError if err.get("type") else DeltaStoreError
        exc = cls(f"{err.get('type')}: {err.get('message')}")
    else:
        exc = cls(err.get("message", ""))
    if err.get("restored") is False:
        exc.restored = False  # type: ignore[attr-defined]
    raise exc


def results(res: list[Any]) -> list[dict[str, Any]]:
    """The workers' results; the first error among them is re-raised with its deltastore type."""
    out = []
    for r in res:
        if isinstance(r, dict) and "error" in r and isinstance(r["error"], dict):
            raise_error(r["error"])
        out.append(r)
    return out
