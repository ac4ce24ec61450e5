"""Content addressing needs objects whose bytes depend on their contents alone, in every process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# make_golden is imported by path: a top-level ``tests`` package installed by a dependency (verl ships
# one) would shadow this repository's ``tests`` namespace
SCRIPT = """
import hashlib, sys
sys.path.insert(0, "tests/test_codecs")
from deltastore.codecs import get_codec
from make_golden import cases, whole
ups = cases()["mixed"]
for record in ("raw", "zstd", "ulp", "ctx", {"id": "auto", "config": {"link_mbps": None}}, "dense",
               {"id": "dense", "config": {"planes": True}}):
    codec = get_codec(record)
    print(codec.codec_id, hashlib.sha256(codec.encode(whole(ups) if codec.dense else ups)).hexdigest())
"""


def test_every_codec_writes_the_same_bytes_in_every_process():
    runs = [subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"}).stdout
            for seed in (1, 2, 3)]
    assert runs[0].count("\n") == 7
    assert runs[0] == runs[1] == runs[2]
