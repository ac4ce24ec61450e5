"""Shared fixtures: the real weight trace, fresh stores."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("DELTASTORE_TRACES", ROOT.parent / "shared" / "traces"))
TRACE_DIR = TRACES / "smollm2-135m"
RUNS = ["cold-lr1e-6", "dither-lr1e-5"]


def _trace_module():
    if not (TRACES / "weight_trace.py").exists() or not TRACE_DIR.exists():
        msg = f"weight trace not found at {TRACES} (set DELTASTORE_TRACES)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)  # CI has ../shared: a missing trace is a failure there
        pytest.skip(msg)
    if str(TRACES) not in sys.path:
        sys.path.insert(0, str(TRACES))
    import weight_trace

    return weight_trace


@pytest.fixture(scope="session", params=RUNS)
def trace(request):
    """Each run of the shared SmolLM2 trace (weight_trace.Trace)."""
    return _trace_module().load_trace(str(TRACE_DIR), run=request.param)


@pytest.fixture(scope="session")
def dither_trace():
    """The denser run (lr 1e-5) only."""
    return _trace_module().load_trace(str(TRACE_DIR), run="dither-lr1e-5")


@pytest.fixture
def store_uri(tmp_path):
    """A fresh local-disk store."""
    return str(tmp_path / "store")


@pytest.fixture
def memory_uri():
    """A fresh in-memory store."""
    return f"memory://{uuid.uuid4().hex}"


def bits_equal(a: dict, b: dict) -> bool:
    """Bit-exact equality of two state dicts (integer views, never allclose)."""
    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k].detach().cpu(), b[k].detach().cpu()
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        w = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        if not torch.equal(x.contiguous().view(w), y.contiguous().view(w)):
            return False
    return True
