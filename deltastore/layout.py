"""Layout changes between versions: which tensors a pull path adds, reshapes, re-types or drops.

A version may change the layout of its parent (format 1.1, ``docs/format.md``
"Layout changes"): a tensor listed in ``new_tensors`` is stored whole in that
version; a tensor listed in ``dropped_tensors`` is gone from it. Every other
tensor must be in the parent with the same dtype and shape. :func:`check_step`
holds a manifest to that rule against the layout it is applied to (its
parent's, as the reader rebuilt it), so a hostile manifest is refused with a
:class:`ManifestError` naming the tensor before anything is fetched or written.
:func:`path_layout` walks a whole pull path that way and says which tensors
arrive whole and which are dropped. All of it is O(tensors) per version and
reads manifests only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

from .tensor_spec import TensorSpec
from .errors import ManifestError
from .manifest import Manifest

Layout = dict[str, TensorSpec]


def layout_of(m: Manifest) -> Layout:
    """``name -> spec`` of every tensor of ``m``, in manifest order."""
    return {t.name: t.spec for t in m.tensors}


def same_spec(a: TensorSpec | None, b: TensorSpec | None) -> bool:
    return a is not None and b is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)


def describe(spec: TensorSpec) -> str:
    return f"{str(spec.dtype).replace('torch.', '')}{list(spec.shape)}"


def check_step(prev: Mapping[str, TensorSpec], m: Manifest, *, base: int | None = None) -> None:
    """Raise :class:`ManifestError` unless ``m`` applied to layout ``prev`` is a valid layout step.

    Every tensor of ``m`` not in ``m.new_tensors`` must be in ``prev`` with
    the same dtype and shape; every tensor of ``prev`` must be in ``m`` or in
    ``m.dropped_tensors``; a dropped tensor must be in ``prev``. ``base``
    names the version ``prev`` belongs to in messages.
    """
    where = f"version {base}" if base is not None else "its parent"
    new = set(m.new_tensors)
    names = set()
    for rec in m.tensors:
        names.add(rec.name)
        if rec.name in new:
            continue
        have = prev.get(rec.name)
        if have is None:
            raise ManifestError(f"version {m.step}, tensor {rec.name!r}: not in {where} and not listed in "
                                "new_tensors (a tensor a version adds must be stored whole)")
        if not same_spec(have, rec.spec):
            raise ManifestError(f"version {m.step}, tensor {rec.name!r}: {describe(rec.spec)} here but "
                                f"{describe(have)} in {where}, and not listed in new_tensors")
    dropped = set(m.dropped_tensors)
    for name in dropped:
        if name not in prev:
            raise ManifestError(f"version {m.step} drops tensor {name!r}, which {where} does not have")
    for name in prev:
        if name not in names and name not in dropped:
            raise ManifestError(f"version {m.step} lacks tensor {name!r} of {where} and does not list it "
                                "in dropped_tensors")


class PathLayout:
    """How a pull path changes the layout it starts from.

    start_manifest / final_manifest: the versions at the path's start and end;
    ``start`` / ``final`` their layouts (built on first use).
    whole: tensors of ``final`` whose content arrives whole along the path
        (added, reshaped, re-typed, or re-laid at some step), in final order.
    dropped: tensors the path had at some point that ``final`` lacks.
    """

    def __init__(self, start: Manifest, final: Manifest, whole: list[str] | None = None,
                 dropped: list[str] | None = None):
        self.start_manifest, self.final_manifest = start, final
        self.whole = whole or []
        self.dropped = dropped or []

    @functools.cached_property
    def start(self) -> Layout:
        return layout_of(self.start_manifest)

    @functools.cached_property
    def final(self) -> Layout:
        return layout_of(self.final_manifest)

    @property
    def changes(self) -> bool:
        return bool(self.whole or self.dropped)

    def first_change(self) -> str:
        """A one-line description of the first change (for error messages)."""
        if self.whole:
            name = self.whole[0]
            have, new = self.start.get(name), describe(self.final[name])
            if have is None:
                return f"adds tensor {name!r} ({new})"
            return f"re-lays tensor {name!r} ({describe(have)} -> {new})"
        return f"drops tensor {self.dropped[0]!r}"


def layout_diff(a: Manifest, b: Manifest) -> PathLayout:
    """What differs between the layouts of versions ``a`` and ``b``, whatever lies between them
    (``whole``: tensors ``b`` has in another dtype or shape, or that ``a`` lacks; ``dropped``: only in ``a``)."""
    if a.layout_key == b.layout_key:
        return PathLayout(a, b)
    before, after = layout_of(a), layout_of(b)
    whole = [n for n, spec in after.items() if not same_spec(before.get(n), spec)]
    return PathLayout(a, b, whole, [n for n in before if n not in after])


def path_layout(start: Manifest, steps: Iterable[Manifest], differential: Manifest | None = None) -> PathLayout:
    """Validate each step of a path (:func:`check_step`) and return what it changes.

    ``start`` is the manifest whose tensors the path starts from (an anchor,
    or the version a target holds); ``differential`` a version whose
    differential (``start`` -> it) comes first, which must have ``start``'s
    layout exactly; ``steps`` the versions whose deltas follow, in order, each
    a layout step from the one before. A path whose versions all have one
    layout costs one tuple compare per version.
    """
    steps = list(steps)
    prev = start
    if differential is not None:
        if differential.changes_layout or differential.layout_key != start.layout_key:
            raise ManifestError(f"version {differential.step}: its differential from version {start.step} "
                                "crosses a layout change (a differential keeps its anchor's layout)")
        prev = differential
    final = steps[-1] if steps else prev
    if all(not m.changes_layout and m.layout_key == start.layout_key for m in steps):
        return PathLayout(start, final)
    layout = layout_of(prev)
    begin = layout_of(start)
    relaid: set[str] = set()
    seen: set[str] = set(layout)
    base = prev.step
    for m in steps:
        check_step(layout, m, base=base)
        relaid.update(m.new_tensors)
        layout = layout_of(m)
        seen.update(layout)
        base = m.step
    whole = [n for n, spec in layout.items() if n in relaid or not same_spec(begin.get(n), spec)]
    dropped = [n for n in seen if n not in layout]
    return PathLayout(start, final, whole, dropped)
