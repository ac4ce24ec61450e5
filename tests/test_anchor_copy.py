"""``Publisher(anchor_copy_dir=)``: differentials of a sampled drift from a local copy of the anchor's bits.

Every case forces the drift tracker to sample (a 20 kB budget), so each differential needs the anchor's bits
everywhere: without a copy they are streamed back from the store, with one they are read from the file.
"""

from __future__ import annotations

import os

import pytest
import torch

import deltastore as ds
import deltastore.publish.chain as chain_mod
from conftest import step_bits
from deltastore.errors import PostCommitWarning
from deltastore.publish.anchors import Adaptive
from deltastore.store import DeltaStore
from deltastore.tensors import bits_view
from deltastore.testing import bits_equal


@pytest.fixture(autouse=True)
def sampled_drift(monkeypatch):
    monkeypatch.setattr(chain_mod, "DRIFT_MEMORY_MIN", 20_000)
    monkeypatch.setattr(chain_mod, "DRIFT_MEMORY_FRACTION", 0.0)


@pytest.fixture(scope="module")
def states() -> list[dict[str, torch.Tensor]]:
    """26 versions of a model of bf16 and fp32 tensors, 2 % of each tensor's elements changed per step in every
    way a weight's bits change."""
    g = torch.Generator().manual_seed(3)
    out = [{"a": torch.randn(256, 128, generator=g).to(torch.bfloat16),
            "b": torch.randn(4096, generator=g).to(torch.bfloat16), "c": torch.randn(64, 64, generator=g)}]
    for _ in range(25):
        nxt = {k: v.clone() for k, v in out[-1].items()}
        for v in nxt.values():
            bits = bits_view(v).view(-1)
            step_bits(bits, torch.randperm(bits.numel(), generator=g)[:bits.numel() // 50], g)
        out.append(nxt)
    return out


def policy() -> Adaptive:
    """Anchors every 10 versions, differentials in between."""
    return Adaptive(max_chain=10, budget=100, differential_gain=0.5)


@pytest.fixture
def reads(monkeypatch) -> dict[int, int]:
    """Objects each store (by id) was asked for."""
    counts: dict[int, int] = {}
    real = DeltaStore.get_object

    def counted(store, digest, size=None):  # noqa: ANN001, ANN202
        counts[id(store)] = counts.get(id(store), 0) + 1
        return real(store, digest, size)

    monkeypatch.setattr(DeltaStore, "get_object", counted)
    return counts


def publish(uri: str, states, **kwargs):  # noqa: ANN001
    pub = ds.Publisher(uri, anchor=policy(), **kwargs)
    infos = [pub.publish(s, step=i) for i, s in enumerate(states)]
    return pub, infos


def differential_digests(uri: str, step: int) -> list[str]:
    m = ds.open_store(uri).manifest(step)
    return sorted(m.objects[i].digest for i in m.diff_objects)


@pytest.mark.parametrize("chunk", [None, 5000], ids=["one chunk", "5 kB chunks"])
def test_a_copy_gives_the_same_differentials_and_reads_nothing_back(tmp_path, states, reads, monkeypatch, chunk):
    """With 5 kB chunks the copy is read back in several chunks, tensor "a" (64 KiB) alone in one above the limit."""
    if chunk is not None:
        monkeypatch.setattr("deltastore.publish.anchor_copy.CHUNK_BYTES", chunk)
    plain, copied, copy_dir = str(tmp_path / "plain"), str(tmp_path / "copied"), tmp_path / "copy"
    pub, infos = publish(plain, states)
    assert reads.get(id(pub.store), 0) > 0  # without a copy each differential streams the anchor back
    pub.close()
    pub, infos_copied = publish(copied, states, anchor_copy_dir=copy_dir)
    files = os.listdir(copy_dir)
    assert len(files) == 1 and files[0].startswith("deltastore-anchor-")
    assert oct(os.stat(copy_dir / files[0]).st_mode & 0o777) == oct(0o600)
    assert reads.get(id(pub.store), 0) == 0
    pub.close()
    assert os.listdir(copy_dir) == []  # removed at close
    kinds = [(i.kind, i.differential) for i in infos]
    assert kinds == [(i.kind, i.differential) for i in infos_copied]
    diffs = [i.step for i in infos if i.differential]
    assert sum(i.kind == "anchor" for i in infos) >= 3 and len(diffs) >= 4
    for step in diffs:  # the same changes, hence the same objects, byte for byte
        assert differential_digests(copied, step) == differential_digests(plain, step)
    sub = ds.Subscriber(copied)
    for step in diffs:
        assert sub.plan(step).differential == step
        assert bits_equal(sub.pull(step=step).state, states[step])


def test_a_copy_in_the_background_writer(tmp_path, states, reads):
    with ds.Publisher(str(tmp_path / "s"), anchor=policy(), background=True,
                      anchor_copy_dir=tmp_path / "copy") as pub:
        infos = [p.wait() for p in [pub.publish(s, step=i) for i, s in enumerate(states)]]
        assert reads.get(id(pub.store), 0) == 0
    assert any(i.differential for i in infos)
    sub = ds.Subscriber(str(tmp_path / "s"))
    for i in infos:
        if i.differential:
            assert bits_equal(sub.pull(step=i.step).state, states[i.step])


@pytest.mark.parametrize("damage", ["one byte changed", "truncated", "removed"])
def test_a_damaged_copy_is_dropped_with_a_warning_and_the_anchor_read_from_the_store(tmp_path, states, reads,
                                                                                     damage):
    copy_dir = tmp_path / "copy"
    uri = str(tmp_path / "s")
    pub = ds.Publisher(uri, anchor=policy(), anchor_copy_dir=copy_dir)
    for i, s in enumerate(states[:3]):
        pub.publish(s, step=i)
    (path,) = copy_dir.iterdir()
    if damage == "one byte changed":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 64)
    else:
        path.unlink()
    infos = []
    with pytest.warns(PostCommitWarning, match="anchor copy .* unusable"):
        for i in range(3, 10):
            infos.append(pub.publish(states[i], step=i))
    assert any(i.differential for i in infos)
    assert reads.get(id(pub.store), 0) > 0  # read back from the store instead
    assert not path.exists()
    pub.close()
    sub = ds.Subscriber(uri)
    for i in infos:
        if i.differential:
            assert bits_equal(sub.pull(step=i.step).state, states[i.step])


def test_a_copy_that_cannot_be_written_is_a_warning_and_nothing_else(tmp_path, states, reads):
    blocker = tmp_path / "a file"
    blocker.write_bytes(b"")  # a directory cannot be made under a file
    uri = str(tmp_path / "s")
    with pytest.warns(PostCommitWarning, match="anchor copy for version 0 not written"):
        pub = ds.Publisher(uri, anchor=policy(), anchor_copy_dir=blocker / "copy")
        infos = [pub.publish(s, step=i) for i, s in enumerate(states[:10])]
    # written on its own thread: the next version reports it (the anchor itself was committed without waiting)
    assert not infos[0].warnings and "not written" in infos[1].warnings[0]
    assert any(i.differential for i in infos) and reads.get(id(pub.store), 0) > 0
    pub.close()
    assert bits_equal(ds.Subscriber(uri).pull(step=9).state, states[9])


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_the_next_version_waits_for_a_slow_copy_before_the_mirror_moves(tmp_path, states, reads, monkeypatch,
                                                                        background):
    """The copy is written on its own thread from the mirror itself: the next version's compare (or, in the
    background, its write) must wait for it, else the copy would hold a mix of two versions (its checksums
    would then refuse it: a warning and a read from the store, which this test forbids)."""
    import threading
    import time

    from deltastore.publish.anchor_copy import AnchorCopy

    real = AnchorCopy._write_file
    started = threading.Event()

    def slow(self, *args):  # noqa: ANN001, ANN202
        started.set()
        time.sleep(0.3)
        return real(self, *args)

    monkeypatch.setattr(AnchorCopy, "_write_file", slow)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", PostCommitWarning)
        with ds.Publisher(str(tmp_path / "s"), anchor=policy(), background=background,
                          anchor_copy_dir=tmp_path / "copy") as pub:
            infos = []
            for i, s in enumerate(states[:10]):
                got = pub.publish(s, step=i)
                infos.append(got.wait() if background else got)
                if i == 0:
                    assert started.wait(5)
            assert reads.get(id(pub.store), 0) == 0
    assert any(i.differential for i in infos) and not any(i.warnings for i in infos)


def test_a_sharded_publisher_refuses_a_copy(tmp_path):
    from deltastore.publish.collective import LOCAL
    from deltastore.publish.sharded import ShardedPublisher

    with pytest.raises(ValueError, match="anchor_copy_dir"):
        ShardedPublisher(str(tmp_path / "s"), group=LOCAL, anchor_copy_dir=tmp_path / "copy")


def test_a_script_that_never_closes_its_publisher_leaves_no_copy_behind(tmp_path):
    """The copy is the model's size: a training script that exits without ``close()`` must not leave one per run."""
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    copy_dir = tmp_path / "copy"
    script = textwrap.dedent(f"""
        import os, torch, deltastore as ds
        pub = ds.Publisher({str(tmp_path / "s")!r}, anchor_copy_dir={str(copy_dir)!r})
        pub.publish({{"w": torch.randn(4096).to(torch.bfloat16)}}, step=0)
        pub.stages.anchor_copy.settle()
        assert len(os.listdir({str(copy_dir)!r})) == 1
        """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(copy_dir) == []
