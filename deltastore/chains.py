"""Synthetic version chains with realistic change statistics, for tests and benchmarks.

:func:`extend_trace` continues a recorded trace past its last step by
replaying its steps cyclically on the current state: step ``k`` changes the
positions the trace changed at step ``((k - 1) % n) + 1`` by the same ulp
steps. Densities, position structure and ulp-step distributions stay those of
the real run; only the values drift further.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


def extend_trace(base: Mapping[str, torch.Tensor], changes: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
                 old: list[dict[str, torch.Tensor]], steps: int, names: list[str] | None = None
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``steps + 1`` states (step 0 = ``base``) as fresh bf16 dicts.

    ``changes[i]`` is the trace's step ``i + 1`` as ``{name: (flat positions, new bits)}``
    and ``old[i]`` the trace's bits at those positions before that step, so the ulp
    step ``new - old`` can be re-applied to the current bits. ``names`` limits the tensors.
    """
    keep = names or list(base)
    cur = {n: base[n].view(torch.int16).reshape(-1).clone() for n in keep}
    shapes = {n: base[n].shape for n in keep}
    yield {n: cur[n].clone().view(torch.bfloat16).reshape(shapes[n]) for n in keep}
    for k in range(steps):
        i = k % len(changes)
        for n, (idx, bits) in changes[i].items():
            if n not in cur:
                continue
            step = bits.to(torch.int32) - old[i][n].to(torch.int32)
            cur[n][idx] = (cur[n][idx].to(torch.int32) + step).clamp(-32768, 32767).to(torch.int16)
        yield {n: cur[n].clone().view(torch.bfloat16).reshape(shapes[n]) for n in keep}


def trace_steps(trace) -> tuple[list[dict[str, tuple[torch.Tensor, torch.Tensor]]], list[dict[str, torch.Tensor]]]:
    """``(changes, old)`` lists for :func:`extend_trace` from a ``weight_trace.Trace``."""
    changes, old = [], []
    for s in range(1, trace.steps + 1):
        before = trace.state(s - 1)
        ch = trace.changes(s)
        changes.append(ch)
        old.append({n: before[n].view(torch.int16).reshape(-1)[idx] for n, (idx, _) in ch.items()})
    return changes, old
