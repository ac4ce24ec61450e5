"""A tiny Qwen2 with a real PEFT LoRA, trained by real AdamW steps (shared by test_lora and the vLLM LoRA check).

Head size 64 and a saved ``config.json``, so the same base also runs in vLLM's CPU build.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

VOCAB = 512
PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 42], [300, 301, 302, 303, 304, 305, 306], [9]]


def base_model(seed: int = 1234):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # wide weights, so a trained adapter visibly moves greedy outputs
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.normal_(1.0, 0.05)
    return model.eval()


def lora_model(base):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"],
                     task_type="CAUSAL_LM")
    return get_peft_model(base, cfg)


def train(model, steps: int, lr: float = 2e-2, seed: int = 0) -> Iterator[int]:
    """Yield after each real AdamW step on random next-token batches (k = 1..steps)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for k in range(1, steps + 1):
        ids = torch.randint(0, VOCAB, (4, 16), generator=g)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        yield k


def logits(model) -> torch.Tensor:
    ids = torch.tensor([p + [0] * (7 - len(p)) for p in PROMPTS])
    with torch.no_grad():
        return model(input_ids=ids).logits
