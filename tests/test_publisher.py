"""Publisher behaviour: resume, step rules, dtype casting, module targets, tied weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deltastore as ds
from conftest import chain_states
from deltastore.testing import bits_equal
from deltastore.errors import StepOrderError, TargetMismatchError, VersionExistsError
from deltastore.pull import tracking


def _states(n, seed=0):
    return chain_states(n, {"w": (64, 32), "b": (32,)}, changes=0.01, seed=seed)


def test_resume_continues_the_chain(store_uri):
    states = _states(8)
    pub = ds.Publisher(store_uri, anchor_every=4)
    for i in range(4):
        pub.publish(states[i], step=i)
    pub.close()
    pub2 = ds.Publisher(store_uri, anchor_every=4)  # restarted trainer
    assert pub2.last.step == 3
    info = pub2.publish(states[4], step=4)
    assert info.kind == "anchor"  # 3 deltas after anchor 0, as if never restarted
    info = pub2.publish(states[5], step=5)
    assert info.kind == "delta" and info.changed == sum(
        int((states[5][k].view(torch.int16) != states[4][k].view(torch.int16)).sum()) for k in states[5])
    sub = ds.Subscriber(store_uri)
    m = sub.manifest(5)
    assert m.parent == ds.Subscriber(store_uri).store.ref(4)
    for step in range(6):
        assert bits_equal(sub.pull(step=step).state, states[step])


def test_fill_writes_a_version_into_fresh_buffers(store_uri):
    """What a resuming Publisher builds its mirror with: flat bit views filled from scratch, untracked."""
    states = _states(4)
    with ds.Publisher(store_uri, anchor_every=10) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    sub = ds.Subscriber(store_uri)
    bufs = {k: torch.full((v.numel(),), 7, dtype=torch.int16) for k, v in states[0].items()}
    sub.fill(bufs, step=2)
    for k, v in states[2].items():
        assert torch.equal(bufs[k], v.view(torch.int16).reshape(-1))
    assert tracking.get_version(bufs) is None


def test_resume_false_starts_a_new_chain(store_uri):
    states = _states(3)
    with ds.Publisher(store_uri) as pub:
        pub.publish(states[0], step=0)
        pub.publish(states[1], step=2)
    with ds.Publisher(store_uri, resume=False) as pub:
        with pytest.raises(StepOrderError):
            pub.publish(states[2], step=1)  # still below the store's latest
        info = pub.publish(states[2], step=3)
    assert info.kind == "anchor" and ds.Subscriber(store_uri).manifest(3).parent is None
    assert bits_equal(ds.Subscriber(store_uri).pull(step=3).state, states[2])


def test_step_rules(memory_uri):
    states = _states(3)
    pub = ds.Publisher(memory_uri)
    pub.publish(states[0], step=5)
    with pytest.raises(VersionExistsError) as e:
        pub.publish(states[1], step=5)
    assert isinstance(e.value, FileExistsError)
    with pytest.raises(StepOrderError) as e:
        pub.publish(states[1], step=4)
    assert isinstance(e.value, ValueError)
    for bad in (-1, 1.5, True, "6"):
        with pytest.raises(StepOrderError):
            pub.publish(states[1], step=bad)
    assert pub.publish(states[1], step=9).kind == "delta"
    assert ds.Subscriber(memory_uri).versions() == [5, 9]


def test_conflicting_writer_loses_with_typed_error(store_uri):
    states = _states(3)
    a = ds.Publisher(store_uri)
    a.publish(states[0], step=0)
    b = ds.Publisher(store_uri)
    a.publish(states[1], step=1)
    with pytest.raises(VersionExistsError):
        b.publish(states[2], step=1)  # b resumed at 0 and races a for step 1
    assert bits_equal(ds.Subscriber(store_uri).pull(step=1).state, states[1])


def test_fp32_master_published_as_bf16_and_module_target_keeps_storage(memory_uri):
    torch.manual_seed(0)
    master = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    replica = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8)).bfloat16()
    ptrs = {n: p.data_ptr() for n, p in replica.state_dict().items()}
    pub = ds.Publisher(memory_uri, dtype=torch.bfloat16)
    sub = ds.Subscriber(memory_uri)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for step in range(6):
        if step:
            master(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        pub.publish(master, step=step)
        sub.pull(replica, step=step)
        want = {n: t.detach().bfloat16() for n, t in master.state_dict().items()}
        assert bits_equal(replica.state_dict(), want)
        assert {n: p.data_ptr() for n, p in replica.state_dict().items()} == ptrs
    assert sub.manifest(5).tensors[0].dtype == "bfloat16"


def test_tied_weights_are_published_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

    uri = "memory://tied"
    m = Tied().bfloat16()
    ds.Publisher(uri).publish(m, step=0)
    assert [t.name for t in ds.Subscriber(uri).manifest(0).tensors] == ["emb.weight"]
    r = Tied().bfloat16()
    ds.Subscriber(uri).pull(r)
    assert torch.equal(r.head.weight.view(torch.int16), m.emb.weight.view(torch.int16))


def test_layout_change_stays_on_the_chain(memory_uri):
    pub = ds.Publisher(memory_uri, anchor_every=100)
    pub.publish({"a": torch.ones(4, dtype=torch.bfloat16)}, step=0)
    info = pub.publish({"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.zeros(2)}, step=1)
    m = ds.Subscriber(memory_uri).manifest(1)
    assert info.kind == "delta" and m.parent.step == 0 and m.new_tensors == ("b",)  # (tests/test_layout_changes.py)


def test_bad_tensor_inputs_are_typed(memory_uri):
    pub = ds.Publisher(memory_uri)
    with pytest.raises(TargetMismatchError):
        pub.publish({"a/../b": torch.ones(2)}, step=0)
    with pytest.raises(TargetMismatchError):
        pub.publish({"a": torch.ones(2, dtype=torch.complex64)}, step=0)
    with pytest.raises(TargetMismatchError):
        pub.publish({"a": [1, 2]}, step=0)
    with pytest.raises(TypeError):
        ds.Publisher(memory_uri, metadata={"x": object()})
    assert ds.Subscriber(memory_uri).versions() == []


def test_all_float_dtypes_and_special_values_roundtrip(memory_uri):
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 1.0, -1.0]
    states = []
    for i in range(3):
        s = {}
        for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            t = torch.tensor(specials * 3, dtype=dt)
            bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            bits[i::5] ^= 1  # touch NaN payloads, sign-adjacent and subnormal bits
            s[str(dt).split(".")[1]] = t
        s["flags"] = torch.tensor([True, False, bool(i % 2)])
        s["steps"] = torch.arange(5, dtype=torch.int64) * i
        states.append(s)
    pub = ds.Publisher(memory_uri)
    for i, s in enumerate(states):
        pub.publish(s, step=i)
    sub = ds.Subscriber(memory_uri)
    target = sub.pull(step=0).state
    for i, s in enumerate(states):
        assert bits_equal(sub.pull(step=i).state, s)
        sub.pull(target, step=i)
        assert bits_equal(target, s)


def test_aliased_names_reach_a_target_that_holds_them_separately(memory_uri):
    w = torch.randn(8, 4).bfloat16()
    sub = ds.Subscriber(memory_uri)
    pub = ds.Publisher(memory_uri)
    pub.publish({"emb": w, "head": w}, step=0)  # one storage under two names
    m = sub.manifest(0)
    assert [t.name for t in m.tensors] == ["emb"] and m.aliases == {"head": "emb"}
    target = {"emb": torch.zeros(8, 4, dtype=torch.bfloat16), "head": torch.zeros(8, 4, dtype=torch.bfloat16)}
    sub.pull(target)
    w2 = w.clone()
    w2.view(torch.int16)[0, :2] += 1
    pub.publish({"emb": w2, "head": w2}, step=1)
    assert sub.pull(target).path == "delta"
    assert bits_equal(target, {"emb": w2, "head": w2})
    sub.verify(target)
    target["head"].view(torch.int16)[3, 3] += 1
    with pytest.raises(ds.errors.ChecksumMismatchError, match="head"):
        sub.verify(target)
