"""Registering codecs: three lines for a user codec, clobber, lazy paths, and a third-party codec found through
its entry point passing the conformance kit (which also pulls every built-in codec end to end:
``test_conformance.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import deltastore as ds
import deltastore.codecs.raw  # noqa: F401  (ds.codecs.raw below)
from deltastore.codecs import get_codec
from deltastore.errors import PluginConflictError, UnknownCodecError
from deltastore.registry import codecs as codec_registry
from deltastore.testing import CodecConformance

from deltastore.testing import bits_equal

EP_DIR = Path(__file__).parent / "entrypoint_dist"


def _states(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.float32)
    out = []
    for _ in range(n):
        w = w.clone()
        b = b.clone()
        m = torch.rand(w.shape, generator=g) < 0.05
        w.view(torch.int16)[m] += 1
        b[:3] += 1e-3
        out.append({"layer.weight": w, "layer.bias": b})
    return out


def _publish_and_pull(uri, codec):
    states = _states()
    with ds.Publisher(uri, codec=codec, anchor_every=100) as pub:
        for step, s in enumerate(states):
            pub.publish(s, step=step)
    sub = ds.Subscriber(uri)
    target = sub.pull(step=0).state
    sub.pull(target, step=0)  # registers the version the target holds
    for step, s in enumerate(states[1:], start=1):
        r = sub.pull(target, step=step, allow_anchor=False)
        assert r.path == "delta"
        assert bits_equal(target, s)


def test_user_codec_in_three_lines(memory_uri):
    class MyCodec(ds.codecs.raw.RawCodec):
        codec_id = "my-codec"

    ds.register_codec("my-codec", MyCodec)
    try:
        _publish_and_pull(memory_uri, "my-codec")
        assert ds.Subscriber(memory_uri).manifest(1).objects[0].codec["id"] == "my-codec"
    finally:
        codec_registry.unregister("my-codec")


def test_clobber_rules():
    class A(ds.codecs.raw.RawCodec):
        codec_id = "clob"

    class B(ds.codecs.raw.RawCodec):
        codec_id = "clob"

    ds.register_codec("clob", A)
    try:
        ds.register_codec("clob", A)
        with pytest.raises(PluginConflictError):
            ds.register_codec("clob", B)
        with pytest.raises(PluginConflictError):
            ds.register_codec("ctx", B)  # built-ins are protected too
        ds.register_codec("clob", B, clobber=True)
        assert isinstance(get_codec("clob"), B)
    finally:
        codec_registry.unregister("clob")


def test_lazy_path_and_install_hint():
    ds.register_codec("lazy-missing", "no_such_pkg_for_tests.codec:Thing", install_hint="pip install thing")
    try:
        with pytest.raises(ImportError, match="pip install thing"):
            get_codec("lazy-missing")
    finally:
        codec_registry.unregister("lazy-missing")
    with pytest.raises(UnknownCodecError):
        get_codec("never-registered")


class TestDemoCodecPlugin(CodecConformance):
    """A third-party codec, installed as a distribution with an entry point (``entrypoint_dist/``), passes the
    kit: found by name through the entry point, then every check a built-in codec passes."""

    @pytest.fixture
    def codec(self, monkeypatch):
        monkeypatch.syspath_prepend(str(EP_DIR))
        codec_registry.refresh()
        try:
            codec = get_codec("demo-ep")
            assert type(codec).__name__ == "DemoCodec"
            yield codec
        finally:
            codec_registry.unregister("demo-ep")
            codec_registry.refresh()
            sys.modules.pop("demo_codec_plugin", None)

    @pytest.fixture
    def entry_point(self):
        return True
