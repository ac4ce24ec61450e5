"""What ``ctx`` costs beyond ``ulp``, and what it saves: the constants of ``auto``'s time model, measured.

    DELTASTORE_TRACES=../shared/traces .venv/bin/python bench/ctx_model.py [--traces smollm2-135m minilm-l6]
        [--steps 6] [--repeat 5]

For every step of both runs of each trace, the step's changed tensors are encoded and decoded (as a follower
decodes: its old tensors at hand) by ``ulp`` and by ``ctx``, one thread, process CPU time, the best of
``--repeat``, alternating. Then, over the steps, a least-squares fit of ctx's extra time
``a x elements + b x changed + c x tensors`` and the bytes ctx saves per changed element; ``auto`` chooses ctx
for a tensor when the saving, at the follower's link rate, beats that extra time (``codecs/auto.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
for _var in ("DELTASTORE_THREADS", "DELTASTORE_CODEC_THREADS"):
    os.environ[_var] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _trace  # noqa: E402
from deltastore.codecs import TensorSpec, Update, get_codec  # noqa: E402


def step_updates(tr, step: int, state: dict[str, torch.Tensor]) -> list[Update]:
    """The step's changed tensors as updates against ``state`` (then moved to the step)."""
    ups = []
    for n, (idx, new) in tr.changes(step).items():
        flat = state[n].view(torch.int16).reshape(-1)
        if idx.numel():
            ups.append(Update(TensorSpec(n, torch.bfloat16, tuple(state[n].shape)), new.clone(), idx,
                              flat[idx].clone(), flat.clone()))
        flat[idx] = new
    return ups


def cost(codec, ups, repeat: int) -> tuple[float, int]:
    """(best CPU seconds of encode + decode, object bytes)."""
    olds = {u.spec.name: u.old_tensor for u in ups}
    specs = [u.spec for u in ups]
    best, size = float("inf"), 0
    for _ in range(repeat):
        c = time.process_time()
        data = codec.encode(ups)
        codec.decode(data, specs, lambda n, p: olds[n] if p is None else olds[n][p])
        best = min(best, time.process_time() - c)
        size = len(data)
    return best, size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ulp, ctx = get_codec("ulp"), get_codec("ctx")
    rows = []  # (elements, changed, tensors, extra seconds, saved bytes)
    for name in a.traces or _trace.available():
        for run in _trace.runs(name):
            tr = _trace.load(run, name)
            state = {k: v.clone() for k, v in tr.base.items()}
            for step in range(1, min(tr.steps, a.steps) + 1):
                ups = step_updates(tr, step, state)
                if not ups:
                    continue
                (tu, bu), (tc, bc) = cost(ulp, ups, a.repeat), cost(ctx, ups, a.repeat)
                el = sum(u.spec.numel for u in ups)
                ch = sum(u.count for u in ups)
                rows.append((el, ch, len(ups), tc - tu, bu - bc))
                print(f"{name} {run} step {step}: {el} elements, {ch} changed ({100 * ch / el:.2f} %), "
                      f"{len(ups)} tensors; ulp {1e3 * tu:.2f} ms {bu / ch:.3f} B/ch, ctx {1e3 * tc:.2f} ms "
                      f"{bc / ch:.3f} B/ch ({el * 2 / 1e6 / tc:.0f} MB of model per CPU-s)", flush=True)
    x = np.array([[r[0], r[1], r[2]] for r in rows], np.float64)
    y = np.array([r[3] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    saved = np.array([r[4] / r[1] for r in rows])
    print(f"\nctx extra time = {1e9 * coef[0]:.3f} ns x element + {1e9 * coef[1]:.1f} ns x changed + "
          f"{1e6 * coef[2]:.0f} us x tensor (least squares over {len(rows)} steps, 1 thread)")
    print(f"bytes ctx saves against ulp per changed element: median {np.median(saved):.3f} "
          f"(min {saved.min():.3f}, max {saved.max():.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
