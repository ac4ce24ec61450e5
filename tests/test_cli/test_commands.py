"""Each command on good input: output, exit status, ``--json`` documents."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid

from safetensors.torch import load_file

import deltastore as ds
from conftest import require_module
from deltastore.testing import bits_equal
from deltastore.backends.memory import MemoryBackend
from deltastore.registry import backends as backend_registry, codecs as codec_registry
from deltastore.store import STORE_MARKER, object_key

from .conftest import make_states, publish_all


def test_ls_text_and_json(store, cli):
    uri, _ = store
    r = cli("ls", uri)
    assert r.rc == 0 and r.err == ""
    assert r.out.count("anchor") == 2 and r.out.count("delta") == 4
    doc = json.loads(cli("ls", uri, "--json").out)
    assert [v["step"] for v in doc["versions"]] == list(range(6))
    assert [v["kind"] for v in doc["versions"]] == ["anchor", "delta", "delta", "anchor", "delta", "delta"]
    assert all(v["bytes"] > 0 and v["total"] == 32 * 16 + 16 for v in doc["versions"])


class _SlowMemory(MemoryBackend):
    """A memory store whose reads take 50 ms and record how many run at once."""

    lock = threading.Lock()
    running = 0
    most = 0

    @classmethod
    def from_uri(cls, uri, **options):
        return cls(uri.split("://", 1)[1])

    def _entry(self, key):  # what every read goes through (whole, ranged or bounded)
        if not key.startswith("versions/"):
            return super()._entry(key)
        with self.lock:
            type(self).running += 1
            type(self).most = max(self.most, self.running)
        try:
            time.sleep(0.05)
            return super()._entry(key)
        finally:
            with self.lock:
                type(self).running -= 1


def test_ls_fetches_manifests_concurrently(cli):
    name = uuid.uuid4().hex
    publish_all(f"memory://{name}", make_states(8))
    backend_registry.register("cli-slow", _SlowMemory)
    try:
        r = cli("ls", f"cli-slow://{name}", "--json")
    finally:
        backend_registry.unregister("cli-slow")
    assert r.rc == 0 and len(json.loads(r.out)["versions"]) == 8
    assert _SlowMemory.most > 1  # more than one manifest read at a time


def test_store_without_marker_is_still_a_store(store, cli):
    uri, _ = store
    os.remove(os.path.join(uri, STORE_MARKER))  # a store written before the marker: versions/ only
    assert cli("ls", uri).rc == 0


def test_inspect(store, cli):
    uri, _ = store
    r = cli("inspect", uri, "4")
    assert r.rc == 0 and "version 4 (delta)" in r.out and '"run": "cli"' in r.out
    assert json.loads(cli("inspect", uri, "--json").out)["step"] == 5
    cli("inspect", uri, "99").one_line_error(1, "VersionNotFoundError", "99")


def _corrupt_an_object_of(uri: str, step: int) -> None:
    m = ds.Subscriber(uri).manifest(step)
    path = os.path.join(uri, *object_key(m.objects[0].digest).split("/"))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_verify_passes_then_names_the_corruption(store, cli):
    uri, _ = store
    r = cli("verify", uri)
    assert r.rc == 0 and "6 versions, 6 replayed" in r.out
    doc = json.loads(cli("verify", uri, "--json").out)
    assert doc["ok"] and doc["replayed"] == list(range(6)) and doc["problems"] == []
    _corrupt_an_object_of(uri, 4)
    r = cli("verify", uri)
    assert r.rc == 1 and "FAIL version 4" in r.out and "sha256" in r.out
    r = cli("verify", uri, "--json")
    doc = json.loads(r.out)
    assert r.rc == 1 and not doc["ok"] and 4 in [p["step"] for p in doc["problems"]]


def test_pull_latest_a_step_and_the_materialize_alias(store, tmp_path, cli):
    uri, states = store
    out = tmp_path / "ckpt"
    r = cli("pull", uri, out)
    assert r.rc == 0 and "wrote version 5" in r.out
    assert bits_equal(load_file(out / "model.safetensors"), states[5])
    assert cli("pull", uri, out, "--step", "2").rc == 0  # replaces the folder
    assert bits_equal(load_file(out / "model.safetensors"), states[2])
    assert cli("materialize", uri, "4", out).rc == 0
    assert bits_equal(load_file(out / "model.safetensors"), states[4])
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "s"]  # no temporary folder left behind
    assert oct(os.stat(out).st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def test_failed_pull_keeps_the_folders_earlier_version(store, tmp_path, cli):
    uri, states = store
    out = tmp_path / "ckpt"
    assert cli("pull", uri, out, "--step", "1").rc == 0
    _corrupt_an_object_of(uri, 5)
    cli("pull", uri, out).one_line_error(1, "CorruptObjectError")
    assert bits_equal(load_file(out / "model.safetensors"), states[1])
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "s"]


def test_pull_refuses_to_replace_a_folder_that_is_not_a_checkpoint(store, tmp_path, cli):
    uri, _ = store
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    cli("pull", uri, precious).one_line_error(1, "refusing to replace")
    assert (precious / "notes.txt").read_text() == "keep me"


def test_gc_dry_run_then_collect(store, cli, monkeypatch):
    uri, _ = store
    doc = json.loads(cli("gc", uri, "--keep-last", "1", "--keep-anchors", "1", "--dry-run", "--json").out)
    assert doc["dry_run"] and doc["keep"] == [3, 4, 5] and doc["delete_versions"] == [0, 1, 2]
    assert ds.Subscriber(uri).versions() == list(range(6))
    cli("gc", uri, "--keep-last", "1", "--keep-anchors", "1", "--grace", "0").one_line_error(1, "too short")
    assert ds.Subscriber(uri).versions() == list(range(6))
    import deltastore.store

    monkeypatch.setattr(deltastore.store, "REFRESH_WINDOW", 0.0)  # publishers refreshing before every commit
    r = cli("gc", uri, "--keep-last", "1", "--keep-anchors", "1", "--grace", "0")
    assert r.rc == 0 and "deleted 3 versions" in r.out
    assert ds.Subscriber(uri).versions() == [3, 4, 5]


def test_stats_text_json_and_plot(store, tmp_path, cli):
    require_module("matplotlib")
    uri, _ = store
    r = cli("stats", uri)
    assert r.rc == 0 and "6 versions (2 anchors" in r.out
    doc = json.loads(cli("stats", uri, "--json").out)
    rows = doc["versions"]
    assert [x["anchor"] for x in rows] == [True, False, False, True, False, False]
    assert all(0 < x["changed_fraction"] <= 1 and x["follower_bytes"] <= x["stored_bytes"] for x in rows[1:])
    assert rows[3]["follower_bytes"] < rows[3]["stored_bytes"]  # a follower takes the anchor's delta only
    assert doc["totals"]["stored_bytes"] == sum(x["stored_bytes"] for x in rows)
    png = tmp_path / "stats.png"
    assert cli("stats", uri, "--plot", png).rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_plot_without_matplotlib_is_one_line(store, cli, monkeypatch, tmp_path):
    uri, _ = store
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    cli("stats", uri, "--plot", tmp_path / "x.png").one_line_error(1, "MissingDependencyError", "deltastore[plot]")


class _EntryPointCodec:  # never loaded: only listed
    pass


def test_plugins_lists_builtins_registrations_and_entry_points(cli, tmp_path, monkeypatch):
    dist = tmp_path / "fakeplug-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[deltastore.codecs]\nfake = fakeplug_missing:Codec\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    codec_registry.refresh()
    backend_registry.register("cli-test", _SlowMemory)
    try:
        r = cli("plugins")
        doc = json.loads(cli("plugins", "--json").out)
    finally:
        backend_registry.unregister("cli-test")
        codec_registry.unregister("fake")
        codec_registry.refresh()
    assert r.rc == 0 and "codecs:" in r.out and "backends:" in r.out and "anchor policies:" in r.out
    by_name = {kind: {x["name"]: x for x in rows} for kind, rows in doc.items()}
    assert by_name["codecs"]["ctx"]["origin"] == "built-in" and by_name["codecs"]["ctx"]["available"]
    assert by_name["anchor_policies"]["adaptive"]["origin"] == "built-in"
    assert by_name["backends"]["cli-test"]["origin"] == "registered"
    fake = by_name["codecs"]["fake"]
    assert fake["origin"] == "entry point deltastore.codecs (fakeplug)" and not fake["available"]
    assert fake["install_hint"] == "pip install fakeplug"


def test_verbose_logs_each_pull(store, tmp_path, cli):
    uri, _ = store
    r = cli("pull", uri, tmp_path / "o", "-v")
    assert r.rc == 0 and "INFO deltastore.subscriber: pulled version 5 (anchor)" in r.err
    r = cli("-q", "pull", uri, tmp_path / "o")
    assert r.rc == 0 and r.err == ""


def test_demo_runs_bit_exact(tmp_path, cli):
    r = cli("demo", "--steps", "2", "--store", tmp_path / "demo")
    assert r.rc == 0, r.err
    assert r.out.count("  yes\n") == 2 and "every step bit-exact: yes" in r.out
    assert ds.Subscriber(str(tmp_path / "demo")).versions() == [1, 2]
