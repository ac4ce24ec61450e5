"""Tampered streams, frames of another dtype, zstd bombs, wrong tensor sets and malformed ``auto`` records raise
typed errors, each naming the problem. (Truncated, extended, garbage and other hostile objects of every codec,
and future major versions: the conformance kit, ``test_conformance.py``.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zstandard

from deltastore.codecs import TensorSpec, Update, get_codec
from deltastore.codecs._common import pack_meta, u8, unpack_meta
from deltastore.errors import CorruptObjectError, UnsupportedFormatError


def _sample():
    rng = np.random.default_rng(3)
    old = (torch.from_numpy(rng.standard_normal(5000)) * 0.02).to(torch.bfloat16).view(torch.int16)
    new = old.clone()
    idx = torch.from_numpy(np.sort(rng.choice(5000, 200, replace=False)))
    new[idx] += 1
    pos = torch.ne(old, new).nonzero().squeeze(1)
    return [Update(TensorSpec("w", torch.bfloat16, (5000,)), new[pos].clone(), pos, old[pos].clone(), old.clone())]


def _codec(cid):
    return get_codec({"id": "dense", "version": "2.0", "config": {"planes": True}}) if cid == "dense-planes" \
        else get_codec(cid)


def _decode(codec, data, ups):
    olds = {u.spec.name: u.old_tensor for u in ups}
    specs = [u.spec for u in ups]
    return codec.decode(data, specs, lambda n, p: olds[n] if p is None else olds[n][p])


def _encode(cid, ups):
    codec = _codec(cid)
    if codec.dense:
        ups = [Update(u.spec, u.old_tensor) for u in ups]
    return codec, ups, codec.encode(ups)


@pytest.mark.parametrize("cid", ["zstd", "ulp", "ctx", "dense-planes"])
def test_stream_tampering(cid):
    """Flip bytes inside each stored stream, and append bytes to each: typed error or a detectably different result."""
    codec, ups, data = _encode(cid, _sample())
    tensors, meta = unpack_meta(data, cid.split("-")[0])
    for key, t in tensors.items():
        b = t.numpy().tobytes()
        for variant in (b + b"\x01", b[:-1]):
            tt = dict(tensors)
            tt[key] = u8(variant)
            bad = pack_meta(tt, codec.codec_id, meta["deltastore.codec_version"],
                            {k: v for k, v in meta.items() if not k.startswith("deltastore.codec")})
            with pytest.raises(CorruptObjectError):
                _decode(codec, bad, ups)


@pytest.mark.parametrize("cid", ["zstd", "ulp", "ctx", "auto"])
def test_a_frame_of_another_dtype_or_rank_is_refused(cid):
    """The sparse codecs read their frames as bytes in place: a frame stored as int16, or as a 2-D array,
    is named as corrupt, not reinterpreted."""
    codec, ups, data = _encode(cid, _sample())
    tensors, meta = unpack_meta(data, cid)
    key = sorted(tensors)[0]
    extra = {k: v for k, v in meta.items() if not k.startswith("deltastore.codec")}
    raw = tensors[key].numpy().tobytes()
    for wrong in (torch.frombuffer(bytearray(raw + b"\0" * (len(raw) % 2)), dtype=torch.int16),
                  u8(raw).reshape(1, -1)):
        bad = pack_meta({**tensors, key: wrong}, codec.codec_id, meta["deltastore.codec_version"], extra)
        with pytest.raises(CorruptObjectError, match=f"{key}.*expected 1-D uint8"):
            _decode(codec, bad, ups)


@pytest.mark.parametrize("cid", ["zstd", "ulp"])
def test_zstd_bomb_is_refused(cid):
    codec, ups, data = _encode(cid, _sample())
    tensors, meta = unpack_meta(data, cid)
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x00" * (64 << 20))  # 64 MiB of zeros in a few KB
    tensors["positions"] = u8(bomb)
    bad = pack_meta(tensors, codec.codec_id, "1.0", {"deltastore.names": meta["deltastore.names"]})
    with pytest.raises(CorruptObjectError):
        _decode(codec, bad, ups)


def test_wrong_tensor_set_is_refused():
    ups = _sample()
    for cid in ("zstd", "ulp", "ctx"):
        codec = get_codec(cid)
        data = codec.encode(ups)
        with pytest.raises(CorruptObjectError):
            codec.decode(data, [TensorSpec("other", torch.bfloat16, (5000,))], lambda n, p: ups[0].old_tensor)


def test_ctx_wrong_old_tensor_size():
    ups = _sample()
    codec = get_codec("ctx")
    data = codec.encode(ups)
    with pytest.raises(CorruptObjectError):
        codec.decode(data, [ups[0].spec], lambda n, p: torch.zeros(10, dtype=torch.int16))


@pytest.mark.parametrize("choice, match", [
    ('{"w": "nope"}', "unknown part codec 'nope'"),
    ('{"w": ["ulp"]}', "not a string"),
    ('{"w": 3}', "not a string"),
    ('{"other": "ulp"}', "tensors differ"),
    ('{"w": "ulp", "v": "ulp"}', "tensors differ"),
    ('{}', "tensors differ"),
    ('["w"]', "tensors differ"),
    ('{"w": "zstd"}', "parts .* do not match"),
])
def test_auto_choice_map_tampering_is_named(choice, match):
    """auto's map of which part codec holds each tensor (format 1.1: every tensor named) is read before any
    part: a codec it does not know, an entry that is not a codec name, or other tensors than the manifest's,
    is a typed error naming it."""
    codec, ups, data = _encode("auto", _sample())
    tensors, meta = unpack_meta(data, "auto")
    assert json.loads(meta["deltastore.auto.choice"]) == {"default": "ulp", "other": {}}  # the object tampered
    good = pack_meta(tensors, codec.codec_id, "1.1", {"deltastore.auto": '{"w": "ulp"}'})
    assert torch.equal(_decode(codec, good, ups)["w"].bits, ups[0].bits)  # a 1.1 object, as 1.1 wrote it
    bad = pack_meta(tensors, codec.codec_id, "1.1", {"deltastore.auto": choice})
    with pytest.raises(CorruptObjectError, match=match):
        _decode(codec, bad, ups)


@pytest.mark.parametrize("choice, match", [
    ('{"default": "nope", "other": {}}', "unknown part codec 'nope'"),
    ('{"default": "ulp", "other": {"w": "nope"}}', "unknown part codec 'nope'"),
    ('{"default": ["ulp"], "other": {}}', "not a string"),
    ('{"default": "ulp", "other": {"w": 3}}', "not a string"),
    ('{"default": "ulp", "other": {"v": "ulp"}}', "tensors differ"),
    ('{"default": "ulp"}', "choice record is not"),
    ('{"default": "ulp", "other": {}, "more": 1}', "choice record is not"),
    ('["w"]', "choice record is not"),
    ('{"default": "ulp", "other": ["w"]}', "no map of other tensors"),
    ('{"default": "zstd", "other": {}}', "parts .* do not match"),
    ('{"default": "ulp", "other": {"w": "zstd"}}', "parts .* do not match"),
    ('not json', "lacks a valid choice map"),
])
def test_auto_choice_record_tampering_is_named(choice, match):
    """Format 1.2 names only the tensors outside its default part; the same tampering is named the same way."""
    codec, ups, data = _encode("auto", _sample())
    tensors, meta = unpack_meta(data, "auto")
    bad = pack_meta(tensors, codec.codec_id, meta["deltastore.codec_version"], {"deltastore.auto.choice": choice})
    with pytest.raises(CorruptObjectError, match=match):
        _decode(codec, bad, ups)


@pytest.mark.parametrize("version, error, match", [
    ("1.9", UnsupportedFormatError, "newer than the installed"),
    ("2.0", CorruptObjectError, "not 1.x"),
    ("one", CorruptObjectError, "not 1.x"),
])
def test_auto_object_of_another_format_is_refused(version, error, match):
    codec, ups, data = _encode("auto", _sample())
    tensors, meta = unpack_meta(data, "auto")
    bad = pack_meta(tensors, codec.codec_id, version, {"deltastore.auto.choice": meta["deltastore.auto.choice"]})
    with pytest.raises(error, match=match):
        _decode(codec, bad, ups)


def test_auto_1_1_object_without_its_map_is_refused():
    """What a 1.1 reader meets in a 1.2 object, the other way round: a 1.1 object lacking ``deltastore.auto``."""
    codec, ups, data = _encode("auto", _sample())
    tensors, meta = unpack_meta(data, "auto")
    bad = pack_meta(tensors, codec.codec_id, "1.1", {"deltastore.auto.choice": meta["deltastore.auto.choice"]})
    with pytest.raises(CorruptObjectError, match="lacks a valid choice map"):
        _decode(codec, bad, ups)
