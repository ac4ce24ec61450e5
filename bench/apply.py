"""Pull/apply time of one delta vs a dense copy of the same tensors.

    python bench/apply.py [--scale N] [--runs cold-lr1e-6 dither-lr1e-5]

A follower at step k-1 pulls step k from a local-disk store (fetch, sha256,
decode, checksum checks, in-place write); the reference copies every tensor
of step k into the target (``dst.copy_(src)``), which is the cost of applying
a full checkpoint that is already in memory. Goal: <= 10 % at ~1 % density.
A second reference is what a full reload really costs: loading step k's
safetensors checkpoint from the same disk (page cache warm) and copying it in.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

import _trace
import deltastore as ds


def main() -> None:
    a = _trace.bench_args(__doc__)
    print(f"{'run':<15} {'model MB':>9} {'density':>8} {'pull ms':>8} {'dense copy ms':>14} {'ratio':>6} "
          f"{'load+copy ms':>13} {'ratio':>6}")
    for run in a.runs:
        tr = _trace.load(run)
        states = [_trace.scaled(s, a.scale) for _, s in tr.iter_states()]
        mb = sum(t.numel() * 2 for t in states[0].values()) / 1e6
        with tempfile.TemporaryDirectory() as d:
            with ds.Publisher(d, codec=a.codec, anchor_every=10**9) as pub:
                dens = [pub.publish(s, step=i).fraction for i, s in enumerate(states)][1:]
            sub = ds.Subscriber(d)
            target = {k: v.clone() for k, v in states[0].items()}
            sub.pull(target, step=0)
            pull_ms, copy_ms, load_ms = [], [], []
            scratch = {k: torch.empty_like(v) for k, v in states[0].items()}
            for step in range(1, len(states)):
                t0 = time.perf_counter()
                res = sub.pull(target, step=step)
                pull_ms.append((time.perf_counter() - t0) * 1e3)
                assert res.path == "delta"
                t0 = time.perf_counter()
                for k, v in states[step].items():
                    scratch[k].copy_(v)
                copy_ms.append((time.perf_counter() - t0) * 1e3)
                ckpt = os.path.join(d, "full.safetensors")
                save_file(states[step], ckpt)
                t0 = time.perf_counter()
                for k, v in load_file(ckpt).items():
                    scratch[k].copy_(v)
                load_ms.append((time.perf_counter() - t0) * 1e3)
            for k, v in states[-1].items():
                assert torch.equal(target[k].view(torch.int16), v.view(torch.int16)), k
        p, c, f = statistics.median(pull_ms), statistics.median(copy_ms), statistics.median(load_ms)
        print(f"{run:<15} {mb:>9.1f} {100 * statistics.median(dens):>7.2f}% {p:>8.1f} {c:>14.1f} {p / c:>6.2f} "
              f"{f:>13.1f} {p / f:>6.2f}")


if __name__ == "__main__":
    main()
