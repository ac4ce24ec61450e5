"""A commit's wait for concurrent GC deletes (docs/format.md, P3) skips the objects the parent version
names while the parent's manifest is stored as it was: a resumed publisher reuses its parent's layout
object, and on S3, GCS or HF its first commit used to wait the whole delete window for it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import deltastore as ds
from deltastore import store as store_mod
from deltastore.backends import open_backend
from deltastore.backends.base import WrapperBackend
from deltastore.store import DELETE_WINDOW, DeltaStore, version_key


class _NoConditionalDelete(WrapperBackend):
    """Local disk as a backend without an atomic conditional delete (as S3, GCS and HF are)."""

    @property
    def capabilities(self):  # noqa: ANN201
        return dataclasses.replace(self.inner.capabilities, conditional_delete=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(32, 48, generator=g).to(torch.bfloat16) for i in range(3)}


@pytest.mark.parametrize("parent", ["stored", "gone", "rewritten"])
def test_a_resumed_publisher_waits_only_for_objects_its_stored_parent_does_not_name(tmp_path, monkeypatch, parent):
    uri = str(tmp_path / "store")

    def store() -> DeltaStore:
        return DeltaStore(_NoConditionalDelete(open_backend(uri)), uri)

    with ds.Publisher(store(), anchor_every=10) as pub:
        pub.publish(_state(0), step=0)
        pub.publish(_state(1), step=1)
    slept: list[float] = []
    monkeypatch.setattr(store_mod.time, "sleep", slept.append)
    vouched: list[frozenset[str]] = []
    real = DeltaStore._named_by_stored_parent
    monkeypatch.setattr(DeltaStore, "_named_by_stored_parent",
                        lambda self, m: vouched.append(real(self, m)) or vouched[-1])
    resumed = store()
    with ds.Publisher(resumed, anchor_every=10, resume=True) as pub:
        path = os.path.join(uri, version_key(1))
        if parent == "gone":
            os.remove(path)
        elif parent == "rewritten":  # another manifest under the parent's step: it vouches for nothing
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(data + b" ")
        info = pub.publish(_state(2), step=2)
    assert info.kind == "delta"
    m = resumed.manifest(2)
    assert len(vouched) == 1  # the commit reused an object: the parent's layout object
    waits = [s for s in slept if s > DELETE_WINDOW / 2]
    if parent == "stored":
        assert m.layout_ref is not None and m.layout_ref.digest in vouched[0]
        assert waits == []
    else:
        assert vouched == [frozenset()]
        assert len(waits) == 1
    assert 2 in resumed.versions()
    if parent == "stored":
        follower = ds.Subscriber(uri).pull(step=2).state
        assert all(torch.equal(follower[k].view(torch.int16), v.view(torch.int16)) for k, v in _state(2).items())
