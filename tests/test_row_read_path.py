"""The read path by rows: a delta object's tensors prepared from the parsed layout's arrays.

A follower one delta behind decodes each object as rows of the manifest's
layout (:class:`deltastore.pull.objects.RowPairs` -> ``RowSpecs`` -> ``RowNames``):
no pass per tensor to sort, count or find the target's tensors. These tests
check that the path is the one taken, that it stays bit-exact while the set
of changed tensors moves from step to step, that a decoder's lies on it are
typed errors with the target restored (``tests/test_decode_batch.py``, its
in-place liar), and that rows are only trusted against the very list they
index.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import deltastore as ds
from conftest import step_bits
from deltastore import manifest as manifest_mod
from deltastore.pull.staging import SparseOverlay, TargetAddresses, mapping_reader
from deltastore.checksum import tensor_keys
from deltastore.codecs._common import check_object, names_digest
from deltastore.codecs.base import RowNames, RowSpecs, TensorSpec
from deltastore.errors import CorruptObjectError
from deltastore.pull import objects
from deltastore.segments import pointers


def _state(n: int = 40, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # names out of name order (layer 10 before layer 2 in a state dict's order, not in sorted order)
    return {f"layers.{i}.w": (torch.randn(8 + i, 5, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}


def _step(state: dict[str, torch.Tensor], g: torch.Generator, step: int) -> None:
    """Change about 5 % of the elements of most tensors; a few tensors, different each step, not at all."""
    for i, v in enumerate(state.values()):
        if (i + step) % 7 == 0:
            continue
        hit = torch.rand(v.shape, generator=g) < 0.05
        step_bits(v.view(torch.int16), hit, g)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


@pytest.mark.parametrize("codec_id", ["auto", "ulp"])
def test_a_follower_pulls_deltas_by_rows_bit_exact_while_the_changed_set_moves(memory_uri, monkeypatch, codec_id):
    g = torch.Generator().manual_seed(1)
    state = _state()
    pub = ds.Publisher(memory_uri, codec=codec_id, anchor_every=100)
    pub.publish(state, step=0)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    sub = ds.Subscriber(memory_uri)
    sub.pull(target, step=0)
    general, by_name = [], []
    monkeypatch.setattr(objects, "_checked_batches",
                        lambda *a, _f=objects._checked_batches: general.append(1) or _f(*a))
    monkeypatch.setattr(TargetAddresses, "rows", lambda self, names, _f=TargetAddresses.rows:
                        by_name.append(1) or _f(self, names))
    sets = set()
    for step in range(1, 6):
        _step(state, g, step)
        pub.publish(state, step=step)
        res = sub.pull(target, step=step, allow_anchor=False)
        assert res.path == "delta" and _equal(target, state), step
        m = sub.manifest(step)
        assert m.row_layout is not None
        sets.add(frozenset(r.name for r in m.tensors if r.changed))
        assert set(res.written) == {r.name for r in m.tensors if r.changed}
    pub.close()
    assert len(sets) > 1  # the object held another set of tensors from one step to the next
    assert not general and not by_name  # every delta went the row path: checks and target rows as arrays


def _overlay(names: list[str], table: list[str]) -> tuple[SparseOverlay, dict[str, torch.Tensor]]:
    tensors = {n: torch.zeros(4 + i, dtype=torch.int16) for i, n in enumerate(names)}
    flat = list(tensors.values())
    addresses = TargetAddresses(list(names), pointers(flat), np.array([t.numel() for t in flat], np.int64),
                                np.dtype(np.int16), tensor_keys(list(names), len(names)))
    base = types.SimpleNamespace(checksum_values={n: 0 for n in names})
    return SparseOverlay(mapping_reader(tensors), base, tensors, write_through=True, addresses=addresses,
                         table=table), tensors


def test_rows_are_trusted_only_against_the_very_list_the_target_follows():
    names = ["a", "b", "c", "d"]
    overlay, tensors = _overlay(names, names)
    got = overlay.in_place(RowNames(["c", "a"], np.array([2, 0]), names), np.array([0, 1, 2], np.int64))
    assert got is not None and got.pointers.tolist() == [tensors["c"].data_ptr(), tensors["a"].data_ptr()]
    # rows of another list (equal or not) are not rows of this target: the names decide
    other = ["d", "c", "b", "a"]
    overlay, tensors = _overlay(names, names)
    got = overlay.in_place(RowNames(["c", "a"], np.array([1, 3]), other), np.array([0, 1, 2], np.int64))
    assert got is not None and got.pointers.tolist() == [tensors["c"].data_ptr(), tensors["a"].data_ptr()]
    assert overlay.tensors_written_in_place() == [[tensors["c"], tensors["a"]]]


def _specs(names: list[str]) -> list[TensorSpec]:
    return [TensorSpec(n, torch.bfloat16, (3,)) for n in names]


def test_row_specs_in_name_order_check_an_object_as_a_plain_list_does():
    table = ["z.w", "a.w", "m.w", "b.w"]
    specs = _specs(table)
    for rows in ([1, 3, 2, 0], [1, 2, 0], [3, 2]):  # the same table, other rows: never the last digest
        ordered = [specs[i] for i in rows]
        row_specs = RowSpecs(ordered, np.array(rows), table, np.full(len(rows), 3), True, True)
        meta = {"deltastore.names": names_digest([s.name for s in ordered])}
        got = check_object(meta, row_specs, "ulp")
        assert isinstance(got, RowSpecs) and got is not row_specs and list(got) == ordered
        assert check_object(meta, ordered, "ulp") == ordered
        with pytest.raises(CorruptObjectError, match="holds tensors"):
            check_object({"deltastore.names": names_digest(["x"])}, row_specs, "ulp")


def test_a_parsed_manifest_has_its_row_layout_and_count_columns(memory_uri):
    state = _state(6)
    with ds.Publisher(memory_uri, codec="ulp", anchor_every=100) as pub:
        pub.publish(state, step=0)
        _step(state, torch.Generator().manual_seed(4), 1)
        pub.publish(state, step=1)
    manifest_mod._LAYOUTS.clear()
    m = ds.Subscriber(memory_uri).manifest(1)
    layout = m.row_layout
    assert layout is not None and layout.names == [r.name for r in m.tensors]
    assert layout.numel_array.tolist() == [r.numel for r in m.tensors]
    assert [layout.names[i] for i in np.argsort(layout.name_rank)] == sorted(layout.names)
    assert m.count_column("delta").tolist() == [r.changed for r in m.tensors]
    assert m.count_column("diff").tolist() == [r.diff_changed for r in m.tensors]
    assert not m.count_column("delta").flags.writeable
    index = objects.object_index(m, "delta")
    (pairs,) = index.values()
    assert isinstance(pairs, objects.RowPairs)
    assert [m.tensors[i].name for i in pairs.rows] == [t.name for t, _ in pairs]
