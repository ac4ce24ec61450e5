"""Ask Linux for AMX tile state in every Python process of the vLLM test servers.

On an x86 host with AMX (Sapphire Rapids and later), vLLM's CPU attention
kernel (``cpu_attn`` ISA "amx") executes AMX instructions, but Linux grants
a process AMX state only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``; without it the first tile instruction is SIGILL. vLLM
0.32's ``vllm serve`` workers never request it, so the first completion
kills the worker. (The in-process engine of ``engine_check.py`` ran on the
same host without it; what asks for it there was not traced.) The test
harness puts this directory on ``PYTHONPATH`` of the vLLM processes it
starts; on hosts without AMX the call fails harmlessly. Nothing here is part
of deltastore.
"""

import ctypes
import platform

if platform.system() == "Linux" and platform.machine() == "x86_64":
    try:
        _SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
        ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        pass
