"""Hostile variants of a codec's object, and a meter that bounds each decode of them in time and memory.

Used by the codec conformance kit (:mod:`deltastore.testing.codecs`): :func:`hostile_objects` makes the
variants from a good object, :class:`DecodeMeter` runs each decode under a deadline and measures how much
memory it took.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

MiB = 1 << 20


#: bytes of zeros in each zstd bomb of :func:`bombs`
BOMB_BYTES = 64 * MiB


@functools.lru_cache(maxsize=1)
def bombs() -> dict[str, bytes]:
    """zstd frames of :data:`BOMB_BYTES` zeros, a few KB each: one that declares its size, one that does not."""
    import zstandard

    zeros = bytes(BOMB_BYTES)
    return {"declared": zstandard.ZstdCompressor(level=3).compress(zeros),
            "undeclared": zstandard.ZstdCompressor(level=3, write_content_size=False).compress(zeros)}


def status_kb(field: str) -> int | None:
    """A field of ``/proc/self/status`` in kB (``VmRSS``, ``VmHWM``, ...), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset this process's peak resident memory (``VmHWM := VmRSS``, Linux); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # CLEAR_REFS_MM_HIWATER_RSS
        return True
    except OSError:
        return False


class DecodeMeter:
    """Runs decodes on a worker thread, each under a deadline, and measures each one's memory growth: the
    larger of the rise of the process's peak resident memory (``VmHWM``, reset before each where Linux
    allows: it sees every allocator) and :mod:`tracemalloc`'s peak (Python and numpy, touched or not)."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="codec-conformance")
        self.hwm = reset_peak()
        self.tracing = tracemalloc.is_tracing()
        if not self.tracing:
            tracemalloc.start()

    def close(self) -> None:
        if not self.tracing:
            tracemalloc.stop()
        self.pool.shutdown(wait=False)

    def run(self, fn: Callable[[], Any], what: str) -> tuple[BaseException | None, int]:
        """(what ``fn`` raised or None, bytes it grew memory by); fails the test past the deadline."""
        base = (status_kb("VmRSS") or 0) if self.hwm and reset_peak() else None
        tracemalloc.reset_peak()
        traced = tracemalloc.get_traced_memory()[0]

        def call() -> BaseException | None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - judged by the caller
                return e
            return None

        future = self.pool.submit(call)
        try:
            error = future.result(timeout=self.deadline)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"{what}: the decode did not finish within {self.deadline} s", pytrace=False)
        grew = tracemalloc.get_traced_memory()[1] - traced
        if base is not None:
            grew = max(grew, ((status_kb("VmHWM") or 0) - base) * 1024)
        return error, grew


def safetensors_parts(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    """A safetensors object's header and body, or None when ``data`` is not one."""
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n]) if 8 + n <= len(data) else None
    except ValueError:
        return None
    if not isinstance(header, dict) or not all(
            isinstance(t, dict) and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
            for k, t in header.items() if k != "__metadata__"):
        return None
    return header, data[8 + n:]


def _st_pack(header: dict[str, Any], body: bytes) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + body


def _int_leaves(doc: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(doc, bool):
        return
    if isinstance(doc, int):
        yield path
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from _int_leaves(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _int_leaves(v, path + (i,))


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    doc = dict(doc) if isinstance(doc, dict) else list(doc)
    doc[path[0]] = _set(doc[path[0]], path[1:], value)
    return doc


def _replaced(header: dict[str, Any], body: bytes, name: str, chunk: bytes) -> bytes:
    """The safetensors object ``header`` + ``body`` with tensor ``name``'s bytes replaced by ``chunk`` (a
    1-D tensor of its dtype; the other tensors keep their bytes, moved)."""
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    h, chunks, off = dict(header), [], 0
    for n in sorted(tensors, key=lambda k: tensors[k]["data_offsets"][0]):
        a, b = tensors[n]["data_offsets"]
        c = chunk if n == name else body[a:b]
        h[n] = {**tensors[n], "data_offsets": [off, off + len(c)]}
        if n == name:
            h[n]["shape"] = [len(c)]
        chunks.append(c)
        off += len(c)
    return _st_pack(h, b"".join(chunks))


def _framed_variants(header: dict[str, Any], body: bytes, bombs: dict[str, bytes], depth: int) -> dict[str, bytes]:
    """:func:`hostile_objects` of a safetensors object, but the bit flips."""
    out: dict[str, bytes] = {}
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, t in tensors.items():
        a, b = t["data_offsets"]
        for k in sorted({0, 1, 2, 3, 4, 5, 8, (b - a) // 2, b - a - 8}):
            if 0 <= k < b - a:
                run = min(8, b - a - k)
                out[f"0xFF x {run} at byte {k} of {name!r}"] = _st_pack(header, body[:a + k] + b"\xff" * run
                                                                       + body[a + k + run:])
    meta = header.get("__metadata__") or {}
    for key, value in meta.items():
        try:
            doc = json.loads(value)
        except (TypeError, ValueError):
            continue
        leaves = list(_int_leaves(doc))
        for i in sorted({*np.linspace(0, len(leaves) - 1, 16).astype(int).tolist()}) if leaves else []:
            for huge in (2**40, 2**62, -1):
                h = {**header, "__metadata__": {**meta, key: json.dumps(_set(doc, leaves[i], huge))}}
                out[f"{key} {list(leaves[i])} = {huge}"] = _st_pack(h, body)
    for name, t in tensors.items():
        if t.get("dtype") != "U8":
            continue
        for kind, bomb in bombs.items():
            out[f"{name!r} replaced by a zstd bomb ({kind} size)"] = _replaced(header, body, name, bomb)
        a, b = t["data_offsets"]
        nested = safetensors_parts(body[a:b]) if depth > 0 else None
        if nested is not None:  # a whole object stored as bytes (auto's parts): its own variants, in place
            for what, inner in _framed_variants(*nested, bombs, depth - 1).items():
                out[f"in {name!r}: {what}"] = _replaced(header, body, name, inner)
    return out


def hostile_objects(data: bytes, bombs: dict[str, bytes]) -> dict[str, bytes]:
    """Variants of a good object ``data`` a decoder must survive: single bits flipped, 8-byte runs of 0xFF
    written over each stored tensor's start, middle and end (length fields made huge), each integer in the
    header metadata's JSON values made huge or negative, each byte tensor replaced by each of ``bombs``
    (zstd frames of 64 MiB of zeros), and the same inside a byte tensor that holds a safetensors object
    itself. Without a safetensors frame, the runs go over the whole object."""
    out: dict[str, bytes] = {}
    for i in sorted({*range(min(16, len(data))), *np.linspace(0, len(data) - 1, 48).astype(int).tolist()}):
        out[f"bit {i % 8} of byte {i} flipped"] = data[:i] + bytes([data[i] ^ (1 << (i % 8))]) + data[i + 1:]
    parts = safetensors_parts(data)
    if parts is None:
        for i in np.linspace(0, max(0, len(data) - 8), 16).astype(int).tolist():
            out[f"0xFF x 8 at byte {i}"] = data[:i] + b"\xff" * 8 + data[i + 8:]
        return out
    out.update(_framed_variants(*parts, bombs, depth=1))
    return out


__all__ = ["BOMB_BYTES", "DecodeMeter", "bombs", "hostile_objects", "safetensors_parts"]
