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

from ..errors import VersionNotFoundError
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
    step was rewritten by another writer) ends the walk there. Raises
    :class:`VersionNotFoundError` when no path exists (for example a broken
    chain with no anchor below the step), naming ``where``.
    """
    best: Plan | None = None

    def offer(candidate: Plan) -> None:
        nonlocal best
        if candidate.anchor is not None and not allow_anchor:
            return
        if best is None or candidate.nbytes < best.nbytes:
            best = candidate

    chain: list[int] = []  # steps above the walk position, newest first
    delta_bytes = 0
    m, digest = read(step)
    while True:
        if current is not None and m.step == current.step and digest == current.digest:
            if best is None or delta_bytes <= best.nbytes:
                best = Plan(None, chain[::-1], delta_bytes)
            break
        if m.kind == "anchor" and not _uses(m, m.full_objects, avoid):
            offer(Plan(m.step, chain[::-1], m.object_bytes(m.full_objects) + delta_bytes))
        if m.differential is not None and not _uses(m, m.diff_objects, avoid):
            _offer_differential(read, m, chain, delta_bytes, current, offer, avoid)
        if not m.has_delta or m.parent is None or _uses(m, m.step_objects, avoid):
            break  # every start further down would have to replay this version's delta
        if current is None and m.kind == "anchor":
            break  # without a current version only anchors start a path; deeper ones cost more
        if current is not None and m.parent.step < current.step and best is not None:
            break
        delta_bytes += m.object_bytes(m.step_objects)
        if best is not None and delta_bytes >= best.nbytes:
            break
        chain.append(m.step)
        parent = m.parent
        try:
            m, digest = read(parent.step)
        except VersionNotFoundError:
            break
        if digest != parent.digest:
            break  # the parent step was rewritten by another writer: this chain ends here
    if best is None:
        raise VersionNotFoundError(f"no anchor and no delta chain reaches version {step} in {where}")
    return best


def _offer_differential(read: ManifestReader, m: Manifest, chain: list[int], delta_bytes: int,
                        current: VersionRef | None, offer: Callable[[Plan], None], avoid: frozenset[str]) -> None:
    base = m.differential
    assert base is not None
    diff_bytes = m.object_bytes(m.diff_objects)
    if current is not None and current == base:
        offer(Plan(None, chain[::-1], diff_bytes + delta_bytes, differential=m.step))
    try:
        bm, bdigest = read(base.step)
    except VersionNotFoundError:
        return
    if m.changes_layout or bm.layout_key != m.layout_key:
        return  # a differential keeps its anchor's layout; a store that says otherwise is not planned through
    if bdigest == base.digest and bm.kind == "anchor" and not _uses(bm, bm.full_objects, avoid):
        offer(Plan(base.step, chain[::-1], bm.object_bytes(bm.full_objects) + diff_bytes + delta_bytes,
                   differential=m.step))


def _uses(m: Manifest, indices: set[int], avoid: frozenset[str]) -> bool:
    return bool(avoid) and any(m.objects[i].digest in avoid for i in indices)
