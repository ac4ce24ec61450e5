"""Fault families on the target and publisher side (``bench/faults.py``; tests in ``test_targets_families.py``).

* layout changes: a random walk of steps that add, drop, reshape or re-type tensors; a follower, a
  joiner from each anchor and a pull without a target must all be bit-exact, and ``verify`` clean;
* aliasing targets: a target whose tensors overlap in memory (the version stores them apart) is
  refused with a typed error before anything is written;
* interrupts: ``KeyboardInterrupt`` / ``SystemExit`` raised at a random write of a pull: the target is
  back at its previous version, bit for bit, and the interrupt propagates as itself;
* post-commit failures: the store marker write or retention fails after the commit point:
  ``publish()`` returns, the version is pullable, the next step publishes.
"""

from __future__ import annotations

import random
import time
import uuid
import warnings
from typing import Any

import torch

import deltastore as ds
from deltastore.pull import tracking
from deltastore.backends.memory import MemoryBackend
from deltastore.errors import DeltaStoreError, PostCommitWarning, TargetMismatchError
from deltastore.gc import Retention
from deltastore.store import STORE_MARKER, DeltaStore
from deltastore.testing.faults import Fault, FaultyBackend
from deltastore.pull.verify import verify_store

from .scenarios import Stats, bits_equal, clone_state

_DTYPES = (torch.bfloat16, torch.float32)


def _bump(t: torch.Tensor, g: torch.Generator, p: float) -> torch.Tensor:
    bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()
    bits[torch.rand(bits.shape, generator=g) < p] += 1
    return bits.view(t.dtype)


def _layout_walk(rng: random.Random, g: torch.Generator, steps: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """States whose layout changes at random steps; returns them and how many steps changed the layout."""
    state = {f"w{i}": torch.randn(16, 8, generator=g).bfloat16() for i in range(4)}
    out, changes, fresh = [state], 0, 4
    for _ in range(1, steps):
        nxt = {k: _bump(v, g, 0.05) for k, v in out[-1].items()}
        if rng.random() < 0.4:
            changes += 1
            op = rng.choice(("add", "drop", "reshape", "retype"))
            name = rng.choice(sorted(nxt))
            if op == "add" or len(nxt) == 1:
                nxt[f"w{fresh}"] = torch.randn(rng.randint(1, 40), generator=g).to(rng.choice(_DTYPES))
                fresh += 1
            elif op == "drop":
                del nxt[name]
            elif op == "reshape":
                nxt[name] = torch.randn(rng.randint(1, 30), 8, generator=g).to(nxt[name].dtype)
            else:
                t = nxt[name]
                nxt[name] = t.float() if t.dtype == torch.bfloat16 else t.bfloat16()
        out.append(nxt)
    return out, changes


def run_layout_changes(trials: int, seed: int = 0) -> Stats:
    stats = Stats("layout changes (add/drop/reshape/retype)", "memory")
    rng, t_start = random.Random(seed), time.monotonic()
    for trial in range(trials):
        g = torch.Generator().manual_seed(seed * 1000 + trial)
        states, changes = _layout_walk(rng, g, 8)
        uri = f"memory://layout-{uuid.uuid4().hex}"
        stats.trials += 1
        stats.faults += changes
        try:
            with ds.Publisher(uri, anchor_every=rng.choice((3, 5, 100))) as pub:
                for step, s in enumerate(states):
                    pub.publish(s, step=step)
            sub = ds.Subscriber(uri)
            follower = {k: torch.empty_like(v) for k, v in states[0].items()}  # a server's buffers
            for step, s in enumerate(states):  # followed in place, through every layout change
                t0 = time.monotonic()
                sub.pull(follower, step=step)
                stats.recovery.append(time.monotonic() - t0)
                joined = sub.pull(step=step).state  # a joiner: from the nearest anchor
                for what, got in (("follower", follower), ("joiner", joined)):
                    if not bits_equal(got, s):
                        stats.wrong += 1
                        stats.problem(trial, f"{what} at version {step} has wrong bits")
            report = verify_store(sub.store)
            if not report.ok:
                stats.problem(trial, f"verify: {report.problems[:2]}")
        except DeltaStoreError as e:
            stats.problem(trial, f"unexpected typed error: {e!r}")
        except Exception as e:
            stats.untyped_error(trial, e)
    stats.seconds = time.monotonic() - t_start
    return stats


def run_aliasing(trials: int, seed: int = 0) -> Stats:
    stats = Stats("aliasing targets (overlapping tensors)", "memory")
    rng, t_start = random.Random(seed), time.monotonic()
    g = torch.Generator().manual_seed(seed)
    states = [{f"t{i}": torch.randn(64, generator=g).bfloat16() for i in range(3)}]
    for _ in range(3):
        states.append({k: _bump(v, g, 0.1) for k, v in states[-1].items()})
    uri = f"memory://alias-{uuid.uuid4().hex}"
    with ds.Publisher(uri, anchor_every=100) as pub:
        for step, s in enumerate(states):
            pub.publish(s, step=step)
    sub = ds.Subscriber(uri)
    for trial in range(trials):
        start = rng.randrange(0, 3)
        buf = clone_state(sub.pull(step=start).state)
        flat = torch.cat([buf[k] for k in sorted(buf)])
        a, b = sorted(rng.sample(sorted(buf), 2))
        off = rng.randint(1, 63)  # b starts inside a: the two overlap by 64 - off elements
        target = dict(buf)
        target[a] = flat[:64]
        target[b] = flat[off:off + 64]
        tracking.set_version(target, sub.store.ref(start) if rng.random() < 0.5 else None)
        before = flat.view(torch.int16).clone()
        stats.trials += 1
        stats.faults += 1
        try:
            sub.pull(target, step=rng.randrange(start + 1, 4))
            stats.wrong += 1
            stats.problem(trial, f"pull into overlapping {a!r}/{b!r} succeeded")
        except TargetMismatchError as e:
            if a not in str(e) or b not in str(e):
                stats.problem(trial, f"refusal does not name both tensors: {e}")
            if not torch.equal(flat.view(torch.int16), before):
                stats.wrong += 1
                stats.problem(trial, "the refused target was written")
        except DeltaStoreError as e:
            stats.problem(trial, f"unexpected typed error: {e!r}")
        except Exception as e:
            stats.untyped_error(trial, e)
    stats.seconds = time.monotonic() - t_start
    return stats


class _Interrupt(torch.Tensor):
    """Counts target writes; the one at ``fail_at`` raises ``exc`` (an interrupt, not an Exception)."""

    fail_at = -1
    count = 0
    exc: type[BaseException] = KeyboardInterrupt

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("copy_", "__setitem__", "index_put_") and cls.fail_at >= 0:
            cls.count += 1
            if cls.count == cls.fail_at:
                cls.fail_at = -1
                raise cls.exc("interrupted in the middle of a target write")
        return super().__torch_function__(func, types, args, kwargs or {})


def run_interrupts(trials: int, seed: int = 0) -> Stats:
    stats = Stats("interrupts (KeyboardInterrupt/SystemExit mid-write)", "memory")
    rng, t_start = random.Random(seed), time.monotonic()
    g = torch.Generator().manual_seed(seed + 1)
    states = [{f"t{i}": torch.randn(48, 8, generator=g).bfloat16() for i in range(5)}]
    for _ in range(5):
        states.append({k: _bump(v, g, 0.1) for k, v in states[-1].items()})
    uri = f"memory://interrupt-{uuid.uuid4().hex}"
    with ds.Publisher(uri, anchor_every=3) as pub:
        for step, s in enumerate(states):
            pub.publish(s, step=step)
    sub = ds.Subscriber(uri)
    for trial in range(trials):
        start = rng.randrange(0, 5)
        want = rng.randrange(start + 1, 6)
        target = {k: v.as_subclass(_Interrupt) for k, v in clone_state(sub.pull(step=start).state).items()}
        anchor_path = rng.random() < 0.3
        tracking.set_version(target, None if anchor_path else sub.store.ref(start))
        version_before = tracking.get_version(target)
        _Interrupt.exc = rng.choice((KeyboardInterrupt, SystemExit))
        _Interrupt.count, _Interrupt.fail_at = 0, rng.randint(1, 5)
        stats.trials += 1
        try:
            sub.pull(target, step=want)
            stats.note("pull finished before the interrupt point")
            if not bits_equal(target, states[want]):
                stats.wrong += 1
                stats.problem(trial, "completed pull is wrong")
        except (KeyboardInterrupt, SystemExit) as e:
            stats.faults += 1
            if type(e) is not _Interrupt.exc:
                stats.problem(trial, f"{_Interrupt.exc.__name__} came out as {type(e).__name__}")
            if not bits_equal(target, states[start]) or tracking.get_version(target) != version_before:
                stats.wrong += 1
                stats.problem(trial, f"target not back at version {start} ({'anchor' if anchor_path else 'delta'} path)")
            t0 = time.monotonic()
            sub.pull(target, step=want)
            stats.recovery.append(time.monotonic() - t0)
            if not bits_equal(target, states[want]):
                stats.wrong += 1
                stats.problem(trial, "the pull after the interrupt is wrong")
        except DeltaStoreError as e:
            stats.problem(trial, f"unexpected typed error: {e!r}")
        except Exception as e:
            stats.untyped_error(trial, e)
        finally:
            _Interrupt.fail_at = -1
    stats.seconds = time.monotonic() - t_start
    return stats


def run_post_commit(trials: int, seed: int = 0) -> Stats:
    stats = Stats("post-commit failures (marker, retention)", "memory")
    rng, t_start = random.Random(seed), time.monotonic()
    g = torch.Generator().manual_seed(seed + 2)
    for trial in range(trials):
        inner = MemoryBackend(uuid.uuid4().hex)
        where = rng.choice(("marker", "retention"))
        rules = [Fault("permanent", ops="put", prefix=STORE_MARKER)] if where == "marker" else \
            [Fault("permanent", ops="delete", prefix="versions/")]
        states = [{"w": torch.randn(32, generator=g).bfloat16()}]
        for _ in range(4):
            states.append({"w": _bump(states[-1]["w"], g, 0.2)})
        stats.trials += 1
        try:
            warned: list[Any] = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PostCommitWarning)
                with ds.Publisher(DeltaStore(FaultyBackend(inner, rules=rules)), anchor_every=2,
                                  retention=Retention(keep_last=2)) as pub:
                    infos = [pub.publish(s, step=i) for i, s in enumerate(states)]
                warned = [w for w in caught if issubclass(w.category, PostCommitWarning)]
            stats.faults += sum(bool(i.warnings) for i in infos)
            if not warned:
                stats.note("no post-commit failure reached")
            sub = ds.Subscriber(DeltaStore(inner))
            for step in sub.versions():
                if not bits_equal(sub.pull(step=step).state, states[step]):
                    stats.wrong += 1
                    stats.problem(trial, f"version {step} pulled wrong")
            if 4 not in sub.versions():
                stats.lost += 1
                stats.problem(trial, "the last committed version is missing")
        except DeltaStoreError as e:
            stats.problem(trial, f"publish raised after its commit point: {e!r}")
        except Exception as e:
            stats.untyped_error(trial, e)
    stats.seconds = time.monotonic() - t_start
    return stats
