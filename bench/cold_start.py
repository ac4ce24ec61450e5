"""What a fresh process pays: a first publish + pull with empty caches against the same run with warm ones.

    python bench/cold_start.py [--repeat 5] [--tensors 8] [--rows 512] [--steps 3] [--read-only] [--rev REV]

Each run is a new interpreter (``python -c``) that imports torch and deltastore, publishes ``--steps``
versions of a small bf16 model (``--tensors`` tensors of ``--rows`` x ``--rows``; an anchor, then deltas of
~5 % changed elements) to a new local store and pulls the last one into a zeroed copy (checked bit for bit).
*Cold*: HOME, XDG_CACHE_HOME and NUMBA_CACHE_DIR are new empty folders (a new container, a new worker
image). *Warm*: the same folders again, after a run has filled them. Cold and warm alternate; prints the
median wall seconds of the whole process and of the publish + pull inside it, their spread (min-max), and
cold / warm (issue 47's bound: at most 1.5).

``--read-only`` runs the package from a copy made read-only (permission bits; its folder is checked unchanged
afterwards, which also holds for root). ``--rev REV`` runs the package of that git revision (``git archive``
into a temporary folder) instead of the importable one: for revisions whose kernels are numba (they compile on
first use and need numba installed); a revision with compiled kernels must be built first, so it is run from
its installed or built checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
import torch
import deltastore as ds
t1 = time.perf_counter()
uri, n, rows, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
model = {f"layers.{i}.weight": (torch.randn(rows, rows, generator=g) * 0.02).bfloat16() for i in range(n)}
pub = ds.Publisher(uri, dtype=torch.bfloat16)
for step in range(1, steps + 1):
    for w in model.values():
        bits = w.view(torch.int16)
        bits[torch.rand(bits.shape, generator=g) < 0.05] += 1
    pub.publish(model, step=step)
pub.close()
target = {k: torch.zeros_like(v) for k, v in model.items()}
res = ds.Subscriber(uri).pull(target)
exact = res.step == steps and all(torch.equal(target[k].view(torch.int16), v.view(torch.int16))
                                  for k, v in model.items())
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "work": t2 - t1, "exact": exact, "file": ds.__file__}))
'''


def one(env: dict[str, str], caches: Path, store: Path, args: argparse.Namespace) -> dict:
    run_env = {**env, "HOME": str(caches / "home"), "XDG_CACHE_HOME": str(caches / "xdg"),
               "NUMBA_CACHE_DIR": str(caches / "numba")}
    for d in ("home", "xdg", "numba"):
        (caches / d).mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(store), str(args.tensors), str(args.rows),
                          str(args.steps)], env=run_env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["wall"] = wall
    got["stderr"] = out.stderr.strip()
    return got


def tree_of(rev: str, where: Path) -> Path:
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "deltastore"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def read_only_copy(where: Path) -> Path:
    """The importable deltastore package copied under ``where`` and made read-only."""
    src = Path(importlib.util.find_spec("deltastore").origin).parent
    shutil.copytree(src, where / "deltastore", ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    for p in [where, *where.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    return where


def listing(root: Path) -> set[tuple[str, int, int]]:
    return {(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--read-only", action="store_true", help="run the package from a read-only copy")
    ap.add_argument("--rev", help="run this git revision's package (numba-era revisions)")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    env = dict(os.environ)
    try:
        tree = None
        if a.rev:
            tree = tree_of(a.rev, work / "tree")
        elif a.read_only:
            tree = read_only_copy(work / "tree")
            env["PYTHONDONTWRITEBYTECODE"] = "1"  # as root the bits do not stop Python's own .pyc writes
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
            before = listing(tree)
        rows: dict[str, list[dict]] = {"cold": [], "warm": []}
        for r in range(a.repeat):
            cold = work / f"caches-{r}"
            rows["cold"].append(one(env, cold, work / f"store-cold-{r}", a))
            rows["warm"].append(one(env, cold, work / f"store-warm-{r}", a))  # the caches the cold run left
        first = rows["cold"][0]
        print(f"deltastore from {first['file']}; {a.tensors} tensors of {a.rows}x{a.rows} bf16, {a.steps} versions "
              f"published then pulled; {a.repeat} cold/warm pairs; median (min-max)")
        for kind in ("cold", "warm"):
            rs = rows[kind]
            print(f"  {kind}: process {summary([x['wall'] for x in rs])}, import {summary([x['import'] for x in rs])}"
                  f", publish + pull {summary([x['work'] for x in rs])}, bit-exact {all(x['exact'] for x in rs)}")
        ratio = statistics.median(x["wall"] for x in rows["cold"]) / statistics.median(x["wall"] for x in rows["warm"])
        ratio_work = (statistics.median(x["work"] for x in rows["cold"])
                      / statistics.median(x["work"] for x in rows["warm"]))
        print(f"  cold / warm: process {ratio:.2f}, publish + pull {ratio_work:.2f} (bound: 1.5)")
        if tree is not None:
            changed = listing(tree) ^ before
            print(f"  package folder {'unchanged' if not changed else f'CHANGED: {sorted(changed)[:5]}'}")
        said = {x["stderr"] for x in rows["cold"] if x["stderr"]}
        for line in sorted(said):
            print(f"  a cold run said: {line[:300]}")
        return 0 if all(x["exact"] for k in rows for x in rows[k]) else 1
    finally:
        for p in [work, *work.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
