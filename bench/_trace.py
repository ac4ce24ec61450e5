"""Locate and load the shared weight trace for benchmarks (env DELTASTORE_TRACES, default ../shared/traces)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("DELTASTORE_TRACES", ROOT.parent / "shared" / "traces"))
RUNS = ["cold-lr1e-6", "dither-lr1e-5"]


def load(run: str):
    """The ``weight_trace.Trace`` of ``run``; exits with a message when the trace is missing."""
    if not (TRACES / "weight_trace.py").exists():
        sys.exit(f"weight trace not found at {TRACES}; set DELTASTORE_TRACES")
    sys.path.insert(0, str(TRACES))
    import weight_trace

    return weight_trace.load_trace(str(TRACES / "smollm2-135m"), run=run)


def scaled(state: dict[str, torch.Tensor], scale: int) -> dict[str, torch.Tensor]:
    """``scale`` copies of every tensor under distinct names (emulates a larger model with the same statistics)."""
    if scale == 1:
        return state
    return {f"{k}.{i}" if i else k: v.clone() if i else v for i in range(scale) for k, v in state.items()}


def bench_args(doc: str) -> argparse.Namespace:
    """``--scale``, ``--runs`` and ``--codec`` for the per-step trace benchmarks; sets 2 torch threads."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--scale", type=int, default=4, help="replicate the trace tensors N times (default 4: 75 MB)")
    ap.add_argument("--runs", nargs="+", default=RUNS)
    ap.add_argument("--codec", default="raw")
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}, scale {a.scale}, codec {a.codec}")
    return a
