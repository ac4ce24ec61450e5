"""A vLLM-shaped model without vLLM: fused and tensor-parallel parameters, vLLM-style loaders.

It copies the *behaviour* of vLLM's stock loaders that matters for the mapping
(narrow by tensor-parallel rank, write into a fused parameter at a shard
offset, pad the vocabulary and fill the padding, ``param.data.copy_``), so the
checkpoint -> parameter mapping can be tested on CPU.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 16
HEADS = 4
KV_HEADS = 2
HEAD = 4
INTER = 24
VOCAB = 50
VOCAB_PAD = 64
LAYERS = 2


def checkpoint_specs() -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    s = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
         "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        s.update({
            p + "self_attn.q_proj.weight": (HEADS * HEAD, HIDDEN), p + "self_attn.q_proj.bias": (HEADS * HEAD,),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD, HIDDEN), p + "self_attn.k_proj.bias": (KV_HEADS * HEAD,),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD, HIDDEN), p + "self_attn.v_proj.bias": (KV_HEADS * HEAD,),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
        })
    return {n: (torch.bfloat16, shape) for n, shape in s.items()}


def random_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (dtype, shape) in checkpoint_specs().items()}


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.full(shape, float("nan"), dtype=torch.bfloat16), requires_grad=False)


class FakeLayer(nn.Module):
    def __init__(self, tp: int, rank: int):
        super().__init__()
        self.tp, self.rank = tp, rank
        q = HEADS * HEAD // tp
        kv = KV_HEADS * HEAD // tp
        self.q, self.kv = q, kv
        self.qkv_proj = nn.Module()
        self.qkv_proj.weight = _param(q + 2 * kv, HIDDEN)
        self.qkv_proj.bias = _param(q + 2 * kv)
        self.o_proj = nn.Module()
        self.o_proj.weight = _param(HIDDEN, HEADS * HEAD // tp)
        i = INTER // tp
        self.inter = i
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = _param(2 * i, HIDDEN)
        self.down_proj = nn.Module()
        self.down_proj.weight = _param(HIDDEN, i)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = _param(HIDDEN)
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = _param(HIDDEN)


class FakeVllmModel(nn.Module):
    """Parameter names as vLLM's Qwen2: fused qkv/gate_up, TP shards, padded vocab."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, tp: int = 1, rank: int = 0, transpose_o_proj: bool = False):
        super().__init__()
        self.tp, self.rank = tp, rank
        self.transpose_o_proj = transpose_o_proj
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = _param(VOCAB_PAD // tp, HIDDEN)
        self.model.layers = nn.ModuleList([FakeLayer(tp, rank) for _ in range(LAYERS)])
        self.model.norm = nn.Module()
        self.model.norm.weight = _param(HIDDEN)
        self.lm_head = nn.Module()
        self.lm_head.weight = _param(VOCAB_PAD // tp, HIDDEN)

    # vLLM-style loaders --------------------------------------------------------------
    def _vocab(self, param: torch.Tensor, w: torch.Tensor) -> None:
        per = VOCAB_PAD // self.tp
        start = self.rank * per
        end = min(start + per, VOCAB)
        n = max(0, end - start)
        if n:
            param[:n].data.copy_(w.narrow(0, start, n))
        param[n:].data.fill_(0)

    def _column(self, param: torch.Tensor, w: torch.Tensor, offset: int, size: int) -> None:
        shard = w.narrow(0, self.rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)

    def _row(self, param: torch.Tensor, w: torch.Tensor) -> None:
        size = param.shape[1]
        if self.transpose_o_proj:  # a loader that rearranges elements: not mappable
            param.data.copy_(w.narrow(1, self.rank * size, size).flip(0))
            return
        param.data.copy_(w.narrow(1, self.rank * size, size))

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            parts = name.split(".")
            if name.startswith("model.embed_tokens"):
                self._vocab(self.model.embed_tokens.weight, w)
            elif name.startswith("lm_head"):
                self._vocab(self.lm_head.weight, w)
            elif name == "model.norm.weight":
                self.model.norm.weight.data.copy_(w)
            else:
                layer = self.model.layers[int(parts[2])]
                mod, leaf = parts[-2], parts[-1]
                if mod in ("q_proj", "k_proj", "v_proj"):
                    param = getattr(layer.qkv_proj, leaf)
                    off = {"q_proj": 0, "k_proj": layer.q, "v_proj": layer.q + layer.kv}[mod]
                    size = layer.q if mod == "q_proj" else layer.kv
                    self._column(param, w, off, size)
                elif mod in ("gate_proj", "up_proj"):
                    off = 0 if mod == "gate_proj" else layer.inter
                    self._column(layer.gate_up_proj.weight, w, off, layer.inter)
                elif mod == "o_proj":
                    self._row(layer.o_proj.weight, w)
                elif mod == "down_proj":
                    self._row(layer.down_proj.weight, w)
                elif mod in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, mod).weight.data.copy_(w)
                else:
                    raise KeyError(name)
            loaded.add(name)
        return loaded


def loaded_model(ckpt: dict[str, torch.Tensor], tp: int = 1, rank: int = 0) -> FakeVllmModel:
    m = FakeVllmModel(tp, rank)
    with torch.no_grad():
        m.load_weights(ckpt.items())
    return m


def perturb(ckpt: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """A new checkpoint with ~frac of each tensor's elements moved by +-1 ulp."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in ckpt.items():
        bits = t.reshape(-1).view(torch.int16).to(torch.int32)
        mask = torch.rand(bits.numel(), generator=g) < frac
        step = torch.where(torch.rand(bits.numel(), generator=g) < 0.5, 1, -1).to(torch.int32)
        sign, mag = bits & 0x8000, bits & 0x7FFF
        new = mag + step
        ok = mask & (new >= 1) & (new < 0x7F80)  # stay finite and nonzero: like a trainer's 1-ulp moves
        bits = torch.where(ok, sign | new, bits & 0xFFFF)
        bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
        out[n] = bits.view(t.dtype).reshape(t.shape)
    return out
