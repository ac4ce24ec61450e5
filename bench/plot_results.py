"""The two plots of docs/benchmarks.md, drawn from the figures its tables report.

    .venv/bin/python bench/plot_results.py [--out docs/img]

Writes ``bytes-per-step.png`` (bytes per changed element of each format, both traces, from
``bench/codecs.py`` and ``bench/reference_encoders.py``) and ``time-ratios.png`` (each timed figure
of ``bench/scale.py`` as its ratio to the reference timed in the same run: one dot per run, the
target as a bar). The figures are copied here from the runs the page records, with the commit they
were measured at; after a new run, update them here and on the page together, then rerun this.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# bench/codecs.py at 175ce05 (bytes are deterministic): bytes per changed element over every step of each run.
# The full checkpoint's figure is its bf16 bytes per changed element (2 B / density).
TRACES = ("cold-lr1e-6: 0.17 % changed per step", "dither-lr1e-5: 2.54 % changed per step")
BYTES = [  # (format, cold, dither, kind)
    ("full bf16 checkpoint", 1163.0, 78.73, "full"),
    ("TRL: int32 index + bf16 value", 6.212, 6.017, "peer"),
    ("TRL: uint16 gaps + bf16 value", 4.209, 4.017, "peer"),
    ("PULSE / grail sparse patch", 3.752, 3.169, "peer"),
    ("deltastore default (auto at 1 Gbit/s)", 1.887, 1.185, "ours"),
    ("deltastore, auto link_mbps=None", 0.721, 0.793, "ours"),
]
BOUND = (1.576, 1.061)  # independent-position entropy bound, from the same run

# bench/scale.py, 1 GB (16,384-tensor rows: ~200 MB), at ba30d4b: two runs on each trace.
RUNS = ("SmolLM2", "SmolLM2", "MiniLM", "MiniLM")
COMMIT = "ba30d4b"
TIMES = [  # (figure, reference, target, ratio per run)
    ("publish(), sync, cold", "compare", 2.0, (0.205, 0.201, 0.284, 0.313)),
    ("publish(), sync, dither", "compare", 2.0, (0.659, 0.677, 0.719, 0.736)),
    ("publish() blocks, background, cold", "compare", 1.1, (0.127, 0.108, 0.144, 0.112)),
    ("publish() blocks, background, dither", "compare", 1.1, (0.393, 0.372, 0.130, 0.216)),
    ("pull() one delta, cold", "copy", 0.3, (0.250, 0.279, 0.368, 0.386)),
    ("pull() one delta, dither", "copy", 1.0, (0.936, 0.964, 0.884, 0.741)),
    ("16,384 tensors: delta publish", "compare", 3.0, (1.544, 4.077, 1.565, 1.562)),
    ("16,384 tensors: anchor publish", "save_file", 1.5, (1.190, 1.418, 1.294, 1.227)),
    ("16,384 tensors: delta pull", "copy", 2.0, (1.874, 1.907, 1.706, 1.893)),
    ("16,384 tensors: anchor pull", "load_file", 1.5, (1.866, 1.920, 1.994, 2.139)),
]
COLORS = {"full": "#9e9e9e", "peer": "#f57c00", "ours": "#3f51b5"}


def _log_axis(ax, ticks: list[float], labels: list[str]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(ticks, labels)
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_bytes(out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.9), sharey=True)
    names = [b[0] for b in BYTES]
    for i, (ax, trace) in enumerate(zip(axes, TRACES)):
        values = [b[1 + i] for b in BYTES]
        bars = ax.barh(range(len(BYTES)), values, color=[COLORS[b[3]] for b in BYTES])
        ax.axvline(BOUND[i], color="#2e7d32", linestyle="--", linewidth=1.2)
        ax.text(BOUND[i] * 1.08, -0.75, "bound", color="#2e7d32", fontsize=9, va="bottom")
        _log_axis(ax, [1, 10, 100, 1000], ["1", "10", "100", "1000"])
        ax.set_xlim(0.4, 8000)
        ax.set_ylim(len(BYTES) - 0.5, -1.0)
        ax.set_title(trace, fontsize=10)
        ax.set_xlabel("bytes per changed element")
        for bar, v in zip(bars, values):
            ax.text(v * 1.1, bar.get_y() + bar.get_height() / 2, f"{v:,.2f}" if v < 100 else f"{v:,.0f}",
                    va="center", fontsize=9)
        ax.grid(axis="x", which="major", alpha=0.3)
    axes[0].set_yticks(range(len(BYTES)), names, fontsize=9.5)
    fig.tight_layout()
    fig.savefig(out / "bytes-per-step.png", dpi=150)
    plt.close(fig)


def plot_times(out: Path) -> None:
    assert all(len(ratios) == len(RUNS) for *_, ratios in TIMES), "one ratio per run in RUNS"
    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    for row, (name, ref, target, ratios) in enumerate(TIMES):
        ax.plot([min(ratios), max(ratios)], [row, row], color="#3f51b5", linewidth=7, alpha=0.25,
                solid_capstyle="round")
        ax.plot(ratios, [row] * len(ratios), "o", color="#3f51b5", markersize=5)
        ax.plot([target], [row], marker="|", color="#c62828", markersize=16, markeredgewidth=2.5)
    ax.axvline(1.0, color="#616161", linewidth=1)
    _log_axis(ax, [0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5], ["0.1×", "0.2×", "0.3×", "0.5×", "1×", "2×", "3×", "5×"])
    ax.set_xlim(0.1, 5)
    ax.set_yticks(range(len(TIMES)), [f"{n} ÷ {r}" for n, r, _, _ in TIMES], fontsize=9.5)
    ax.invert_yaxis()
    traces = " and ".join(dict.fromkeys(RUNS))
    ax.set_xlabel(f"time ÷ the reference timed in the same run\n(dots: {len(RUNS)} runs at {COMMIT}, {traces}; "
                  "red: the target)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "time-ratios.png", dpi=150)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plot_bytes(args.out)
    plot_times(args.out)
    print(f"wrote {args.out / 'bytes-per-step.png'} and {args.out / 'time-ratios.png'}")


if __name__ == "__main__":
    main()
