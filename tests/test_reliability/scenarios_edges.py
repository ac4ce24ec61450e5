"""The families of issue 48 as rows of ``bench/faults.py``: each trial is one of the suite's own cases
(the same functions the tests run), counted into a :class:`Stats` row.

A trial passes when its case returns; an ``AssertionError`` is a broken promise (a *wrong version* when it
says the bits are wrong), a ``DeltaStoreError`` the case did not expect is a problem, anything else an
untyped exception. The families: false claims (``scenarios_claims``), GC grace below the minimum, user
S3 retry settings against the deadline, typed edges of publish and pull, and the LoRA follower over HTTP.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from deltastore.errors import DeltaStoreError

from . import scenarios_claims as C
from .scenarios import Stats, Where
from .scenarios_store import open_unreachable

Case = tuple[str, Callable[[], Any]]


def run_cases(scenario: str, backend: str, cases: Iterable[Case], *, timed: bool = False) -> Stats:
    """Run each ``(label, case)``; the label's part before ":" is noted per trial. A case counts one fault,
    or as many as the int it returns (the refusals it checked)."""
    import pytest

    stats = Stats(scenario, backend)
    t0 = time.monotonic()
    for label, case in cases:
        t = time.monotonic()
        try:
            got = case()
        except pytest.skip.Exception as e:
            stats.note(f"skipped: {e}")
            continue
        except AssertionError as e:
            text = str(e).splitlines()[0][:300] if str(e) else repr(e)
            if "wrong" in text:
                stats.wrong += 1
            stats.problem(label, text)
        except DeltaStoreError as e:
            stats.problem(label, f"unexpected typed error {e!r}")
        except Exception as e:  # noqa: BLE001 - counted
            stats.untyped_error(label, e)
        else:
            stats.faults += got if isinstance(got, int) else 1
            stats.note(label.split(":")[0])
        stats.trials += 1
        if timed:
            stats.recovery.append(time.monotonic() - t)
    stats.seconds = time.monotonic() - t0
    return stats


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="deltastore-edges-"))


# -- false claims -------------------------------------------------------------------------------------
def run_claims_store(where: Where, trials: int, seed: int = 0) -> Stats:
    """(a) rewritten-store joiners and (d) rival creates on ``where``; recovery: the whole case."""
    cases: list[Case] = []
    for i in range(trials):
        cases.append((f"rewritten-store joiner: seed {seed + i}", lambda i=i: C.run_rewritten_store_joiner(where, seed + i)))
        cases.append((f"rival create on retry: seed {seed + i}", lambda i=i: C.run_rival_create_is_not_ours(where, seed + i)))
    return run_cases("false claims: rewritten-store joiner, rival create", where.kind, cases, timed=True)


def run_claims_target(trials: int, seed: int = 0) -> Stats:
    """(b) a failed layout change restores a copied tensor, (c) a refused anchor restore leaves the version
    unknown (memory stores)."""
    cases: list[Case] = []
    for i in range(trials):
        cases.append((f"layout change restored: seed {seed + i}",
                      lambda i=i: C.run_layout_failure_restores_a_copied_tensor(seed + i)))
        cases.append((f"anchor restore refused, version unknown: seed {seed + i}",
                      lambda i=i: C.run_anchor_failure_marks_the_version_unknown(seed + i)))
    return run_cases("false claims: layout restore, version after a refused restore", "memory", cases, timed=True)


# -- GC grace -----------------------------------------------------------------------------------------
def run_gc_grace(where: Where) -> Stats:
    """Every entry point refuses a grace not longer than the store's minimum (3 values each)."""
    from . import test_gc_grace as G

    def collect() -> int:
        G.test_collect_garbage_refuses_a_short_grace(G.published_store(where))
        return len(G.BELOW)

    def publisher_and_delete() -> int:  # delete_unreferenced, and Publisher(gc_grace=) with and without retention
        G.test_delete_unreferenced_and_a_publisher_refuse_a_short_grace(G.published_store(where))
        return 3 * len(G.BELOW)

    cases: list[Case] = [("collect_garbage", collect),
                         ("delete_unreferenced and Publisher(gc_grace=)", publisher_and_delete)]
    if where.kind == "local":
        cases += [(f"deltastore gc --grace {v}", lambda v=v: _cli_gc_refused(v)) for v in ("0", "1", "10")]
    return run_cases("GC grace below the minimum (refusals)", where.kind, cases)


def _cli_gc_refused(value: str) -> None:
    import contextlib
    import io

    import deltastore as ds
    from deltastore.cli import main

    from . import test_gc_grace as G

    uri = str(_tmp() / "s")
    with ds.Publisher(uri, anchor_every=2) as pub:
        for k, s in enumerate(G._states(6)):
            pub.publish(s, step=k)
    store = ds.open_store(uri)
    stored = (store.versions(), sorted(store.list_objects()))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["gc", uri, "--keep-last", "2", "--keep-anchors", "1", "--grace", value])
    assert rc == 1 and err.getvalue().startswith(f"deltastore: GraceTooShortError: grace={float(value)} s"), err
    assert (store.versions(), sorted(store.list_objects())) == stored


# -- a user's S3 retry setting --------------------------------------------------------------------------
def run_user_retries(trials: int, deadline: float = 1.0) -> Stats:
    """``config_kwargs={"retries": ...}`` on an unreachable S3 endpoint: typed within the deadline (+5 s);
    recovery: the time to the typed error."""
    from test_backends.servers import free_port

    settings = [{"max_attempts": 10, "mode": "standard"}, {"total_max_attempts": 20, "mode": "adaptive"},
                {"max_attempts": 8, "mode": "legacy"}, {"mode": "standard"}]
    stats = Stats(f"user S3 retry settings (deadline {deadline:g} s)", "s3")
    t0 = time.monotonic()
    for i, retries in zip(range(trials), itertools.cycle(settings)):
        opts = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k", "secret": "s", "deadline": deadline,
                "config_kwargs": {"retries": dict(retries)}}
        open_unreachable(stats, i, "s3://bucket-x/run", opts, str(retries))
    stats.seconds = time.monotonic() - t0
    return stats


# -- typed edges of publish and pull ----------------------------------------------------------------------
def run_typed_edges() -> Stats:
    """Malformed items and meta tensors (4 ways in), FP8 non-finite blocks, read-only mappings (child
    processes), a full tmpfs under materialize / pull, dropped background versions, exit without close()."""
    import test_background_exit as B
    import test_typed_edges as T

    cases: list[Case] = []
    for case, mode in T.MALFORMED_CASES:
        cases.append((f"malformed item / meta tensor: {case}, {mode}",
                      lambda c=case, m=mode: T.test_a_malformed_item_or_a_meta_tensor_is_a_typed_error(_tmp(), c, m)))
    for bad, background in itertools.product(["nan", "inf", "-inf"], [False, True]):
        cases.append((f"fp8 non-finite block: {bad}, background={background}",
                      lambda b=bad, bg=background: T.test_fp8_refuses_a_non_finite_weight_naming_the_tensor_and_block(
                          _tmp(), b, bg)))
    for kind in ("numpy-memmap", "mmap-prot-read"):
        cases.append((f"read-only mapping: {kind}",
                      lambda k=kind: T.test_pulling_into_a_read_only_mapping_is_refused_before_writing(_tmp(), k)))
    cases.append(("full disk under materialize and pull",
                  lambda: T.test_a_full_disk_while_writing_a_folder_is_typed_and_keeps_the_old_one(_tmp())))
    cases.append(("background versions dropped behind a failure",
                  lambda: B.test_versions_dropped_behind_a_failure_raise_a_typed_error_chaining_it(_tmp())))
    for gated in (True, False):
        cases.append((f"exit without close(): gated={gated}",
                      lambda g=gated: B.test_a_script_that_exits_without_close_commits_its_queued_versions_and_warns(
                          _tmp(), g)))
    return run_cases("typed edges (items, meta, FP8, read-only, full disk, background)", "local", cases)


# -- the LoRA follower over HTTP ---------------------------------------------------------------------------
def run_lora_http() -> Stats:
    """The follower against an HTTP server with vLLM's LoRA rules, failing on purpose (needs PEFT)."""
    import test_lora_http as L
    from vllm_lora_standin import LoraServer

    uri = L.adapter_store_at(str(_tmp() / "store"))

    def with_server(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        def run() -> None:
            server = LoraServer()
            try:
                fn(uri, server, _tmp() / "work", *args)
            finally:
                server.close()
        return run

    cases: list[Case] = [
        ("alias re-load fails (500), in-place vLLM", with_server(L.test_a_failed_alias_reload_keeps_serving_the_previous_version, True)),
        ("alias re-load fails (500), vLLM without in-place loads", with_server(L.test_a_failed_alias_reload_keeps_serving_the_previous_version, False)),
        ("server down", with_server(L.test_an_unreachable_server_is_a_typed_error)),
        ("server slow (timeout)", with_server(L.test_a_slow_server_times_out_typed_and_what_it_loaded_is_unloaded)),
        ("unload fails after a failed load", with_server(L.test_an_unload_that_fails_after_a_failed_load_is_done_at_the_next_load)),
        ("load refused (400)", with_server(L.test_a_refused_load_unloads_nothing_and_names_the_status)),
    ]
    return run_cases("LoRA follower over HTTP (vLLM-rules server)", "http", cases, timed=True)


__all__ = ["run_cases", "run_claims_store", "run_claims_target", "run_gc_grace", "run_user_retries",
           "run_typed_edges", "run_lora_http"]
