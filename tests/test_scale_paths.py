"""The publish and pull paths built for scale: the flat mirror and its fused compare kernel, background
capture against one mirror, anchors streamed into live targets with an undo journal, many small tensors.

Everything is checked bit for bit (integer views) against the plain per-tensor reference paths.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore import segments
from deltastore.pull import tracking
from deltastore.pull.staging import SparseOverlay, mapping_reader
from deltastore.backends.memory import MemoryBackend
from deltastore.checksum import full_checksum, sparse_sum, tensor_key
from deltastore.codecs import TensorSpec
from deltastore.publish.diff import find_changes
from deltastore.errors import ApplyError, CorruptObjectError
from deltastore.publish.mirror import Mirror, Pending
from deltastore.store import DeltaStore, object_key
from deltastore.tensors import bits_view
from deltastore.pull.undo import UndoJournal

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]


def _random(dtype, n, g):
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (n,), generator=g, dtype=torch.int64).to(dtype)


def _perturb(t, density, g):
    """A copy of ``t`` with about ``density`` of its elements' bits changed (some by exactly one bit pattern)."""
    b = bits_view(t.clone())
    mask = torch.rand(b.numel(), generator=g) < density
    if b.dtype == torch.uint8:
        b[mask] ^= 1
    else:
        b[mask] += 1
    return b.view(t.dtype).reshape(t.shape)


def _reference(old_bits, new):
    """The plain torch compare (independent of the kernels): positions, new bits, old bits."""
    n = bits_view(new.contiguous())
    pos = torch.ne(old_bits, n).nonzero().squeeze(1)
    return type("Ref", (), {"positions": pos, "new_bits": n[pos], "old_bits": old_bits[pos]})


def _sum_delta(name, ch):
    k = tensor_key(name)
    return (sparse_sum(k, ch.positions, ch.new_bits) - sparse_sum(k, ch.positions, ch.old_bits)) % 2**64


@pytest.mark.parametrize("density", [0.0, 0.003, 0.05, 0.6])
def test_mirror_diff_matches_the_per_tensor_reference(density):
    g = torch.Generator().manual_seed(int(density * 1000))
    sizes = [0, 1, 3, 7, 8, 9, 100, 4097, 70_000]
    state = {f"{dt}.{n}".replace("torch.", ""): _random(dt, n, g) for dt in DTYPES for n in sizes}
    specs = {k: TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in state.items()}
    mirror = Mirror.capture(state, specs)
    for k, v in state.items():
        assert torch.equal(mirror.view(k), bits_view(v))
    assert mirror.checksums() == {k: full_checksum(k, v) for k, v in state.items()}
    # misaligned views as the new state: a storage offset of one element
    new = {}
    for k, v in state.items():
        p = _perturb(v, density, g).reshape(-1)
        holder = torch.empty(p.numel() + 1, dtype=p.dtype)
        holder[1:] = p
        new[k] = holder[1:]
    diff = mirror.diff(new)
    for k in state:
        ref = _reference(bits_view(state[k]), new[k])
        assert torch.equal(find_changes(bits_view(state[k]), new[k]).positions, ref.positions)
        got = diff.changes[k]
        assert torch.equal(got.positions, ref.positions), k
        assert torch.equal(got.new_bits, ref.new_bits) and torch.equal(got.old_bits, ref.old_bits), k
        assert diff.sums[k] == _sum_delta(k, ref), k
    before = {k: mirror.view(k).clone() for k in state}
    mirror.advance(diff)
    for k in state:
        assert torch.equal(mirror.view(k), bits_view(new[k].contiguous())), k
    mirror.revert(diff)
    for k in state:
        assert torch.equal(mirror.view(k), before[k]), k


def test_flat_changes_split_across_buffers_are_exact():
    """Tiny output buffers force many parts, with tensors straddling them."""
    g = torch.Generator().manual_seed(3)
    olds = [_random(torch.int16, n, g) for n in (5, 300_000, 17, 1_000_000, 64)]
    news = [_perturb(o, 0.2, g) for o in olds]
    keys = np.array([tensor_key(f"t{i}") for i in range(len(olds))], np.uint64)
    fc = segments.diff_segments(olds, news, keys, hint=0.0)
    assert len(fc.parts) > 1
    whole = fc.changes()
    for i, (o, n) in enumerate(zip(olds, news)):
        ref = _reference(o, n)
        for got in (fc.change(i), whole[i]):
            assert torch.equal(got.positions, ref.positions)
            assert torch.equal(got.new_bits, ref.new_bits) and torch.equal(got.old_bits, ref.old_bits)
        assert int(fc.sums[i]) == _sum_delta(f"t{i}", ref)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_scatter_writes_exactly_the_positions_given(dtype):
    # segments around the kernel's prefetch distance (32 items ahead), one without changes
    g = torch.Generator().manual_seed(11)
    sizes, counts = (5, 40, 33, 64, 100_000, 7), (0, 31, 33, 32, 4_000, 7)
    ts = [_random(dtype, n, g) for n in sizes]
    pos = [torch.randperm(n, generator=g)[:k].sort().values for n, k in zip(sizes, counts)]
    bounds = segments.bounds_of(counts)
    vals = torch.randint(-2**15, 2**15, (sum(counts),), generator=g).to(dtype)
    want = [t.clone() for t in ts]
    for w, p, a, b in zip(want, pos, bounds[:-1], bounds[1:]):
        w[p] = vals[a:b]
    segments.scatter(ts, segments.cat(pos), bounds, vals)
    assert all(torch.equal(t, w) for t, w in zip(ts, want))


def test_segment_helpers_match_torch():
    g = torch.Generator().manual_seed(5)
    ts = [_random(torch.int32, n, g) for n in (1, 10, 1000, 300_000)]
    pos = [torch.unique(torch.randint(0, t.numel(), (max(1, t.numel() // 7),), generator=g)) for t in ts]
    bounds = segments.bounds_of([p.numel() for p in pos])
    flat = segments.cat(pos)
    got = segments.gather(ts, flat, bounds)
    assert torch.equal(got, torch.cat([t[p] for t, p in zip(ts, pos)]))
    new = got + 1
    keys = np.array([tensor_key(f"s{i}") for i in range(len(ts))], np.uint64)
    deltas = segments.mix_delta(flat, got, new, bounds, keys)
    before = [full_checksum(f"s{i}", t) for i, t in enumerate(ts)]
    segments.scatter(ts, flat, bounds, new)
    for i, t in enumerate(ts):
        assert (before[i] + int(deltas[i])) % 2**64 == full_checksum(f"s{i}", t)
    assert [int(x) for x in segments.full_sums(ts, keys)] == [full_checksum(f"s{i}", t) for i, t in enumerate(ts)]
    assert segments.check_positions(flat, bounds, np.array([t.numel() for t in ts])) == -1
    bad = flat.clone()
    bad[int(bounds[2]) + 1] = bad[int(bounds[2])]  # a repeat inside tensor 2
    assert segments.check_positions(bad, bounds, np.array([t.numel() for t in ts])) == 2
    dst = [torch.empty_like(t) for t in ts]
    segments.copy(ts, dst)
    assert all(torch.equal(a, b) for a, b in zip(ts, dst))
    assert segments.is_zero(torch.zeros(1001, dtype=torch.int16)[1:])
    z = torch.zeros(1001, dtype=torch.int16)
    z[-1] = 1
    assert not segments.is_zero(z[1:]) and segments.is_zero(z[:-1])


def test_pending_overlay_gives_the_changes_against_the_last_captured_version():
    """The mirror lags two versions behind; the corrected diff equals a diff against the true previous state."""
    g = torch.Generator().manual_seed(11)
    v0 = {"a": _random(torch.bfloat16, 5000, g), "b": _random(torch.float32, 300, g), "c": _random(torch.int8, 64, g)}
    specs = {k: TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in v0.items()}
    mirror = Mirror.capture(v0, specs)
    mirror.version = 0
    pending = Pending()
    states = [v0]
    for step in range(1, 8):
        prev = states[-1]
        nxt = {k: _perturb(v, 0.05, g) for k, v in prev.items()}
        if step % 3 == 0:  # some elements go back to older bits
            nxt["a"] = states[max(0, step - 2)]["a"].clone()
        pending.prune(mirror.version)
        diff = mirror.diff(nxt, pending=pending)
        for k in nxt:
            ref = _reference(bits_view(prev[k]), nxt[k])
            got = diff.changes[k]
            assert torch.equal(got.positions, ref.positions), (step, k)
            assert torch.equal(got.new_bits, ref.new_bits) and torch.equal(got.old_bits, ref.old_bits), (step, k)
            assert diff.sums[k] == _sum_delta(k, ref)
        pending.add(diff, step)
        states.append(nxt)
        if step % 2 == 0:  # the "writer" catches up on every version but the newest
            for s in range(mirror.version + 1, step):
                d = Mirror.capture(states[s - 1], specs).diff(states[s])
                mirror.advance(d)
                mirror.version = s


class _Slow(MemoryBackend):
    """A memory backend whose puts take a while, so the capture side runs versions ahead of the writer."""

    def __init__(self, delay):
        super().__init__(uuid.uuid4().hex)
        self.delay = delay

    def put(self, key, data, *, mode="overwrite"):
        time.sleep(self.delay)
        super().put(key, data, mode=mode)


@pytest.mark.parametrize("codec", ["auto", "ulp", "raw"])
def test_background_with_one_mirror_is_bit_exact_while_the_writer_lags(codec):
    g = torch.Generator().manual_seed(2)
    states = [{"w": _random(torch.bfloat16, 20_000, g), "n": _random(torch.bfloat16, 64, g),
               "i": _random(torch.int32, 100, g)}]
    for i in range(1, 14):
        nxt = {k: _perturb(v, 0.03 if i % 4 else 0.3, g) for k, v in states[-1].items()}
        if i % 5 == 0:
            nxt["w"] = states[i - 2]["w"].clone()  # back to an older version's bits
        states.append(nxt)
    backend = _Slow(0.01)
    live = {k: v.clone() for k, v in states[0].items()}
    pub = ds.Publisher(DeltaStore(backend), codec=codec, background=True, max_pending=4, anchor_every=6)
    futures = []
    for i, s in enumerate(states):
        for k in live:
            live[k].copy_(s[k])
        futures.append(pub.publish(live, step=i))
    pub.flush()
    assert pub._capture_mirror is pub._mirror  # one mirror, shared by the capture side and the writer
    assert pub._mirror.nbytes < 1.01 * sum(v.numel() * v.element_size() for v in states[0].values()) + 4096
    pub.close()
    assert [f.result().step for f in futures] == list(range(len(states)))
    sub = ds.Subscriber(DeltaStore(backend))
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    for i, s in enumerate(states):
        assert bits_equal(sub.pull(step=i).state, s), i
        sub.pull(target, step=i)
        assert bits_equal(target, s), i


def test_failed_publish_moves_the_mirror_back():
    """A commit that fails after the mirror was advanced (an anchor on the chain) leaves the Publisher as it was."""
    g = torch.Generator().manual_seed(4)
    states = [{"w": _random(torch.bfloat16, 4000, g)}]
    for _ in range(4):
        states.append({"w": _perturb(states[-1]["w"], 0.05, g)})
    armed = {"on": True}

    class Failing(MemoryBackend):
        def put(self, key, data, *, mode="overwrite"):
            if key.startswith("versions/000000000002") and armed["on"]:
                armed["on"] = False
                raise ConnectionError("injected")
            super().put(key, data, mode=mode)

    backend = Failing(uuid.uuid4().hex)
    pub = ds.Publisher(DeltaStore(backend), anchor_every=2)  # step 2 is an anchor written from the mirror
    pub.publish(states[0], step=0)
    pub.publish(states[1], step=1)
    with pytest.raises(ConnectionError):
        pub.publish(states[2], step=2)
    assert torch.equal(pub._mirror.view("w"), bits_view(states[1]["w"]))
    assert pub.publish(states[2], step=2).kind == "anchor"
    pub.publish(states[3], step=3)
    pub.close()
    sub = ds.Subscriber(DeltaStore(backend))
    for i in range(4):
        assert bits_equal(sub.pull(step=i).state, states[i])


def test_many_small_tensors_roundtrip_in_one_kernel_call_each(memory_uri):
    g = torch.Generator().manual_seed(6)
    base = {f"e{i}": _random(torch.bfloat16, int(n), g) for i, n in enumerate(torch.randint(1, 400, (1500,)))}
    base.update({f"i{i}": _random(torch.int8, 33, g) for i in range(50)})
    states = [base]
    for _ in range(4):
        states.append({k: _perturb(v, 0.04, g) for k, v in states[-1].items()})
    with ds.Publisher(memory_uri, anchor_every=10, max_object_bytes=200_000) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    sub = ds.Subscriber(memory_uri)
    m = sub.manifest(0)
    assert len(m.objects) > 1  # several anchor objects, streamed
    target = {k: torch.zeros_like(v) for k, v in base.items()}
    for i, s in enumerate(states):
        res = sub.pull(target, step=i)
        assert bits_equal(target, s), i
        assert res.path == ("anchor" if i == 0 else "delta")
    assert bits_equal(sub.pull(step=4).state, states[4])


def test_fp32_master_and_cpu_tensors_mix_in_one_mirror(memory_uri):
    """Tensors cast on the way (fp32 master published as bf16) take the torch path next to kernel ones."""
    g = torch.Generator().manual_seed(8)
    master = {"w": torch.randn(3000, generator=g), "b": torch.randn(40, generator=g),
              "steps": torch.tensor([1, 2, 3], dtype=torch.int64)}
    published = []
    with ds.Publisher(memory_uri, dtype=torch.bfloat16, anchor_every=100) as pub:
        for i in range(4):
            pub.publish(master, step=i)
            published.append({k: v.bfloat16() if v.is_floating_point() else v.clone() for k, v in master.items()})
            master["w"] += 1e-2 * torch.randn(3000, generator=g)
            master["steps"] += 1
    sub = ds.Subscriber(memory_uri)
    for i, want in enumerate(published):
        assert bits_equal(sub.pull(step=i).state, want), i


def _anchor_store(uri, states):
    with ds.Publisher(uri, anchor_every=100, max_object_bytes=25_000) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)


def _three_states(seed=9):
    g = torch.Generator().manual_seed(seed)
    s = {f"t{i}": _random(torch.bfloat16, 6000, g) for i in range(6)}
    out = [s]
    for _ in range(2):
        out.append({k: _perturb(v, 0.05, g) for k, v in out[-1].items()})
    return out


@pytest.mark.parametrize("journal_memory", [0, 1 << 30])
def test_anchor_pull_into_a_live_target_is_undone_when_a_later_object_is_corrupt(journal_memory):
    backend = MemoryBackend(uuid.uuid4().hex)
    states = _three_states()
    _anchor_store(DeltaStore(backend), states)
    m = DeltaStore(backend).manifest(0)
    assert len(m.full_objects) >= 3
    last = sorted(m.full_objects)[-1]
    key = object_key(m.objects[last].digest)
    good = backend.get(key)
    backend.put(key, good[:-1] + bytes([good[-1] ^ 0xFF]), mode="overwrite")
    g = torch.Generator().manual_seed(1)
    target = {k: _random(torch.bfloat16, 6000, g) for k in states[0]}  # a live target, version unknown
    before = {k: v.clone() for k, v in target.items()}
    sub = ds.Subscriber(DeltaStore(backend), journal_memory=journal_memory)
    with pytest.raises(CorruptObjectError):
        sub.pull(target, step=2)
    assert bits_equal(target, before)
    assert tracking.get_version(target) is None
    backend.put(key, good, mode="overwrite")
    sub.store.forget_all()
    sub.pull(target, step=2)
    assert bits_equal(target, states[2])


class _Refusing(torch.Tensor):
    """A tensor whose n-th in-place copy raises after landing half of it (a device error mid-write)."""

    fail_at = -1
    count = 0
    storages: set[int] = set()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and args[0].untyped_storage().data_ptr() in cls.storages:
            cls.count += 1
            if cls.count == cls.fail_at:
                with torch._C.DisableTorchFunctionSubclass():
                    n = args[0].numel() // 2
                    args[0].reshape(-1)[:n].copy_(args[1].reshape(-1)[:n])
                raise RuntimeError("injected write failure")
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("journal_memory", [0, 1 << 30])
def test_anchor_pull_into_a_live_target_is_undone_when_a_write_fails(memory_uri, journal_memory):
    states = _three_states(12)
    _anchor_store(memory_uri, states)
    sub = ds.Subscriber(memory_uri, journal_memory=journal_memory)
    plain = ds.Subscriber(memory_uri).pull(step=1).state
    target = {k: v.as_subclass(_Refusing) for k, v in plain.items()}
    _Refusing.storages = {v.untyped_storage().data_ptr() for v in plain.values()}
    tracking.set_version(target, None)
    before = {k: v.as_subclass(torch.Tensor).clone() for k, v in target.items()}
    _Refusing.count, _Refusing.fail_at = 0, 4
    with pytest.raises(ApplyError) as info:
        sub.pull(target, step=2, allow_anchor=True)
    _Refusing.fail_at = -1
    assert info.value.restored
    assert bits_equal({k: v.as_subclass(torch.Tensor) for k, v in target.items()}, before)
    sub.pull(target, step=2)
    assert bits_equal({k: v.as_subclass(torch.Tensor) for k, v in target.items()}, states[2])


def test_undo_journal_restores_memory_disk_and_zero_entries(tmp_path):
    g = torch.Generator().manual_seed(13)
    ts = [_random(torch.int16, 1000, g), torch.zeros(500, dtype=torch.int16), _random(torch.int64, 300, g),
          _random(torch.uint8, 77, g)]
    before = [t.clone() for t in ts]
    journal = UndoJournal(tmp_path, memory_bytes=2500)  # the first in memory, the rest spill to disk
    for t in ts:
        journal.save(t)
        journal.save(t)  # saved once
        t.fill_(7)
    assert len(journal) == len(ts)
    assert journal.restore() == 0
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
    journal.close()


def test_overlay_hands_decoders_a_view_of_a_cpu_target():
    target = {"w": torch.arange(100, dtype=torch.int16)}
    reader = mapping_reader(target)

    class _M:  # the manifest fields SparseOverlay reads
        tensors = ()
        checksum_values: dict[str, int] = {}

    overlay = SparseOverlay(reader, _M())
    whole = overlay.old_bits("w", None)
    assert whole.data_ptr() == target["w"].data_ptr()  # no copy while nothing is staged
    from deltastore.pull.staging import _Pending

    overlay.pending["w"] = _Pending(torch.tensor([3]), torch.tensor([-1], dtype=torch.int16),
                                    torch.tensor([3], dtype=torch.int16))
    staged = overlay.old_bits("w", None)
    assert staged.data_ptr() != target["w"].data_ptr() and int(staged[3]) == -1
    assert int(target["w"][3]) == 3  # the target itself is untouched


def test_background_overlay_survives_concurrent_writer_advances():
    """Capture and writer threads race on the same mirror for many versions; every version stays exact."""
    g = torch.Generator().manual_seed(21)
    states = [{"w": _random(torch.bfloat16, 50_000, g)}]
    for _ in range(25):
        states.append({"w": _perturb(states[-1]["w"], 0.02, g)})
    backend = _Slow(0.002)
    pub = ds.Publisher(DeltaStore(backend), codec="raw", background=True, max_pending=3, anchor_every=1000)
    for i, s in enumerate(states):
        pub.publish(s, step=i)
    pub.close()
    sub = ds.Subscriber(DeltaStore(backend))
    target = {"w": torch.zeros_like(states[0]["w"])}
    for i, s in enumerate(states):
        sub.pull(target, step=i)
        assert bits_equal(target, s), i
