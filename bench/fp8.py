"""FP8 served weights from a bf16 trainer, on both real traces: what changes per step and what it costs.

    .venv/bin/python bench/fp8.py [--runs cold-lr1e-6 dither-lr1e-5] [--codecs raw zstd ulp ctx auto]

For every linear-layer weight of the trace (the tensors ``fp8_block128``
quantizes by default: ``*.weight`` without embed / lm_head / norm) and every
step, the trainer's bf16 state is quantized exactly as
``Publisher(quantize="fp8_block128")`` does, and compared with the previous
step's quantized state bit for bit. Per step it prints:

* bf16 %: elements whose bf16 bits changed (the unquantized delta);
* fp8 %: e4m3 bytes that changed; scales %: block scales that changed;
* rescaled %: of the changed e4m3 bytes, those in a block whose scale changed
  (and, in the summary, how many bytes such a block changes);
* moved %: of the bf16-changed elements in blocks whose scale stayed, the
  share whose e4m3 byte changed (one e4m3 step is 16 bf16 ulps at the same
  exponent, so a 1-ulp bf16 change crosses an e4m3 rounding edge ~1/16 of the time);
* bytes of the FP8 delta (e4m3 + scales) and of the bf16 delta of the same
  tensors and step, per codec (each codec's real encoder, one object per step),
  their ratio, and the FP8 delta against the full FP8 checkpoint of those
  tensors (e4m3 bytes + fp32 scales, raw).

Sizes are deterministic (safe on a busy machine). ``--time`` adds the
quantizer's cost per step against a plain copy of the same bf16 tensors timed
in the same run (a ratio; needs a quiet machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _trace import RUNS, load  # noqa: E402

from deltastore.codecs import TensorSpec, Update, get_codec  # noqa: E402
from deltastore.quantization import BLOCK, SCALE_SUFFIX  # noqa: E402
from deltastore.quantize.fp8 import default_rule, quantize_block128  # noqa: E402
from deltastore.tensors import bits_view  # noqa: E402

CODECS = ["raw", "zstd", "ulp", "ctx", "auto"]


def quantized(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for n in names:
        out[n], out[n + SCALE_SUFFIX] = quantize_block128(state[n])
    return out


def updates(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> list[Update]:
    """The bit-changed elements of every tensor, as the Publisher hands them to a codec."""
    ups = []
    for n, t in new.items():
        nb, ob = bits_view(t), bits_view(old[n])
        pos = torch.nonzero(nb != ob).reshape(-1)
        if pos.numel():
            ups.append(Update(TensorSpec(n, t.dtype, tuple(t.shape)), nb[pos].clone(), pos, ob[pos].clone(), ob))
    return ups


def encoded(codec, ups: list[Update]) -> int:
    return len(codec.encode(ups)) if ups else 0


def drivers(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], new_b: dict[str, torch.Tensor],
            old_b: dict[str, torch.Tensor], names: list[str]) -> tuple[int, int, int, int]:
    """(changed e4m3 bytes in rescaled blocks, rescaled blocks, bf16-changed elements outside them,
    of those the ones whose e4m3 byte changed)."""
    inside = blocks = bf16_out = moved = 0
    for n in names:
        shape = new[n].shape
        ch = bits_view(new[n]).view(shape) != bits_view(old[n]).view(shape)
        chb = bits_view(new_b[n]).view(shape) != bits_view(old_b[n]).view(shape)
        sch = (bits_view(new[n + SCALE_SUFFIX]) != bits_view(old[n + SCALE_SUFFIX])).view(new[n + SCALE_SUFFIX].shape)
        mask = sch.repeat_interleave(BLOCK, 0)[:shape[0]].repeat_interleave(BLOCK, 1)[:, :shape[1]]
        inside += int((ch & mask).sum())
        blocks += int(sch.sum())
        bf16_out += int((chb & ~mask).sum())
        moved += int((ch & chb & ~mask).sum())
    return inside, blocks, bf16_out, moved


def run(name: str, codecs: list[str]) -> dict[str, float]:
    tr = load(name)
    names = [n for n, t in tr.base.items() if t.dim() == 2 and default_rule(n, t)]
    cods = {c: get_codec(c) for c in codecs}
    elems = sum(tr.base[n].numel() for n in names)
    prev_bf16 = {n: tr.base[n].clone() for n in names}
    prev_q = quantized(prev_bf16, names)
    nscales = sum(prev_q[n + SCALE_SUFFIX].numel() for n in names)
    full_fp8 = sum(t.numel() * t.element_size() for t in prev_q.values())
    dense = get_codec({"id": "dense", "config": {"planes": True}})
    anchor = {kind: len(dense.encode([Update(TensorSpec(n, t.dtype, tuple(t.shape)), bits_view(t)) for n, t in st.items()]))
              for kind, st in (("fp8", prev_q), ("bf16", prev_bf16))}
    print(f"\n## {name}: {len(names)} linear weights, {elems:,} elements; full FP8 checkpoint {full_fp8:,} B "
          f"(bf16 {2 * elems:,} B), {nscales:,} block scales; anchor (dense planes) fp8 {anchor['fp8']:,} B "
          f"({100 * anchor['fp8'] / full_fp8:.1f} % of raw), bf16 {anchor['bf16']:,} B "
          f"({50 * anchor['bf16'] / elems:.1f} % of raw)")
    cols = " | ".join(f"{c} fp8 B | {c} bf16 B" for c in codecs)
    print(f"| step | bf16 % | fp8 % | scales % | rescaled % | moved % | {cols} | fp8/bf16 ({codecs[-1]}) "
          f"| fp8 delta / full FP8 ({codecs[-1]}) |")
    print("|" + "---:|" * (8 + 2 * len(codecs)))
    sums = {k: 0.0 for k in ("bf16", "fp8", "scales", "rescaled", "moved")}
    rescaled_bytes = rescaled_blocks = 0
    totals = {c: [0, 0] for c in codecs}
    steps = 0
    for step, state in tr.iter_states():
        if step == 0:
            continue
        cur_bf16 = {n: state[n] for n in names}
        cur_q = quantized(cur_bf16, names)
        ups_q, ups_b = updates(cur_q, prev_q), updates(cur_bf16, prev_bf16)
        ch_b = sum(u.positions.numel() for u in ups_b)
        ch_q = sum(u.positions.numel() for u in ups_q if not u.spec.name.endswith(SCALE_SUFFIX))
        ch_s = sum(u.positions.numel() for u in ups_q if u.spec.name.endswith(SCALE_SUFFIX))
        inside, nblocks, bf16_out, moved = drivers(cur_q, prev_q, cur_bf16, prev_bf16, names)
        rescaled_bytes += inside
        rescaled_blocks += nblocks
        row = [100 * ch_b / elems, 100 * ch_q / elems, 100 * ch_s / nscales, 100 * inside / max(ch_q, 1),
               100 * moved / max(bf16_out, 1)]
        for k, v in zip(sums, row):
            sums[k] += v
        sizes = []
        for c, codec in cods.items():
            bq, bb = encoded(codec, ups_q), encoded(codec, ups_b)
            totals[c][0] += bq
            totals[c][1] += bb
            sizes += [bq, bb]
        last_q, last_b = sizes[-2], sizes[-1]
        print(f"| {step} | {row[0]:.3f} | {row[1]:.3f} | {row[2]:.2f} | {row[3]:.1f} | {row[4]:.1f} | "
              + " | ".join(f"{s:,}" for s in sizes)
              + f" | {last_q / max(last_b, 1):.2f} | {100 * last_q / full_fp8:.3f} % |")
        prev_bf16, prev_q = {n: t.clone() for n, t in cur_bf16.items()}, cur_q
        steps += 1
    mean = {k: v / steps for k, v in sums.items()}
    print(f"\nmean over {steps} steps: bf16 {mean['bf16']:.3f} %, fp8 bytes {mean['fp8']:.3f} %, "
          f"scales {mean['scales']:.2f} %, rescaled {mean['rescaled']:.1f} % of changed fp8 bytes "
          f"({rescaled_bytes / max(rescaled_blocks, 1):,.0f} changed bytes per rescaled block of up to "
          f"{BLOCK * BLOCK:,}), moved {mean['moved']:.1f} % of bf16-changed elements")
    for c, (bq, bb) in totals.items():
        print(f"  {c:>5}: fp8 delta {bq / steps:,.0f} B/step, bf16 delta {bb / steps:,.0f} B/step, "
              f"fp8/bf16 {bq / max(bb, 1):.2f}, fp8 delta / full FP8 {100 * bq / steps / full_fp8:.3f} %")
    return mean


def timing(name: str, repeats: int = 5) -> None:
    """Quantizing the linear weights of one state vs copying them (the memory-bandwidth reference)."""
    import time

    tr = load(name)
    ws = [t for n, t in tr.base.items() if t.dim() == 2 and default_rule(n, t)]
    elems = sum(w.numel() for w in ws)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    q = best(lambda: [quantize_block128(w) for w in ws])
    c = best(lambda: [w.clone() for w in ws])
    print(f"\nquantize: {1e9 * q / elems:.2f} ns/element, copy: {1e9 * c / elems:.2f} ns/element, "
          f"ratio {q / c:.1f}x ({torch.get_num_threads()} torch threads, {elems:,} elements)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", default=RUNS)
    ap.add_argument("--codecs", nargs="+", default=CODECS)
    ap.add_argument("--time", action="store_true", help="also time the quantizer against a copy")
    a = ap.parse_args()
    torch.set_num_threads(2)
    for r in a.runs:
        run(r, a.codecs)
    if a.time:
        timing(a.runs[0])


if __name__ == "__main__":
    main()
