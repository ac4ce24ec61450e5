"""One Publisher or one target used from several threads: calls are serialised, every committed version is right.

Publisher: publish/flush/close hold one lock, and each publish is checked against the step the one before it
published (StepOrderError / VersionExistsError for a racer that lost). Subscriber: one pull or stage at a time
per Subscriber, and pulls into one target (from any Subscribers) one at a time.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

import deltastore as ds
from deltastore.errors import ReentrantCallError, StepOrderError, VersionExistsError
from deltastore.testing import bits_equal

_NAMES = [f"layer{i}.weight" for i in range(4)]


def _state(step: int) -> dict[str, torch.Tensor]:
    """Version ``step``: a fixed base with ~3 % of the bits of each tensor moved, drawn from the step."""
    base = torch.Generator().manual_seed(0)
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name in _NAMES:
        bits = torch.randn(64, 1024, generator=base).bfloat16().view(torch.int16)
        hit = torch.rand(bits.shape, generator=g) < 0.03
        bits[hit] += torch.randint(-2, 3, bits.shape, generator=g, dtype=torch.int16)[hit]
        out[name] = bits.view(torch.bfloat16)
    return out


def _race(n_threads: int, body) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def run(k: int) -> None:
        start.wait()
        try:
            body(k)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a thread hung"
    return errors


@pytest.mark.parametrize("background", [False, True])
def test_one_publisher_from_four_threads_commits_only_right_versions(where, background):
    uri = where.fresh()
    pub = ds.Publisher(uri, anchor_every=5, background=background, storage_options=where.options)
    steps = itertools.count(0)
    take = threading.Lock()
    published: dict[int, object] = {}
    refused: list[BaseException] = []

    def body(k: int) -> None:
        for _ in range(4):
            with take:
                step = next(steps)
            state = _state(step)
            try:
                info = pub.publish(state, step=step)
            except (StepOrderError, VersionExistsError) as e:  # lost the race to a later step: said so
                refused.append(e)
                continue
            published[step] = info

    errors = _race(4, body)
    pub.close()
    assert not errors, errors
    committed = {step: info.wait() if background else info for step, info in published.items()}
    sub = ds.Subscriber(uri, storage_options=where.options)
    assert sub.versions() == sorted(committed)  # every publish() that returned committed, no other version
    follower = {n: torch.empty_like(t) for n, t in _state(0).items()}
    for step in sub.versions():
        m = sub.manifest(step)
        assert m.parent is None or m.parent.step < step
        assert bits_equal(sub.pull(step=step).state, _state(step)), step
        sub.pull(follower, step=step)  # the delta chain too
        assert bits_equal(follower, _state(step)), step
    assert len(committed) + len(refused) == 16


def test_publish_from_the_background_writers_own_thread_is_refused_not_a_deadlock(tmp_path):
    uri = str(tmp_path / "s")
    seen: list[BaseException] = []
    with ds.Publisher(uri, background=True) as pub:
        gate = threading.Event()  # the writer holds version 0 until the callback is registered
        write = pub._writer._write
        pub._writer._write = lambda item: gate.wait(60) and write(item)
        info = pub.publish(_state(0), step=0)

        def again(_future: object) -> None:
            try:
                pub.publish(_state(1), step=1)
            except BaseException as e:  # noqa: BLE001
                seen.append(e)

        info.add_done_callback(again)  # runs on the writer's thread once version 0 is committed
        gate.set()
        info.wait(60)
        pub.flush()
    assert len(seen) == 1 and isinstance(seen[0], ReentrantCallError), seen
    assert "background writer thread" in str(seen[0])
    assert ds.Subscriber(uri).versions() == [0]


def test_close_waits_for_a_publish_in_another_thread(tmp_path):
    uri = str(tmp_path / "s")
    pub = ds.Publisher(uri)
    pub.publish(_state(0), step=0)
    errors = _race(2, lambda k: pub.publish(_state(1), step=1) if k == 0 else pub.close())
    # either the publish ran first (committed) or close did (the publish then says the Publisher is closed)
    versions = ds.Subscriber(uri).versions()
    if versions == [0, 1]:
        assert not errors
    else:
        assert versions == [0] and len(errors) == 1 and "closed" in str(errors[0])


@pytest.mark.parametrize("subscribers", [1, 2])
def test_pulls_into_one_target_from_several_threads_leave_it_at_a_whole_version(where, subscribers):
    uri = where.fresh()
    with ds.Publisher(uri, anchor_every=4, storage_options=where.options) as pub:
        for step in range(10):
            pub.publish(_state(step), step=step)
    subs = [ds.Subscriber(uri, storage_options=where.options) for _ in range(subscribers)]
    target = {n: torch.empty_like(t) for n, t in _state(0).items()}
    subs[0].pull(target, step=0)
    order = [[3, 7, 9, 2, 5, 8], [9, 1, 6, 4, 9, 0], [5, 5, 8, 3, 1, 9]]

    def body(k: int) -> None:
        sub = subs[k % subscribers]
        for step in order[k]:
            res = sub.pull(target, step=step)
            assert res.step == step

    errors = _race(3, body)
    assert not errors, errors
    held = subs[0].version_of(target)
    assert held is not None
    assert bits_equal(target, _state(held.step))
    for step in (4, 9):  # and it goes on from there by deltas
        subs[-1].pull(target, step=step)
        assert bits_equal(target, _state(step))
