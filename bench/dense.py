"""Anchor codec (``dense`` with byte planes) and full checksum at model scale, and per-tensor overhead.

    python bench/dense.py [--mb 500] [--tensors 16384] [--tensors-mb 200] [--threads 2] [--repeat 3]

What ``bench/codecs.py`` does not show: throughput on a model-sized state (the
real trace's bf16 tensors replicated under new names to ``--mb``, so every
tensor keeps its real statistics), with the kernel threads set to
``--threads``, and the cost of many small tensors (``--tensors`` tensors of
``--tensors-mb`` in all, cut from the trace) against ``safetensors``
``save_file`` / ``load_file`` of the same tensors in a temporary folder.
Prints MB/s of model (wall, best of ``--repeat``) and per CPU-second (all
threads' CPU time: what a quiet core would give), size as % of raw, and
checks every decoded bit. The whole-pipeline figures (publish, pull) live in
``bench/scale.py``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import _trace


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(best wall seconds, CPU seconds of that run, result)."""
    runs = []
    for _ in range(repeat):
        c, t = time.process_time(), time.perf_counter()
        r = fn()
        runs.append((time.perf_counter() - t, time.process_time() - c, r))
    return min(runs, key=lambda x: x[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=500, help="replicate the trace to about this many MB of bf16")
    ap.add_argument("--tensors", type=int, default=16384)
    ap.add_argument("--tensors-mb", type=float, default=200)
    ap.add_argument("--threads", type=int, default=2, help="kernel and torch threads")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    os.environ["DELTASTORE_THREADS"] = str(a.threads)
    torch.set_num_threads(a.threads)
    from deltastore.checksum import full_checksum
    from deltastore.codecs import TensorSpec, Update, get_codec
    from deltastore.tensors import bits_view

    base = _trace.load("cold-lr1e-6").state(0)
    one = sum(v.numel() * 2 for v in base.values())
    state = _trace.scaled(base, max(1, round(a.mb * 1e6 / one)))
    mb = sum(v.numel() * 2 for v in state.values()) / 1e6
    print(f"threads {a.threads}; model: {mb:.0f} MB bf16 in {len(state)} tensors (trace x{len(state) // len(base)})")

    wall, cpu, _ = best(lambda: [full_checksum(k, v) for k, v in state.items()], a.repeat)
    print(f"full_checksum: {mb / wall:.0f} MB/s wall, {mb / cpu:.0f} MB/s per CPU-second")

    codec = get_codec({"id": "dense", "config": {"planes": True}})

    def run(st: dict[str, torch.Tensor], label: str) -> tuple[float, float]:
        specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in st.items()]
        ups = [Update(s, bits_view(st[s.name])) for s in specs]
        size = sum(v.numel() * v.element_size() for v in st.values()) / 1e6
        we, ce, data = best(lambda: codec.encode(ups), a.repeat)
        wd, cd, out = best(lambda: codec.decode(data, specs), a.repeat)
        exact = all(torch.equal(out[s.name].bits, bits_view(st[s.name])) for s in specs)
        print(f"{label}: {len(data) / size / 1e4:.2f} % of raw; encode {size / we:.0f} MB/s wall "
              f"({we * 1e3:.0f} ms), {size / ce:.0f} MB/s per CPU-s; decode {size / wd:.0f} MB/s wall "
              f"({wd * 1e3:.0f} ms), {size / cd:.0f} MB/s per CPU-s; bit-exact {exact}")
        return we, wd

    run(state, f"dense planes, {mb:.0f} MB")

    flat = torch.cat([bits_view(v) for v in base.values()])
    n = max(1, int(a.tensors_mb * 1e6 / 2 / a.tensors))
    small = {}
    for i in range(a.tensors):
        at = (i * n) % (flat.numel() - n)
        small[f"model.layers.{i // 128}.mlp.experts.{i % 128}.w"] = flat[at:at + n].clone().view(torch.bfloat16)
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.safetensors")
        ws, _, _ = best(lambda: save_file(small, path), a.repeat)
        wl, _, _ = best(lambda: load_file(path), a.repeat)
    print(f"{a.tensors} tensors of {n} bf16 ({a.tensors * n * 2 / 1e6:.0f} MB): safetensors save_file "
          f"{ws * 1e3:.0f} ms, load_file {wl * 1e3:.0f} ms")
    we, wd = run(small, f"dense planes, {a.tensors} tensors")
    print(f"  encode / save_file {we / ws:.2f}x, decode / load_file {wd / wl:.2f}x")


if __name__ == "__main__":
    main()
