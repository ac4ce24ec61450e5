"""The compare kernel (``_simd.h`` ``ds_diff_*``, every instruction set this CPU has) against numpy: bit-exact on
edge cases (sign crossings, -0.0 / +0.0, NaN payloads, changes at both ends of a range, ranges not on a block
boundary or an aligned address), full output buffers, and the fused advance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore import segments
from deltastore.checksum import sparse_sum, tensor_key
from deltastore.kernels import diff as K

UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ISAS = list(range(K.compare_isa() + 1))  # 0 SSE2 (or plain C), 1 AVX2, 2 AVX-512BW: those this CPU runs


def reference(old: np.ndarray, new: np.ndarray, a: int, b: int):
    idx = a + np.flatnonzero(old[a:b] != new[a:b])
    return idx, new[idx], old[idx]


def edge_pairs(width: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``old`` and ``new`` of ``n`` elements: random bits, and changes of every awkward kind placed at both ends
    of blocks and of the array (sign flips, -0/+0, NaN payloads, one and many ulp), plus random ones."""
    rng = np.random.default_rng(seed)
    dt = UNSIGNED[width]
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    new = old.copy()
    sign = dt(1) << dt(8 * width - 1)
    picks = {0, 1, n - 1, n - 2, 31, 32, 33, 63, 64, 65} | set(rng.integers(0, n, max(1, n // 37)).tolist())
    for k, p in enumerate(sorted(x for x in picks if 0 <= x < n)):
        kind = k % 5
        if kind == 0:
            new[p] = old[p] ^ sign                       # sign crossing (e.g. +0.0 -> -0.0)
        elif kind == 1:
            old[p], new[p] = dt(0), sign                 # +0 -> -0 (equal as floats, different bits)
        elif kind == 2:
            old[p] = dt(np.iinfo(dt).max)                # an all-ones NaN payload ...
            new[p] = old[p] ^ dt(1)                      # ... to another payload
        elif kind == 3:
            new[p:p + 1] = old[p:p + 1] + dt(1)          # one ulp (wraps at the top)
        else:
            new[p:p + 1] = old[p:p + 1] + dt(rng.integers(2, 200))  # many ulp
    return old, new


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 31, 64, 65, 1000, 4099])
def test_compare_range_matches_numpy(isa, width, n):
    old, new = edge_pairs(width, n, seed=n * 10 + width)
    rng = np.random.default_rng(n)
    for a, b in [(0, n), (1, n), (0, max(0, n - 1)), tuple(sorted(rng.integers(0, n + 1, 2).tolist()))]:
        want = reference(old, new, a, b)
        pos = np.empty(n + 1, np.int64)
        nw, od = np.empty(n + 1, old.dtype), np.empty(n + 1, old.dtype)
        c, nxt = K.compare_range(old, new, a, b, pos, nw, od, isa)
        assert nxt == b
        np.testing.assert_array_equal(pos[:c], want[0])
        np.testing.assert_array_equal(nw[:c], want[1])
        np.testing.assert_array_equal(od[:c], want[2])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", [1, 2, 8])
def test_compare_range_unaligned_views(isa, width):
    """Ranges that start at every offset of a block and arrays whose address is not 64-byte aligned."""
    old, new = edge_pairs(width, 700, seed=width)
    for shift in (1, 3):
        o, nn = old[shift:], new[shift:]
        for a in range(0, 70, 7):
            want = reference(o, nn, a, o.size)
            pos = np.empty(o.size, np.int64)
            nw, od = np.empty(o.size, o.dtype), np.empty(o.size, o.dtype)
            c, nxt = K.compare_range(o, nn, a, o.size, pos, nw, od, isa)
            assert (c, nxt) == (want[0].size, o.size)
            np.testing.assert_array_equal(pos[:c], want[0])
            np.testing.assert_array_equal(od[:c], want[2])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cap", [0, 1, 5, 33, 100])
def test_compare_range_stops_when_the_output_is_full(isa, cap):
    """A full output stops the scan at the first change it cannot hold; resuming there gives the rest."""
    old, new = edge_pairs(2, 3000, seed=cap)
    want = reference(old, new, 0, old.size)[0]
    got, at = [], 0
    while at < old.size:
        pos = np.empty(cap, np.int64) if cap else np.empty(0, np.int64)
        nw, od = np.empty(cap, old.dtype), np.empty(cap, old.dtype)
        c, nxt = K.compare_range(old, new, at, old.size, pos, nw, od, isa)
        assert c <= cap
        if c < cap:
            assert nxt == old.size
        else:
            assert nxt == old.size or old[nxt] != new[nxt]  # stopped on a change it had no room for
        got += pos[:c].tolist()
        if cap == 0:
            assert nxt == (want[0] if want.size else old.size)
            return
        at = nxt
    assert got == want.tolist()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_compare_range_advance_writes_the_new_bits(isa, width):
    old, new = edge_pairs(width, 2049, seed=7 + width)
    keep = old.copy()
    want = reference(old, new, 5, 2000)
    pos = np.empty(old.size, np.int64)
    nw, od = np.empty(old.size, old.dtype), np.empty(old.size, old.dtype)
    c, _ = K.compare_range(old, new, 5, 2000, pos, nw, od, isa, advance=True)
    np.testing.assert_array_equal(od[:c], want[2])  # the old bits were read before they were overwritten
    expect = keep.copy()
    expect[5:2000] = new[5:2000]
    np.testing.assert_array_equal(old, expect)  # inside the range the new bits, outside it untouched


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("hint", [0.0, 0.5])
def test_diff_segments_matches_numpy_and_the_checksum(monkeypatch, width, hint):
    """Many tensors of one width, some empty, buffers that fill up (hint 0) on two threads: every change, in
    order, with each tensor's checksum delta."""
    monkeypatch.setenv("DELTASTORE_THREADS", "2")
    monkeypatch.setattr(segments, "MIN_CHUNK", 256)
    sizes = [0, 1, 63, 64, 1000, 5000, 17, 0, 3000]
    pairs = [edge_pairs(width, n, seed=i) if n else (np.zeros(0, UNSIGNED[width]),) * 2
             for i, n in enumerate(sizes)]
    names = [f"t{i}" for i in range(len(sizes))]
    keys = np.array([tensor_key(n) for n in names], np.uint64)
    olds = [segments.to_bits(o.copy()) for o, _ in pairs]
    news = [segments.to_bits(nw.copy()) for _, nw in pairs]
    fc = segments.diff_segments(olds, news, keys, hint=hint)
    for i, ((o, nw), ch) in enumerate(zip(pairs, fc.changes())):
        idx, nb, ob = reference(o, nw, 0, o.size)
        np.testing.assert_array_equal(ch.positions.numpy(), idx)
        np.testing.assert_array_equal(segments.unsigned(ch.new_bits), nb)
        np.testing.assert_array_equal(segments.unsigned(ch.old_bits), ob)
        pos = torch.from_numpy(idx.astype(np.int64))
        delta = (sparse_sum(int(keys[i]), pos, segments.to_bits(nb)) -
                 sparse_sum(int(keys[i]), pos, segments.to_bits(ob))) % 2**64
        assert int(fc.sums[i]) == delta


@pytest.mark.parametrize("rate", [1, 3, 7])
@pytest.mark.parametrize("width", [1, 2, 8])
def test_sample_stream_keeps_the_sampled_positions_in_order(rate, width):
    """The kernel behind a sampled drift: a stream held in parts of any lengths (some empty), rows straddling
    parts, empty rows, positions at both ends of the int64 range: what ``drift.sampled`` keeps, row by row."""
    from deltastore.publish.drift import sampled

    rng = np.random.default_rng(rate * 10 + width)
    dt = UNSIGNED[width]
    pos = np.concatenate([np.array([0, 1, 2**31 - 1, 2**31, 2**62], np.int64),
                          np.sort(rng.integers(0, 2**40, 5000))])
    old = rng.integers(0, np.iinfo(dt).max, pos.size, dtype=dt, endpoint=True)
    new = old ^ dt(1)
    cuts = [0, 0, 3, 1000, 1000, 2500, pos.size]
    parts = [(pos[a:b].copy(), old[a:b].copy(), new[a:b].copy()) for a, b in zip(cuts, cuts[1:])]
    bounds = np.array([0, 0, 4, 900, 2501, 2501, pos.size], np.int64)
    at = [np.array([p[j].ctypes.data for p in parts], np.int64) for j in range(3)]
    lens = np.array([p[0].size for p in parts], np.int64)
    out = np.empty(pos.size + 1, np.int64), np.empty(pos.size + 1, dt), np.empty(pos.size + 1, dt)
    ob = np.empty(bounds.size, np.int64)
    kept = K.sample_stream(old[:0], *at, lens, bounds, rate, *out, ob)
    m = sampled(pos, rate)
    np.testing.assert_array_equal(out[0][:kept], pos[m])
    np.testing.assert_array_equal(out[1][:kept], old[m])
    np.testing.assert_array_equal(out[2][:kept], new[m])
    np.testing.assert_array_equal(ob, np.concatenate([[0], np.cumsum(m)])[bounds])
    with pytest.raises(ValueError):
        K.sample_stream(old[:0], *at, lens, bounds, rate, out[0][:10], out[1], out[2], ob)
