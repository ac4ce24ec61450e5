"""Anchor policies compared: stored bytes, joiner downloads, publish bytes per step.

    python bench/anchors.py [--steps 200] [--runs cold-lr1e-6 dither-lr1e-5] [--plot docs/img/anchors.png]

Each run of the shared trace is continued to ``--steps`` versions by
replaying its recorded steps cyclically (``deltastore.chains.extend_trace``),
then published under ``every(10)``, ``every(20)`` and ``adaptive``. For every
policy: total bytes stored, the bytes a joiner downloads to reach each
version (mean and worst over all versions, from ``Subscriber.plan``), and the
mean bytes published per step. The plot shows cumulative stored bytes per step.
"""

from __future__ import annotations

import argparse
import statistics

import _trace
import deltastore as ds
from deltastore.chains import extend_trace, trace_steps

POLICIES = {"every(10)": ds.every(10), "every(20)": ds.every(20), "adaptive": "adaptive"}


def measure(states, policy, codec):
    uri = f"memory://bench-anchors-{id(states)}-{policy}"
    per_step = []
    with ds.Publisher(uri, anchor=policy, codec=codec) as pub:
        for i, s in enumerate(states):
            per_step.append(pub.publish(s, step=i).nbytes)
    sub = ds.Subscriber(uri)
    joiner = [sub.plan(s).nbytes for s in range(len(states))]
    kinds = [sub.manifest(s) for s in range(len(states))]
    return {
        "stored": sum(per_step), "per_step": per_step, "joiner_mean": statistics.mean(joiner),
        "joiner_worst": max(joiner), "anchors": sum(m.kind == "anchor" for m in kinds),
        "differentials": sum(m.differential is not None for m in kinds),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", nargs="+", default=_trace.RUNS)
    ap.add_argument("--codec", default="auto")
    ap.add_argument("--plot", default="", help="write the cumulative-bytes plot here (needs matplotlib)")
    a = ap.parse_args()
    results = {}
    for run in a.runs:
        tr = _trace.load(run)
        changes, old = trace_steps(tr)
        states = list(extend_trace(tr.base, changes, old, a.steps))
        full = sum(t.numel() * 2 for t in states[0].values())
        print(f"\n{run}: {len(states)} versions, bf16 model {full / 1e6:.1f} MB, codec {a.codec}")
        print(f"{'policy':<10} {'anchors':>7} {'diffs':>5} {'stored MB':>10} {'vs every10':>10} "
              f"{'joiner mean MB':>14} {'vs every10':>10} {'joiner worst MB':>15} {'publish MB/step':>15}")
        res = {name: measure(states, pol, a.codec) for name, pol in POLICIES.items()}
        ref = res["every(10)"]
        for name, r in res.items():
            print(f"{name:<10} {r['anchors']:>7} {r['differentials']:>5} {r['stored'] / 1e6:>10.2f} "
                  f"{r['stored'] / ref['stored']:>10.2f} {r['joiner_mean'] / 1e6:>14.2f} "
                  f"{r['joiner_mean'] / ref['joiner_mean']:>10.2f} {r['joiner_worst'] / 1e6:>15.2f} "
                  f"{statistics.mean(r['per_step'][1:]) / 1e6:>15.3f}")
        results[run] = res
    if a.plot:
        import itertools

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
        for ax, (run, res) in zip(axes[0], results.items()):
            for name, r in res.items():
                ax.plot(list(itertools.accumulate(b / 1e6 for b in r["per_step"])), label=name)
            ax.set_title(f"{run}: cumulative stored bytes")
            ax.set_xlabel("step")
            ax.set_ylabel("MB")
            ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
        print(f"\nplot: {a.plot}")


if __name__ == "__main__":
    main()
