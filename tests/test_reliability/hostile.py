"""Hostile-input fuzzing (hypothesis): manifests, safetensors object headers, codec streams.

Every case must end in success or a :class:`DeltaStoreError`; anything else is
counted as untyped. Each ``fuzz_*`` function builds a hypothesis test with
``max_examples`` cases and returns when it has run; :data:`COUNTS` records
cases and outcomes for the figures.
"""

from __future__ import annotations

import json
import struct
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltastore as ds
from deltastore.codecs import Update, get_codec
from deltastore.codecs._common import pack_meta, unpack_meta
from deltastore.codecs.base import TensorSpec
from deltastore.errors import DeltaStoreError
from deltastore.manifest import Manifest
from deltastore.store import version_key

COUNTS: Counter[str] = Counter()
UNTYPED: list[str] = []
CODECS = ["raw", "zstd", "ulp", "ctx", "auto", {"id": "dense", "config": {"planes": True}}, "dense"]
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _settings(n: int) -> Any:
    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def _outcome(kind: str, fn: Any) -> None:
    COUNTS[f"{kind} cases"] += 1
    try:
        fn()
        COUNTS[f"{kind} accepted"] += 1
    except DeltaStoreError as e:
        COUNTS[f"{kind} typed: {type(e).__name__}"] += 1
    except Exception as e:  # noqa: BLE001 - the finding
        COUNTS["untyped"] += 1
        UNTYPED.append(f"{kind}: {type(e).__name__}: {e!r}"[:400])


# -- a small real store to mutate -----------------------------------------------------------------
class _Base:
    """A memory store with an anchor (0) and a delta (1); their manifest documents and the states."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.s0 = {"w": torch.randn(64, 48, generator=g).bfloat16(), "b": torch.randn(48, generator=g).bfloat16()}
        self.s1 = {k: v.view(torch.int16).clone() for k, v in self.s0.items()}
        for v in self.s1.values():
            v.view(-1)[::37] += 1
        self.s1 = {k: v.view(torch.bfloat16) for k, v in self.s1.items()}
        self.uri = f"memory://hostile-{uuid.uuid4().hex}"
        with ds.Publisher(self.uri, anchor_every=100) as pub:
            pub.publish(self.s0, step=0)
            pub.publish(self.s1, step=1)
        self.sub = ds.Subscriber(self.uri)
        self.docs = {s: json.loads(self.sub.store.backend.get(version_key(s))) for s in (0, 1)}


_BASE: _Base | None = None


def base() -> _Base:
    global _BASE
    if _BASE is None:
        _BASE = _Base()
    return _BASE


# -- manifests ------------------------------------------------------------------------------------------
HOSTILE_VALUES = st.one_of(
    st.sampled_from([10**30, -10**30, 2**63, 2**64, -1, 0, 1 << 48, (1 << 48) + 1, 10**12, 1e308, -0.0, None, True,
                     "", "..", "../../etc/passwd", "a/b", "/abs", "sha256:" + "0" * 64, "sha256:../../x", "\x00",
                     "x" * 600, [], {}, [-1, 4], [2**40, 2**40], [0], [1] * 17, [2**31, 2**31], "9.0", "1.999"]),
    st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.lists(st.integers(min_value=-2**70, max_value=2**70), max_size=5),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc: Any, path: tuple, value: Any, delete: bool) -> None:
    for p in path[:-1]:
        doc = doc[p]
    if delete and isinstance(doc, dict):
        del doc[path[-1]]
    elif delete and isinstance(doc, list):
        doc.pop(path[-1])
    else:
        doc[path[-1]] = value


@st.composite
def hostile_manifests(draw: Any) -> bytes:
    b = base()
    step = draw(st.sampled_from([0, 1]))
    doc = json.loads(json.dumps(b.docs[step]))
    how = draw(st.sampled_from(["field", "field", "field", "fields", "delete", "duplicate", "truncate", "bytes",
                                "nesting", "nan"]))
    if how in ("field", "fields", "delete"):
        paths = _paths(doc)
        for _ in range(draw(st.integers(1, 4)) if how == "fields" else 1):
            path = draw(st.sampled_from(paths))
            try:
                _set(doc, path, draw(HOSTILE_VALUES), how == "delete")
            except (KeyError, IndexError, TypeError):
                pass
            paths = _paths(doc) or [("step",)]
        return json.dumps(doc).encode()
    text = json.dumps(doc)
    if how == "duplicate":
        key = draw(st.sampled_from(['"step":5', '"kind":"anchor"', '"tensors":[]', '"name":"w"', '"digest":"x"']))
        at = draw(st.sampled_from([i + 1 for i, c in enumerate(text) if c == "{"]))
        return (text[:at] + key + "," + text[at:]).encode()
    if how == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))].encode()
    if how == "nesting":
        depth = draw(st.integers(1000, 200000))
        return b"[" * depth + b"]" * draw(st.integers(0, depth))
    if how == "nan":
        return text.replace('"created":', '"created":NaN,"x":', 1).encode()
    return draw(st.binary(max_size=2000))


def manifest_case(data: bytes) -> None:
    """Parse; if it parses, commit it in a copy of the store and pull through it (fresh and following)."""
    def run() -> None:
        m = Manifest.from_json(data)
        b = base()
        uri = f"memory://hostile-{uuid.uuid4().hex}"
        store = ds.open_store(uri)
        for key in b.sub.store.backend.list(""):
            if not key.startswith("versions/"):
                store.backend.put(key, b.sub.store.backend.get(key))
        store.backend.put(version_key(0), b.sub.store.backend.get(version_key(0)))
        store.backend.put(version_key(m.step), data, mode="overwrite")
        sub = ds.Subscriber(store)
        target = sub.pull(step=0).state
        before = {k: v.clone() for k, v in target.items()}
        try:
            sub.pull(target, step=m.step)
        except DeltaStoreError:
            for k in before:
                if not torch.equal(before[k].view(torch.int16), target[k].view(torch.int16)):
                    raise AssertionError("a failed pull changed the target") from None
            raise
        sub.pull(step=m.step)

    _outcome("manifest", run)


def fuzz_manifests(n: int) -> None:
    @_settings(n)
    @given(hostile_manifests())
    def fuzz(data: bytes) -> None:
        manifest_case(data)

    fuzz()


# -- safetensors headers -----------------------------------------------------------------------------------
SPECS = [TensorSpec("b", torch.bfloat16, (48,)), TensorSpec("w", torch.bfloat16, (64, 48))]


@st.composite
def hostile_safetensors(draw: Any) -> tuple[str, bytes]:
    codec = draw(st.sampled_from(["raw", "dense"]))
    entries: dict[str, Any] = {}
    names = draw(st.lists(st.sampled_from(["w", "b", "w.indices", "w.values", "b.indices", "b.values", "../x", ""]),
                          max_size=5, unique=True))
    for name in names:
        entries[name] = {
            "dtype": draw(st.sampled_from(["BF16", "I32", "I64", "U8", "F32", "XYZ", "I16"])),
            "shape": draw(st.lists(st.integers(-4, 2**40).filter(lambda x: True), max_size=3)
                          | st.just([64, 48]) | st.just([10])),
            "data_offsets": draw(st.lists(st.integers(-10, 1 << 62) | st.integers(0, 400), min_size=2, max_size=2)
                                 | st.just([0, 20])),
        }
    entries["__metadata__"] = {"deltastore.codec": codec, "deltastore.codec_version": "1.0",
                               **draw(st.dictionaries(st.sampled_from(["deltastore.names", "format", "x"]),
                                                      st.text(max_size=20), max_size=2))}
    header = json.dumps(entries).encode()
    declared = draw(st.sampled_from([len(header), len(header), 1 << 60, 2**64 - 1, 0, len(header) + 7, 3]))
    payload = draw(st.binary(max_size=600))
    return codec, struct.pack("<Q", declared) + header + payload


def decode_case(codec: Any, data: bytes, old: Any = None) -> None:
    def run() -> None:
        get_codec(codec).decode(data, SPECS, old)

    _outcome("object", run)


def fuzz_safetensors(n: int) -> None:
    @_settings(n)
    @given(hostile_safetensors())
    def fuzz(case: tuple[str, bytes]) -> None:
        decode_case(case[0], case[1])

    fuzz()


# -- codec streams ---------------------------------------------------------------------------------------------
_ENCODED: dict[str, tuple[Any, bytes]] = {}


def _old(name: str, positions: torch.Tensor | None) -> torch.Tensor:
    flat = base().s0[name].view(torch.int16).reshape(-1)
    return flat if positions is None else flat[positions]


def encoded(i: int) -> tuple[Any, bytes]:
    """A valid object of codec ``CODECS[i]`` holding step 0 -> 1 of the base (dense: the whole tensors)."""
    key = json.dumps(CODECS[i])
    if key not in _ENCODED:
        b = base()
        codec = get_codec(CODECS[i])
        ups = []
        for spec in SPECS:
            old = b.s0[spec.name].view(torch.int16).reshape(-1)
            new = b.s1[spec.name].view(torch.int16).reshape(-1)
            if codec.dense:
                ups.append(Update(spec, new.clone()))
            else:
                pos = (old != new).nonzero().reshape(-1)
                ups.append(Update(spec, new[pos], pos, old[pos], old))
        _ENCODED[key] = (CODECS[i], codec.encode(ups))
    return _ENCODED[key]


def _bomb(declared: bool) -> bytes:
    """A frame of 1 GiB of zeros (a few KiB on the wire), declaring its size in the header or not."""
    size = 1 << 30
    cobj = zstandard.ZstdCompressor(level=3).compressobj(size=size if declared else -1)
    chunk = b"\0" * (1 << 20)
    return b"".join(cobj.compress(chunk) for _ in range(size // len(chunk))) + cobj.flush()


_BOMBS: dict[bool, bytes] = {}

# Every place a built-in codec's object holds a zstd frame: (codec, tensor or frame). dense keeps its frames
# inside a payload with an index: its first zstd frame is replaced, in an object of the current encoder and
# in the committed golden object of format 2.0 (still read).
BOMB_CASES = [("zstd", "positions"), ("ulp", "positions"), ("ulp", "plane0"), ("dense-planes", "first z frame"),
              ("dense-2.0", "first z frame")]
_BOMB_CODEC = {"zstd": 1, "ulp": 2, "dense-planes": 5}
GOLDEN = Path(__file__).resolve().parents[1] / "test_codecs" / "golden"


def _bomb_first_frame(frames: list[list[Any]], payload: bytes, bomb: bytes) -> bytes:
    """``payload`` (the frames of ``frames``, concatenated) with its first zstd frame replaced by ``bomb``;
    ``frames`` is updated in place."""
    out, off, done = [], 0, False
    for e in frames:
        chunk = payload[off:off + e[3]]
        off += e[3]
        if not done and e[4] == "z":
            chunk, e[3], done = bomb, len(bomb), True
        out.append(chunk)
    assert done, f"no zstd frame among {frames}"
    return b"".join(out)


def _dense_bomb(tensors: dict[str, torch.Tensor], meta: dict[str, str], bomb: bytes) -> dict[str, torch.Tensor]:
    """Replace the first zstd frame of a dense planes object (format 2.0 or 2.1); updates ``meta``'s index."""
    tensors = dict(tensors)
    if "deltastore.dense.groups" in meta:  # 2.1: one "frames" payload, groups of frames in order
        groups = json.loads(meta["deltastore.dense.groups"])
        frames = [e for g in groups for e in g["frames"]]
        payload = _bomb_first_frame(frames, tensors["frames"].numpy().tobytes(), bomb)
        tensors["frames"] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        meta["deltastore.dense.groups"] = json.dumps(groups)
        return tensors
    index = json.loads(meta["deltastore.dense"])  # 2.0: a payload per tensor
    name = next(n for n, frames in index.items() if any(e[4] == "z" for e in frames))
    payload = _bomb_first_frame(index[name], tensors[name].numpy().tobytes(), bomb)
    tensors[name] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    meta["deltastore.dense"] = json.dumps(index)
    return tensors


def golden_specs(case: str = "mixed") -> list[TensorSpec]:
    """The specs of a committed golden case (``tests/test_codecs/golden``)."""
    from safetensors import safe_open

    with safe_open(str(GOLDEN / f"{case}.expected.safetensors"), "pt") as f:
        meta = f.metadata()
    return [TensorSpec(n, getattr(torch, json.loads(v)[0]), tuple(json.loads(v)[1])) for n, v in sorted(meta.items())]


def bomb_object(case: tuple[str, str], declared: bool) -> tuple[Any, bytes, list[TensorSpec]]:
    """(codec, object, specs): a valid object of ``case``'s codec with one zstd frame replaced by a 1 GiB bomb.

    Raises ``AssertionError`` when that object holds no zstd frame there any more (the case would test nothing).
    """
    name, key = case
    bomb = _BOMBS.setdefault(declared, _bomb(declared))
    if name == "dense-2.0":
        codec, data, specs = {"id": "dense", "config": {"planes": True}}, (GOLDEN / "dense-2.0-planes-mixed.bin"
                                                                            ).read_bytes(), golden_specs()
    else:
        (codec, data), specs = encoded(_BOMB_CODEC[name]), SPECS
    c = get_codec(codec)
    tensors, meta = unpack_meta(data, c.codec_id)
    meta = dict(meta)
    if name.startswith("dense"):
        tensors = _dense_bomb(tensors, meta, bomb)
    else:
        t = tensors[key]
        assert t.dtype == torch.uint8 and bytes(t[:4].tolist()) == ZSTD_MAGIC, f"{name} {key} is not a zstd frame"
        tensors = dict(tensors, **{key: torch.frombuffer(bytearray(bomb), dtype=torch.uint8)})
    version = meta.pop("deltastore.codec_version")
    meta.pop("deltastore.codec", None)
    return codec, pack_meta(tensors, c.codec_id, version, meta), specs


@st.composite
def hostile_streams(draw: Any) -> tuple[Any, bytes]:
    codec, data = encoded(draw(st.integers(0, len(CODECS) - 1)))
    how = draw(st.sampled_from(["flip", "flip", "truncate", "varint", "splice", "bomb", "bomb"]))
    if how == "bomb":
        try:
            tensors, meta = unpack_meta(data, get_codec(codec).codec_id)
        except DeltaStoreError:
            return codec, data
        frames = [k for k, t in tensors.items() if t.dtype == torch.uint8 and bytes(t[:4].tolist()) == ZSTD_MAGIC]
        if not frames:
            how = "varint"
        else:
            declared = draw(st.booleans())
            if declared not in _BOMBS:
                _BOMBS[declared] = _bomb(declared)
            key = draw(st.sampled_from(frames))
            tensors = dict(tensors)
            tensors[key] = torch.frombuffer(bytearray(_BOMBS[declared]), dtype=torch.uint8)
            c = get_codec(codec)
            return codec, pack_meta(tensors, c.codec_id, c.format_version, meta)
    out = bytearray(data)
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            out[draw(st.integers(0, len(out) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        del out[draw(st.integers(0, len(out) - 1)):]
    elif how == "varint":  # a run of continuation bytes: a varint that never ends (or is far too long)
        at = draw(st.integers(0, len(out) - 1))
        k = draw(st.integers(1, 40))
        out[at:at + k] = b"\xff" * k
    else:
        at = draw(st.integers(0, len(out) - 1))
        out[at:at] = draw(st.binary(min_size=1, max_size=64))
    return codec, bytes(out)


def fuzz_streams(n: int) -> None:
    @_settings(n)
    @given(hostile_streams())
    def fuzz(case: tuple[Any, bytes]) -> None:
        decode_case(case[0], case[1], _old)

    fuzz()
