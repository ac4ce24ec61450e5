"""The ``ctx`` coding kernels (``kernels/ctx.py``) against the numpy formulation the format was written with:
the same thresholds, header integers and bit streams, on edge cases (every subset mode, one- and multi-ulp
steps, sign crossings, 64-bit wraps, changes at both ends, empty buckets) and on the real traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore.codecs import _bits as B
from deltastore.codecs.base import TensorSpec, Update
from deltastore.codecs.ctx import CtxCodec
from deltastore.kernels import ctx as K


# -- the numpy reference (the encoder as it was before the kernels) ---------------------------------------------
def ref_entropy_bits(n, k):
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    return n * h


def ref_thresholds(cls_counts, cls_hits, max_buckets, shift):
    nz = np.flatnonzero(cls_counts)
    m = nz.size
    if m <= 1 or max_buckets <= 1 or cls_hits.sum() == 0:
        return []
    C = np.concatenate(([0], np.cumsum(cls_counts[nz].astype(np.float64))))
    Kc = np.concatenate(([0], np.cumsum(cls_hits[nz].astype(np.float64))))
    cost = ref_entropy_bits(C[None, :] - C[:, None], Kc[None, :] - Kc[:, None]) + 64
    cost[np.tril_indices(m + 1)] = np.inf
    best = np.full((max_buckets + 1, m + 1), np.inf)
    arg = np.zeros((max_buckets + 1, m + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for g in range(1, max_buckets + 1):
        tot = best[g - 1][:, None] + cost
        arg[g] = np.argmin(tot, axis=0)
        best[g] = tot[arg[g], np.arange(m + 1)]
    g = int(np.argmin(best[1:, m])) + 1
    cuts, j = [], m
    while g > 0:
        i = int(arg[g, j])
        if i > 0:
            cuts.append(i)
        j, g = i, g - 1
    return sorted(int(nz[i]) << shift for i in cuts)


def ref_subset(s, n, header, seqs):
    c = int(s.size)
    header.append(c)
    if c == 0:
        return
    if c == n:
        header.append(0)
        return
    g = (np.diff(s, prepend=-1) - 1).astype(np.uint64)
    kind, cost = B.best_kind(g)
    mode, values = 1, g
    if 2 * c > n:
        mask = np.ones(n, dtype=bool)
        mask[s] = False
        comp = np.flatnonzero(mask)
        gc = (np.diff(comp, prepend=-1) - 1).astype(np.uint64)
        kc, cc = B.best_kind(gc)
        if cc < cost:
            mode, kind, cost, values = 2, kc, cc, gc
    if n < cost:
        mask = np.zeros(n, dtype=np.uint64)
        mask[s] = 1
        mode, kind, values = 3, B.Kind(B.FIXED, 1), mask
    header.append(mode)
    if mode in (1, 2):
        header.append(kind.code())
    seqs.append((values, kind))


def ref_code(bucket, rank, d, sizes):
    header, seqs = [], []
    for b in range(len(sizes)):
        sel = np.flatnonzero(bucket == b)
        if sel.size == 0:
            header.append(0)
            continue
        ref_subset(rank[sel], int(sizes[b]), header, seqs)
        db = d[sel]
        a = np.where(db < 0, -db, db).view(np.uint64)
        big = np.flatnonzero(a >= np.uint64(2))
        ref_subset(big, sel.size, header, seqs)
        ref_subset(np.flatnonzero(db < 0), sel.size, header, seqs)
        if big.size:
            kind, _ = B.best_kind(a[big] - np.uint64(2))
            header.append(kind.code())
            seqs.append((a[big] - np.uint64(2), kind))
    qs, ws, rs = [], [], []
    for values, kind in seqs:
        q, w, r = B.split(values, kind)
        qs.append(q)
        ws.append(w)
        rs.append(r)
    q = np.concatenate(qs) if qs else np.zeros(0, np.int64)
    u = B.pack_unary(q[q >= 0])
    r = B.pack_raw(np.concatenate(ws) if ws else np.zeros(0, np.int64),
                   np.concatenate(rs) if rs else np.zeros(0, np.uint64))
    return header, u, r


def check_code(bucket, rank, d, sizes):
    bucket, rank, d, sizes = (np.ascontiguousarray(x, np.int64) for x in (bucket, rank, d, sizes))
    hdr, u, r = K.code_tensor(bucket, rank, d, sizes)
    want = ref_code(bucket, rank, d, sizes)
    assert hdr.tolist() == want[0]
    assert u == want[1]
    assert r == want[2]


def random_changes(rng, nb, size, density, step_kind):
    sizes = np.maximum(1, rng.integers(1, size, nb))
    bucket, rank = [], []
    for b, n in enumerate(sizes.tolist()):
        k = int(min(n, rng.binomial(n, density)))
        rank.append(np.sort(rng.choice(n, k, replace=False)))
        bucket.append(np.full(k, b))
    # interleave the buckets as positions would (any order of buckets, ranks increasing within each)
    order = rng.permutation(sum(x.size for x in rank))
    bucket = np.concatenate(bucket)[np.argsort(order, kind="stable")]
    rank_sorted = np.zeros(bucket.size, np.int64)
    for b in range(nb):
        rank_sorted[bucket == b] = rank[b]
    m = bucket.size
    if step_kind == "ulp":
        d = rng.choice([-1, 1], m)
    elif step_kind == "mixed":
        d = rng.choice([-3, -2, -1, 1, 1, 1, 2, 7, 300], m)
    else:  # wide: steps of 64-bit elements, wrapping ones included
        d = rng.integers(-2**62, 2**62, m)
        d[::7] = np.iinfo(np.int64).min
        d[1::11] = np.iinfo(np.int64).max
        d[d == 0] = 5
    return bucket, rank_sorted, d, sizes


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("density", [0.001, 0.05, 0.4, 0.7, 0.97, 1.0])
def test_code_tensor_matches_the_numpy_formulation(seed, density):
    rng = np.random.default_rng(seed * 100 + int(density * 1000))
    nb = int(rng.integers(1, 17))
    step_kind = ["ulp", "mixed", "wide"][seed % 3]
    check_code(*random_changes(rng, nb, int(rng.integers(2, 3000)), density, step_kind))


def test_code_tensor_edge_cases():
    check_code([], [], [], [10])                                   # nothing changed
    check_code([0], [0], [1], [1])                                 # the whole one-element universe
    check_code([0, 0], [0, 9], [-1, 1], [10])                      # both ends
    check_code([1, 1], [0, 1], [2, -2], [5, 2])                    # an empty bucket, then a full one
    check_code([0] * 6, list(range(6)), [1, -1, 2, -3, 1, -1], [7])  # all but one: a complement
    with pytest.raises(ValueError):
        K.code_tensor(*(np.array(x, np.int64) for x in ([0], [5], [1], [5])))  # rank outside its bucket
    with pytest.raises(ValueError):
        K.code_tensor(*(np.array(x, np.int64) for x in ([2], [0], [1], [5, 5])))  # bucket outside


@pytest.mark.parametrize("seed", range(40))
def test_thresholds_match_the_numpy_formulation(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    counts = rng.integers(0, 10**int(rng.integers(1, 8)), n) * (rng.random(n) < 0.5)
    hits = np.minimum(counts, rng.integers(0, 1000, n) * (rng.random(n) < 0.5))
    for buckets in (1, 2, 4, 16):
        shift = int(rng.integers(0, 10))
        assert K.thresholds(counts.astype(np.int64), hits.astype(np.int64), buckets, shift) == \
            ref_thresholds(counts, hits, buckets, shift)


def test_ctx_objects_are_unchanged_on_the_trace(trace):
    """On real steps of every dtype the codec takes, the object the kernels write is the numpy formulation's."""
    from deltastore.codecs import ctx as C

    codec = CtxCodec()
    ups = []
    for name, (idx, new) in list(trace.changes(1).items())[:12]:  # against the base
        old = trace.base[name].view(torch.int16).reshape(-1)
        ups.append(Update(TensorSpec(name, torch.bfloat16, tuple(trace.base[name].shape)), new, idx, old[idx], old))
    for u in ups:
        spec, old, pos = u.spec, u.old_tensor.numpy(), u.positions.numpy()
        classes = C._Classes(old, spec)
        hits = np.bincount((C._magnitude(old[pos], spec) >> classes.shift).astype(np.int64), minlength=classes.n)
        counts = np.maximum(classes.counts(), hits)
        assert K.thresholds(counts, hits, 4, classes.shift) == ref_thresholds(counts, hits, 4, classes.shift)
    data = codec.encode(ups)
    assert data == codec.encode(ups)
    got = codec.decode(data, [u.spec for u in ups], lambda n, p: next(u.old_tensor for u in ups if u.spec.name == n))
    for u in ups:
        assert torch.equal(got[u.spec.name].positions, u.positions)
        assert torch.equal(got[u.spec.name].bits, u.bits)


# -- ranks and select within four buckets, 16-bit elements by 32-element blocks -----------------------------------
def ref_ranks3(bits, mask, cuts, pos):
    mag = (bits.astype(np.int64) & mask)
    b = (mag[:, None] >= np.array(cuts)[None, :]).sum(axis=1)
    rank = np.array([int((b[:p] == b[p]).sum()) for p in pos.tolist()], np.int64)
    return b[pos], rank, b


@pytest.mark.parametrize("isa", [0, -1])  # plain C, and the best this CPU has
@pytest.mark.parametrize("seed", range(8))
def test_block_ranks_and_select_match_numpy(isa, seed):
    from deltastore.kernels._ranks import _count3, _ranks3, _select3

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 700))
    bits = rng.integers(0, 2**16, n, dtype=np.uint16)
    bits[rng.random(n) < 0.1] = 0x7FC1  # a NaN payload: the largest magnitude
    bits[rng.random(n) < 0.1] = 0x8000  # -0.0: magnitude 0
    mask = 0x7FFF
    cuts = sorted(rng.choice([1, 0x3C00, 0x3F80, 0x4000, 0x7F80, 0x8000], 3).tolist())
    density = [0.01, 0.3, 1.0][seed % 3]
    pos = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    if seed % 4 == 0:
        pos = np.unique(np.concatenate([pos, [0, n - 1]])).astype(np.int64)  # both ends
    want_b, want_r, all_b = ref_ranks3(bits, mask, cuts, pos)
    # two chunks, the second starting inside a block: its counts before come from _count3
    split = int(rng.integers(0, n + 1))
    g = _count3(bits, 0, split, mask, *cuts)
    cut = int(np.searchsorted(pos, split))
    rank, bucket = np.full(pos.size, -1, np.int64), np.full(pos.size, -1, np.int64)
    _ranks3(bits, mask, *cuts, pos, 0, cut, 0, split, 0, 0, 0, rank, bucket, isa)
    _ranks3(bits, mask, *cuts, pos, cut, pos.size, split, n, *g, rank, bucket, isa)
    np.testing.assert_array_equal(bucket, want_b)
    np.testing.assert_array_equal(rank, want_r)
    # select: the same positions back, in order, from the ranks per bucket
    ranks = [want_r[want_b == b] for b in range(4)]
    flat = np.concatenate(ranks).astype(np.int64)
    off = np.concatenate([[0], np.cumsum([r.size for r in ranks])]).astype(np.int64)
    outpos, src = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
    left = _select3(bits, mask, *cuts, 0, n, flat, off[:-1].copy(), np.zeros(4, np.int64),
                    np.array([r.size for r in ranks], np.int64), 0, 0, 0, 0, outpos, src, isa)
    assert left == 0
    np.testing.assert_array_equal(outpos, pos)
    np.testing.assert_array_equal(flat[src], want_r)
    # a rank past its bucket is never found
    sizes = np.bincount(all_b, minlength=4)
    bad = [np.append(r, sizes[b]) for b, r in enumerate(ranks)]
    flat = np.concatenate(bad).astype(np.int64)
    off = np.concatenate([[0], np.cumsum([r.size for r in bad])]).astype(np.int64)
    outpos, src = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
    left = _select3(bits, mask, *cuts, 0, n, flat, off[:-1].copy(), np.zeros(4, np.int64),
                    np.array([r.size for r in bad], np.int64), 0, 0, 0, 0, outpos, src, isa)
    assert left == 4


@pytest.mark.parametrize("buckets", [1, 2, 4, 7, 16])
def test_whole_tensor_kernel_writes_the_objects_of_the_stepwise_path(monkeypatch, trace, buckets):
    """bf16 and fp16 tensors go through one kernel call (``encode16``); the stepwise path (numpy around the
    kernels tested above) writes the same bytes, on real steps and on edge cases (sign crossings, -0/+0, NaN
    payloads, multi-ulp steps, changes at both ends, a tensor larger than 2**20 elements: sampled counts)."""
    from deltastore.codecs import ctx as C

    rng = np.random.default_rng(buckets)
    ups = []
    for name, (idx, new) in list(trace.changes(1).items())[:8]:
        old = trace.base[name].view(torch.int16).reshape(-1)
        ups.append(Update(TensorSpec(name, torch.bfloat16, tuple(trace.base[name].shape)), new, idx, old[idx], old))
    for dtype, n in ((torch.float16, 5000), (torch.bfloat16, (1 << 20) + 77)):
        old = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 0.05).to(dtype).view(torch.int16)
        old[:5] = torch.tensor([0, -32768, 0x7FC1, -1, 0x7F80], dtype=torch.int16)
        new = old.clone()
        idx = torch.from_numpy(np.unique(np.concatenate([[0, 1, 2, 3, 4, n - 1], rng.choice(n, n // 50)])))
        new[idx] = new[idx] + torch.from_numpy(rng.choice([-300, -2, -1, 1, 1, 1, 2, 5], idx.numel()).astype(np.int16))
        new[idx[:2]] = new[idx[:2]] ^ torch.tensor(-32768, dtype=torch.int16)  # sign crossings
        idx = torch.ne(old, new).nonzero().squeeze(1)
        ups.append(Update(TensorSpec(f"x.{dtype}", dtype, (n,)), new[idx].clone(), idx, old[idx].clone(), old))
    codec = CtxCodec(buckets=buckets)
    whole = codec.encode(ups)
    monkeypatch.setattr(C, "_WHOLE_IN_C", ())
    assert codec.encode(ups) == whole


@pytest.mark.parametrize("buckets", [1, 4, 7])
def test_whole_tensor_decoder_matches_the_stepwise_one_and_refuses_corrupt_streams(monkeypatch, trace, buckets):
    """``decode16`` (bf16 / fp16 in one call) against the stepwise decoder on real steps and edge cases; then
    every single-byte corruption of the streams, and truncations: a CorruptObjectError or a decode, never
    anything else (out-of-bounds reads would show here under a sanitizer, and as crashes without one)."""
    from deltastore.codecs import ctx as C
    from deltastore.errors import CorruptObjectError

    rng = np.random.default_rng(buckets)
    ups = []
    for name, (idx, new) in list(trace.changes(1).items())[:6]:
        old = trace.base[name].view(torch.int16).reshape(-1)
        ups.append(Update(TensorSpec(name, torch.bfloat16, tuple(trace.base[name].shape)), new, idx, old[idx], old))
    n = 3000
    old = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 0.05).to(torch.float16).view(torch.int16)
    new = old.clone()
    new[::3] += 1
    new[1::97] -= 40
    new[:3] = torch.tensor([-32768, 0x7C01, 1], dtype=torch.int16)  # -0, a NaN payload, a subnormal
    new[-1] ^= torch.tensor(-32768, dtype=torch.int16)                 # a sign crossing at the end
    idx = torch.ne(old, new).nonzero().squeeze(1)
    ups.append(Update(TensorSpec("h.weight", torch.float16, (n,)), new[idx].clone(), idx, old[idx].clone(), old))
    codec = CtxCodec(buckets=buckets)
    data = codec.encode(ups)
    specs = [u.spec for u in ups]
    olds = {u.spec.name: u.old_tensor for u in ups}
    got = codec.decode(data, specs, lambda nm, p: olds[nm])
    with monkeypatch.context() as mp:
        mp.setattr(C, "_WHOLE_IN_C", ())
        want = codec.decode(data, specs, lambda nm, p: olds[nm])
    for u in ups:
        assert torch.equal(got[u.spec.name].positions, u.positions) and torch.equal(got[u.spec.name].bits, u.bits)
        assert torch.equal(want[u.spec.name].bits, u.bits)
    # corruptions of the last tensor's object (small: every byte of its streams)
    small = codec.encode(ups[-1:])
    from deltastore.codecs._common import pack_meta, u8, unpack_meta
    tensors, meta = unpack_meta(small, "ctx")
    streams = bytearray(tensors["streams"].numpy().tobytes())
    extra = {k: v for k, v in meta.items() if not k.startswith("deltastore.codec")}
    outcomes = set()
    for i in range(len(streams)):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(streams)
            bad[i] ^= flip
            obj = pack_meta({**tensors, "streams": u8(bytes(bad))}, "ctx", "1.0", extra)
            try:
                out = codec.decode(obj, specs[-1:], lambda nm, p: olds[nm])
                assert out["h.weight"].positions.numel() == out["h.weight"].bits.numel()
                outcomes.add("decoded")
            except CorruptObjectError:
                outcomes.add("refused")
    assert "refused" in outcomes


class _Receiver:
    """An ``old`` that offers its tensors to be written in place, as the Subscriber does."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.offered = None

    def __call__(self, name, positions):
        t = self.tensors[name]
        return t if positions is None else t[positions]

    def in_place(self, names, bounds):
        from deltastore.checksum import tensor_key
        from deltastore.codecs.base import InPlace

        ts = [self.tensors[n] for n in names]
        self.offered = InPlace(np.array([t.data_ptr() for t in ts], np.int64), np.array([t.numel() for t in ts]),
                               np.dtype(np.int16), np.zeros(len(ts), np.bool_),
                               np.array([tensor_key(n) for n in names], np.uint64), np.zeros(len(ts), np.uint64))
        return self.offered


def test_ctx_decodes_into_the_receivers_tensors_and_undoes(trace):
    """Offered the target, ``decode_batch`` writes each bf16 tensor in place (whole, once decoded), notes its
    checksum change and sets an undo; a corrupt tensor later in the object raises with the earlier ones done,
    and the undo puts their bits back."""
    from deltastore.checksum import full_checksum
    from deltastore.codecs.base import WrittenBatch
    from deltastore.codecs._common import pack_meta, u8, unpack_meta
    from deltastore.errors import CorruptObjectError

    ups, news = [], {}
    for name, (idx, new) in list(trace.changes(1).items())[:4]:
        old = trace.base[name].view(torch.int16).reshape(-1)
        ups.append(Update(TensorSpec(name, torch.bfloat16, (old.numel(),)), new, idx, old[idx], old))
        full = old.clone()
        full[idx] = new
        news[name] = full
    codec = CtxCodec()
    data = codec.encode(ups)
    target = {u.spec.name: u.old_tensor.clone() for u in ups}
    rx = _Receiver(target)
    out = codec.decode_batch(data, [u.spec for u in ups], rx)
    assert len(out) == 1 and isinstance(out[0], WrittenBatch) and bool(rx.offered.done.all())
    for i, s in enumerate(out[0].specs):
        assert torch.equal(target[s.name], news[s.name])
        before = full_checksum(s.name, next(u.old_tensor for u in ups if u.spec.name == s.name))
        assert (before + int(rx.offered.sums[i])) % 2**64 == full_checksum(s.name, news[s.name])
    rx.offered.undo()
    assert all(torch.equal(target[u.spec.name], u.old_tensor) for u in ups)
    # the last tensor's streams cut short: the earlier ones are written, then the error; the undo restores them
    tensors, meta = unpack_meta(data, "ctx")
    streams = tensors["streams"].numpy().tobytes()
    extra = {k: v for k, v in meta.items() if not k.startswith("deltastore.codec")}
    hdr = codec._header_ints(tensors["header"].numpy().tobytes())
    hdr[-1] += 1  # the last tensor's R stream one byte longer than it holds
    from deltastore.codecs import _bits as B
    bad = pack_meta({"header": u8(B.uvarint_encode(np.array(hdr, np.uint64))), "streams": u8(streams + b"\0")},
                    "ctx", "1.0", extra)
    target = {u.spec.name: u.old_tensor.clone() for u in ups}
    rx = _Receiver(target)
    with pytest.raises(CorruptObjectError):
        codec.decode_batch(bad, [u.spec for u in ups], rx)
    assert bool(rx.offered.done[:-1].all()) and not bool(rx.offered.done[-1])
    last = sorted(u.spec.name for u in ups)[-1]
    assert torch.equal(target[last], next(u.old_tensor for u in ups if u.spec.name == last))  # untouched
    rx.offered.undo()
    assert all(torch.equal(target[u.spec.name], u.old_tensor) for u in ups)


def test_a_follower_pulls_ctx_deltas_in_place(monkeypatch, tmp_path, trace):
    """End to end: ``auto`` bytes first (every tensor ``ctx``), a follower one delta behind: the ctx part is
    written into its tensors in place, every version bit-exact."""
    import deltastore as ds
    from deltastore.codecs import ctx as C

    calls = []
    real = C.CtxCodec._write_in_place
    monkeypatch.setattr(C.CtxCodec, "_write_in_place", lambda self, jobs, target: calls.append(len(jobs)) or
                        real(self, jobs, target))
    state = {n: t.clone() for n, t in list(trace.base.items())[:6]}
    pub = ds.Publisher(str(tmp_path), codec={"id": "auto", "config": {"link_mbps": None}}, anchor_every=100)
    sub = ds.Subscriber(str(tmp_path))
    pub.publish(state, step=0)
    target = sub.pull(step=0).state
    for step in (1, 2, 3):
        for n, (idx, new) in trace.changes(step).items():
            if n in state:
                state[n].view(torch.int16).reshape(-1)[idx] = new
        pub.publish(state, step=step)
        sub.pull(target, step=step)
        assert all(torch.equal(target[n].view(torch.int16), state[n].view(torch.int16)) for n in state)
    assert calls, "the ctx part was not written in place"
    pub.close()
    sub.close()
