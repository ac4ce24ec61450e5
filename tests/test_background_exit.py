"""Background publishing at the edges: versions dropped behind a failure raise a typed error chaining it,
and a script that exits without ``close()`` commits its queued versions at exit (with a warning).

The exit cases run as real scripts in their own interpreter: what happens at interpreter shutdown cannot
be seen from inside the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import deltastore as ds
from deltastore.testing import bits_equal
from deltastore.errors import StoreFullError, VersionDroppedError
from deltastore.store import DeltaStore
from deltastore.testing.faults import Fault, FaultyBackend
from deltastore.backends import open_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(4096, generator=g).bfloat16(), "b": torch.randn(64, generator=g).bfloat16()}
            for _ in range(n)]


def test_versions_dropped_behind_a_failure_raise_a_typed_error_chaining_it(tmp_path):
    uri = str(tmp_path / "s")
    states = _states(4)
    full = Fault("permanent", ops="put", prefix="versions/", skip=1, limit=1,
                 error=lambda msg: StoreFullError(f"no space left: {msg}"))
    queued = threading.Event()  # version 1's commit waits until 2 and 3 are queued behind it, then fails
    hold = Fault("pause", ops="put", prefix="versions/", skip=1, limit=1, hook=lambda op, key: queued.wait(60))
    pub = ds.Publisher(DeltaStore(FaultyBackend(open_backend(uri), rules=[hold, full]), uri), background=True)
    assert pub.publish(states[0], step=0).wait().step == 0
    infos = [pub.publish(states[k], step=k) for k in (1, 2, 3)]
    queued.set()
    with pytest.raises(StoreFullError, match="no space left: injected permanent fault on put 'versions/"):
        infos[0].wait()
    for k, info in zip((2, 3), infos[1:]):
        with pytest.raises(VersionDroppedError, match=rf"version {k} was dropped: an earlier background publish "
                                                      r"failed \(StoreFullError: no space left") as e:
            info.wait()
        assert isinstance(e.value, RuntimeError) and isinstance(e.value.__cause__, StoreFullError)
    with pytest.raises(StoreFullError):  # the failure itself also reaches the next call, once
        pub.flush()
    assert full._fired == 1
    store = ds.open_store(uri)
    assert store.versions() == [0]  # nothing of 1..3 was committed, nothing committed was lost
    assert bits_equal(ds.Subscriber(uri).pull(step=0).state, states[0])
    assert pub.publish(states[1], step=1).wait().kind == "anchor"  # a new chain, and it commits
    pub.close()
    assert bits_equal(ds.Subscriber(uri).pull(step=1).state, states[1])


_SCRIPT = r"""
import json, sys, threading
import torch, deltastore as ds
from deltastore.backends import open_backend
from deltastore.store import DeltaStore
from deltastore.testing.faults import Fault, FaultyBackend

uri, n, gated = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "gated"
g = torch.Generator().manual_seed(0)
states = [{"w": torch.randn(4096, generator=g).bfloat16()} for _ in range(n)]
gate = threading.Event()
rules = [Fault("pause", ops="put", prefix="versions/", limit=1, hook=lambda op, key: gate.wait(60))] if gated else []
pub = ds.Publisher(DeltaStore(FaultyBackend(open_backend(uri), rules=rules), uri), background=True,
                   max_pending=n)
for k, s in enumerate(states):
    pub.publish(s, step=k)
# the writer holds version 0's commit until the interpreter starts to exit: every version is still queued
# then (this hook is registered after the Publisher's, so it runs before it)
threading._register_atexit(gate.set)
print(json.dumps([int(s["w"].view(torch.int16).sum()) for s in states]), flush=True)
# no close(), no flush()
"""


@pytest.mark.parametrize("gated", [True, False], ids=["all queued at exit", "writer racing the exit"])
def test_a_script_that_exits_without_close_commits_its_queued_versions_and_warns(tmp_path, gated):
    uri = str(tmp_path / "s")
    n = 4
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, uri, str(n), "gated" if gated else "free"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Fatal Python error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if gated:
        assert f"UnclosedPublisherWarning: deltastore: a background Publisher was not closed: committing its {n} " \
               "queued version(s) at interpreter exit" in proc.stderr, proc.stderr[-3000:]
    sums = json.loads(proc.stdout)
    sub = ds.Subscriber(uri)
    assert sub.versions() == list(range(n))  # nothing queued was lost
    g = torch.Generator().manual_seed(0)
    for k in range(n):
        want = {"w": torch.randn(4096, generator=g).bfloat16()}
        assert int(want["w"].view(torch.int16).sum()) == sums[k]
        assert bits_equal(sub.pull(step=k).state, want), k
