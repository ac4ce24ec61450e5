"""The pull path's planner: the cheapest way to a version, from manifests alone.

:func:`plan_path` takes a manifest reader (``step -> (Manifest, digest of its
bytes)``, raising :class:`VersionNotFoundError` for a missing step) and
returns a :class:`Plan`: which anchor (if any) starts the path, which
differential follows, which deltas come after, and the object bytes it
downloads. It reads manifests and nothing else (no object, no target), so it
is tested on synthetic manifests (``tests/test_planner.py``); the
:class:`~deltastore.Subscriber` gives it the store's cached reader.

Costs are object bytes. Candidates, walking parents down from the wanted
step: the delta chain from the target's version; every anchor met, followed
by its deltas; every differential met (its anchor's full objects, or the
target's version when that is the anchor, then the differential, then the
deltas above it). Ties go to the candidate met first; a delta chain stops
being walked once it costs as much as the best candidate so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UntrustedVersionError, VersionNotFoundError
from ..manifest import Manifest, VersionRef

ManifestReader = Callable[[int], tuple[Manifest, str]]


@dataclass
class Plan:
    """What a pull fetches, in order.

    anchor: step whose full objects start the path (None: start from the target's own version).
    differential: step whose differential (its anchor -> itself) is applied next, or None.
    deltas: steps whose deltas follow, ascending.
    nbytes: object bytes the path downloads.
    """

    anchor: int | None
    deltas: list[int]
    nbytes: int
    differential: int | None = None

    @property
    def steps(self) -> list[int]:
        """Every step whose objects the plan reads."""
        head = [s for s in (self.anchor, self.differential) if s is not None]
        return head + self.deltas


def plan_path(read: ManifestReader, step: int, current: VersionRef | None = None, *, allow_anchor: bool = True,
              avoid: frozenset[str] = frozenset(), where: str = "the store") -> Plan:
    """The cheapest path (in object bytes) from ``current`` to ``step``.

    With ``allow_anchor=False`` only paths that start at ``current`` count;
    paths that read an object whose digest is in ``avoid`` do not count. A
    parent whose manifest digest differs from the one its child records (the
    step was rewritten by another writer) ends the walk there. A
    differential's anchor manifest is read only when that path could win (a
    follower one step behind reads two manifests). Raises
    :class:`VersionNotFoundError` when no path exists (for example a broken
    chain with no anchor below the step), naming ``where``. A version below
    ``step`` that ``read`` refuses as untrusted (a Subscriber with trusted
    keys) ends the walk like a missing one; when no path is left, that
    :class:`UntrustedVersionError` is raised.
    """
    offers = _Offers(allow_anchor)
    chain: list[int] = []  # steps above the walk position, newest first
    delta_bytes = 0
    m, digest = read(step)
    refused: list[UntrustedVersionError] = []
    read = _untrusted_as_missing(read, refused)
    while True:
        if current is not None and m.step == current.step and digest == current.digest:
            if not offers.any_below(delta_bytes):
                return Plan(None, chain[::-1], delta_bytes)
            break
        if m.kind == "anchor" and not _uses(m, m.full_objects, avoid):
            offers.offer(Plan(m.step, chain[::-1], m.object_bytes(m.full_objects) + delta_bytes))
        if m.differential is not None and not _uses(m, m.diff_objects, avoid):
            _offer_differential(read, m, chain, delta_bytes, current, offers, avoid)
        if not m.has_delta or m.parent is None or _uses(m, m.step_objects, avoid):
            break  # every start further down would have to replay this version's delta
        if current is None and m.kind == "anchor":
            break  # without a current version only anchors start a path; deeper ones cost more
        if current is not None and m.parent.step < current.step and offers.any_below(None):
            break
        delta_bytes += m.object_bytes(m.step_objects)
        if offers.any_below(delta_bytes, inclusive=True):
            break
        chain.append(m.step)
        parent = m.parent
        try:
            m, digest = read(parent.step)
        except VersionNotFoundError:
            break
        if digest != parent.digest:
            break  # the parent step was rewritten by another writer: this chain ends here
    best = offers.best()
    if best is None:
        if refused:
            raise refused[0]
        raise VersionNotFoundError(f"no anchor and no delta chain reaches version {step} in {where}")
    return best


def _untrusted_as_missing(read: ManifestReader, refused: list[UntrustedVersionError]) -> ManifestReader:
    """``read``, raising :class:`VersionNotFoundError` for a version it refuses as untrusted (noted in
    ``refused``): a path never goes through one."""

    def reader(step: int) -> tuple[Manifest, str]:
        try:
            return read(step)
        except UntrustedVersionError as e:
            refused.append(e)
            raise VersionNotFoundError(str(e)) from e

    return reader


@dataclass
class _Deferred:
    """A candidate known by a lower bound of its bytes until ``resolve`` (which reads a manifest) says."""

    lower: int
    resolve: Callable[[], Plan | None]


class _Offers:
    """Candidates in the order the walk meets them; the first of the cheapest wins. Deferred ones are
    resolved only when a decision depends on them, so every decision is the one the resolved list gives."""

    def __init__(self, allow_anchor: bool) -> None:
        self.allow_anchor = allow_anchor
        self.entries: list[Plan | _Deferred] = []

    def offer(self, plan: Plan | None) -> None:
        if plan is not None and (plan.anchor is None or self.allow_anchor):
            self.entries.append(plan)

    def defer(self, lower: int, resolve: Callable[[], Plan | None]) -> None:
        """A candidate through an anchor (none without ``allow_anchor``), priced when a decision needs it."""
        if self.allow_anchor:
            self.entries.append(_Deferred(lower, resolve))

    def _resolve(self, bound: int | None, inclusive: bool) -> list[Plan]:
        """Resolve every deferred candidate whose bound is below ``bound`` (or at it, ``inclusive``;
        None: all of them); the resolved candidates, in order."""
        kept: list[Plan | _Deferred] = []
        for e in self.entries:
            if isinstance(e, _Deferred) and (bound is None or e.lower < bound or (inclusive and e.lower == bound)):
                got = e.resolve()
                if got is not None:
                    kept.append(got)
            else:
                kept.append(e)
        self.entries = kept
        return [e for e in kept if isinstance(e, Plan)]

    def any_below(self, nbytes: int | None, inclusive: bool = False) -> bool:
        """Whether a candidate costs less than ``nbytes`` (or as much, ``inclusive``; None: any candidate)."""
        plans = self._resolve(nbytes, inclusive)
        return any(nbytes is None or p.nbytes < nbytes or (inclusive and p.nbytes == nbytes) for p in plans)

    def best(self) -> Plan | None:
        """The first of the cheapest candidates (deferred ones resolved where they could be it)."""
        plans = [e for e in self.entries if isinstance(e, Plan)]
        plans = self._resolve(min(p.nbytes for p in plans) if plans else None, True)
        best: Plan | None = None
        for p in plans:
            if best is None or p.nbytes < best.nbytes:
                best = p
        return best


def _offer_differential(read: ManifestReader, m: Manifest, chain: list[int], delta_bytes: int,
                        current: VersionRef | None, offers: _Offers, avoid: frozenset[str]) -> None:
    base = m.differential
    assert base is not None
    diff_bytes = m.object_bytes(m.diff_objects)
    deltas = chain[::-1]
    if current is not None and current == base:
        offers.offer(Plan(None, deltas, diff_bytes + delta_bytes, differential=m.step))
    if m.changes_layout:
        return  # a differential keeps its anchor's layout; a store that says otherwise is not planned through

    def through_anchor() -> Plan | None:
        try:
            bm, bdigest = read(base.step)
        except VersionNotFoundError:
            return None
        if bm.layout_key != m.layout_key:
            return None  # (as above)
        if bdigest != base.digest or bm.kind != "anchor" or _uses(bm, bm.full_objects, avoid):
            return None
        return Plan(base.step, deltas, bm.object_bytes(bm.full_objects) + diff_bytes + delta_bytes, differential=m.step)

    offers.defer(diff_bytes + delta_bytes, through_anchor)


def _uses(m: Manifest, indices: set[int], avoid: frozenset[str]) -> bool:
    return bool(avoid) and any(m.objects[i].digest in avoid for i in indices)
