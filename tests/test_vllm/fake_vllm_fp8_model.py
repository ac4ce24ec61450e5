"""A vLLM-shaped block-FP8 model without vLLM: what ``Fp8LinearMethod`` (``weight_block_size=[128, 128]``) holds.

Each linear layer has ``weight`` (``float8_e4m3fn``, ``[out, in]``) and
``weight_scale_inv`` (fp32, ``[ceil(out/128), ceil(in/128)]``); q/k/v and
gate/up are fused. The loaders copy what vLLM's do for block-quantized
parameters: a weight shard goes to its row offset, a scale shard to its
*block-row* offset (``offset // 128`` rows of ``ceil(size / 128)``), as
``BlockQuantScaleParameter`` does. Embeddings, norms, biases and ``lm_head``
stay bf16 (vLLM does not quantize them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

HIDDEN = 256
Q = 256
KV = 128
INTER = 384
VOCAB = 300
LAYERS = 2
B = 128


def checkpoint_specs() -> dict[str, tuple[int, ...]]:
    """The bf16 trainer checkpoint (before quantization)."""
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
                                     "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        s.update({p + "self_attn.q_proj.weight": (Q, HIDDEN), p + "self_attn.q_proj.bias": (Q,),
                  p + "self_attn.k_proj.weight": (KV, HIDDEN), p + "self_attn.k_proj.bias": (KV,),
                  p + "self_attn.v_proj.weight": (KV, HIDDEN), p + "self_attn.v_proj.bias": (KV,),
                  p + "self_attn.o_proj.weight": (HIDDEN, Q),
                  p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                  p + "mlp.down_proj.weight": (HIDDEN, INTER),
                  p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)})
    return s


def random_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in checkpoint_specs().items()}


def _nan(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    t = torch.full(shape, float("nan"), dtype=torch.float32).to(dtype)
    return nn.Parameter(t, requires_grad=False)


class Fp8Linear(nn.Module):
    def __init__(self, out: int, inp: int, bias: bool = False):
        super().__init__()
        self.weight = _nan(out, inp, dtype=torch.float8_e4m3fn)
        self.weight_scale_inv = _nan(math.ceil(out / B), math.ceil(inp / B), dtype=torch.float32)
        if bias:
            self.bias = _nan(out, dtype=torch.bfloat16)


class Bf16(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.weight = _nan(*shape, dtype=torch.bfloat16)


class FakeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = Fp8Linear(Q + 2 * KV, HIDDEN, bias=True)
        self.o_proj = Fp8Linear(HIDDEN, Q)
        self.gate_up_proj = Fp8Linear(2 * INTER, HIDDEN)
        self.down_proj = Fp8Linear(HIDDEN, INTER)
        self.input_layernorm = Bf16(HIDDEN)
        self.post_attention_layernorm = Bf16(HIDDEN)


class FakeVllmFp8Model(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = Bf16(VOCAB, HIDDEN)
        self.model.layers = nn.ModuleList([FakeLayer() for _ in range(LAYERS)])
        self.model.norm = Bf16(HIDDEN)
        self.lm_head = Bf16(VOCAB, HIDDEN)

    @staticmethod
    def _shard(param: torch.Tensor, leaf: str, w: torch.Tensor, offset: int, size: int) -> None:
        if leaf == "weight_scale_inv":  # BlockQuantScaleParameter: offsets in block rows
            offset, size = offset // B, math.ceil(size / B)
        param.data.narrow(0, offset, size).copy_(w)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            parts = name.split(".")
            if name.startswith("model.embed_tokens"):
                self.model.embed_tokens.weight.data.copy_(w)
            elif name.startswith("lm_head"):
                self.lm_head.weight.data.copy_(w)
            elif name == "model.norm.weight":
                self.model.norm.weight.data.copy_(w)
            else:
                layer = self.model.layers[int(parts[2])]
                mod, leaf = parts[-2], parts[-1]
                if mod in ("q_proj", "k_proj", "v_proj"):
                    off = {"q_proj": 0, "k_proj": Q, "v_proj": Q + KV}[mod]
                    self._shard(getattr(layer.qkv_proj, leaf), leaf, w, off, Q if mod == "q_proj" else KV)
                elif mod in ("gate_proj", "up_proj"):
                    self._shard(getattr(layer.gate_up_proj, leaf), leaf, w, 0 if mod == "gate_proj" else INTER, INTER)
                elif mod in ("o_proj", "down_proj"):
                    getattr(getattr(layer, mod), leaf).data.copy_(w)
                elif mod in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, mod).weight.data.copy_(w)
                else:
                    raise KeyError(name)
            loaded.add(name)
        return loaded
