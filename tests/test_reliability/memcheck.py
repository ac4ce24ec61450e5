"""Hostile cases in a fresh interpreter, each measured against its own memory peak.

    python -m test_reliability.memcheck bomb CODEC FRAME DECLARED   # from tests/
    python -m test_reliability.memcheck fuzz manifests|safetensors|streams N

Prints one JSON line. A process's peak RSS (``ru_maxrss``, ``VmHWM``) only ever
grows, so a case measured in a process that peaked higher earlier (another
test, a bigger setup) could inflate unseen: each case runs here, in its own
interpreter, and its growth is measured from the resident size just before it
to the peak during it. Where Linux allows it (``/proc/self/clear_refs``), the
peak is reset before every single case, so each fuzz case has its own peak too.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
from typing import Any, Callable

from deltastore.testing.hostile_objects import reset_peak, status_kb


def _peak_kb() -> int:
    hwm = status_kb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(fn: Callable[[], Any], collect: bool = True) -> tuple[float, Any]:
    """(MB the peak grew during ``fn`` above the resident size before it, ``fn``'s result)."""
    if collect:
        gc.collect()
    now = status_kb("VmRSS")
    base = now if now is not None and reset_peak() else _peak_kb()
    result = fn()
    return (_peak_kb() - base) / 1024, result


def bomb(codec: str, frame: str, declared: bool) -> dict[str, Any]:
    from deltastore.errors import DeltaStoreError

    from . import hostile

    spec, data, specs = hostile.bomb_object((codec, frame), declared)
    c = hostile.get_codec(spec)

    def run() -> str | None:
        try:
            c.decode(data, specs, hostile._old if specs is hostile.SPECS else None)
        except DeltaStoreError as e:
            return f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            return f"UNTYPED {type(e).__name__}: {e}"
        return None

    growth, error = measure(run)
    return {"case": [codec, frame, declared], "object_bytes": len(data), "growth_mb": round(growth, 1),
            "error": error, "typed": error is not None and not error.startswith("UNTYPED")}


def fuzz(name: str, n: int) -> dict[str, Any]:
    from . import hostile

    hostile.base()  # setup outside any case
    for i in range(len(hostile.CODECS)):
        hostile.encoded(i)
    worst: dict[str, Any] = {"growth_mb": 0.0}
    outcome = hostile._outcome

    def measured(kind: str, fn: Callable[[], None]) -> None:
        growth, _ = measure(lambda: outcome(kind, fn), collect=False)  # gc.collect() costs ~0.1 s a case
        if growth > worst["growth_mb"]:
            worst.update(growth_mb=round(growth, 1), case=hostile.COUNTS[f"{kind} cases"], kind=kind)

    hostile._outcome = measured
    getattr(hostile, f"fuzz_{name}")(n)
    cases = sum(v for k, v in hostile.COUNTS.items() if k.endswith(" cases"))
    return {"fuzz": name, "cases": cases, "max_growth_mb": worst["growth_mb"], "worst": worst,
            "untyped": hostile.UNTYPED[:10], "counts": dict(hostile.COUNTS)}


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    if argv[0] == "bomb":
        out = bomb(argv[1], argv[2], argv[3] == "1")
    elif argv[0] == "fuzz":
        out = fuzz(argv[1], int(argv[2]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
