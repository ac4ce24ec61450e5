"""The checkpoint -> vLLM-parameter mapping and the sparse in-place apply, on CPU tensors, without vLLM.

The fake model copies what vLLM's stock loaders do (fused q/k/v and gate/up,
tensor-parallel narrowing, padded vocabulary); every check compares bits.
"""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from deltastore.checksum import full_checksum
from deltastore.errors import ChecksumMismatchError, CorruptObjectError, TargetMismatchError
from deltastore.integrations.vllm import VllmApplier, combine_verify
from deltastore.integrations.vllm.mapping import Block, probe, reload_groups
from deltastore.integrations.vllm.stage import stage

from .fake_vllm_model import FakeVllmModel, checkpoint_specs, loaded_model, perturb, random_checkpoint


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


def params_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(m.named_parameters())


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = params_of(a), params_of(b)
    return pa.keys() == pb.keys() and all(torch.equal(bits(pa[n]), bits(pb[n])) for n in pa)


def snapshot(m: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    return {n: (p.data_ptr(), bits(p).clone()) for n, p in m.named_parameters()}


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_probe_writes_nothing_and_maps_every_tensor(tp, rank):
    ckpt = random_checkpoint()
    m = loaded_model(ckpt, tp, rank)
    before = snapshot(m)
    pmap = probe(m.load_weights, params_of(m), checkpoint_specs())
    assert not pmap.unmapped
    assert all(pmap.blocks[n] for n in checkpoint_specs())
    after = snapshot(m)
    assert before.keys() == after.keys()
    for n in before:
        assert before[n][0] == after[n][0]
        assert torch.equal(before[n][1], after[n][1]), n


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_gather_reads_checkpoint_bits_through_fused_and_sharded_params(tp, rank):
    ckpt = random_checkpoint(1)
    m = loaded_model(ckpt, tp, rank)
    pmap = probe(m.load_weights, params_of(m), checkpoint_specs())
    for name, t in ckpt.items():
        pos = torch.arange(t.numel())
        held, got = pmap.gather(name, pos)
        assert held.any()
        assert torch.equal(got[held], bits(t)[held]), name
        if tp == 1:
            assert bool(held.all()), name


def test_shards_cover_each_tensor_exactly_once_across_ranks():
    ckpt = random_checkpoint(2)
    models = [loaded_model(ckpt, 2, r) for r in range(2)]
    maps = [probe(m.load_weights, params_of(m), checkpoint_specs()) for m in models]
    for name, t in ckpt.items():
        pos = torch.arange(t.numel())
        held = [mp.gather(name, pos)[0] for mp in maps]
        total = held[0].to(torch.int64) + held[1].to(torch.int64)
        if t.dim() == 1 and "bias" not in name:  # norms are replicated on every rank
            assert bool((total == 2).all()), name
        else:
            assert bool((total == 1).all()), name


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_sparse_write_equals_a_fresh_load_bit_for_bit_and_keeps_storage(tp, rank):
    old = random_checkpoint(3)
    new = perturb(old, 0.05, seed=4)
    served = loaded_model(old, tp, rank)
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    pmap = probe(served.load_weights, params_of(served), checkpoint_specs())
    for name in old:
        pos = (bits(old[name]) != bits(new[name])).nonzero().squeeze(1)
        pmap.write(name, pos, bits(new[name])[pos])
    fresh = loaded_model(new, tp, rank)
    assert same_params(served, fresh)
    assert ptrs == {n: p.data_ptr() for n, p in served.named_parameters()}


def test_write_full_equals_a_fresh_load():
    a, b = random_checkpoint(5), random_checkpoint(6)
    served = loaded_model(a, 2, 0)
    pmap = probe(served.load_weights, params_of(served), checkpoint_specs())
    for name, t in b.items():
        pmap.write_full(name, bits(t))
    assert same_params(served, loaded_model(b, 2, 0))


def test_partial_checksums_combine_to_the_full_checksum():
    ckpt = random_checkpoint(7)
    reports = []
    for r in range(2):
        m = loaded_model(ckpt, 2, r)
        pmap = probe(m.load_weights, params_of(m), checkpoint_specs())
        tensors = {}
        for name, t in ckpt.items():
            s, count, finger = pmap.partial_checksum(name)
            tensors[name] = {"source": "served", "partial": f"{s:016x}", "count": count,
                             "fingerprint": f"{finger:016x}", "numel": t.numel(),
                             "expected": f"{full_checksum(name, t):016x}",
                             "ok": None if count != t.numel() else s == full_checksum(name, t)}
        reports.append({"step": 1, "tensors": tensors})
    assert combine_verify(reports)["ok"]
    reports[1]["tensors"]["model.layers.0.mlp.down_proj.weight"]["partial"] = "0" * 16
    assert combine_verify(reports)["bad"] == ["model.layers.0.mlp.down_proj.weight"]


def test_a_rearranging_loader_is_reported_unmappable():
    ckpt = random_checkpoint(8)
    m = FakeVllmModel(transpose_o_proj=True)
    m.load_weights(ckpt.items())
    pmap = probe(m.load_weights, params_of(m), checkpoint_specs())
    assert set(pmap.unmapped) == {f"model.layers.{i}.{m}.weight" for i in range(2)
                                  for m in ("self_attn.o_proj", "mlp.down_proj")}
    with pytest.raises(TargetMismatchError):
        pmap.check_layout([("model.layers.0.self_attn.o_proj.weight", torch.bfloat16, (16, 16))])


def test_block_locate_rejects_positions_outside():
    b = Block("p", (3, 4), hf_offset=8, hf_strides=(8, 1), p_offset=100, p_strides=(4, 1))
    b.check()
    sel, ppos = b.locate(torch.tensor([0, 8, 11, 12, 16, 27, 28, 40]))
    assert sel.tolist() == [1, 2, 4, 5]
    assert ppos.tolist() == [100, 103, 104, 111]
    with pytest.raises(ValueError):
        Block("p", (3, 4), 0, (2, 1), 0, (4, 1)).check()  # overlapping rows


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_locate_agrees_with_every_position_of_the_block(tp, rank):
    """Every block the probe finds (whole, fused, padded, sharded by rows or by columns) locates random
    positions, in and out of it, where its own enumeration of positions says they are; shifted copies take
    the arithmetic shortcut only when every position lies in the block."""
    model = FakeVllmModel(tp, rank)
    params = dict(model.named_parameters())
    pmap = probe(model.load_weights, params, {n: s for n, s in checkpoint_specs().items()})
    g = torch.Generator().manual_seed(5)
    shortcut = 0
    for name, blocks in pmap.blocks.items():
        n = pmap.numel(name)
        for b in blocks:
            hf = torch.cat(list(b.hf_positions()))
            p_of = dict(zip(hf.tolist(), b.views(torch.arange(n), torch.arange(params[b.param].numel()))[1]
                            .reshape(-1).tolist()))
            inside = hf[torch.randperm(hf.numel(), generator=g)[:50]]
            for positions in (inside, torch.randint(-3, n + 3, (200,), generator=g)):
                sel, ppos = b.locate(positions)
                want = [(i, p_of[int(q)]) for i, q in enumerate(positions.tolist()) if int(q) in p_of]
                assert list(zip(sel.tolist(), ppos.tolist())) == want, (name, b)
            shortcut += b._shifted_copy
    assert shortcut > 0


def test_reload_groups_send_fused_partners_together():
    names = list(checkpoint_specs())
    groups = reload_groups(names, FakeVllmModel.packed_modules_mapping)
    qkv = groups["model.layers.0.self_attn.qkv_proj"]
    assert sorted(qkv) == sorted(f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias"))
    assert sorted(groups["model.layers.1.mlp.gate_up_proj"]) == [
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert reload_groups(names, FakeVllmModel.packed_modules_mapping, served_modules={"lm_head"}) is None


# -- staging and the applier's sparse path, end to end through a real store ---------------------------
def _publish(uri, versions, anchor_every=4):
    with ds.Publisher(uri, anchor_every=anchor_every) as pub:
        for step, ck in enumerate(versions):
            pub.publish(ck, step=step)


def _versions(n, frac=0.01):
    vs = [random_checkpoint(11)]
    for i in range(1, n):
        vs.append(perturb(vs[-1], frac, seed=100 + i))
    return vs


def test_stage_gives_each_deltas_change_without_writing(tmp_path):
    """Three deltas behind, the adapter stages one delta at a time against the bits the server holds: each
    piece is that delta's change (positions, new bits, the bits there before it), staged without writing,
    and the next is read only once the caller wrote this one."""
    uri = str(tmp_path / "store")
    vs = _versions(4)
    _publish(uri, vs, anchor_every=100)
    sub = ds.Subscriber(uri)
    host = {n: bits(t).clone() for n, t in vs[0].items()}
    pieces = stage(sub.reader, sub.store.ref(0), lambda n, p: host[n].clone() if p is None else host[n][p], 3)
    k = 0
    for k, st in enumerate(pieces, 1):
        assert st.path == "delta" and st.versions_applied == [k] and st.ref == sub.store.ref(k)
        assert all(torch.equal(host[n], bits(vs[k - 1][n])) for n in host)  # staging wrote nothing
        changes = st.changes()
        for name, (pos, new, orig) in changes.items():
            assert torch.equal(new, bits(vs[k][name])[pos])
            assert torch.equal(orig, bits(vs[k - 1][name])[pos])
        changed = {n for n in vs[0] if not torch.equal(bits(vs[k - 1][n]), bits(vs[k][n]))}
        assert {n for n, p in changes.items() if not torch.equal(p[1], p[2])} == changed
        for name, (pos, new, _orig) in changes.items():  # the caller writes this one before asking for more
            host[name][pos] = new
    assert k == 3 and all(torch.equal(host[n], bits(vs[3][n])) for n in host)


def _applier(model):
    ap = VllmApplier(model, None, path="sparse")
    ap.allow_cpu_sparse = True
    return ap


def test_applier_sparse_path_follows_ten_versions_bit_exactly(tmp_path):
    uri = str(tmp_path / "store")
    vs = _versions(11)
    _publish(uri, vs)
    served = loaded_model(random_checkpoint(99))  # an engine started from some other checkpoint
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    ap = _applier(served)
    r = ap.pull(uri, 0)
    assert r["route"] == "anchor" and r["path"] == "sparse"
    assert same_params(served, loaded_model(vs[0]))
    for step in range(1, 11):
        r = ap.pull(uri, step)
        assert r["route"] == "delta", r
        assert r["elements_written"] < 0.05 * sum(t.numel() for t in vs[0].values())
        assert same_params(served, loaded_model(vs[step])), step
    assert ptrs == {n: p.data_ptr() for n, p in served.named_parameters()}
    rep = ap.verify_local()
    assert rep["ok"] is True and rep["served"] == len(vs[0])


def test_applier_keeps_its_version_on_a_wrong_base_or_a_corrupt_object(tmp_path):
    uri = str(tmp_path / "store")
    vs = _versions(4)
    _publish(uri, vs, anchor_every=100)
    served = loaded_model(vs[0])
    ap = _applier(served)
    ap.pull(uri, 1)
    # wrong base: the served weights drift from version 1 behind the applier's back, at an element
    # version 2 changes (the O(changed) checksum sees those; verify_local sees any)
    q = "model.layers.0.self_attn.q_proj.weight"
    at = int((bits(vs[1][q]) != bits(vs[2][q])).nonzero()[0])
    target = bits(served.model.layers[0].qkv_proj.weight)  # q rows come first in the fused qkv
    with torch.no_grad():
        target[at] += 1
    snap = snapshot(served)
    with pytest.raises(ChecksumMismatchError):
        ap.pull(uri, 2, allow_anchor=False)
    assert ap.describe()["step"] == 1
    assert all(torch.equal(snap[n][1], bits(p)) for n, p in served.named_parameters())
    assert ap.verify_local()["ok"] is False
    with torch.no_grad():
        target[at] -= 1
    assert ap.verify_local()["ok"] is True
    # a corrupt object: nothing is written
    from deltastore.store import object_key
    for o in ap._last_sub.manifest(2).objects:
        path = tmp_path / "store" / object_key(o.digest)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    snap = snapshot(served)
    with pytest.raises(CorruptObjectError):
        ap.pull(uri, 2)
    assert ap.describe()["step"] == 1
    assert all(torch.equal(snap[n][1], bits(p)) for n, p in served.named_parameters())
    assert same_params(served, loaded_model(vs[1]))
