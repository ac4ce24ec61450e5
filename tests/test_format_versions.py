"""A chain whose early versions were written in the 1.0 row form (deltastore 0.1), later ones in 1.2
columns and the last ones in 1.3 (columns naming a layout object): a publisher resumes across each change,
followers and joiners pull through them bit-exactly, and the store verifies."""

from __future__ import annotations

import json
import os

import torch

import deltastore as ds
from conftest import chain_states
from deltastore.testing import bits_equal
from deltastore.publish import commit as commit_module
from deltastore.manifest import COLUMNS_FORMAT_VERSION, FORMAT_VERSION, LAYOUT_OBJECT_FORMAT_VERSION
from deltastore.store import version_key
from deltastore.pull.verify import verify_store


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return chain_states(n, {f"l{i}.w": (16, 8) for i in range(70)}, changes=5, scale=0.02, seed=seed)


def test_a_chain_written_in_rows_then_columns_is_resumed_and_pulled_through(store_uri, monkeypatch):
    states = _states(9)
    monkeypatch.setattr(commit_module, "LAYOUT_OBJECT_FORMAT_VERSION", FORMAT_VERSION)  # as deltastore 0.1 wrote
    with ds.Publisher(store_uri, anchor_every=4) as pub:
        for step in range(3):
            pub.publish(states[step], step=step)
    monkeypatch.setattr(commit_module, "LAYOUT_OBJECT_FORMAT_VERSION", COLUMNS_FORMAT_VERSION)  # deltastore 0.2
    follower = ds.Subscriber(store_uri).pull(step=2).state
    with ds.Publisher(store_uri, anchor_every=4) as pub:  # resumes on the 1.0 chain
        for step in range(3, 6):
            pub.publish(states[step], step=step)
    monkeypatch.undo()
    with ds.Publisher(store_uri, anchor_every=4) as pub:  # resumes on the 1.2 chain
        for step in range(6, 9):
            pub.publish(states[step], step=step)

    forms = []
    for step in range(9):
        with open(os.path.join(store_uri, *version_key(step).split("/"))) as f:
            doc = json.load(f)
        forms.append((doc["format_version"], type(doc["tensors"]).__name__, "layout" in doc))
    assert forms == ([("1.0", "list", False)] * 3 + [(COLUMNS_FORMAT_VERSION, "dict", False)] * 3
                     + [(LAYOUT_OBJECT_FORMAT_VERSION, "dict", True)] * 3)

    sub = ds.Subscriber(store_uri)
    assert sub.manifest(3).parent == sub.store.ref(2)  # the chain goes on across each change
    assert sub.manifest(6).parent == sub.store.ref(5)
    got = sub.pull(follower, step=8, allow_anchor=False)
    assert got.path == "delta" and got.versions_applied == list(range(3, 9)) and bits_equal(follower, states[8])
    assert bits_equal(ds.Subscriber(store_uri).pull(step=8).state, states[8])  # a joiner
    assert verify_store(ds.open_store(store_uri)).ok
