"""Bad input: each one is one line on stderr, no traceback, the documented exit status."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from importlib import import_module

import pytest

from conftest import ROOT
from deltastore.cli import main

URI_COMMANDS = [("ls",), ("inspect",), ("verify",), ("stats",), ("gc", "--dry-run")]


@pytest.mark.parametrize("command", URI_COMMANDS + [("pull", "OUT")], ids=lambda c: c[0])
def test_a_uri_without_a_store_is_exit_3_naming_it(command, tmp_path, cli):
    missing = tmp_path / "nonexistent"
    argv = [command[0], missing, *[tmp_path / "out" if a == "OUT" else a for a in command[1:]]]
    cli(*argv).one_line_error(3, str(missing), "not a deltastore store")
    assert not missing.exists()  # looking did not create it
    other = tmp_path / "some-folder"
    other.mkdir()
    (other / "file.txt").write_text("x")
    argv[1] = other
    cli(*argv).one_line_error(3, str(other))


def test_materialize_on_a_wrong_uri(tmp_path, cli):
    cli("materialize", tmp_path / "nope", "1", tmp_path / "out").one_line_error(3, "nope")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needle", [
    (("gc", "{uri}", "--keep-last", "0"), "--keep-last: must be at least 1"),
    (("gc", "{uri}", "--keep-anchors", "-1"), "--keep-anchors"),
    (("gc", "{uri}", "--grace", "nan"), "--grace"),
    (("demo", "--steps", "0"), "--steps: must be at least 1"),
    (("inspect", "{uri}", "-3"), "inspect"),
    (("pull", "{uri}", "out", "--step", "x"), "--step: not an integer"),
    (("ls", "{uri}", "-o", "novalue"), "expected KEY=VALUE"),
    (("ls", "{uri}", "--storage-options", "{not json"), "--storage-options: not JSON"),
    (("ls", "{uri}", "--storage-options", "[1, 2]"), "must be a JSON object"),
    (("ls", "{uri}", "-o", "bogus=1"), "bogus"),  # the local backend takes no such option
    (("ls", "s3://"), "needs a bucket"),
    (("ls", "hf://datasets/o/x"), "not an HF bucket URI"),
    (("ls", "az://container/run"), "no backend serves this URI"),
    (("ls",), "required: uri"),
    (("frobnicate",), "invalid choice"),
    (("ls", "{uri}", "--no-such-flag"), "unrecognized arguments"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_usage_errors_are_exit_2(argv, needle, store, cli):
    uri, _ = store
    cli(*[a.replace("{uri}", uri) for a in argv]).one_line_error(2, needle)


def test_help_and_version(cli):
    r = cli("--version")
    assert r.rc == 0 and r.out.startswith("deltastore ")
    r = cli("ls", "--help")
    assert r.rc == 0 and "-o KEY=VALUE" in r.out and "--storage-options" in r.out and "--json" in r.out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the with block ends: connections are refused


def test_unreachable_endpoint_is_one_line(cli):
    port = _closed_port()
    r = cli("ls", "s3://bucket/run", "-o", f"endpoint_url=http://127.0.0.1:{port}", "-o", "key=k", "-o", "secret=s",
            "-o", "retry=1", "-o", "timeout=1", "-o", 'config_kwargs={"retries": {"max_attempts": 1}}')
    r.one_line_error(1, "BackendUnavailableError", "unreachable", f"127.0.0.1:{port}")


def test_a_manifest_with_an_extreme_created_time_does_not_break_ls(store, cli):
    uri, _ = store
    path = os.path.join(uri, "versions", f"{2:012d}.json")
    doc = json.loads(open(path).read())
    doc["created"] = 1e300
    open(path, "w").write(json.dumps(doc))
    r = cli("ls", uri)
    assert r.rc == 0 and r.err == "" and "Traceback" not in r.out
    line = [x for x in r.out.splitlines() if x.split()[:1] == ["2"]][0]
    assert "not a date" in line or "unreadable manifest" in line
    r = cli("ls", uri, "--json")
    assert r.rc == 0 and len(json.loads(r.out)["versions"]) == 6


def test_debug_prints_the_traceback(tmp_path, cli):
    r = cli("--debug", "inspect", tmp_path / "nope")
    assert r.rc == 3 and "Traceback" in r.err and r.err.strip().splitlines()[-1].startswith("deltastore: ")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), DELTASTORE_NO_PROGRESS="1")


def test_broken_pipe_is_quiet(store):
    """``python -m deltastore ls URI | head -0``: the reader is gone before the first write."""
    uri, _ = store
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "-m", "deltastore", "ls", uri], stdout=write, stderr=subprocess.PIPE,
                          text=True, env=_env(), timeout=120)
    os.close(write)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


def test_console_script_entry_point():
    """The ``deltastore`` script's target exists (``python -m deltastore`` runs in the broken-pipe test)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module, _, attr = project["scripts"]["deltastore"].partition(":")
    assert getattr(import_module(module), attr) is main


def test_demo_storage_options_need_a_store(cli):
    cli("demo", "--steps", "1", "-o", "anon=true").one_line_error(2, "need --store")
