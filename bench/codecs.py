"""Codec benchmark on a real weight trace (the shared SmolLM2 one, or another by --trace: bench/_trace.py).

    .venv/bin/python bench/codecs.py [--trace minilm-l6] [--steps 1,2,5,10] [--runs cold-lr1e-6,...]

Per run and codec: bytes per changed element (all chosen steps together), % of
the full bf16 size of the recorded tensors, ratios against the reference
encoders (bench/reference_encoders.py) and the independent-position bound
measured in the same run, encode throughput, and decode + apply throughput in
MB of model per second with 1 and 2 threads (decode of the whole step plus
writing the changed elements into a copy of the old state).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _trace  # noqa: E402
import reference_encoders as ref  # noqa: E402

from deltastore.codecs import TensorSpec, Update, get_codec  # noqa: E402

CODECS = ["raw", "zstd", "ulp", "ctx", "auto", "auto-bytes"]


def step_inputs(tr, step, state):
    ups, changes = [], {}
    for name, (idx, bits) in tr.changes(step).items():
        old = state[name].contiguous().view(torch.int16).reshape(-1)
        spec = TensorSpec(name, torch.bfloat16, tuple(state[name].shape))
        ups.append(Update(spec, bits, idx, old[idx].clone(), old))
        changes[name] = (idx.numpy(), bits.numpy(), old[idx].numpy(), spec.shape, torch.bfloat16)
    return ups, changes


def decode_apply(codec, data, ups, olds):
    specs = [u.spec for u in ups]
    out = codec.decode(data, specs, lambda n, p: olds[n] if p is None else olds[n][p])
    for name, u in out.items():
        olds[name].clone()[u.positions] = u.bits  # the apply: a scatter into the tensor
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    _trace.add_trace_arg(ap)
    ap.add_argument("--runs", default=None, help="comma list (default: every run of the trace)")
    ap.add_argument("--steps", default="all", help="comma list or 'all'")
    ap.add_argument("--codecs", default=",".join(CODECS))
    args = ap.parse_args()
    _trace.select(args.trace)

    for run in (args.runs.split(",") if args.runs else _trace.RUNS):
        tr = _trace.load(run)
        steps = range(1, tr.steps + 1) if args.steps == "all" else [int(s) for s in args.steps.split(",")]
        model_bytes = sum(t.numel() * 2 for t in tr.base.values())
        totals: dict[str, float] = {}
        enc_t: dict[str, float] = {}
        dec_t: dict[tuple[str, int], float] = {}
        changed = 0
        refs = {"trl_raw": 0.0, "trl_gap16": 0.0, "pulse": 0.0, "bound": 0.0}
        for step in steps:
            state = tr.state(step - 1)
            ups, changes = step_inputs(tr, step, state)
            olds = {u.spec.name: u.old_tensor for u in ups}
            changed += sum(u.count for u in ups)
            refs["trl_raw"] += ref.trl_raw(changes)
            refs["trl_gap16"] += ref.trl_gap16(changes)
            refs["pulse"] += ref.pulse(changes)
            refs["bound"] += ref.independent_bound(changes)
            for cid in args.codecs.split(","):
                codec = _codec(cid)
                t0 = time.perf_counter()
                data = codec.encode(ups)
                enc_t[cid] = enc_t.get(cid, 0) + time.perf_counter() - t0
                totals[cid] = totals.get(cid, 0) + len(data)
                for threads in (1, 2):
                    _set_threads(threads)
                    t0 = time.perf_counter()
                    out = decode_apply(codec, data, ups, olds)
                    dec_t[cid, threads] = dec_t.get((cid, threads), 0) + time.perf_counter() - t0
                for u in ups:  # bit-exact, always
                    assert torch.equal(out[u.spec.name].positions, u.positions)
                    assert torch.equal(out[u.spec.name].bits, u.bits)
        n = len(list(steps))
        mb = model_bytes * n / 1e6
        print(f"\n## {run}: {n} steps, {changed:,} changed elements "
              f"({100 * changed / (model_bytes / 2 * n):.2f} % density), model {model_bytes / 1e6:.1f} MB")
        print(f"references (B/changed el): TRL raw {refs['trl_raw'] / changed:.3f}, "
              f"TRL gap16 {refs['trl_gap16'] / changed:.3f}, PULSE-style {refs['pulse'] / changed:.3f}, "
              f"independent-position bound {refs['bound'] / changed:.3f}\n")
        print("| codec | B/changed el | % of bf16 | x bound | PULSE / codec | TRL raw / codec | encode MB/s | "
              "decode+apply MB/s 1 thr | 2 thr |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for cid, b in totals.items():
            print(f"| {cid} | {b / changed:.3f} | {100 * b / (model_bytes * n):.3f} | {b / refs['bound']:.3f} | "
                  f"{refs['pulse'] / b:.2f} | {refs['trl_raw'] / b:.2f} | {mb / enc_t[cid]:.0f} | "
                  f"{mb / dec_t[cid, 1]:.0f} | {mb / dec_t[cid, 2]:.0f} |")
    dense_report(tr)


def dense_report(tr) -> None:
    ups = [Update(TensorSpec(n, torch.bfloat16, tuple(t.shape)), t.contiguous().view(torch.int16).reshape(-1))
           for n, t in tr.base.items()]
    raw = sum(u.count * 2 for u in ups)
    codec = get_codec({"id": "dense", "config": {"planes": True}})
    data = codec.encode(ups)
    print("\n## dense (anchor of the recorded tensors)\n\n| threads | % of raw bf16 | encode MB/s | decode MB/s |")
    print("|---:|---:|---:|---:|")
    for threads in (1, 2):
        _set_threads(threads)
        te = min(_timed_encode(codec, ups) for _ in range(3))
        best = min(_timed(codec, data, ups) for _ in range(3))
        print(f"| {threads} | {100 * len(data) / raw:.2f} | {raw / 1e6 / te:.0f} | {raw / 1e6 / best:.0f} |")


def _codec(cid: str):
    """A codec by name; ``auto-bytes`` is ``auto`` with ``link_mbps=None`` (smallest bytes, machine-independent)."""
    if cid == "auto-bytes":
        return get_codec({"id": "auto", "config": {"link_mbps": None}})
    return get_codec(cid)


def _set_threads(threads: int) -> None:
    """Per-tensor codec threads, kernel threads and torch threads, all to ``threads``."""
    os.environ["DELTASTORE_CODEC_THREADS"] = str(threads)
    os.environ["DELTASTORE_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _timed_encode(codec, ups) -> float:
    t0 = time.perf_counter()
    codec.encode(ups)
    return time.perf_counter() - t0


def _timed(codec, data, ups) -> float:
    t0 = time.perf_counter()
    out = codec.decode(data, [u.spec for u in ups])
    dt = time.perf_counter() - t0
    assert all(torch.equal(out[u.spec.name].bits, u.bits) for u in ups)
    return dt


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
