"""Shared fixtures: the real weight trace, fresh stores; :func:`require` for what the suite ships.

``make test`` (and CI, ``CI=true``) runs with ``DELTASTORE_STRICT=1``: then
anything ``make test`` installs or the repository ships (the weight trace at
``../shared/traces``, the trainer libraries of ``requirements-test.txt``, the
vLLM virtualenv) must be present, and a missing one *fails* its tests. A bare
``pytest`` on a developer's machine skips them instead, with the reason (shown
by ``-ra``).
"""

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


def strict() -> bool:
    """True under ``make test`` / CI: a missing shipped or installed requirement is a failure, not a skip."""
    return os.environ.get("DELTASTORE_STRICT") == "1" or os.environ.get("CI") == "true"


def require(ok: bool, msg: str) -> None:
    """Skip (bare pytest) or fail (:func:`strict`) with ``msg`` unless ``ok``."""
    if ok:
        return
    if strict():
        pytest.fail(f"{msg} [DELTASTORE_STRICT: make test ships or installs this, so it may not be skipped]",
                    pytrace=False)
    pytest.skip(msg)


def require_module(name: str):
    """``pytest.importorskip`` for a package ``make test`` installs: an import failure fails under :func:`strict`.

    At module level a failure here is a collection error, which stops the run: a broken install is loud.
    """
    if strict():
        import importlib

        return importlib.import_module(name)  # the real ImportError, with its traceback
    return pytest.importorskip(name)


def _trace_module():
    require((TRACES / "weight_trace.py").exists() and TRACE_DIR.exists(),
            f"weight trace not found at {TRACES} (set DELTASTORE_TRACES)")
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


def step_bits(bits: torch.Tensor, where: torch.Tensor, g: torch.Generator) -> None:
    """Change integer view ``bits`` (of a float tensor) at ``where`` (a mask or distinct indices), in place, in
    every way a trained weight's bits change, not only +1 ulp: one ulp down, several ulps up or down
    (2-999), across the sign (the sign bit flipped: same magnitude, other sign, crossing zero), and to -0.0
    (from -0.0: to +0.0). Every element at ``where`` changes."""
    old = bits[where]
    n = old.numel()
    sign = -(1 << (bits.element_size() * 8 - 1))  # the sign bit as a signed integer (0x8000 for 16 bits)
    kind = torch.randint(0, 6, (n,), generator=g)
    ulps = torch.randint(2, 1000, (n,), generator=g).to(bits.dtype)
    new = old.clone()
    new[kind == 0] += 1
    new[kind == 1] -= 1
    new[kind == 2] += ulps[kind == 2]
    new[kind == 3] -= ulps[kind == 3]
    new[kind == 4] ^= sign
    new[kind == 5] = torch.where(old[kind == 5] == sign, torch.zeros_like(old[kind == 5]),
                                 torch.full_like(old[kind == 5], sign))
    bits[where] = new


def edit_tensor_columns(uri: str, doc: dict, edit) -> None:
    """What a hostile writer of the local store ``uri`` can do to the tensor columns of manifest document
    ``doc``: ``edit(columns)`` changes ``{field: column}`` (every field of a tensor record). From format 1.3
    the name, dtype and shape columns are a layout object: the edited ones are stored as a new layout object
    under its own digest, and ``doc`` names that one."""
    import hashlib
    import json

    from deltastore.manifest import LAYOUT_FIELDS
    from deltastore.store import object_key

    ref = doc.get("layout")
    if ref is None:  # 1.2: the columns are the document's
        edit(doc["tensors"])
        return
    layout = json.loads(Path(uri, *object_key(ref["digest"]).split("/")).read_bytes())
    columns = {**{k: layout[k] for k in LAYOUT_FIELDS}, **doc["tensors"]}  # the same lists: edited in place
    edit(columns)
    data = json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = Path(uri, *object_key(digest).split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    doc["layout"] = {"digest": digest, "size": len(data)}


def publish_all(uri: str, states: list, **publisher_args) -> None:
    """Publish ``states`` as steps 0, 1, ... with one Publisher."""
    import deltastore as ds

    with ds.Publisher(uri, **publisher_args) as pub:
        for step, state in enumerate(states):
            pub.publish(state, step=step)


def quick_gc_store(uri: str):
    """A store on ``uri`` whose publishers refresh every reused object right before each commit
    (``refresh_window=0``): on local disk and memory (exact timestamps) it accepts a GC grace of 0
    (``DeltaStore.min_gc_grace``), for tests that collect at once."""
    from deltastore.backends import open_backend
    from deltastore.store import DeltaStore

    return DeltaStore(open_backend(uri), uri, refresh_window=0.0)


def follower_at(uri: str, step: int):
    """A Subscriber and the dict target it pulled to ``step`` (the anchor at 0, then deltas)."""
    import deltastore as ds

    sub = ds.Subscriber(uri)
    target = sub.pull(step=0).state
    sub.pull(target, step=step)
    return sub, target
