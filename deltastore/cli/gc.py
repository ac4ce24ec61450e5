"""``deltastore gc``: apply a retention (manifests first, a grace period, then objects).

Without a policy flag (``--keep-last``, ``--keep-anchors``) nothing is deleted: the command shows what the
default policy would delete and which flags apply it (a dry run, as restic's ``forget`` without a policy).
"""

from __future__ import annotations

import argparse
from typing import Any

from ._common import (add_json_argument, add_store_arguments, emit_json, human_bytes, non_negative_float,
                      open_existing, positive_int, sleeper, step_ranges)

#: the policy shown by a bare ``gc URI`` (and filled in for the flag not given with the other): the defaults of
#: :class:`deltastore.gc.Retention`, not imported here (--help stays light; a test keeps them equal)
DEFAULT_KEEP_LAST, DEFAULT_KEEP_ANCHORS = 20, 2


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("gc", parents=parents, help="delete versions and objects outside a retention policy",
                       description="Keep the last --keep-last versions and the last --keep-anchors anchors (with "
                                   "their chains); delete the other manifests, wait --grace seconds for readers, "
                                   "then delete the objects no manifest references. Without --keep-last or "
                                   "--keep-anchors nothing is deleted: it shows what the default policy "
                                   f"(--keep-last {DEFAULT_KEEP_LAST} --keep-anchors {DEFAULT_KEEP_ANCHORS}) "
                                   "would delete.")
    add_store_arguments(s)
    s.add_argument("--keep-last", type=positive_int,
                   help=f"most recent versions to keep restorable (default {DEFAULT_KEEP_LAST} when "
                        "--keep-anchors is given)")
    s.add_argument("--keep-anchors", type=positive_int,
                   help=f"most recent anchors to keep (default {DEFAULT_KEEP_ANCHORS} when --keep-last is given)")
    s.add_argument("--grace", type=non_negative_float, default=30.0,
                   help="seconds between deleting manifests and objects (shown as a bar on a terminal); more than "
                        "the store's refresh window plus its timestamp resolution (10 s on local disk, 11 s on S3)")
    s.add_argument("--orphans", action="store_true",
                   help="also delete objects no manifest references (only while no publisher writes)")
    s.add_argument("--dry-run", action="store_true", help="print what the policy would delete; delete nothing")
    add_json_argument(s)
    s.set_defaults(func=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    from ..gc import Retention, collect_garbage

    policy_given = args.keep_last is not None or args.keep_anchors is not None
    keep_last = args.keep_last if args.keep_last is not None else DEFAULT_KEEP_LAST
    keep_anchors = args.keep_anchors if args.keep_anchors is not None else DEFAULT_KEEP_ANCHORS
    dry_run = args.dry_run or not policy_given
    with open_existing(args) as store:
        plan = collect_garbage(store, Retention(keep_last=keep_last, keep_anchors=keep_anchors),
                               dry_run=dry_run, grace=args.grace, orphans=args.orphans,
                               sleep=sleeper(args, "gc grace period"))
    flags = f"--keep-last {keep_last} --keep-anchors {keep_anchors}"
    if args.json:
        emit_json({"uri": args.uri, "dry_run": dry_run,
                   "policy": {"keep_last": keep_last, "keep_anchors": keep_anchors, "given": policy_given},
                   "keep": plan.keep, "delete_versions": plan.delete_versions,
                   "delete_objects": plan.delete_objects, "reclaimed_bytes": plan.reclaimed_bytes})
        return 0
    keep_verb, delete_verb = ("would keep", "would delete") if dry_run else ("kept", "deleted")
    print(f"{keep_verb} {len(plan.keep)} versions{_listed(plan.keep)}")
    print(f"{delete_verb} {len(plan.delete_versions)} versions{_listed(plan.delete_versions)}; "
          f"{len(plan.delete_objects)} objects ({human_bytes(plan.reclaimed_bytes)})")
    if not policy_given:
        print(f"nothing deleted: no policy given (shown: the default, {flags}); "
              f"to delete, run again with {flags}")
    elif dry_run:
        print("nothing deleted (--dry-run); to delete, run again without --dry-run")
    return 0


def _listed(steps: list[int]) -> str:
    return f": {step_ranges(steps)}" if steps else ""
