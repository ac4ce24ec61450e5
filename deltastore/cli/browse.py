"""``deltastore ls`` and ``deltastore inspect``: versions and one manifest."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import DeltaStoreError
from ._common import (CliError, add_json_argument, add_store_arguments, dated, emit_json, format_time,
                      non_negative_int, open_existing, tracked)

if TYPE_CHECKING:
    from ..manifest import Manifest
    from ..store import DeltaStore

#: manifests fetched at once by ``ls`` and ``stats`` (each is one small GET)
FETCH_WORKERS = 16


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("ls", parents=parents, help="list versions",
                       description="List the versions of a store: kind, changed and total elements, stored bytes.")
    add_store_arguments(s)
    add_json_argument(s)
    s.set_defaults(func=cmd_ls)
    s = sub.add_parser("inspect", parents=parents, help="show one version's manifest",
                       description="Show one version's manifest (default: the latest).")
    add_store_arguments(s)
    s.add_argument("step", nargs="?", type=non_negative_int, help="the version (default: the latest)")
    add_json_argument(s)
    s.set_defaults(func=cmd_inspect)


def manifests(store: DeltaStore, steps: list[int], args: argparse.Namespace
              ) -> Iterator[tuple[int, Manifest | DeltaStoreError]]:
    """``(step, manifest or the error reading it)`` for each step, in order, fetched concurrently."""

    def fetch(step: int) -> Manifest | DeltaStoreError:
        try:
            return store.manifest(step)
        except DeltaStoreError as e:
            return e

    with ThreadPoolExecutor(max_workers=FETCH_WORKERS) as pool:
        yield from tracked(args, zip(steps, pool.map(fetch, steps)), "manifests", len(steps), "manifests")


def row(m: Manifest) -> dict[str, Any]:
    """One version as ``ls --json`` prints it."""
    return {"step": m.step, "kind": m.kind, "changed": m.changed, "total": m.total, "bytes": m.object_bytes(),
            "differential": m.differential.step if m.differential is not None else None,
            "parent": m.parent.step if m.parent is not None else None, "created": m.created}


def cmd_ls(args: argparse.Namespace) -> int:
    from ..manifest import Manifest

    with open_existing(args) as store:
        steps = store.versions()
        rows = []
        for step, m in manifests(store, steps, args):
            rows.append(row(m) if isinstance(m, Manifest) else {"step": step, "error": f"{type(m).__name__}: {m}"})
    if args.json:
        emit_json({"uri": args.uri, "versions": [r if "error" in r else dated(r) for r in rows]})
        return 0
    if not rows:
        print(f"{args.uri}: no versions")
        return 0
    print(f"{'step':>12} {'kind':>6} {'changed':>12} {'total':>14} {'bytes':>14}  created")
    for r in rows:
        if "error" in r:
            print(f"{r['step']:>12} {'?':>6}  unreadable manifest: {r['error']}")
        else:
            print(f"{r['step']:>12} {r['kind']:>6} {r['changed']:>12,} {r['total']:>14,} {r['bytes']:>14,}  "
                  f"{format_time(r['created'])}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    with open_existing(args) as store:
        step = args.step if args.step is not None else store.latest()
        if step is None:
            raise CliError(f"{args.uri}: no versions")
        m, digest = store.manifest_with_digest(step)
    if args.json:  # the manifest's fields, its date as ISO 8601 (the epoch seconds beside it) and its digest
        emit_json({**dated(m.to_dict()), "manifest_digest": digest})
        return 0
    print(f"version {m.step} ({m.kind}), manifest {digest}, created {format_time(m.created)} UTC")
    print(f"parent: {_step_of(m.parent)}; differential from: {_step_of(m.differential)}; "
          f"format {m.format_version}; producer {_json(m.producer)}")
    print(f"metadata: {_json(m.metadata)}")
    for label, value in (("files", {name: rec.get("size") for name, rec in m.files.items()}),
                         ("aliases", m.aliases), ("quantization", m.quantization),
                         ("new tensors", list(m.new_tensors)), ("dropped tensors", list(m.dropped_tensors))):
        if value:
            print(f"{label}: {_json(value)}")
    print(f"changed {m.changed:,} of {m.total:,} elements ({100 * m.changed / max(m.total, 1):.4f} %)")
    for i, o in enumerate(m.objects):
        print(f"object {i}: {o.digest} {o.size:,} B codec {o.codec['id']} {o.codec.get('version')}")
    print(f"{'tensor':<60} {'dtype':>9} {'shape':>18} {'changed':>10}  {'delta':>6} {'full':>6} {'diff':>6} checksum")
    for t in m.tensors:
        roles = " ".join(f"{','.join(str(p.object) for p in parts) or '-':>6}" for parts in (t.delta, t.full, t.diff))
        print(f"{t.name:<60} {t.dtype:>9} {str(list(t.shape)):>18} {t.changed:>10,}  {roles} {t.checksum}")
    return 0


def _step_of(ref: Any) -> str:
    return str(ref.step) if ref is not None else "none"


def _json(value: Any) -> str:
    """``value`` as compact JSON (what ``--json`` would print), not a Python repr."""
    return json.dumps(value, sort_keys=True, default=str)
