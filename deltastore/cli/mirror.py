"""``deltastore mirror SRC DST [--follow]``: a verified, version-aware copy of a store (a region-local relay)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import UsageError, add_json_argument, emit_json, human_bytes, non_negative_float, positive_int, \
    storage_option, storage_options_json


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("mirror", parents=parents, help="copy a store's versions, verified, to another store",
                       description="Copy every version of SRC into DST in commit order: each version's objects "
                                   "(checked against their sha256), then its manifest, then refs/latest and the "
                                   "index, so DST is always a store a follower can use. Resumes where a killed "
                                   "mirror stopped; copies nothing twice. SRC may be https:// (read through its "
                                   "index); DST must be writable (a folder, s3://, gs://, hf://).")
    s.add_argument("src", metavar="SRC", help="the store to copy: a path, s3://, gs://, hf://, https://...")
    s.add_argument("dst", metavar="DST", help="where to copy it (writable)")
    s.add_argument("--follow", action="store_true", help="keep copying new versions until interrupted")
    s.add_argument("--interval", type=non_negative_float, default=1.0,
                   help="seconds between rounds with --follow (default 1)")
    s.add_argument("--workers", type=positive_int, default=8, help="objects copied in parallel (default 8)")
    s.add_argument("--trusted-key", dest="trusted_keys", metavar="KEY", action="append", default=None,
                   help="a public key file (PEM or OpenSSH) or OpenSSH line; repeatable. Every version (and the "
                        "latest ref) copied must be signed by one of them (default: $DELTASTORE_TRUSTED_KEYS)")
    for side in ("src", "dst"):
        s.add_argument(f"--{side}-option", dest=f"{side}_options", metavar="KEY=VALUE", type=storage_option,
                       action="append", default=[], help=f"a storage option of {side.upper()} (repeatable)")
        s.add_argument(f"--{side}-storage-options", dest=f"{side}_json", metavar="JSON", type=storage_options_json,
                       default={}, help=f"storage options of {side.upper()} as one JSON object")
    add_json_argument(s)
    s.set_defaults(func=cmd_mirror)


def cmd_mirror(args: argparse.Namespace) -> int:
    from ..signing import keys_from_env
    from ..store_mirror import mirror_store

    if args.src == args.dst:
        raise UsageError("deltastore mirror: SRC and DST are the same store")

    def copied(step: int, objects: int, nbytes: int) -> None:
        if not args.json:
            print(f"version {step}: {objects} objects, {human_bytes(nbytes)} copied", flush=True)

    report = mirror_store(args.src, args.dst, follow=args.follow, poll_interval=args.interval,
                          trusted_keys=args.trusted_keys or keys_from_env(),
                          max_workers=args.workers, src_options={**args.src_json, **dict(args.src_options)},
                          dst_options={**args.dst_json, **dict(args.dst_options)}, on_version=copied)
    if args.json:
        emit_json({"src": args.src, "dst": args.dst, "copied": report.copied, "present": sorted(report.present),
                   "objects": report.objects, "object_bytes": report.object_bytes, "gone": report.gone})
    else:
        print(f"mirrored {args.src} -> {args.dst}: {len(report.copied)} versions copied "
              f"({report.objects} objects, {human_bytes(report.object_bytes)}), {len(report.present)} already there"
              + (f", {len(report.gone)} deleted at the source before they were copied" if report.gone else ""))
    return 0
