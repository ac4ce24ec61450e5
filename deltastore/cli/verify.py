"""``deltastore verify``: re-hash every object, walk and replay every chain."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import DeltaStoreError
from ._common import EXIT_FAILED, add_json_argument, add_store_arguments, advance, bar, emit_json, open_existing
from .keys import add_trust_arguments, latest_step, trust_of


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("verify", parents=parents, help="re-hash every object, walk and replay every chain",
                       description="Re-hash every object, check every parent link and replay every chain against "
                                   "the manifests' checksums. Exit 1 when a problem is found.")
    add_store_arguments(s)
    add_json_argument(s)
    add_trust_arguments(s)
    s.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..pull.verify import verify_store

    trust = trust_of(args)
    with open_existing(args) as store:
        store.trust = trust  # a version that fails the keys is a problem of that version
        if trust is not None:
            try:
                latest_step(args, store)
            except DeltaStoreError as e:
                latest_problem: str | None = f"{type(e).__name__}: {e}"
            else:
                latest_problem = None
        n = len(store.versions())
        with bar(args, "verify", 2 * n, unit="steps") as cb:  # each version: its objects, then its replay
            report = verify_store(store, progress=lambda msg: advance(cb))
    if trust is not None and latest_problem is not None:
        report.problems.append((None, f"refs/latest: {latest_problem}"))
    problems = [{"step": step, "message": msg} for step, msg in report.problems]
    notes = [{"step": step, "message": msg} for step, msg in report.notes]
    checked = "verified" if trust is not None else "not checked: no --trusted-key"
    signers = [{"step": step, "key_id": kid, "verified": trust is not None and kid is not None}
               for step, kid in report.signers.items()]
    if args.json:
        emit_json({"uri": args.uri, "ok": report.ok, "versions": report.versions, "replayed": report.replayed,
                   "objects": report.objects, "problems": problems, "notes": notes, "signers": signers})
    else:
        for first, last, kid in _runs(report.signers):
            which = f"version {first}" if first == last else f"versions {first}-{last}"
            print(f"{which}: unsigned" if kid is None else f"{which}: signed by key {kid} ({checked})")
        for n in notes:
            print(f"note version {n['step']}: {n['message']}")
        for p in problems:
            print(f"FAIL version {p['step']}: {p['message']}" if p["step"] is not None else f"FAIL: {p['message']}")
        print(f"{len(report.versions)} versions, {len(report.replayed)} replayed bit-exact against their checksums, "
              f"{report.objects} objects re-hashed, {len(report.problems)} problems")
    return 0 if report.ok else EXIT_FAILED


def _runs(signers: dict[int, str | None]) -> list[tuple[int, int, str | None]]:
    """``(first step, last step, key id)`` of each run of consecutive versions with one signer (None: unsigned)."""
    out: list[tuple[int, int, str | None]] = []
    for step, kid in signers.items():
        if out and out[-1][2] == kid:
            out[-1] = (out[-1][0], step, kid)
        else:
            out.append((step, step, kid))
    return out
