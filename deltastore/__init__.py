"""deltastore: publish only the bf16 weights that changed, pull them bit-exactly.

    import deltastore as ds
    pub = ds.Publisher("./runs/grpo-1")
    pub.publish(model, step=1)
    ds.Subscriber("./runs/grpo-1").pull(inference_model)

The names below are imported on first use (PEP 562), so ``import deltastore`` (and the command line)
does not import torch until something that works on tensors is asked for.
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # what static tools (type checkers, the API docs) see
    from . import errors
    from .codecs import Codec, TensorSpec, Update, get_codec, register_codec
    from .manifest import Manifest, VersionRef
    from .publish.anchors import AnchorPolicy, Every, every
    from .publish.publisher import Publisher, VersionInfo
    from .pull.subscriber import PullResult, Subscriber
    from .registry import Registry
    from .store import DeltaStore, open_store
    from .store_mirror import MirrorReport, mirror_store

#: public name -> the module that defines it
_LAZY = {
    "AnchorPolicy": "publish.anchors", "Every": "publish.anchors", "every": "publish.anchors",
    "Codec": "codecs", "TensorSpec": "codecs", "Update": "codecs", "get_codec": "codecs", "register_codec": "codecs",
    "Manifest": "manifest", "VersionRef": "manifest",
    "Publisher": "publish.publisher", "VersionInfo": "publish.publisher",
    "Registry": "registry",
    "DeltaStore": "store", "open_store": "store",
    "MirrorReport": "store_mirror", "mirror_store": "store_mirror",
    "PullResult": "pull.subscriber", "Subscriber": "pull.subscriber",
}

__all__ = sorted([*_LAZY, "__version__", "errors"])


def __getattr__(name: str) -> Any:
    import importlib

    if name == "errors":
        return importlib.import_module(".errors", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
