"""The checksum kernels give exactly the value of the original numpy formula (it is in every stored manifest)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore import checksum as cs
from deltastore.errors import TargetMismatchError
from deltastore.kernels import checksum as k
from deltastore.kernels import parallel

# --- the reference: deltastore 0.1's numpy implementation, kept verbatim -------------------------
_M64 = (1 << 64) - 1
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_CHUNK = 1 << 22
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _mix_sum(key: int, positions: np.ndarray, bits: np.ndarray) -> int:
    x = positions.astype(np.uint64) * _C1
    x ^= bits.view(_UNSIGNED[bits.dtype.itemsize]).astype(np.uint64)
    x += np.uint64(key)
    x ^= x >> _S30
    x *= _C2
    x ^= x >> _S27
    x *= _C3
    x ^= x >> _S31
    return int(x.sum(dtype=np.uint64))


def ref_sparse_sum(key: int, positions: torch.Tensor, bits: torch.Tensor) -> int:
    pos = positions.detach().to("cpu", torch.int64).numpy()
    b = bits.detach().cpu().numpy()
    total = 0
    for i in range(0, pos.size, _CHUNK):
        total += _mix_sum(key, pos[i:i + _CHUNK], b[i:i + _CHUNK])
    return total & _M64


def ref_full_checksum(name: str, tensor: torch.Tensor) -> int:
    from deltastore.tensors import bits_view

    flat = bits_view(tensor)
    key = cs.tensor_key(name)
    total = 0
    for i in range(0, flat.numel(), _CHUNK):
        chunk = flat[i:i + _CHUNK].cpu().numpy()
        total += _mix_sum(key, np.arange(i, i + chunk.size, dtype=np.uint64), chunk)
    return total & _M64
# -------------------------------------------------------------------------------------------------


DTYPES = [torch.uint8, torch.int8, torch.bool, torch.int16, torch.bfloat16, torch.float16,
          torch.int32, torch.float32, torch.int64, torch.float64]


def _random(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` elements of ``dtype`` with uniformly random bits (every bit pattern, NaN payloads included)."""
    g = np.random.default_rng(seed)
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(g.integers(0, 256, n * width, dtype=np.uint8))
    if dtype == torch.bool:
        return (raw & 1).view(torch.bool)
    if n == 0:
        return torch.empty(0, dtype=dtype)
    return raw.view(dtype)


@pytest.fixture
def threads(monkeypatch):
    monkeypatch.setenv("DELTASTORE_THREADS", "3")  # more pieces than the machine's cores: chunk seams


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, (1 << 19) + 13])
def test_full_checksum_matches_reference(dtype, n, threads):
    t = _random(dtype, n, seed=n)
    assert cs.full_checksum("model.layers.0.w", t) == ref_full_checksum("model.layers.0.w", t)


def test_full_checksum_across_the_old_chunk_boundary():
    # 2**22 was the reference's own chunk; the kernel's chunks are elsewhere: both must agree across it
    t = _random(torch.bfloat16, (1 << 22) + 5, seed=3)
    assert cs.full_checksum("emb", t) == ref_full_checksum("emb", t)


@pytest.mark.parametrize("start,stop", [(0, 0), (0, 1), (5, 9), (1 << 18, (1 << 19) + 3)])
def test_dense_kernel_ranges_sum_to_the_whole(start, stop):
    b = _random(torch.int16, (1 << 19) + 3, seed=1).numpy().view(np.uint16)
    key = np.uint64(0xDEADBEEFCAFEF00D)
    whole = int(k.mix_sum_dense(b, 0, b.size, key))
    parts = (int(k.mix_sum_dense(b, 0, start, key)) + int(k.mix_sum_dense(b, start, stop, key))
             + int(k.mix_sum_dense(b, stop, b.size, key))) & _M64
    assert parts == whole
    assert int(k.mix_sum_dense(b, start, stop, key)) == _mix_sum(int(key), np.arange(start, stop), b[start:stop])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 999, (1 << 19) + 1])
def test_sparse_sum_matches_reference(dtype, n, threads):
    g = np.random.default_rng(n)
    pos = torch.from_numpy(np.sort(g.choice(1 << 40, n, replace=False)).astype(np.int64))
    bits = _random(dtype, n, seed=n + 1)
    from deltastore.tensors import bits_view

    bits = bits_view(bits)
    key = cs.tensor_key("x")
    assert cs.sparse_sum(key, pos, bits) == ref_sparse_sum(key, pos, bits)


def test_sparse_sum_int32_positions_and_negative_wrap():
    pos64 = torch.tensor([0, 1, 2**31 - 1, -1, -(2**40)], dtype=torch.int64)
    bits = torch.tensor([1, -1, 7, -32768, 32767], dtype=torch.int16)
    key = cs.tensor_key("neg")
    assert cs.sparse_sum(key, pos64, bits) == ref_sparse_sum(key, pos64, bits)
    pos32 = pos64[:4].to(torch.int32)
    assert cs.sparse_sum(key, pos32, bits[:4]) == ref_sparse_sum(key, pos32, bits[:4])


def test_sparse_sum_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        cs.sparse_sum(1, torch.arange(3), torch.zeros(4, dtype=torch.int16))
    with pytest.raises(ValueError):
        cs.torch_mix_sum(1, torch.arange(3), torch.zeros(4, dtype=torch.int16))


def test_full_checksum_reads_in_place_and_refuses_non_contiguous():
    t = _random(torch.bfloat16, 4096, seed=9).reshape(64, 64)
    assert cs.full_checksum("t", t) == ref_full_checksum("t", t)
    with pytest.raises(TargetMismatchError):
        cs.full_checksum("t", t.t())
    # a view into a larger storage (a part) is hashed from its own first element
    assert cs.full_checksum("t", t[8:16]) == ref_full_checksum("t", t[8:16].clone())


def test_updated_checksum_equals_full_checksum_of_the_result():
    old = _random(torch.bfloat16, 100_000, seed=4)
    new = old.clone().view(torch.int16)
    pos = torch.tensor([0, 17, 500, 99_999])
    new[pos] += 1
    before = cs.full_checksum("w", old)
    after = cs.updated_checksum("w", before, pos, old.view(torch.int16)[pos], new[pos])
    assert after == cs.full_checksum("w", new) == ref_full_checksum("w", new)


# --- the torch path (what runs on CUDA), exercised on CPU tensors ---------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 3001])
def test_torch_path_matches_reference_dense(dtype, n, monkeypatch):
    monkeypatch.setattr(cs, "_TORCH_CHUNK", 1000)  # several device passes
    t = _random(dtype, n, seed=n + 7).to("cpu")
    from deltastore.tensors import bits_view

    key = cs.tensor_key("cuda.w")
    assert cs.torch_mix_sum(key, None, bits_view(t)) == ref_full_checksum("cuda.w", t)
    assert cs.torch_mix_sum(key, None, t) == ref_full_checksum("cuda.w", t)  # float tensors read as bits


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_torch_path_matches_reference_sparse(dtype, monkeypatch):
    monkeypatch.setattr(cs, "_TORCH_CHUNK", 100)
    g = np.random.default_rng(5)
    pos = torch.from_numpy(g.integers(-(1 << 62), 1 << 62, 777, dtype=np.int64))
    bits = _random(dtype, 777, seed=6)
    key = cs.tensor_key("y")
    before = pos.clone(), bits.clone()
    assert cs.torch_mix_sum(key, pos, bits) == ref_sparse_sum(key, pos, bits)
    assert torch.equal(pos, before[0]) and torch.equal(bits, before[1])  # inputs are never modified


def test_kernel_threads_split_work(monkeypatch):
    monkeypatch.setenv("DELTASTORE_THREADS", "2")
    assert len(parallel.bounds(1 << 20, cs._MIN_CHUNK)) == 2
    t = _random(torch.float32, 1 << 20, seed=11)
    assert cs.full_checksum("f", t) == ref_full_checksum("f", t)


def test_full_checksums_batch_equals_one_by_one(monkeypatch):
    monkeypatch.setattr(cs, "_MIN_CHUNK", 64)  # small and "large" (parallel) tensors both present
    items = [(f"t{i}", _random(dt, n, seed=i)) for i, (dt, n) in enumerate(
        (dt, n) for dt in DTYPES for n in (0, 1, 5, 100, 1000))]
    items.append(("view", _random(torch.bfloat16, 500, seed=99)[100:300]))
    want = [ref_full_checksum(name, t) for name, t in items]
    assert cs.full_checksums(items) == want
    assert [cs.full_checksum(name, t) for name, t in items] == want
    with pytest.raises(TargetMismatchError):
        cs.full_checksums([("nc", torch.zeros(4, 4, dtype=torch.int16).t())])


def test_sparse_sum_noncontiguous_and_device_agnostic_inputs():
    bits = _random(torch.int16, 2000, seed=5)[::2]  # not contiguous
    pos = torch.arange(0, 3000, 3)[:1000].to(torch.int32)[::1]
    key = cs.tensor_key("nc")
    assert cs.sparse_sum(key, pos, bits) == ref_sparse_sum(key, pos, bits.contiguous())
    assert cs.sparse_sum(key, pos, bits.view(torch.bfloat16)) == ref_sparse_sum(key, pos, bits.contiguous())
