"""The planner on synthetic manifests: which path a pull takes, from manifests alone (no store, no objects)."""

from __future__ import annotations

import hashlib
import random

import pytest

from deltastore.errors import VersionNotFoundError
from deltastore.manifest import Manifest, ObjectRecord, Part, TensorRecord, VersionRef
from deltastore.pull.planner import Plan, plan_path

_CODEC = {"id": "raw", "version": "1.0", "config": {}}


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class Chain:
    """Manifests by step, each with a made-up digest; ``read`` is the planner's manifest reader."""

    def __init__(self) -> None:
        self.versions: dict[int, tuple[Manifest, str]] = {}
        self.reads: list[int] = []

    def ref(self, step: int) -> VersionRef:
        return VersionRef(step, self.versions[step][1])

    def read(self, step: int) -> tuple[Manifest, str]:
        self.reads.append(step)
        if step not in self.versions:
            raise VersionNotFoundError(f"no version {step}")
        return self.versions[step]

    def add(self, step: int, *, full: int | None = None, delta: int | None = None, diff: tuple[int, int] | None = None,
            shape: tuple[int, ...] = (8,)) -> None:
        """Version ``step`` (parent ``step - 1`` when it has a delta): an anchor when ``full`` (its full
        objects' bytes), a delta of ``delta`` bytes, a differential ``(anchor step, bytes)``."""
        objects, roles = [], {}
        numel = 1
        for d in shape:
            numel *= d
        for role, size in (("full", full), ("delta", delta), ("diff", diff[1] if diff else None)):
            if size is not None:
                roles[role] = (Part(len(objects), 0, numel),)
                objects.append(ObjectRecord(_sha(f"object {step} {role}"), size, _CODEC))
        rec = TensorRecord("w", "bfloat16", shape, 1, "0" * 16, roles.get("delta", ()), roles.get("full", ()),
                           roles.get("diff", ()), 1 if diff else 0)
        parent = self.ref(step - 1) if delta is not None else None
        m = Manifest(step=step, kind="anchor" if full is not None else "delta", parent=parent, tensors=(rec,),
                     objects=tuple(objects), differential=self.ref(diff[0]) if diff else None)
        self.versions[step] = (m, _sha(f"manifest {step} {len(self.versions)}"))

    def object_digest(self, step: int, role: str) -> str:
        return _sha(f"object {step} {role}")


def _linear(n: int, *, anchor_bytes: int = 1000, delta_bytes: int = 10) -> Chain:
    """Anchor 0, then deltas 1 .. n - 1."""
    c = Chain()
    c.add(0, full=anchor_bytes)
    for s in range(1, n):
        c.add(s, delta=delta_bytes)
    return c


def test_a_follower_one_behind_takes_one_delta_and_reads_two_manifests():
    c = _linear(6)
    assert plan_path(c.read, 5, c.ref(4)) == Plan(None, [5], 10)
    assert c.reads == [5, 4]


def test_a_fresh_follower_starts_at_the_nearest_anchor_below():
    c = _linear(4)
    c.add(4, full=1000, delta=10)  # an anchor that also has a delta from 3
    c.add(5, delta=10)
    assert plan_path(c.read, 5) == Plan(4, [5], 1010)
    assert plan_path(c.read, 3) == Plan(0, [1, 2, 3], 1030)
    assert plan_path(c.read, 0) == Plan(0, [], 1000)


def test_a_far_behind_follower_takes_the_anchor_when_the_chain_costs_more():
    c = _linear(5, delta_bytes=300)
    c.add(5, full=500, delta=300)
    c.add(6, delta=300)
    assert plan_path(c.read, 6, c.ref(1)) == Plan(5, [6], 800)  # chain 2..6 would be 1500
    assert plan_path(c.read, 6, c.ref(4)) == Plan(None, [5, 6], 600)
    assert plan_path(c.read, 6, c.ref(4), allow_anchor=False) == Plan(None, [5, 6], 600)
    assert plan_path(c.read, 6, c.ref(1), allow_anchor=False) == Plan(None, [2, 3, 4, 5, 6], 1500)


def test_a_tie_goes_to_the_path_met_first():
    c = _linear(3, delta_bytes=100)
    c.add(3, full=200, delta=100)
    c.add(4, delta=100)
    # from 1: the anchor 3 then 4 is 300, met first; the chain 2, 3, 4 would be 300 too: not walked to its end
    assert plan_path(c.read, 4, c.ref(1)) == Plan(3, [4], 300)
    assert c.reads == [4, 3, 2]
    # from 2 the chain (200) is cheaper than the anchor path (300)
    assert plan_path(c.read, 4, c.ref(2)) == Plan(None, [3, 4], 200)


def test_a_differential_replaces_the_deltas_since_its_anchor():
    c = _linear(5, anchor_bytes=1000, delta_bytes=100)
    c.add(5, delta=100, diff=(0, 150))
    # a fresh follower: anchor 0 + differential 5 (1150) instead of anchor 0 + five deltas (1500)
    assert plan_path(c.read, 5) == Plan(0, [], 1150, differential=5)
    # a follower holding the anchor: the differential alone (150) instead of five deltas (500)
    assert plan_path(c.read, 5, c.ref(0)) == Plan(None, [], 150, differential=5)
    # one behind: the delta (100) is cheaper than the differential
    assert plan_path(c.read, 5, c.ref(4)) == Plan(None, [5], 100)
    c.add(6, delta=100)
    assert plan_path(c.read, 6, c.ref(0)) == Plan(None, [6], 250, differential=5)


def test_a_differential_over_another_layout_is_not_planned_through():
    c = Chain()
    c.add(0, full=1000, shape=(4, 2))  # same element count, another shape
    for s in range(1, 5):
        c.add(s, delta=100)
    c.add(5, delta=100, diff=(0, 150))
    assert plan_path(c.read, 5).differential is None


def test_an_avoided_object_is_planned_around():
    c = _linear(3)
    c.add(3, full=1000, delta=10)
    c.add(4, delta=10)
    bad = c.object_digest(4, "delta")
    with pytest.raises(VersionNotFoundError):
        plan_path(c.read, 4, c.ref(3), avoid=frozenset({bad}))  # every path to 4 reads its delta
    assert plan_path(c.read, 3, c.ref(1), avoid=frozenset({c.object_digest(2, "delta")})) == Plan(3, [], 1000)
    with pytest.raises(VersionNotFoundError):  # the only anchor below 2 is avoided
        plan_path(c.read, 2, None, avoid=frozenset({c.object_digest(0, "full")}))


def test_a_rewritten_parent_ends_the_walk():
    c = _linear(4)
    held = c.ref(2)
    m, _ = c.versions[2]
    c.versions[2] = (m, _sha("another writer's version 2"))  # step 2 rewritten under 3's parent link
    # a follower holding the old 2 is not reached: 3's parent link names a version the store no longer has
    with pytest.raises(VersionNotFoundError, match="in the test store"):
        plan_path(c.read, 3, held, allow_anchor=False, where="the test store")
    # nor is the anchor below it: the walk stops at 3
    with pytest.raises(VersionNotFoundError):
        plan_path(c.read, 3)
    assert plan_path(c.read, 2) == Plan(0, [1, 2], 1020)  # the rewritten 2 has its own (valid) chain


def test_a_missing_step_is_typed_and_a_broken_chain_has_no_path():
    c = _linear(3)
    held = c.ref(1)
    with pytest.raises(VersionNotFoundError):
        plan_path(c.read, 7)
    del c.versions[1]  # collected, or never written
    with pytest.raises(VersionNotFoundError, match="no anchor and no delta chain reaches version 2"):
        plan_path(c.read, 2)
    with pytest.raises(VersionNotFoundError):  # the follower's own version must be readable to be joined
        plan_path(c.read, 2, held)


def test_a_follower_one_behind_a_differential_version_reads_no_anchor_manifest():
    c = _linear(5, anchor_bytes=1000, delta_bytes=100)
    c.add(5, delta=100, diff=(0, 150))
    c.reads.clear()
    assert plan_path(c.read, 5, c.ref(4)) == Plan(None, [5], 100)
    assert c.reads == [5, 4]  # the differential (150 and more) cannot beat the delta (100): anchor 0 unread
    c.reads.clear()
    assert plan_path(c.read, 5) == Plan(0, [], 1150, differential=5)
    assert 0 in c.reads


def _random_chain(rng: random.Random) -> Chain:
    c = Chain()
    anchors = [0]
    c.add(0, full=rng.choice((0, 300, 500, 1000)))  # 0: an empty model's anchor: ties with its bound
    for s in range(1, rng.randint(2, 9)):
        kind = rng.random()
        size = rng.choice((0, 50, 100, 150, 300))
        if kind < 0.2:
            c.add(s, full=rng.choice((0, 300, 500, 1000)), delta=size if rng.random() < 0.7 else None)
            anchors.append(s)
        elif kind < 0.5:
            c.add(s, delta=size, diff=(rng.choice(anchors), rng.choice((0, 100, 150, 250, 400))))
        else:
            c.add(s, delta=size)
    return c


def test_reading_differential_anchors_lazily_plans_what_reading_them_eagerly_plans(monkeypatch):
    """The walk decides on bounds until a differential could matter; every plan must equal the plan of the
    walk that reads each differential's anchor manifest as soon as it meets it, and read no more."""
    from deltastore.pull import planner

    def eager(self, lower, resolve):  # noqa: ANN001, ANN202 - the reference: resolve at once
        if self.allow_anchor:
            self.offer(resolve())

    rng = random.Random(20261203)
    lazy_reads = eager_reads = 0
    for _ in range(600):
        c = _random_chain(rng)
        steps = sorted(c.versions)
        if rng.random() < 0.2:  # a version rewritten by another writer, or collected
            s = rng.choice(steps)
            if rng.random() < 0.5:
                c.versions[s] = (c.versions[s][0], _sha(f"rewritten {s}"))
            else:
                del c.versions[s]
        live = sorted(c.versions)
        if not live:
            continue
        step = rng.choice(live)
        current = rng.choice([None, *[c.ref(s) for s in live if s <= step]])
        objects = [o.digest for m, _ in c.versions.values() for o in m.objects]
        avoid = frozenset(rng.sample(objects, k=min(len(objects), rng.choice((0, 0, 1, 2)))))
        kw = dict(allow_anchor=rng.random() < 0.8, avoid=avoid)
        got = []
        for mode in ("lazy", "eager"):
            with monkeypatch.context() as mp:
                if mode == "eager":
                    mp.setattr(planner._Offers, "defer", eager)
                c.reads.clear()
                try:
                    got.append(plan_path(c.read, step, current, **kw))
                except VersionNotFoundError:
                    got.append(None)
                if mode == "lazy":
                    lazy_reads += len(c.reads)
                else:
                    eager_reads += len(c.reads)
        assert got[0] == got[1], (step, current, kw, {s: m for s, (m, _) in c.versions.items()})
    assert lazy_reads < eager_reads  # the laziness is real on these chains
