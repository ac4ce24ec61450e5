"""Which version a target currently holds.

A target is identified by object identity. Weak references are used where the
target allows them (``nn.Module``); plain dicts cannot be weakly referenced, so
a bounded table keeps the most recent ones alive (an evicted target is simply
treated as unknown: the next pull starts from an anchor, which is always safe).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from .manifest import VersionRef

_MAX_STRONG = 64
_weak: weakref.WeakKeyDictionary[Any, VersionRef] = weakref.WeakKeyDictionary()
_strong: OrderedDict[int, tuple[Any, VersionRef]] = OrderedDict()
_lock = threading.Lock()


def get_version(target: Any) -> VersionRef | None:
    """The version recorded for ``target``, or None when unknown."""
    with _lock:
        try:
            return _weak.get(target)
        except TypeError:
            entry = _strong.get(id(target))
            return entry[1] if entry is not None and entry[0] is target else None


def set_version(target: Any, ref: VersionRef | None) -> None:
    """Record (or with None, forget) the version ``target`` holds."""
    with _lock:
        try:
            if ref is None:
                _weak.pop(target, None)
            else:
                _weak[target] = ref
            return
        except TypeError:
            pass
        _strong.pop(id(target), None)
        if ref is not None:
            _strong[id(target)] = (target, ref)
            while len(_strong) > _MAX_STRONG:
                _strong.popitem(last=False)
