"""What a version that carries a differential costs the publisher, with and without a local anchor copy.

    .venv/bin/python bench/differentials.py [--trace minilm-l6] [--runs dither-lr5e-6] [--size 0.2]
                                            [--steps 24] [--threads 1] [--json PATH] [--workdir DIR]

A trace run replicated to ``--size`` GB (``bench/scale.py``'s ``Source``) is published for ``--steps``
versions by two Publishers side by side, default settings (``adaptive`` anchors, ``auto`` codec), on two
local stores (tmpfs when there is one): one as shipped (a differential of a sampled drift streams the anchor
back from the store) and one with ``anchor_copy_dir`` (it compares with the anchor's bits in a local file).
Both see the same states, in alternating order. Per kind of version (delta, delta with a differential,
anchor) it prints the median and spread of the process CPU time and wall time of ``publish()``, the
bytes read back from the store per version (``DeltaStore.get_object``), and the CPU of writing an
anchor's copy, which runs on a thread after ``publish()`` returned (waited for apart, untimed by it). It also prints the mean over
every version, which is what a training loop pays, and checks both stores' last version bit-exact
through a Subscriber. The drift tracker samples at any model above ~17 M elements, so at these sizes
every differential is rebuilt (the first steps of each run show it as ``exact drift`` otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import _trace  # noqa: E402
import scale  # noqa: E402
import deltastore as ds  # noqa: E402
from deltastore.store import DeltaStore  # noqa: E402
from deltastore.testing import bits_equal  # noqa: E402

CONFIGS = ("from the store", "anchor copy")


class ReadCounter:
    """Bytes each store returns from ``get_object`` (wraps the class method once; keyed by store)."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        real = DeltaStore.get_object

        def counted(store, digest, size=None):  # noqa: ANN001, ANN202
            data = real(store, digest, size)
            self.bytes[id(store)] = self.bytes.get(id(store), 0) + len(data)
            return data

        DeltaStore.get_object = counted

    def take(self, store: DeltaStore) -> int:
        return self.bytes.pop(id(store), 0)


def kind_of(info) -> str:  # noqa: ANN001
    return "anchor" if info.kind == "anchor" else "differential" if info.differential else "delta"


def run_one(run: str, size: float, steps: int, threads: int, workdir: str) -> dict:
    src = scale.Source(run, size_gb=size)
    counter = ReadCounter()
    dirs = {c: tempfile.mkdtemp(prefix="bench-diff-", dir=workdir) for c in CONFIGS}
    copy_dir = tempfile.mkdtemp(prefix="bench-diff-copy-", dir=workdir)
    pubs = {"from the store": ds.Publisher(dirs["from the store"], max_workers=threads),
            "anchor copy": ds.Publisher(dirs["anchor copy"], max_workers=threads, anchor_copy_dir=copy_dir)}
    rows: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    try:
        for step in range(steps):
            if step:
                src.advance(keep=False)
            order = CONFIGS if step % 2 == 0 else CONFIGS[::-1]
            for c in order:
                pub = pubs[c]
                counter.take(pub.store)
                w, t = time.perf_counter(), time.process_time()
                info = pub.publish(src.state, step=step)
                row = {"step": step, "kind": kind_of(info), "cpu": time.process_time() - t,
                       "wall": time.perf_counter() - w, "read": counter.take(pub.store),
                       "warnings": list(info.warnings)}
                # the copy of an anchor is written on a thread after publish() returned: waited for here, apart,
                # so that its CPU is not counted in the other publisher's next call
                w, t = time.perf_counter(), time.process_time()
                if pub.stages.anchor_copy is not None:
                    pub.stages.anchor_copy.settle()
                row["copy_cpu"], row["copy_wall"] = time.process_time() - t, time.perf_counter() - w
                rows[c].append(row)
        for c in CONFIGS:
            pubs[c].close()
            got = ds.Subscriber(dirs[c]).pull(step=steps - 1).state
            if not bits_equal(got, src.state):
                raise SystemExit(f"{run} {c}: the last version does not pull bit-exact")
    finally:
        for p in pubs.values():
            p.close()
        for d in (*dirs.values(), copy_dir):
            shutil.rmtree(d, ignore_errors=True)
    return {"model_bytes": src.nbytes, "rows": rows}


def stat(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"


def report(name: str, res: dict) -> None:
    print(f"\n## {name} ({res['model_bytes'] / 1e9:.2f} GB of bf16)\n")
    print("| config | kind | versions | `publish()` CPU ms | `publish()` wall ms | MB read back from the store | "
          "copy written after it returned, CPU ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for c in CONFIGS:
        rows = [r for r in res["rows"][c] if r["step"] > 0]  # step 0 is the first anchor
        for kind in ("delta", "differential", "anchor"):
            rs = [r for r in rows if r["kind"] == kind]
            if rs:
                copy = stat([r["copy_cpu"] * 1e3 for r in rs]) if kind == "anchor" and c == "anchor copy" else "-"
                print(f"| {c} | {kind} | {len(rs)} | {stat([r['cpu'] * 1e3 for r in rs])} | "
                      f"{stat([r['wall'] * 1e3 for r in rs])} | {stat([r['read'] / 1e6 for r in rs])} | {copy} |")
        print(f"| {c} | **every version, mean** | {len(rows)} | "
              f"{statistics.mean(r['cpu'] for r in rows) * 1e3:.0f} | "
              f"{statistics.mean(r['wall'] for r in rows) * 1e3:.0f} | "
              f"{statistics.mean(r['read'] for r in rows) / 1e6:.1f} | "
              f"{statistics.mean(r['copy_cpu'] for r in rows) * 1e3:.0f} |")
    warned = sorted({w for c in CONFIGS for r in res["rows"][c] for w in r["warnings"]})
    for w in warned:
        print(f"- warning: {w}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _trace.add_trace_arg(ap)
    ap.add_argument("--runs", nargs="+", help="runs of the trace (default: all)")
    ap.add_argument("--size", type=float, default=0.2, help="model size, GB of bf16 (default 0.2)")
    ap.add_argument("--steps", type=int, default=24, help="versions published, the first an anchor (default 24)")
    ap.add_argument("--threads", type=int, default=1, help="kernel, codec and upload threads (default 1)")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--workdir", help="where the stores and the copy go (default /dev/shm when there is one)")
    a = ap.parse_args(argv)
    _trace.select(a.trace)
    torch.set_num_threads(a.threads)
    os.environ["DELTASTORE_THREADS"] = os.environ["DELTASTORE_CODEC_THREADS"] = str(a.threads)
    workdir = a.workdir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    print(f"bench/differentials.py: trace {a.trace}, size {a.size} GB, {a.steps} steps, {a.threads} thread(s), "
          f"os.cpu_count() {os.cpu_count()}, 1-min load {os.getloadavg()[0]:.1f}")
    out = {}
    for run in a.runs or _trace.runs(a.trace):
        out[run] = run_one(run, a.size, a.steps, a.threads, workdir)
        report(f"{a.trace} {run}", out[run])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
