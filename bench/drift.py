"""What the drift tracker costs a synchronous publish: wall ms per step of its count and its merge.

    .venv/bin/python bench/drift.py [--size 1.0] [--run dither-lr1e-5] [--steps 5]

Data as in ``bench/scale.py`` (the real trace replicated to ``--size`` GB of
bf16). A Publisher with the defaults (the adaptive policy, which tracks the
drift) writes an anchor and ``--steps`` deltas to a temporary local store;
``DriftTracker.propose`` (the count that decides the anchor policy) and
``DriftTracker.commit`` (the merge into the committed table) are timed with a
wall clock around each call, next to the whole ``publish()``. A step that
also writes a differential builds its proposal while reading it, so its
commit has nothing left to merge. The last step is pulled at the end and
checked bit-exact against the model.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import scale  # noqa: E402
import deltastore as ds  # noqa: E402
from deltastore.publish import drift  # noqa: E402


def _timed(log: dict[str, float], name: str):
    f = getattr(drift.DriftTracker, name)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            log[name] = log.get(name, 0.0) + time.perf_counter() - t0
    setattr(drift.DriftTracker, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="model size in GB of bf16")
    ap.add_argument("--run", default="dither-lr1e-5")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    log: dict[str, float] = {}
    for name in ("propose", "commit"):
        _timed(log, name)
    src = scale.build({"size": a.size}, a.run, "model")
    with tempfile.TemporaryDirectory(prefix="deltastore-drift-") as store:
        with ds.Publisher(store) as pub:
            pub.publish(src.state, step=0)
            print("| step | publish ms | propose ms | commit ms | differential | drift MB |")
            print("|---:|---:|---:|---:|---|---:|")
            for t in range(1, a.steps + 1):
                src.advance(keep=False)
                log.clear()
                t0 = time.perf_counter()
                info = pub.publish(src.state, step=t)
                wall = time.perf_counter() - t0
                print(f"| {t} | {wall * 1e3:.0f} | {log.get('propose', 0) * 1e3:.0f} | {log.get('commit', 0) * 1e3:.0f} "
                      f"| {info.differential} | {pub.head.drift.nbytes / 1e6:.1f} |")  # the tracker's own count
        ok = scale.bits_equal(ds.Subscriber(store).pull(step=a.steps).state, src.state)
    print("bit-exact" if ok else "NOT bit-exact")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
