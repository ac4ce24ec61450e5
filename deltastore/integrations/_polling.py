"""The polling loop the store followers share: ``poll_once()`` every ``poll_interval`` s until ``stop()``."""

from __future__ import annotations

import logging
import threading
from typing import Any


class PollingLoop:
    """Mixin: :meth:`run` (in the caller's thread) or :meth:`start` (a daemon thread) until :meth:`stop`.

    Subclasses set ``poll_interval``, implement ``poll_once()`` and report ``served_step``; a failed poll
    is logged as ``_poll_failure`` on ``_poll_log`` and the loop goes on (the engine keeps what it serves).
    """

    poll_interval: float
    served_step: Any
    _thread_name = "deltastore-follower"
    _poll_failure = "deltastore: follower could not apply (still serving step %s): %s: %s"
    _poll_log = logging.getLogger("deltastore")

    def _init_polling(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> Any:
        raise NotImplementedError

    def run(self) -> None:
        """Poll until :meth:`stop`; errors are logged and the engine keeps what it serves. A failure that
        repeats the previous poll's (the same version refused again) is logged once, then at DEBUG."""
        last: tuple[Any, ...] | None = None
        while not self._stop.is_set():
            try:
                self.poll_once()
                last = None
            except Exception as e:
                failure = (self.served_step, type(e).__name__, str(e))
                self._poll_log.log(logging.DEBUG if failure == last else logging.WARNING, self._poll_failure,
                                   *failure)
                last = failure
            self._stop.wait(self.poll_interval)

    def start(self) -> threading.Thread:
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=self._thread_name, daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
