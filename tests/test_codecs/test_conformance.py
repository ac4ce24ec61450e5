"""Every built-in codec (and whatever else is registered) passes the codec conformance kit."""

from __future__ import annotations

import pytest
import torch

from deltastore.codecs import TensorSpec, get_codec
from deltastore.registry import codecs as codec_registry
from deltastore.testing import CodecConformance
from deltastore.testing.codecs import Change, check_fresh_process, representative_changes

# the registered codecs as they are used: auto both ways, dense in both formats (planes in chunks small
# enough that the round trips cross chunks)
CONFIGS = {"raw": "raw", "zstd": "zstd", "ulp": "ulp", "ctx": "ctx", "auto": "auto",
           "auto-bytes-first": {"id": "auto", "config": {"link_mbps": None}}, "dense": "dense",
           "dense-planes": {"id": "dense", "config": {"planes": True, "chunk": 4096}}}
CONFIGS.update({name: name for name in codec_registry.names() if name not in CONFIGS})

_STEPS: dict[str, list[Change]] = {}


def trace_step(trace, step: int = 4) -> list[Change]:
    """The changed tensors of one step of the real trace (what the sparse codecs' estimates are made for)."""
    key = f"{getattr(trace, 'run', id(trace))}:{step}"
    if key not in _STEPS:
        state = trace.state(step - 1)
        _STEPS[key] = [Change(TensorSpec(name, state[name].dtype, tuple(state[name].shape)),
                              state[name].contiguous().view(torch.int16).reshape(-1), idx, bits)
                       for name, (idx, bits) in trace.changes(step).items()]
    return _STEPS[key]


class TestBuiltinCodecs(CodecConformance):
    @pytest.fixture(params=list(CONFIGS.values()), ids=list(CONFIGS))
    def codec(self, request):
        return get_codec(request.param)

    @pytest.fixture
    def representative(self, codec, trace):
        # both runs of the real trace; an anchor codec's estimate is for any weights: the kit's sample
        return representative_changes() if codec.dense else trace_step(trace)

    @pytest.fixture
    def fresh_process(self):
        return False  # one interpreter for every codec: below


def test_every_codec_writes_the_same_bytes_in_a_fresh_process():
    check_fresh_process([get_codec(c) for c in CONFIGS.values()])
