"""``deltastore stats``: per version what was stored and what a follower downloads; an optional plot."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import MissingDependencyError
from ._common import CliError, add_json_argument, add_store_arguments, emit_json, human_bytes, open_existing
from .browse import manifests


if TYPE_CHECKING:
    from ..manifest import Manifest


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("stats", parents=parents, help="bytes and changed fraction per version",
                       description="Per version: kind, changed fraction, bytes stored, bytes a follower holding "
                                   "the parent downloads, anchor (A) and differential (D) marks; totals. With "
                                   "--plot, a PNG of bytes and changed fraction per step (needs matplotlib: "
                                   "pip install 'deltastore[plot]').")
    add_store_arguments(s)
    s.add_argument("--plot", metavar="FILE.png", help="write a plot of bytes and changed fraction per step")
    add_json_argument(s)
    s.set_defaults(func=cmd_stats)


def version_stats(m: Manifest) -> dict[str, Any]:
    """One version's figures (what ``stats --json`` prints per version).

    ``follower_bytes``: what a follower at the parent downloads (the delta
    objects; an anchor without a parent: its full objects).
    """
    from ..tensor_spec import DTYPE_SIZES

    follower = m.object_bytes(m.delta_objects) if m.has_delta else m.object_bytes(m.full_objects)
    return {"step": m.step, "kind": m.kind, "changed": m.changed, "total": m.total,
            "changed_fraction": m.changed / m.total if m.total else 0.0,
            "stored_bytes": m.object_bytes(), "follower_bytes": follower,
            "model_bytes": sum(t.numel * DTYPE_SIZES[t.dtype] for t in m.tensors),
            "anchor": m.kind == "anchor", "differential": m.differential is not None}


def cmd_stats(args: argparse.Namespace) -> int:
    from ..manifest import Manifest

    if args.plot is not None:
        _pyplot()  # fail before any work when matplotlib is missing
    with open_existing(args) as store:
        rows, unreadable = [], []
        for step, m in manifests(store, store.versions(), args):
            if isinstance(m, Manifest):
                rows.append(version_stats(m))
            else:
                unreadable.append({"step": step, "error": f"{type(m).__name__}: {m}"})
    totals = {"versions": len(rows), "anchors": sum(r["anchor"] for r in rows),
              "differentials": sum(r["differential"] for r in rows),
              "stored_bytes": sum(r["stored_bytes"] for r in rows),
              "follower_bytes": sum(r["follower_bytes"] for r in rows),
              "mean_changed_fraction": sum(r["changed_fraction"] for r in rows) / len(rows) if rows else 0.0}
    if args.plot is not None:
        if not rows:
            raise CliError(f"{args.uri}: no versions to plot")
        plot(rows, args.plot, title=args.uri)
    if args.json:
        emit_json({"uri": args.uri, "versions": rows, "unreadable": unreadable, "totals": totals})
        return 0
    print(f"{'step':>12} {'kind':>6} {'changed %':>10} {'stored':>12} {'follower':>12} {'vs full':>8}  marks")
    for r in rows:
        marks = ("A" if r["anchor"] else "") + ("D" if r["differential"] else "")
        print(f"{r['step']:>12} {r['kind']:>6} {100 * r['changed_fraction']:>10.4f} {human_bytes(r['stored_bytes']):>12}"
              f" {human_bytes(r['follower_bytes']):>12} {r['follower_bytes'] / max(r['model_bytes'], 1):>8.2%}  {marks}")
    for u in unreadable:
        print(f"{u['step']:>12} {'?':>6}  unreadable manifest: {u['error']}")
    print(f"{totals['versions']} versions ({totals['anchors']} anchors, {totals['differentials']} with a "
          f"differential); stored {human_bytes(totals['stored_bytes'])}, a follower of every version downloads "
          f"{human_bytes(totals['follower_bytes'])}; mean changed {100 * totals['mean_changed_fraction']:.4f} %")
    if args.plot is not None:
        print(f"plot: {args.plot}")
    return 0


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingDependencyError(f"stats --plot needs matplotlib ({e}); install it with: "
                                     "pip install 'deltastore[plot]'") from e
    return plt


def plot(rows: list[dict[str, Any]], path: str, *, title: str = "") -> None:
    """Bytes (stored, follower) and changed fraction per step, anchors marked; written as PNG to ``path``."""
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), constrained_layout=True)
    top.plot(steps, [r["stored_bytes"] for r in rows], label="stored", marker=".")
    top.plot(steps, [r["follower_bytes"] for r in rows], label="follower download", marker=".")
    top.set_yscale("log")
    top.set_ylabel("bytes")
    bottom.plot(steps, [100 * r["changed_fraction"] for r in rows], color="tab:green", marker=".")
    bottom.set_ylabel("changed elements (%)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        for r in rows:
            if r["anchor"]:
                ax.axvline(r["step"], color="grey", alpha=0.3, linewidth=1)
        ax.grid(alpha=0.3)
    top.plot([], [], color="grey", alpha=0.5, label="anchor")
    top.legend(loc="best")
    if title:
        top.set_title(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
