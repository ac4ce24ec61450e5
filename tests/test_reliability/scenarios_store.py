"""Store and backend fault families for ``bench/faults.py`` (issue 12): GC racing reusing publishes,
unreachable endpoints, refused / read-only / full local stores, store-layer memory bombs. Each returns a
:class:`~test_reliability.scenarios.Stats` row; a broken promise is a ``problem``."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import deltastore as ds
from deltastore.errors import (AccessDeniedError, BackendUnavailableError, DeltaStoreError, ReadOnlyStoreError,
                               StoreFullError)
from deltastore.manifest import MAX_MANIFEST_BYTES
from deltastore.store import object_key, version_key
from deltastore.testing import bits_equal

from . import gc_interleavings as G
from .scenarios import States, Stats, Where

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_gc_reuse(where: Where, trials: int, seed: int = 0) -> Stats:
    """``trials`` GC passes, each racing a publish that reuses the objects GC is collecting, in one of the
    staged interleavings (drawn at random); wrong = a committed version that does not pull bit-exactly."""
    stats = Stats("GC racing a reusing publish", where.kind)
    rng = random.Random(seed)
    t0 = time.monotonic()
    names = [rng.choice(sorted(G.INTERLEAVINGS)) for _ in range(trials)]
    cases = [G.prepare(where, f"gc-{seed}-{i}") for i in range(trials)]
    G.age(where, cases)
    for i, (name, case) in enumerate(zip(names, cases)):
        t = time.monotonic()
        try:
            deleted = G.INTERLEAVINGS[name](case)
            stats.faults += 1  # every trial ran GC in the middle of the publish
            stats.note(f"{name} (objects GC deleted {sum(1 for _ in deleted)})")
        except AssertionError as e:
            versions = where.store(case.uri).versions()
            if 2 in versions:
                stats.wrong += 1
            stats.problem(i, f"{name}: {e}")
        except DeltaStoreError as e:
            stats.problem(i, f"{name}: unexpected {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - counted
            stats.untyped_error(i, e)
        stats.trials += 1
        stats.recovery.append(time.monotonic() - t)
    stats.seconds = time.monotonic() - t0
    return stats


def run_unreachable(trials: int, deadline: float = 1.0) -> Stats:
    """Open a Subscriber / Publisher on S3, GCS and HF endpoints where nothing listens: a typed
    :class:`BackendUnavailableError` within the deadline (+5 s for one connect and the imports)."""
    from test_backends.servers import free_port

    stats = Stats(f"unreachable endpoint (deadline {deadline:g} s)", "s3/gcs/hf")
    kinds = [("s3://bucket-x/run", lambda ep: {"endpoint_url": ep, "key": "k", "secret": "s"}),
             ("gs://bucket-x/run", lambda ep: {"endpoint_url": ep, "token": "anon"}),
             ("hf://buckets/ns/b/run", lambda ep: {"endpoint": ep, "token": "hf_x"})]
    t0 = time.monotonic()
    for i in range(trials):
        uri, opts = kinds[i % len(kinds)]
        open_unreachable(stats, i, uri, {**opts(f"http://127.0.0.1:{free_port()}"), "deadline": deadline}, uri)
    stats.seconds = time.monotonic() - t0
    return stats


def open_unreachable(stats: Stats, i: int, uri: str, options: dict, label: str) -> None:
    """Trial ``i``: a Subscriber (odd ``i``) or Publisher on ``uri`` where nothing listens must raise
    :class:`BackendUnavailableError` within ``options["deadline"]`` (+5 s for one connect and the imports);
    recovery: the time to the typed error."""
    deadline = options["deadline"]
    t = time.monotonic()
    try:
        (ds.Subscriber if i % 2 else ds.Publisher)(uri, storage_options=options)
        stats.problem(i, f"{label}: opened although nothing listens")
    except BackendUnavailableError:
        stats.faults += 1
    except DeltaStoreError as e:
        stats.problem(i, f"{label}: {type(e).__name__} instead of BackendUnavailableError: {e}")
    except Exception as e:  # noqa: BLE001 - counted
        stats.untyped_error(i, e)
    took = time.monotonic() - t
    if took > deadline + 5:
        stats.problem(i, f"{label}: failed after {took:.1f} s, deadline {deadline} s")
    stats.trials += 1
    stats.recovery.append(took)


_DISK = {"erofs": (errno.EROFS, ReadOnlyStoreError), "enospc": (errno.ENOSPC, StoreFullError),
         "eacces": (errno.EACCES, AccessDeniedError)}


def run_disk_errors(where: Where, trials: int, seed: int = 0) -> Stats:
    """The n-th file a publish creates fails with EROFS / ENOSPC / EACCES (what the kernel answers on a
    read-only mount, a full disk, a store the user may not write): the typed error of its kind, the store
    at its last version, a follower unchanged; the same step publishes once the disk is back."""
    stats = Stats("read-only / full / refused local store", where.kind)
    rng = random.Random(seed)
    states = States(seed + 11)
    t0 = time.monotonic()
    real_open = os.open
    for i in range(trials):
        kind = sorted(_DISK)[i % len(_DISK)]
        code, cls = _DISK[kind]
        uri = where.fresh(f"disk-{seed}-{i}")
        with ds.Publisher(where.store(uri), anchor_every=3) as pub:
            pub.publish(states.get(0), step=0)
            sub = ds.Subscriber(where.store(uri))
            held = sub.pull().state
            fail_at = rng.randrange(1, 3)  # an object or the manifest
            seen = [0]

            def failing_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
                if flags & os.O_CREAT:
                    seen[0] += 1
                    if seen[0] >= fail_at:
                        raise (PermissionError if code == errno.EACCES else OSError)(code, os.strerror(code), path)
                return real_open(path, flags, *args, **kw)

            os.open = failing_open
            try:
                pub.publish(states.get(1), step=1)
                if seen[0] < fail_at or sub.versions() != [0, 1]:
                    stats.problem(i, f"{kind}: publish succeeded on a failing disk")
                stats.note("failure after the commit (refs/latest hint, ignored)")
                stats.trials += 1
                continue
            except cls:
                stats.faults += 1
            except DeltaStoreError as e:
                stats.problem(i, f"{kind}: {type(e).__name__} instead of {cls.__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - counted
                stats.untyped_error(i, e)
            finally:
                os.open = real_open
            t = time.monotonic()
            if sub.versions() != [0]:
                stats.lost += 1
                stats.problem(i, f"{kind}: versions {sub.versions()} after the failed publish")
            pub.publish(states.get(1), step=1)  # the disk is back: the same step again
            if not bits_equal(sub.pull(held).state, states.get(1)):
                stats.wrong += 1
                stats.problem(i, f"{kind}: step 1 pulled wrong bits after recovery")
            stats.recovery.append(time.monotonic() - t)
        stats.trials += 1
    stats.seconds = time.monotonic() - t0
    return stats


def run_store_bombs(where: Where, numel: int = 1 << 20) -> Stats:
    """An object 1 GiB (local, sparse) / 16 MiB (S3) long where the manifest says a few MiB, and a manifest
    over the 64 MiB limit: refused typed, peak RSS growth of the reader (own interpreter) < 2x the largest
    tensor."""
    import torch

    stats = Stats("store-layer bombs (object > declared size, manifest > 64 MiB)", where.kind)
    t0 = time.monotonic()
    warm, uri = where.fresh("bomb-warm"), where.fresh("bomb")
    g = torch.Generator().manual_seed(3)
    for u, n in ((warm, 64), (uri, numel)):
        with ds.Publisher(where.store(u), anchor_every=1) as pub:
            pub.publish({"big": torch.randn(n, generator=g).bfloat16()}, step=0)
    store = where.store(uri)
    victim = max(store.manifest(0).objects, key=lambda o: o.size)
    limit_mb = 2 * numel * 2 / (1 << 20)
    if where.kind == "local":
        for key in (object_key(victim.digest), version_key(1)):
            path = os.path.join(uri, *key.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(1 << 30)
    else:
        store.backend.put(object_key(victim.digest), bytes(int(limit_mb * 4) << 20))
        store.backend.put(version_key(1), bytes(MAX_MANIFEST_BYTES + 1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS])}
    out = subprocess.run([sys.executable, "-m", "test_reliability.storebomb", uri, json.dumps(where.options), warm],
                         cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    stats.trials = 2
    if out.returncode != 0:
        stats.problem("child", out.stderr[-1500:])
    else:
        got = json.loads(out.stdout.strip().splitlines()[-1])
        untyped = [e for e in got["errors"] if e.startswith("UNTYPED")]
        stats.untyped = len(untyped)
        stats.faults = sum(1 for e in got["errors"] if e.startswith(("ManifestError", "CorruptObjectError")))
        if stats.faults < 2:
            stats.problem("child", f"expected a ManifestError and a CorruptObjectError, got {got['errors']}")
        stats.note("peak RSS growth MB (x10)", int(got["growth_mb"] * 10))
        if got["growth_mb"] >= limit_mb:
            stats.problem("child", f"peak RSS grew by {got['growth_mb']} MB, limit {limit_mb} MB")
    stats.seconds = time.monotonic() - t0
    return stats
