"""deltastore.kernels.jit: cached kernels load without numba's compiler, and nothing about them changes.

Each case runs in a fresh interpreter (what is loaded is a per-process fact) over a kernel module written
into a temporary folder, so that its numba cache and the runtime's object file live there and start empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

KERNEL = '''
import numpy as np
from deltastore.kernels.jit import njit


@njit(nogil=True, cache=True)
def scaled_sum(x, k):
    out = np.empty(x.size, np.int64)  # an allocation: the runtime (NRT) must be there
    for i in range(x.size):
        out[i] = np.int64(x[i]) * k
    return out.sum()
'''

PROBE = '''
import json, sys
import numpy as np
from numba.core.runtime import rtsys
import kernel_mod
x = np.arange(1000, dtype=np.uint16)
got = int(kernel_mod.scaled_sum(x, 3))
more = {}
if "--compile-after" in sys.argv:  # a cache miss after the lean load: numba's own compile path
    from deltastore.kernels.jit import njit
    @njit
    def fresh(n):
        return np.arange(n).sum()
    more["fresh"] = int(fresh(10))
print(json.dumps(dict(
    got=got,
    cache=type(kernel_mod.scaled_sum._cache).__name__,
    cache_hits=sum(kernel_mod.scaled_sum._cache_hits.values()),
    lowering_imported="numba.np.npyimpl" in sys.modules or "numba.cpython.listobj" in sys.modules,
    runtime_ready=bool(rtsys._init),
    **more,
)))
'''

EXPECT = 3 * sum(range(1000))


def _probe(folder: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path]), **(env or {})}
    out = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=folder, env=run_env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "kernel_mod.py").write_text(textwrap.dedent(KERNEL))
    return tmp_path


def _runtime_files(folder: Path) -> list[Path]:
    return sorted((folder / "__pycache__").glob("nrt-*.bin"))


def test_a_cached_kernel_loads_without_the_compiler(folder: Path) -> None:
    first = _probe(folder)  # compiles, saves the kernel and the runtime's object code
    assert first["got"] == EXPECT and first["cache"] == "LeanFunctionCache" and first["cache_hits"] == 0
    (path,) = _runtime_files(folder)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask, "the runtime file ignores the umask"
    second = _probe(folder)
    assert second["got"] == EXPECT and second["cache_hits"] == 1 and second["runtime_ready"]
    assert not second["lowering_imported"], "a cached load imported numba's lowering modules"


def test_numba_compiles_after_a_lean_load(folder: Path) -> None:
    _probe(folder)
    got = _probe(folder, "--compile-after")
    assert got["got"] == EXPECT and got["cache_hits"] == 1 and got["fresh"] == 45


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-build", "garbage"])
def test_a_bad_runtime_file_is_ignored_and_written_anew(folder: Path, damage: str) -> None:
    _probe(folder)
    (path,) = _runtime_files(folder)
    data = path.read_bytes()
    if damage == "flip":  # one bit of the object code: the digest refutes it before LLVM sees it
        data = data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "other-build":
        head, _, body = data.partition(b"\n")[2].partition(b"\n")
        meta = json.loads(head)
        meta["llvmlite"] = "0.0.0"
        data = data.partition(b"\n")[0] + b"\n" + json.dumps(meta).encode() + b"\n" + body
    else:
        data = b"not a runtime file"
    path.write_bytes(data)
    got = _probe(folder)
    assert got["got"] == EXPECT and got["cache_hits"] == 1 and not got["lowering_imported"]
    assert path.read_bytes() != data, "the refused file was not replaced"
    assert _probe(folder)["got"] == EXPECT


def test_a_runtime_file_that_cannot_be_written_costs_only_the_compile(folder: Path) -> None:
    _probe(folder)
    (path,) = _runtime_files(folder)
    path.unlink()
    path.mkdir()  # neither read nor replaced, whatever the user's permissions
    got = _probe(folder)
    assert got["got"] == EXPECT and got["cache_hits"] == 1 and path.is_dir()


def test_the_switch_gives_numbas_own_cache(folder: Path) -> None:
    got = _probe(folder, env={"DELTASTORE_NUMBA_LEAN": "0"})
    assert got["got"] == EXPECT and got["cache"] == "FunctionCache"
    again = _probe(folder, env={"DELTASTORE_NUMBA_LEAN": "0"})
    assert again["cache_hits"] == 1 and again["lowering_imported"]
