"""deltastore: publish only the bf16 weights that changed, pull them bit-exactly.

    import deltastore as ds
    pub = ds.Publisher("./runs/grpo-1")
    pub.publish(model, step=1)
    ds.Subscriber("./runs/grpo-1").pull(inference_model)
"""

from ._version import __version__
from .anchors import AnchorPolicy, Every, every
from .codecs import Codec, TensorSpec, Update, get_codec, register_codec
from .manifest import Manifest, VersionRef
from .publisher import Publisher, VersionInfo
from .registry import Registry
from .store import DeltaStore, open_store
from .store_mirror import MirrorReport, mirror_store
from .subscriber import PullResult, Subscriber
from . import errors

__all__ = [
    "AnchorPolicy", "Codec", "DeltaStore", "Every", "Manifest", "MirrorReport", "Publisher", "PullResult", "Registry",
    "Subscriber", "TensorSpec", "Update", "VersionInfo", "VersionRef", "__version__", "errors", "every",
    "get_codec", "mirror_store", "open_store", "register_codec",
]
