"""A read-only install works: nothing is compiled, cached or written beside the package or in HOME on first use.

The installed package (with its compiled kernels) is copied into a folder made read-only and imported from
there by a fresh interpreter whose HOME and cache directories cannot be created (they lie under
``/dev/null``, which refuses even root, who ignores permission bits). A publish + pull round trip through
every default codec path must succeed bit-exactly, say nothing on stderr, and leave the package folder
exactly as it was (no file added, removed or changed: a JIT cache beside the modules, as numba kept, would
be caught here even when running as root).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import deltastore

CHILD = r'''
import json, sys
import torch
import deltastore as ds
uri = sys.argv[1]
g = torch.Generator().manual_seed(0)
model = {f"layers.{i}.weight": (torch.randn(256, 256, generator=g) * 0.02).bfloat16() for i in range(4)}
model["norm.weight"] = torch.ones(256, dtype=torch.bfloat16)
pub = ds.Publisher(uri, dtype=torch.bfloat16)
for step in range(1, 4):
    for name, w in model.items():
        bits = w.view(torch.int16)
        bits[torch.rand(bits.shape, generator=g) < 0.03] += 1
    pub.publish(model, step=step)
pub.close()
target = {k: torch.zeros_like(v) for k, v in model.items()}
res = ds.Subscriber(uri).pull(target)
exact = all(torch.equal(target[k].view(torch.int16), v.view(torch.int16)) for k, v in model.items())
print(json.dumps({"step": res.step, "exact": exact, "file": ds.__file__,
                  "jit": sorted({m.split(".")[0] for m in sys.modules} & {"numba", "llvmlite"})}))
'''


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
            for p in root.rglob("*")}


def test_publish_and_pull_from_a_read_only_install_with_no_writable_home(tmp_path: Path) -> None:
    site = tmp_path / "site"
    src = Path(deltastore.__file__).parent
    shutil.copytree(src, site / "deltastore", ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    for p in [site, *site.rglob("*")]:  # read-only for everyone (root still could write: the snapshot tells)
        mode = p.stat().st_mode
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before = _snapshot(site)
    unwritable = "/dev/null/deltastore-test"  # no folder can be made under a character device
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "PYTHON"))}
    env.update(PYTHONPATH=str(site), HOME=unwritable, XDG_CACHE_HOME=unwritable + "/cache",
               NUMBA_CACHE_DIR=unwritable + "/numba", TORCHINDUCTOR_CACHE_DIR=unwritable + "/inductor",
               PYTHONDONTWRITEBYTECODE="1")  # Python's own .pyc files are not the package's doing
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert Path(got["file"]).parent == site / "deltastore", got["file"]
        assert got["step"] == 3 and got["exact"]
        assert got["jit"] == [], f"a JIT compiler was imported: {got['jit']}"
        assert out.stderr.strip() == "", out.stderr[-3000:]
        assert _snapshot(site) == before, "the package folder changed on first use"
    finally:
        for p in [site, *site.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
