"""Locate and load the real weight traces for benchmarks.

Two places hold traces, one format (``weight_trace.py``'s, version 1):

* the shared folder (env ``DELTASTORE_TRACES``, default ``../shared/traces``): the loader ``weight_trace.py``
  and ``smollm2-135m`` (SmolLM2-135M, GRPO-style loss);
* ``bench/traces/`` in this repository: ``minilm-l6`` (all-MiniLM-L6-v2, a BERT encoder, contrastive loss;
  made by ``bench/make_trace_bert.py``).

The trace is chosen by name: :func:`select` (``--trace`` of the benchmarks that take it) or env
``DELTASTORE_TRACE``; the default is the shared SmolLM2 trace. A name found in both places is the shared one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("DELTASTORE_TRACES", ROOT.parent / "shared" / "traces"))
LOCAL = ROOT / "bench" / "traces"
DEFAULT = "smollm2-135m"
ENV = "DELTASTORE_TRACE"


def trace_dir(name: str | None = None) -> Path | None:
    """The folder of trace ``name`` (default: the selected one), or None when neither place has it."""
    name = name or os.environ.get(ENV) or DEFAULT
    for root in (TRACES, LOCAL):
        if (root / name / "trace.json").exists():
            return root / name
    return None


def available() -> list[str]:
    """Names of the traces found in either place."""
    return sorted({p.parent.name for root in (TRACES, LOCAL) if root.is_dir() for p in root.glob("*/trace.json")})


def runs(name: str | None = None) -> list[str]:
    """The runs of trace ``name``, sorted (``cold-...`` before ``dither-...``); [] when it is missing."""
    d = trace_dir(name)
    if d is None or not (d / "runs").is_dir():
        return []
    return sorted(r.name for r in (d / "runs").iterdir() if (r / "trace.json").exists())


def select(name: str) -> None:
    """Make trace ``name`` the one :func:`load` and :data:`RUNS` refer to, here and in child processes."""
    global RUNS
    os.environ[ENV] = name
    RUNS = runs(name) or RUNS


#: the selected trace's runs (the SmolLM2 run names when no trace is found, so argparse defaults still print)
RUNS = runs() or ["cold-lr1e-6", "dither-lr1e-5"]


def loader():
    """The ``weight_trace`` module of the shared folder; exits with a message when it is missing."""
    if not (TRACES / "weight_trace.py").exists():
        sys.exit(f"weight trace loader not found at {TRACES}; set DELTASTORE_TRACES")
    if str(TRACES) not in sys.path:
        sys.path.insert(0, str(TRACES))
    import weight_trace

    return weight_trace


def load(run: str, name: str | None = None):
    """The ``weight_trace.Trace`` of ``run`` in trace ``name`` (default: the selected one); exits with a message
    when the trace is missing."""
    wt = loader()
    d = trace_dir(name)
    if d is None:
        sys.exit(f"trace {name or os.environ.get(ENV) or DEFAULT!r} not found in {TRACES} or {LOCAL} "
                 f"(have: {', '.join(available()) or 'none'})")
    return wt.load_trace(str(d), run=run)


def short(run: str) -> str:
    """A run's kind: ``cold-lr1e-6`` -> ``cold``, ``dither-lr5e-6`` -> ``dither`` (other names unchanged)."""
    kind = run.split("-lr", 1)[0]
    return kind if kind in ("cold", "dither") else run


def scaled(state: dict[str, torch.Tensor], scale: int) -> dict[str, torch.Tensor]:
    """``scale`` copies of every tensor under distinct names (emulates a larger model with the same statistics)."""
    if scale == 1:
        return state
    return {f"{k}.{i}" if i else k: v.clone() if i else v for i in range(scale) for k, v in state.items()}


def add_trace_arg(ap: argparse.ArgumentParser) -> None:
    """``--trace NAME`` (default: env ``DELTASTORE_TRACE`` or the shared SmolLM2 trace)."""
    ap.add_argument("--trace", default=os.environ.get(ENV) or DEFAULT,
                    help=f"trace by name, from {TRACES} or {LOCAL} (have: {', '.join(available()) or 'none'})")


def bench_args(doc: str) -> argparse.Namespace:
    """``--trace``, ``--scale``, ``--runs`` and ``--codec`` for the per-step trace benchmarks; sets 2 torch
    threads."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    add_trace_arg(ap)
    ap.add_argument("--scale", type=int, default=4, help="replicate the trace tensors N times (default 4: 75 MB)")
    ap.add_argument("--runs", nargs="+", default=None, help="runs of the trace (default: all)")
    ap.add_argument("--codec", default="raw")
    a = ap.parse_args()
    select(a.trace)
    a.runs = a.runs or RUNS
    torch.set_num_threads(2)
    print(f"trace {a.trace}, torch threads {torch.get_num_threads()}, scale {a.scale}, codec {a.codec}")
    return a
