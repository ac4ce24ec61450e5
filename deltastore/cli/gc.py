"""``deltastore gc``: apply a retention (manifests first, a grace period, then objects)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import add_json_argument, add_store_arguments, emit_json, non_negative_float, open_existing, \
    positive_int, sleeper


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("gc", parents=parents, help="delete versions and objects outside the retention",
                       description="Keep the last --keep-last versions and the last --keep-anchors anchors (with "
                                   "their chains); delete the other manifests, wait --grace seconds for readers, "
                                   "then delete the objects no manifest references.")
    add_store_arguments(s)
    s.add_argument("--keep-last", type=positive_int, default=20, help="most recent versions to keep restorable")
    s.add_argument("--keep-anchors", type=positive_int, default=2, help="most recent anchors to keep")
    s.add_argument("--grace", type=non_negative_float, default=30.0,
                   help="seconds between deleting manifests and objects (shown as a bar on a terminal)")
    s.add_argument("--orphans", action="store_true",
                   help="also delete objects no manifest references (only while no publisher writes)")
    s.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    add_json_argument(s)
    s.set_defaults(func=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    from ..gc import Retention, collect_garbage

    with open_existing(args) as store:
        plan = collect_garbage(store, Retention(keep_last=args.keep_last, keep_anchors=args.keep_anchors),
                               dry_run=args.dry_run, grace=args.grace, orphans=args.orphans,
                               sleep=sleeper(args, "gc grace period"))
    if args.json:
        emit_json({"uri": args.uri, "dry_run": args.dry_run, "keep": plan.keep,
                   "delete_versions": plan.delete_versions, "delete_objects": plan.delete_objects,
                   "reclaimed_bytes": plan.reclaimed_bytes})
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"kept {len(plan.keep)} versions; {verb} {len(plan.delete_versions)} versions and "
          f"{len(plan.delete_objects)} objects ({plan.reclaimed_bytes:,} B)")
    if plan.delete_versions:
        print("versions:", " ".join(map(str, plan.delete_versions)))
    return 0
