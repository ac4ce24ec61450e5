"""Inference side of the CPU GRPO example: follow the store, apply each new version, check it.

Polls the store; whenever the served model is behind, pulls the latest version
in place (bf16 ``TinyLM``), checks every tensor against the version's checksums
with ``Subscriber.verify`` and prints step, lag, bytes fetched and whether the
weights are bit-exact. ``--serve-ms`` pretends to serve requests between polls
(a slow server skips versions and takes them in one pull); ``--max-lag K``
tolerates K versions of staleness before pulling (``Subscriber.sync``).

Stops after holding ``--steps`` (the trainer's last step), or when no new
version arrived for ``--idle-timeout`` seconds. Exit status 0 only if every
pull was bit-exact and the last step was reached.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import deltastore as ds
from deltastore.demo import TinyLM
from deltastore.errors import ChecksumMismatchError


def server_model(sub: ds.Subscriber, step: int) -> TinyLM:
    """The inference server's bf16 model, sized from a manifest (random weights: the first pull replaces them)."""
    shapes = {t.name: t.shape for t in sub.manifest(step).tensors}
    layers = 1 + max(int(n.split(".")[2]) for n in shapes if n.startswith("blocks.layers."))
    return TinyLM(d=shapes["embed.weight"][1], layers=layers, ctx=shapes["pos"][0]).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="./grpo-store")
    ap.add_argument("--steps", type=int, default=200, help="stop once this step is held")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between looks at the store")
    ap.add_argument("--serve-ms", type=float, default=0.0, help="simulated serving time between polls")
    ap.add_argument("--max-lag", type=int, default=0, help="versions of staleness tolerated before pulling")
    ap.add_argument("--idle-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)

    sub = ds.Subscriber(args.store, max_lag=args.max_lag)
    model = None
    pulls, exact_all, held = 0, True, None
    last_new = time.time()
    print(f"{'step':>5} {'behind':>6} {'lag':>4} {'path':>6} {'applied':>12} {'fetched B':>10} {'pull ms':>8}  bit-exact", flush=True)
    while True:
        res, latest = None, sub.latest()
        if latest is not None and model is None:
            model = server_model(sub, latest)
        if latest is not None:
            behind = sub.lag(model)  # None until the first pull: the model's version is unknown
            t0 = time.perf_counter()
            res = sub.sync(model)  # pulls the latest version only if more than max_lag versions behind
            if res is None and latest >= args.steps and (held or 0) < args.steps:
                res = sub.pull(model)  # the trainer is done: take its last version whatever max_lag says
            ms = (time.perf_counter() - t0) * 1e3
        if res is not None:
            try:
                sub.verify(model)  # every tensor's checksum against the version it now holds
                exact = True
            except ChecksumMismatchError as e:
                print(f"NOT bit-exact: {e}", file=sys.stderr)
                exact = False
            exact_all &= exact
            pulls += 1
            held = res.step
            last_new = time.time()
            applied = ",".join(map(str, res.versions_applied))
            if len(applied) > 12:
                applied = f"{res.versions_applied[0]}..{res.versions_applied[-1]}"
            print(f"{res.step:>5} {'-' if behind is None else behind:>6} {res.lag:>4} {res.path:>6} {applied:>12} {res.bytes_fetched:>10,} {ms:>8.1f}  "
                  f"{'yes' if exact else 'NO'}", flush=True)
        if held is not None and held >= args.steps:
            break
        if time.time() - last_new > args.idle_timeout:
            print(f"no new version for {args.idle_timeout:.0f} s; stopping at step {held}", file=sys.stderr)
            break
        if args.serve_ms:
            time.sleep(args.serve_ms / 1e3)  # "serving" with the weights held
        time.sleep(args.poll)
    sub.close()
    ok = exact_all and held is not None and held >= args.steps
    print(f"DONE step={held} pulls={pulls} all_exact={exact_all}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
