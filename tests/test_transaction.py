"""The pull side's two halves: the version reader (usable alone on a store) and the transaction that owns a
target (one undo log, one error rule, the version tracked in one place, a named strategy per path)."""

from __future__ import annotations

import pytest
import torch

import deltastore as ds
from conftest import chain_states, publish_all
from deltastore.pull import tracking
from deltastore.errors import ApplyError, ChecksumMismatchError, CorruptObjectError
from deltastore.pull import transaction as T
from deltastore.pull.anchor import WriteFailed
from deltastore.pull.apply import write_sparse
from deltastore.pull.reader import VersionReader
from deltastore.pull.staging import FullState, mapping_reader
from deltastore.store import open_store
from deltastore.testing import bits_equal

PUBLISHED = {"n": 5, "follower": 1, "changes": 0.5}  # deltas that overlap: a skipped one shows


# -- the one error rule ----------------------------------------------------------------------------------------
def test_a_typed_error_that_changed_nothing_stands_as_it_is():
    e = CorruptObjectError("bad object")
    assert T.failure(e, 0) is e
    restored = ApplyError("a writer's own undo put everything back")
    assert T.failure(restored, 0) is restored


def test_any_other_failure_is_an_apply_error_that_says_whether_the_target_was_restored():
    cause = RuntimeError("disk gone")
    err = T.failure(cause, 0)
    assert isinstance(err, ApplyError) and err.restored is True and err.__cause__ is cause
    assert "the target was restored" in str(err)
    err = T.failure(cause, 2)
    assert isinstance(err, ApplyError) and err.restored is False and "2 write(s) refused the restore" in str(err)
    typed = ChecksumMismatchError("off")  # typed, but a restore refused: the target is not as it was
    err = T.failure(typed, 1)
    assert isinstance(err, ApplyError) and err.restored is False and err.__cause__ is typed
    wrapped = WriteFailed("writing 'a' failed")
    wrapped.__cause__ = OSError("no space")
    assert T.failure(wrapped, 0).__cause__ is wrapped.__cause__  # a failed write names what the write raised


def test_an_interrupt_is_itself_once_the_log_ran():
    for exc, refused in ((KeyboardInterrupt(), 0), (SystemExit(1), 3)):
        assert T.failure(exc, refused) is exc and exc.deltastore_restored is (refused == 0)


# -- the undo log ----------------------------------------------------------------------------------------------
def test_the_undo_log_runs_every_kind_of_entry_newest_first_and_counts_refusals():
    ran = []
    log = T.UndoLog()
    t = torch.arange(6, dtype=torch.int16)
    journal = log.journal()
    journal.save(t)  # the anchor's journal: first in, restored last
    t.fill_(9)

    class Overlay:  # what decoders wrote in place
        def undo_in_place(self):
            ran.append("in place")
            return 0

    log.overlay(Overlay())
    steps = log.steps()
    steps.append(lambda: ran.append("first step"))
    steps.append(lambda: (_ for _ in ()).throw(RuntimeError("refused")))
    steps.append(lambda: ran.append("last step"))
    assert log.restore() == 1
    assert ran == ["last step", "first step", "in place"]
    assert t.tolist() == list(range(6))  # and the journal put the tensor back last
    assert log.restore() == 0  # emptied


# -- the reader, alone -----------------------------------------------------------------------------------------
def test_a_reader_alone_stages_and_fills_without_a_subscriber(published):
    uri, states, _, _ = published
    reader = VersionReader(open_store(uri))
    staged = reader.stage(4)
    assert staged.path == "anchor" and staged.versions_applied == [0, 1, 2, 3, 4]
    assert isinstance(staged.state, FullState) and bits_equal(staged.state.as_tensors(), states[4])
    bufs = {k: torch.empty(v.numel(), dtype=torch.int16) for k, v in states[2].items()}
    reader.fill(bufs, step=2)
    assert all(bits_equal(bufs[k], v.view(torch.int16).reshape(-1)) for k, v in states[2].items())


def test_stage_each_reads_a_delta_only_once_the_one_before_it_is_written(published):
    """Each piece is one delta staged against the target as the caller left it: pieces are made lazily, and
    the caller's writes between them are what the next one's checksums are checked against."""
    uri, states, sub, target = published
    reader = sub.reader
    pieces = reader.stage_each(4, sub.version_of(target), mapping_reader(target))
    seen = []
    for st in pieces:
        seen.append(st.versions_applied)
        assert st.path == "delta" and st.ref == sub.store.ref(st.versions_applied[0])
        assert bits_equal(target, states[st.ref.step - 1])  # staging wrote nothing
        write_sparse(target, st.state, [])
    assert seen == [[2], [3], [4]] and bits_equal(target, states[4])
    # a piece not written: the next one is checked against the target's bits and refused
    t2 = {k: v.clone() for k, v in states[1].items()}
    pieces = reader.stage_each(3, sub.store.ref(1), mapping_reader(t2))
    next(pieces)
    with pytest.raises(ChecksumMismatchError):
        next(pieces)
    # an anchor path comes whole, as one piece; a target at the version gets "none"
    whole = list(reader.stage_each(3))
    assert [st.path for st in whole] == ["anchor"] and bits_equal(whole[0].state.as_tensors(), states[3])
    assert [st.path for st in reader.stage_each(3, sub.store.ref(3), mapping_reader(states[3]))] == ["none"]


# -- the transaction -------------------------------------------------------------------------------------------
@pytest.fixture
def strategies(monkeypatch):
    """The strategies transactions ran, by class name, and the version the target was tracked at meanwhile."""
    ran = []
    for cls in (T.Already, T.AnchorIntoNewDict, T.AnchorIntoTarget, T.DeltasOneByOne, T.DeltasWhole):
        real = cls.run

        def run(self, txn, ref, manifest, _real=real, _name=cls.__name__):
            ran.append((_name, tracking.get_version(txn.target) if txn.target is not None else None))
            return _real(self, txn, ref, manifest)
        monkeypatch.setattr(cls, "run", run)
    return ran


def test_each_path_is_one_named_strategy_and_the_version_is_unknown_while_writing(published, strategies):
    uri, states, sub, target = published
    assert sub.pull(target, step=2).path == "delta"             # a follower one behind
    assert sub.pull(target, step=4).path == "delta"             # two behind: still one delta at a time
    assert sub.pull(target, step=4).path == "none"
    fresh = sub.pull(step=3).state                              # no target
    stranger = {k: v.clone() for k, v in states[0].items()}     # a target of unknown version
    assert sub.pull(stranger, step=4).path == "anchor"
    assert [name for name, _ in strategies] == ["DeltasOneByOne", "DeltasOneByOne", "Already",
                                                "AnchorIntoNewDict", "AnchorIntoTarget"]
    # writers see their target's version unknown from the first write on; the others leave it as it was
    assert [held for _, held in strategies] == [None, None, sub.store.ref(4), None, None]
    assert sub.version_of(target) == sub.store.ref(4) and sub.version_of(fresh) == sub.store.ref(3)
    assert bits_equal(target, states[4]) and bits_equal(stranger, states[4]) and bits_equal(fresh, states[3])


def test_a_layout_change_is_staged_whole(store_uri, strategies):
    states = chain_states(3, {"a": (8, 8), "b": (8,)})
    states[2] = {**states[2], "c": torch.ones(4, dtype=torch.bfloat16)}  # a tensor added at step 2
    publish_all(store_uri, states, anchor_every=100)
    sub = ds.Subscriber(store_uri)
    target = sub.pull(step=1).state
    assert sub.pull(target, step=2).path == "delta" and bits_equal(target, states[2])
    assert [name for name, _ in strategies][-1] == "DeltasWhole"


def test_a_failure_restores_the_version_only_when_every_write_was_put_back(published, monkeypatch):
    uri, states, sub, target = published
    held = sub.version_of(target)
    real = T.write_sparse

    def write_then_fail(target_, overlay, undo, *a, **k):
        real(target_, overlay, undo, *a, **k)
        raise OSError("injected after the write landed")
    monkeypatch.setattr(T, "write_sparse", write_then_fail)
    with pytest.raises(ApplyError) as e:
        sub.pull(target, step=3)
    assert e.value.restored is True and sub.version_of(target) == held and bits_equal(target, states[1])

    def write_refuse_undo(target_, overlay, undo, *a, **k):
        real(target_, overlay, undo, *a, **k)
        undo.append(lambda: (_ for _ in ()).throw(RuntimeError("refused")))
        raise OSError("injected after the write landed")
    monkeypatch.setattr(T, "write_sparse", write_refuse_undo)
    with pytest.raises(ApplyError, match="refused the restore") as e:
        sub.pull(target, step=3)
    assert e.value.restored is False and sub.version_of(target) is None
    monkeypatch.undo()
    assert sub.pull(target, step=3).path == "anchor" and bits_equal(target, states[3])
