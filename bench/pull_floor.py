"""How fast could a follower's ``ulp`` delta pull be on this machine? A floor, next to the library's pull.

    .venv/bin/python bench/pull_floor.py [--run dither-lr1e-5] [--size 1.0] [--steps 4] [--repeat 5]

The library's pull decodes an object in stages that each write an array
(positions, value planes, the old and new bits) and then checks the result
(counts, positions, the checksum of every touched tensor). This asks what is
left when all of that is taken away: the object's two zstd streams
decompressed at once (positions on one thread, value planes on the other),
then one fused kernel pass per thread that reads each gap, steps the value and
writes it into the target, with nothing written anywhere else (``bench/_pull_floor.c``,
compiled here with the system C compiler, ``$CC`` or ``cc``, and called through ctypes). The threads
split the tensors at a point worked out before the clock starts (a format
could store such split points; today's does not). It then adds back the
one check a pull cannot skip, the checksum of every touched tensor, in the
same pass.

No undo record is kept (a ``ulp`` step can be undone from the new bits alone)
and nothing is validated beyond a position staying inside its tensor and a
value inside its dtype. So no correct pull with today's object format can be
faster than the first figure, and none that verifies what it wrote faster
than the second. Each row is the median (and range) over ``--repeat`` pulls
of the same delta into a target reset between them, with a dense ``copy_`` of
the same tensors timed around each. Data as in ``bench/pull_stages.py``
(whose store it reuses).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pull_stages  # noqa: E402
import scale  # noqa: E402
import deltastore as ds  # noqa: E402
from deltastore.pull import tracking  # noqa: E402
from deltastore.checksum import tensor_keys  # noqa: E402
from deltastore.codecs._common import read_header, unpack_frames, zstd_decompress  # noqa: E402
from deltastore.kernels.bitstream import _gap_offsets, _step_range  # noqa: E402
from deltastore.kernels.parallel import each  # noqa: E402


def _floor_kernel() -> ctypes.CDLL:
    """``_pull_floor.c`` compiled with the system C compiler (``$CC``, default ``cc``) into a temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="pull-floor-")) / "_pull_floor.so"
    src = Path(__file__).with_name("_pull_floor.c")
    subprocess.run([os.environ.get("CC", "cc"), "-O3", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))  # a CDLL call releases the GIL: the two halves run on two threads at once
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.fused.argtypes = [p, p, p, p, i64, i64, p, i64, i64, i64, p, i64, i64, i64, i64, i64, ctypes.c_int, p]
    lib.fused.restype = i64
    return lib


def _fused(lib: ctypes.CDLL, ptr: np.ndarray, lens: np.ndarray, counts: np.ndarray, keys: np.ndarray, s0: int,
           s1: int, gaps: np.ndarray, i0: int, e0: int, planes: np.ndarray, fmag: int, lo: int, hi: int,
           hashed: bool, sums: np.ndarray) -> int:
    """The fused floor pass over segments ``s0 .. s1 - 1`` (see ``_pull_floor.c``)."""
    return lib.fused(ptr.ctypes.data, lens.ctypes.data, counts.ctypes.data, keys.ctypes.data, s0, s1, gaps.ctypes.data,
                     gaps.size, i0, e0, planes.ctypes.data, planes.strides[0], planes.shape[0], int(fmag), int(lo),
                     int(hi), int(hashed), sums.ctypes.data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="dither-lr1e-5", choices=scale._trace.RUNS)
    ap.add_argument("--size", type=float, default=1.0, help="GB of bf16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--store", default=None)
    args = ap.parse_args(argv)
    args.layout = "whole"
    cfg = {"size": args.size, "tensors": 16384, "tensors_mb": 200.0}
    args.store = args.store or f"/tmp/deltastore-pull-stages-whole-{args.size}-{args.run}-{args.steps}"
    pull_stages.build_store(args, cfg)

    src = scale.build(cfg, args.run, "whole")
    sub = ds.Subscriber(args.store)
    target = {k: torch.zeros_like(v) for k, v in src.state.items()}
    scratch = {k: torch.zeros_like(v) for k, v in src.state.items()}
    sub.pull(target, step=0)
    src.advance(keep=False)
    sub.pull(target, step=1)
    held = tracking.get_version(target)  # step 1: set again before each library pull of step 2
    src.advance(keep=False)  # src now holds step 2: what each pull of step 2 must produce
    before = {k: v.clone() for k, v in target.items()}

    m = sub.manifest(2)
    recs = m.tensor_map()
    fmag, lo, hi = _step_range(np.dtype(np.int16), True)
    lib = _floor_kernel()
    objects = []  # per object: what the timed pull starts from (its bytes) and what it may know beforehand
    for index in sorted(m.delta_objects):
        raw, _ = unpack_frames(sub.store.get_object(m.objects[index].digest), "auto")
        if set(raw) != {"part.ulp"}:
            print(f"object {index} holds parts {sorted(raw)}; this bench reads objects of one ulp part only",
                  file=sys.stderr)
            return 2
        ulp, _ = unpack_frames(raw["part.ulp"], "ulp")
        names = sorted(r.name for r in m.tensors if any(p.object == index for p in r.delta))
        counts, (raw_len, nplanes) = read_header(ulp, [recs[n].spec for n in names], "ulp", 2)
        counts_a = np.asarray(counts, np.int64)
        total = int(counts_a.sum())
        gaps = np.frombuffer(zstd_decompress(ulp["positions"], raw_len, "positions"), np.uint8)
        half = int(np.searchsorted(np.cumsum(counts_a), total // 2))  # the split: about half the changes each
        ts = [target[n] for n in names]
        objects.append({
            "ulp": ulp, "raw_len": raw_len, "nplanes": nplanes, "total": total, "counts": counts_a,
            "ptr": np.array([t.data_ptr() for t in ts], np.int64), "lens": np.array([t.numel() for t in ts], np.int64),
            "keys": tensor_keys(names, len(names)),
            "runs": [(0, half, 0, 0), (half, len(names), int(_gap_offsets(gaps, np.array([counts_a[:half].sum()], np.int64))[0]),
                                        int(counts_a[:half].sum()))]})
    changes = sum(o["total"] for o in objects)

    def one_object(o: dict, hashed: bool) -> None:
        planes = np.empty((o["nplanes"], o["total"]), np.uint8)
        box: list[np.ndarray] = []

        def unpack(k: int) -> None:
            if k == 0:
                box.append(np.frombuffer(zstd_decompress(o["ulp"]["positions"], o["raw_len"], "positions"), np.uint8))
            else:
                for j in range(o["nplanes"]):
                    planes[j] = np.frombuffer(zstd_decompress(o["ulp"][f"plane{j}"], o["total"], "plane"), np.uint8)

        each(2, unpack)
        sums = np.zeros(len(o["ptr"]), np.uint64)
        runs = o["runs"]
        keys = np.ascontiguousarray(o["keys"], np.uint64)
        bad = each(2, lambda k: _fused(lib, o["ptr"], o["lens"], o["counts"], keys, runs[k][0], runs[k][1],
                                       box[0], runs[k][2], runs[k][3], planes, fmag, lo, hi, hashed, sums))
        assert all(b == -1 for b in bad), bad

    def one(hashed: bool) -> float:
        w = time.perf_counter()
        for o in objects:
            one_object(o, hashed)
        return time.perf_counter() - w

    rows: dict[str, list[float]] = {"library pull": [], "floor: decompress + fused apply": [],
                                    "floor + checksum in the same pass": []}
    copies: list[float] = []
    one(False)  # warm up
    for k, v in target.items():
        v.copy_(before[k])
    one(True)
    for _ in range(args.repeat):
        for label in rows:
            for k, v in target.items():
                v.copy_(before[k])
            w = time.perf_counter()
            scale.dense_copy(scratch, src.state)
            copies.append(time.perf_counter() - w)
            if label == "library pull":
                tracking.set_version(target, held)
                w = time.perf_counter()
                sub.pull(target, step=2)
                rows[label].append(time.perf_counter() - w)
            else:
                rows[label].append(one(label.endswith("pass")))
            if not scale.bits_equal(target, src.state):
                print(f"{label}: not bit-exact", file=sys.stderr)
                return 1
    copy = statistics.median(copies)
    print(f"{len(target)} tensors in {len(objects)} objects, {src.nbytes / 1e9:.2f} GB, {changes:,} changes; dense copy median "
          f"{1e3 * copy:.0f} ms ({1e3 * min(copies):.0f}-{1e3 * max(copies):.0f})\n")
    print("| pull of one delta | ms (median, range) | x dense copy |\n|---|---:|---:|")
    for label, xs in rows.items():
        med = statistics.median(xs)
        print(f"| {label} | {1e3 * med:.0f} ({1e3 * min(xs):.0f}-{1e3 * max(xs):.0f}) | {med / copy:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
