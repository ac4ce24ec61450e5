"""Anchors decoded straight into the target (``Codec.decode_into``): the same bits ``decode`` gives, no
decode buffer, destinations checked before anything is written, and an anchor pull that fails half-way
through a placed object still leaves the target at its last good bits."""

from __future__ import annotations

import errno
import uuid

import pytest
import numpy as np
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore.pull import tracking
from deltastore.codecs import TensorSpec, Update, get_codec
from deltastore.codecs import dense as dense_mod
from deltastore.codecs.base import decode_placed
from deltastore.codecs.dense import DenseCodec
from deltastore.errors import ApplyError, ChecksumMismatchError, CorruptObjectError
from deltastore.tensors import bits_view
from deltastore.pull import undo as undo_mod
from deltastore.pull.undo import UndoJournal

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool, torch.int8]


def _random(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g, dtype=torch.int64).to(dtype)


def _tensors(seed: int, n: int = 12) -> dict[str, torch.Tensor]:
    """Small (packed into shared groups) and large (chunked) tensors of mixed kinds, not flat."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (7, 300) if i % 3 else (3, 5, 2)
        out[f"layer.{i}.w"] = _random(dtype, shape, g)
    return out


def _encode(codec: DenseCodec, state: dict[str, torch.Tensor]) -> tuple[bytes, list[TensorSpec]]:
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in sorted(state.items())]
    ups = [Update(s, bits_view(state[s.name]).clone()) for s in specs]
    return codec.encode(ups), specs


@pytest.mark.parametrize("chunk", [64, 1 << 22])
def test_decode_into_writes_what_decode_returns(chunk):
    codec = DenseCodec(planes=True, chunk=chunk)
    state = _tensors(1)
    data, specs = _encode(codec, state)
    want = codec.decode(data, specs)
    dests = [torch.full(s.shape, 3, dtype=s.dtype) if s.dtype != torch.bool else torch.zeros(s.shape, dtype=s.dtype)
             for s in specs]
    assert codec.decode_into(data, specs, dests) is True
    for s, d in zip(specs, dests):
        assert torch.equal(bits_view(d), want[s.name].bits), s.name
        assert torch.equal(bits_view(d), bits_view(state[s.name])), s.name


@pytest.mark.parametrize("bad", ["numel", "width", "strided", "count"])
def test_decode_into_refuses_destinations_that_do_not_fit_before_writing(bad):
    codec = DenseCodec(planes=True)
    state = _tensors(2, n=4)
    data, specs = _encode(codec, state)
    dests = [torch.zeros(s.shape, dtype=s.dtype) for s in specs]
    if bad == "numel":
        dests[1] = torch.zeros(dests[1].numel() - 1, dtype=specs[1].dtype)
    elif bad == "width":
        dests[1] = torch.zeros(dests[1].numel(), dtype=torch.float64)
    elif bad == "strided":
        dests[1] = torch.zeros(dests[1].numel() * 2, dtype=specs[1].dtype)[::2]
    else:
        dests = dests[:-1]
    with pytest.raises(ValueError):
        codec.decode_into(data, specs, dests)
    assert all(not bits_view(d.contiguous()).any() for d in dests)


def test_decode_into_declines_formats_it_cannot_place():
    state = _tensors(3, n=4)
    data, specs = _encode(DenseCodec(planes=False), state)  # format 1.0: a plain safetensors file
    dests = [torch.zeros(s.shape, dtype=s.dtype) for s in specs]
    assert DenseCodec(planes=True).decode_into(data, specs, dests) is False
    assert all(not bits_view(d).any() for d in dests)
    assert get_codec("raw").decode_into(data, specs, dests) is False  # the base default


def test_decode_into_raises_a_typed_error_on_a_corrupt_frame():
    codec = DenseCodec(planes=True, chunk=64)
    data, specs = _encode(codec, _tensors(4))
    bad = bytearray(data)
    at = data.rindex(b"\x28\xb5\x2f\xfd")  # the last zstd frame's magic number
    bad[at + 4:at + 12] = bytes(8)  # its frame header: no declared size, so it is refused before decompressing
    with pytest.raises(CorruptObjectError):
        codec.decode_into(bytes(bad), specs, [torch.zeros(s.shape, dtype=s.dtype) for s in specs])
    other = [s if i else TensorSpec("not.in.object", s.dtype, s.shape) for i, s in enumerate(specs)]
    with pytest.raises(CorruptObjectError):
        codec.decode_into(data, other, [torch.zeros(s.shape, dtype=s.dtype) for s in other])


def test_a_subclass_overriding_only_decode_is_not_bypassed():
    seen = []

    class Spy(DenseCodec):
        def decode(self, data, specs, old=None):  # noqa: ANN001, ANN201
            seen.append(len(specs))
            return super().decode(data, specs, old)

    codec = Spy(planes=True)
    data, specs = _encode(codec, _tensors(5, n=3))
    dests = [torch.zeros(s.shape, dtype=s.dtype) for s in specs]
    assert decode_placed(codec, data, specs, dests) is False
    assert decode_placed(DenseCodec(planes=True), data, specs, dests) is True
    assert seen == []


def _store(uri: str, states: list[dict[str, torch.Tensor]]) -> None:
    with ds.Publisher(uri, anchor_every=100, max_object_bytes=6_000) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)


def _states(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    s0 = {f"t{i}": torch.randn(40, 50, generator=g).bfloat16() for i in range(8)}
    s1 = {k: (v.float() + 1e-2 * torch.randn(v.shape, generator=g)).bfloat16() for k, v in s0.items()}
    return [s0, s1]


def test_an_anchor_pull_decodes_into_the_target_without_a_buffer(monkeypatch):
    uri = f"memory://{uuid.uuid4().hex}"
    states = _states(6)
    _store(uri, states)
    sub = ds.Subscriber(uri)
    assert len(sub.manifest(0).full_objects) >= 3

    def no_buffer(n, width):  # noqa: ANN001, ANN202
        raise AssertionError("the anchor was decoded into a buffer, not into the target")

    monkeypatch.setattr(dense_mod, "_empty", no_buffer)
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    g = torch.Generator().manual_seed(1)
    target["t3"] = torch.randn(40, 50, generator=g).bfloat16()  # some tensors hold old bits, most zeros
    assert sub.pull(target, step=0).path == "anchor"
    assert bits_equal(target, states[0])
    assert sub.pull(target, step=1).path == "delta"
    assert bits_equal(target, states[1])


@pytest.mark.parametrize("failure", ["corrupt", "checksum"])
@pytest.mark.parametrize("journal_memory", [0, 1 << 30])
def test_an_anchor_pull_failing_inside_a_placed_object_restores_the_target(monkeypatch, failure, journal_memory):
    """The decoder writes half of the target's tensors, then fails (or writes wrong bits): every tensor
    goes back to its old bits (zeros, or what it held), the version is unknown, the next pull works."""
    uri = f"memory://{uuid.uuid4().hex}"
    states = _states(7)
    _store(uri, states)
    g = torch.Generator().manual_seed(2)
    target = {k: (torch.randn(v.shape, generator=g).bfloat16() if i % 2 else torch.zeros_like(v))
              for i, (k, v) in enumerate(states[0].items())}
    before = {k: v.clone() for k, v in target.items()}
    real = DenseCodec.decode_into
    calls = []

    def failing(self, data, specs, dests):  # noqa: ANN001, ANN202
        calls.append(len(specs))
        assert real(self, data, specs, dests)
        if len(calls) == 2:
            if failure == "corrupt":
                raise CorruptObjectError("dense: injected failure after writing the object")
            bits_view(dests[0])[0] ^= 1
        return True

    monkeypatch.setattr(DenseCodec, "decode_into", failing)
    sub = ds.Subscriber(uri, journal_memory=journal_memory)
    with pytest.raises(CorruptObjectError if failure == "corrupt" else ChecksumMismatchError):
        sub.pull(target, step=1)
    assert len(calls) == 2
    assert bits_equal(target, before)
    assert tracking.get_version(target) is None
    monkeypatch.setattr(DenseCodec, "decode_into", real)
    sub.pull(target, step=1)
    assert bits_equal(target, states[1])


@pytest.mark.parametrize("fail_at", [1, 2])
def test_an_anchor_pull_whose_undo_journal_cannot_write_restores_the_target(monkeypatch, tmp_path, fail_at):
    """The journal (saving one object ahead, on its own thread) meets a full disk at its first or a later
    object: a typed ApplyError naming the cause, every tensor back to its old bits, nothing claimed; the
    next pull works."""
    uri = f"memory://{uuid.uuid4().hex}"
    states = _states(8)
    _store(uri, states)
    g = torch.Generator().manual_seed(3)
    target = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in states[0].items()}
    before = {k: v.clone() for k, v in target.items()}
    real, calls = undo_mod._writev, []

    def full_disk(fd, iov):  # noqa: ANN001, ANN202
        calls.append(len(iov))
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "undo journal: No space left on device")
        return real(fd, iov)

    monkeypatch.setattr(undo_mod, "_writev", full_disk)
    sub = ds.Subscriber(uri, journal_dir=str(tmp_path), journal_memory=0)
    with pytest.raises(ApplyError, match="No space left") as err:
        sub.pull(target, step=1)
    assert err.value.restored is True
    assert len(calls) == fail_at
    assert bits_equal(target, before)
    assert tracking.get_version(target) is None
    monkeypatch.setattr(undo_mod, "_writev", real)
    assert sub.pull(target, step=1).path == "anchor"
    assert bits_equal(target, states[1])


def test_undo_journal_save_many_checks_zeros_in_one_pass_and_restores(tmp_path):
    g = torch.Generator().manual_seed(13)
    ts = [torch.zeros(300, dtype=torch.int16), torch.randint(-9, 9, (1000,), generator=g, dtype=torch.int16),
          torch.zeros(7, dtype=torch.int64), torch.randint(1, 9, (300,), generator=g, dtype=torch.int64),
          torch.zeros(0, dtype=torch.int16), torch.randint(0, 9, (77,), generator=g, dtype=torch.int32)]
    ts[1][500] = 0
    before = [t.clone() for t in ts]
    journal = UndoJournal(tmp_path, memory_bytes=2500)  # the first non-zero in memory, the others on disk
    journal.save_many(ts + ts[:2])  # saved once each
    journal.save(ts[3])
    assert len(journal) == 5  # the empty one costs nothing
    assert [kind for _, kind, _ in journal._entries].count("zeros") == 2
    for t in ts:
        t.fill_(7)
    assert journal.restore() == 0
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
    journal.close()


@pytest.mark.parametrize("memory_bytes", [0, 1500, 1 << 20])
def test_undo_journal_save_many_takes_the_targets_own_tensors_and_restores_their_bits(tmp_path, memory_bytes):
    """An anchor pull hands the journal the target's tensors as they are (any shape; floats and integers of
    one width side by side), not flat bit views of them: they are saved and put back bit for bit, in memory
    or in the file, NaN payloads and -0.0 included."""
    g = torch.Generator().manual_seed(15)
    ts = [torch.randn(6, 40, generator=g).bfloat16(), torch.randint(-99, 99, (3, 5, 7), generator=g, dtype=torch.int16),
          torch.zeros(4, 4, dtype=torch.float16), torch.randn(30, 9, generator=g).half(),
          torch.tensor([[float("nan"), -0.0], [float("inf"), 1e-40]], dtype=torch.bfloat16)]
    ts[4].view(torch.int16)[0, 0] = 0x7FC3  # a NaN with a payload
    before = [bits_view(t).clone() for t in ts]
    journal = UndoJournal(tmp_path, memory_bytes=memory_bytes)
    journal.save_many(ts)
    assert [kind for _, kind, _ in journal._entries].count("zeros") == 1
    for t in ts:
        bits_view(t).fill_(0x1234)
    assert journal.restore() == 0
    assert all(torch.equal(bits_view(t), b) and t.shape == s for t, b, s in
               zip(ts, before, [(6, 40), (3, 5, 7), (4, 4), (30, 9), (2, 2)]))
    journal.close()


@pytest.mark.parametrize("memory_bytes", [0, 3000, 1 << 20])
def test_undo_journal_save_many_writes_through_short_writes_exactly(tmp_path, monkeypatch, memory_bytes):
    """Tensors written to the file a few buffers per ``writev``, the kernel cutting every write short
    (as it may, e.g. near a full disk), a memory budget that ends inside the list: every tensor comes
    back bit for bit."""
    real = undo_mod._writev
    calls = []

    def short_writev(fd, iov):  # noqa: ANN001, ANN202
        calls.append(len(iov))
        cut = iov.copy()  # at most 700 bytes, as a kernel may cut a write
        budget = 700
        for row in cut:
            row[1] = min(int(row[1]), budget)
            budget -= int(row[1])
        return real(fd, np.ascontiguousarray(cut[cut[:, 1] > 0]))

    monkeypatch.setattr(undo_mod, "_IOV_MAX", 3)
    monkeypatch.setattr(undo_mod, "_writev", short_writev)
    g = torch.Generator().manual_seed(14)
    sizes = [3, 100, 600, 1, 511, 512, 2000, 7, 40, 900, 13]
    ts = [torch.randint(1, 999, (n,), generator=g, dtype=torch.int16) for n in sizes]
    ts.insert(4, torch.zeros(50, dtype=torch.int16))
    before = [t.clone() for t in ts]
    journal = UndoJournal(tmp_path, memory_bytes=memory_bytes)
    journal.save_many(ts)
    journal.save(torch.randint(1, 9, (400,), generator=g, dtype=torch.int64))  # a single save after them
    assert len(journal) == len(ts) + 1
    assert journal._in_memory <= memory_bytes
    if memory_bytes < 3000:
        assert calls and max(calls) <= 3
    if journal._file is not None:
        journal._file = _ShortReads(journal._file)  # and every read back cut short too
    for t in ts:
        t.fill_(-1)
    assert journal.restore() == 0
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
    journal.close()


class _ShortReads:
    """A file whose ``readinto`` returns at most 300 bytes a call, as a raw file may for big reads."""

    def __init__(self, f):  # noqa: ANN001
        self.f = f

    def readinto(self, b):  # noqa: ANN001, ANN201
        return self.f.readinto(memoryview(b)[:300])

    def __getattr__(self, name):  # noqa: ANN001, ANN204
        return getattr(self.f, name)


class _Tagged(torch.Tensor):
    """A tensor subclass: the pull writes it through torch ops, never by address."""


def test_an_anchor_pull_through_torch_ops_checks_every_checksum(monkeypatch):
    uri = f"memory://{uuid.uuid4().hex}"
    states = _states(8)
    _store(uri, states)
    target = {k: torch.zeros_like(v).as_subclass(_Tagged) for k, v in states[0].items()}
    real = DenseCodec.decode

    def lying(self, data, specs, old=None):  # noqa: ANN001, ANN202
        out = real(self, data, specs, old)
        out[specs[-1].name].bits[-1] ^= 1
        return out

    monkeypatch.setattr(DenseCodec, "decode", lying)
    sub = ds.Subscriber(uri)
    with pytest.raises(ChecksumMismatchError):
        sub.pull(target, step=0)
    assert all(not bits_view(v.as_subclass(torch.Tensor)).any() for v in target.values())
    monkeypatch.setattr(DenseCodec, "decode", real)
    sub.pull(target, step=0)
    assert bits_equal({k: v.as_subclass(torch.Tensor) for k, v in target.items()}, states[0])


def test_an_anchor_streamed_to_a_sink_hands_each_tensor_over_once_verified_and_keeps_none(tmp_path, monkeypatch):
    """What a resuming publisher uses to measure its drift: the anchor passes through, object by object."""
    from deltastore.pull import anchor as anchor_mod
    from deltastore.pull.anchor import stream_anchor

    state = _tensors(3)
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, max_object_bytes=1 << 14) as pub:  # many objects, some tensors split over several
        pub.publish(state, step=0)
    store = ds.open_store(uri)
    am = store.manifest(0)
    assert len(am.full_objects) > 3
    got: dict[str, torch.Tensor] = {}
    verified: set[str] = set()
    real_verify = anchor_mod._verify

    def verifying(m, names, where):  # noqa: ANN001, ANN202
        real_verify(m, names, where)
        verified.update(names)

    def sink(name: str, bits: torch.Tensor) -> None:
        assert name not in got and name in verified  # once, and only after its checksum was compared
        got[name] = bits.clone()

    monkeypatch.setattr(anchor_mod, "_verify", verifying)
    assert stream_anchor(store, am, workers=2, ahead=1, sink=sink) == {}
    assert set(got) == set(state)
    assert all(torch.equal(got[k], bits_view(v)) for k, v in state.items())


def test_undo_journal_writev_reports_the_systems_error(tmp_path):
    """The by-address ``writev`` raises ``OSError`` with the system's errno (a full disk is ENOSPC, a
    descriptor not open for writing EBADF), never a silent short count."""
    import errno

    path = tmp_path / "ro"
    path.write_bytes(b"x")
    buf = np.arange(16, dtype=np.uint8)
    iov = np.array([[buf.ctypes.data, buf.nbytes]], np.uint64)
    with open(path, "rb") as f, pytest.raises(OSError) as e:
        undo_mod._writev(f.fileno(), iov)
    assert e.value.errno == errno.EBADF
    with open(tmp_path / "w", "wb", buffering=0) as f:
        assert undo_mod._writev(f.fileno(), iov) == 16
    assert (tmp_path / "w").read_bytes() == buf.tobytes()
