"""Publish time per step vs a bare bit-compare (`torch.ne(old, new).nonzero()`) of the same tensors.

    python bench/publish.py [--scale N] [--runs cold-lr1e-6 dither-lr1e-5]

For every delta step of the shared trace: the time of ``Publisher.publish``
(diff, encode, hash, store, commit to a local-disk store) against the time of
the reference compare over the same old/new tensors, measured in the same run.
Goal: ratio <= 2.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

import _trace
import deltastore as ds


def main() -> None:
    a = _trace.bench_args(__doc__)
    print(f"{'run':<15} {'model MB':>9} {'density':>8} {'publish ms':>11} {'ne+nonzero ms':>14} {'ratio':>6}")
    for run in a.runs:
        tr = _trace.load(run)
        states = [_trace.scaled(s, a.scale) for _, s in tr.iter_states()]
        mb = sum(t.numel() * 2 for t in states[0].values()) / 1e6
        with tempfile.TemporaryDirectory() as d:
            pub = ds.Publisher(d, codec=a.codec, anchor_every=10**9)
            pub.publish(states[0], step=0)
            pub_ms, ref_ms, dens = [], [], []
            for step in range(1, len(states)):
                old, new = states[step - 1], states[step]
                t0 = time.perf_counter()
                for k in new:
                    torch.ne(old[k].view(torch.int16).reshape(-1), new[k].view(torch.int16).reshape(-1)).nonzero()
                ref_ms.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                info = pub.publish(new, step=step)
                pub_ms.append((time.perf_counter() - t0) * 1e3)
                dens.append(info.fraction)
            pub.close()
        p, r = statistics.median(pub_ms), statistics.median(ref_ms)
        print(f"{run:<15} {mb:>9.1f} {100 * statistics.median(dens):>7.2f}% {p:>11.1f} {r:>14.1f} {p / r:>6.2f}")


if __name__ == "__main__":
    main()
