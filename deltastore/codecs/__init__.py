"""Codec plugins, chosen by name.

Built-ins: ``raw`` (sparse: positions + new values), ``zstd`` (gap-coded
positions + zstd, raw values), ``ulp`` (plus ulp-step values), ``ctx``
(context-modelled on the receiver's tensor), ``auto`` (per tensor the
smallest) and ``dense`` (whole tensors, for anchors). See ``docs/codecs.md``. Register your own with :func:`register_codec` or an
entry point in the group ``deltastore.codecs``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ManifestError, UnsupportedFormatError
from ..registry import codecs as _registry
from ..tensor_spec import TensorSpec

if TYPE_CHECKING:
    from .base import Codec, InPlace, OldBits, Update, UpdateBatch, WrittenBatch, read_old_bits, write_in_place

__all__ = ["Codec", "InPlace", "OldBits", "TensorSpec", "Update", "UpdateBatch", "WrittenBatch", "get_codec",
           "read_old_bits", "register_codec", "write_in_place"]

#: the names of :mod:`.base` offered here, imported (with torch) on first use: registering codecs, reading a
#: manifest or listing plugins needs no torch
_FROM_BASE = ("Codec", "InPlace", "OldBits", "Update", "UpdateBatch", "WrittenBatch", "read_old_bits",
              "write_in_place")


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_BASE))


_registry.register("raw", "deltastore.codecs.raw:RawCodec")
_registry.register("dense", "deltastore.codecs.dense:DenseCodec")
_registry.register("zstd", "deltastore.codecs.zstd:ZstdCodec")
_registry.register("ulp", "deltastore.codecs.ulp:UlpCodec")
_registry.register("ctx", "deltastore.codecs.ctx:CtxCodec")
_registry.register("auto", "deltastore.codecs.auto:AutoCodec")


def register_codec(name: str, cls: type[Codec] | str, *, clobber: bool = False,
                   install_hint: str | None = None) -> None:
    """Register a codec class (or a lazy ``"module:Class"`` path) under ``name``.

    Raises :class:`PluginConflictError` if another class holds ``name`` and
    ``clobber`` is false.
    """
    _registry.register(name, cls, clobber=clobber, install_hint=install_hint)


def get_codec(config: str | dict[str, Any] | Codec) -> Codec:
    """Build a codec from a name, a manifest codec record or a codec instance.

    A record is ``{"id": NAME, "version": "MAJOR.MINOR", "config": {...}}``; its
    major version must equal the installed codec's, else
    :class:`UnsupportedFormatError`. Unknown names raise :class:`UnknownCodecError`.
    """
    from .base import Codec

    if isinstance(config, Codec):
        return config
    if isinstance(config, str):
        return _registry.get(config)()
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise ManifestError(f"codec record must be a dict with a string 'id', got {config!r}")
    cls = _registry.get(config["id"])
    version = config.get("version", cls.format_version)
    if not isinstance(version, str) or not cls.reads_major(version.split(".")[0]):
        raise UnsupportedFormatError(
            f"codec {config['id']!r} object format {version!r} is not readable by the installed codec "
            f"(format {cls.format_version}); upgrade deltastore or the codec's package")
    cfg = config.get("config", {})
    if not isinstance(cfg, dict):
        raise ManifestError(f"codec {config['id']!r} config must be a JSON object, got {cfg!r}")
    try:
        return cls.from_config(cfg)
    except (TypeError, ValueError) as e:
        raise ManifestError(f"codec {config['id']!r} rejects config {cfg!r}: {e}") from e

