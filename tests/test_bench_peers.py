"""bench/peer_formats.py: each peer's reference round-trips bit-exactly on real trace steps of both traces and
sends the bytes its format says; bench/peers.py runs every sync and prints its tables.

Correctness only: no timing is asserted (speed lives in the benchmark itself).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TRACES, _trace_module

sys.path.insert(0, str(ROOT / "bench"))

import _trace  # noqa: E402
import peer_formats  # noqa: E402

DITHER = {"smollm2-135m": "dither-lr1e-5", "minilm-l6": "dither-lr5e-6"}


@pytest.fixture(scope="module", params=list(DITHER))
def dither(request):
    _trace_module()  # skips without the shared loader locally; fails under CI=true
    return _trace.load(DITHER[request.param], request.param)


def _advance(tr, step, state) -> int:
    changed = 0
    for name, (idx, new) in tr.changes(step).items():
        state[name].view(torch.int16).reshape(-1)[idx] = new
        changed += idx.numel()
    return changed


@pytest.mark.parametrize("peer", list(peer_formats.PEERS))
def test_reference_round_trips_bit_exactly(dither, peer):
    state = {k: v.clone() for k, v in dither.base.items()}
    target = {k: v.clone() for k, v in dither.base.items()}
    sync = peer_formats.PEERS[peer](dither.base, 2)  # 2 threads: the peers' worker pools run
    for step in (1, 2):  # AdamW's first update (the densest), then a typical step
        changed = _advance(dither, step, state)
        blob = sync.send(state)
        sync.receive(blob, target)
        assert all(torch.equal(target[k].view(torch.int16), state[k].view(torch.int16)) for k in state), (peer, step)
        per_changed = len(blob) / changed
        if peer in ("trl-raw", "vllm-patch"):  # int32 position + bf16 value, plus a header
            assert 6.0 <= per_changed < 6.1, per_changed
        elif peer == "trl-gap_delta":  # a 2-byte gap (4 where it does not fit) + bf16 value
            assert 4.0 <= per_changed < 4.5, per_changed
        else:  # compressed: under the 6 bytes of the plain pair
            assert 0.5 < per_changed < 6.0, (peer, per_changed)


def test_receiver_checks_catch_a_wrong_base(dither):
    """A receiver that does not hold the sender's previous version: the peers that check the result (grail's
    model hash, slime's and SkyRL's per-tensor xxh3) refuse, the others end up with wrong bits; none ends up
    equal to the sender (what bench/peers.py compares)."""
    state = {k: v.clone() for k, v in dither.base.items()}
    _advance(dither, 1, state)
    for peer, make in peer_formats.PEERS.items():
        sync = make(state, 1)
        after = {k: v.clone() for k, v in state.items()}
        _advance(dither, 2, after)
        blob = sync.send(after)
        stale = {k: v.clone() for k, v in dither.base.items()}  # one step behind
        try:
            sync.receive(blob, stale)
        except peer_formats.IntegrityError:
            assert peer in ("grail", "slime-xor", "slime-overwrite", "skyrl"), peer
            continue
        assert not all(torch.equal(stale[k].view(torch.int16), after[k].view(torch.int16)) for k in after), peer


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_peers_bench_prints_every_table(tmp_path):
    _trace_module()
    out = tmp_path / "peers.json"
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers.py"), "--steps", "2", "--threads", "1", "--json", str(out),
         "--workdir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "NOT BIT-EXACT" not in proc.stderr
    doc = json.loads(out.read_text())
    runs = {(r["trace"], r["run"]) for r in doc["raw"].values()}
    assert runs == {(t, r) for t in _trace.available() for r in _trace.runs(t)} >= {
        ("smollm2-135m", "cold-lr1e-6"), ("minilm-l6", "dither-lr5e-6")}
    head = proc.stdout.split("## Sync time per step at 1 Gbit/s")[1]
    for title, figs in doc["figures"].items():
        assert title in proc.stdout and title in head  # its tables, and its line in the summary
        assert set(figs) == {"ours-auto", "ours-ctx", *peer_formats.PEERS}
        for name, f in figs.items():
            assert f["exact_steps"] == f["steps"] == 2 and not f["failed"], (title, name)
            assert f"| {name} | 2/2" in proc.stdout
            for key in ("bytes_per_changed", "x_bound", "enc_cpu_1t", "enc_wall_1t", "dec_cpu_1t", "dec_wall_1t",
                        "sync_ms 100 Mbit/s", "sync_ms 1 Gbit/s", "sync_ms 10 Gbit/s"):
                s = f[key]
                assert all(_finite_positive(s[k]) for k in ("median", "min", "max")), (title, name, key, s)
                assert s["min"] <= s["median"] <= s["max"]
        # the slower the link, the longer the sync
        for f in figs.values():
            assert f["sync_ms 100 Mbit/s"]["median"] > f["sync_ms 10 Gbit/s"]["median"]
        # the fewest-bytes setting sends no more than the default, and both less than the plain int32 + bf16 pair
        assert figs["ours-ctx"]["bytes_per_changed"]["median"] <= figs["ours-auto"]["bytes_per_changed"]["median"]
        assert figs["ours-auto"]["bytes_per_changed"]["median"] < figs["trl-raw"]["bytes_per_changed"]["median"]


def test_peers_bench_at_a_size_replicates_without_handing_ours_duplicates(tmp_path):
    """``--size``: the trace replicated as bench/scale.py does. Plain clones would give our content-addressed
    store identical objects to skip (bytes per change near 1/replicas of the recorded size's)."""
    _trace_module()
    out = tmp_path / "peers.json"
    env = {**os.environ, "DELTASTORE_TRACES": str(TRACES), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers.py"), "--traces", "minilm-l6", "--runs", "cold", "--steps", "2",
         "--threads", "1", "--size", "0.04", "--syncs", "ours-auto", "vllm-patch", "--json", str(out),
         "--workdir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    (raw,) = doc["raw"].values()
    (f,) = doc["figures"].values()
    assert raw["model_bytes"] >= 3 * 9_000_000  # four replicas of the 9.1 MB trace
    assert f["ours-auto"]["exact_steps"] == f["vllm-patch"]["exact_steps"] == 2
    assert 1.2 < f["ours-auto"]["bytes_per_changed"]["median"] < 3.0  # as at the recorded size: no replica skipped
    assert 0.9 < f["ours-auto"]["x_bound"]["median"] < 2.0
