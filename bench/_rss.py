"""This process's resident memory for the benchmarks: now, the peak since a reset, a trimmed baseline (Linux)."""

from __future__ import annotations

import ctypes
import gc
import threading
import time


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


class Rss:
    """This process's resident memory now and its peak since :meth:`reset`.

    The peak is VmHWM after a reset through ``/proc/self/clear_refs``; where
    that is refused, a thread samples VmRSS every millisecond instead.
    """

    def __init__(self):
        self._max = 0
        self._sampler: threading.Thread | None = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        while True:
            self._max = max(self._max, _status()["VmRSS"])
            time.sleep(0.001)

    @staticmethod
    def now() -> int:
        return _status()["VmRSS"]

    @staticmethod
    def anonymous() -> int:
        """The anonymous part of :meth:`now` (heap and mappings; not the file-backed pages of code)."""
        return _status().get("RssAnon", 0)

    def reset(self) -> None:
        if self.hwm:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._max = self.now()

    def peak(self) -> int:
        return max(_status()["VmHWM"], self.now()) if self.hwm else max(self._max, self.now())


def baseline(anonymous: bool = False) -> int:
    """RSS (its anonymous part with ``anonymous``) once freed memory is handed back (gc, then glibc
    ``malloc_trim``): what the model itself costs."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return Rss.anonymous() if anonymous else Rss.now()
