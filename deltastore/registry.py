"""One plugin registry for every plugin kind (codecs, backends, anchor policies).

A :class:`Registry` maps a name to a plugin class. A plugin can be registered
as the class itself or as a lazy dotted path (``"pkg.module:Class"``) that is
imported on first use, with an install hint shown when the import fails.
Third-party packages register through entry points in the registry's group
(``deltastore.codecs``, ``deltastore.backends``, ``deltastore.anchor_policies``),
discovered lazily the first time a name is not found.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar

from .errors import (MissingDependencyError, PluginConflictError, UnknownBackendError, UnknownCodecError,
                     UnknownPluginError)

T = TypeVar("T")


@dataclass
class _Entry:
    target: Any  # a class, or a dotted path "module:attr" not yet imported
    install_hint: str | None = None
    entry_point: str | None = None  # "group: name = value (distribution)" when found through an entry point
    requires: tuple[str, ...] = ()  # modules the target imports that an extra installs (see missing())


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin, as :meth:`Registry.describe` lists it.

    target: ``"module:Class"``; origin: ``"built-in"`` (shipped in
    deltastore), ``"entry point <group> (<distribution>)"`` or
    ``"registered"`` (a ``register()`` call from other code);
    install_hint: what to install when its module is missing.
    """

    name: str
    target: str
    origin: str
    install_hint: str | None


def _import_dotted(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not attr:
        module, _, attr = path.rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Name -> plugin class, with lazy imports, entry points and install hints.

    ``kind`` is used in error messages ("codec", "backend"); ``group`` is the
    entry-point group scanned for third-party plugins; ``error`` is the
    :class:`UnknownPluginError` subclass raised for an unknown name.
    """

    def __init__(self, kind: str, group: str, error: type[UnknownPluginError] = UnknownPluginError):
        self.kind = kind
        self.group = group
        self._error = error
        self._entries: dict[str, _Entry] = {}
        self._entry_points_loaded = False
        self._lock = threading.RLock()

    def register(self, name: str, target: type[T] | str, *, install_hint: str | None = None,
                 clobber: bool = False, requires: tuple[str, ...] = ()) -> None:
        """Register ``target`` (a class or a ``"module:Class"`` path) under ``name``.

        ``requires``: modules the target needs that are not always installed (an extra's packages), so
        that :meth:`missing` can tell without importing anything. Raises :class:`PluginConflictError`
        when a *different* plugin already holds the name and ``clobber`` is false; registering the same
        target again is a no-op.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        with self._lock:
            old = self._entries.get(name)
            if old is not None and not clobber and not _same_target(old.target, target):
                raise PluginConflictError(
                    f"{self.kind} {name!r} is already registered as {_describe(old.target)}; "
                    f"pass clobber=True to replace it with {_describe(target)}")
            self._entries[name] = _Entry(target, install_hint, requires=tuple(requires))

    def unregister(self, name: str) -> None:
        """Remove ``name`` (no error if absent)."""
        with self._lock:
            self._entries.pop(name, None)

    def get(self, name: str) -> type[T]:
        """Return the plugin class registered under ``name``, importing it if needed.

        Raises the registry's :class:`UnknownPluginError` subclass for an unknown
        name and :class:`MissingDependencyError` (with the install hint) when a
        lazy plugin's module cannot be imported.
        """
        with self._lock:
            entry = self._entry(name)
            if isinstance(entry.target, str):
                try:
                    entry.target = _import_dotted(entry.target)
                except AttributeError as e:
                    raise MissingDependencyError(
                        f"{self.kind} {name!r} points at {entry.target!r}, which does not exist ({e})") from e
                except ImportError as e:
                    hint = f"; install it with: {entry.install_hint}" if entry.install_hint else ""
                    raise MissingDependencyError(
                        f"{self.kind} {name!r} needs a package that is not installed ({e}){hint}") from e
            return entry.target

    def missing(self, name: str) -> str | None:
        """What keeps ``name`` from loading, found without importing the plugin (its module, and the modules
        it was registered as requiring, are looked up, not run): None when all are installed, else a
        message naming the missing module. A module that is found may still fail when imported
        (:meth:`get` tells). Raises the registry's :class:`UnknownPluginError` subclass for an unknown name.
        """
        with self._lock:
            entry = self._entry(name)
            if not isinstance(entry.target, str):
                return None
            module = entry.target.partition(":")[0] if ":" in entry.target else entry.target.rpartition(".")[0]
            for needed in (module, *entry.requires):
                if not _installed(needed):
                    hint = f"; install it with: {entry.install_hint}" if entry.install_hint else ""
                    return f"{self.kind} {name!r} needs module {needed!r}, which is not installed{hint}"
            return None

    def _entry(self, name: str) -> _Entry:
        """The entry of ``name`` (entry points scanned when it is not registered); the caller holds the lock."""
        entry = self._entries.get(name)
        if entry is None:
            self._load_entry_points()
            entry = self._entries.get(name)
        if entry is None:
            raise self._error(f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}")
        return entry

    def names(self) -> list[str]:
        """All registered names, entry points included."""
        with self._lock:
            self._load_entry_points()
            return sorted(self._entries)

    def describe(self) -> list[PluginInfo]:
        """Every registered plugin with where it comes from (entry points included; nothing is imported)."""
        with self._lock:
            self._load_entry_points()
            out = []
            for name, e in sorted(self._entries.items()):
                target = _describe(e.target)
                origin = (e.entry_point if e.entry_point is not None
                          else "built-in" if target.startswith("deltastore.") else "registered")
                out.append(PluginInfo(name, target, origin, e.install_hint))
            return out

    def __contains__(self, name: object) -> bool:
        with self._lock:
            if name not in self._entries:
                self._load_entry_points()
            return name in self._entries

    def refresh(self) -> None:
        """Scan the entry points again on the next lookup (after installing a plugin package)."""
        with self._lock:
            self._entry_points_loaded = False

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in metadata.entry_points(group=self.group):
            if ep.name not in self._entries:  # explicit registrations win
                dist = getattr(ep, "dist", None)
                dist_name = getattr(dist, "name", None) if dist is not None else None
                hint = f"pip install {dist_name}" if dist_name else None
                self._entries[ep.name] = _Entry(ep.value, hint, f"entry point {self.group} ({dist_name or '?'})")


def _installed(module: str) -> bool:
    """Whether ``module`` can be found (its parent packages are imported to look, the module itself is not)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a module without a spec
        return False


def _same_target(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return _describe(a) == _describe(b)


def _describe(target: Any) -> str:
    if isinstance(target, str):
        return target
    return f"{target.__module__}:{target.__qualname__}"


codecs: Registry[Any] = Registry("codec", "deltastore.codecs", UnknownCodecError)
backends: Registry[Any] = Registry("backend", "deltastore.backends", UnknownBackendError)
anchor_policies: Registry[Any] = Registry("anchor policy", "deltastore.anchor_policies")
