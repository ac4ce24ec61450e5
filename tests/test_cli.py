"""The command line: ls, inspect, verify, materialize, demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import deltastore as ds
from conftest import ROOT, bits_equal
from deltastore.cli import main
from deltastore.store import object_key


@pytest.fixture
def store(tmp_path):
    uri = str(tmp_path / "s")
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(32, 16, generator=g).bfloat16(), "n": torch.ones(16, dtype=torch.bfloat16)}]
    for _ in range(5):
        w = states[-1]["w"].view(torch.int16).clone()
        w[torch.rand(w.shape, generator=g) < 0.05] += 1
        states.append({"w": w.view(torch.bfloat16), "n": states[-1]["n"]})
    with ds.Publisher(uri, anchor_every=3, metadata={"run": "cli"}) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)
    return uri, states


def test_ls_and_inspect(store, capsys):
    uri, _ = store
    assert main(["ls", uri]) == 0
    out = capsys.readouterr().out
    assert out.count("anchor") == 2 and out.count("delta") == 4
    assert main(["inspect", uri, "4"]) == 0
    out = capsys.readouterr().out
    assert "version 4 (delta)" in out and '"run": "cli"' in out
    assert main(["inspect", uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 5
    assert main(["inspect", uri, "99"]) == 1
    assert "VersionNotFoundError" in capsys.readouterr().err


def test_verify_passes_then_names_the_corruption(store, capsys):
    uri, _ = store
    assert main(["verify", uri]) == 0
    assert "6 versions, 6 replayed" in capsys.readouterr().out
    m = ds.Subscriber(uri).manifest(4)
    path = os.path.join(uri, *object_key(m.objects[0].digest).split("/"))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert main(["verify", uri]) == 1
    out = capsys.readouterr().out
    assert "FAIL version 4" in out and "sha256" in out


def test_materialize_writes_a_loadable_checkpoint(store, tmp_path, capsys):
    uri, states = store
    out = tmp_path / "ckpt"
    assert main(["materialize", uri, "4", str(out)]) == 0
    assert bits_equal(load_file(out / "model.safetensors"), states[4])


def test_materialize_shards_large_models(store, tmp_path):
    from deltastore.materialize import materialize

    uri, states = store
    files = materialize(ds.open_store(uri), 5, tmp_path / "sharded", shard_bytes=100)
    assert files[-1] == "model.safetensors.index.json" and len(files) == 3
    index = json.loads((tmp_path / "sharded" / files[-1]).read_text())
    loaded = {}
    for name, fname in index["weight_map"].items():
        loaded[name] = load_file(tmp_path / "sharded" / fname)[name]
    assert bits_equal(loaded, states[5])


def test_demo_runs_bit_exact(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "deltastore", "demo", "--steps", "4", "--store",
                           str(tmp_path / "demo")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("  yes\n") == 4 and "every step bit-exact: yes" in proc.stdout
    assert ds.Subscriber(str(tmp_path / "demo")).versions() == [1, 2, 3, 4]
