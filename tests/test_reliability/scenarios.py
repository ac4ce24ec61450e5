"""Reliability scenarios shared by the pytest suite (``tests/test_reliability``) and ``bench/faults.py``.

Each ``run_*`` function runs a number of trials on one store location and
returns a :class:`Stats`: trials, faults injected, wrong versions applied,
versions lost, untyped exceptions, recovery times, and ``problems`` (every
broken promise, with its trial). A scenario never raises for a broken
promise: it records it, so a figures run reports everything at once; the tests
assert ``stats.problems == []``.

States are small synthetic bf16 models (a few tensors, ~1e5 elements) whose
version ``k`` is a deterministic function of ``(seed, k)``: ~1.5 % of the
elements move by one ulp per step, so any pulled version can be compared with
what it must be, bit for bit (int16 views, never allclose).
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

import deltastore as ds
from deltastore.pull import tracking
from deltastore.backends import open_backend
from deltastore.backends.retry import RetryPolicy
from deltastore.errors import ApplyError, CorruptObjectError, DeltaStoreError, VersionExistsError
from deltastore.store import DeltaStore, object_key, version_key
from deltastore.testing import bits_equal
from deltastore.testing.faults import Fault, FaultyBackend, RetryingBackend, corrupt_bytes
from deltastore.pull.verify import verify_store

SHAPES = {"embed.weight": (256, 192), "layer.0.weight": (192, 192), "layer.1.weight": (192, 160),
          "norm.weight": (192,), "head.bias": (256,)}
FRAC = 0.015
FAST_RETRY = {"attempts": 10, "base_delay": 0.005, "max_delay": 0.05, "deadline": 60.0}


# -- states ---------------------------------------------------------------------------------------
class States:
    """Version ``k`` of a synthetic bf16 model, deterministic in ``(seed, k)``; ``variant`` for racers."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self._cache: dict[int, dict[str, torch.Tensor]] = {
            0: {n: torch.randn(*s, generator=g).bfloat16() for n, s in SHAPES.items()}}

    def get(self, k: int) -> dict[str, torch.Tensor]:
        if k not in self._cache:
            prev = self.get(k - 1)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
            nxt = {}
            for name, v in prev.items():
                bits = v.view(torch.int16).clone()
                mask = torch.rand(bits.shape, generator=g) < FRAC
                step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
                bits[mask] += step[mask]
                nxt[name] = bits.view(torch.bfloat16)
            self._cache[k] = nxt
        return self._cache[k]

    def variant(self, k: int, racer: int) -> dict[str, torch.Tensor]:
        """Racer ``racer``'s version ``k``: version ``k`` with a few racer-specific elements moved."""
        out = {n: t.clone() for n, t in self.get(k).items()}
        g = torch.Generator().manual_seed(self.seed * 7919 + k * 31 + racer)
        for name, t in out.items():
            bits = t.view(torch.int16).reshape(-1)
            idx = torch.randint(0, bits.numel(), (17,), generator=g)
            bits[idx] += racer + 1
        return out


def clone_state(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in s.items()}


# -- where the store lives -----------------------------------------------------------------------
@dataclass
class Where:
    """A store location: ``kind`` ("local" or "s3"), a base URI, storage options for the backend."""

    kind: str
    base: str
    options: dict = field(default_factory=dict)

    def fresh(self, name: str | None = None) -> str:
        """URI of a new, empty store under the base."""
        name = name or uuid.uuid4().hex[:12]
        return f"{self.base.rstrip('/')}/{name}"

    def backend(self, uri: str, **extra: Any):
        return open_backend(uri, **{**self.options, **extra})

    def store(self, uri: str, **extra: Any) -> DeltaStore:
        return DeltaStore(self.backend(uri, **extra), uri)


def local_where(root: str | None = None) -> Where:
    return Where("local", root or tempfile.mkdtemp(prefix="deltastore-rel-"))


def s3_where(server: Any) -> Where:
    """A fresh bucket on an S3 test server (``tests/test_backends/servers.py``)."""
    import s3fs

    bucket = f"rel-{uuid.uuid4().hex[:16]}"
    s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options()).mkdir(bucket)
    return Where("s3", f"s3://{bucket}", {**server.storage_options(), "skip_instance_cache": True})


# -- figures -------------------------------------------------------------------------------------
@dataclass
class Stats:
    scenario: str
    backend: str
    trials: int = 0
    faults: int = 0
    wrong: int = 0
    lost: int = 0
    untyped: int = 0
    recovery: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def note(self, key: str, n: int = 1) -> None:
        self.notes[key] = self.notes.get(key, 0) + n

    def problem(self, trial: Any, msg: str) -> None:
        self.problems.append(f"trial {trial}: {msg}")

    def untyped_error(self, trial: Any, e: BaseException) -> None:
        self.untyped += 1
        self.problem(trial, f"untyped {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")

    def recovery_text(self) -> str:
        if not self.recovery:
            return "-"
        return f"{statistics.median(self.recovery) * 1e3:.0f} / {max(self.recovery) * 1e3:.0f}"


def _check_pull(stats: Stats, trial: Any, sub: ds.Subscriber, states: States, step: int, target=None) -> bool:
    """Pull ``step`` (into ``target`` or fresh) and count a wrong version; True when bit-exact."""
    res = sub.pull(target, step=step)
    if not bits_equal(res.state, states.get(step)):
        stats.wrong += 1
        stats.problem(trial, f"version {step} pulled with wrong bits (path {res.path})")
        return False
    return True


# -- 1. crash: SIGKILL at random points of publish() ---------------------------------------------
def _crash_child(kind: str, uri: str, options: dict, seed: int, first: int, count: int, mode: str, k: int,
                 when: str, log_path: str) -> None:
    """Child process: resume on ``uri`` and publish ``count`` versions from ``first``; die by SIGKILL
    on backend call ``k`` (mode "call": in that call, before it or after it landed) or from another thread
    the moment call ``k`` starts (mode "async": the kill lands wherever the publishing thread then is, in
    the call, encoding, between files). Logs committed steps, and ``calls N`` when it was not killed."""
    torch.set_num_threads(1)
    states = States(seed)
    reached = threading.Event()
    if mode == "async":  # an event, not a timer: the kill point is a call, whatever the machine's speed
        threading.Thread(target=lambda: (reached.wait(), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
        rules = [Fault("pause", skip=k, limit=1, hook=lambda op, key: reached.set())]
    else:
        rules = [Fault("kill", skip=k, limit=1, when=when)]
    backend = FaultyBackend(open_backend(uri, **options), seed=seed, rules=rules)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    pub = ds.Publisher(DeltaStore(backend, uri), anchor_every=3, resume=True)
    for step in range(first, first + count):
        pub.publish(states.get(step), step=step)
        os.write(fd, f"{step}\n".encode())
    pub.close()
    os.write(fd, f"calls {sum(backend.calls.values())}\n".encode())
    os._exit(0)


def run_crash(where: Where, trials: int, seed: int = 0, steps_per_child: int = 3) -> Stats:
    """SIGKILL the publisher process at random points; check verify, complete versions only, resume."""
    stats = Stats("crash (SIGKILL in publish)", where.kind)
    rng = random.Random(seed)
    states = States(seed)
    t_start = time.monotonic()
    calls_per_run = None
    for trial in range(trials):
        uri = where.fresh(f"crash-{seed}-{trial}")
        try:
            counter = FaultyBackend(where.backend(uri))
            with ds.Publisher(DeltaStore(counter, uri), anchor_every=3) as pub:
                pub.publish(states.get(0), step=0)
                pub.publish(states.get(1), step=1)
            follower = ds.Subscriber(where.store(uri)).pull(step=1).state
            if calls_per_run is None:  # backend calls of a resume + the child's publishes, about
                calls_per_run = sum(counter.calls.values()) * (steps_per_child + 1) // 2
        except Exception as e:
            stats.untyped_error(trial, e)
            continue
        mode = "call" if trial % 2 == 0 else "async"
        k = rng.randrange(calls_per_run)
        when = rng.choice(["before", "after"])
        log_path = os.path.join(tempfile.gettempdir(), f"ds-crash-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        args = [where.kind, uri, where.options, seed, 2, steps_per_child, mode, k, when, log_path]
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(args)],
                                stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            stats.problem(trial, "child did not finish in 120 s")
            continue
        stats.trials += 1
        if proc.returncode == -signal.SIGKILL:
            stats.faults += 1
            stats.note(f"killed ({mode})")
        elif proc.returncode != 0:
            stats.problem(trial, f"child exited with status {proc.returncode}: {err.decode()[-800:]}")
        try:
            lines = open(log_path).read().splitlines() if os.path.exists(log_path) else []
        finally:
            if os.path.exists(log_path):
                os.unlink(log_path)
        logged = [int(x) for x in lines if not x.startswith("calls ")]
        calls = [int(x.split()[1]) for x in lines if x.startswith("calls ")]
        if proc.returncode == 0 and calls and calls[0] > k:
            if mode == "call":  # the kill is in the call itself: it cannot be outrun
                stats.problem(trial, f"child made {calls[0]} backend calls, past its kill point {k}, and lived")
            stats.note("finished with its kill on the way")
        elif proc.returncode == 0:
            stats.note("finished before its kill point")
        try:
            store = where.store(uri)
            present = store.versions()
            for s in {0, 1, *logged}:
                if s not in present:
                    stats.lost += 1
                    stats.problem(trial, f"committed version {s} is gone")
            report = verify_store(store)
            if not report.ok:
                stats.problem(trial, f"verify_store failed after a kill ({mode}, k={k}, {when}): "
                                     f"{report.problems[:3]}")
            sub = ds.Subscriber(where.store(uri))
            for s in present:  # every listed version is complete and exact
                _check_pull(stats, trial, sub, states, s)
            latest = present[-1]
            # a restarted publisher continues the chain
            t0 = time.monotonic()
            with ds.Publisher(where.store(uri), anchor_every=3, resume=True) as pub:
                info = pub.publish(states.get(latest + 1), step=latest + 1)
            stats.recovery.append(time.monotonic() - t0)
            m = sub.manifest(latest + 1)
            if m.parent is None or m.parent != sub.store.ref(latest):
                stats.problem(trial, f"restarted publisher did not continue the chain from {latest}: {m.parent}")
            res = sub.pull(follower, step=latest + 1)
            if not bits_equal(follower, states.get(latest + 1)):
                stats.wrong += 1
                stats.problem(trial, f"follower wrong after resume (path {res.path}, kind {info.kind})")
            if res.path != "delta":
                stats.note("follower took an anchor")
        except DeltaStoreError as e:
            stats.problem(trial, f"typed error after a kill ({mode}, k={k}, {when}): {e!r}")
        except Exception as e:
            stats.untyped_error(trial, e)
    stats.seconds = time.monotonic() - t_start
    return stats


# -- 2. corruption: objects and manifests truncated or bit-flipped --------------------------------
def planned_keys(sub: ds.Subscriber, want: int, current: Any) -> tuple[list[str], list[str]]:
    """(manifest keys, object keys) that a pull of ``want`` from ``current`` (a VersionRef or None) reads:
    the manifests of ``want``, of ``current`` and of every step on the planned path, and the path's objects."""
    plan = sub.plan(want, current)
    steps = {want, *plan.steps} | ({current.step} if current is not None else set())
    objects = []
    for s in plan.steps:
        m = sub.manifest(s)
        role = "full" if s == plan.anchor else "diff" if s == plan.differential else "delta"
        objects += [object_key(m.objects[i].digest) for i in sorted(m.objects_for(role))]
    return sorted(version_key(s) for s in steps), sorted(set(objects))


def _reads(inner: Any, key: str, rules: list[Fault]) -> FaultyBackend:
    """``inner`` with ``rules``, plus a zero-delay ``latency`` rule that counts the reads of ``key``
    (``injected["latency"]``)."""
    return FaultyBackend(inner, rules=[*rules, Fault("latency", ops=("get", "get_range"), prefix=key, delay=0.0,
                                                     jitter=False)])


def run_corruption(where: Where, trials: int, seed: int = 0, versions: int = 8) -> Stats:
    """Corrupt an object or manifest on the planned path of the pull that follows (at rest, or once in
    transit). The fault must fire (the pull reads the key) in every trial; the pull is bit-exact or typed,
    and a corrupted object is always caught by its digest (``CorruptObjectError`` naming it, or routed
    around), never decoded (``ChecksumMismatchError`` would mean the bad bytes reached a codec)."""
    stats = Stats("corruption (flip/truncate)", where.kind)
    rng = random.Random(seed)
    states = States(seed + 1)
    uri = where.fresh(f"corrupt-{seed}")
    t_start = time.monotonic()
    with ds.Publisher(where.store(uri), anchor_every=3) as pub:
        for s in range(versions):
            pub.publish(states.get(s), step=s)
    raw = where.backend(uri)
    keys = sorted(k for k in raw.list("") if k.startswith(("objects/", "versions/")))
    pristine = {k: raw.get(k) for k in keys}
    for trial in range(trials):
        key = None
        on_manifest = rng.random() < 0.4
        in_transit = rng.random() < 0.3
        want = rng.randrange(versions)
        start = rng.choice([None, *range(want)])  # a fresh target, or a follower holding an older version
        try:
            clean = ds.Subscriber(where.store(uri))
            if start is None:
                target = {n: torch.zeros_like(t) for n, t in states.get(0).items()}
            else:
                target = clean.pull(step=start).state
            before = clone_state(target)
            version_before = tracking.get_version(target)
            manifest_keys, object_keys = planned_keys(clean, want, version_before)
            key = rng.choice(manifest_keys if on_manifest or not object_keys else object_keys)
            bad = corrupt_bytes(pristine[key], rng)
            digest = ("sha256:" + key.split("/", 2)[2].replace("/", "")) if key.startswith("objects/") else None
            if in_transit:
                rules = [Fault("corrupt", ops=("get", "get_range"), prefix=key, limit=1)]
            else:
                raw.put(key, bad, mode="overwrite")
                rules = []
            backend = _reads(where.backend(uri), key, rules)
            faulty_sub = ds.Subscriber(DeltaStore(backend, uri))
            stats.trials += 1
            stats.faults += 1
            what = f"{'in transit' if in_transit else 'at rest'} {key}"
            try:
                res = faulty_sub.pull(target, step=want)
                if bits_equal(target, states.get(want)):
                    stats.note("reached the version (refetched, or routed around)")
                    if digest is not None and not in_transit and faulty_sub.replans == 0:
                        stats.problem(trial, f"pull reached {want} through an object corrupted {what} "
                                             "without detecting it (no re-plan)")
                else:
                    stats.wrong += 1
                    stats.problem(trial, f"wrong bits after corrupting {what} (path {res.path})")
            except DeltaStoreError as e:
                stats.note(f"typed: {type(e).__name__}")
                if not bits_equal(target, before) or tracking.get_version(target) != version_before:
                    stats.wrong += 1
                    stats.problem(trial, f"target changed by a failed pull ({e!r})")
                if digest is not None and not (isinstance(e, CorruptObjectError) and e.digest == digest):
                    stats.problem(trial, f"an object corrupted {what} got past its digest check: {e!r}")
                if in_transit:  # a corrupted transfer: the next pull, unharmed, succeeds
                    t0 = time.monotonic()
                    faulty_sub.pull(target, step=want)
                    stats.recovery.append(time.monotonic() - t0)
                    if not bits_equal(target, states.get(want)):
                        stats.wrong += 1
                        stats.problem(trial, "retry after a corrupted transfer is wrong")
            if in_transit and backend.injected["corrupt"] != 1:
                stats.problem(trial, f"the corruption {what} never fired")
            elif not in_transit and backend.injected["latency"] == 0:
                stats.problem(trial, f"the pull never read {key}, corrupted at rest on its planned path")
            if not in_transit:  # at rest: the store check must see it
                report = verify_store(where.store(uri))
                if report.ok:
                    if _harmless(pristine[key], bad, key):
                        stats.note("undetected but harmless")
                    else:
                        stats.problem(trial, f"verify_store missed a corruption of {key}")
                else:
                    stats.note("detected by verify")
        except DeltaStoreError as e:
            stats.problem(trial, f"unexpected typed error outside the faulty pull: {e!r}")
        except Exception as e:
            stats.untyped_error(trial, e)
        finally:
            if key is not None:
                raw.put(key, pristine[key], mode="overwrite")
    stats.seconds = time.monotonic() - t_start
    return stats


def _harmless(good: bytes, bad: bytes, key: str) -> bool:
    """A manifest corruption that still parses to the same weights (e.g. a digit of ``created``)."""
    if not key.startswith("versions/"):
        return False
    from deltastore.manifest import Manifest

    try:
        a, b = Manifest.from_json(good), Manifest.from_json(bad)
    except DeltaStoreError:
        return False
    return a.tensors == b.tensors and a.objects == b.objects and a.parent == b.parent


# -- 3. transient faults at 20 % of requests --------------------------------------------------------
def run_transient_local(where: Where, cycles: int, seed: int = 0, rate: float = 0.2) -> Stats:
    """Publish + pull cycles with 20 % of backend calls failing (errors, dropped answers) through
    :class:`RetryingBackend` over :class:`FaultyBackend` over the local backend."""
    stats = Stats(f"transient faults ({rate:.0%} of requests)", where.kind)
    uri = where.fresh(f"transient-{seed}")

    def faulty(s: int) -> FaultyBackend:
        err = rate * 0.75
        drop = (rate - err) / (1 - err)
        return FaultyBackend(where.backend(uri), seed=s, rules=[
            Fault("latency", rate=rate, delay=0.002), Fault("transient", rate=err), Fault("drop", rate=drop)])

    fp, fs = faulty(seed), faulty(seed + 1)
    return _transient_cycles(stats, uri, DeltaStore(RetryingBackend(fp, FAST_RETRY), uri),
                             DeltaStore(RetryingBackend(fs, FAST_RETRY), uri),
                             lambda: fp.total_injected - fp.injected["latency"] + fs.total_injected
                             - fs.injected["latency"], where, cycles, seed)


def run_transient_s3(where: Where, server: Any, cycles: int, seed: int = 0, rate: float = 0.2) -> Stats:
    """The same cycles on S3 with real network faults from a TCP proxy (cut uploads, dropped answers,
    refused connections) at ``rate`` of requests, retried by the S3 backend's own RetryPolicy only."""
    from .rateproxy import RateFaultProxy

    stats = Stats(f"transient faults ({rate:.0%} of requests)", where.kind)
    uri = where.fresh(f"transient-{seed}")
    proxy = RateFaultProxy(server.port, rate=rate, seed=seed)
    opts = {**where.options, "endpoint_url": proxy.endpoint, "retry": FAST_RETRY, "retries": 1,
            "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}
    try:
        pub_store = DeltaStore(open_backend(uri, **opts), uri)
        sub_store = DeltaStore(open_backend(uri, **opts), uri)
        return _transient_cycles(stats, uri, pub_store, sub_store, lambda: len(proxy.fired), where, cycles, seed)
    finally:
        proxy.close()


def _transient_cycles(stats: Stats, uri: str, pub_store: DeltaStore, sub_store: DeltaStore, injected: Any,
                      where: Where, cycles: int, seed: int) -> Stats:
    states = States(seed + 2)
    t_start = time.monotonic()
    pub = ds.Publisher(pub_store, anchor_every=10)
    sub = ds.Subscriber(sub_store)
    target = None
    for step in range(cycles):
        t0 = time.monotonic()
        try:
            pub.publish(states.get(step), step=step)
            res = sub.pull(target, step=step)
            target = res.state
            if not bits_equal(target, states.get(step)):
                stats.wrong += 1
                stats.problem(step, f"pulled wrong bits (path {res.path})")
        except DeltaStoreError as e:
            stats.problem(step, f"did not complete through retries: {e!r}")
            target = None
        except Exception as e:
            stats.untyped_error(step, e)
            target = None
        stats.recovery.append(time.monotonic() - t0)
        stats.trials += 1
    pub.close()
    stats.faults = injected()
    try:
        present = where.store(uri).versions()
        stats.lost = sum(1 for s in range(cycles) if s not in present)
        report = verify_store(where.store(uri))
        if not report.ok:
            stats.problem("end", f"verify_store: {report.problems[:3]}")
    except Exception as e:
        stats.untyped_error("end", e)
    stats.seconds = time.monotonic() - t_start
    return stats


# -- 4. concurrent publishers ---------------------------------------------------------------------------
def run_races(where: Where, races: int, seed: int = 0, racers: int = 3) -> Stats:
    """``racers`` publishers (threads, one store each) publish the same step at once, ``races`` times."""
    stats = Stats(f"concurrent publishers ({racers} per step)", where.kind)
    states = States(seed + 3)
    uri = where.fresh(f"race-{seed}")
    t_start = time.monotonic()
    with ds.Publisher(where.store(uri), anchor_every=5) as pub:
        pub.publish(states.get(0), step=0)
    winners: dict[int, int] = {}
    follower = None
    sub = ds.Subscriber(where.store(uri))
    for race in range(1, races + 1):
        t0 = time.monotonic()
        pubs = [ds.Publisher(where.store(uri), anchor_every=5, resume=True) for _ in range(racers)]
        barrier = threading.Barrier(racers)
        outcome: dict[int, Any] = {}

        def run(i: int) -> None:
            state = states.variant(race, i)
            barrier.wait()
            try:
                pubs[i].publish(state, step=race)
                outcome[i] = "won"
            except VersionExistsError:
                outcome[i] = "lost"
            except BaseException as e:  # noqa: BLE001 - recorded
                outcome[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in pubs:
            p.close()
        stats.trials += 1
        stats.faults += racers - 1
        won = [i for i, o in outcome.items() if o == "won"]
        for i, o in outcome.items():
            if isinstance(o, DeltaStoreError):
                stats.problem(race, f"racer {i}: {o!r}")
            elif isinstance(o, BaseException):
                stats.untyped += 1
                stats.problem(race, f"racer {i}: untyped {o!r}")
        if len(won) != 1:
            stats.problem(race, f"{len(won)} winners: {outcome}")
            continue
        winners[race] = won[0]
        try:
            m = sub.manifest(race)
            if m.producer.get("writer") != pubs[won[0]].writer_id:
                stats.problem(race, "the committed manifest is not the winner's")
            res = sub.pull(follower, step=race)
            follower = res.state
            if not bits_equal(follower, states.variant(race, won[0])):
                stats.wrong += 1
                stats.problem(race, f"version {race} is not the winner's state (mixed version?)")
            stats.recovery.append(time.monotonic() - t0)
        except Exception as e:
            stats.untyped_error(race, e) if not isinstance(e, DeltaStoreError) else stats.problem(race, repr(e))
    try:
        store = where.store(uri)
        present = store.versions()
        stats.lost = sum(1 for r in winners if r not in present)
        report = verify_store(store)
        if not report.ok:
            stats.problem("end", f"verify_store: {report.problems[:3]}")
        fresh = ds.Subscriber(where.store(uri))
        for r, w in winners.items():  # every version, pulled cold, is exactly one racer's state
            res = fresh.pull(step=r)
            if not bits_equal(res.state, states.variant(r, w)):
                stats.wrong += 1
                stats.problem(r, "cold pull is not the winner's state")
    except Exception as e:
        stats.untyped_error("end", e)
    stats.seconds = time.monotonic() - t_start
    return stats


# -- 5. apply interrupted ---------------------------------------------------------------------------------
class _Writes:
    """Shared switch for :class:`_Interrupting`: fail the ``fail_at``-th write (after writing half of it)."""

    fail_at = -1
    count = 0
    always = False  # also refuse restores (the write failure is permanent)
    storages: set[int] = set()  # data pointers of the target's tensors (decoding makes other tensors)


_WRITES = (torch.Tensor.__setitem__, torch.Tensor.copy_)


class _Interrupting(torch.Tensor):
    """A tensor whose n-th in-place write lands half-way, then raises (a device error mid-apply)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _WRITES or (_Writes.always and func is torch.Tensor.index_put_)) and \
                args[0].untyped_storage().data_ptr() in _Writes.storages:
            _Writes.count += 1
            if _Writes.count == _Writes.fail_at or (_Writes.always and _Writes.count > _Writes.fail_at > 0):
                with torch._C.DisableTorchFunctionSubclass():
                    _half_write(func, args)
                raise RuntimeError("injected failure midway through a write")
        return super().__torch_function__(func, types, args, kwargs)


def _half_write(func: Any, args: tuple) -> None:
    dest = args[0]
    if func is torch.Tensor.copy_:
        src = args[1]
        n = dest.numel() // 2
        dest.reshape(-1)[:n].copy_(src.reshape(-1)[:n].to(dest.device))
    elif func is torch.Tensor.__setitem__:
        idx, val = args[1], args[2]
        if isinstance(idx, torch.Tensor) and idx.numel() > 1:
            n = idx.numel() // 2
            dest[idx[:n]] = val[:n] if isinstance(val, torch.Tensor) and val.numel() == idx.numel() else val


def run_apply_interrupted(trials: int, seed: int = 0) -> Stats:
    """A write into the target fails at a random point (after landing half of that write): the target
    is restored bit-exactly to its previous version, or, when the restore is refused too, marked unknown
    and repaired by the next pull."""
    stats = Stats("apply interrupted", "memory")
    rng = random.Random(seed)
    states = States(seed + 4)
    uri = f"memory://apply-{uuid.uuid4().hex}"
    t_start = time.monotonic()
    with ds.Publisher(uri, anchor_every=4) as pub:
        for s in range(8):
            pub.publish(states.get(s), step=s)
    sub = ds.Subscriber(uri)
    for trial in range(trials):
        try:
            anchor_path = rng.random() < 0.4
            start = rng.randrange(0, 7)
            want = rng.randrange(start + 1, 8)
            plain = sub.pull(step=start).state
            target = {n: t.as_subclass(_Interrupting) for n, t in plain.items()}
            _Writes.storages = {t.untyped_storage().data_ptr() for t in plain.values()}
            tracking.set_version(target, None if anchor_path else sub.store.ref(start))
            before = clone_state({n: t.as_subclass(torch.Tensor) for n, t in target.items()})
            version_before = tracking.get_version(target)
            _Writes.count, _Writes.always = 0, rng.random() < 0.2
            _Writes.fail_at = rng.randint(1, len(SHAPES))
            stats.trials += 1
            stats.faults += 1
            try:
                sub.pull(target, step=want)
                stats.faults -= 1
                stats.note("write finished before the fault point")
                if not bits_equal(target, states.get(want)):
                    stats.wrong += 1
                    stats.problem(trial, "completed pull is wrong")
                continue
            except ApplyError as e:
                if e.restored:
                    stats.note("restored")
                    if not bits_equal(target, before) or tracking.get_version(target) != version_before:
                        stats.wrong += 1
                        stats.problem(trial, f"target not restored bit-exactly ({'anchor' if anchor_path else 'delta'} "
                                             f"path, write {_Writes.fail_at})")
                else:
                    stats.note("restore refused: version unknown")
                    if tracking.get_version(target) is not None:
                        stats.wrong += 1
                        stats.problem(trial, "unrestored target still claims a version")
            _Writes.fail_at, _Writes.always = -1, False
            t0 = time.monotonic()
            sub.pull(target, step=want)  # the retry (with a healthy device) reaches the version
            stats.recovery.append(time.monotonic() - t0)
            if not bits_equal(target, states.get(want)):
                stats.wrong += 1
                stats.problem(trial, "retry after an interrupted apply is wrong")
        except DeltaStoreError as e:
            stats.problem(trial, f"unexpected typed error: {e!r}")
        except Exception as e:
            stats.untyped_error(trial, e)
        finally:
            _Writes.fail_at, _Writes.always = -1, False
    stats.seconds = time.monotonic() - t_start
    return stats


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":  # the crash child: python scenarios.py '<json args of _crash_child>'
    _crash_child(*json.loads(sys.argv[1]))
