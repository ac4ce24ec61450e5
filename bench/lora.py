"""LoRA adapter sync: bytes per step of ``Publisher(adapter_only=True)`` against shipping the adapter file.

    .venv/bin/python bench/lora.py [--steps 8] [--hidden 256] [--layers 4] [--rank 16] [--lr 1e-3]

A small Qwen2 with a real PEFT LoRA (q/k/v/o/gate/up/down, rank ``--rank``) is
trained by real AdamW steps on random next-token batches; after every step the
adapter is published twice: as trained (fp32) and cast to bf16
(``dtype=torch.bfloat16``, what a bf16 server loads). Per step: the elements
that changed, the bytes a follower downloads (the version's delta objects, the
default ``auto`` codec), and the bytes stored (an ``adaptive`` anchor may also
write the whole adapter), against the adapter file ``save_pretrained`` writes
(what peers ship every step). Sizes only: no timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import deltastore as ds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    a = ap.parse_args()
    torch.set_num_threads(2)
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=1)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(
        r=a.rank, lora_alpha=2 * a.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        file_bytes = os.path.getsize(os.path.join(d, "adapter_model.safetensors"))
    pubs = {"fp32": ds.Publisher("memory://lora-fp32", adapter_only=True),
            "bf16": ds.Publisher("memory://lora-bf16", adapter_only=True, dtype=torch.bfloat16)}
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"adapter: {n:,} elements, save_pretrained file {file_bytes:,} B (fp32)")
    print("| step | kind | changed % fp32 | follower B fp32 | stored B fp32 | changed % bf16 | follower B bf16 "
          "| stored B bf16 | follower fp32 / file |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    totals = {k: [0, 0] for k in pubs}
    for step in range(a.steps + 1):
        if step:
            ids = torch.randint(0, 1024, (8, 32), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        row = []
        for kind, pub in pubs.items():
            info = pub.publish(model, step=step)
            m = pub.store.manifest(step)
            follow = m.object_bytes(m.delta_objects) if step else info.nbytes
            row += [100 * info.fraction, follow, info.nbytes]
            if step:
                totals[kind][0] += follow
                totals[kind][1] += info.nbytes
        print(f"| {step} | {info.kind} | {row[0]:.1f} | {row[1]:,} | {row[2]:,} | {row[3]:.1f} | {row[4]:,} "
              f"| {row[5]:,} | {row[1] / file_bytes:.2f} |")
    for kind, (follow, stored) in totals.items():
        print(f"{kind}: follower {follow / a.steps:,.0f} B/step ({follow / a.steps / file_bytes:.2f}x the fp32 file), "
              f"stored {stored / a.steps:,.0f} B/step")
    for pub in pubs.values():
        pub.close()


if __name__ == "__main__":
    main()
