"""Progress reporting for long operations, in fsspec's ``Callback`` convention.

:meth:`Publisher.publish <deltastore.publish.publisher.Publisher.publish>` and
:meth:`Subscriber.pull <deltastore.pull.subscriber.Subscriber.pull>` take
``progress=``:

* ``None`` / ``False``: nothing is reported (the default);
* ``True``: a tqdm bar on stderr (none when ``DELTASTORE_NO_PROGRESS=1``);
* an ``fsspec.callbacks.Callback`` (``TqdmCallback``, your own subclass):
  its ``set_size(n)`` is called as the work becomes known and
  ``relative_update(n)`` as it is done; the caller owns it (and closes it);
* a plain function ``f(size, value)``: called on every update, as an fsspec
  hook is.

What is counted: a pull counts object bytes fetched (an anchor's streamed
objects and each delta's objects); a publish counts objects encoded and
stored. ``size`` grows as the work is planned, so a bar's total may rise
during the first moments. In background publishing (``background=True``)
the write happens after ``publish()`` returned, and nothing is reported.

The library's internals read the active callback with :func:`current`; a
callback is active inside :func:`reporting`, for the calling thread (a
``ContextVar``), and updates from worker threads go through :func:`advance`.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Union

from fsspec.callbacks import DEFAULT_CALLBACK, Callback, TqdmCallback

__all__ = ["ENV_OFF", "ProgressArg", "active", "advance", "as_callback", "current", "disabled_by_env", "grow",
           "reporting", "tqdm_callback"]

#: set to ``1`` to turn every progress bar off (library ``progress=True`` and the CLI alike)
ENV_OFF = "DELTASTORE_NO_PROGRESS"

ProgressArg = Union[bool, Callback, Callable[[Any, Any], Any], None]

_current: ContextVar[Callback] = ContextVar("deltastore_progress", default=DEFAULT_CALLBACK)
_lock = threading.Lock()


def disabled_by_env() -> bool:
    """Whether ``DELTASTORE_NO_PROGRESS`` turns bars off."""
    return os.environ.get(ENV_OFF, "").strip().lower() not in ("", "0", "false", "no")


def tqdm_callback(desc: str, unit: str = "B") -> Callback:
    """A ``TqdmCallback`` drawing one bar on stderr that disappears when closed."""
    kwargs: dict[str, Any] = {"desc": desc, "file": sys.stderr, "leave": False}
    if unit == "B":
        kwargs.update(unit="B", unit_scale=True, unit_divisor=1024)
    elif unit == "s":  # a wait: seconds done of seconds, no rate (a rate of seconds per second says nothing)
        kwargs.update(bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s")
    else:  # counted things: "12/40 [00:01<00:02, 9.87 manifests/s]", never inverted to "1.01s/ manifests"
        kwargs.update(unit=f" {unit}", bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                                   "[{elapsed}<{remaining}, {rate_noinv_fmt}]")
    return TqdmCallback(tqdm_kwargs=kwargs)


def as_callback(progress: ProgressArg, *, desc: str, unit: str = "B") -> tuple[Callback, bool]:
    """Turn a ``progress=`` argument into a ``Callback``; returns it and whether it was created here.

    Raises ``TypeError`` for anything else than the forms in the module docstring.
    """
    if progress is None or progress is False:
        return DEFAULT_CALLBACK, False
    if progress is True:
        return (DEFAULT_CALLBACK, False) if disabled_by_env() else (tqdm_callback(desc, unit), True)
    if isinstance(progress, Callback):
        return progress, False
    if callable(progress):
        return Callback(hooks={"deltastore": lambda size, value, **_: progress(size, value)}), True
    raise TypeError(f"progress must be a bool, an fsspec Callback or a function f(size, value), got {progress!r}")


@contextmanager
def reporting(progress: ProgressArg, *, desc: str, unit: str = "B") -> Iterator[Callback]:
    """Make ``progress`` the active callback of this thread for the block; closes a bar it created."""
    cb, owned = as_callback(progress, desc=desc, unit=unit)
    token = _current.set(cb)
    try:
        yield cb
    finally:
        _current.reset(token)
        if owned:
            cb.close()


def current() -> Callback:
    """The active callback (a no-op one outside :func:`reporting`)."""
    return _current.get()


def active() -> bool:
    """Whether a callback other than the no-op one is active."""
    return _current.get() is not DEFAULT_CALLBACK


def grow(cb: Callback, n: int) -> None:
    """Add ``n`` to the callback's size (thread-safe)."""
    if cb is DEFAULT_CALLBACK or n <= 0:
        return
    with _lock:
        cb.set_size((cb.size or 0) + n)


def advance(cb: Callback, n: int = 1) -> None:
    """Report ``n`` more units done (thread-safe)."""
    if cb is DEFAULT_CALLBACK:
        return
    with _lock:
        cb.relative_update(n)
