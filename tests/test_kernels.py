"""The compiled kernels against plain numpy references (exact equality, many shapes, forced chunking)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore.codecs import _bits as B
from deltastore.codecs import _common
from deltastore.codecs.base import TensorSpec, Update
from deltastore.codecs.ctx import CtxCodec
from deltastore.errors import CorruptObjectError
from deltastore.kernels import bitstream as K
from deltastore.kernels import parallel
from deltastore.kernels import ranks as R


@pytest.fixture(params=[1, 3], ids=["one-thread", "three-threads"])
def small_chunks(request, monkeypatch):
    """Chunks of 1000 elements on 1 or 3 threads, so chunk boundaries and prefixes are exercised."""
    monkeypatch.setenv("DELTASTORE_THREADS", str(request.param))
    monkeypatch.setattr(R, "_MIN_CHUNK", 1000)
    return request.param


# -- bit streams: the numpy formulation the format was defined with ------------------------
def ref_pack_unary(q: np.ndarray) -> bytes:
    if q.size == 0:
        return b""
    ones = np.cumsum(q + 1) - 1
    bits = np.zeros(int(ones[-1]) + 1, dtype=np.uint8)
    bits[ones] = 1
    return np.packbits(bits).tobytes()


def ref_pack_raw(w: np.ndarray, r: np.ndarray) -> bytes:
    total = int(w.sum())
    if total == 0:
        return b""
    bits = []
    for width, value in zip(w.tolist(), r.tolist()):
        bits += [(value >> (width - 1 - j)) & 1 for j in range(width)]
    return np.packbits(np.array(bits, dtype=np.uint8)).tobytes()


def ref_best_kind(v: np.ndarray) -> tuple[B.Kind, int]:
    v = v.astype(np.uint64)
    n, maxbits = v.size, int(v.max()).bit_length()
    best = (B.Kind(B.EG, 0), None)
    for k in range(min(maxbits, 63) + 1):
        cost = sum(int(x) >> k for x in v) + n * (k + 1)
        if best[1] is None or cost < best[1]:
            best = (B.Kind(B.RICE, k), cost)
    if maxbits >= 62:
        return best
    for k in range(min(maxbits, 40) + 1):
        cost = sum(2 * ((int(x) + (1 << k)).bit_length() - 1) - k + 1 for x in v)
        if best[1] is None or cost < best[1]:
            best = (B.Kind(B.EG, k), cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_bit_streams_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400))
    q = rng.geometric(0.3, n).astype(np.int64) - 1
    assert B.pack_unary(q) == ref_pack_unary(q)
    got = B.unpack_unary(B.pack_unary(q), n)
    assert np.array_equal(got, q)
    w = rng.integers(0, 65, n).astype(np.int64)
    r = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, n, dtype=np.uint64)
    r = np.where(w == 64, r, r & ((np.uint64(1) << w.astype(np.uint64)) - np.uint64(1)))
    data = B.pack_raw(w, r)
    assert data == ref_pack_raw(w, r)
    assert np.array_equal(B.unpack_raw(data, w), r)


def test_truncated_streams_are_typed_errors():
    q = np.array([3, 0, 5], np.int64)
    with pytest.raises(CorruptObjectError):
        B.unpack_unary(B.pack_unary(q)[:1], 3)
    with pytest.raises(CorruptObjectError):
        B.unpack_raw(b"\x00", np.array([9], np.int64))
    with pytest.raises(CorruptObjectError):
        B.unpack_raw(b"\x00" * 16, np.array([65], np.int64))


@pytest.mark.parametrize("values", [
    [0], [1], [0, 0, 0], [5000, 1, 70000], list(range(50)), [2**40, 3], [2**62 + 5, 1], [2**63, 2**64 - 1],
], ids=lambda v: f"{len(v)}-values")
def test_best_kind_is_the_exact_argmin(values):
    v = np.array(values, dtype=np.uint64)
    assert B.best_kind(v) == ref_best_kind(v)


def test_best_kind_on_geometric_gaps(small_chunks):
    rng = np.random.default_rng(7)
    for mean in (1.5, 40, 3000, 70000):
        v = rng.geometric(1 / mean, 3000).astype(np.uint64)
        assert B.best_kind(v) == ref_best_kind(v)


# -- ranks and select within buckets --------------------------------------------------------
def bf16_like(n: int, rng: np.random.Generator) -> np.ndarray:
    exp = np.clip(rng.normal(118, 4, n).astype(np.int64), 0, 255)
    return ((exp << 7) | rng.integers(0, 128, n) | (rng.integers(0, 2, n) << 15)).astype(np.uint16).view(np.int16)


@pytest.mark.parametrize("ncuts", [1, 2, 3, 5, 15])
@pytest.mark.parametrize("density", [0.001, 0.05, 0.6])
def test_bucket_ranks_and_select_match_numpy(ncuts, density, small_chunks):
    rng = np.random.default_rng(ncuts * 100 + int(density * 1000))
    n = 9_973
    bits = bf16_like(n, rng)
    mask, shift = 0x7FFF, 7
    cls = (bits.astype(np.int64) & mask) >> shift
    cut_classes = np.sort(rng.choice(np.arange(100, 140), ncuts, replace=False))
    lut = np.searchsorted(cut_classes, np.arange(256), side="right").astype(np.int64)
    bucket_of_all = lut[cls]
    pos = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    bucket, rank, sizes = R.bucket_ranks(bits, pos, mask, shift, lut, ncuts + 1)
    for b in range(ncuts + 1):
        members = np.flatnonzero(bucket_of_all == b)
        assert sizes[b] == members.size
        sel = bucket == b
        assert np.array_equal(rank[sel], np.searchsorted(members, pos[sel]))
    assert np.array_equal(bucket, bucket_of_all[pos])
    bk = R.Buckets(bits, mask, shift, lut, ncuts + 1)
    assert np.array_equal(bk.sizes, sizes)
    found = R.bucket_select(bk, [rank[bucket == b] for b in range(ncuts + 1)])
    assert found is not None
    got, src = found
    assert np.array_equal(got, pos)
    order = np.concatenate([np.flatnonzero(bucket == b) for b in range(ncuts + 1)])
    assert np.array_equal(order[src], np.arange(pos.size))


def test_select_of_a_rank_beyond_its_bucket_is_refused(small_chunks):
    rng = np.random.default_rng(3)
    bits = bf16_like(5000, rng)
    lut = np.searchsorted(np.array([118]), np.arange(256), side="right").astype(np.int64)
    bk = R.Buckets(bits, 0x7FFF, 7, lut, 2)
    assert R.bucket_select(bk, [np.array([int(bk.sizes[0])]), np.zeros(0, np.int64)]) is None


def test_class_counts_exact_and_sampled():
    rng = np.random.default_rng(5)
    bits = bf16_like(100_000, rng)
    exact = np.bincount((bits.astype(np.int64) & 0x7FFF) >> 7, minlength=256)
    assert np.array_equal(R.class_counts(bits, 0x7FFF, 7, 256), exact)
    assert np.array_equal(R.class_counts(bits, 0x7FFF, 7, 256, stride=16),
                          np.bincount((bits[::16].astype(np.int64) & 0x7FFF) >> 7, minlength=256) * 16)


def test_parallel_each_and_chunked_cover_everything(monkeypatch):
    monkeypatch.setenv("DELTASTORE_THREADS", "3")
    assert parallel.each(5, lambda i: i * i) == [0, 1, 4, 9, 16]
    spans = parallel.chunked(10, lambda s, e: (s, e), min_chunk=2)
    assert spans[0][0] == 0 and spans[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert parallel.chunked(0, lambda s, e: (s, e)) == []


# -- ctx end to end through the kernels ----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_ctx_round_trip_across_chunks(dtype, small_chunks):
    g = torch.Generator().manual_seed(11)
    old = (torch.randn(20_000, generator=g) * 0.02).to(dtype)
    new = old.clone()
    pos = torch.randperm(old.numel(), generator=g)[:700].sort().values
    new[pos] = (old[pos].float() * 1.01 + 1e-4).to(dtype)
    from deltastore.tensors import bits_view
    ob, nb = bits_view(old), bits_view(new)
    pos = torch.ne(ob, nb).nonzero().squeeze(1)
    spec = TensorSpec("w", dtype, (old.numel(),))
    for buckets in (1, 4, 16):
        codec = CtxCodec(buckets=buckets)
        data = codec.encode([Update(spec, nb[pos].clone(), pos, ob[pos].clone(), ob)])
        out = codec.decode(data, [spec], lambda name, p: ob if p is None else ob[p])["w"]
        assert torch.equal(out.positions, pos) and torch.equal(out.bits, nb[pos])


def test_ctx_threshold_inside_an_exponent_class_is_corrupt():
    from deltastore.codecs._common import pack_meta, names_digest, u8
    spec = TensorSpec("w", torch.bfloat16, (64,))
    # 2 buckets, threshold 5 (not a multiple of 2**7), both buckets empty, empty streams
    header = B.uvarint_encode(np.array([2, 5, 0, 0, 0, 0], dtype=np.uint64))
    data = pack_meta({"header": u8(header), "streams": u8(b"")}, "ctx", "1.0",
                     {"deltastore.names": names_digest(["w"])})
    old = torch.zeros(64, dtype=torch.int16)
    with pytest.raises(CorruptObjectError, match="inside an exponent class"):
        CtxCodec().decode(data, [spec], lambda name, p: old if p is None else old[p])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int16, torch.int64, torch.uint8, torch.bool])
def test_gather_and_scatter_match_indexing(dtype):
    from deltastore.kernels.gather import gather, scatter_
    from deltastore.tensors import bits_view
    g = torch.Generator().manual_seed(2)
    flat = (torch.randn(5000, generator=g) * 100).to(dtype)
    pos = torch.randperm(5000, generator=g)[:321].sort().values
    got = gather(flat, pos)
    assert got.dtype == flat.dtype and torch.equal(bits_view(got), bits_view(flat[pos]))
    values = (torch.randn(321, generator=g) * 100).to(dtype)
    want = flat.clone()
    want[pos] = values
    scatter_(flat, pos, values)
    assert torch.equal(bits_view(flat), bits_view(want))


def ref_uvarint(values: list[int]) -> bytes:
    out = bytearray()
    for x in values:
        while x >= 0x80:
            out.append((x & 0x7F) | 0x80)
            x >>= 7
        out.append(x)
    return bytes(out)


def test_uvarint_matches_the_reference_and_refuses_bad_streams():
    rng = np.random.default_rng(9)
    values = [0, 1, 127, 128, 300, 2**63, 2**64 - 1] + [int(x) for x in rng.integers(0, 2**40, 200)]
    data = B.uvarint_encode(np.array(values, dtype=np.uint64))
    assert data == ref_uvarint(values)
    got, used = B.uvarint_decode(data + b"\x05", len(values))
    assert got.tolist() == values and used == len(data)
    with pytest.raises(CorruptObjectError, match="holds"):
        B.uvarint_decode(data[:-1], len(values))
    with pytest.raises(CorruptObjectError, match="longer than 10"):
        B.uvarint_decode(b"\xff" * 11 + b"\x01", 1)


def test_kernels_are_compiled_modules_and_bring_no_jit():
    """The kernels are the installed extension modules: importing them loads no compiler (numba, llvmlite)."""
    import subprocess
    import sys

    from deltastore.kernels import _bitstream, _checksum, _diff, _merge, _planes, _ranks

    for mod in (_bitstream, _checksum, _diff, _merge, _planes, _ranks):
        assert mod.__file__.endswith((".so", ".pyd")), mod.__file__
    probe = ("import sys, deltastore.kernels.diff, deltastore.kernels.bitstream, deltastore.kernels.ranks, "
             "deltastore.kernels.planes, deltastore.kernels.merge, deltastore.kernels.checksum; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def ref_zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64)
    return ((d << 1) ^ (d >> 63)).view(np.uint64)


@pytest.mark.parametrize("dtype,is_float", [(np.int16, True), (np.int32, True), (np.int64, True), (np.int16, False),
                                            (np.int64, False), (np.uint8, False)])
def test_ulp_steps_match_the_ordered_image(dtype, is_float):
    rng = np.random.default_rng(4)
    info = np.iinfo(dtype)
    old = rng.integers(info.min, info.max, 5000, dtype=dtype, endpoint=True)
    new = rng.integers(info.min, info.max, 5000, dtype=dtype, endpoint=True)
    new[:2000] = (old[:2000].astype(np.int64) + rng.choice([-2, -1, 1, 3], 2000)).astype(dtype)  # small steps
    want = ref_zigzag(B.ordered(new, is_float) - B.ordered(old, is_float)) - np.uint64(1)
    every = np.ascontiguousarray(want.astype("<u8").view(np.uint8).reshape(-1, 8).T)
    fewest = max(1, (int(want.max()).bit_length() + 7) // 8)
    planes = K.step_planes(new, old, is_float)
    assert planes.shape == (fewest, new.size) and np.array_equal(planes, every[:fewest])
    assert not every[fewest:].any()
    bits, bad = K.apply_steps(old, planes, is_float)
    assert bad == -1 and np.array_equal(bits, new)
    up = np.array([3], dtype=dtype)
    one = K.step_planes(up + np.array([1], dtype=dtype), up, is_float)  # one ulp up: zigzag(1) - 1 = 1, one plane
    assert one.tolist() == [[1]] and K.step_planes(new[:0], old[:0], is_float).shape == (0, 0)


def test_ulp_steps_out_of_range_are_reported():
    old = np.array([0x7FFF, 5], dtype=np.int16)  # the largest positive bf16 pattern, one step up is out of range
    z = np.array([ref_zigzag(np.array([1]))[0] - np.uint64(1), 0], dtype=np.uint64)
    planes = np.ascontiguousarray(z.astype("<u8").view(np.uint8).reshape(-1, 8).T)
    _, bad = K.apply_steps(old, planes, True)
    assert bad == 0


def _in_place_case(dtype, nplanes, seed, n_tensors=40):
    """Tensors, sorted positions in each, and step planes whose results stay in range."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 20000, n_tensors)
    lo, hi = (60, 190) if dtype == np.uint8 else (100, 16000)  # positive patterns, far from the range's ends
    arrays = [rng.integers(lo, hi, int(n)).astype(dtype) for n in lens]
    pos = [np.sort(rng.choice(int(n), int(rng.integers(0, min(n, 9000))), replace=False)) for n in lens]
    bounds = np.concatenate([[0], np.cumsum([p.size for p in pos])]).astype(np.int64)
    planes = np.zeros((nplanes, int(bounds[-1])), np.uint8)
    planes[0] = rng.integers(0, 40, planes.shape[1])  # steps of +-20 at most
    return arrays, np.concatenate(pos).astype(np.int64), bounds, planes


def _addresses(arrays):
    return np.array([a.ctypes.data for a in arrays], np.int64), np.array([a.size for a in arrays], np.int64)


def _steps_in_place(arrays, positions, bounds, planes, is_float, gaps=None, slot=None, keys=None):
    """A :class:`K.StepsInPlace` over ``arrays`` (their positions as a gap stream, unless ``gaps`` is given)
    and the buffers it fills."""
    counts = np.diff(bounds)
    if gaps is None:
        gaps = np.frombuffer(K.gap_stream([positions[bounds[i]:bounds[i + 1]] for i in range(len(counts))]), np.uint8)
    k = len(arrays)
    done, sums = np.zeros(k, np.bool_), np.zeros(k, np.uint64)
    keys = np.arange(1, k + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) if keys is None else keys
    steps = K.StepsInPlace(*_addresses(arrays), keys, done, sums, counts, gaps, planes, arrays[0].dtype, is_float,
                           slot)
    return steps, done, sums, keys


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype,is_float,nplanes", [(np.int16, True, 1), (np.int16, False, 2), (np.uint8, False, 1),
                                                    (np.int32, True, 3), (np.int64, True, 8)])
def test_ulp_steps_in_place_match_gather_step_scatter(monkeypatch, threads, dtype, is_float, nplanes):
    """One pass over the gap stream writes what decoding the positions, gathering, stepping and scattering
    would and sums the checksum change the separate pass computes; undo steps everything back."""
    from deltastore import segments

    monkeypatch.setenv("DELTASTORE_THREADS", str(threads))
    arrays, positions, bounds, planes = _in_place_case(dtype, nplanes, seed=nplanes)
    before = [a.copy() for a in arrays]
    want_old = np.concatenate([a[positions[bounds[i]:bounds[i + 1]]] for i, a in enumerate(arrays)])
    want_new, want_bad = K.apply_steps(want_old, planes, is_float)
    assert want_bad == -1
    steps, done, sums, keys = _steps_in_place(arrays, positions, bounds, planes, is_float)
    assert threads == 1 or len(steps.runs) > 1  # the runs' starts come from the scan
    assert steps.run() == (0, -1) and done.all()
    for i, (a, b) in enumerate(zip(arrays, before)):
        b[positions[bounds[i]:bounds[i + 1]]] = want_new[bounds[i]:bounds[i + 1]]
        assert np.array_equal(a, b), i
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    want_sums = segments.mix_delta(torch.from_numpy(positions), torch.from_numpy(want_old.view(unsigned)),
                                   torch.from_numpy(want_new.view(unsigned)), bounds, keys)
    assert np.array_equal(sums, want_sums)
    steps.undo()
    assert all(np.array_equal(a, b) for a, b in zip(arrays, _in_place_case(dtype, nplanes, seed=nplanes)[0]))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("fault,status", [("past the end", 3), ("value out of range", 4), ("varint over 10 bytes", 2),
                                          ("truncated", 1), ("trailing bytes", 5)])
def test_ulp_steps_in_place_write_a_tensor_whole_or_not_at_all(monkeypatch, threads, fault, status):
    monkeypatch.setenv("DELTASTORE_THREADS", str(threads))
    arrays, positions, bounds, planes = _in_place_case(np.int16, 1, seed=7)
    counts = np.diff(bounds)
    bad_t = int(np.flatnonzero(counts > 5)[len(np.flatnonzero(counts > 5)) // 2])
    if fault == "truncated" or fault == "trailing bytes":
        bad_t = len(arrays) - 1 if counts[-1] else int(np.flatnonzero(counts)[-1])
    lo, hi = int(bounds[bad_t]), int(bounds[bad_t + 1])
    j = lo + 3  # a few items into that tensor: those are written, then must be put back
    if fault == "past the end":
        positions[hi - 1] = arrays[bad_t].size
    elif fault == "value out of range":
        arrays[bad_t][positions[j]] = 0x7FFF  # the largest positive pattern: any step up leaves the range
        planes[0, j] = 1  # zigzag(+1) - 1
    elif fault == "varint over 10 bytes":
        positions[lo] = 0  # a one-byte first value, replaced by eleven bytes
    before = [a.copy() for a in arrays]
    gaps = K.gap_stream([positions[bounds[i]:bounds[i + 1]] for i in range(len(counts))])
    if fault == "varint over 10 bytes":
        at = int(K._gap_offsets(np.frombuffer(gaps, np.uint8), np.array([lo], np.int64))[0])
        gaps = gaps[:at] + b"\x80" * 10 + b"\x00" + gaps[at + 1:]
    elif fault == "truncated":
        gaps = gaps[:-1]
    elif fault == "trailing bytes":
        gaps = gaps + b"\x00"
    steps, done, _, _ = _steps_in_place(arrays, positions, bounds, planes, True, gaps=np.frombuffer(gaps, np.uint8))
    got, seg = steps.run()
    assert got == status and not done[bad_t] or fault == "trailing bytes" and got == 5
    if fault != "trailing bytes":
        assert seg == bad_t and np.array_equal(arrays[bad_t], before[bad_t])  # the failing tensor is as it was
    steps.undo()  # stepping the done tensors back undoes everything
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))


def test_ulp_steps_in_place_skip_the_segments_of_another_kind(monkeypatch):
    """With a slot map, segments marked -1 are read past and left alone: an object of two element kinds
    takes one pass per kind over the same stream."""
    monkeypatch.setenv("DELTASTORE_THREADS", "3")
    arrays, positions, bounds, planes = _in_place_case(np.int16, 1, seed=11)
    before = [a.copy() for a in arrays]
    mine = list(range(0, len(arrays), 2))
    slot = np.full(len(arrays), -1, np.int64)
    slot[mine] = np.arange(len(mine))
    gaps = np.frombuffer(K.gap_stream([positions[bounds[i]:bounds[i + 1]] for i in range(len(arrays))]), np.uint8)
    chosen = [arrays[i] for i in mine]
    steps, done, _, _ = _steps_in_place(chosen, positions, bounds, planes, True, gaps=gaps, slot=slot)
    assert steps.run() == (0, -1) and done.all()
    for i, (a, b) in enumerate(zip(arrays, before)):
        want = b.copy()
        if i in mine:
            got, _ = K.apply_steps(b[positions[bounds[i]:bounds[i + 1]]], planes[:, bounds[i]:bounds[i + 1]], True)
            want[positions[bounds[i]:bounds[i + 1]]] = got
        assert np.array_equal(a, want), i
    steps.undo()
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))


def test_ulp_steps_in_place_refuse_arrays_that_do_not_fit_before_writing():
    arrays, positions, bounds, planes = _in_place_case(np.int16, 1, seed=3, n_tensors=4)
    before = [a.copy() for a in arrays]
    ptr, lens = _addresses(arrays)
    counts = np.diff(bounds)
    gaps = np.frombuffer(K.gap_stream([positions[bounds[i]:bounds[i + 1]] for i in range(4)]), np.uint8)
    keys, sums, done = np.zeros(4, np.uint64), np.zeros(4, np.uint64), np.zeros(4, np.bool_)
    i16 = np.dtype(np.int16)
    for args in [(ptr, lens, keys, done, sums, counts[:-1], gaps, planes, i16),
                 (ptr, lens, keys, done, sums, counts, gaps, planes[:, 1:], i16),
                 (ptr, lens[:-1], keys, done, sums, counts, gaps, planes, i16),
                 (ptr, lens, keys, done, sums.astype(np.int64), counts, gaps, planes, i16),
                 (ptr, lens, keys, done.astype(np.int8), sums, counts, gaps, planes, i16),
                 (ptr, lens, keys, done, sums, counts, gaps.astype(np.int16), planes, i16),
                 (ptr, lens, keys, done, sums, counts, gaps, planes, np.dtype(np.float32))]:
        with pytest.raises(ValueError, match="do not fit"):
            K.StepsInPlace(*args, True)
    with pytest.raises(ValueError, match="do not fit"):  # a slot naming a tensor twice
        K.StepsInPlace(ptr, lens, keys, done, sums, counts, gaps, planes, i16, True, np.array([0, 0, 1, 2]))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before)) and not done.any()


def test_parallel_each_raises_only_after_every_piece_finished(monkeypatch):
    import threading
    import time

    monkeypatch.setenv("DELTASTORE_THREADS", "3")
    finished = []
    lock = threading.Lock()

    def piece(i):
        if i == 2:
            raise ValueError("bad piece")  # the caller's own piece fails at once
        time.sleep(0.2)
        with lock:
            finished.append(i)
        return i

    with pytest.raises(ValueError, match="bad piece"):
        parallel.each(3, piece)
    assert sorted(finished) == [0, 1]  # the others had finished before the error surfaced


@pytest.fixture(params=["plain", "mixed"])
def gap_reader(request, monkeypatch):
    """Each of the two gap-stream readers, forced whatever the stream's bytes per position."""
    monkeypatch.setattr(K, "MIXED_BYTES_PER_POSITION", 1e9 if request.param == "plain" else -1.0)
    return request.param


@pytest.mark.parametrize("seed", range(4))
def test_gap_positions_match_the_numpy_formulation(seed, gap_reader):
    rng = np.random.default_rng(seed)
    numels = rng.integers(1, 5000, size=7)
    numels[2] = 1 << 40  # a huge tensor: gaps beyond 32 bits
    segs = [np.sort(rng.choice(min(int(n), 10**6), size=rng.integers(0, min(int(n), 300) + 1), replace=False))
            for n in numels]
    segs[2] = np.sort(rng.choice(1 << 40, size=50, replace=False))
    stream = _common.encode_positions(segs)
    got, status, seg, used = K.gap_positions(stream, [s.size for s in segs], numels)
    assert (status, used) == (0, len(stream))
    assert np.array_equal(got, np.concatenate(segs))
    flat, bounds = _common.decode_positions(stream, [s.size for s in segs], list(numels), "t")
    assert all(np.array_equal(flat[a:b], s) for a, b, s in zip(bounds[:-1], bounds[1:], segs))


def test_gap_positions_refuse_bad_streams(gap_reader):
    ok = _common.encode_positions([np.array([3, 9])])
    with pytest.raises(CorruptObjectError, match="fewer than"):
        _common.decode_positions(ok[:-1], [2], [10], "t")
    with pytest.raises(CorruptObjectError, match="longer than 10 bytes"):
        _common.decode_positions(b"\x80" * 11 + b"\x01", [1], [10], "t")
    with pytest.raises(CorruptObjectError, match="beyond the tensor"):  # 3, then 3 + 1 + 5 = 9 >= numel 9
        _common.decode_positions(ok, [2], [9], "t")
    with pytest.raises(CorruptObjectError, match="beyond the tensor"):  # a gap near 2**64 must not wrap
        _common.decode_positions(B.uvarint_encode(np.array([3, 2**64 - 2], np.uint64)), [2], [10], "t")
    with pytest.raises(CorruptObjectError, match="trailing bytes"):
        _common.decode_positions(ok + b"\x00", [2], [10], "t")


@pytest.mark.parametrize("seed", range(6))
def test_the_two_gap_readers_agree_on_any_stream(seed):
    """Valid streams of every gap size, then the same streams cut, corrupted and overrun: both readers give
    the same positions, status, segment and bytes used."""
    rng = np.random.default_rng(seed)
    spans = [1 << 7, 1 << 14, 1 << 21, 1 << 40]
    numels = rng.choice(spans, size=9) + rng.integers(0, 100, size=9)
    segs = [np.unique(rng.integers(0, int(n), size=int(rng.integers(0, 200)))) for n in numels]
    stream = np.frombuffer(_common.encode_positions(segs), np.uint8)
    counts = np.array([s.size for s in segs], np.int64)
    variants = [stream, stream[:-1], stream[: stream.size // 2], np.concatenate([stream, [0x80] * 12])]
    for _ in range(20):
        v = stream.copy()
        v[rng.integers(0, max(1, v.size), size=3)] = rng.integers(0, 256, size=3)
        variants.append(v)
    for v in variants:
        for lims in (numels, numels // 2 + 1):
            a, b = np.empty(int(counts.sum()), np.int64), np.empty(int(counts.sum()), np.int64)
            ra = K._gap_positions(v, counts, lims.astype(np.int64), a)
            rb = K._gap_positions_mixed(v, counts, lims.astype(np.int64), b)
            assert ra == rb
            done = int(counts[: ra[1]].sum()) if ra[0] else a.size  # positions complete before the failure
            assert np.array_equal(a[:done], b[:done])


# -- laying a delta over staged changes (kernels/merge.py through segments.merge_staged / overlay_staged) -------
def _segments(rng, sizes, numel=500):
    pos = [np.sort(rng.choice(numel, k, replace=False)).astype(np.int64) for k in sizes]
    return pos, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@pytest.mark.parametrize("threads", [1, 3])
def test_merge_staged_is_the_per_segment_union_the_delta_winning(monkeypatch, threads):
    from deltastore import segments
    from deltastore.kernels import diff

    monkeypatch.setenv("DELTASTORE_THREADS", str(threads))
    real_runs = diff.segment_runs  # runs of a few segments each, so several threads share the work
    monkeypatch.setattr(diff, "segment_runs", lambda bounds, pieces, min_chunk=1: real_runs(bounds, pieces, 1))
    rng = np.random.default_rng(threads)
    n = 40
    s_sizes, d_sizes = rng.integers(0, 60, n), rng.integers(0, 60, n)
    s_sizes[3] = d_sizes[5] = s_sizes[7] = d_sizes[7] = 0  # empty on either side, or both
    spos, sb = _segments(rng, s_sizes)
    dpos, db = _segments(rng, d_sizes)
    sbits = [rng.integers(0, 2**16, k).astype(np.uint16) for k in s_sizes]
    sorig = [rng.integers(0, 2**16, k).astype(np.uint16) for k in s_sizes]
    dbits = [rng.integers(0, 2**16, k).astype(np.uint16) for k in d_sizes]
    before = [rng.integers(0, 2**16, k).astype(np.uint16) for k in d_sizes]
    t = lambda xs, dt=torch.int16: torch.from_numpy(np.concatenate(xs).view(np.int16 if dt == torch.int16 else np.int64))
    got = segments.merge_staged((t(spos, torch.int64), t(sbits), t(sorig), sb), t(dpos, torch.int64), t(dbits),
                                t(before), db)
    want_pos, want_bits, want_orig, counts = [], [], [], []
    for s in range(n):
        table = {int(p): (int(b), int(o)) for p, b, o in zip(spos[s], sbits[s], sorig[s])}
        for p, b, o in zip(dpos[s], dbits[s], before[s]):
            table[int(p)] = (int(b), table[int(p)][1] if int(p) in table else int(o))
        keys = sorted(table)
        want_pos += keys
        want_bits += [table[k][0] for k in keys]
        want_orig += [table[k][1] for k in keys]
        counts.append(len(keys))
    assert got[0].tolist() == want_pos
    assert got[1].numpy().view(np.uint16).tolist() == want_bits
    assert got[2].numpy().view(np.uint16).tolist() == want_orig
    assert got[3].tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()

    old = torch.from_numpy(np.concatenate(before).view(np.int16)).clone()
    assert segments.overlay_staged((t(spos, torch.int64), t(sbits), sb), t(dpos, torch.int64), db, old)
    staged_at = [dict(zip(spos[s].tolist(), sbits[s].tolist())) for s in range(n)]
    want = [staged_at[s].get(int(p), int(o)) for s in range(n) for p, o in zip(dpos[s], before[s])]
    assert old.numpy().view(np.uint16).tolist() == want
    backwards = t([p[::-1].copy() for p in dpos], torch.int64)
    assert not segments.overlay_staged((t(spos, torch.int64), t(sbits), sb), backwards, db, old.clone())
