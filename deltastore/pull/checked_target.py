"""What a pull checked about its target, so that the next pull into the very same tensors need not check again.

Before it writes, a pull checks its target: every entry a tensor, none an
alias of another (:func:`~deltastore.tensors.named_tensors`), every tensor of
the version present with its dtype and shape, contiguous
(:func:`~deltastore.pull.checks.check_target`), no two overlapping in memory
(:func:`~deltastore.pull.checks.check_overlaps`). Those checks look at each tensor
in Python, several times; at 16,384 tensors they take about 21 ms of a
145 ms delta pull (``bench/pull_stages.py --layout many``). They depend only on the target's entries and on the version's layout,
and a follower pulls one layout into one target again and again.

:class:`CheckedTarget` keeps, after a pull whose checks passed, the target's
identity, its names, and for each tensor its identity, type, data pointer,
element count, dtype and autograd version counter, with the layout it was
checked against (and whether every tensor was a plain CPU one, which the
addresses it hands out promise). :meth:`CheckedTarget.lookup` answers the
checked tensors again only when all of those are still the same (one pass
over the tensors, then one over the version counters) and the new
version has the very same layout (the parsed manifests share one layout
object, :mod:`deltastore.manifest`). Anything else is a miss, and the pull
checks everything.

What this cannot see: a tensor replaced by one of the same dtype and
element count at the same address (its ``.data`` swapped for another view of
the same memory, which does not move the version counter, or a new tensor
object that gets the old one's id and memory); the pull then writes the
version's bits at the addresses it checked, under the new shape. Every
in-place change of shape, storage or strides (``resize_``, ``set_``,
``as_strided_``) moves the counter, and a new tensor or a moved one changes
identity or address. The
target's values were never checked between pulls (the target is trusted to
hold the version deltastore last wrote, :mod:`deltastore.pull.tracking`).

After a lookup that found the target as it was, :meth:`CheckedTarget.addresses`
gives the checked arrays themselves (every tensor's address and element
count, with their checksum keys) to the decoders that write the target in
place (:class:`~deltastore.pull.staging.TargetAddresses`): the addresses a pull
writes at are the ones it has just compared, never an older record's.

Nothing here holds the target or its tensors (identities are kept as ids).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..checksum import tensor_keys
from ..manifest import Manifest
from ..tensors import all_plain_cpu, bits_dtype
from .staging import TargetAddresses

_VERSION = operator.attrgetter("_version")


@dataclasses.dataclass(frozen=True)
class _Seen:
    target: int
    columns: object  # the layout object of the version checked (compared by identity)
    names: list[str]
    #: per tensor: (identity, dtype, data pointer, element count), compared as one list
    facts: list[tuple[int, torch.dtype, int, int]]
    versions: list[int]
    types: set[type]
    plain: bool  # every tensor plain and on the CPU (tensors.all_plain_cpu) when remembered
    pointers: np.ndarray
    numels: np.ndarray
    dtypes: list[torch.dtype]


def _facts(target: Mapping[str, Any]) -> tuple[list[str], list[Any], list[tuple[int, torch.dtype, int, int]],
                                               list[int], set[type]] | None:
    """Names, tensors, :attr:`_Seen.facts`, version counters and types of a dict of tensors, or None (anything
    else: a tensor without a version counter, such as an inference tensor, or an entry that is not a tensor).
    The facts in one pass that reads each tensor once: at 16,384 tensors about half the time of one C-level
    pass per fact, each of which finds the tensors' metadata out of cache again."""
    names = list(target)
    values = list(target.values())
    types = set(map(type, values))
    if not all(issubclass(c, torch.Tensor) for c in types):
        return None
    try:
        versions = list(map(_VERSION, values))
    except RuntimeError:  # inference tensors keep no version counter
        return None
    return names, values, [(id(t), t.dtype, t.data_ptr(), t.numel()) for t in values], versions, types


class CheckedTarget:
    """The last target whose checks passed, for one reader (not thread-safe: one per Subscriber, whose pulls
    into a target do not overlap)."""

    def __init__(self) -> None:
        self._seen: _Seen | None = None
        self._hit: _Seen | None = None  # what the last lookup found still true
        self._addresses: TargetAddresses | None = None  # made from the record of the names it holds

    def addresses(self) -> TargetAddresses | None:
        """After a :meth:`lookup` that answered the target's tensors: their addresses, lengths and checksum
        keys in the target's order, when all are plain CPU tensors of one dtype (made once per record of
        names, then kept while lookups keep finding the same tensors); else None."""
        hit, known = self._hit, self._addresses
        if hit is None or not hit.plain:
            return None
        if known is None or known.names is not hit.names or known.pointers is not hit.pointers:
            if len(set(hit.dtypes)) != 1:
                return None
            dtype = torch.empty(0, dtype=bits_dtype(hit.dtypes[0])).numpy().dtype
            known = self._addresses = TargetAddresses(hit.names, hit.pointers, hit.numels, dtype,
                                                      tensor_keys(hit.names, len(hit.names)))
        return known

    def lookup(self, target: object, manifest: Manifest) -> dict[str, torch.Tensor] | None:
        """``target``'s tensors by name as the last :meth:`remember` checked them, when nothing those checks
        looked at has changed and ``manifest`` has the layout they were made against (and no aliases);
        else None (the caller checks everything)."""
        seen, self._hit = self._seen, None
        if (seen is None or seen.target != id(target) or not isinstance(target, dict) or manifest.aliases
                or manifest.layout_columns is not seen.columns or len(target) != len(seen.names)):
            return None
        got = _facts(target)
        if got is None:
            return None
        names, values, facts, versions, types = got
        if names != seen.names or facts != seen.facts or versions != seen.versions or types != seen.types:
            return None
        self._hit = seen
        return dict(zip(names, values))

    def remember(self, target: object, manifest: Manifest) -> None:
        """Record ``target`` (a plain dict of tensors, laid out as ``manifest`` wants and checked so) after a
        pull that wrote it; anything else is forgotten. After a :meth:`lookup` that found this target as it
        was, only the version counters (which the pull's writes moved) are read again."""
        hit, self._seen, self._hit = self._hit, None, None
        if not isinstance(target, dict) or manifest.aliases:
            return
        if hit is not None and hit.target == id(target) and hit.columns is manifest.layout_columns:
            # the pull moved no tensor (the lookup saw these tensors, all with a version counter)
            self._seen = dataclasses.replace(hit, versions=list(map(_VERSION, target.values())))
            return
        got = _facts(target)
        if got is None:
            return
        names, values, facts, versions, types = got
        _, dtypes, pointers, numels = zip(*facts) if facts else ((),) * 4
        self._seen = _Seen(id(target), manifest.layout_columns, names, facts, versions, types,
                           all_plain_cpu(values), np.array(pointers, np.int64), np.array(numels, np.int64),
                           list(dtypes))

    def forget(self) -> None:
        """Drop the record (what the last :meth:`lookup` found stays for :meth:`remember` and
        :meth:`addresses`)."""
        self._seen = None


__all__ = ["CheckedTarget"]
