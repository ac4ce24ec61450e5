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
from typing import Any, NamedTuple

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


def chain_states(n: int, shapes: dict[str, tuple[int, ...]] | None = None, *, changes: float | int = 0.02,
                 seed: int = 0, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0,
                 every_step: dict[int, float | int] | None = None) -> list[dict[str, torch.Tensor]]:
    """``n`` states of a model as a trainer would publish them: the first drawn at random (``shapes``: name ->
    shape, default ``{"a": (64, 48), "b": (48,)}``; ``scale`` times a standard normal, in ``dtype``), each
    next one with some of every tensor's elements one bit-step up (integer view + 1): ``changes`` of them
    when a float (each element with that probability), exactly ``changes`` when an int (at distinct
    positions); ``every_step`` overrides it for given steps. Seeded: the same arguments give the same bits."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (64, 48), "b": (48,)} if shapes is None else shapes
    state = {k: (torch.randn(shape, generator=g) * scale).to(dtype) for k, shape in shapes.items()}
    out = [state]
    for step in range(1, n):
        many = (every_step or {}).get(step, changes)
        state = {k: v.clone() for k, v in state.items()}
        for v in state.values():
            bits = v.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[v.element_size()]).view(-1)
            if isinstance(many, float):
                bits[torch.rand(bits.shape, generator=g) < many] += 1
            else:
                bits[torch.randperm(bits.numel(), generator=g)[:many]] += 1
        out.append(state)
    return out


class Published(NamedTuple):
    """What the ``published`` fixture made: the store, its versions' states, and (with ``follower``) a
    Subscriber with the dict target it pulled to that step."""

    uri: str
    states: list[dict[str, torch.Tensor]]
    sub: Any = None
    target: Any = None


@pytest.fixture
def published(request, store_uri) -> Published:
    """A local store holding :func:`chain_states` as versions 0, 1, ... (an anchor at 0 only:
    ``anchor_every=100``). A test module sets ``PUBLISHED = {...}``: :func:`chain_states` arguments (``n``
    default 5), ``publisher`` (more Publisher arguments) and ``follower`` (a step: a Subscriber and the dict
    target it pulled to that step, the anchor at 0 then deltas, checked bit-exact)."""
    cfg = dict(getattr(request.module, "PUBLISHED", {}))
    follower = cfg.pop("follower", None)
    publisher = {"anchor_every": 100, **cfg.pop("publisher", {})}
    states = chain_states(cfg.pop("n", 5), **cfg)
    publish_all(store_uri, states, **publisher)
    if follower is None:
        return Published(store_uri, states)
    from deltastore.testing import bits_equal

    sub, target = follower_at(store_uri, follower)
    assert bits_equal(target, states[follower])
    return Published(store_uri, states, sub, target)
