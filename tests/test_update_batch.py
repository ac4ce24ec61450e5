"""Flat update batches (``Codec.encode_batch``) on the publish path: same bytes as the per-tensor path,
exact selections from the compare's flat arrays, and a sync publish that builds no per-tensor changes."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import deltastore as ds
from conftest import step_bits
from deltastore import segments
from deltastore.publish.anchors import Adaptive, Every
from deltastore.checksum import tensor_key
from deltastore.codecs import TensorSpec, UpdateBatch, get_codec
from deltastore.codecs.auto import AutoCodec
from deltastore.publish.drift import DriftTracker
from deltastore.kernels import bitstream as K
from deltastore.publish.mirror import Diff

SPARSE = ("auto", "ulp", "zstd", "raw", "ctx")


def _batch(rng: np.random.Generator, n: int, *, kinds: bool, old_tensor_share: float = 0.0) -> UpdateBatch:
    """``n`` tensors under shuffled names (never in name order), some with no change, one bits dtype."""
    names = random.Random(int(rng.integers(1 << 30))).sample([f"layer.{i}.w" for i in range(3 * n)], n)
    specs, pos, new, old, olds = [], [], [], [], {}
    for name in names:
        dtype = [torch.bfloat16, torch.float16, torch.int16][int(rng.integers(3))] if kinds else torch.bfloat16
        numel = int(rng.integers(1, 600))
        count = int(rng.integers(0, numel + 1)) if rng.random() < 0.5 else int(rng.integers(0, max(1, numel // 20)))
        p = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
        whole = rng.integers(-2**15, 2**15, numel).astype(np.int16)
        step = (rng.integers(1, 4, count) * rng.choice([-1, 1], count)).astype(np.int16)
        specs.append(TensorSpec(name, dtype, (numel,)))
        pos.append(p)
        old.append(whole[p])
        new.append((whole[p] + step).astype(np.int16))
        if rng.random() < old_tensor_share:
            olds[name] = torch.from_numpy(whole)
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum([p.size for p in pos], out=bounds[1:])
    return UpdateBatch(specs, torch.from_numpy(np.concatenate(pos)), bounds, torch.from_numpy(np.concatenate(new)),
                       torch.from_numpy(np.concatenate(old)), olds)


def _encoded(encode) -> bytes | str:  # noqa: ANN001
    try:
        return encode()
    except ValueError as e:  # both paths must refuse the same way
        return repr(e)


@pytest.mark.parametrize("codec_id", SPARSE)
@pytest.mark.parametrize("kinds", [False, True], ids=["bf16", "mixed-kinds"])
def test_encode_batch_writes_the_bytes_of_encode(codec_id, kinds):
    rng = np.random.default_rng(hash((codec_id, kinds)) % 2**32)
    codec = get_codec(codec_id)
    for n in (1, 2, 7, 40):
        batch = _batch(rng, n, kinds=kinds, old_tensor_share=1.0 if codec_id == "ctx" else 0.0)
        want = _encoded(lambda: codec.encode(batch.updates()))
        assert isinstance(want, bytes), want
        assert _encoded(lambda: codec.encode_batch(batch)) == want


@pytest.mark.parametrize("link_mbps", [1000.0, None], ids=["default-link", "bytes-first"])
def test_auto_batch_decides_tensors_with_old_tensors_one_by_one(link_mbps):
    """Tensors with an old tensor may go ctx or dense (auto's rules), the rest ulp: same bytes, same choices."""
    rng = np.random.default_rng(11)
    codec = AutoCodec(link_mbps=link_mbps)
    chosen = set()
    for _ in range(12):
        batch = _batch(rng, 9, kinds=False, old_tensor_share=0.5)
        data = codec.encode_batch(batch)
        assert data == codec.encode(batch.updates())
        record = json.loads(_meta(data)["deltastore.auto.choice"])  # only tensors off the default part named
        chosen |= {record["other"].get(s.name, record["default"]) for s in batch.specs}
    assert "ulp" in chosen and ({"ctx", "dense"} & chosen), chosen  # the special path was exercised


def _meta(data: bytes) -> dict[str, str]:
    from deltastore.codecs._common import unpack_meta

    return unpack_meta(data, "auto")[1]


def test_batch_roundtrips_through_decode():
    rng = np.random.default_rng(4)
    batch = _batch(rng, 30, kinds=True)
    data = get_codec("ulp").encode_batch(batch)
    olds = {u.spec.name: u.old_bits for u in batch.updates()}

    def old(name: str, positions: torch.Tensor | None) -> torch.Tensor:
        u = next(x for x in batch.updates() if x.spec.name == name)
        assert positions is not None and torch.equal(positions, u.positions)
        return olds[name]

    got = get_codec("ulp").decode(data, batch.specs, old)
    for u in batch.updates():
        assert torch.equal(got[u.spec.name].positions, u.positions)
        assert torch.equal(got[u.spec.name].bits.view(torch.int16), u.bits.view(torch.int16))


def test_subset_takes_the_chosen_tensors_in_order():
    rng = np.random.default_rng(5)
    batch = _batch(rng, 25, kinds=False, old_tensor_share=0.3)
    order = list(rng.permutation(25)[:17])
    sub = batch.subset(order)
    every = batch.updates()
    for u, i in zip(sub.updates(), order):
        ref = every[i]
        assert u.spec == ref.spec
        for a, b in ((u.positions, ref.positions), (u.bits, ref.bits), (u.old_bits, ref.old_bits)):
            assert torch.equal(a, b)
        assert (u.old_tensor is None) == (ref.old_tensor is None)
    assert batch.subset(list(range(25))) is batch


def test_take_and_flat_gap_stream_match_their_references():
    rng = np.random.default_rng(6)
    lens = rng.integers(0, 50, 300)
    bounds = np.zeros(301, np.int64)
    np.cumsum(lens, out=bounds[1:])
    pos = np.concatenate([np.sort(rng.choice(10_000, k, replace=False)) for k in lens]).astype(np.int64)
    idx = rng.permutation(300)[:200]
    (got,), got_bounds = segments.take([torch.from_numpy(pos)], bounds, idx)
    want = np.concatenate([pos[bounds[i]:bounds[i + 1]] for i in idx])
    assert np.array_equal(got.numpy(), want) and np.array_equal(np.diff(got_bounds), lens[idx])
    assert K.gap_stream_flat(pos, bounds) == K.gap_stream([pos[bounds[i]:bounds[i + 1]] for i in range(300)])
    assert K.gap_stream_flat(pos[:0], np.zeros(1, np.int64)) == b""


def _random(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, generator=g)


def test_select_from_many_parts_matches_each_tensors_change(monkeypatch):
    """Tiny compare buffers (many parts, tensors straddling them); consecutive, gapped, reordered and single
    choices."""
    monkeypatch.setenv("DELTASTORE_THREADS", "3")
    g = torch.Generator().manual_seed(8)
    sizes = [5, 300_000, 17, 400_000, 64, 0, 90_000, 3]
    olds = [_random(n, g) for n in sizes]
    news = []
    for o in olds:
        n = o.clone()
        hit = torch.rand(n.numel(), generator=g) < 0.2
        step_bits(n, hit, g)
        news.append(n)
    keys = np.array([tensor_key(f"t{i}") for i in range(len(sizes))], np.uint64)
    fc = segments.diff_segments(olds, news, keys, hint=0.0)
    assert len(fc.parts) > 2
    for idx in ([0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3], [3], [0, 3, 6], [1, 4, 7], [5], [7, 3, 1, 0], [6, 2, 4]):
        pos, new, old, bounds = fc.select(np.array(idx, np.int64))
        for k, i in enumerate(idx):
            ch = fc.change(i)
            a, b = int(bounds[k]), int(bounds[k + 1])
            assert torch.equal(pos[a:b], ch.positions) and torch.equal(new[a:b], ch.new_bits)
            assert torch.equal(old[a:b], ch.old_bits)


def test_differential_flat_matches_the_per_tensor_differential():
    g = torch.Generator().manual_seed(9)
    names = [f"t{i}" for i in range(30)]
    anchor = [_random(int(n), g) for n in torch.randint(1, 500, (30,), generator=g)]
    state = [a.clone() for a in anchor]
    tracker = DriftTracker()
    keys = np.arange(30, dtype=np.uint64)
    for _ in range(3):
        before = [s.clone() for s in state]
        for t in state:
            hit = torch.rand(t.numel(), generator=g) < 0.1
            step_bits(t, hit, g)
        tracker.commit(tracker.propose(dict(zip(names, segments.diff_segments(before, state, keys).changes()))))
    views = dict(zip(names, state))
    per_tensor = DriftTracker.differential(tracker._drift, lambda n, p: views[n][p])
    flat = Diff({}, DriftTracker.differential_flat(tracker._drift, views.__getitem__))
    counts = flat.counts()
    assert {n for n, c in counts.items() if c} == set(per_tensor)
    for name, ch in per_tensor.items():
        got = flat.changes[name]
        assert counts[name] == ch.count
        for a, b in ((got.positions, ch.positions), (got.new_bits, ch.new_bits), (got.old_bits, ch.old_bits)):
            assert torch.equal(a, b)
    (table_names, rows), = DriftTracker.differential_flat(tracker._drift, views.__getitem__)
    for idx in ([3, 4, 5, 6], [17, 2, 29, 5], [8], []):  # one range (views), any order (joined), empty
        pos, new, old, bounds = rows.select(np.array(idx, dtype=np.int64))
        assert pos.dtype == torch.int64 and bounds.tolist()[0] == 0 and int(bounds[-1]) == pos.numel()
        for k, i in enumerate(idx):
            ch = per_tensor.get(table_names[i])
            a, b = int(bounds[k]), int(bounds[k + 1])
            if ch is None:
                assert a == b
                continue
            for x, y in ((pos[a:b], ch.positions), (new[a:b], ch.new_bits), (old[a:b], ch.old_bits)):
                assert torch.equal(x, y)


def test_a_differential_larger_than_an_object_is_split_and_a_joiner_reads_it(memory_uri, monkeypatch):
    """A differential is cut into objects of the anchor's object size, not ``max_object_bytes`` (each read
    from the drift as it is encoded), and a joiner that takes it is bit-exact."""
    from deltastore.publish import objects as objects_module

    monkeypatch.setattr(objects_module, "ANCHOR_OBJECT_MIN", 4096)  # this model's anchor objects: 4 KiB
    g = torch.Generator().manual_seed(13)
    state = {f"block.{i}.w": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16) for i in range(24)}
    pub = ds.Publisher(memory_uri, anchor=Adaptive(budget=100.0, max_drift=1.0, differential_gain=0.2))
    infos = []
    for step in range(8):
        for v in state.values():
            # +1 ulp: object sizes follow the codec's size estimate, made for a trainer's small steps (the
            # sign crossings and jumps of step_bits encode 2-3x larger); bit-exactness under those: the others
            v.view(torch.int16)[torch.rand(v.shape, generator=g) < 0.1] += 1
        infos.append(pub.publish(state, step=step))
    pub.close()
    with_diff = [i.step for i in infos if i.differential]
    assert with_diff, [i.kind for i in infos]
    store = ds.open_store(memory_uri)
    m = store.manifest(with_diff[-1])
    assert len(m.diff_objects) > 1 and all(m.objects[i].size <= 2 * 4096 for i in m.diff_objects)
    sub = ds.Subscriber(memory_uri)
    assert sub.plan(with_diff[-1]).differential is not None
    joined = sub.pull(step=with_diff[-1]).state
    for k in state:
        if with_diff[-1] == infos[-1].step:
            assert torch.equal(joined[k].view(torch.int16), state[k].view(torch.int16)), k
    last = sub.pull(joined, step=infos[-1].step)  # then on through the deltas
    assert last.step == infos[-1].step
    for k in state:
        assert torch.equal(joined[k].view(torch.int16), state[k].view(torch.int16)), k


@pytest.mark.parametrize("anchor_every", [None, 2], ids=["adaptive-with-differentials", "every-2"])
def test_sync_publish_builds_no_per_tensor_changes(memory_uri, monkeypatch, anchor_every):
    """The synchronous delta path (compare, drift, differential, encode) works on flat arrays only, and a
    follower pulls every version bit-exactly."""
    g = torch.Generator().manual_seed(12)
    state = {f"block.{i}.w": (torch.randn(64, 33, generator=g) * 0.02).to(torch.bfloat16) for i in range(60)}
    state["norm"] = torch.ones(48, dtype=torch.bfloat16)
    built = []
    changes = segments.FlatChanges.changes
    monkeypatch.setattr(segments.FlatChanges, "changes", lambda self: built.append(1) or changes(self))
    # differentials soon (a low gain) and no second anchor (a large budget): deltas and differentials only
    policy = Every(anchor_every) if anchor_every else Adaptive(budget=100.0, max_drift=1.0, differential_gain=0.2)
    pub = ds.Publisher(memory_uri, anchor=policy)
    sub = ds.Subscriber(memory_uri)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    infos = []
    for step in range(6):
        for k, v in state.items():
            hit = torch.rand(v.shape, generator=g) < 0.05
            step_bits(v.view(torch.int16), hit, g)
        infos.append(pub.publish(state, step=step))
        sub.pull(target, step=step)
        for k in state:
            assert torch.equal(target[k].view(torch.int16), state[k].view(torch.int16)), (step, k)
    pub.close()
    assert not built, "the sync publish built one Change per tensor"
    assert any(i.kind == "delta" for i in infos)
    if anchor_every is None:  # the differential came from the drift's flat tables; a joiner reads it
        assert any(i.differential for i in infos)
        last = len(infos) - 1
        assert ds.Subscriber(memory_uri).plan(last).differential is not None
        joined = ds.Subscriber(memory_uri).pull(step=last).state
        for k in state:
            assert torch.equal(joined[k].view(torch.int16), state[k].view(torch.int16)), k


def test_objects_break_where_the_compare_buffers_do():
    """part_breaks: the first tensor of each buffer after the first, and a straddling tensor plus the one
    after it; then every object of the rest is a view of one buffer (select copies nothing)."""
    import numpy as np
    import torch

    from deltastore.publish.mirror import Diff
    from deltastore.segments import FlatChanges

    names = ["a", "b", "c", "d", "e"]
    bounds = np.array([0, 3, 3, 7, 10, 12], np.int64)  # b is unchanged; d straddles buffers 1 and 2
    pos = torch.arange(12, dtype=torch.int64)
    bits = torch.arange(12, dtype=torch.int16)
    cuts = [0, 3, 8, 12]  # buffer 1 starts at c (a tensor's start), buffer 2 inside d
    parts = [(pos[a:b].clone(), bits[a:b].clone(), bits[a:b].clone()) for a, b in zip(cuts, cuts[1:])]
    fc = FlatChanges(bounds, parts, np.array(cuts[:-1], np.int64), np.zeros(5, np.uint64))
    diff = Diff({n: 0 for n in names}, [(names, fc)])
    assert diff.part_breaks() == {"c", "d", "e"}
    p, _, _, b = fc.select(np.array([0, 1]))  # a with the unchanged b: a view of buffer 0
    assert p.data_ptr() == parts[0][0].data_ptr() and b.tolist() == [0, 3, 3]
    p, _, _, _ = fc.select(np.array([2]))
    assert p.data_ptr() == parts[1][0].data_ptr()
    p, _, _, b = fc.select(np.array([3]))  # the straddler alone: joined
    assert p.tolist() == [7, 8, 9] and b.tolist() == [0, 3]
