"""``deltastore demo``: the main job end to end on a local store.

A small transformer language model (fp32 master weights, AdamW, small
learning rate) trains on a short text. After every optimizer step the trainer
publishes the bf16 weights; a second, bf16 copy of the model is kept in sync
by a Subscriber and compared bit for bit with what was published.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .publish.publisher import Publisher
from .pull.subscriber import Subscriber
from .tensors import named_tensors

TEXT = (
    "Reinforcement learning for language models updates the weights a little at every step. "
    "Most bf16 weights stay bit-identical from one step to the next, so the trainer ships only "
    "the elements that changed, and every inference server applies them exactly. "
) * 8


class TinyLM(nn.Module):
    """A byte-level causal transformer with a tied output head."""

    def __init__(self, d: int = 192, layers: int = 2, heads: int = 4, ctx: int = 64):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.head.weight = self.embed.weight
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.blocks(self.embed(x) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _dither_(model: nn.Module, gen: torch.Generator) -> None:
    """Spread each fp32 master weight uniformly inside its bf16 rounding cell.

    This is the state of an fp32 master in the middle of a long run: small
    updates already flip some bf16 values, as they do in real RL training.
    """
    with torch.no_grad():
        for p in model.parameters():
            b = p.to(torch.bfloat16)
            up = (b.view(torch.int16) + 1).view(torch.bfloat16).float()
            ulp = (up - b.float()).abs()
            p.copy_(b.float() + (torch.rand(p.shape, generator=gen) - 0.5) * ulp * 0.999)


def run_demo(store: str | None = None, *, steps: int = 30, lr: float = 1e-6, anchor_every: int = 10,
             out: Callable[[str], None] = print, storage_options: dict[str, Any] | None = None) -> bool:
    """Train, publish every step, keep a bf16 replica in sync; True when every step was bit-exact.

    ``store``: a URI (default: a temporary folder, removed afterwards); ``storage_options`` go to its backend.
    """
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    owned = store is None
    root = store or tempfile.mkdtemp(prefix="deltastore-demo-")
    try:
        trainer = TinyLM()
        _dither_(trainer, gen)
        replica = TinyLM().to(torch.bfloat16)
        opt = torch.optim.AdamW(trainer.parameters(), lr=lr, weight_decay=0.0)
        data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
        published = {n: t for n, t in named_tensors(trainer).items()}
        full_bytes = sum(t.numel() * 2 for t in published.values())
        pub = Publisher(root, anchor_every=anchor_every, dtype=torch.bfloat16, resume=False,
                        metadata={"run": "demo", "lr": lr}, storage_options=storage_options)
        sub = Subscriber(root, storage_options=storage_options)
        out(f"store: {root}")
        out(f"model: {sum(t.numel() for t in published.values()):,} parameters, bf16 checkpoint {full_bytes:,} B")
        out(f"{'step':>4} {'kind':>6} {'loss':>7} {'changed':>9} {'stored B':>10} {'vs full':>8} "
            f"{'fetched B':>10} {'pull ms':>8}  bit-exact")
        all_exact = True
        start = time.time()
        for step in range(1, steps + 1):
            i = torch.randint(0, data.numel() - trainer.ctx - 1, (8,), generator=gen)
            x = torch.stack([data[j:j + trainer.ctx] for j in i])
            y = torch.stack([data[j + 1:j + trainer.ctx + 1] for j in i])
            loss = nn.functional.cross_entropy(trainer(x).reshape(-1, 256), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            info = pub.publish(trainer, step=step)
            t0 = time.perf_counter()
            res = sub.pull(replica, step=step)
            ms = (time.perf_counter() - t0) * 1e3
            want = {n: t.detach().to(torch.bfloat16) for n, t in named_tensors(trainer).items()}
            got = named_tensors(replica)
            exact = all(torch.equal(want[n].view(torch.int16), got[n].view(torch.int16)) for n in want)
            all_exact &= exact
            out(f"{step:>4} {info.kind:>6} {loss.item():>7.4f} {100 * info.fraction:>8.3f}% {info.nbytes:>10,} "
                f"{info.nbytes / full_bytes:>7.1%} {res.bytes_fetched:>10,} {ms:>8.1f}  {'yes' if exact else 'NO'}")
        pub.close()
        out(f"{steps} steps in {time.time() - start:.1f} s; every step bit-exact: {'yes' if all_exact else 'NO'}")
        return all_exact and math.isfinite(loss.item())
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
