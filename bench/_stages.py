"""Stage timers for the profiling benchmarks (``publish_stages.py``, ``pull_stages.py``).

:func:`instrument` wraps named functions and methods of the library, in place, with timers that add
``[cpu, wall, calls]`` per stage into a dict; inclusive times (a stage that calls another counts both).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Iterable


def instrument(stages: Iterable[tuple[str, str]], spent: dict[str, list[float]]) -> list[str]:
    """Wrap every ``(module, qualified name)`` of ``stages`` (a function, or ``Class.method`` incl. class and
    static methods) with timers adding ``[cpu, wall, calls]`` into ``spent[qualified name]`` (a
    ``defaultdict``); every module of the library that imported a function by name gets the wrapper too.
    Returns the names not found (renamed or gone)."""
    missing = []
    for modname, qual in stages:
        try:
            mod = sys.modules.get(modname) or __import__(modname, fromlist=["_"])
        except ImportError:
            missing.append(qual)
            continue
        owner, attr = mod, qual
        if "." in qual:
            cls, attr = qual.split(".")
            owner = getattr(mod, cls, None)
        raw = owner.__dict__.get(attr) if owner is not None else None
        if raw is None:
            missing.append(qual)
            continue
        is_cm, is_sm = isinstance(raw, classmethod), isinstance(raw, staticmethod)
        fn = raw.__func__ if is_cm or is_sm else raw

        def timed(*a, _fn=fn, _q=qual, **k):
            c, w = time.process_time(), time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                s = spent[_q]
                s[0] += time.process_time() - c
                s[1] += time.perf_counter() - w
                s[2] += 1

        wrapped = functools.wraps(fn)(timed)
        if owner is not mod:
            setattr(owner, attr, classmethod(wrapped) if is_cm else staticmethod(wrapped) if is_sm else wrapped)
            continue
        for m in list(sys.modules.values()):  # every module that imported it by name
            if getattr(m, "__name__", "").startswith("deltastore") and getattr(m, attr, None) is fn:
                setattr(m, attr, wrapped)
    return missing
