"""The ``ctx`` codec's per-tensor coding, compiled (``_ctx.pyx`` over ``_ctx.h``, nogil).

* :func:`thresholds` — the bucket thresholds: the contiguous groups of exponent classes with the least
  ``sum n H(k / n)`` plus 64 bits a group (dynamic programming over the exponent classes).
* :func:`code_tensor` — one tensor's subsets and magnitudes (POS, BIG, NEG, MAG per bucket, each sequence with
  its cheapest RICE / EG kind by exact bit count, or a complement or a bitmap where cheaper), written as header
  integers and the U and R bit streams of ``docs/codecs.md``.
* :func:`encode16` — a 16-bit float tensor (bf16, fp16) whole in one call: class counts, thresholds, ordered
  steps, buckets and ranks (one pass over the old tensor by 32-element blocks), then :func:`code_tensor`'s coding.
* :func:`decode16` — its inverse in one call: the buckets' sizes (a counting pass), every sequence read back
  from the streams (each read bounded by its stream, each value by its universe), the ranks turned into
  positions (a select pass) and the new bits; a status names what is corrupt, nothing is read or written out
  of bounds.

Inputs are checked by the wrappers (types, lengths, every change inside its bucket); the coding runs without
the GIL.
"""

from __future__ import annotations

from ._ctx import code_tensor, decode16, encode16, thresholds

#: what a :func:`decode16` status says (0: decoded)
DECODE_ERRORS = {1: "a stream ends inside a value, or a field is wider than 64 bits",
                 2: "a subset member, gap or count beyond its universe",
                 3: "a subset decodes to another count than its header says",
                 4: "ranks beyond their buckets",
                 5: "a decoded value is out of range for the dtype",
                 6: "a stream is longer than its content"}

__all__ = ["DECODE_ERRORS", "code_tensor", "decode16", "encode16", "thresholds"]
