"""Four ways to claim a version or a commit that is not so (issue 48), as runs shared by
``test_false_claims.py`` and ``bench/faults.py``: each ``run_*`` raises AssertionError when the promise is
broken (see the test module for the four cases).
"""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from deltastore.pull import tracking
from deltastore.publish.anchors import Adaptive
from deltastore.backends.retry import RetryingBackend
from deltastore.errors import ApplyError, VersionExistsError
from deltastore.store import DeltaStore
from deltastore.testing.faults import Fault, FaultyBackend

from deltastore.testing import bits_equal

FAST_RETRY = {"attempts": 5, "base_delay": 0.001, "max_delay": 0.005, "deadline": 30.0}


def _bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.view(torch.int16).clone() for k, v in state.items()}


def _wipe(store: DeltaStore) -> None:
    """Delete every key of the store (its owner starts it again from nothing)."""
    for key in list(store.backend.list("")):
        store.backend.delete(key)


# -- a. a differential's base is matched by digest ----------------------------------------------------
def sparse_chain(seed: int, n: int = 10, numel: int = 1 << 14) -> list[dict[str, torch.Tensor]]:
    """States whose changes keep returning to the same 5 % of elements (so the drift stays small and an
    adaptive policy writes differentials)."""
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(numel, generator=g).bfloat16(), "v": torch.randn(2048, generator=g).bfloat16()}
    hot = {k: torch.randperm(v.numel(), generator=g)[: v.numel() // 20] for k, v in base.items()}
    out = [base]
    for _ in range(1, n):
        state = {k: v.clone() for k, v in out[-1].items()}
        for k, v in state.items():
            v.view(torch.int16)[hot[k][torch.randperm(hot[k].numel(), generator=g)[: hot[k].numel() // 3]]] += 1
        out.append(state)
    return out


def run_rewritten_store_joiner(where, seed: int = 0) -> None:
    """A target at step 0 of a store that was then wiped and published again from another step 0 pulls the
    new chain's version that has a differential: bit-exact, through the new anchor."""
    uri = where.fresh()
    old = sparse_chain(seed)
    with ds.Publisher(where.store(uri)) as pub:
        pub.publish(old[0], step=0)
    joiner = ds.Subscriber(where.store(uri)).pull(step=0).state  # tracked at (0, old digest)
    held = tracking.get_version(joiner)
    _wipe(where.store(uri))
    new = sparse_chain(seed + 1)  # another step 0: 30 % of it differs from the old one
    with ds.Publisher(where.store(uri), anchor=Adaptive(max_chain=1000, budget=100, differential_gain=0.5)) as pub:
        infos = [pub.publish(s, step=k) for k, s in enumerate(new)]
    with_diff = [i.step for i in infos if i.differential]
    assert with_diff, "the policy wrote no differential: the case is not exercised"
    step = with_diff[-1]
    sub = ds.Subscriber(where.store(uri))  # the joiner's server restarted: nothing cached from the old store
    m = sub.manifest(step)
    assert m.differential.step == held.step and m.differential.digest != held.digest  # same step, other A
    plan = sub.plan(step, held)
    stored = sub.versions(), sorted(sub.store.list_objects())
    res = sub.pull(joiner, step=step)
    assert bits_equal(joiner, new[step]), f"the joiner holds wrong weights (path {res.path}, plan {plan})"
    assert plan.anchor == 0 and res.path == "anchor", f"planned from the target's other version 0: {plan}"
    assert tracking.get_version(joiner) == sub.store.ref(step)
    assert (sub.versions(), sorted(sub.store.list_objects())) == stored


# -- b. a failed layout change restores a tensor it copied whole --------------------------------------
class _FailsWrites(torch.Tensor):
    """A target tensor whose first in-place write fails (a transient device error; its restore then goes
    through), noting whether another tensor was written by then (``seen_written``: the bits of ``watch``
    differed from ``watch_before`` when the failure came)."""

    watch: torch.Tensor | None = None
    watch_before: torch.Tensor | None = None
    failures = 0
    seen_written = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.index_put_) and not cls.failures:
            cls.failures += 1
            if cls.watch is not None:
                cls.seen_written |= not torch.equal(cls.watch.view(torch.int16), cls.watch_before)
            raise RuntimeError("injected write failure")
        return super().__torch_function__(func, types, args, kwargs or {})


def run_layout_failure_restores_a_copied_tensor(seed: int = 0) -> None:
    """Version 1 holds ``a``, ``b``; version 2 adds ``c`` and ``d``. A target at version 1 already has ``c``
    and ``d`` of the right dtype and shape (``d`` fails its first write): the pull copies ``c`` whole, fails at
    ``d``, and must leave ``c`` (and ``a``, ``b``) as they were, at version 1."""
    g = torch.Generator().manual_seed(seed)
    s1 = {"a": torch.randn(4096, generator=g).bfloat16(), "b": torch.randn(300, generator=g).bfloat16()}
    s2 = {k: v.clone() for k, v in s1.items()}
    s2["a"].view(torch.int16)[torch.randperm(4096, generator=g)[:200]] += 3
    s2["c"] = torch.randn(1024, generator=g).bfloat16()
    s2["d"] = torch.randn(512, generator=g).bfloat16()
    uri = f"memory://layout-restore-{seed}-{torch.randint(0, 1 << 30, (1,), generator=g).item()}"
    with ds.Publisher(uri, anchor_every=100) as pub:
        pub.publish(s1, step=0)
        pub.publish(s1, step=1)
        pub.publish(s2, step=2)
    sub = ds.Subscriber(uri)
    target = sub.pull(step=0).state
    sub.pull(target, step=1)
    target["c"] = torch.randn(1024, generator=g).bfloat16()  # the model has them already (a buffer, say)
    target["d"] = torch.randn(512, generator=g).bfloat16().as_subclass(_FailsWrites)
    before = _bits({k: v.as_subclass(torch.Tensor) for k, v in target.items()})
    _FailsWrites.watch, _FailsWrites.watch_before = target["c"], before["c"]
    _FailsWrites.failures, _FailsWrites.seen_written = 0, False
    stored = sub.versions(), sorted(sub.store.list_objects())
    try:
        with pytest.raises(ApplyError, match="injected write failure") as e:
            sub.pull(target, step=2)
    finally:
        _FailsWrites.watch = _FailsWrites.watch_before = None
    assert _FailsWrites.failures == 1 and _FailsWrites.seen_written, "c was not written before d failed: " \
                                                                       "the case is not exercised"
    after = _bits({k: v.as_subclass(torch.Tensor) for k, v in target.items()})
    assert sorted(after) == sorted(before)
    for k in before:
        assert torch.equal(after[k], before[k]), f"tensor {k!r} was not restored"
    assert e.value.restored is True and sub.version_of(target).step == 1
    assert (sub.versions(), sorted(sub.store.list_objects())) == stored
    target["d"] = target["d"].as_subclass(torch.Tensor)  # the device is healthy again: the pull goes through
    sub.pull(target, step=2)
    assert bits_equal(target, s2)


# -- c. a refused restore after an anchor failure leaves the version unknown ----------------------------
class _SecondFails(torch.Tensor):
    """Writes into the first tensor written land; writes into any other fail, restores too."""

    first: int | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.index_put_):
            with torch._C.DisableTorchFunctionSubclass():
                ptr = args[0].untyped_storage().data_ptr()
            cls.first = ptr if cls.first is None else cls.first
            if ptr != cls.first:
                raise RuntimeError("injected write failure (restores refused too)")
        return super().__torch_function__(func, types, args, kwargs or {})


def run_anchor_failure_marks_the_version_unknown(seed: int = 0) -> None:
    """A target tracked at version 1 pulls version 5 through anchor 3 (every step rewrites every element, so
    the anchor path is the cheaper one); the second tensor refuses its writes and its restore."""
    g = torch.Generator().manual_seed(seed)
    states = [{"a": torch.randn(8192, generator=g).bfloat16(), "b": torch.randn(4096, generator=g).bfloat16()}
              for _ in range(6)]
    uri = f"memory://anchor-unknown-{seed}-{torch.randint(0, 1 << 30, (1,), generator=g).item()}"
    with ds.Publisher(uri, anchor_every=3) as pub:
        for k, s in enumerate(states):
            pub.publish(s, step=k)
    sub = ds.Subscriber(uri)
    target = sub.pull(step=0).state
    sub.pull(target, step=1)
    held = tracking.get_version(target)
    assert held is not None and held.step == 1
    assert sub.plan(5, held).anchor == 3, "the case needs the anchor path"
    target.update({k: v.as_subclass(_SecondFails) for k, v in target.items()})  # same storages, same tracking
    _SecondFails.first = None
    stored = sub.versions(), sorted(sub.store.list_objects())
    with pytest.raises(ApplyError, match="refused the restore; the target's version is unknown") as e:
        sub.pull(target, step=5)
    assert e.value.restored is False
    assert tracking.get_version(target) is None, "a target the restore could not put back still claims a version"
    plain = {k: v.as_subclass(torch.Tensor) for k, v in target.items()}
    written = [k for k in plain if _SecondFails.first == plain[k].untyped_storage().data_ptr()]
    assert written and all(torch.equal(plain[k].view(torch.int16), states[1][k].view(torch.int16))
                           for k in written)  # what could be restored was
    assert (sub.versions(), sorted(sub.store.list_objects())) == stored
    target.update(plain)  # a healthy device: the next pull repairs it from an anchor
    assert sub.pull(target, step=5).path == "anchor" and bits_equal(target, states[5])


# -- d. a rival's create is not our commit ----------------------------------------------------------------
def run_rival_create_is_not_ours(where, seed: int = 0) -> None:
    """Publisher A's commit of step 1 fails before writing (a dropped connection); meanwhile publisher B
    commits step 1; A's retry finds the key: A must get VersionExistsError, B's version must stand."""
    g = torch.Generator().manual_seed(seed)
    s0, sa, sb = ({"w": torch.randn(4096, generator=g).bfloat16()} for _ in range(3))
    uri = where.fresh()
    rival: list = []

    def rival_commits(op: str, key: str) -> None:
        with ds.Publisher(where.store(uri)) as b:
            rival.append((b.writer_id, b.publish(sb, step=1)))

    inner = where.backend(uri)
    inner = inner.inner if isinstance(inner, RetryingBackend) else inner  # (S3 comes with one)
    rules = [Fault("pause", ops="put", prefix="versions/", skip=1, limit=1, hook=rival_commits),
             Fault("transient", ops="put", prefix="versions/", skip=1, limit=1)]  # before the call: nothing written
    faulty = FaultyBackend(inner, rules=rules)
    a = ds.Publisher(DeltaStore(RetryingBackend(faulty, FAST_RETRY), uri))
    a.publish(s0, step=0)
    with pytest.raises(VersionExistsError, match="version 1 already exists") as e:
        a.publish(sa, step=1)
    assert faulty.injected["transient"] == 1 and rival, "the race was not staged"
    assert isinstance(e.value, FileExistsError)
    store = where.store(uri)
    assert store.versions() == [0, 1]
    assert store.manifest(1).producer["writer"] == rival[0][0] != a.writer_id  # B's commit stands
    assert bits_equal(ds.Subscriber(where.store(uri)).pull(step=1).state, sb)
    a.publish(sa, step=2)  # A carries on after the race it lost
    a.close()
    assert bits_equal(ds.Subscriber(where.store(uri)).pull(step=2).state, sa)
