"""What fresh memory costs on this machine: the first write to newly mapped pages, 4 KiB and huge (Linux).

A publish or pull allocates its temporaries fresh, so the kernel time it
pays depends on the machine: on a virtual machine whose balloon device
reports free pages to the hypervisor (``VIRTIO_BALLOON_F_REPORTING``), the
free 2 MiB blocks a transparent huge page is made from are handed back to
the host, and the first write to one waits for the host to back it again.
:func:`fault_cost` measures that, so the kernel-time lines of
``bench/scale.py`` can be read against it.
"""

from __future__ import annotations

import mmap
import os
import resource
import time

_F_REPORTING = 5  # feature bit of a virtio balloon device (virtio spec, "Memory Balloon Device")
_BALLOON = "/sys/bus/virtio/drivers/virtio_balloon"


def reports_free_pages() -> bool | None:
    """Whether a virtio balloon device here reports free pages to its host; None where there is none."""
    try:
        devices = [d for d in os.listdir(_BALLOON) if d.startswith("virtio")]
    except OSError:
        return None
    found = False
    for d in devices:
        try:
            with open(os.path.join(_BALLOON, d, "features")) as f:
                bits = f.read().strip()
        except OSError:
            continue
        found = True
        if len(bits) > _F_REPORTING and bits[_F_REPORTING] == "1":
            return True
    return False if found else None


def _touch(nbytes: int, huge: bool) -> tuple[float, float]:
    """(wall s, system CPU s) to write one byte of every 4 KiB page of a fresh anonymous mapping."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            m.madvise(mmap.MADV_HUGEPAGE)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
        for off in range(0, nbytes, mmap.PAGESIZE):
            m[off] = 1
        return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0
    finally:
        m.close()


def fault_cost(nbytes: int = 256 << 20, idle_s: float = 5.0) -> dict:
    """Seconds per GiB of fresh memory written for the first time, with 4 KiB pages (``small``) and with
    ``MADV_HUGEPAGE`` (``huge``): ``cold`` after ``idle_s`` seconds without allocating (a host that takes
    free pages back has then taken them), ``warm`` right after the same amount was freed. Also whether
    free page reporting is on (None: no balloon device)."""
    gib = nbytes / (1 << 30)
    out: dict = {"reports_free_pages": reports_free_pages(), "mib": nbytes >> 20, "idle_s": idle_s}
    for kind in ("small", "huge"):
        time.sleep(idle_s)
        cold = _touch(nbytes, kind == "huge")
        warm = _touch(nbytes, kind == "huge")
        out[kind] = {"cold_s_per_gib": cold[0] / gib, "cold_sys_s_per_gib": cold[1] / gib,
                     "warm_s_per_gib": warm[0] / gib, "warm_sys_s_per_gib": warm[1] / gib}
    return out
