"""``deltastore stats``: per version what was stored and what a follower downloads; a summary; an optional plot.

The summary's per-step figures are over the versions a follower reaches by a delta (it holds the parent and
downloads the changes); anchors are summarised apart, since a version stored whole would otherwise swamp
them (a 100 % anchor averaged with 2 % deltas reads as "10 % changed").
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING, Any

from ..errors import MissingDependencyError
from ._common import CliError, add_json_argument, add_store_arguments, emit_json, human_bytes, open_existing, \
    step_ranges
from .browse import manifests

if TYPE_CHECKING:
    from ..manifest import Manifest


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("stats", parents=parents, help="bytes and changed fraction per version",
                       description="Per version: kind, changed fraction, bytes stored, bytes a follower holding "
                                   "the parent downloads, anchor (A) and differential (D) marks; then a summary: "
                                   "the median changed fraction and download of the versions a follower reaches "
                                   "by a delta, the anchors apart. With --plot, a PNG of both per step (needs "
                                   "matplotlib: pip install 'deltastore[plot]').")
    add_store_arguments(s)
    s.add_argument("--plot", metavar="FILE.png", help="write a plot of bytes and changed fraction per step")
    add_json_argument(s)
    s.set_defaults(func=cmd_stats)


def version_stats(m: Manifest) -> dict[str, Any]:
    """One version's figures (what ``stats --json`` prints per version).

    ``by_delta``: a follower holding the parent reaches this version by its delta objects (and the whole new
    tensors), ``follower_bytes`` of them; otherwise (the first version, or one without a delta) it downloads
    the full objects. ``model_bytes``: the checkpoint's size (every tensor's elements).
    """
    from ..tensor_spec import DTYPE_SIZES

    by_delta = m.has_delta
    follower = m.object_bytes(m.step_objects) if by_delta else m.object_bytes(m.full_objects)
    return {"step": m.step, "kind": m.kind, "changed": m.changed, "total": m.total,
            "changed_fraction": m.changed / m.total if m.total else 0.0,
            "stored_bytes": m.object_bytes(), "follower_bytes": follower,
            "model_bytes": sum(t.numel * DTYPE_SIZES[t.dtype] for t in m.tensors),
            "anchor": m.kind == "anchor", "differential": m.differential is not None, "by_delta": by_delta}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The totals of ``stats --json``: counts and sums over every version, the medians (and ranges) of the
    versions reached by a delta, the anchors' stored sizes apart."""
    deltas = [r for r in rows if r["by_delta"]]
    anchors = [r for r in rows if r["anchor"]]
    fractions = [r["changed_fraction"] for r in deltas]
    return {
        "versions": len(rows), "anchors": len(anchors), "differentials": sum(r["differential"] for r in rows),
        "stored_bytes": sum(r["stored_bytes"] for r in rows),
        "follower_bytes": sum(r["follower_bytes"] for r in rows),
        "model_bytes": rows[-1]["model_bytes"] if rows else 0,
        "by_delta": {
            "versions": len(deltas),
            "median_changed_fraction": statistics.median(fractions) if deltas else None,
            "min_changed_fraction": min(fractions) if deltas else None,
            "max_changed_fraction": max(fractions) if deltas else None,
            "median_follower_bytes": statistics.median(r["follower_bytes"] for r in deltas) if deltas else None,
        },
        "anchor_versions": {
            "steps": [r["step"] for r in anchors],
            "median_stored_bytes": statistics.median(r["stored_bytes"] for r in anchors) if anchors else None,
            "without_parent": [r["step"] for r in rows if not r["by_delta"]],
        },
    }


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
    totals = summary(rows)
    if args.plot is not None:
        if not rows:
            raise CliError(f"{args.uri}: no versions to plot")
        plot(rows, args.plot, title=args.uri)
    if args.json:
        emit_json({"uri": args.uri, "versions": rows, "unreadable": unreadable, "totals": totals})
        return 0
    print(f"{'step':>12} {'kind':>6} {'changed %':>10} {'stored':>12} {'download':>12} {'vs full':>8}  marks")
    for r in rows:
        marks = ("A" if r["anchor"] else "") + ("D" if r["differential"] else "")
        print(f"{r['step']:>12} {r['kind']:>6} {100 * r['changed_fraction']:>10.4f} "
              f"{human_bytes(r['stored_bytes']):>12} {human_bytes(r['follower_bytes']):>12} "
              f"{r['follower_bytes'] / max(r['model_bytes'], 1):>8.2%}  {marks}")
    for u in unreadable:
        print(f"{u['step']:>12} {'?':>6}  unreadable manifest: {u['error']}")
    for line in summary_lines(totals):
        print(line)
    if args.plot is not None:
        print(f"plot: {args.plot}")
    return 0


def summary_lines(totals: dict[str, Any]) -> list[str]:
    """The text summary under the table."""
    full = totals["model_bytes"]
    d, a = totals["by_delta"], totals["anchor_versions"]
    lines = [f"{totals['versions']} versions ({totals['anchors']} anchors, {totals['differentials']} with a "
             f"differential); the full checkpoint is {human_bytes(full)}"]
    if d["versions"]:
        lines.append(f"per step, over the {d['versions']} versions a follower reaches by a delta: changed median "
                     f"{100 * d['median_changed_fraction']:.4g} % (range {100 * d['min_changed_fraction']:.4g}-"
                     f"{100 * d['max_changed_fraction']:.4g} %), download median "
                     f"{human_bytes(d['median_follower_bytes'])} ({d['median_follower_bytes'] / max(full, 1):.2%}"
                     " of the full checkpoint)")
    if a["steps"]:
        whole = (f"; downloaded whole: {step_ranges(a['without_parent'])} (no delta from a parent)"
                 if a["without_parent"] else "")
        steps = a["steps"]
        where = step_ranges(steps) if len(steps) <= 8 else f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}"
        lines.append(f"anchors at {where}: stored median {human_bytes(a['median_stored_bytes'])} "
                     f"each ({a['median_stored_bytes'] / max(full, 1):.2%} of the full checkpoint){whole}")
    lines.append(f"stored in all {human_bytes(totals['stored_bytes'])}; a follower of every version downloads "
                 f"{human_bytes(totals['follower_bytes'])}")
    return lines


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingDependencyError(f"stats --plot needs matplotlib ({e}); install it with: "
                                     "pip install 'deltastore[plot]'") from e
    return plt


def _log_limits(values: list[float], base: float) -> tuple[float, float]:
    """Limits of a log axis holding ``values`` whose ends are whole powers of ``base`` (so they carry ticks)."""
    import math

    low, high = min(values), max(values)
    return base ** math.floor(math.log(low, base)), base ** math.ceil(math.log(high * 1.2, base))


def plot(rows: list[dict[str, Any]], path: str, *, title: str = "") -> None:
    """:func:`figure` written as PNG to ``path``."""
    plt = _pyplot()
    fig = figure(rows, title=title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(rows: list[dict[str, Any]], *, title: str = "") -> Any:
    """A matplotlib figure of the versions ``rows`` (:func:`version_stats`): bytes per step (stored,
    downloaded by a follower, the full checkpoint as a dashed line) on a log axis in KiB/MiB, and the
    changed fraction per step on a log axis in %, anchors marked."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    steps = [r["step"] for r in rows]
    full = rows[-1]["model_bytes"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5), constrained_layout=True)
    top.axhline(full, color="black", linestyle="--", linewidth=1, label=f"full checkpoint ({human_bytes(full)})")
    top.plot(steps, [r["stored_bytes"] for r in rows], label="stored", marker=".")
    top.plot(steps, [r["follower_bytes"] for r in rows], label="downloaded by a follower", marker=".")
    top.set_yscale("log", base=2)
    top.set_ylim(*_log_limits([v for r in rows for v in (r["stored_bytes"], r["follower_bytes"]) if v > 0] + [full], 2))
    top.yaxis.set_major_locator(LogLocator(base=2, numticks=9))  # 16 KiB, 32 KiB, ... (fewer when the span is wide)
    top.yaxis.set_minor_locator(NullLocator())
    top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".0 ", " ")))
    top.set_ylabel("bytes per version")

    percent = [100 * r["changed_fraction"] if r["changed_fraction"] > 0 else float("nan") for r in rows]
    bottom.plot(steps, percent, color="tab:green", marker=".", label="changed elements")
    bottom.set_yscale("log")
    if any(p == p for p in percent):  # not all NaN
        low, high = _log_limits([p for p in percent if p == p], 10)
        bottom.set_ylim(low, min(high, 130))  # 100 % at most, with room for its marker
    bottom.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # ... 1 %, 2 %, 5 %, 10 % ...
    bottom.yaxis.set_minor_locator(NullLocator())
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} %"))
    bottom.set_ylabel("changed elements (% of the model)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        for r in rows:
            if r["anchor"]:
                ax.axvline(r["step"], color="grey", alpha=0.3, linewidth=1)
        ax.grid(alpha=0.3, which="major")
    top.plot([], [], color="grey", alpha=0.5, label="anchor")
    top.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=4, fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    return fig
