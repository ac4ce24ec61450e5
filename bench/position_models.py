"""What a step's changes cost under each model a decoder could use: positions, then value steps (real traces).

    DELTASTORE_TRACES=../shared/traces .venv/bin/python bench/position_models.py [--steps 2-8]

A delta's bytes are mostly its positions (which elements changed). This
prints, per trace run, the ideal cost of those positions in bytes per changed
element under models that differ in what the decoder must hold to use them:

* ``tensor``: one density per tensor (the position part of the
  independent-position bound of ``bench/codecs.py``); the decoder needs the
  count only, and ``ulp``'s gap stream is coded against it.
* ``block 1024`` / ``block 16384`` / ``row``: one density per block of
  elements (or per row of a 2-D tensor), the block counts charged at their
  own zero-order entropy per tensor (optimistic for this model); the decoder
  needs the counts only, so it stays O(changed).
* ``previous step``: two densities per tensor, for the elements that changed
  in the step before and for the others; the decoder needs the previous
  step's positions (O(changed), but state kept between pulls).
* ``old exponent``: one density per exponent value of the old element (what
  ``ctx`` conditions on); the decoder must read every element of the old
  tensor (O(model)).

The value steps (the change of each element's ordered image, as in the
bound) are costed twice: zero-order over every change of the steps (the
bound's own), and zero-order per exponent of the old element, which a
decoder can read at the changed positions alone (O(changed)). The last
table adds them up: the bound; the best a decoder that never reads the old
tensor whole can do here (the cheapest O(changed) position model plus the
conditioned steps); and ``ctx``'s model.

Each figure is an entropy (a bound an ideal coder reaches), summed over the
steps; the per-class counts a real coder would also send are left out for the
context models (a few bytes per tensor). Step 1 (AdamW's first update, twice
as dense) is left out by default, as in ``bench/scale.py``.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

import _trace
from deltastore.codecs._bits import ordered


def _bits(n: np.ndarray, k: np.ndarray) -> float:
    """Sum over classes of ``n * H(k / n)``: the ideal bits for ``k`` members among ``n`` items, each class."""
    n, k = np.asarray(n, np.float64), np.asarray(k, np.float64)
    keep = (k > 0) & (k < n)
    n, k = n[keep], k[keep]
    p = k / n
    return float((-(k * np.log2(p)) - (n - k) * np.log2(1 - p)).sum())


def _zero_order(values: np.ndarray) -> float:
    """Bits of ``values`` under their own zero-order entropy."""
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(counts * np.log2(p)).sum())


def _blocks(mask: np.ndarray, size: int) -> float:
    """Bits of ``mask``'s members with one density per block of ``size`` elements, plus the block counts."""
    n = mask.size
    nb = -(-n // size)
    padded = np.zeros(nb * size, bool)
    padded[:n] = mask
    counts = padded.reshape(nb, size).sum(1)
    sizes = np.full(nb, size)
    sizes[-1] = n - size * (nb - 1)
    return _bits(sizes, counts) + _zero_order(counts)


MODELS = ["tensor", "block 1024", "block 16384", "row", "previous step", "old exponent"]
NEEDS = {"tensor": "the count", "block 1024": "block counts", "block 16384": "block counts",
         "row": "row counts", "previous step": "last step's positions", "old exponent": "every old element"}


def measure(tr: Any, steps: range) -> tuple[dict[str, float], int, int]:
    """Bits of every position model over ``steps`` of trace ``tr`` (a ``weight_trace`` trace; and of the value
    steps, as ``steps`` and ``steps by exponent``), the changes counted, and the elements per step."""
    bits = dict.fromkeys(MODELS, 0.0)
    deltas: list[np.ndarray] = []
    classes: list[np.ndarray] = []
    changed = 0
    previous: dict[str, np.ndarray] = {}
    state = {k: v.clone() for k, v in tr.state(steps.start - 1).items()}
    if steps.start > 1:
        previous = {k: idx.numpy() for k, (idx, _) in tr.changes(steps.start - 1).items()}
    numel = sum(t.numel() for t in state.values())
    for s in steps:
        now = tr.changes(s)
        for name, old in state.items():
            idx = now[name][0].numpy() if name in now else np.zeros(0, np.int64)
            n, k = old.numel(), idx.size
            changed += k
            mask = np.zeros(n, bool)
            mask[idx] = True
            bits["tensor"] += _bits([n], [k])
            bits["block 1024"] += _blocks(mask, 1024)
            bits["block 16384"] += _blocks(mask, 16384)
            bits["row"] += _blocks(mask, old.shape[-1]) if old.dim() == 2 else _blocks(mask, n)
            before = np.zeros(n, bool)
            before[previous.get(name, np.zeros(0, np.int64))] = True
            bits["previous step"] += _bits([before.sum(), n - before.sum()], [mask[before].sum(), mask[~before].sum()])
            old_bits = old.reshape(-1).view(torch.int16).numpy()
            exponent = (old_bits.astype(np.int32) >> 7) & 0xFF
            per_class = np.bincount(exponent, minlength=256)
            changed_class = np.bincount(exponent[idx], minlength=256)
            bits["old exponent"] += _bits(per_class, changed_class)
            if k:
                new_bits = now[name][1].numpy()
                deltas.append(ordered(new_bits, True).astype(np.int64) - ordered(old_bits[idx], True).astype(np.int64))
                classes.append(exponent[idx])
        for name, (idx, new_bits) in now.items():  # the next step's old state
            state[name].reshape(-1).view(torch.int16)[idx] = new_bits
        previous = {k: idx.numpy() for k, (idx, _) in now.items()}
    d, c = np.concatenate(deltas), np.concatenate(classes)
    bits["steps"] = _zero_order(d)
    bits["steps by exponent"] = sum(_zero_order(d[c == e]) for e in np.unique(c))
    return bits, changed, numel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", default=_trace.RUNS)
    ap.add_argument("--steps", default="2-", help="FIRST-LAST (LAST empty: the run's last step)")
    a = ap.parse_args()
    first, _, last = a.steps.partition("-")
    for run in a.runs:
        tr = _trace.load(run)
        steps = range(int(first), (int(last) if last else tr.steps) + 1)
        bits, changed, numel = measure(tr, steps)
        base = bits["tensor"]
        print(f"\n## {run}: steps {steps.start}-{steps.stop - 1}, {changed:,} changes "
              f"({100 * changed / (numel * len(steps)):.2f} % density)\n")
        print("| model | decoder needs | position B/changed el | x per-tensor density |")
        print("|---|---|---:|---:|")
        for m in MODELS:
            print(f"| {m} | {NEEDS[m]} | {bits[m] / 8 / changed:.3f} | {bits[m] / base:.3f} |")
        bound = bits["tensor"] + bits["steps"]
        local = min(bits[m] for m in MODELS if m != "old exponent") + bits["steps by exponent"]
        print(f"\nvalue steps: {bits['steps'] / 8 / changed:.3f} B/changed el zero-order, "
              f"{bits['steps by exponent'] / 8 / changed:.3f} by the old exponent\n")
        print("| whole delta | B/changed el | x independent-position bound |")
        print("|---|---:|---:|")
        for what, b in (("independent-position bound", bound),
                        ("best O(changed) decoder: positions above + steps by exponent", local),
                        ("old-exponent positions + steps by exponent (ctx's model)",
                         bits["old exponent"] + bits["steps by exponent"])):
            print(f"| {what} | {b / 8 / changed:.3f} | {b / bound:.3f} |")


if __name__ == "__main__":
    main()
