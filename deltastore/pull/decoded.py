"""A version's decoded sparse updates, kept as the flat batches the decoders made.

:class:`DecodedUpdates` is what :meth:`Subscriber.fetch_updates` returns for
a delta or a differential: the validated :class:`~deltastore.codecs.UpdateBatch`
of each object (positions in the whole tensor) plus the updates of tensors
split over several objects (joined), by name. It reads as a
``Mapping[str, Update]``, an ``Update`` made on demand (a few microseconds);
the overlay (:class:`deltastore.pull.staging.SparseOverlay`) reads the batches
themselves, so staging many small tensors costs their elements, not their
count. A batch its decoder wrote into the overlay's target itself is a
:class:`~deltastore.codecs.WrittenBatch`: it holds no changes to read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..codecs import Update, UpdateBatch, WrittenBatch


class DecodedUpdates(Mapping[str, Update]):
    """``name -> Update`` over ``batches`` (flat, tensors held whole by one object) and ``loose`` updates.

    Every name is in exactly one batch or in ``loose`` (the caller makes sure). Iteration is in
    decoding order: the batches' tensors in turn, then the loose ones.
    """

    __slots__ = ("batches", "loose", "_where")

    def __init__(self, batches: list[UpdateBatch | WrittenBatch], loose: dict[str, Update]):
        self.batches = batches
        self.loose = loose
        self._where: dict[str, tuple[int, int]] | None = None

    def _index(self) -> dict[str, tuple[int, int]]:
        if self._where is None:
            self._where = {s.name: (k, i) for k, b in enumerate(self.batches) for i, s in enumerate(b.specs)}
        return self._where

    def __getitem__(self, name: str) -> Update:
        u = self.loose.get(name)
        if u is not None:
            return u
        k, i = self._index()[name]
        b = self.batches[k]
        if isinstance(b, WrittenBatch):
            raise TypeError(f"the changes of {name!r} were written into the target as they were decoded")
        return b.update(i)

    def __contains__(self, name: object) -> bool:
        return name in self.loose or name in self._index()

    def __iter__(self) -> Iterator[str]:
        for b in self.batches:
            for s in b.specs:
                yield s.name
        yield from self.loose

    def __len__(self) -> int:
        return sum(len(b.specs) for b in self.batches) + len(self.loose)
