"""One pull into one target, from begin to commit or abort.

A :class:`Transaction` owns its target for one pull (the model: one session
per transaction, with the planning and the reading left to the reader,
:mod:`.reader`). What it owns, and nobody else touches:

* **the target's checks**, made once at :meth:`Transaction.begin`: every
  entry a tensor and none an alias of another, every tensor of the version
  present with its dtype and shape, contiguous, in writable memory and
  overlapping no other (:mod:`.checks`; skipped when the target is
  the one the last pull checked, unchanged since: :mod:`.checked_target`);
* **the target's version** (:mod:`deltastore.pull.tracking`), set in one place
  (:meth:`Transaction._track`): unknown from the first write on; the new
  version on commit; the old one again on abort only when every write was put
  back, else unknown (the next pull starts from an anchor);
* **one undo log** (:class:`UndoLog`) of everything written: the old bits an
  anchor overwrites (an :class:`~deltastore.pull.undo.UndoJournal`), the steps that
  put back a sparse write or a layout change (:func:`deltastore.pull.apply.write_sparse`),
  and what decoders wrote into the target in place
  (:meth:`~deltastore.pull.staging.SparseOverlay.undo_in_place`); on abort it runs
  newest first, whatever raised, an interrupt too;
* **one error epilogue** (:func:`failure`): a typed
  :class:`~deltastore.errors.DeltaStoreError` that changed nothing stands as
  it is (a corrupt object is then planned around); any other failure is an
  :class:`~deltastore.errors.ApplyError` whose ``restored`` says whether the
  target was put back; an interrupt (``KeyboardInterrupt``, ``SystemExit``)
  is re-raised as itself once the log ran.

How a version gets in is a named strategy, chosen once the path is planned
(:meth:`Transaction.begin`): :class:`Already` (the target holds it),
:class:`AnchorIntoNewDict` (no target), :class:`AnchorIntoTarget`,
:class:`DeltasOneByOne` (a path of deltas that keeps the layout: each delta
decoded, checked and written before the next is read) and
:class:`DeltasWhole` (a path with a differential, a layout change or alias
copies: staged whole on one overlay, then written).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._memory import release_memory
from ..errors import ApplyError, DeltaStoreError, UntrustedVersionError, VersionNotFoundError
from ..layout import PathLayout
from ..manifest import Manifest, VersionRef
from ..tensors import bits_view, named_tensors
from . import tracking
from .anchor import WriteFailed
from .apply import write_sparse
from .checked_target import CheckedTarget
from .checks import check_layout, check_overlaps, check_target, check_tied, holds_layout
from .planner import Plan
from .reader import VersionReader, kept
from .staging import SparseOverlay, TargetAddresses, mapping_reader
from .undo import UndoJournal

Target = Any  # nn.Module | MutableMapping[str, Tensor] | None
Path = Literal["anchor", "delta", "none"]


# -- the undo log ---------------------------------------------------------------------
class UndoLog:
    """Everything one transaction wrote into its target, undoable newest first.

    Entries, in the order the writes they undo began: an anchor's
    :class:`UndoJournal` (:meth:`journal`), a list of undo steps that a writer
    fills just before each write (:meth:`steps`), an overlay whose decoders may
    write in place (:meth:`overlay`). :meth:`restore` runs them all, newest
    first, and counts what refused; :meth:`close` forgets them (after a commit).
    """

    def __init__(self) -> None:
        self._entries: list[Callable[[], int]] = []
        self._journals: list[UndoJournal] = []

    def journal(self, directory: str | None = None, memory_bytes: int | None = None) -> UndoJournal:
        """A new undo journal (old bits saved before an anchor overwrites them), restored with the log."""
        j = UndoJournal(directory) if memory_bytes is None else UndoJournal(directory, memory_bytes)
        self._journals.append(j)
        self._entries.append(j.restore)
        return j

    def steps(self) -> list[Callable[[], object]]:
        """A list for a writer's undo steps (each appended before its write; run newest first)."""
        steps: list[Callable[[], object]] = []
        self._entries.append(lambda: put_back(steps))
        return steps

    def overlay(self, overlay: SparseOverlay) -> SparseOverlay:
        """``overlay``, whose decoders' in-place writes are undone with the log; returned."""
        self._entries.append(overlay.undo_in_place)
        return overlay

    def restore(self) -> int:
        """Undo every entry, newest first (each still tried when one refuses); how many writes refused."""
        refused = 0
        for restore in reversed(self._entries):
            refused += restore()
        self.close()
        return refused

    def close(self) -> None:
        """Forget every entry; delete the journals' temporary files."""
        for j in self._journals:
            j.close()
        self._entries, self._journals = [], []


def put_back(undo: list[Callable[[], object]]) -> int:
    """Run the undo steps of writes (newest first); returns how many refused (raised), each still tried."""
    failed = 0
    with torch.no_grad():
        for step in reversed(undo):
            try:
                step()
            except Exception:  # noqa: BLE001 - counted; the caller reports the target as unknown
                failed += 1
    return failed


def restored_by(error: BaseException, refused: int) -> bool:
    """Whether the target holds its old version again after ``error``: no undo step refused, and ``error``
    (an :class:`ApplyError` from a writer's own undo) does not say otherwise."""
    return refused == 0 and getattr(error, "restored", True) is not False


def failure(error: BaseException, refused: int, doing: str = "writing into the target") -> BaseException:
    """What a transaction raises after ``error`` once its undo log ran with ``refused`` refusals: the one rule.

    The target is restored when nothing refused (and ``error`` does not say otherwise). An interrupt (any
    ``BaseException`` that is not an ``Exception``) is returned as itself, with ``deltastore_restored`` set.
    A typed :class:`DeltaStoreError` that left the target restored stands as it is. Anything else becomes
    :class:`ApplyError` naming its cause, with ``restored`` set; not restored, it says the target's version
    is unknown.
    """
    restored = restored_by(error, refused)
    if not isinstance(error, Exception):
        try:
            error.deltastore_restored = restored  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return error
    if restored and isinstance(error, DeltaStoreError):
        return error
    cause = error.__cause__ if isinstance(error, WriteFailed) and error.__cause__ is not None else error
    if restored:
        err = ApplyError(f"{doing} failed ({cause!r}); the target was restored")
    else:
        err = ApplyError(f"{doing} failed ({cause!r}) and {max(refused, 1)} write(s) refused the restore; the "
                         "target's version is unknown: pull again (from an anchor) to repair it")
    err.restored = restored
    err.__cause__ = cause
    return err


# -- the transaction ----------------------------------------------------------------------
@dataclass
class Outcome:
    """What a committed transaction did: ``state`` (the target, or the new dict without one) holds
    ``ref`` by ``path``; the object bytes read, the steps applied and the elements written per tensor."""

    ref: VersionRef
    manifest: Manifest
    path: Path
    state: Any
    fetched: int = 0
    applied: list[int] = field(default_factory=list)
    written: dict[str, int] = field(default_factory=dict)


class Transaction:
    """One pull of one version into ``target`` (None: into a new dict), through ``reader``.

    ``checked``: the owner's record of the last target it checked (reused when this target is that one,
    unchanged; renewed on commit). ``journal_dir`` / ``journal_memory``: where an anchor's undo journal
    keeps the old bits (:class:`~deltastore.pull.undo.UndoJournal`). The caller holds the target exclusively
    (:func:`deltastore.pull.tracking.exclusive`) for the transaction's life.
    """

    def __init__(self, reader: VersionReader, target: Target, checked: CheckedTarget, *,
                 journal_dir: str | None = None, journal_memory: int | None = None):
        self.reader, self.store = reader, reader.store
        self.target = target
        self.checked = checked
        self.journal_dir, self.journal_memory = journal_dir, journal_memory
        self.undo = UndoLog()
        #: the version the target holds as far as deltastore knows (None: unknown, or no target)
        self.current: VersionRef | None = tracking.get_version(target) if target is not None else None
        self.tensors: dict[str, torch.Tensor] | None = None
        self.tied: dict[str, str] = {}
        self.hit = False  # the target is the one ``checked`` recorded, unchanged: its checks stand
        self.copies: dict[str, list[str]] = {}
        self.drop: list[str] = []

    def pull(self, step: int, *, allow_anchor: bool = True, avoid: frozenset[str] = frozenset()) -> Outcome:
        """Bring the target to version ``step``: plan, :meth:`begin`, then run the chosen strategy under the
        undo log and commit, or abort (:func:`failure`). Raises what the reader and the checks raise (nothing
        written then) and :class:`ApplyError`."""
        manifest, digest = self.store.manifest_with_digest(step)
        ref = VersionRef(step, digest)
        if self.target is None:
            plan = self.reader.plan_for(step, None, allow_anchor, avoid)
            return self._run(AnchorIntoNewDict(plan), ref, manifest)
        if self.current is not None and self.current == manifest.parent and not avoid:
            # a follower one behind reads this version's own objects: they download while the target is checked
            self.reader.prefetch_version(manifest)
        self._look(manifest)
        if self.current == ref:
            return self._run(Already(), ref, manifest)
        if self.current is not None and not holds_layout(self.tensors, self._held(self.current), manifest):
            self.current = None  # laid out otherwise than the tracked version (resized by its owner): an anchor
        plan = self.reader.plan_for(step, self.current, allow_anchor, avoid)
        return self._run(self.begin(plan, manifest), ref, manifest)

    def _look(self, manifest: Manifest) -> None:
        """The target's tensors: as the last pull checked them, when nothing those checks saw changed."""
        assert self.target is not None
        found = self.checked.lookup(self.target, manifest)
        self.checked.forget()  # remembered again only after a pull that commits
        self.hit = found is not None
        self.tensors = found if found is not None else named_tensors(self.target, self.tied)

    def begin(self, plan: Plan, manifest: Manifest) -> Strategy:
        """Check the target against the version (once; nothing written) and choose how the plan gets in.

        Raises :class:`TargetMismatchError` (a tensor missing, of another dtype or shape, not contiguous,
        in read-only memory, overlapping another, tied where the version keeps two, a layout change the
        target cannot take) and what validating the path's layout raises."""
        tensors = self.tensors
        assert tensors is not None
        if plan.anchor is None:  # the objects download while the target is checked
            self.reader.prefetch(plan, wait=False)
        else:
            self.store.forget_prefetched()  # a delta fetched ahead for a follower one behind, not read after all
        lay = self.reader.path_layout(plan, self.current)
        laid_out = True  # the target holds every tensor of the version as the version lays it out
        if not self.hit:
            check_tied(manifest, self.tied)
            held = self._held(self.current)
            self.copies, self.drop = check_target(self.target, tensors, manifest, held)
            check_overlaps(tensors, manifest, self.copies)
            laid_out = held is None or held.layout_key == manifest.layout_key  # check_target: check_layout
        if plan.anchor is not None:
            return AnchorIntoTarget(plan, lay, laid_out)
        if (plan.differential is None and not lay.changes and not self.copies
                and (len(plan.deltas) == 1 or not self.drop)):
            return DeltasOneByOne(plan, lay)
        return DeltasWhole(plan, lay)

    def _held(self, current: VersionRef | None) -> Manifest | None:
        """The manifest of the version a target holds, if this store has exactly that version."""
        if current is None:
            return None
        try:
            m, digest = self.store.manifest_with_digest(current.step)
        except (VersionNotFoundError, UntrustedVersionError):  # (untrusted: a path from it is not planned)
            return None
        return m if digest == current.digest else None

    # -- running, commit and abort ---------------------------------------------------------
    def _run(self, strategy: Strategy, ref: VersionRef, manifest: Manifest) -> Outcome:
        """Run ``strategy``: a writing one under the undo log, the target's version unknown meanwhile; then
        commit, or abort by the one rule (:func:`failure`)."""
        if strategy.writes:
            self._track(None)  # unknown while writing
        try:
            out = strategy.run(self, ref, manifest)
        except BaseException as e:  # an interrupt too: every write undone, then re-raised
            if not strategy.writes:
                raise
            refused = self.undo.restore()
            self._track(self.current if restored_by(e, refused) else None)
            err = failure(e, refused)
            if err is e:
                raise
            raise err from err.__cause__
        self.undo.close()
        self._commit(out, strategy)
        return out

    def _commit(self, out: Outcome, strategy: Strategy) -> None:
        if self.target is None:
            self._track(out.ref, out.state)  # tracked weakly: the next pull into it takes deltas
        elif strategy.writes:
            self._track(out.ref)
        if self.target is not None and not (self.tied or self.copies or self.drop or strategy.relays):
            self.checked.remember(self.target, out.manifest)
        if out.path != "none":
            release_memory()

    def _track(self, ref: VersionRef | None, target: Target = None) -> None:
        """The one place the transaction sets the version its target holds."""
        tracking.set_version(self.target if target is None else target, ref)

    # -- what the strategies share ----------------------------------------------------------
    def overlay(self, base: Manifest, held: dict[str, torch.Tensor] | None, *, write_through: bool = False,
                addresses: TargetAddresses | None = None, table: list[str] | None = None) -> SparseOverlay:
        """An overlay over the target from version ``base``, its in-place writes in the undo log."""
        assert self.tensors is not None
        return self.undo.overlay(SparseOverlay(mapping_reader(self.tensors), base, held, write_through=write_through,
                                               addresses=addresses, table=table))

    def write(self, overlay: SparseOverlay, *, drop: bool = True) -> None:
        """Write ``overlay``'s staged changes into the target (and its layout changes; ``drop``: delete the
        tensors the version drops), each write's undo in the log first."""
        assert self.tensors is not None
        write_sparse(self.tensors, overlay, self.undo.steps(), self.copies, owner=self.target,
                     drop=self.drop if drop else None)


# -- the strategies -----------------------------------------------------------------------
class Strategy:
    """How one version gets into the target. ``writes``: whether it writes the target (under the undo log)."""

    path: Path = "none"
    writes = True
    relays = False  # the path changes the layout (the target's checks are not remembered)

    def run(self, txn: Transaction, ref: VersionRef, manifest: Manifest) -> Outcome:
        raise NotImplementedError


class Already(Strategy):
    """The target holds the version: its layout is checked (unless the last pull's checks stand), nothing read."""

    path: Path = "none"
    writes = False

    def run(self, txn: Transaction, ref: VersionRef, manifest: Manifest) -> Outcome:
        assert txn.tensors is not None
        if not txn.hit:
            check_layout(txn.tensors, manifest)
        return Outcome(ref, manifest, "none", txn.target)


class AnchorIntoNewDict(Strategy):
    """No target: the plan's anchor streamed into new tensors, then its differential and deltas applied;
    the new dict (:class:`~deltastore.pull.tracking.StateDict`) is tracked at the version."""

    path: Path = "anchor"
    writes = False

    def __init__(self, plan: Plan):
        self.plan = plan

    def run(self, txn: Transaction, ref: VersionRef, manifest: Manifest) -> Outcome:
        txn.reader.path_layout(self.plan, None)  # validated before anything is fetched
        state, fetched = txn.reader.anchor_state(self.plan)
        return Outcome(ref, manifest, "anchor", tracking.StateDict(state.as_tensors()), fetched, self.plan.steps)


class AnchorIntoTarget(Strategy):
    """The plan's anchor streamed into the live target, each tensor's old bits journaled just before its
    first write; then the differential and deltas staged on one overlay and written. Tensors the target
    cannot take from the anchor as they are (the path re-lays them, or the target holds them in another
    layout) are held on the host from the anchor on and written (or, in a mapping, set) at the end; the
    version's dropped tensors are deleted then. ``laid_out``: the target was checked to hold every tensor
    of the path's last version (and its aliases) as that version lays it out, so none needs a look of its own.
    """

    path: Path = "anchor"

    def __init__(self, plan: Plan, lay: PathLayout, laid_out: bool):
        self.plan, self.lay, self.laid_out = plan, lay, laid_out
        self.relays = bool(lay.changes)

    def run(self, txn: Transaction, ref: VersionRef, manifest: Manifest) -> Outcome:
        plan, tensors, copies = self.plan, txn.tensors, txn.copies
        assert plan.anchor is not None and tensors is not None
        am = txn.store.manifest(plan.anchor)
        txn.reader.prefetch(plan)
        keep = kept(am, self.lay, None if self.laid_out else tensors, copies)
        names = [r.name for r in am.tensors] if keep is None else [r.name for r in am.tensors if r.name in keep]
        dests = dict(zip(names, map(tensors.__getitem__, names)))  # checked contiguous: no view per tensor
        alias_dests = {n: [bits_view(tensors[a]) for a in aliases] for n, aliases in copies.items() if n in dests}
        journal = txn.undo.journal(txn.journal_dir, txn.journal_memory)
        held = txn.reader.stream_anchor(am, dests=dests, alias_dests=alias_dests, journal=journal)
        fetched = am.object_bytes(am.full_objects)
        overlay = txn.overlay(am, dests)
        records = am.tensor_map()
        for name, bits in held.items():
            overlay.hold(name, records[name].spec, bits, int(records[name].checksum, 16))
        fetched += txn.reader.apply_steps(plan, overlay)
        txn.write(overlay)
        return Outcome(ref, manifest, "anchor", txn.target, fetched, plan.steps,
                       {r.name: r.numel for r in manifest.tensors})


class _Deltas(Strategy):
    path: Path = "delta"

    def __init__(self, plan: Plan, lay: PathLayout):
        self.plan, self.lay = plan, lay
        self.relays = bool(lay.changes)

    def _start(self, txn: Transaction) -> tuple[dict[str, torch.Tensor], list[str], TargetAddresses | None]:
        """The target's tensors of the version it holds, in that version's order (the target itself when it
        holds just those), their names, and their addresses when they are the tensors the last pull checked
        in that order."""
        tensors = txn.tensors
        assert tensors is not None
        names = self.lay.start_manifest.layout_columns[0]
        held = tensors if list(tensors) == names else dict(zip(names, map(tensors.__getitem__, names)))
        return held, names, txn.checked.addresses() if txn.hit and held is tensors else None


class DeltasOneByOne(_Deltas):
    """A path of deltas that keeps the layout (no differential, no alias copies): each delta staged on an
    overlay of its own from the version before it, its decoders writing into the target as they decode
    (the changes of a tensor seen first), then written, before the next delta is read; every write stays
    in the undo log until the pull commits. ``written`` sums what each delta wrote."""

    def run(self, txn: Transaction, ref: VersionRef, manifest: Manifest) -> Outcome:
        held, names, known = self._start(txn)
        assert txn.current is not None
        base = txn.store.manifest(txn.current.step)
        fetched = 0
        written: dict[str, int] = {}
        last = self.plan.deltas[-1]
        for s in self.plan.deltas:
            overlay = txn.overlay(base, held, write_through=True, addresses=known, table=names)
            base = txn.store.manifest(s)
            fetched += txn.reader.advance(overlay, base, "delta")
            for name, n in _counts(overlay).items():
                written[name] = written.get(name, 0) + n
            txn.write(overlay, drop=s == last)
        return Outcome(ref, manifest, "delta", txn.target, fetched, self.plan.steps, written)


class DeltasWhole(_Deltas):
    """A path from the target's version with a differential, a layout change or alias copies: staged whole
    on one overlay (every delta's changes merged into the net change), then written."""

    def run(self, txn: Transaction, ref: VersionRef, manifest: Manifest) -> Outcome:
        held, names, known = self._start(txn)
        assert txn.current is not None
        overlay = txn.overlay(txn.store.manifest(txn.current.step), held, addresses=known, table=names)
        fetched = txn.reader.apply_steps(self.plan, overlay)
        written = _counts(overlay)
        txn.write(overlay)
        return Outcome(ref, manifest, "delta", txn.target, fetched, self.plan.steps, written)


def _counts(overlay: SparseOverlay) -> dict[str, int]:
    """Elements an overlay writes per tensor: its staged changes, what its decoders wrote in place, and the
    tensors it holds whole."""
    counts = overlay.pending.counts()
    counts.update(overlay.written_in_place)
    counts.update((n, b.numel()) for n, b in overlay.whole.items())
    return counts


__all__ = ["AnchorIntoNewDict", "AnchorIntoTarget", "Already", "DeltasOneByOne", "DeltasWhole", "Outcome",
           "Strategy", "Transaction", "UndoLog", "failure", "put_back"]
