"""Whole-store verification: every object re-hashed, every chain walked and replayed.

:func:`verify_store` reports problems instead of stopping at the first one,
so ``deltastore verify`` can list everything that is wrong with a store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import DeltaStoreError, VersionNotFoundError
from ..layout import check_step
from ..manifest import Manifest
from ..store import DeltaStore
from .reader import VersionReader
from .staging import FullState


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_store`.

    versions: steps whose manifests parsed.
    replayed: steps whose tensors were rebuilt and matched every checksum.
    objects: distinct objects re-hashed.
    problems: ``(step or None, message)`` for everything wrong.
    notes: ``(step, message)`` for what is not wrong but weaker than usual: a version committed
        with a check-then-write create (a backend without atomic create, e.g. ``hf://``), which a
        concurrent writer could have raced (``docs/format.md``).
    signers: step -> the key id that signed the version (None: unsigned), for every version that parsed;
        checked when the store has ``trust`` (a version that fails it is a problem, not listed here).
    """

    versions: list[int] = field(default_factory=list)
    replayed: list[int] = field(default_factory=list)
    objects: int = 0
    problems: list[tuple[int | None, str]] = field(default_factory=list)
    notes: list[tuple[int, str]] = field(default_factory=list)
    signers: dict[int, str | None] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(store: DeltaStore, *, progress: Callable[[str], None] | None = None) -> VerifyReport:
    """Check every version of ``store``.

    For each manifest: it parses; each delta's parent exists with the recorded
    digest; every object it names (data objects, recorded files, its layout
    object) exists and matches its sha256. Then every chain is
    replayed from its anchors: each version's tensors must match the checksums
    in its manifest, and a layout change must agree with its parent's layout.
    A version that does not follow from the one replayed before it (a writer
    that lost a race and continued from its own last version) is rebuilt the
    way a reader would pull it, from the cheapest anchor path; only when no
    path reaches it is it reported. Nothing is modified. Returns a
    :class:`VerifyReport`.
    ``progress(message)`` is called twice per readable version: before its
    objects are re-hashed and before it is replayed.
    """
    report = VerifyReport()
    reader = VersionReader(store)
    say = progress or (lambda _msg: None)
    # One pass in step order. Only each readable version's digest is kept (a parent is checked against it), so
    # memory holds one manifest and one replayed state, not every manifest of the store.
    digests: dict[int, str] = {}
    seen: set[str] = set()
    # Replay: keep the state of the previous version when it is the parent; a version whose parent is not that
    # state is judged as a reader would get it: the cheapest path from an anchor.
    state: FullState | None = None
    state_ref: tuple[int, str] | None = None
    for step in store.versions():
        try:
            m, digest = store.manifest_with_digest(step)
        except DeltaStoreError as e:
            report.problems.append((step, f"manifest: {e}"))
            continue
        digests[step] = digest
        report.versions.append(step)
        report.signers[step] = m.signed_by
        if m.producer.get("commit") == "check-then-write":
            report.notes.append((step, "committed with a check-then-write create (no atomic create on this "
                                       "backend): a concurrent writer could have raced it"))
        say(f"re-hashing the objects of version {step}")
        if m.parent is not None and m.kind == "delta":
            parent = digests.get(m.parent.step)
            if parent is None:
                report.problems.append((step, f"parent version {m.parent.step} is missing"))
            elif parent != m.parent.digest:
                report.problems.append((step, f"parent version {m.parent.step} has another digest"))
        for obj, size in m.references().items():
            if obj in seen:
                continue
            seen.add(obj)
            try:
                store.get_object(obj, size)
            except DeltaStoreError as e:
                report.problems.append((step, str(e)))
        say(f"replaying version {step}")
        state, state_ref = _replay(reader, report, step, m, digest, state, state_ref)
    report.objects = len(seen)
    return report


def _replay(reader: VersionReader, report: VerifyReport, step: int, m: Manifest, digest: str, state: FullState | None,
            state_ref: tuple[int, str] | None) -> tuple[FullState | None, tuple[int, str] | None]:
    """Rebuild version ``step`` (from ``state`` when that is its parent) and check every checksum; the state
    to carry to the next version. Problems go to ``report``."""
    try:
        if (state is not None and m.parent is not None and m.has_delta
                and state_ref == (m.parent.step, m.parent.digest)):
            check_step(state.specs, m, base=state_ref[0])
            reader.advance(state, m)
            if m.kind == "anchor":  # the full objects must agree too
                FullState(m, reader.fetch_updates(m, "full", None)[0])
        elif m.kind == "anchor":
            state = FullState(m, reader.fetch_updates(m, "full", None)[0])
        else:
            state = None
            try:
                staged = reader.stage(step, layout_changes=True)
            except VersionNotFoundError:
                report.problems.append((step, "delta is not reachable from a verified predecessor"))
                return None, None
            assert isinstance(staged.state, FullState)
            state = staged.state
        report.replayed.append(step)
        return state, (step, digest)
    except DeltaStoreError as e:
        report.problems.append((step, f"replay: {e}"))
        return None, None
