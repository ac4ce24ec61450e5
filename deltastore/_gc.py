"""Python's cycle collector paused while a version is published or pulled.

A version of a model with many tensors allocates a few container objects per
tensor (manifest records, parts, updates, changes) that survive until the
call returns. Every time enough of them have survived, CPython runs a
collection that traverses every tracked object of the process (the caller's
model and optimizer state included): measured, 40 % of a 16,384-tensor pull
and of its publish. These paths create no reference cycles of their own, so
the collector is paused while they run and resumes when the outermost paused
call returns; objects allocated meanwhile are then collected as usual. A
counter makes nested calls and calls from several threads (a background
writer next to the training loop) safe; a collector the application disabled
itself stays disabled.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

_lock = threading.Lock()
_depth = 0
_resume = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cycle collector for the block (see the module docstring)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


def paused(fn: F) -> F:
    """``fn`` run under :func:`collector_paused`."""

    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> object:
        with collector_paused():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
