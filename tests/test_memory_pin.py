"""The allocator pin of :mod:`deltastore._memory`: freed temporaries leave the process, an application's
own malloc tuning is kept. Each case runs in a fresh interpreter (the pin is once per process)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the pin is glibc's mallopt")

# A worker thread frees a large mmapped block (glibc then slides its threshold up to that size) and then
# many blocks below it, as a publish or pull does with its temporaries; what stays resident is printed.
_SCENARIO = """
import json, sys, threading
import numpy as np
import deltastore as ds
from deltastore import _memory

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

made = sys.argv[1]
if made == "publisher":
    ds.Publisher(sys.argv[2]).close()
elif made == "subscriber":
    ds.Subscriber(sys.argv[2])

def work():
    for _ in range(3):
        big = np.ones(24 << 20, np.uint8)
        del big
        blocks = [np.ones(6 << 20, np.uint8) for _ in range(12)]
        del blocks

base = rss()
t = threading.Thread(target=work)
t.start()
t.join()
_memory.release_memory()
print(json.dumps({"pinned": _memory._pinned, "kept": rss() - base}))
"""

MB = 1 << 20


def _run(tmp_path, made: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in
             ("GLIBC_TUNABLES", "DELTASTORE_PIN_MALLOC")}
    out = subprocess.run([sys.executable, "-c", _SCENARIO, made, str(tmp_path / "store")], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("made", ["publisher", "subscriber"])
def test_a_publisher_or_subscriber_pins_the_threshold_and_freed_temporaries_leave(tmp_path, made):
    got = _run(tmp_path, made)
    assert got["pinned"] is True
    assert got["kept"] < 8 * MB, got


def test_without_the_pin_the_same_temporaries_stay_resident(tmp_path):
    """The scenario is one where glibc keeps memory (else the test above could not fail)."""
    got = _run(tmp_path, "publisher", DELTASTORE_PIN_MALLOC="0")
    assert got["pinned"] is False
    assert got["kept"] > 16 * MB, got


@pytest.mark.parametrize("env", [{"DELTASTORE_PIN_MALLOC": "0"}, {"MALLOC_MMAP_THRESHOLD_": "4194304"},
                                 {"MALLOC_TRIM_THRESHOLD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304"}])
def test_an_application_that_tunes_malloc_itself_is_left_alone(tmp_path, env):
    assert _run(tmp_path, "publisher", **env)["pinned"] is False
