"""The vLLM adapter to the version reader: a pull staged and verified before any write, by checkpoint name.

A vLLM server has no mapping of checkpoint-named tensors (its parameters are
fused, sharded, repacked), so the applier reads the bits it serves through a
callback (from the served parameters, or from a host mirror) and writes what
:meth:`deltastore.pull.reader.VersionReader.stage_each` stages: the anchor
path's whole tensors, or each delta's changes (positions, new bits, the
served bits there), one delta at a time, each written before the next is read.
The version's tensors must be the served checkpoint's (names, dtypes, shapes):
a server's layout is fixed.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...codecs import OldBits
from ...errors import TargetMismatchError
from ...manifest import Manifest, VersionRef
from ...pull.reader import Staged, VersionReader
from .checkpoint import Specs


def check_specs(manifest: Manifest, specs: Specs | None) -> None:
    """The version's tensors must match the server's checkpoint tensors (names, dtypes, shapes):
    :class:`TargetMismatchError` naming the first that does not."""
    if specs is None:
        return
    for rec in manifest.tensors:
        have = specs.get(rec.name)
        if have is None:
            raise TargetMismatchError(f"the served model has no tensor {rec.name!r} (version {manifest.step} has it)")
        if have != (rec.spec.dtype, tuple(rec.shape)):
            raise TargetMismatchError(f"served tensor {rec.name!r} is {have[0]}{list(have[1])}, "
                                      f"version {manifest.step} has {rec.dtype}{list(rec.shape)}")


def stage(reader: VersionReader, current: VersionRef | None, bits: OldBits | None, step: int, *,
          allow_anchor: bool = True, specs: Specs | None = None) -> Iterator[Staged]:
    """The way from ``current`` to ``step``, staged piece by piece (:meth:`VersionReader.stage_each`):
    ``bits`` gives the bits the server holds now (without it, or without ``current``, only an anchor path
    is possible). The version is checked against ``specs`` before anything is fetched. Raises the typed
    errors of :meth:`deltastore.Subscriber.pull`; nothing is written here.
    """
    check_specs(reader.store.manifest(step), specs)
    return reader.stage_each(step, current if bits is not None else None, bits, allow_anchor=allow_anchor)
