"""A server several deltas behind: does catching up cost more than the single pulls added up?

    .venv/bin/python bench/lagging.py [--layers 6] [--deltas 3] [--repeat 3] [--density 0.002 0.025] [--tiny]

Two followers of the same store, both at version 0: one pulls versions 1..N one at a time (the
single pulls, timed each), the other pulls N at once (the lagging pull). Their ratio is what a
lagging server pays against a server that kept up; the issue's target is <= 1.0. Measured for

* ``Subscriber.pull`` into a dict of tensors (the plain path: one transaction, delta by delta), and
* the vLLM applier (``VllmApplier.pull``, sparse in-place path) on a vLLM-shaped model without vLLM
  (``tests/test_vllm/fake_vllm_model.py``, scaled up: fused qkv / gate_up parameters, vLLM's loaders),
  which stages through :meth:`deltastore.pull.reader.VersionReader.stage_each`, the path
  ``Subscriber.stage`` users take.

Versions move a random ``density`` of each tensor's elements by +-1 ulp (so this is not a real trace:
the ratio, not the bytes, is the figure). Wall and process CPU time, medians over ``--repeat``; every
final state is checked bit-exact against a fresh load of the last version.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "test_vllm"))

import fake_vllm_model as fake  # noqa: E402

import deltastore as ds  # noqa: E402
from deltastore.integrations.vllm.applier import VllmApplier  # noqa: E402
from deltastore.testing import bits_equal  # noqa: E402


def scale_model(layers: int) -> None:
    """A ~Llama-shaped model (hidden 1024, 16 heads, GQA 8, MLP 2816, vocabulary 32,000)."""
    fake.HIDDEN, fake.HEADS, fake.KV_HEADS, fake.HEAD = 1024, 16, 8, 64
    fake.INTER, fake.VOCAB, fake.VOCAB_PAD, fake.LAYERS = 2816, 32000, 32000, layers


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def same_served(model: torch.nn.Module, ckpt: dict[str, torch.Tensor]) -> bool:
    want = dict(fake.loaded_model(ckpt).named_parameters())
    return all(bits_equal(p.data, want[n].data) for n, p in model.named_parameters())


def dict_case(uri: str, versions: list[dict[str, torch.Tensor]], n: int) -> dict[str, tuple[float, float]]:
    single_t = {k: v.clone() for k, v in versions[0].items()}
    lag_t = {k: v.clone() for k, v in versions[0].items()}
    s1, s2 = ds.Subscriber(uri), ds.Subscriber(uri)
    s1.pull(single_t, step=0)
    s2.pull(lag_t, step=0)
    singles = [timed(lambda k=k: s1.pull(single_t, step=k)) for k in range(1, n + 1)]
    lag = timed(lambda: s2.pull(lag_t, step=n))
    assert bits_equal(single_t, versions[n]) and bits_equal(lag_t, versions[n]), "not bit-exact"
    return {"single": (sum(w for w, _ in singles), sum(c for _, c in singles)), "lagging": lag}


def applier_case(uri: str, versions: list[dict[str, torch.Tensor]], n: int) -> dict[str, tuple[float, float]]:
    out = {}
    for kind in ("single", "lagging"):
        model = fake.loaded_model(versions[0])
        ap = VllmApplier(model, None, path="sparse")
        ap.allow_cpu_sparse = True  # the fake model's CPU parameters have no packed GEMM copy
        ap.pull(uri, 0)
        ap.ensure_map()  # the one-time probe of the model's loaders is not a pull's cost
        steps = range(1, n + 1) if kind == "single" else [n]
        times = [timed(lambda k=k: ap.pull(uri, k)) for k in steps]
        assert ap.last_result["route"] == "delta", ap.last_result
        assert same_served(model, versions[n]), f"applier ({kind}) not bit-exact"
        out[kind] = (sum(w for w, _ in times), sum(c for _, c in times))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--deltas", type=int, default=3, help="how far behind the lagging follower is")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--density", type=float, nargs="+", default=[0.002, 0.025])
    ap.add_argument("--tiny", action="store_true", help="the test model's own sizes (a smoke run, seconds)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    if not args.tiny:
        scale_model(args.layers)
    base = fake.random_checkpoint(0)
    mb = sum(t.numel() * t.element_size() for t in base.values()) / 1e6
    print(f"model: {len(base)} checkpoint tensors, {mb:.0f} MB bf16; {args.deltas} deltas behind; "
          f"{args.repeat} repeats; torch threads 2")
    print("| density | follower | single pulls added up, wall / CPU s | lagging pull, wall / CPU s "
          "| lagging ÷ single, wall (runs) | CPU (median) |")
    print("|---:|---|---:|---:|---:|---:|")
    for density in args.density:
        versions = [base]
        for i in range(args.deltas):
            versions.append(fake.perturb(versions[-1], density, seed=100 + i))
        with tempfile.TemporaryDirectory() as tmp:
            uri = str(Path(tmp) / "store")
            with ds.Publisher(uri, anchor_every=1000) as pub:
                for step, ck in enumerate(versions):
                    pub.publish(ck, step=step)
            for name, case in (("`Subscriber.pull` (dict)", dict_case), ("vLLM applier (stage_each)", applier_case)):
                runs = [case(uri, versions, args.deltas) for _ in range(args.repeat)]
                ratio_w = [r["lagging"][0] / r["single"][0] for r in runs]
                ratio_c = [r["lagging"][1] / r["single"][1] for r in runs]
                sw = statistics.median(r["single"][0] for r in runs)
                sc = statistics.median(r["single"][1] for r in runs)
                lw = statistics.median(r["lagging"][0] for r in runs)
                lc = statistics.median(r["lagging"][1] for r in runs)
                print(f"| {density:.1%} | {name} | {sw:.3f} / {sc:.3f} | {lw:.3f} / {lc:.3f} | "
                      f"{statistics.median(ratio_w):.2f} ({min(ratio_w):.2f}–{max(ratio_w):.2f}) | "
                      f"{statistics.median(ratio_c):.2f} |", flush=True)


if __name__ == "__main__":
    main()
