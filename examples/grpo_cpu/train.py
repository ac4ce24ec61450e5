"""Trainer side of the CPU GRPO example: sample, score, GRPO update, publish every step.

A small byte-level transformer (``deltastore.demo.TinyLM``, fp32 master
weights, AdamW) samples ``--group`` completions for each of ``--prompts``
prompts, scores them with a toy reward, and takes one GRPO step:

* advantages normalised within each prompt's group: ``(r - mean) / (std + eps)``;
* token-mean REINFORCE: ``-sum(A_i * log p(token)) / number of completion tokens``
  (one on-policy update per batch, so GRPO's clipped ratio is exactly 1 and drops out);
* right after ``optimizer.step()``: ``publisher.publish(model, step=step)`` in bf16.

Run ``subscriber.py`` against the same ``--store`` in another terminal (or
``run.sh``, which starts both). No downloads: everything is built here.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

import deltastore as ds
from deltastore.demo import TinyLM, _dither_

PROMPTS = [b"The weights ", b"A delta is ", b"Inference ", b"Each step ", b"Bits that ", b"RL on CPU ",
           b"One store ", b"Servers pull "]


def reward(completion: bytes) -> float:
    """Toy reward in [0, 1]: lowercase letters and spaces, with many distinct letters (lexical diversity)."""
    if not completion:
        return 0.0
    ok = sum(1 for c in completion if 97 <= c <= 122 or c == 32) / len(completion)
    distinct = len({c for c in completion if 97 <= c <= 122}) / 26
    return 0.5 * ok + 0.5 * ok * distinct


@torch.no_grad()
def sample(model: TinyLM, prompts: torch.Tensor, length: int, gen: torch.Generator,
           temperature: float = 1.0) -> torch.Tensor:
    """One completion of ``length`` bytes per row of ``prompts`` (equal lengths), sampled from the model itself."""
    x = prompts
    for _ in range(length):
        logits = model(x[:, -model.ctx:])[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        x = torch.cat([x, nxt], 1)
    return x[:, prompts.shape[1]:]


def grpo_loss(model: TinyLM, prompts: torch.Tensor, completions: torch.Tensor,
              advantages: torch.Tensor) -> torch.Tensor:
    """Token-mean REINFORCE with group-normalised advantages (one row per completion)."""
    seqs = torch.cat([prompts, completions], 1)
    logits = model(seqs[:, :-1])
    logp = torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    plen = prompts.shape[1]
    comp_logp = logp[:, plen - 1:]  # log-probs of the completion tokens only
    return -(advantages[:, None] * comp_logp).sum() / comp_logp.numel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="./grpo-store", help="store URI (a path is a local-disk store)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (the GRPO group)")
    ap.add_argument("--length", type=int, default=16, help="completion length in bytes")
    ap.add_argument("--width", type=int, default=128, help="model width (TinyLM d)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-final", default=None, metavar="PATH",
                    help="also torch.save the last step's bf16 weights here (for checking a replica)")
    ap.add_argument("--fresh", action="store_true", help="delete a local store left by an earlier run first")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    if args.fresh and "://" not in args.store:
        shutil.rmtree(args.store, ignore_errors=True)
    model = TinyLM(d=args.width)
    _dither_(model, gen)  # fp32 master weights as in the middle of a run (see deltastore.demo)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    pub = ds.Publisher(args.store, dtype=torch.bfloat16, metadata={"run": "grpo_cpu", "lr": args.lr})
    if pub.last is not None:
        print(f"{args.store} already holds versions up to {pub.last.step}; use --fresh or another --store",
              file=sys.stderr)
        return 2
    prompts = [torch.tensor(list(p[:12].ljust(12)), dtype=torch.long) for p in PROMPTS]
    full = sum(p.numel() for p in model.parameters()) * 2
    print(f"store {args.store}: {sum(p.numel() for p in model.parameters()):,} parameters, bf16 {full:,} B", flush=True)
    print(f"{'step':>5} {'reward':>7} {'loss':>8} {'kind':>6} {'changed':>8} {'stored B':>9} {'publish ms':>10}",
          flush=True)
    t_start = time.time()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(prompts), (args.prompts,), generator=gen).tolist()
        batch_p = torch.stack([prompts[i] for i in idx for _ in range(args.group)])  # group rows per prompt
        model.eval()
        batch_c = sample(model, batch_p, args.length, gen)
        r = torch.tensor([reward(bytes(c.tolist())) for c in batch_c]).reshape(args.prompts, args.group)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)
        model.train()
        loss = grpo_loss(model, batch_p, batch_c, adv)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t0 = time.perf_counter()
        info = pub.publish(model, step=step)  # right after optimizer.step(): only the changed bf16 bits
        ms = (time.perf_counter() - t0) * 1e3
        print(f"{step:>5} {r.mean().item():>7.3f} {loss.item():>8.4f} {info.kind:>6} {100 * info.fraction:>7.2f}% "
              f"{info.nbytes:>9,} {ms:>10.1f}", flush=True)
    pub.close()  # waits for anything still uploading
    if args.save_final:
        torch.save({n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}, args.save_final)
    print(f"trained and published {args.steps} steps in {time.time() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
