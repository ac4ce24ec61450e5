"""What :meth:`Publisher.publish` returns: a :class:`VersionInfo`, committed or (background mode) pending.

A synchronous publish returns a committed :class:`VersionInfo`. A background
publish returns a :class:`PendingVersionInfo` as soon as the changes are
captured: ``step``, ``changed`` and ``total`` are known at once; the fields
only the commit knows (``kind``, ``nbytes``, ``digest``, ``created``,
``differential``, ``warnings``) wait for it, and ``wait()`` re-raises the
background error if the version was not committed. Both forms also answer the
``Future`` calls earlier releases returned in background mode (``result()``,
``done()``, ``exception()``, ``add_done_callback()``), so such code keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VersionInfo:
    """A committed version, as :meth:`Publisher.publish` wrote it.

    kind: ``"anchor"`` (full objects written, plus a delta when there is a parent) or ``"delta"``.
    changed / total: elements whose bits changed since the previous version / all elements.
    nbytes: bytes stored for this version (its objects and its manifest).
    digest: sha256 of the manifest bytes, the version's identity.
    differential: whether the version also carries a differential (anchor -> this version).
    warnings: what failed *after* the commit point (the ``deltastore.json`` marker, retention);
        the version is committed and pullable all the same (each is also issued as a
        :class:`~deltastore.errors.PostCommitWarning`).
    """

    step: int
    kind: str
    changed: int
    total: int
    nbytes: int
    digest: str
    created: float
    differential: bool = False
    warnings: tuple[str, ...] = ()

    @property
    def fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0

    @property
    def committed(self) -> bool:
        """Whether the version is committed (always, for this form)."""
        return True

    def wait(self, timeout: float | None = None) -> VersionInfo:
        """The committed info (this one)."""
        return self

    # -- the Future calls background publish() used to return ------------------------
    def result(self, timeout: float | None = None) -> VersionInfo:
        """Same as :meth:`wait`."""
        return self.wait(timeout)

    def done(self) -> bool:
        return True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[VersionInfo], Any]) -> None:
        """Call ``fn(self)`` once the commit has been decided (at once here)."""
        fn(self)


_COMMIT_FIELDS = ("kind", "nbytes", "digest", "created", "differential", "warnings")


class PendingVersionInfo(VersionInfo):
    """A version captured by a background publish, committed (or not) later by the writer thread.

    ``step``, ``changed`` and ``total`` are known at once. Reading any other
    field waits for the commit (like :meth:`wait`) and raises the background
    error if it failed. ``committed`` tells without waiting.
    """

    def __init__(self, step: int, changed: int, total: int, future: Future[VersionInfo]):  # noqa: D107
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "_changed", changed)
        object.__setattr__(self, "_total", total)
        object.__setattr__(self, "_future", future)

    step = property(lambda self: self._step)  # type: ignore[assignment]
    changed = property(lambda self: self._changed)  # type: ignore[assignment]
    total = property(lambda self: self._total)  # type: ignore[assignment]

    @property
    def committed(self) -> bool:
        """True once the writer committed this version (never blocks; False while pending or after a failure)."""
        f = self._future
        return f.done() and not f.cancelled() and f.exception() is None

    def wait(self, timeout: float | None = None) -> VersionInfo:
        """Block until the writer has decided; return the committed :class:`VersionInfo`.

        Raises the background error if this version was not committed (its own
        failure, or ``RuntimeError`` when it was dropped after an earlier one),
        ``TimeoutError`` if ``timeout`` seconds pass first.
        """
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[VersionInfo], Any]) -> None:
        """Call ``fn(self)`` once the writer has decided (from the writer thread, or at once if it has)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        if not self.done():
            return f"PendingVersionInfo(step={self.step}, changed={self.changed}, total={self.total}, pending)"
        error = self._future.exception()
        return repr(self._future.result()) if error is None else \
            f"PendingVersionInfo(step={self.step}, failed: {error!r})"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def _commit_field(name: str) -> property:
    return property(lambda self: getattr(self.wait(), name), doc=f"``{name}`` of the committed version (waits)")


for _name in _COMMIT_FIELDS:
    setattr(PendingVersionInfo, _name, _commit_field(_name))
