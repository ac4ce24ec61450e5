"""Anchor policies, differentials, catch-up paths, retention and GC."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch

import deltastore as ds
import deltastore.publish.chain as chain_mod
from conftest import quick_gc_store
from deltastore.testing import bits_equal
from deltastore.publish.anchors import Adaptive, ChainState, Every, get_anchor_policy
from deltastore.chains import extend_trace, trace_steps
from deltastore.cli import main
from deltastore.errors import (ObjectNotFoundError, StaleVersionError, UnknownPluginError, VersionNotFoundError)
from deltastore.gc import Retention, collect_garbage, plan_gc
from deltastore.pull.reader import VersionReader
from deltastore.pull.verify import verify_store

NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"]


@pytest.fixture(scope="module")
def chain64():
    """65 states (0..64) continuing the cold trace cyclically, three tensors (~1.4 M elements)."""
    import conftest

    tr = conftest._trace_module().load_trace(str(conftest.TRACE_DIR), run="cold-lr1e-6")
    changes, old = trace_steps(tr)
    return list(extend_trace(tr.base, changes, old, 64, NAMES))


def test_policy_decisions_and_registry():
    assert not Every(3).should_anchor(ChainState(versions_since_anchor=1))
    assert Every(3).should_anchor(ChainState(versions_since_anchor=2))
    a = Adaptive(budget=1.0, max_drift=0.1, max_chain=50)

    def state(**kw):
        base = dict(versions_since_anchor=3, anchor_bytes=1000, bytes_per_element=2.0)
        return ChainState(**{**base, **kw})

    # without a differential a joiner replays the whole chain
    assert not a.should_anchor(state(delta_bytes_since_anchor=900, delta_bytes_since_differential=900,
                                     drift_elements=1000))
    assert a.should_anchor(state(delta_bytes_since_anchor=1000, delta_bytes_since_differential=1000,
                                 drift_elements=1000))
    # with a small differential the extra is differential + deltas after it
    assert not a.should_anchor(state(delta_bytes_since_anchor=5000, delta_bytes_since_differential=100,
                                     drift_elements=200))
    assert a.should_anchor(state(delta_bytes_since_anchor=5000, delta_bytes_since_differential=100,
                                 drift_elements=450))
    assert not Adaptive(budget=1.0, differentials=False).should_anchor(state(delta_bytes_since_anchor=900))
    assert a.should_anchor(state(drift=0.2))          # drifted too far
    assert a.should_anchor(state(versions_since_anchor=49))  # chain cap
    # a differential pays once the deltas replayed since the last one cost as much as it
    assert a.should_differential(state(delta_bytes_since_differential=300, drift_elements=100))
    assert not a.should_differential(state(delta_bytes_since_differential=100, drift_elements=100))
    assert isinstance(get_anchor_policy("adaptive"), Adaptive)
    assert get_anchor_policy({"name": "every", "n": 4}).n == 4
    with pytest.raises(UnknownPluginError):
        get_anchor_policy("nope")
    with pytest.raises(ValueError):
        Every(0)


POLICIES = {
    "every10": dict(anchor_every=10),
    "every20": dict(anchor=ds.every(20)),
    "adaptive": dict(),  # the default
    "adaptive-nodiff": dict(anchor=Adaptive(differentials=False, budget=0.5)),
}


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_join_at_every_step_of_a_long_chain(chain64, tmp_path, policy):
    uri = str(tmp_path / policy)
    with ds.Publisher(uri, **POLICIES[policy]) as pub:
        infos = [pub.publish(s, step=i) for i, s in enumerate(chain64)]
    kinds = [i.kind for i in infos]
    assert kinds[0] == "anchor" and len(infos) == 65
    if policy == "every10":
        assert [i for i, k in enumerate(kinds) if k == "anchor"] == list(range(0, 65, 10))
    sub = ds.Subscriber(uri)
    follower = sub.pull(step=0).state
    sub.pull(follower, step=0)
    lagging = {k: torch.zeros_like(v) for k, v in chain64[0].items()}
    rng = random.Random(policy)
    used_differential = False
    for step, want in enumerate(chain64):
        joiner = sub.pull(step=step)
        assert bits_equal(joiner.state, want), (policy, step)
        used_differential |= sub.plan(step).differential is not None
        res = sub.pull(follower, step=step)
        assert bits_equal(follower, want) and (step == 0 or res.versions_applied == [step])
        if rng.random() < 0.3:
            sub.pull(lagging, step=step)
            assert bits_equal(lagging, want), (policy, step)
    if policy == "adaptive":
        assert any(i.differential for i in infos) and used_differential
    assert verify_store(ds.open_store(uri)).ok


@pytest.fixture(params=["exact drift", "sampled drift"])
def drift_memory(request, monkeypatch):
    """The drift tracker's budget: the default (this model's drift fits: exact), or 20 kB (it samples, and
    differentials are rebuilt from the stored anchor)."""
    sampled = request.param == "sampled drift"
    if sampled:
        monkeypatch.setattr(chain_mod, "DRIFT_MEMORY_MIN", 20_000)
        monkeypatch.setattr(chain_mod, "DRIFT_MEMORY_FRACTION", 0.0)
    return sampled


def test_differential_path_is_bit_exact_and_cheaper(chain64, memory_uri, drift_memory):
    with ds.Publisher(memory_uri, anchor=Adaptive(max_chain=1000, budget=100, differential_gain=0.5)) as pub:
        infos = [pub.publish(s, step=i) for i, s in enumerate(chain64[:30])]
        assert pub.head.drift.nbytes <= 20_000 if drift_memory else pub.head.drift.nbytes > 20_000
        assert (pub.head.drift.rate_log2 > 0) == drift_memory
    diffs = [i.step for i in infos if i.differential]
    assert diffs, "adaptive wrote no differential"
    sub = ds.Subscriber(memory_uri)
    d = diffs[-1]
    plan = sub.plan(29)
    assert plan.anchor == 0 and plan.differential == d and plan.deltas == list(range(d + 1, 30))
    chain_only = sum(sub.manifest(s).object_bytes(sub.manifest(s).delta_objects) for s in range(1, 30))
    anchor_bytes = sub.manifest(0).object_bytes(sub.manifest(0).full_objects)
    assert plan.nbytes < anchor_bytes + chain_only
    res = sub.pull(step=29)
    assert res.versions_applied == [0, d, *range(d + 1, 30)] and res.bytes_fetched == plan.nbytes
    assert bits_equal(res.state, chain64[29])
    # a target holding the anchor takes the differential without the anchor
    target = sub.pull(step=0).state
    sub.pull(target, step=0)
    res = sub.pull(target, step=29)
    assert res.path == "delta" and res.versions_applied[0] == d and bits_equal(target, chain64[29])


def test_background_writer_rebuilds_differentials_from_the_anchor(chain64, memory_uri, monkeypatch):
    """A sampled drift in background mode: the writer streams the anchor back while the capture side goes on."""
    monkeypatch.setattr(chain_mod, "DRIFT_MEMORY_MIN", 20_000)
    monkeypatch.setattr(chain_mod, "DRIFT_MEMORY_FRACTION", 0.0)
    with ds.Publisher(memory_uri, background=True,
                      anchor=Adaptive(max_chain=1000, budget=100, differential_gain=0.5)) as pub:
        pending = [pub.publish(s, step=i) for i, s in enumerate(chain64[:30])]
        infos = [p.wait() for p in pending]
        assert pub.head.drift.rate_log2 > 0
    diffs = [i.step for i in infos if i.differential]
    assert diffs, "adaptive wrote no differential"
    sub = ds.Subscriber(memory_uri)
    for d in diffs:  # a joiner at d reads the anchor and d's differential, nothing between
        assert sub.plan(d).differential == d
        res = sub.pull(step=d)
        assert res.versions_applied[-1] == d and len(res.versions_applied) == 2
        assert bits_equal(res.state, chain64[d])
    assert verify_store(ds.open_store(memory_uri)).ok


def test_differential_from_the_stored_anchor_equals_the_tensor_by_tensor_compare(tmp_path):
    """A sampled drift's differential, rebuilt from the anchor streamed back object by object: bf16 and fp32
    tensors side by side, tensors split over several objects, one unchanged; the same changes (positions,
    current bits, anchor bits) as comparing each final tensor with its anchor alone."""
    from deltastore.publish.diff import find_changes
    from deltastore.publish.resume import differential_from_anchor
    from deltastore.tensors import bits_view

    g = torch.Generator().manual_seed(7)
    states = [{"a": torch.randn(300, 64, generator=g).to(torch.bfloat16), "b": torch.randn(2000, generator=g),
               "c": torch.randn(64, 64, generator=g).to(torch.bfloat16), "d": torch.randn(50, generator=g)}]
    for step in range(1, 6):
        nxt = {k: v.clone() for k, v in states[-1].items()}
        for k in ("a", "b", "c"):
            flat = bits_view(nxt[k]).view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:flat.numel() // (10 + step)]] += 1
        states.append(nxt)
    with ds.Publisher(str(tmp_path / "s"), anchor_every=1000, max_object_bytes=1 << 13) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
        assert len(pub.store.manifest(0).full_objects) > 4
        got = differential_from_anchor(pub.store, pub.head, pub._mirror, workers=2)
    assert set(got) == set(states[0])
    for k in states[0]:
        want = find_changes(bits_view(states[0][k]).reshape(-1), states[-1][k].reshape(-1))
        assert torch.equal(got[k].positions, want.positions), k
        assert torch.equal(got[k].new_bits, want.new_bits) and torch.equal(got[k].old_bits, want.old_bits), k
    assert got["d"].count == 0 and got["a"].count > 0 and got["b"].count > 0


def test_resume_rebuilds_the_measured_chain(chain64, tmp_path, drift_memory):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    straight = ds.Publisher(a)
    for i, s in enumerate(chain64[:12]):
        straight.publish(s, step=i)
    restarted = ds.Publisher(b)
    for i, s in enumerate(chain64[:7]):
        restarted.publish(s, step=i)
    restarted.close()
    restarted = ds.Publisher(b)
    for i in range(7, 12):
        restarted.publish(chain64[i], step=i)
    assert restarted.chain.drift_elements == straight.chain.drift_elements
    assert (restarted.head.drift.rate_log2 > 0) == (straight.head.drift.rate_log2 > 0) == drift_memory
    assert restarted.chain.versions_since_anchor == straight.chain.versions_since_anchor
    assert [ds.Subscriber(b).manifest(i).kind for i in range(12)] == [ds.Subscriber(a).manifest(i).kind
                                                                        for i in range(12)]
    assert bits_equal(ds.Subscriber(b).pull(step=11).state, chain64[11])


def test_large_anchors_are_sharded(chain64, memory_uri):
    with ds.Publisher(memory_uri, max_object_bytes=200_000, anchor_every=3) as pub:
        pub.publish(chain64[0], step=0)
    m = ds.Subscriber(memory_uri).manifest(0)
    assert len(m.full_objects) >= 3
    assert bits_equal(ds.Subscriber(memory_uri).pull(step=0).state, chain64[0])


def test_retention_bounds_the_store_and_keeps_it_valid(chain64, tmp_path):
    uri = str(tmp_path / "s")
    with ds.Publisher(quick_gc_store(uri), anchor_every=5, retention=Retention(keep_last=4, keep_anchors=1),
                      gc_grace=0) as pub:
        for i, s in enumerate(chain64[:23]):
            pub.publish(s, step=i)
    sub = ds.Subscriber(uri)
    kept = sub.versions()
    # the last 4 (19..22), the last anchor (20), and 19's chain down to its anchor (15)
    assert kept == list(range(15, 23))
    for s in kept:
        assert bits_equal(sub.pull(step=s).state, chain64[s])
    with pytest.raises(VersionNotFoundError):
        sub.pull(step=3)
    report = verify_store(ds.open_store(uri))
    assert report.ok, report.problems
    # nothing unreferenced is left behind
    store = ds.open_store(uri)
    referenced = {d for s in kept for d in store.manifest(s).references()}
    assert len(referenced) > len({o.digest for s in kept for o in store.manifest(s).objects})  # + the layout
    assert set(store.list_objects()) == referenced


def test_gc_plan_keeps_chains_and_unreadable_manifests(chain64, tmp_path):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=4) as pub:
        for i, s in enumerate(chain64[:10]):
            pub.publish(s, step=i)
    store = ds.open_store(uri)
    plan = plan_gc(store, Retention(keep_last=1, keep_anchors=1))
    assert plan.keep == [8, 9] and plan.delete_versions == list(range(8))
    (tmp_path / "s" / "versions" / "000000000005.json").write_text("{garbage")
    store = ds.open_store(uri)
    plan = plan_gc(store, Retention(keep_last=1, keep_anchors=1))
    assert 5 in plan.keep and all(s in plan.keep for s in range(5))


class _Rendezvous:
    """Parks one pull between planning and fetching whenever GC asks for one, so GC runs under it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.wanted = threading.Event()   # GC wants a pull in flight
        self.parked = threading.Event()   # a pull has planned and waits
        self.release = threading.Event()  # GC is done: the parked pull goes on
        self.stop = threading.Event()

    def subscriber(self, uri):
        rv = self

        class Parking(VersionReader):
            def prefetch(self, plan, **kw):
                if rv.wanted.is_set() and rv.lock.acquire(blocking=False):
                    try:
                        if rv.wanted.is_set():
                            rv.wanted.clear()
                            rv.parked.set()
                            rv.release.wait(timeout=30)
                            rv.release.clear()
                    finally:
                        rv.lock.release()
                super().prefetch(plan, **kw)

        sub = ds.Subscriber(uri)
        sub.reader = Parking(sub.store)
        return sub


def test_gc_while_subscribers_pull_never_gives_wrong_weights(chain64, tmp_path):
    """Three readers pull while the publisher runs GC after every version; each GC runs while a pull is
    parked between planning and fetching, so GC really removes paths from under pulls in flight."""
    uri = str(tmp_path / "s")
    pub = ds.Publisher(uri, anchor_every=4)
    for i in range(8):
        pub.publish(chain64[i], step=i)
    rv = _Rendezvous()
    outcomes = {"ok": 0, "typed": 0, "retried": 0}
    failures = []
    subs = []

    def reader(seed):
        rng = random.Random(seed)
        sub = rv.subscriber(uri)
        subs.append(sub)
        target = None
        while not rv.stop.is_set():
            try:
                versions = sub.versions()
                step = rng.choice(versions[-6:]) if versions else None
                if step is None:
                    continue
                if target is None or rng.random() < 0.3:
                    res = sub.pull(step=step)
                    got = res.state
                else:
                    res = sub.pull(target, step=max(step, (sub.version_of(target) or ds.VersionRef(0, "")).step))
                    got = target
                if not bits_equal(got, chain64[res.step]):
                    failures.append(("wrong weights", res.step))
                target = got
                outcomes["ok"] += 1
            except (VersionNotFoundError, ObjectNotFoundError):
                outcomes["typed"] += 1
                try:  # the retry from the newest versions succeeds
                    res = sub.pull()
                    if not bits_equal(res.state, chain64[res.step]):
                        failures.append(("wrong weights after retry", res.step))
                    outcomes["retried"] += 1
                except (VersionNotFoundError, ObjectNotFoundError):
                    outcomes["typed"] += 1
            except Exception as e:  # anything else is a failure
                failures.append(repr(e))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    store = quick_gc_store(uri)
    races = 0
    deleted = 0
    try:
        for i in range(8, 40):
            pub.publish(chain64[i], step=i)
            rv.wanted.set()
            raced = rv.parked.wait(timeout=30)  # a pull has planned and waits for this GC
            rv.parked.clear()
            deleted += len(collect_garbage(store, Retention(keep_last=3, keep_anchors=1), grace=0).delete_versions)
            races += raced
            rv.release.set()
    finally:
        rv.stop.set()
        rv.wanted.clear()
        rv.release.set()
        for t in threads:
            t.join()
        pub.close()
    assert not failures, failures[:5]
    assert races == 32, f"only {races} of 32 GCs ran while a pull was in flight"
    assert deleted >= 25  # the GCs really deleted versions
    # GC removed part of a planned path under a pull: it re-planned, or failed typed and retried
    replans = sum(s.replans for s in subs)
    print(f"GC under pulls: {races} races, {deleted} versions deleted, {replans} re-plans, {outcomes}")
    assert replans + outcomes["typed"] > 0, (replans, outcomes)
    assert outcomes["ok"] > 10
    assert verify_store(ds.open_store(uri)).ok


def test_pull_replans_when_gc_removes_its_path(chain64, tmp_path):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=4) as pub:
        for i in range(10):
            pub.publish(chain64[i], step=i)

    class RacingReader(VersionReader):
        """Runs GC right after planning, before the objects are fetched."""

        armed = False

        def prefetch(self, plan, **kw):
            if self.armed:
                self.armed = False
                collect_garbage(quick_gc_store(uri), Retention(keep_last=2, keep_anchors=1), grace=0)
            super().prefetch(plan, **kw)

    sub = ds.Subscriber(uri)
    sub.reader = RacingReader(sub.store)
    target = sub.pull(step=1).state
    sub.pull(target, step=1)
    assert sub.plan(9, sub.version_of(target)).anchor is None  # deltas 2..9 planned first
    sub.reader.armed = True
    res = sub.pull(target, step=9)
    assert sub.replans == 1 and res.path == "anchor" and res.versions_applied == [8, 9]
    assert bits_equal(target, chain64[9])


def test_lag_max_lag_and_sync(chain64, memory_uri):
    pub = ds.Publisher(memory_uri)
    for i in range(5):
        pub.publish(chain64[i], step=i)
    sub = ds.Subscriber(memory_uri, max_lag=1)
    target = {k: torch.zeros_like(v) for k, v in chain64[0].items()}
    assert sub.lag(target) is None
    with pytest.raises(StaleVersionError):
        sub.pull(target, step=2)
    res = sub.pull(target, step=3)
    assert res.lag == 1 and sub.lag(target) == 1
    assert sub.sync(target) is None  # within max_lag
    pub.publish(chain64[5], step=5)
    res = sub.sync(target)
    assert res is not None and res.step == 5 and res.lag == 0 and bits_equal(target, chain64[5])
    assert res.created == sub.manifest(5).created and 0 <= res.age < 60


def test_cli_gc_dry_run_then_real(chain64, tmp_path, capsys, monkeypatch):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, anchor_every=3) as pub:
        for i, s in enumerate(chain64[:9]):
            pub.publish(s, step=i)
    assert main(["gc", uri, "--keep-last", "2", "--keep-anchors", "1", "--dry-run"]) == 0
    assert "would delete 6 versions" in capsys.readouterr().out
    assert ds.Subscriber(uri).versions() == list(range(9))
    assert main(["gc", uri, "--keep-last", "2", "--keep-anchors", "1", "--grace", "0"]) == 1  # too short: refused
    assert "GraceTooShortError: grace=0.0 s is too short" in capsys.readouterr().err
    assert ds.Subscriber(uri).versions() == list(range(9))
    import deltastore.store

    monkeypatch.setattr(deltastore.store, "REFRESH_WINDOW", 0.0)  # publishers refreshing before every commit
    assert main(["gc", uri, "--keep-last", "2", "--keep-anchors", "1", "--grace", "0"]) == 0
    assert ds.Subscriber(uri).versions() == [6, 7, 8]
    assert main(["verify", uri]) == 0


def test_materialize_copies_recorded_model_files(chain64, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    uri = str(tmp_path / "s")
    with ds.Publisher(uri, source_dir=src) as pub:
        pub.publish(chain64[0], step=0)
        pub.publish(chain64[1], step=1)
    assert ds.Publisher(uri).publish(chain64[2], step=2).kind  # resumed publisher keeps the files
    out = tmp_path / "out"
    assert main(["materialize", uri, "2", str(out)]) == 0
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    assert (out / "tokenizer.json").read_text() == "{}"
    with pytest.raises(FileNotFoundError):
        ds.Publisher(str(tmp_path / "x"), source_dir=tmp_path / "empty-nonexistent")
