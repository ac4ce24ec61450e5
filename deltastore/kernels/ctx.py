"""The ``ctx`` codec's per-tensor coding, compiled (``_ctx.pyx`` over ``_ctx.h``, nogil).

* :func:`thresholds` — the bucket thresholds: the contiguous groups of exponent classes with the least
  ``sum n H(k / n)`` plus 64 bits a group (dynamic programming; what ``ctx.choose_thresholds`` computes).
* :func:`code_tensor` — one tensor's subsets and magnitudes (POS, BIG, NEG, MAG per bucket, each sequence with
  its cheapest RICE / EG kind by exact bit count, or a complement or a bitmap where cheaper), written as header
  integers and the U and R bit streams of ``docs/codecs.md``.
* :func:`encode16` — a 16-bit float tensor (bf16, fp16) whole in one call: class counts, thresholds, ordered
  steps, buckets and ranks (one pass over the old tensor by 32-element blocks), then :func:`code_tensor`'s coding.

Inputs are checked by the wrappers (types, lengths, every change inside its bucket); the coding runs without
the GIL.
"""

from __future__ import annotations

from ._ctx import code_tensor, encode16, thresholds

__all__ = ["code_tensor", "encode16", "thresholds"]
