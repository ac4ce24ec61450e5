"""Helpers the TRL end-to-end test hands to TRL's spawned rollout worker (module-level: picklable),
and a CPU stand-in for the one GPU kernel TRL's AsyncGRPOTrainer needs.

``AsyncGRPOTrainer`` forwards with its tree attention ``"tree_fa3"``, which
loads flash-attention 3 from the Hub (CUDA only). :func:`cpu_tree_attention`
computes the same varlen causal attention (queries of segment i attend to
``key.index_select(tree_kv_index)`` rows ``cu_k[i]:cu_k[i+1]``, causal,
bottom-right aligned as flash-attention does) with torch on CPU, so the
trainer's own training step runs; the weight sync under test does not depend
on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reward_len(completions, **kwargs):  # noqa: ANN001, ANN201 - TRL's reward-function signature
    """Reward longer completions (anything that varies gives GRPO an advantage to train on)."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else str(c)
        out.append(float(len(text.split())))
    return out


def cpu_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,  # noqa: ANN001,ANN201
                       tree_cu_seqlens_k, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None,
                       sliding_window=None, softcap=None, **kwargs):
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [T, H, D]
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.zeros_like(q)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qe == qs:
            continue
        lq, lk = qe - qs, ke - ks
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                           v[ks:ke].transpose(0, 1), attn_mask=mask, scale=scaling)
        out[qs:qe] = o.transpose(0, 1)
    return out.unsqueeze(0), None
