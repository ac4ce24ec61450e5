"""``deltastore`` command line: ls, inspect, verify, materialize, gc, demo."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import datetime, timezone

from ._version import __version__
from .errors import DeltaStoreError
from .store import open_store


def _cmd_ls(args: argparse.Namespace) -> int:
    store = open_store(args.uri)
    steps = store.versions()
    if not steps:
        print(f"{args.uri}: no versions")
        return 0
    print(f"{'step':>12} {'kind':>6} {'changed':>12} {'total':>14} {'bytes':>14}  created")
    for step in steps:
        try:
            m = store.manifest(step)
        except DeltaStoreError as e:
            print(f"{step:>12} {'?':>6}  unreadable manifest: {e}")
            continue
        when = datetime.fromtimestamp(m.created, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{step:>12} {m.kind:>6} {m.changed:>12,} {m.total:>14,} {m.object_bytes():>14,}  {when}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    store = open_store(args.uri)
    step = args.step if args.step is not None else store.latest()
    if step is None:
        print(f"{args.uri}: no versions", file=sys.stderr)
        return 1
    m, digest = store.manifest_with_digest(step)
    if args.json:
        print(json.dumps(m.to_dict(), indent=2))
        return 0
    print(f"version {m.step} ({m.kind}), manifest {digest}")
    print(f"parent: {m.parent.step if m.parent else None}; format {m.format_version}; producer {m.producer}")
    print(f"metadata: {json.dumps(m.metadata)}")
    print(f"changed {m.changed:,} of {m.total:,} elements ({100 * m.changed / max(m.total, 1):.4f} %)")
    for i, o in enumerate(m.objects):
        print(f"object {i}: {o.digest} {o.size:,} B codec {o.codec['id']} {o.codec.get('version')}")
    print(f"{'tensor':<60} {'dtype':>9} {'shape':>18} {'changed':>10}  {'delta':>6} {'full':>6} {'diff':>6} checksum")
    for t in m.tensors:
        roles = " ".join(f"{','.join(str(p.object) for p in parts) or '-':>6}" for parts in (t.delta, t.full, t.diff))
        print(f"{t.name:<60} {t.dtype:>9} {str(list(t.shape)):>18} {t.changed:>10,}  {roles} {t.checksum}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_store

    report = verify_store(open_store(args.uri))
    for step, msg in report.problems:
        print(f"FAIL version {step}: {msg}" if step is not None else f"FAIL: {msg}")
    print(f"{len(report.versions)} versions, {len(report.replayed)} replayed bit-exact against their checksums, "
          f"{report.objects} objects re-hashed, {len(report.problems)} problems")
    return 0 if report.ok else 1


def _cmd_materialize(args: argparse.Namespace) -> int:
    from .materialize import materialize

    files = materialize(open_store(args.uri), args.step, args.out_dir)
    print(f"wrote version {args.step} to {args.out_dir}: {', '.join(files)}")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from .gc import Retention, collect_garbage

    plan = collect_garbage(open_store(args.uri), Retention(keep_last=args.keep_last, keep_anchors=args.keep_anchors),
                           dry_run=args.dry_run, grace=args.grace, orphans=args.orphans)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"kept {len(plan.keep)} versions; {verb} {len(plan.delete_versions)} versions and "
          f"{len(plan.delete_objects)} objects ({plan.reclaimed_bytes:,} B)")
    if plan.delete_versions:
        print("versions:", " ".join(map(str, plan.delete_versions)))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return 0 if run_demo(args.store, steps=args.steps) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltastore", description="Sparse, bit-exact weight sync through object stores.")
    p.add_argument("--version", action="version", version=f"deltastore {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("ls", help="list versions")
    s.add_argument("uri")
    s.set_defaults(func=_cmd_ls)
    s = sub.add_parser("inspect", help="show one version's manifest")
    s.add_argument("uri")
    s.add_argument("step", nargs="?", type=int)
    s.add_argument("--json", action="store_true", help="print the manifest as JSON")
    s.set_defaults(func=_cmd_inspect)
    s = sub.add_parser("verify", help="re-hash every object, walk and replay every chain")
    s.add_argument("uri")
    s.set_defaults(func=_cmd_verify)
    s = sub.add_parser("materialize", help="write one version as a safetensors checkpoint")
    s.add_argument("uri")
    s.add_argument("step", type=int)
    s.add_argument("out_dir")
    s.set_defaults(func=_cmd_materialize)
    s = sub.add_parser("gc", help="delete versions and objects outside the retention")
    s.add_argument("uri")
    s.add_argument("--keep-last", type=int, default=20, help="most recent versions to keep restorable")
    s.add_argument("--keep-anchors", type=int, default=2, help="most recent anchors to keep")
    s.add_argument("--grace", type=float, default=30.0, help="seconds between deleting manifests and objects")
    s.add_argument("--orphans", action="store_true",
                   help="also delete objects no manifest references (only while no publisher writes)")
    s.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    s.set_defaults(func=_cmd_gc)
    s = sub.add_parser("demo", help="train a small model, publish every step, keep a replica in sync")
    s.add_argument("--store", help="store to publish to (default: a temporary folder)")
    s.add_argument("--steps", type=int, default=30)
    s.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (1 on a deltastore error, printed without a traceback)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DeltaStoreError as e:
        print(f"deltastore: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
