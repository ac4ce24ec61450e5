"""Progress: bars on a pseudo-terminal only (off with --quiet / DELTASTORE_NO_PROGRESS); the library callbacks."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import sys
import termios

import pytest
from fsspec.callbacks import Callback

import deltastore as ds
from deltastore.cli import main

from .conftest import make_states


def _on_a_pty(argv: list[str], monkeypatch) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; returns the exit status and what the terminal got."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    term = io.TextIOWrapper(io.FileIO(slave, "w", closefd=True), write_through=True)
    monkeypatch.setattr(sys, "stderr", term)
    chunks = []
    try:
        rc = main([str(a) for a in argv])
        term.flush()
        while select.select([master], [], [], 0.1)[0]:  # drain before closing the slave (then reads fail)
            chunks.append(os.read(master, 65536))
    finally:
        term.close()
        os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


BAR = "%|"  # tqdm's "42%|████      |"


def test_bars_on_a_terminal_for_verify_pull_ls_and_the_gc_wait(store, tmp_path, monkeypatch, capsys):
    uri, _ = store
    monkeypatch.delenv("DELTASTORE_NO_PROGRESS", raising=False)
    import deltastore.store

    monkeypatch.setattr(deltastore.store, "REFRESH_WINDOW", 0.0)  # so that a grace of 0.3 s is allowed
    for argv, label in [(["verify", uri], "verify"), (["pull", uri, tmp_path / "o"], "pull 5"),
                        (["ls", uri], "manifests"), (["stats", uri], "manifests"),
                        (["gc", uri, "--keep-last", "1", "--keep-anchors", "1", "--grace", "0.3"], "gc grace")]:
        rc, term = _on_a_pty(argv, monkeypatch)
        assert rc == 0, term
        assert label in term and BAR in term, (argv, term)
    assert BAR not in capsys.readouterr().out  # bars go to stderr only


def test_no_bars_without_a_terminal_or_when_turned_off(store, tmp_path, monkeypatch, capsys):
    uri, _ = store
    assert main(["verify", uri]) == 0  # stderr captured: not a terminal
    assert capsys.readouterr().err == ""
    rc, term = _on_a_pty(["--quiet", "verify", uri], monkeypatch)
    assert rc == 0 and BAR not in term
    rc, term = _on_a_pty(["verify", uri, "-q"], monkeypatch)
    assert rc == 0 and BAR not in term
    monkeypatch.setenv("DELTASTORE_NO_PROGRESS", "1")
    rc, term = _on_a_pty(["pull", uri, tmp_path / "o"], monkeypatch)
    assert rc == 0 and BAR not in term


class Recorder(Callback):
    """An fsspec callback that remembers every (size, value) it was told."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int | None, int]] = []

    def call(self, *args, **kwargs):
        self.seen.append((self.size, self.value))


def test_library_pull_and_publish_report_through_fsspec_callbacks(tmp_path):
    uri = str(tmp_path / "s")
    states = make_states(5)
    pub = ds.Publisher(uri, anchor_every=3)
    publish_cb = Recorder()
    info = pub.publish(states[0], step=0, progress=publish_cb)
    m0 = ds.open_store(uri).manifest(0)
    assert publish_cb.size == publish_cb.value == len(m0.objects) > 0  # every object stored was counted
    for i, s in enumerate(states[1:], 1):
        pub.publish(s, step=i)
    pub.close()
    assert info.kind == "anchor"

    store = ds.open_store(uri)
    anchor, latest = store.manifest(3), store.manifest(4)
    cb = Recorder()
    res = ds.Subscriber(uri).pull(progress=cb)
    assert res.step == 4 and res.path == "anchor"
    # the anchor's full objects, then version 4's delta objects: every byte fetched is counted, once
    want = anchor.object_bytes(anchor.full_objects) + latest.object_bytes(latest.delta_objects)
    assert cb.value == cb.size == want == res.bytes_fetched
    assert [v for _, v in cb.seen] == sorted(v for _, v in cb.seen)  # only forward

    calls = []
    ds.Subscriber(uri).pull(step=2, progress=lambda size, value: calls.append((size, value)))
    assert calls and calls[-1][0] == calls[-1][1] > 0


def test_progress_true_draws_on_stderr_unless_turned_off(tmp_path, capsys, monkeypatch):
    uri = str(tmp_path / "s")
    with ds.Publisher(uri) as pub:
        pub.publish(make_states(1)[0], step=0)
    monkeypatch.delenv("DELTASTORE_NO_PROGRESS", raising=False)
    ds.Subscriber(uri).pull(progress=True)
    assert "pull" in capsys.readouterr().err
    monkeypatch.setenv("DELTASTORE_NO_PROGRESS", "1")
    ds.Subscriber(uri).pull(progress=True)
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match="progress must be"):
        ds.Subscriber(uri).pull(progress="yes")
