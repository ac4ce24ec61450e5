"""The codec conformance suite: what every :class:`~deltastore.codecs.Codec` must do.

Use it from pytest by subclassing :class:`CodecConformance` and providing a
``codec`` fixture that returns the codec, configured as it will be used and
registered under its ``codec_id`` (readers rebuild it from the manifest by
name)::

    import pytest
    from deltastore.testing import CodecConformance

    class TestMyCodec(CodecConformance):
        @pytest.fixture
        def codec(self):
            return MyCodec(level=3)

Optional fixtures a subclass may override: ``entry_point`` (True when the
codec reaches the registry through an entry point of the group
``deltastore.codecs``, which is then checked too; default False),
``representative`` (the :class:`Change` list of one step of the data the
codec is made for, default :func:`representative_changes`: bf16 weights moved
by a few ulp), ``estimate_factor`` (how far ``estimate_size`` may be from the
bytes written on that data, default 2), ``fresh_process`` (False skips
re-encoding in a fresh interpreter, for a codec class that cannot be imported
by its dotted path there; default True) and ``decode_deadline`` (seconds one
hostile decode may take, default 10).

What is checked, following :mod:`deltastore.codecs.base` and ``docs/codecs.md``:

* round trip, bit for bit (integer views), on every dtype deltastore
  publishes (:data:`deltastore.tensors.DTYPES`): edge values (±0, ±inf, NaN
  payloads, subnormals, extremes, every transition between them), sign
  crossings, one- and multi-ulp and wrapping steps, changes at both ends,
  empty, 0-d, one-element, unchanged and wholly changed tensors, every dtype
  in one object, seeded random sizes and densities; through every path the
  library calls (``encode`` and ``encode_batch`` write the same bytes,
  ``decode`` and ``decode_batch`` the same updates, ``decode_into`` the same
  bits or nothing), with the encoder's inputs filled as ``needs_for`` asks,
  the receiver asked only what ``receiver_needs`` declares, and no input or
  old tensor modified;
* byte-stable output: the same input gives the same bytes twice, from other
  memory, from a codec rebuilt from its manifest record, and in a fresh
  interpreter with another hash seed; every object a safetensors file;
* ``estimate_size``: an integer ``>= 0`` for every spec, and on
  representative data within ``estimate_factor`` of the bytes written;
* config: ``get_config`` survives JSON, ``describe()`` rebuilds an equal
  codec through :func:`~deltastore.codecs.get_codec`, an unknown option is
  :class:`~deltastore.errors.ManifestError`, another major version
  :class:`~deltastore.errors.UnsupportedFormatError`;
* registration: the registry (and, with ``entry_point``, the entry point)
  gives the codec's class under its ``codec_id``;
* bomb-safe decode: truncated, extended, garbage and oversized-header
  objects raise :class:`~deltastore.errors.CorruptObjectError` (or
  :class:`~deltastore.errors.UnsupportedFormatError`); bit flips, length
  fields overwritten with huge values, inflated numbers in the header
  metadata and zstd bombs in place of byte streams either raise one of those
  or decode; each within ``decode_deadline`` and allocating no more than
  ``4 x (object bytes + the specs' output bytes) + 16 MiB`` (peak resident
  memory and :mod:`tracemalloc`);
* a Publisher and Subscriber through a local store with the codec (as the
  delta codec, or as the anchor codec for a dense one), every version bit-exact.

Each check is a plain function too (``check_*``), for use outside pytest.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import operator
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import numpy as np
import pytest
import torch

from ..codecs import Codec, TensorSpec, Update, UpdateBatch, get_codec
from ..codecs.base import decode_batched, decode_placed, encode_batched
from ..errors import CorruptObjectError, ManifestError, UnsupportedFormatError
from ..tensors import DTYPE_NAMES, DTYPES, bits_dtype
from .bits import bits_equal
from .codec_cases import (Change, edge_cases, mixed_case, random_cases, representative_changes, small_case,
                          updates_for)
from .hostile_objects import MiB, DecodeMeter, bombs, hostile_objects, safetensors_parts

#: what a decoder may raise for bytes it cannot decode
DECODE_ERRORS = (CorruptObjectError, UnsupportedFormatError)


def _batch(updates: Sequence[Update]) -> UpdateBatch | None:
    """The updates as one flat :class:`UpdateBatch` (as the Publisher hands a compare's group), or None when
    they are not of one bits dtype."""
    if not updates or len({u.bits.dtype for u in updates}) != 1:
        return None
    bounds = np.zeros(len(updates) + 1, dtype=np.int64)
    np.cumsum([u.count for u in updates], out=bounds[1:])
    return UpdateBatch([u.spec for u in updates], torch.cat([u.positions for u in updates]), bounds,  # type: ignore[misc]
                       torch.cat([u.bits for u in updates]), torch.cat([u.old_bits for u in updates]),  # type: ignore[misc]
                       {u.spec.name: u.old_tensor for u in updates if u.old_tensor is not None})


# -- comparing ------------------------------------------------------------------------------------------------
def _expect(codec: Codec, c: Change, positions: torch.Tensor | None, bits: torch.Tensor, how: str) -> None:
    name, want = c.spec.name, c.spec.bits_dtype
    assert bits.dtype == want, f"{how}: {name!r} decoded as {bits.dtype}, expected its bits dtype {want}"
    if codec.dense:
        assert positions is None, f"{how}: a dense codec returned positions for {name!r}"
        assert bits_equal(bits, c.new()), f"{how}: {name!r} ({c.spec.dtype}, {c.spec.shape}) differs from the input"
        return
    assert positions is not None, f"{how}: a sparse codec returned {name!r} without positions"
    assert positions.dtype == torch.int64, f"{how}: {name!r} positions are {positions.dtype}, not int64"
    assert bits_equal(positions, c.positions), f"{how}: {name!r} ({c.spec.dtype}) decoded other positions"
    assert bits_equal(bits, c.bits), f"{how}: {name!r} ({c.spec.dtype}, {c.spec.shape}) decoded other bits"


class _Receiver:
    """The receiver's side of a decode: the old bits of ``changes``, handed out as ``receiver_needs`` allows.

    Calling it is the plain :data:`~deltastore.codecs.OldBits`; :meth:`many` is the one-call form a library
    receiver offers. What the codec should not have asked is recorded (not raised, so that a decoder
    cannot turn it into another error) and reported by :meth:`assert_honest`, with any change to the old
    tensors the decoder was handed.
    """

    def __init__(self, codec: Codec, changes: Sequence[Change]):
        self.needs = codec.receiver_needs
        self.old = {c.spec.name: c.old.clone() for c in changes}
        self.pristine = {c.spec.name: c.old for c in changes}
        self.wrong: list[str] = []

    def __call__(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        if name not in self.old:
            self.wrong.append(f"asked for {name!r}, which is not in the object")
            raise KeyError(name)
        if self.needs == "nothing":
            self.wrong.append(f"asked for old bits of {name!r} but declares receiver_needs='nothing'")
        if positions is None:
            if self.needs != "old_tensor":
                self.wrong.append(f"asked for the whole old {name!r} but declares receiver_needs={self.needs!r}")
            return self.old[name]
        return self.old[name][positions]

    def plain(self) -> Callable[[str, torch.Tensor | None], torch.Tensor]:
        return lambda name, positions: self(name, positions)

    def many(self, names: list[str], positions: torch.Tensor, bounds: np.ndarray) -> torch.Tensor:
        b = bounds.tolist()
        parts = [self(n, positions[b[i]:b[i + 1]]).reshape(-1) for i, n in enumerate(names)]
        return torch.cat(parts) if parts else positions.new_empty(0)

    def assert_honest(self, how: str) -> None:
        assert not self.wrong, f"{how}: the decoder {self.wrong[0]}" + (f" (and {len(self.wrong) - 1} more)"
                                                                        if len(self.wrong) > 1 else "")
        for name, t in self.old.items():
            assert bits_equal(t, self.pristine[name]), f"{how}: the decoder modified the receiver's old {name!r}"


def _snapshot(updates: Sequence[Update]) -> list[tuple[torch.Tensor | None, ...]]:
    return [tuple(None if t is None else t.clone() for t in (u.bits, u.positions, u.old_bits, u.old_tensor))
            for u in updates]


def _assert_untouched(updates: Sequence[Update], before: list[tuple[torch.Tensor | None, ...]], how: str) -> None:
    for u, was in zip(updates, before):
        for field, now, then in zip(("bits", "positions", "old_bits", "old_tensor"),
                                    (u.bits, u.positions, u.old_bits, u.old_tensor), was):
            assert (now is None) == (then is None) and (now is None or bits_equal(now, then)), \
                f"{how} modified the input's {field} of {u.spec.name!r}"


# -- checks (plain functions) ---------------------------------------------------------------------------------
def check_roundtrip(codec: Codec, changes: Sequence[Change]) -> bytes:
    """``changes`` through every path the library calls, bit-exact; returns the object's bytes.

    ``encode`` (and ``encode_batch`` for one bits dtype, the same bytes), then ``decode`` with a plain
    receiver and the specs in another order, ``decode_batch`` (sparse) with a receiver offering ``many``,
    ``decode_into`` (dense: the same bits, or False with nothing written; a destination that does not fit
    is ``ValueError``). Fails when an encoder modifies its inputs, or a decoder asks the receiver for more
    than ``receiver_needs`` or modifies what it was handed.
    """
    ups = updates_for(codec, changes)
    before = _snapshot(ups)
    data = codec.encode(ups)
    assert isinstance(data, bytes), f"encode returned {type(data).__name__}, not bytes"
    _assert_untouched(ups, before, "encode")
    batch = None if codec.dense else _batch(ups)
    if batch is not None:
        assert encode_batched(codec, batch) == data, "encode_batch wrote other bytes than encode"
        _assert_untouched(ups, before, "encode_batch")
    by_name = {c.spec.name: c for c in changes}
    assert len(by_name) == len(changes), "conformance input with a repeated name"
    specs = [c.spec for c in changes][::-1]  # not the encoder's order: decoders look tensors up by name
    receiver = _Receiver(codec, changes)
    got = codec.decode(data, specs, receiver.plain())
    assert set(got) == set(by_name), f"decode returned {sorted(got)[:5]}, expected {sorted(by_name)[:5]}"
    for name, u in got.items():
        _expect(codec, by_name[name], u.positions, u.bits, "decode")
    receiver.assert_honest("decode")
    if codec.dense:
        _check_placed(codec, data, changes)
        return data
    receiver = _Receiver(codec, changes)
    seen: list[str] = []
    for b in decode_batched(codec, data, specs, receiver):
        assert isinstance(b, UpdateBatch), f"decode_batch returned a {type(b).__name__} (no in-place target offered)"
        assert b.bounds.shape == (len(b.specs) + 1,) and int(b.bounds[0]) == 0, "decode_batch: malformed bounds"
        assert int(b.bounds[-1]) == b.positions.numel() == b.bits.numel(), "decode_batch: bounds do not cover it"
        assert np.all(np.diff(b.bounds) >= 0), "decode_batch: decreasing bounds"
        for u in b.updates():
            seen.append(u.spec.name)
            _expect(codec, by_name[u.spec.name], u.positions, u.bits, "decode_batch")
    assert sorted(seen) == sorted(by_name), "decode_batch did not return every tensor exactly once"
    receiver.assert_honest("decode_batch")
    return data


def _check_placed(codec: Codec, data: bytes, changes: Sequence[Change]) -> None:
    fill = 0xA5

    def dests(short: int = 0) -> list[torch.Tensor]:
        return [torch.full((max(0, c.spec.numel - short) * c.spec.bits_dtype.itemsize,), fill, dtype=torch.uint8)
                .view(c.spec.bits_dtype) for c in changes]

    specs = [c.spec for c in changes]
    out = dests()
    if not decode_placed(codec, data, specs, out):
        assert all(bool((d.view(torch.uint8) == fill).all()) for d in out), "decode_into returned False but wrote"
        return
    for c, d in zip(changes, out):
        _expect(codec, c, None, d, "decode_into")
    if any(s.numel for s in specs):
        bad = dests(short=1)
        with pytest.raises(ValueError):
            decode_placed(codec, data, specs, bad)
        assert all(bool((d.view(torch.uint8) == fill).all()) for d in bad), "decode_into wrote into a misfit"


def check_edge_values(codec: Codec, dtype: torch.dtype) -> None:
    """:func:`check_roundtrip` of every :func:`edge_cases` object of ``dtype``."""
    for name, changes in edge_cases(dtype).items():
        try:
            check_roundtrip(codec, changes)
        except AssertionError as e:
            raise AssertionError(f"{DTYPE_NAMES[dtype]} {name}: {e}") from e


def check_random(codec: Codec, dtype: torch.dtype, rounds: int = 8, seed: int = 0) -> None:
    """:func:`check_roundtrip` of ``rounds`` :func:`random_cases` objects of ``dtype``."""
    for i, changes in enumerate(random_cases(dtype, rounds, seed)):
        try:
            check_roundtrip(codec, changes)
        except AssertionError as e:
            c = changes[0]
            raise AssertionError(f"{DTYPE_NAMES[dtype]} random case {i} (seed {seed}; shape {c.spec.shape}, "
                                 f"{c.positions.numel()} changed): {e}") from e


def check_mixed_object(codec: Codec) -> None:
    """:func:`check_roundtrip` of one object holding every dtype (:func:`mixed_case`), then of each group of
    its dtypes that share a bits dtype (bf16, fp16 and int16; the 1-byte ones), as ``encode_batch`` gets
    them from the Publisher."""
    changes = mixed_case()
    check_roundtrip(codec, changes)
    groups: dict[torch.dtype, list[Change]] = {}
    for c in changes:
        groups.setdefault(c.spec.bits_dtype, []).append(c)
    for group in groups.values():
        if len(group) > 1:
            check_roundtrip(codec, group)


def _stable_cases() -> list[list[Change]]:
    cases = edge_cases(torch.bfloat16)
    return [cases["steps"], cases["shapes"], mixed_case(), representative_changes()]


def _copies(changes: Sequence[Change]) -> list[Change]:
    return [Change(c.spec, c.old.clone(), c.positions.clone(), c.bits.clone()) for c in changes]


def check_byte_stable(codec: Codec, fresh_process: bool = True) -> None:
    """The same input encodes to the same bytes: twice, from copies in other memory, with the codec rebuilt
    from its manifest record, and (``fresh_process``: :func:`check_fresh_process`) in a fresh interpreter
    (content addressing stores an object once only if its bytes depend on its contents alone)."""
    rebuilt = get_codec(json.loads(json.dumps(codec.describe())))
    for changes in _stable_cases():
        data = codec.encode(updates_for(codec, changes))
        assert codec.encode(updates_for(codec, changes)) == data, "two encodes of one input differ"
        assert codec.encode(updates_for(codec, _copies(changes))) == data, "a copy of the input encodes otherwise"
        assert rebuilt.encode(updates_for(rebuilt, changes)) == data, \
            "the codec rebuilt from its manifest record (describe) encodes otherwise"
    if fresh_process:
        check_fresh_process([codec])


def check_fresh_process(codecs: Sequence[Codec]) -> None:
    """Each of ``codecs`` encodes the byte-stability inputs to the same bytes in one fresh interpreter, with
    another ``PYTHONHASHSEED``, as here (its class imported there by its dotted path, built from its
    config). One interpreter for them all: a test of several codecs pays its start once."""
    from safetensors.torch import save_file

    paths = []
    for codec in codecs:
        cls = type(codec)
        paths.append(f"{cls.__module__}:{cls.__qualname__}")
        assert "<locals>" not in cls.__qualname__ and cls.__module__ != "__main__", (
            f"{paths[-1]} cannot be imported in a fresh interpreter: define the codec class at module level, "
            "or override the `fresh_process` fixture to return False")
    cases = _stable_cases()
    here = [hashlib.sha256(codec.encode(updates_for(codec, changes))).hexdigest()
            for codec in codecs for changes in cases]
    with tempfile.TemporaryDirectory() as tmp:
        tensors, layout = {}, []
        for i, changes in enumerate(cases):
            layout.append([[c.spec.name, DTYPE_NAMES[c.spec.dtype], list(c.spec.shape)] for c in changes])
            for j, c in enumerate(changes):
                tensors.update({f"{i}.{j}.old": c.old, f"{i}.{j}.positions": c.positions, f"{i}.{j}.bits": c.bits})
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "cases.safetensors"))
        with open(os.path.join(tmp, "cases.json"), "w") as f:
            json.dump({"codecs": [[path, codec.get_config()] for path, codec in zip(paths, codecs)],
                       "cases": layout}, f)
        seed = "0" if os.environ.get("PYTHONHASHSEED") != "0" else "1"
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        run = subprocess.run([sys.executable, "-c", "import sys; from deltastore.testing.codecs import "
                              "_encode_cases as e; e(sys.argv[1])", tmp], env=env, capture_output=True, text=True,
                             timeout=600)
    assert run.returncode == 0, f"the fresh interpreter failed:\n{run.stderr[-3000:]}"
    there = run.stdout.split()
    for k, (a, b) in enumerate(zip(here, there)):
        assert a == b, f"{paths[k // len(cases)]} ({codecs[k // len(cases)].describe()}) encodes input " \
                       f"{k % len(cases)} to other bytes in a fresh interpreter (PYTHONHASHSEED={seed})"
    assert len(there) == len(here), f"the fresh interpreter printed {run.stdout!r}"


def _encode_cases(folder: str) -> None:
    """(In the fresh interpreter of :func:`check_fresh_process`.) Print the sha256 of each case's object, for
    each codec in turn."""
    from safetensors.torch import load_file

    with open(os.path.join(folder, "cases.json")) as f:
        doc = json.load(f)
    t = load_file(os.path.join(folder, "cases.safetensors"))
    cases = [[Change(TensorSpec(name, DTYPES[dtype], tuple(shape)), t[f"{i}.{j}.old"], t[f"{i}.{j}.positions"],
                     t[f"{i}.{j}.bits"]) for j, (name, dtype, shape) in enumerate(layout)]
             for i, layout in enumerate(doc["cases"])]
    for path, config in doc["codecs"]:
        module, _, qual = path.partition(":")
        cls: Any = importlib.import_module(module)
        for part in qual.split("."):
            cls = getattr(cls, part)
        codec = cls.from_config(config)
        for changes in cases:
            print(hashlib.sha256(codec.encode(updates_for(codec, changes))).hexdigest())


def check_safetensors(codec: Codec) -> None:
    """Every object is a safetensors file (what crosses the store is safetensors and JSON, never pickle)."""
    from safetensors import deserialize

    for changes in _stable_cases():
        data = codec.encode(updates_for(codec, changes))
        try:
            deserialize(data)
        except Exception as e:  # noqa: BLE001 - the parser's own error type
            raise AssertionError(f"the object is not a safetensors file: {e}") from e


def check_estimate(codec: Codec, representative: Sequence[Change], factor: float = 2.0) -> None:
    """``estimate_size`` is an integer ``>= 0`` for every spec of the edge cases (any dtype, empty, 0-d), and
    on ``representative`` the estimates summed are within ``factor`` of the bytes written (the Publisher
    compares them to choose between sparse and whole)."""
    for dtype in DTYPES.values():
        for changes in edge_cases(dtype).values():
            for c in changes:
                for changed in {0, c.positions.numel(), c.spec.numel}:
                    got = codec.estimate_size(c.spec, changed)
                    assert operator.index(got) >= 0, f"estimate_size({c.spec}, {changed}) = {got!r}"
    real = len(codec.encode(updates_for(codec, representative)))
    estimate = sum(codec.estimate_size(c.spec, c.positions.numel()) for c in representative)
    assert real / factor <= estimate <= real * factor, \
        f"estimated {estimate} bytes, wrote {real}: not within {factor}x"


def check_config(codec: Codec) -> None:
    """The manifest's record of the codec (``describe()``: id, version, config) survives JSON and rebuilds an
    equal codec through :func:`~deltastore.codecs.get_codec`; an unknown option is :class:`ManifestError`."""
    cfg = codec.get_config()
    assert isinstance(cfg, dict) and json.loads(json.dumps(cfg)) == cfg, f"get_config() is not plain JSON: {cfg!r}"
    record = codec.describe()
    assert set(record) == {"id", "version", "config"} and record["config"] == cfg, f"describe() gave {record!r}"
    assert record["id"] == codec.codec_id and isinstance(codec.codec_id, str) and codec.codec_id
    version = record["version"]
    assert isinstance(version, str) and len(version.split(".")) == 2 and all(p.isdigit() for p in
                                                                            version.split(".")), version
    assert type(codec).reads_major(version.split(".")[0]), f"the codec cannot read the format {version} it writes"
    rebuilt = get_codec(json.loads(json.dumps(record)))
    assert type(rebuilt) is type(codec) and rebuilt.describe() == record, f"{record} rebuilt {rebuilt.describe()}"
    assert type(codec).from_config(cfg).describe() == record, "from_config(get_config()) describes otherwise"
    with pytest.raises(ManifestError):
        get_codec({**record, "config": {**cfg, "no_such_option_of_any_codec": 1}})


def check_format_versions(codec: Codec) -> None:
    """A record naming a newer minor version is accepted (the object decides), each ``readable_majors`` too;
    a major the class does not read is :class:`UnsupportedFormatError`."""
    cls = type(codec)
    base = {"id": codec.codec_id, "config": codec.get_config()}
    majors = [int(v.split(".")[0]) for v in (codec.describe()["version"], cls.format_version)]
    majors += [int(m) for m in cls.readable_majors]
    for major in {*majors}:
        get_codec({**base, "version": f"{major}.99"})
    with pytest.raises(UnsupportedFormatError):
        get_codec({**base, "version": f"{max(majors) + 1}.0"})


def check_registered(codec: Codec, entry_point: bool = False) -> None:
    """The registry gives the codec's class under its ``codec_id``; with ``entry_point``, through one entry
    point of the group ``deltastore.codecs``, which the registry lists as the codec's origin."""
    from ..registry import codecs as registry

    cid = codec.codec_id
    assert cid in registry.names(), f"{cid!r} is not registered (register_codec or an entry point)"
    assert registry.get(cid) is type(codec), f"{cid!r} is registered as {registry.get(cid)}, not {type(codec)}"
    if entry_point:
        eps = [ep for ep in metadata.entry_points(group=registry.group) if ep.name == cid]
        assert len(eps) == 1, f"{len(eps)} entry points named {cid!r} in {registry.group}"
        assert eps[0].load() is type(codec), f"the entry point {eps[0].value} loads another class"
        origin = next(p.origin for p in registry.describe() if p.name == cid)
        assert origin.startswith("entry point"), f"the registry holds {cid!r} from {origin}, not the entry point"


def _sample(codec: Codec) -> tuple[bytes, list[Change]]:
    """:func:`small_case`'s object, round-tripped, and its changes."""
    changes = small_case()
    return check_roundtrip(codec, changes), changes


def _allowance(data: bytes, specs: Sequence[TensorSpec]) -> int:
    out = sum(s.numel * (s.bits_dtype.itemsize + 8) for s in specs)  # bits + int64 positions per element
    return 4 * (len(data) + out) + 16 * MiB


def _decode_each(codec: Codec, cases: dict[str, bytes], specs: list[TensorSpec], receiver: _Receiver,
                 deadline: float, must_refuse: bool) -> None:
    meter = DecodeMeter(deadline)
    try:
        for what, data in cases.items():
            limit = _allowance(data, specs)
            for attempt in range(2):  # a second try where the first paid a first-use cost (a lazy import)
                error, grew = meter.run(lambda: codec.decode(data, specs, receiver.plain()), what)
                if grew <= limit:
                    break
            assert grew <= limit, f"{what}: decoding {len(data)} bytes grew memory by {grew / MiB:.1f} MiB " \
                                  f"(allowed {limit / MiB:.1f} MiB)"
            if error is not None and not isinstance(error, DECODE_ERRORS):
                raise AssertionError(f"{what}: untyped {type(error).__name__}: {error}") from error
            if must_refuse:
                assert error is not None, f"{what}: decoded without an error"
    finally:
        meter.close()


def check_refuses_bad_objects(codec: Codec, deadline: float = 10.0) -> None:
    """Truncated objects (to every length class), bytes appended, garbage, and a safetensors header length
    past the end or huge: each a typed error (:data:`DECODE_ERRORS`), in bounded time and memory."""
    data, changes = _sample(codec)
    specs, receiver = [c.spec for c in changes], _Receiver(codec, changes)
    rng = np.random.default_rng(0)
    cases = {f"truncated to {n} of {len(data)} bytes": data[:n]
             for n in sorted({0, 1, 7, 8, 9, 16, 64, len(data) // 2, len(data) - 8, len(data) - 1}) if 0 <= n < len(data)}
    cases.update({"one byte appended": data + b"\0", "1 KiB appended": data + rng.bytes(1024),
                  "64 zero bytes": bytes(64), "zeros of the object's length": bytes(len(data)),
                  "random bytes of the object's length": rng.bytes(len(data))})
    if safetensors_parts(data) is not None:
        for n in (len(data), 2**40, 2**63 - 1, 2**64 - 1):
            cases[f"header length {n}"] = n.to_bytes(8, "little") + data[8:]
    _decode_each(codec, cases, specs, receiver, deadline, must_refuse=True)
    receiver.assert_honest("decoding bad objects")


def check_hostile_objects(codec: Codec, deadline: float = 10.0) -> None:
    """Every :func:`hostile_objects` variant of a real object either decodes or raises a typed error
    (:data:`DECODE_ERRORS`), in bounded time and memory (see :class:`CodecConformance`). What a variant
    decodes to is not judged: the library validates every decoded update against the manifest. Decoded
    against a manifest naming other tensors (one renamed, one missing, one more), the object gives a typed
    error or updates for exactly the tensors named."""
    data, changes = _sample(codec)
    specs, receiver = [c.spec for c in changes], _Receiver(codec, changes)
    _decode_each(codec, hostile_objects(data, bombs()), specs, receiver, deadline, must_refuse=False)
    receiver.assert_honest("decoding hostile objects")
    w = specs[0]
    unknown = [TensorSpec("not." + w.name, w.dtype, w.shape), TensorSpec("extra", torch.float16, (7,))]
    held = {s.name: torch.zeros(s.numel, dtype=s.bits_dtype) for s in unknown}  # the receiver holds them too
    receiver = _Receiver(codec, [*changes, *(Change.between(s, held[s.name], held[s.name]) for s in unknown)])
    for what, other in {"one tensor renamed": [unknown[0], *specs[1:]], "one tensor missing": specs[1:],
                        "one tensor more": [*specs, unknown[1]]}.items():
        try:
            got = codec.decode(data, other, receiver.plain())
        except DECODE_ERRORS:
            continue
        except Exception as e:  # noqa: BLE001 - reported
            raise AssertionError(f"decoded against a manifest with {what}: untyped {type(e).__name__}: {e}") from e
        assert set(got) == {s.name for s in other}, \
            f"decoded against a manifest with {what}: returned {sorted(got)}, not {sorted(s.name for s in other)}"


def _training_states(steps: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {"layer.weight": (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16),
             "layer.bias": torch.randn(48, generator=g), "layer.scale": torch.randn(16, generator=g).half(),
             "layer.q": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
             "counter": torch.arange(3, dtype=torch.int64), "mask": torch.rand(32, generator=g) < 0.5}
    out = []
    for _ in range(steps):
        state = {k: v.clone() for k, v in state.items()}
        w = state["layer.weight"].view(torch.int16)
        w[torch.rand(w.shape, generator=g) < 0.05] += 1
        state["layer.bias"][:3] += 1e-3
        state["layer.scale"][-2:] *= -1
        state["layer.q"].view(torch.uint8)[5:7] ^= 1
        state["counter"] += 1
        state["mask"][::7] = ~state["mask"][::7]
        out.append(state)
    return out


def check_publish_pull(codec: Codec) -> None:
    """A Publisher with the codec (sparse: the delta codec; dense: the anchor codec) and Subscribers through
    a local store: a follower one delta behind and a fresh reader get every version bit-exact, and the
    manifests record the codec so that it rebuilds as it was."""
    import deltastore as ds

    states = _training_states()
    role = {"anchor_codec": codec} if codec.dense else {"codec": codec}
    with tempfile.TemporaryDirectory() as uri:
        with ds.Publisher(uri, anchor_every=100, **role) as pub:
            for step, s in enumerate(states):
                pub.publish(s, step=step)
        sub = ds.Subscriber(uri)
        target = sub.pull(step=0).state
        for step, want in enumerate(states):
            result = sub.pull(target, step=step, allow_anchor=False) if step else sub.pull(target, step=0)
            if step:
                assert result.path == "delta", f"step {step} pulled by {result.path!r}"
            for name, t in want.items():
                assert bits_equal(target[name].view(bits_dtype(t.dtype)), t.view(bits_dtype(t.dtype))), (step, name)
        fresh = ds.Subscriber(uri).pull().state
        assert all(bits_equal(fresh[k].view(bits_dtype(t.dtype)), t.view(bits_dtype(t.dtype)))
                   for k, t in states[-1].items())
        records = [o.codec for step in range(len(states)) for o in sub.manifest(step).objects
                   if o.codec["id"] == codec.codec_id]
        assert records, f"no object of the published versions was written with {codec.codec_id!r}"
        for r in records:
            assert get_codec(r).describe() == codec.describe(), f"the manifest records {r}"


class CodecConformance:
    """pytest mix-in: subclass it and provide a ``codec`` fixture (the codec, registered under its id)."""

    @pytest.fixture
    def codec(self) -> Codec:  # pragma: no cover - must be overridden
        raise NotImplementedError("subclasses provide a `codec` fixture returning the codec to check")

    @pytest.fixture
    def entry_point(self) -> bool:
        return False

    @pytest.fixture
    def representative(self) -> list[Change]:
        return representative_changes()

    @pytest.fixture
    def estimate_factor(self) -> float:
        return 2.0

    @pytest.fixture
    def fresh_process(self) -> bool:
        return True

    @pytest.fixture
    def decode_deadline(self) -> float:
        return 10.0

    @pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
    def test_edge_values(self, codec: Codec, dtype: torch.dtype) -> None:
        check_edge_values(codec, dtype)

    @pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
    def test_random_roundtrip(self, codec: Codec, dtype: torch.dtype) -> None:
        check_random(codec, dtype)

    def test_every_dtype_in_one_object(self, codec: Codec) -> None:
        check_mixed_object(codec)

    def test_byte_stable(self, codec: Codec, fresh_process: bool) -> None:
        check_byte_stable(codec, fresh_process)

    def test_objects_are_safetensors(self, codec: Codec) -> None:
        check_safetensors(codec)

    def test_estimate_size(self, codec: Codec, representative: list[Change], estimate_factor: float) -> None:
        check_estimate(codec, representative, estimate_factor)

    def test_config_roundtrip(self, codec: Codec) -> None:
        check_config(codec)

    def test_format_versions(self, codec: Codec) -> None:
        check_format_versions(codec)

    def test_registered(self, codec: Codec, entry_point: bool) -> None:
        check_registered(codec, entry_point)

    def test_bad_objects_are_refused(self, codec: Codec, decode_deadline: float) -> None:
        check_refuses_bad_objects(codec, decode_deadline)

    def test_hostile_objects_are_bounded(self, codec: Codec, decode_deadline: float) -> None:
        check_hostile_objects(codec, decode_deadline)

    def test_publish_and_pull(self, codec: Codec) -> None:
        check_publish_pull(codec)


__all__ = ["DECODE_ERRORS", "Change", "CodecConformance", "check_byte_stable", "check_config", "check_edge_values",
           "check_estimate", "check_format_versions", "check_fresh_process", "check_hostile_objects",
           "check_mixed_object", "check_publish_pull", "check_random", "check_refuses_bad_objects",
           "check_registered", "check_roundtrip", "check_safetensors", "representative_changes", "updates_for"]
