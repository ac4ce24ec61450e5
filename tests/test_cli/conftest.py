"""Fixtures of the CLI tests: a small store, the CLI run in-process, the real SeaweedFS."""

from __future__ import annotations

import os

import pytest
import torch

import deltastore as ds
from deltastore.cli import main
from test_backends.conftest import _start
from test_backends.servers import Seaweed


class Ran:
    """One in-process CLI run: exit status, stdout, stderr."""

    def __init__(self, rc: int, out: str, err: str):
        self.rc, self.out, self.err = rc, out, err

    @property
    def err_lines(self) -> list[str]:
        return self.err.splitlines()

    def one_line_error(self, code: int, *needles: str) -> str:
        """Assert exit ``code``, no stdout noise, exactly one stderr line containing every needle."""
        assert self.rc == code, (self.rc, self.out, self.err)
        assert len(self.err_lines) == 1, self.err
        assert "Traceback" not in self.err
        for n in needles:
            assert n in self.err, (n, self.err)
        return self.err


@pytest.fixture
def cli(capsys):
    """``cli(*argv)`` runs ``deltastore argv`` in this process and returns a :class:`Ran`."""
    os.environ.pop("DELTASTORE_NO_PROGRESS", None)

    def run(*argv: str) -> Ran:
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        got = capsys.readouterr()
        return Ran(rc, got.out, got.err)

    return run


def make_states(n: int = 6, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` successive bf16 states, about 5 % of one tensor's elements changing per step."""
    g = torch.Generator().manual_seed(seed)
    states = [{"w": torch.randn(32, 16, generator=g).bfloat16(), "n": torch.ones(16, dtype=torch.bfloat16)}]
    for _ in range(n - 1):
        w = states[-1]["w"].view(torch.int16).clone()
        w[torch.rand(w.shape, generator=g) < 0.05] += 1
        states.append({"w": w.view(torch.bfloat16), "n": states[-1]["n"]})
    return states


def publish_all(uri: str, states, **options) -> None:
    with ds.Publisher(uri, anchor_every=3, metadata={"run": "cli"}, **options) as pub:
        for i, s in enumerate(states):
            pub.publish(s, step=i)


@pytest.fixture
def store(tmp_path):
    """A local store with versions 0..5 (anchors at 0 and 3) and the states published."""
    uri = str(tmp_path / "s")
    states = make_states()
    publish_all(uri, states)
    return uri, states


@pytest.fixture(scope="session")
def seaweed():
    """The real SeaweedFS S3 server (its own instance: the backend tests' fixture lives in their conftest)."""
    server = _start(Seaweed)
    yield server
    server.stop()
