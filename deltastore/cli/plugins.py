"""``deltastore plugins``: registered codecs, backends and anchor policies, and where each comes from."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import add_json_argument, emit_json


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("plugins", parents=parents, help="list codecs, backends and anchor policies",
                       description="List every registered codec, backend (URI scheme) and anchor policy: its "
                                   "class, where it comes from (built-in or an entry point) and whether it "
                                   "is installed here (with the install hint when it is not). Nothing is "
                                   "imported unless --load is given.")
    s.add_argument("--load", action="store_true",
                   help="import every plugin to check that it loads (slower: the codecs import torch)")
    add_json_argument(s)
    s.set_defaults(func=cmd_plugins)


def plugin_table(load: bool = False) -> dict[str, list[dict[str, Any]]]:
    """``{kind: [{name, target, origin, available, install_hint, error}]}`` for every registry.

    ``available``: the plugin's module and the packages it needs are installed (found, not imported:
    :meth:`Registry.missing`); with ``load`` each plugin is imported too, and one that fails to import
    is unavailable with its error.
    """
    from ..publish import anchors  # noqa: F401 - importing them registers the built-ins
    from .. import backends, codecs  # noqa: F401 - importing them registers the built-ins
    from ..errors import DeltaStoreError
    from ..registry import anchor_policies, backends as backend_registry, codecs as codec_registry

    out: dict[str, list[dict[str, Any]]] = {}
    for kind, registry in (("codecs", codec_registry), ("backends", backend_registry),
                           ("anchor_policies", anchor_policies)):
        rows = []
        for info in registry.describe():
            error = registry.missing(info.name)
            if error is None and load:
                try:
                    registry.get(info.name)
                except (DeltaStoreError, ImportError) as e:
                    error = str(e)
            rows.append({"name": info.name, "target": info.target, "origin": info.origin,
                         "available": error is None, "install_hint": info.install_hint, "error": error})
        out[kind] = rows
    return out


def cmd_plugins(args: argparse.Namespace) -> int:
    table = plugin_table(load=args.load)
    if args.json:
        emit_json(table)
        return 0
    for kind, rows in table.items():
        print(f"{kind.replace('_', ' ')}:")
        for r in rows:
            status = "" if r["available"] else f"  [not loadable: {r['install_hint'] or r['error']}]"
            print(f"  {r['name']:<12} {r['target']:<55} {r['origin']}{status}")
    return 0
