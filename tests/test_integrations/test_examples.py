"""examples/grpo_cpu end to end: a GRPO trainer and a subscriber process on one local store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deltastore.testing import bits_equal

import deltastore as ds

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "grpo_cpu"


@pytest.mark.slow
def test_grpo_cpu_example_end_to_end(tmp_path):
    store, final = tmp_path / "store", tmp_path / "final.pt"
    steps = 5
    sub = subprocess.Popen([sys.executable, str(EXAMPLE / "subscriber.py"), "--store", str(store), "--steps",
                            str(steps), "--serve-ms", "100", "--idle-timeout", "120"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        train = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), "--store", str(store), "--steps",
                                str(steps), "--prompts", "2", "--group", "4", "--length", "8", "--width", "64",
                                "--save-final", str(final)],
                               capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert train.returncode == 0, train.stdout + train.stderr
        out, _ = sub.communicate(timeout=300)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.communicate()
    assert sub.returncode == 0, out
    assert f"DONE step={steps} " in out and "all_exact=True" in out, out
    assert " NO" not in out, out
    # The trainer's weights at the last step, compared with what the store serves through integer views.
    s = ds.Subscriber(str(store))
    assert s.versions() == list(range(1, steps + 1))
    got, want = s.pull(step=steps).state, torch.load(final)
    assert set(want) - set(got) == {"head.weight"}  # tied to embed.weight: published once
    assert torch.equal(want["head.weight"].view(torch.int16), want["embed.weight"].view(torch.int16))
    del want["head.weight"]
    assert bits_equal(got, want)
