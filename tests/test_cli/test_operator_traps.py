"""An operator's first hour without traps (issue 47): one test per trap, checking the exit status, the one
line, that nothing was deleted, the mode bits."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid

import pytest

import deltastore as ds
from conftest import ROOT, require_module
from deltastore.cli._common import step_ranges
from deltastore.errors import CredentialsError, DeviceUnavailableError, UnknownOptionError

from .conftest import make_states
from .test_progress import _on_a_pty


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("DELTASTORE_NO_PROGRESS", None)
    return env


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# -- gc: nothing deleted without a policy; step lists as ranges ---------------------------------------------
@pytest.fixture(scope="module")
def long_store(tmp_path_factory):
    """30 versions (anchors every 5): the default policy (keep-last 20, keep-anchors 2) would delete some."""
    uri = str(tmp_path_factory.mktemp("gc") / "s")
    with ds.Publisher(uri, anchor_every=5) as pub:
        for i, s in enumerate(make_states(30)):
            pub.publish(s, step=i)
    return uri


def test_gc_without_a_policy_deletes_nothing_and_says_which_flags_would(long_store, tmp_path, cli, monkeypatch):
    uri = str(tmp_path / "copy")
    import shutil

    shutil.copytree(long_store, uri)
    before = _files(uri)
    r = cli("gc", uri)
    assert r.rc == 0 and r.err == "", r.err
    assert _files(uri) == before  # nothing deleted
    lines = r.out.splitlines()
    assert lines[0] == "would keep 20 versions: 10-29"
    assert lines[1].startswith("would delete 10 versions: 0-9; ") and " objects (" in lines[1]
    assert lines[2] == ("nothing deleted: no policy given (shown: the default, --keep-last 20 --keep-anchors 2); "
                        "to delete, run again with --keep-last 20 --keep-anchors 2")
    doc = json.loads(cli("gc", uri, "--json").out)
    assert doc["dry_run"] and doc["policy"] == {"keep_last": 20, "keep_anchors": 2, "given": False}
    assert doc["delete_versions"] == list(range(10)) and _files(uri) == before

    r = cli("gc", uri, "--keep-last", "3", "--dry-run", "--orphans")  # a policy, but --dry-run
    assert r.rc == 0 and "would delete 24 versions: 0-19, 21-24; " in r.out  # anchors 20, 25 kept (2)
    assert "nothing deleted (--dry-run)" in r.out and _files(uri) == before

    import deltastore.store

    monkeypatch.setattr(deltastore.store, "REFRESH_WINDOW", 0.0)  # so that a grace of 0 is allowed
    r = cli("gc", uri, "--keep-last", "3", "--grace", "0")  # a policy: applied (keep-anchors defaults to 2)
    assert r.rc == 0 and r.out.splitlines()[0] == "kept 6 versions: 20, 25-29"
    assert r.out.splitlines()[1].startswith("deleted 24 versions: 0-19, 21-24; ")
    assert ds.Subscriber(uri).versions() == [20, 25, 26, 27, 28, 29]


def test_the_gc_command_shows_the_library_default_policy():
    from deltastore.cli.gc import DEFAULT_KEEP_ANCHORS, DEFAULT_KEEP_LAST
    from deltastore.gc import Retention

    assert (DEFAULT_KEEP_LAST, DEFAULT_KEEP_ANCHORS) == (Retention().keep_last, Retention().keep_anchors)


def test_step_ranges():
    assert step_ranges([]) == ""
    assert step_ranges([5]) == "5"
    assert step_ranges([1, 2, 3, 190, 195, 196, 197, 198, 199]) == "1-3, 190, 195-199"
    assert step_ranges([9, 3, 2, 2, 10]) == "2-3, 9-10"
    assert step_ranges(range(1, 179)) == "1-178"


# -- pulled files follow the umask -------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_pulled_files_follow_the_umask(store, tmp_path, cli, mask):
    uri, _ = store
    old = os.umask(mask)
    try:
        r = cli("pull", uri, tmp_path / "ckpt")
        r2 = cli("materialize", uri, "2", tmp_path / "ckpt2")
    finally:
        os.umask(old)
    assert r.rc == 0 and r2.rc == 0, (r.err, r2.err)
    for folder in (tmp_path / "ckpt", tmp_path / "ckpt2"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~mask
        names = os.listdir(folder)
        assert "model.safetensors" in names
        for name in names:
            assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o666 & ~mask, name


def test_library_materialize_follows_the_umask(store, tmp_path):
    from deltastore.pull.materialize import materialize

    uri, _ = store
    old = os.umask(0o022)
    try:
        names = materialize(ds.open_store(uri), 3, tmp_path / "out", shard_bytes=600)  # sharded: several files
    finally:
        os.umask(old)
    assert len(names) > 2 and "model.safetensors.index.json" in names
    assert {stat.S_IMODE(os.stat(tmp_path / "out" / n).st_mode) for n in names} == {0o644}


# -- an unreachable endpoint: the first retry shown at once; a refused connection fails fast ---------------
class _Silent:
    """A TCP endpoint that accepts connections and never answers (a hung server, a black-holing proxy)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.sock.settimeout(0.2)
        while not self.stop:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self):
        self.stop = True
        for s in self.held:
            s.close()
        self.sock.close()


@pytest.fixture
def silent():
    s = _Silent()
    yield s
    s.close()


def _terminal() -> tuple[int, int]:
    """A pseudo-terminal (master, slave) with a size, as a real one has (tqdm draws nothing on a 0-column one)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return master, slave


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _s3_options(endpoint: str) -> list[str]:
    return ["-o", f"endpoint_url={endpoint}", "-o", "key=k", "-o", "secret=s", "-o", "check_bucket=true"]


def test_first_retry_is_shown_at_once_on_a_terminal(silent):
    """stderr on a pseudo-terminal, no -v: the first retry is on screen long before the deadline ends the run."""
    require_module("s3fs")
    master, slave = _terminal()
    argv = [sys.executable, "-m", "deltastore", "ls", "s3://bucket/run",
            *_s3_options(f"http://127.0.0.1:{silent.port}"), "-o", "timeout=0.5", "-o", "deadline=6"]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, env=_env())
    os.close(slave)
    seen: list[tuple[float, str]] = []
    buf = b""
    while True:
        ready = select.select([master], [], [], 0.1)[0]
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                seen.append((time.monotonic() - start, line.decode(errors="replace").strip()))
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    end = time.monotonic() - start
    os.close(master)
    assert proc.returncode == 1, seen
    retry = [(t, line) for t, line in seen if "retrying for up to" in line]
    assert len(retry) == 1, seen  # the first retry only; the later ones stay at DEBUG
    t, line = retry[0]
    assert "get" in line or "open" in line, line  # what
    assert "Timeout" in line or "timeout" in line, line  # why
    assert "(storage option 'deadline')" in line and re.search(r"up to \d+ s more", line), line  # the deadline
    assert end - t > 2, (t, end)  # on screen seconds before the run gave up
    assert seen[-1][1].startswith("deltastore: BackendUnavailableError: store unreachable after"), seen


def test_first_retry_is_shown_with_v_and_not_without(silent, cli):
    require_module("s3fs")
    opts = [*_s3_options(f"http://127.0.0.1:{silent.port}"), "-o", "timeout=0.3", "-o", "deadline=3"]
    r = cli("-v", "ls", "s3://bucket/run", *opts)
    assert r.rc == 1 and sum("retrying for up to" in x for x in r.err_lines) == 1, r.err
    cli("ls", "s3://bucket/run", *opts).one_line_error(1, "store unreachable after")  # not a terminal, no -v


def test_a_refused_connection_fails_fast(cli):
    require_module("s3fs")
    port = _closed_port()
    start = time.monotonic()
    r = cli("ls", "s3://bucket/run", *_s3_options(f"http://127.0.0.1:{port}"))  # default deadline: 30 s
    took = time.monotonic() - start
    r.one_line_error(1, "BackendUnavailableError", "connection refused (not retried", f"127.0.0.1:{port}")
    assert took < 10, took  # not retried until the 30 s deadline


def test_a_refused_connection_after_the_store_answered_is_retried():
    """A store that answered once and then refuses is restarting: retried (not failed at the first refusal)."""
    from deltastore.backends.memory import MemoryBackend
    from deltastore.backends.retry import RetryingBackend, RetryPolicy
    from deltastore.errors import BackendUnavailableError

    class Restarting(MemoryBackend):
        refusals = 0

        def _get(self, key):
            if type(self).refusals:
                type(self).refusals -= 1
                raise BackendUnavailableError("down") from ConnectionRefusedError(111, "Connection refused")
            return super()._get(key)

    inner = Restarting(uuid.uuid4().hex)
    inner.put("k", b"v")
    store = RetryingBackend(inner, RetryPolicy(attempts=5, base_delay=0.01, deadline=5))
    Restarting.refusals = 1
    with pytest.raises(BackendUnavailableError, match="connection refused"):
        store.get("k")  # never reached yet: not retried
    assert store.retries == 0
    assert store.get("k") == b"v"  # reached
    Restarting.refusals = 2
    assert store.get("k") == b"v" and store.retries == 2  # now a refusal is a restart: retried


# -- credentials and misspelt options ----------------------------------------------------------------------
def test_no_s3_credentials_is_one_typed_line_naming_where_it_looked(seaweed, monkeypatch, tmp_path, cli):
    require_module("s3fs")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = cli("ls", "s3://bucket/run", "-o", f"endpoint_url={seaweed.endpoint}", "-o", "skip_instance_cache=true")
    err = r.one_line_error(1, "CredentialsError", "s3://bucket/run", "AWS_ACCESS_KEY_ID", "~/.aws/credentials",
                           "-o key=", "-o secret=", "-o profile=", "-o anon=true")
    assert "Traceback" not in err
    with pytest.raises(CredentialsError) as e:
        ds.open_store("s3://bucket/run", endpoint_url=seaweed.endpoint, skip_instance_cache=True)
    assert isinstance(e.value, PermissionError)
    r = cli("ls", "s3://bucket/run", "-o", f"endpoint_url={seaweed.endpoint}", "-o", "profile=nope",
            "-o", "skip_instance_cache=true")
    r.one_line_error(1, "CredentialsError", "nope", "AWS_PROFILE")


@pytest.fixture(scope="module")
def hf_server():
    """The HF bucket stand-in (it answers 401 to a request without its token, as the Hub does)."""
    require_module("huggingface_hub")
    from test_backends.conftest import _start
    from test_backends.servers import HfStandin

    server = _start(HfStandin)
    yield server
    server.stop()


def test_no_hf_token_is_one_typed_line(hf_server, monkeypatch, tmp_path, cli):
    from test_backends.conftest import make_bucket

    bucket = make_bucket("hf", hf_server)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    r = cli("ls", f"hf://buckets/{bucket}/run", "-o", f"endpoint={hf_server.endpoint}")
    r.one_line_error(1, "CredentialsError", "HF_TOKEN", "-o token=", "hf auth login")


def _no_client(monkeypatch):
    """Make building any client an error, so that an option check that comes too late fails the test."""
    import huggingface_hub

    import deltastore.backends.fsspec as fsspec_backend

    def built(*a, **k):
        raise AssertionError("a client was built before the options were checked")

    monkeypatch.setattr(fsspec_backend, "_make_filesystem", built)
    monkeypatch.setattr(huggingface_hub, "HfApi", built)


#: every built-in scheme, a misspelling of one of its options and the option meant
MISSPELT = [("file", "{tmp}/s", "fsinc", "fsync"), ("memory", "memory://x", "deadlin", "deadline"),
            ("s3", "s3://b/r", "endpoint", "endpoint_url"), ("s3a", "s3a://b/r", "endpoint", "endpoint_url"),
            ("gs", "gs://b/r", "endpoint", "endpoint_url"), ("gcs", "gcs://b/r", "project_id", "project"),
            ("hf", "hf://buckets/ns/b/r", "tokn", "token")]


@pytest.mark.parametrize("scheme,uri,typo,meant", MISSPELT, ids=[m[0] for m in MISSPELT])
def test_a_misspelt_option_names_the_closest_and_the_valid_ones(scheme, uri, typo, meant, tmp_path, monkeypatch, cli):
    from deltastore.registry import backends

    backends.get(scheme)  # the plugin loads here (else its install hint is the answer)
    _no_client(monkeypatch)
    uri = uri.format(tmp=tmp_path)
    with pytest.raises(UnknownOptionError) as e:
        ds.open_store(uri, **{typo: "x"})
    assert isinstance(e.value, ValueError)
    assert e.value.option == typo and e.value.suggestion == meant and meant in e.value.valid
    assert {"retry", "deadline"} <= set(e.value.valid)
    msg = str(e.value)
    assert f"unknown storage option {typo!r}" in msg and f"did you mean {meant!r}?" in msg
    assert ", ".join(e.value.valid) in msg
    r = cli("ls", uri, "-o", f"{typo}=x")
    r.one_line_error(2, f"'{typo}'", f"did you mean '{meant}'", "Valid:")
    assert not os.path.exists(tmp_path / "s")  # nothing created


def test_every_registered_scheme_checks_its_options(monkeypatch):
    from deltastore.registry import backends

    _no_client(monkeypatch)
    checked = []
    for name in backends.names():
        if backends.missing(name) is not None:
            continue
        uri = {"file": "/nonexistent/ds-store", "hf": "hf://buckets/ns/b/r"}.get(name, f"{name}://b/r")
        with pytest.raises(UnknownOptionError, match="unknown storage option 'no_such_option'.*valid: "):
            ds.open_store(uri, no_such_option=1)
        checked.append(name)
    assert {"file", "memory", "s3", "s3a", "gs", "gcs", "hf"} <= set(checked)


# -- mirror_device; Ctrl-C -------------------------------------------------------------------------------
def test_a_missing_mirror_device_is_a_typed_error_before_the_store_is_touched(tmp_path):
    import torch

    devices = ["cuda:99", "cuda0", "nonsense"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in devices:
        uri = tmp_path / f"s-{device.replace(':', '-')}"
        with pytest.raises(DeviceUnavailableError, match="mirror_device") as e:
            ds.Publisher(str(uri), mirror_device=device)
        assert isinstance(e.value, ValueError) and repr(device) in str(e.value)
        assert not uri.exists()


def _interrupt_at_import(module: str, *argv: str) -> subprocess.CompletedProcess:
    """Run the CLI (``python -m deltastore argv``) with a SIGINT delivered the moment ``module`` starts
    being imported: a Ctrl-C at that exact point, without timing luck."""
    code = f"""
import os, runpy, signal, sys

class Trip:  # the first finder asked for every import: SIGINT when {module} is looked up
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Trip())
sys.argv = ["deltastore", *{list(argv)!r}]
runpy.run_module("deltastore", run_name="__main__", alter_sys=True)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)


@pytest.mark.parametrize("module", ["deltastore.cli._common", "deltastore.cli.browse"])
def test_ctrl_c_while_the_cli_is_imported_is_130_and_one_line(module, store):
    uri, _ = store
    done = _interrupt_at_import(module, "ls", uri)
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines() == ["deltastore: interrupted"], done.stderr


def test_ctrl_c_while_torch_is_imported_leaves_the_old_folder(store, tmp_path):
    uri, _ = store
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the old checkpoint")
    done = _interrupt_at_import("torch", "pull", uri, str(out))
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines() == ["deltastore: interrupted"], done.stderr
    assert os.listdir(out) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"the old checkpoint"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "s"]  # the store and the old folder; no temporary folder


def test_ctrl_c_during_the_gc_wait_is_130_one_line_and_deletes_no_object(store, tmp_path):
    """A real SIGINT while ``gc`` waits out its grace period (shown as a bar on a terminal)."""
    uri, _ = store
    objects = _files(os.path.join(uri, "objects"))
    master, slave = _terminal()
    proc = subprocess.Popen([sys.executable, "-m", "deltastore", "gc", uri, "--keep-last", "1", "--keep-anchors",
                             "1", "--grace", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                            env=_env())
    os.close(slave)
    term = b""
    deadline = time.monotonic() + 60
    while b"gc grace period" not in term and time.monotonic() < deadline:
        if select.select([master], [], [], 0.1)[0]:
            term += os.read(master, 4096)
    assert b"gc grace period" in term, term
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    out, _ = proc.communicate(timeout=30)
    took = time.monotonic() - start
    while select.select([master], [], [], 0.1)[0]:
        try:
            term += os.read(master, 4096)
        except OSError:
            break
    os.close(master)
    assert proc.returncode == 130 and took < 25, took  # bounded; a loaded 2-core machine can be slow to deliver it
    text = term.decode(errors="replace")
    assert text.rstrip().splitlines()[-1].split("\r")[-1].strip() == "deltastore: interrupted", text
    assert "Traceback" not in text and out == b""
    assert _files(os.path.join(uri, "objects")) == objects  # the objects outlive an interrupted wait


def test_ctrl_c_the_moment_the_gc_bar_is_drawn_wipes_it(store, monkeypatch):
    """The race the real-signal test above loses now and then: SIGINT lands after the bar is drawn but before
    its constructor returns, so no ``finally`` of ours holds it. The one line must still start a clean line."""
    import tqdm

    uri, _ = store
    drawn = tqdm.tqdm.__init__

    def drawn_then_interrupted(self, *args, **kwargs):
        drawn(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(tqdm.tqdm, "__init__", drawn_then_interrupted)
    rc, text = _both_on_a_pty(["gc", uri, "--keep-last", "1", "--keep-anchors", "1", "--grace", "60"], monkeypatch)
    assert rc == 130 and "gc grace period" in text, text
    assert [line for line in _screen(text) if line] == ["deltastore: interrupted"], text


# -- progress bars: closed before the result line; rates that read -----------------------------------------
def _screen(raw: str) -> list[str]:
    """What a terminal shows for ``raw`` (carriage returns overwrite, ESC sequences dropped): its lines."""
    raw = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw)
    lines, row, col = [], [], 0
    for ch in raw:
        if ch == "\n":
            lines.append("".join(row).rstrip())
            row, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            if col < len(row):
                row[col] = ch
            else:
                row.append(ch)
            col += 1
    lines.append("".join(row).rstrip())
    return lines


def _both_on_a_pty(argv: list, monkeypatch) -> tuple[int, str]:
    """Run the CLI with stdout and stderr on one pseudo-terminal (as in a shell); the status and what it got."""
    import io

    from deltastore.cli import main

    master, slave = _terminal()
    term = io.TextIOWrapper(io.FileIO(slave, "w", closefd=True), write_through=True)
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", term)
    chunks = []
    try:
        rc = main([str(a) for a in argv])
        term.flush()
        while select.select([master], [], [], 0.1)[0]:
            chunks.append(os.read(master, 65536))
    finally:
        monkeypatch.undo()
        term.close()
        os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


def test_pull_bar_is_closed_before_the_result_line(store, tmp_path, monkeypatch):
    """stdout and stderr on one terminal: the result line stands alone (the bar was wiped before it)."""
    uri, _ = store
    monkeypatch.delenv("DELTASTORE_NO_PROGRESS", raising=False)
    rc, term = _both_on_a_pty(["pull", uri, tmp_path / "o"], monkeypatch)
    assert rc == 0 and "%|" in term  # a bar was drawn
    shown = [line for line in _screen(term) if line.strip()]
    assert shown == [f"wrote version 5 to {tmp_path / 'o'}: model.safetensors"], shown  # and wiped before it


def test_bar_rates_read_in_their_units(store, monkeypatch):
    uri, _ = store
    monkeypatch.delenv("DELTASTORE_NO_PROGRESS", raising=False)
    import deltastore.store

    monkeypatch.setattr(deltastore.store, "REFRESH_WINDOW", 0.0)  # so that a grace of 1.5 s is allowed
    rc, term = _on_a_pty(["gc", uri, "--keep-last", "1", "--keep-anchors", "1", "--grace", "1.5"], monkeypatch)
    assert rc == 0 and "gc grace period" in term
    assert "s/ s" not in term and "s/s" not in term and re.search(r"\| \d+/2 s", term), term
    rc, term = _on_a_pty(["ls", uri], monkeypatch)
    assert rc == 0 and "manifests:" in term and "s/ manifests" not in term
    assert re.search(r"(\d+\.\d+|\?) manifests/s", term), term


# -- stats, inspect, --json dates ------------------------------------------------------------------------------
def test_stats_headline_is_over_delta_versions_with_anchors_apart(store, cli):
    import statistics

    uri, _ = store  # anchors at 0 (no parent: 100 % changed) and 3 (with a delta from 2)
    doc = json.loads(cli("stats", uri, "--json").out)
    rows, totals = doc["versions"], doc["totals"]
    deltas = [r for r in rows if r["step"] != 0]
    assert [r["by_delta"] for r in rows] == [False] + [True] * 5
    assert totals["by_delta"]["median_changed_fraction"] == statistics.median(r["changed_fraction"] for r in deltas)
    assert totals["by_delta"]["median_changed_fraction"] < 0.2  # the 100 % first anchor is not averaged in
    assert totals["by_delta"]["median_follower_bytes"] == statistics.median(r["follower_bytes"] for r in deltas)
    assert totals["anchor_versions"]["steps"] == [0, 3] and totals["anchor_versions"]["without_parent"] == [0]
    out = cli("stats", uri).out
    pct = 100 * totals["by_delta"]["median_changed_fraction"]
    assert f"over the 5 versions a follower reaches by a delta: changed median {pct:.4g} %" in out
    assert "anchors at 0, 3: stored median" in out and "downloaded whole: 0" in out
    assert "mean changed" not in out


def test_stats_plot_has_log_axes_units_and_the_full_checkpoint(store, tmp_path, cli):
    require_module("matplotlib")
    import matplotlib.pyplot as plt

    from deltastore.cli.stats import figure

    uri, _ = store
    rows = json.loads(cli("stats", uri, "--json").out)["versions"]
    fig = figure(rows, title=uri)
    try:
        top, bottom = fig.axes
        fig.canvas.draw()
        assert top.get_yscale() == "log" and bottom.get_yscale() == "log"
        labels = [t.get_text() for t in top.get_yticklabels()]
        assert any(label.endswith(("KiB", "MiB")) for label in labels), labels
        assert any(line.get_label().startswith("full checkpoint") for line in top.get_lines())
        full = [line for line in top.get_lines() if line.get_label().startswith("full checkpoint")][0]
        assert full.get_ydata()[0] == rows[-1]["model_bytes"]
        percent = [t.get_text() for t in bottom.get_yticklabels()]
        assert all(p.endswith(" %") for p in percent if p) and "100 %" in percent, percent
        low, high = bottom.get_ylim()
        smallest = min(100 * r["changed_fraction"] for r in rows)
        assert low <= smallest and high / low >= 10  # the small fractions are on the axis, not flattened
    finally:
        plt.close(fig)
    assert cli("stats", uri, "--plot", tmp_path / "p.png").rc == 0


def test_inspect_prints_json_values_and_json_dates_are_iso(store, cli):
    uri, _ = store
    r = cli("inspect", uri, "4")
    assert r.rc == 0 and "producer {\"" in r.out and "{'" not in r.out and "metadata: {\"run\": \"cli\"}" in r.out
    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
    doc = json.loads(cli("inspect", uri, "4", "--json").out)
    assert iso.match(doc["created"]) and isinstance(doc["created_unix"], float)
    assert doc["step"] == 4 and doc["manifest_digest"].startswith("sha256:")
    versions = json.loads(cli("ls", uri, "--json").out)["versions"]
    assert all(iso.match(v["created"]) and isinstance(v["created_unix"], float) for v in versions)
