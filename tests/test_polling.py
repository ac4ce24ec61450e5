"""The followers' shared polling loop: a failed poll is logged and the loop goes on until stop()."""

from __future__ import annotations

import logging
import threading

from deltastore.integrations._polling import PollingLoop
from deltastore.integrations.vllm.follower import Follower
from deltastore.integrations.vllm_lora import LoraFollower


class _Counting(PollingLoop):
    poll_interval = 0.001
    served_step = 3

    def __init__(self):
        self._init_polling()
        self.polls = 0
        self.three = threading.Event()

    def poll_once(self):
        self.polls += 1
        if self.polls >= 3:
            self.three.set()
        if self.polls == 1:
            raise RuntimeError("store unreachable")


def test_a_failed_poll_is_logged_and_polling_goes_on(caplog):
    loop = _Counting()
    with caplog.at_level(logging.WARNING, logger="deltastore"):
        thread = loop.start()
        assert loop.three.wait(10)
        loop.stop(10)
    assert not thread.is_alive() and loop.polls >= 3
    assert any("still serving step 3" in r.getMessage() and "store unreachable" in r.getMessage()
               for r in caplog.records)


class _Refusing(PollingLoop):
    """Refuses the same version on polls 1-3, succeeds on 4, refuses again on 5; stops after 6."""

    poll_interval = 0.001
    served_step = 3

    def __init__(self):
        self._init_polling()
        self.polls = 0
        self.done = threading.Event()

    def poll_once(self):
        self.polls += 1
        if self.polls >= 6:
            self.done.set()
            self._stop.set()
        if self.polls in (1, 2, 3, 5):
            raise ValueError("object sha256:ab fails its sha256 check")


def test_a_refusal_repeated_poll_after_poll_is_logged_once(caplog):
    loop = _Refusing()
    with caplog.at_level(logging.DEBUG, logger="deltastore"):
        loop.run()
    assert loop.done.is_set()
    levels = [r.levelno for r in caplog.records if "fails its sha256 check" in r.getMessage()]
    # polls 1-3: once as a warning, then at DEBUG; after a good poll the same failure is news again
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING]


def test_both_followers_use_the_loop_under_their_own_names():
    assert issubclass(Follower, PollingLoop) and issubclass(LoraFollower, PollingLoop)
    assert (Follower._thread_name, LoraFollower._thread_name) == ("deltastore-follower", "deltastore-lora-follower")
