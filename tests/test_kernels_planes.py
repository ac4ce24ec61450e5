"""Byte-plane kernels and the ``dense`` codec's format 2.1 (packing, parallel frames, hostile objects)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zstandard

from deltastore.codecs import TensorSpec, Update, get_codec
from deltastore.codecs import dense as D
from deltastore.codecs._safetensors import pack_u8, view
from deltastore.errors import CorruptObjectError, UnsupportedFormatError
from deltastore.kernels import planes as P
from deltastore.tensors import bits_view

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]
FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_U = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Uniformly random bit patterns (NaN payloads, -0, subnormals included); bool as 0/1."""
    n = int(np.prod(shape))
    width = torch.empty((), dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, n * width, dtype=np.uint8)
    if dtype == torch.bool:
        return torch.from_numpy(raw & 1).view(torch.bool).reshape(shape)
    return torch.from_numpy(raw).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def _ref_planes(bits: np.ndarray, rotate: bool) -> list[np.ndarray]:
    """deltastore 0.1's numpy formula: rotate left by one bit, then little-endian bytes as planes."""
    u = bits.view(_U[bits.dtype.itemsize])
    w = u.dtype.itemsize
    if rotate and w > 1:
        u = (u << u.dtype.type(1)) | (u >> u.dtype.type(8 * w - 1))
    b = u.astype(u.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, w)
    return [np.ascontiguousarray(b[:, j]) for j in range(w)]


# --- kernels ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("n", [0, 1, 3, 1001])
def test_split_join_match_the_numpy_formula(width, rotate, n):
    src = np.random.default_rng(n).integers(0, 2**63, n, dtype=np.uint64).astype(_U[width])
    planes = [np.full(n + 5, 0xAA, np.uint8) for _ in range(width)]  # longer than needed: the tail is untouched
    P.split(src, rotate, planes)
    for got, want in zip(planes, _ref_planes(src, rotate)):
        assert np.array_equal(got[:n], want) and (got[n:] == 0xAA).all()
    out = np.empty(n, _U[width])
    ro = [np.frombuffer(p.tobytes(), np.uint8) for p in planes]  # read-only planes (slices of a stored object)
    P.join(ro, rotate, out)
    assert np.array_equal(out, src)


def test_split_join_signed_views():
    src = np.array([-1, 0, 1, -32768, 32767], np.int16)
    planes = [np.empty(5, np.uint8), np.empty(5, np.uint8)]
    P.split(src, True, planes)
    out = np.empty(5, np.int16)
    P.join(planes, True, out)
    assert np.array_equal(out, src)


def test_split_join_check_their_arguments():
    with pytest.raises(ValueError):
        P.split(np.zeros(4, np.uint16), False, [np.zeros(4, np.uint8)])
    with pytest.raises(ValueError):
        P.split(np.zeros(4, np.uint16), False, [np.zeros(4, np.uint8), np.zeros(3, np.uint8)])
    with pytest.raises(ValueError):
        P.join([np.zeros(4, np.uint8)] * 2, False, np.zeros(5, np.uint16))
    with pytest.raises(ValueError):
        P.join([np.zeros(4, np.int16)] * 2, False, np.zeros(4, np.uint16))


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("rotate", [False, True])
def test_segments_pack_many_tensors_in_one_call(width, rotate):
    dt = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    sizes = [5, 1, 300, 17, 64]
    ts = [bits_view(_random(dt, (n,), seed=i)) for i, n in enumerate(sizes)]
    starts = np.cumsum([0] + sizes[:-1]).astype(np.int64)
    total = sum(sizes)
    planes = [np.empty(total, np.uint8) for _ in range(width)]
    addrs = np.array([t.data_ptr() for t in ts], np.uint64)
    P.split_segments(width, rotate, addrs, np.array(sizes, np.int64), starts, planes)
    flat = torch.cat(ts).numpy()
    for got, want in zip(planes, _ref_planes(flat, rotate)):
        assert np.array_equal(got, want)
    outs = [torch.empty(n, dtype=dt) for n in sizes]
    P.join_segments(width, rotate, planes, starts, np.array(sizes, np.int64),
                    np.array([o.data_ptr() for o in outs], np.uint64))
    assert all(torch.equal(o, t) for o, t in zip(outs, ts))
    # a segment inside a tensor: addresses may point into the middle of one
    part = torch.empty(100, dtype=dt)
    P.join_segments(width, rotate, planes, np.array([205], np.int64), np.array([100], np.int64),
                    np.array([part.data_ptr()], np.uint64))
    assert torch.equal(part, torch.from_numpy(flat)[205:305])


def test_segments_check_their_arguments():
    planes = [np.zeros(10, np.uint8)] * 2
    a = torch.zeros(10, dtype=torch.int16)
    with pytest.raises(ValueError):  # plane too short for start + count
        P.join_segments(2, False, planes, np.array([5], np.int64), np.array([6], np.int64),
                        np.array([a.data_ptr()], np.uint64))
    with pytest.raises(ValueError):  # null address
        P.join_segments(2, False, planes, np.array([0], np.int64), np.array([1], np.int64), np.array([0], np.uint64))
    with pytest.raises(ValueError):  # wrong index dtypes
        P.split_segments(2, False, np.array([a.data_ptr()]), np.array([1]), np.array([0]), planes)
    with pytest.raises(ValueError):
        P.split_segments(3, False, np.array([a.data_ptr()], np.uint64), np.array([1], np.int64),
                         np.array([0], np.int64), planes)


# --- the dense codec, format 2.1 --------------------------------------------------------------------

def _codec(**cfg):
    return get_codec({"id": "dense", "config": {"planes": True, **cfg}})


def _roundtrip(state: dict[str, torch.Tensor], codec) -> bytes:
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    data = codec.encode([Update(s, bits_view(state[s.name])) for s in specs])
    out = codec.decode(data, specs[::-1])  # spec order does not matter
    assert set(out) == set(state)
    for s in specs:
        got = out[s.name].bits
        assert got.dtype == s.bits_dtype and got.shape == (s.numel,) and got.is_contiguous()
        assert torch.equal(got, bits_view(state[s.name])), s.name
    return data


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 22])
def test_every_dtype_roundtrips_bit_exactly(chunk):
    state = {f"t.{i}.{str(dt)[6:]}": _random(dt, shape, seed=i)
             for i, (dt, shape) in enumerate((dt, shape) for dt in DTYPES for shape in [(0,), (1,), (33, 31), (2500,)])}
    _roundtrip(state, _codec(chunk=chunk))


def test_small_tensors_are_packed_into_few_frames():
    state = {f"experts.{i:05d}.w": _random(torch.bfloat16, (8, 16), seed=i) for i in range(3000)}
    state["norm"] = torch.ones(64, dtype=torch.float32)
    data = _roundtrip(state, _codec(chunk=1 << 16))
    tensors, meta = view(data, "dense")
    groups = json.loads(meta["deltastore.dense.groups"])
    # 3000 * 128 bf16 elements in groups of <= 65536 elements: 6 groups of bf16, one of f32
    assert [len(g["tensors"]) for g in groups] == [512] * 5 + [440, 1]
    assert sum(len(g["frames"]) for g in groups) == 6 * 2 + 4
    assert set(tensors) == {"frames"}


def test_tensors_never_straddle_groups_and_large_ones_stand_alone():
    specs = [TensorSpec(n, torch.bfloat16, (k,)) for n, k in [("a", 600), ("b", 600), ("c", 5000), ("d", 10)]]
    groups = D.make_groups(specs, 1000)
    assert [g.names for g in groups] == [["a"], ["b", "d"], ["c"]]
    assert all(g.total <= 1000 or len(g.names) == 1 for g in groups)


def test_encoding_is_deterministic_and_order_free():
    state = {f"w{i}": _random(torch.float16, (777,), seed=i) for i in range(20)}
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    ups = [Update(s, bits_view(state[s.name])) for s in specs]
    c = _codec(chunk=500)
    assert c.encode(ups) == c.encode(ups[::-1])


def test_noncontiguous_and_float_inputs_are_accepted():
    base = _random(torch.bfloat16, (40, 50), seed=1)
    spec = TensorSpec("x", torch.bfloat16, (50, 40))
    c = _codec()
    t = base.t()  # not contiguous: copied, not refused
    out = c.decode(c.encode([Update(spec, bits_view(t.contiguous()))]), [spec])
    data2 = c.encode([Update(spec, t.contiguous().view(torch.int16).reshape(-1))])
    assert torch.equal(out["x"].bits, c.decode(data2, [spec])["x"].bits)


def test_bf16_weights_compress_below_68_percent():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)
    data = _roundtrip({"w": w}, _codec())
    assert len(data) / (2 << 20) < 0.68


def test_mantissa_planes_are_stored_raw_and_exponents_compressed():
    w = (torch.randn(1 << 19, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    _, meta = view(_roundtrip({"w": w}, _codec()), "dense")
    (g,) = json.loads(meta["deltastore.dense.groups"])
    assert [f[4] for f in g["frames"]] == ["r", "z"]


def test_size_estimate_is_close_on_real_weights():
    w = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    spec = TensorSpec("w", torch.bfloat16, (1 << 20,))
    c = _codec()
    real = len(c.encode([Update(spec, bits_view(w))]))
    assert 0.9 * real <= c.estimate_size(spec, 0) <= 1.1 * real
    assert get_codec("dense").estimate_size(spec, 0) == 2 << 20  # 1.0: the raw bits
    assert c.estimate_size(TensorSpec("i", torch.int32, (10,)), 0) == 40 + 1 + 40


def test_config_and_describe():
    c = _codec(chunk=1000, hash_log=None)
    assert c.describe() == {"id": "dense", "version": "2.1",
                            "config": {"planes": True, "level": 1, "chunk": 1000, "hash_log": None}}
    assert get_codec(c.describe()).get_config() == c.get_config()
    assert get_codec("dense").describe()["version"] == "1.0"
    _roundtrip({"a": _random(torch.bfloat16, (3000,), 2)}, c)  # the level's own zstd parameters
    for bad in ({"hash_log": 5}, {"hash_log": True}, {"chunk": 0}, {"level": 99}):
        with pytest.raises(Exception):
            _codec(**bad)


def test_a_20_reader_refuses_a_21_object():
    """A 2.0 reader requires the ``deltastore.dense`` index; 2.1 objects do not carry it."""
    data = _codec().encode([Update(TensorSpec("a", torch.bfloat16, (4,)), torch.zeros(4, dtype=torch.int16))])
    _, meta = view(data, "dense")
    assert meta["deltastore.codec_version"] == "2.1" and "deltastore.dense" not in meta


def test_update_count_and_width_must_match_spec():
    with pytest.raises(ValueError):
        _codec().encode([Update(TensorSpec("a", torch.bfloat16, (5,)), torch.zeros(4, dtype=torch.int16))])
    with pytest.raises(ValueError):  # the kernels read spec-width elements: a narrower buffer must be refused
        _codec().encode([Update(TensorSpec("a", torch.float32, (4,)), torch.zeros(4, dtype=torch.int16))])
    with pytest.raises(ValueError):
        _codec().encode([Update(TensorSpec("a", torch.float32, (4,)), torch.zeros(4, dtype=torch.int32))] * 2)


def test_concurrent_encodes_and_decodes_from_many_threads():
    from concurrent.futures import ThreadPoolExecutor

    states = [{f"w{i}.{k}": _random(torch.bfloat16, (n,), seed=10 * i + k) for k, n in enumerate([5000, 70, 3, 20000])}
              for i in range(8)]
    c = _codec(chunk=4096)

    def one(state):
        specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
        data = c.encode([Update(s, bits_view(state[s.name])) for s in specs])
        out = c.decode(data, specs)
        return all(torch.equal(out[s.name].bits, bits_view(state[s.name])) for s in specs)

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(one, states * 3))


# --- format 2.0 objects (written by deltastore 0.1) still decode -------------------------------------

def _encode_v20(state: dict[str, torch.Tensor], chunk: int) -> bytes:
    """deltastore 0.1's 2.0 writer, kept here as the reference."""
    from safetensors.torch import save

    out, index = {}, {}
    for name, t in state.items():
        bits = bits_view(t).numpy()
        planes = _ref_planes(bits, t.dtype in FLOATS)
        entries, payload = [], b""
        for start in range(0, bits.size, chunk):
            for j, p in enumerate(planes):
                raw = p[start:start + chunk].tobytes()
                z = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
                entries.append([j, start, len(raw), *((len(z), "z") if len(z) < len(raw) else (len(raw), "r"))])
                payload += z if len(z) < len(raw) else raw
        out[name] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
        index[name] = entries
    return save(out, metadata={"deltastore.codec": "dense", "deltastore.codec_version": "2.0",
                               "deltastore.dense": json.dumps(index)})


def test_format_20_objects_decode():
    state = {f"t{i}": _random(dt, (1234,), seed=i) for i, dt in enumerate(DTYPES)}
    state["empty"] = torch.empty(0, dtype=torch.bfloat16)
    data = _encode_v20(state, 500)
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    out = _codec().decode(data, specs)
    assert all(torch.equal(out[k].bits, bits_view(v)) for k, v in state.items())


def test_format_20_overlapping_frames_are_refused():
    state = {"a": _random(torch.bfloat16, (1000,), seed=3)}
    data = _encode_v20(state, 500)
    tensors, meta = view(data, "dense")
    index = json.loads(meta["deltastore.dense"])
    index["a"][2][1] = 400  # second chunk of plane 0 now overlaps the first and leaves a gap
    from safetensors.torch import save

    bad = save({"a": torch.frombuffer(bytearray(tensors["a"][2]), dtype=torch.uint8)},
               metadata={**meta, "deltastore.dense": json.dumps(index)})
    with pytest.raises(CorruptObjectError):
        _codec().decode(bad, [TensorSpec("a", torch.bfloat16, (1000,))])


# --- hostile 2.1 objects: every one is CorruptObjectError, nothing large is allocated ----------------

SPECS = [TensorSpec("a", torch.bfloat16, (3000,)), TensorSpec("b", torch.bfloat16, (10,)),
         TensorSpec("c", torch.float32, (20,))]


@pytest.fixture(scope="module")
def good() -> tuple[bytes, list, dict]:
    w = (torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    state = {"a": w, "b": _random(torch.bfloat16, (10,), 1), "c": _random(torch.float32, (20,), 2)}
    data = _codec(chunk=1000).encode([Update(s, bits_view(state[s.name])) for s in SPECS])
    tensors, meta = view(data, "dense")
    return data, json.loads(meta["deltastore.dense.groups"]), {"meta": meta, "payload": bytes(tensors["frames"][2])}


def _rebuild(good, groups=None, payload=None, **meta) -> bytes:
    m = dict(good[2]["meta"])
    m["deltastore.dense.groups"] = json.dumps(good[1] if groups is None else groups)
    m.update(meta)
    m = {k: v for k, v in m.items() if v is not None}
    return pack_u8({"frames": [good[2]["payload"] if payload is None else payload]}, m)


def _bad(data: bytes, specs=SPECS, match: str | None = None) -> None:
    with pytest.raises(CorruptObjectError, match=match):
        _codec().decode(data, specs)


def test_the_good_object_decodes(good):
    out = _codec().decode(_rebuild(good), SPECS)
    assert set(out) == {"a", "b", "c"}


def _edit(good, fn):
    groups = json.loads(json.dumps(good[1]))
    fn(groups)
    return _rebuild(good, groups=groups)


@pytest.mark.parametrize("how", [
    lambda g: g.pop(),                                            # a tensor missing
    lambda g: g[0]["tensors"].append("b"),                        # listed twice
    lambda g: g[1]["tensors"].append("zzz"),                      # unknown name
    lambda g: g[1]["tensors"].insert(0, 7),                       # not a string
    lambda g: g.append({"tensors": [], "frames": []}),            # empty group
    lambda g: g[1].__setitem__("tensors", ["b", "c"]),            # bf16 and f32 in one group
    lambda g: g[0]["frames"].pop(),                               # plane missing
    lambda g: g[0]["frames"].__delitem__(slice(4, 6)),            # chunk missing: covers too little
    lambda g: g[0]["frames"][0].__setitem__(0, 1),                # plane out of order
    lambda g: g[0]["frames"][2].__setitem__(1, 999),              # start leaves a gap
    lambda g: g[0]["frames"][1].__setitem__(2, 999),              # planes of a chunk disagree on count
    lambda g: g[0]["frames"][0].__setitem__(2, 0),                # empty frame
    lambda g: g[0]["frames"][0].__setitem__(3, 5),                # raw frame of the wrong size
    lambda g: g[0]["frames"][0].__setitem__(4, "x"),              # unknown storage
    lambda g: g[0]["frames"][0].__setitem__(1, True),             # bool is not an int
    lambda g: g[0]["frames"][0].append(1),                        # arity
    lambda g: g[0]["frames"][1].__setitem__(3, 10**9),            # beyond the payload
    lambda g: g[0].__setitem__("frames", "nope"),
    lambda g: g.__setitem__(0, ["a"]),
])
def test_bad_group_index(good, how):
    _bad(_edit(good, how))


def test_bad_objects(good):
    data, groups, rest = good
    _bad(data[:-1])                                               # truncated
    _bad(b"\x00" * 4)                                             # not safetensors
    _bad(data[:8] + b"[" + data[9:])                              # bad header JSON
    _bad(_rebuild(good, **{"deltastore.dense.groups": "[{"}))    # bad index JSON
    _bad(_rebuild(good, **{"deltastore.dense.groups": None}))    # no index
    _bad(_rebuild(good, **{"deltastore.dense.groups": "{}"}))    # index not a list
    _bad(_rebuild(good, **{"deltastore.names": "0" * 16}))       # other tensors
    with pytest.raises(UnsupportedFormatError, match="upgrade"):  # a newer minor
        _codec().decode(_rebuild(good, **{"deltastore.codec_version": "2.7"}), SPECS)
    _bad(_rebuild(good, **{"deltastore.codec": "raw"}))          # another codec's object
    _bad(_rebuild(good, payload=rest["payload"] + b"\x00"))       # trailing bytes
    _bad(pack_u8({"frames": [rest["payload"]], "extra": [b"x"]}, rest["meta"]))
    _bad(pack_u8({"other": [rest["payload"]]}, rest["meta"]))
    _bad(data, SPECS[:2])                                         # manifest expects other tensors
    _bad(data, [SPECS[0], SPECS[1], TensorSpec("c", torch.float32, (21,))])  # other sizes


def _z_frame_index(groups) -> tuple[int, int, int]:
    """(group, frame, payload offset) of the first zstd frame."""
    off = 0
    for gi, g in enumerate(groups):
        for fi, f in enumerate(g["frames"]):
            if f[4] == "z":
                return gi, fi, off
            off += f[3]
    raise AssertionError("no zstd frame")


def test_bad_zstd_frames(good):
    data, groups, rest = good
    gi, fi, off = _z_frame_index(groups)
    n = groups[gi]["frames"][fi][3]
    payload = rest["payload"]
    # corrupt stream (content size kept)
    z = bytearray(payload)
    z[off + n - 3] ^= 0xFF
    z[off + n // 2] ^= 0xFF
    _bad(_rebuild(good, payload=bytes(z)), match="corrupt")
    # a frame that declares 2**40 bytes (a bomb) is refused before decompressing
    big = zstandard.ZstdCompressor(level=19).compressobj(size=2**40)
    bomb = big.compress(b"\x00" * 1000) + big.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    assert zstandard.get_frame_parameters(bomb).content_size == 2**40
    ng = json.loads(json.dumps(groups))
    ng[gi]["frames"][fi][3] = len(bomb)
    _bad(_rebuild(good, groups=ng, payload=payload[:off] + bomb + payload[off + n:]), match="declares 1099511627776")
    # not a zstd frame at all
    junk = b"\x01" * n
    _bad(_rebuild(good, payload=payload[:off] + junk + payload[off + n:]), match="not a zstd frame")
    # a valid frame of the right size followed by extra bytes inside the frame's span
    inner = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"\x00" * groups[gi]["frames"][fi][2])
    ng = json.loads(json.dumps(groups))
    ng[gi]["frames"][fi][3] = len(inner) + 2
    _bad(_rebuild(good, groups=ng, payload=payload[:off] + inner + b"zz" + payload[off + n:]), match="corrupt")
