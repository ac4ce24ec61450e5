"""``deltastore verify``: re-hash every object, walk and replay every chain."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import EXIT_FAILED, add_json_argument, add_store_arguments, advance, bar, emit_json, open_existing


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("verify", parents=parents, help="re-hash every object, walk and replay every chain",
                       description="Re-hash every object, check every parent link and replay every chain against "
                                   "the manifests' checksums. Exit 1 when a problem is found.")
    add_store_arguments(s)
    add_json_argument(s)
    s.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..verify import verify_store

    with open_existing(args) as store:
        n = len(store.versions())
        with bar(args, "verify", 2 * n, unit="steps") as cb:  # each version: its objects, then its replay
            report = verify_store(store, progress=lambda msg: advance(cb))
    problems = [{"step": step, "message": msg} for step, msg in report.problems]
    notes = [{"step": step, "message": msg} for step, msg in report.notes]
    if args.json:
        emit_json({"uri": args.uri, "ok": report.ok, "versions": report.versions, "replayed": report.replayed,
                   "objects": report.objects, "problems": problems, "notes": notes})
    else:
        for n in notes:
            print(f"note version {n['step']}: {n['message']}")
        for p in problems:
            print(f"FAIL version {p['step']}: {p['message']}" if p["step"] is not None else f"FAIL: {p['message']}")
        print(f"{len(report.versions)} versions, {len(report.replayed)} replayed bit-exact against their checksums, "
              f"{report.objects} objects re-hashed, {len(report.problems)} problems")
    return 0 if report.ok else EXIT_FAILED
