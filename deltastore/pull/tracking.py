"""Which version a target currently holds.

A target is identified by object identity. Weak references are used where the
target allows them (``nn.Module``, :class:`StateDict`); plain dicts cannot be
weakly referenced, so a bounded table keeps the most recent ones alive (an
evicted target is simply treated as unknown: the next pull starts from an
anchor, which is always safe).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..manifest import VersionRef

_MAX_STRONG = 64


class StateDict(dict):
    """The dict of tensors a pull without a target returns: a plain ``dict`` that can be weakly referenced,
    so its version is tracked (the next pull into it goes through deltas) without keeping it alive."""

    __slots__ = ("__weakref__",)


# weakly referenceable targets (Modules, StateDict) by id, each with its weak reference (whose callback
# drops the entry); the others in a bounded table that keeps them alive
_weak: dict[int, tuple[weakref.ref, VersionRef]] = {}
_strong: OrderedDict[int, tuple[Any, VersionRef]] = OrderedDict()
_lock = threading.RLock()  # re-entrant: a weak reference's callback may run inside a locked block


def get_version(target: Any) -> VersionRef | None:
    """The version recorded for ``target``, or None when unknown."""
    with _lock:
        entry = _weak.get(id(target))
        if entry is not None and entry[0]() is target:
            return entry[1]
        strong = _strong.get(id(target))
        return strong[1] if strong is not None and strong[0] is target else None


def set_version(target: Any, ref: VersionRef | None) -> None:
    """Record (or with None, forget) the version ``target`` holds."""
    key = id(target)
    with _lock:
        _weak.pop(key, None)
        _strong.pop(key, None)
        if ref is None:
            return
        try:
            _weak[key] = (weakref.ref(target, lambda wr, key=key: _dropped(key, wr)), ref)
            return
        except TypeError:  # a plain dict: not weakly referenceable
            pass
        _strong[key] = (target, ref)
        while len(_strong) > _MAX_STRONG:
            _strong.popitem(last=False)


def _dropped(key: int, wr: weakref.ref) -> None:
    with _lock:
        entry = _weak.get(key)
        if entry is not None and entry[0] is wr:  # not a newer object that got the same id
            del _weak[key]


# targets being written, by id, each with its lock and how many pulls hold or wait for it (the entry goes when
# none does; the target is alive meanwhile, so its id cannot be reused)
_busy: dict[int, list[Any]] = {}


@contextmanager
def exclusive(target: Any) -> Iterator[None]:
    """Hold ``target`` for one pull: pulls into the same target (from any Subscriber, any thread) run one at
    a time. ``None`` (a pull into a new dict) holds nothing."""
    if target is None:
        yield
        return
    key = id(target)
    with _lock:
        entry = _busy.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        with entry[0]:
            yield
    finally:
        with _lock:
            entry[1] -= 1
            if entry[1] == 0:
                del _busy[key]
