"""The mirror: the last published bits of every tensor, and the compare against a new state.

Memory: one flat buffer per element width (tensors back to back in name
order, each at a 64-byte boundary), so the mirror costs the published model's
size and nothing per tensor; :meth:`Mirror.view` gives a tensor's flat bits
(a view).

Compare (:meth:`Mirror.diff`): CPU tensors of the published dtype are
compared by the fused kernel of :mod:`deltastore.kernels.diff` — every tensor
of one width in one call per thread, which also gathers positions, new and
old bits and the checksum deltas in the same pass. Anything else (a tensor on
another device, a dtype cast such as an fp32 master published as bf16, a
mirror on an accelerator) goes through :func:`deltastore.publish.diff.find_changes`
chunk by chunk on the mirror's device.

Advance / revert: the publisher moves the mirror forward by a version's
changes (:meth:`Mirror.advance`) before it encodes what needs the new bits
(anchors, tensors stored whole) and moves it back (:meth:`Mirror.revert`, the
old bits at the same positions) if the version is not committed, so a failed
publish leaves the mirror as it was without a second copy.

Background publishing (:class:`Pending`): the writer thread owns the mirror
and advances it after each commit, while the caller already captures later
versions. The capture side compares against the mirror (which may be some
versions behind) and corrects the result with the diffs of the versions
still queued: for every position one of them changed, the newest bits. A
position outside them holds the same bits in the mirror and in the last
captured version, so only the pending positions need a second look,
O(changed) per version. The writer drops a version from :class:`Pending`
once the mirror holds it, so nothing of it outlives its commit.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np
import torch

from .. import segments
from ..checksum import full_checksum, sparse_sum, tensor_key, tensor_keys
from ..codecs import TensorSpec, UpdateBatch
from .diff import DEFAULT_CHUNK_ELEMS, find_changes
from ..segments import Change
from ..errors import TargetMismatchError
from ..tensors import bits_view

_M64 = (1 << 64) - 1
_ALIGN = 64  # bytes: every tensor starts on a cache line (the compare reads 8-byte words)
_EMPTY: dict[torch.dtype, Change] = {}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def empty_change(bits: torch.dtype) -> Change:
    """A shared, immutable "nothing changed" for tensors of integer view dtype ``bits``."""
    ch = _EMPTY.get(bits)
    if ch is None:
        e = torch.empty(0, dtype=bits)
        ch = _EMPTY[bits] = Change(torch.empty(0, dtype=torch.int64), e, e)
    return ch


class Diff:
    """What :meth:`Mirror.diff` found: per tensor the changes and their checksum delta (mod 2**64).

    ``sums`` has every compared tensor, in manifest order (empty for a
    differential, which needs no checksum deltas). ``flat`` keeps the
    kernel's flat arrays (per element width: names in order,
    :class:`~deltastore.segments.FlatChanges`) so that advance, revert and
    encoding handle every tensor in one call (:meth:`counts`, :meth:`batch`);
    ``loose`` holds the changes of the tensors compared one by one.
    :attr:`changes` (a :class:`~deltastore.segments.Change` per tensor: views,
    a few microseconds each) is built on first use; once it is modified
    (by a background compare, :class:`Pending`), ``flat`` is dropped.
    """

    def __init__(self, sums: dict[str, int], flat: Sequence[tuple[list[str], segments.FlatChanges]] = (),
                 loose: dict[str, Change] | None = None, changes: dict[str, Change] | None = None,
                 advanced: bool = False):
        self.sums = sums
        self.flat = list(flat)
        self.loose = loose if loose is not None else {}
        self._changes = changes
        self._where: dict[str, tuple[int, int]] | None = None
        #: the compare already wrote these changes into the mirror (``Mirror.diff(advance=True)``)
        self.advanced = advanced

    @property
    def changes(self) -> dict[str, Change]:
        if self._changes is None:
            got = dict(self.loose)
            for names, fc in self.flat:
                got.update(zip(names, fc.changes()))
            self._changes = {n: got[n] for n in self.sums} if self.sums else got
        return self._changes

    def counts(self) -> dict[str, int]:
        """Changed elements per tensor (no :class:`Change` is built), in the compare's order while it is kept."""
        if self._changes is not None and not self.flat:
            return {n: ch.count for n, ch in self._changes.items()}
        out = {n: ch.count for n, ch in self.loose.items()}
        for names, fc in self.flat:
            out.update(zip(names, np.diff(fc.bounds).tolist()))
        return out

    @property
    def changed(self) -> int:
        return sum(self.counts().values())

    def loose_changes(self) -> dict[str, Change]:
        """The changes of the tensors outside ``flat``."""
        if self._changes is None:
            return self.loose
        inside = {n for names, _ in self.flat for n in names}
        return {n: ch for n, ch in self._changes.items() if n not in inside}

    def part_breaks(self) -> set[str]:
        """Tensors that must begin an object for every object's changes to be views of one buffer of the
        compare (:meth:`batch` copies them otherwise): the first tensor of each buffer after the first and,
        where a tensor's changes straddle two buffers, it and the tensor after it (it alone is copied)."""
        out: set[str] = set()
        for names, fc in self.flat:
            if not isinstance(fc, segments.FlatChanges):  # a differential's rows: read by selection anyway
                continue
            total = int(fc.bounds[-1])

            def at(e: int) -> int:  # the tensor holding element e of the stream (never an empty one)
                return int(np.searchsorted(fc.bounds, e, side="right")) - 1

            for s in fc.starts[1:].tolist():
                i = at(s)
                out.add(names[i])
                if int(fc.bounds[i]) < s and int(fc.bounds[i + 1]) < total:
                    out.add(names[at(int(fc.bounds[i + 1]))])
        return out

    def batch(self, specs: Sequence[TensorSpec], old_tensors: dict[str, torch.Tensor] | None = None
              ) -> UpdateBatch | None:
        """The changes of ``specs``' tensors as one :class:`~deltastore.codecs.UpdateBatch` (new and old
        bits, and ``old_tensors``), when they all lie in one flat group; else None."""
        if not self.flat:
            return None
        if self._where is None:
            self._where = {n: (g, i) for g, (names, _) in enumerate(self.flat) for i, n in enumerate(names)}
        try:
            at = [self._where[s.name] for s in specs]
        except KeyError:
            return None
        group = at[0][0] if at else -1
        if group < 0 or any(g != group for g, _ in at):
            return None
        pos, new, old, bounds = self.flat[group][1].select(np.fromiter((i for _, i in at), np.int64, len(at)))
        return UpdateBatch(list(specs), pos, bounds, new, old, old_tensors or {})


class Mirror:
    """Host (or accelerator) copy of the last published bits of ``specs``, in flat buffers.

    ``version`` is the step whose bits it holds (kept by the owner).
    """

    def __init__(self, specs: Mapping[str, TensorSpec], device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.specs = dict(specs)
        self.version: int | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._buffers: list[torch.Tensor] = []
        self._groups: dict[int, list[str]] = {}  # element width -> names, in buffer order
        layout: dict[int, list[tuple[str, int, int]]] = {}
        ends: dict[int, int] = {}
        # tensors in name order, the order the built-in codecs store: an object's changes are then one
        # range of the compare's output (views), not a gathered copy
        for name, spec in sorted(self.specs.items()):
            dt = spec.bits_dtype
            w = torch.empty((), dtype=dt).element_size()
            at = ends.get(w, 0)
            layout.setdefault(w, []).append((name, at, spec.numel))
            ends[w] = at + -(-spec.numel * w // _ALIGN) * _ALIGN // w
        for w, items in layout.items():
            buf = torch.empty(max(1, ends[w]), dtype=_BITS[w], device=self.device)
            self._buffers.append(buf)
            self._groups[w] = [n for n, _, _ in items]
            sizes = []  # tensor, padding, tensor, padding, ...: every view in one split
            for i, (_, at, numel) in enumerate(items):
                nxt = items[i + 1][1] if i + 1 < len(items) else buf.numel()
                sizes += [numel, nxt - at - numel]
            views = buf.split(sizes)
            for i, (name, _, _) in enumerate(items):
                self._views[name] = views[2 * i]
        self._keys = {w: tensor_keys(names, len(names))
                      for w, names in self._groups.items()}
        #: name -> (element width, index in its group), and its rank in ``specs``: ``diff(only=...)`` visits
        #: those names alone (a streamed capture compares a model a few tensors at a time)
        self._slot = {n: (w, i) for w, names in self._groups.items() for i, n in enumerate(names)}
        self._order = {n: k for k, n in enumerate(self.specs)}
        self._hint = 1 / 64

    # -- building ------------------------------------------------------------------
    @classmethod
    def capture(cls, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec],
                device: torch.device | str | None = None) -> Mirror:
        """A new mirror holding the bits of ``tensors`` (cast to each spec's dtype)."""
        m = cls(specs, device)
        m.fill(tensors)
        return m

    def relayout(self, specs: Mapping[str, TensorSpec], tensors: Mapping[str, torch.Tensor]
                 ) -> tuple[Mirror, tuple[str, ...], tuple[str, ...]]:
        """A mirror in the layout ``specs``: the tensors this one has with the same spec keep its bits, the
        others (new, reshaped, re-typed) get ``tensors``' bits. Returns it, those others and the dropped names.

        One copy of the model, on a layout change only.
        """
        m = Mirror(specs, self.device)
        m.version = self.version
        new = tuple(n for n, sp in specs.items() if self.specs.get(n) != sp)
        dropped = tuple(n for n in self.specs if n not in specs)
        relaid = set(new)
        kept = [n for n in specs if n not in relaid]
        with torch.no_grad():
            for n in kept:
                m._views[n].copy_(self._views[n])
        m.fill(tensors, new)
        return m, new, dropped

    def fill(self, tensors: Mapping[str, torch.Tensor], names: Sequence[str] | None = None) -> None:
        """Copy every tensor's bits in (``names``: only those), cast to the spec's dtype where it differs."""
        fast: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        with torch.no_grad():
            for name in self.specs if names is None else names:
                spec = self.specs[name]
                t = tensors[name]
                dst = self._views[name]
                if t.dtype == spec.dtype and t.is_cpu and dst.is_cpu and t.is_contiguous():
                    src, dsts = fast.setdefault(dst.element_size(), ([], []))
                    src.append(t)
                    dsts.append(dst)
                elif t.dtype == spec.dtype:
                    dst.copy_(bits_view(t.contiguous()))  # non-contiguous: row-major order, as everywhere
                else:
                    dst.copy_(bits_view(t.detach().to(spec.dtype).contiguous()))
        for src, dsts in fast.values():
            segments.copy(src, dsts)

    # -- reading -------------------------------------------------------------------
    def view(self, name: str) -> torch.Tensor:
        """The flat bits of ``name`` (a view into the mirror: callers must not modify it)."""
        return self._views[name]

    def regions(self) -> list[tuple[int, torch.Tensor, list[str]]]:
        """``(element width, flat buffer, names in buffer order)`` per width: the mirror as it lies in memory
        (a tensor's place in its buffer is ``view(name).storage_offset()``; padding between tensors)."""
        return [(w, buf, self._groups[w]) for w, buf in zip(self._groups, self._buffers)]

    def host_view(self, name: str) -> torch.Tensor:
        """:meth:`view` on the host (a copy when the mirror lives on an accelerator)."""
        v = self._views[name]
        return v if v.is_cpu else v.cpu()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def checksums(self, only: Sequence[str] | None = None) -> dict[str, int]:
        """Every tensor's whole checksum (:mod:`deltastore.checksum`), one kernel pass per element width
        (``only``: just those tensors)."""
        out: dict[str, int] = {}
        wanted = set(only) if only is not None else None
        for w, all_names in self._groups.items():
            idx = [i for i, n in enumerate(all_names) if wanted is None or n in wanted]
            if not idx:
                continue
            names = [all_names[i] for i in idx]
            views = [self._views[n] for n in names]
            if self.device.type == "cpu":
                sums = segments.full_sums(views, self._keys[w][idx])
                out.update((n, int(v)) for n, v in zip(names, sums))
            else:
                out.update((n, full_checksum(n, v)) for n, v in zip(names, views))
        return {n: out[n] for n in self.specs if n in out}

    def keys(self) -> dict[str, int]:
        return {n: int(k) for w, names in self._groups.items() for n, k in zip(names, self._keys[w])}

    # -- compare -------------------------------------------------------------------
    def diff(self, tensors: Mapping[str, torch.Tensor], *, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
             pending: Pending | None = None, only: Collection[str] | None = None, advance: bool = False) -> Diff:
        """Changes of ``tensors`` (same names and specs as the mirror) against the last published bits.

        With ``pending`` (background mode), the result is against the last
        *captured* version: the mirror plus the pending overlay. With ``only``,
        just those tensors are compared (``tensors`` needs no others) and the
        Diff holds just them (a streamed capture diffs a model piece by piece).
        With ``advance`` (not with ``pending``), the mirror is moved to the new
        bits in the same pass (the Diff says so: ``advanced``; :meth:`revert`
        moves it back); a compare that fails leaves the mirror as it was.
        """
        if advance and pending is not None:
            raise ValueError("Mirror.diff: advance cannot be combined with a pending overlay")
        # taken before the compare: the writer may advance the mirror and prune what it wrote meanwhile
        overlay = pending.snapshot() if pending is not None else ()
        loose: dict[str, Change] = {}  # the tensors compared one by one
        sums: dict[str, int] = {}
        flat: list[tuple[list[str], segments.FlatChanges]] = []
        slow: list[str] = []
        total = changed = 0
        for w, names in self._groups.items():
            fast_names, olds, news, keys = [], [], [], []
            wkeys = self._keys[w]
            for i in self._indices(w, only):
                name = names[i]
                t = tensors[name]
                spec = self.specs[name]
                if t.numel() != spec.numel:
                    raise TargetMismatchError(f"{name!r} has {t.numel()} elements, the mirror {spec.numel}")
                if t.dtype == spec.dtype and t.is_cpu and self.device.type == "cpu" and t.is_contiguous():
                    fast_names.append(name)
                    olds.append(self._views[name])
                    news.append(t)
                    keys.append(wkeys[i])
                else:
                    slow.append(name)
            if fast_names:
                try:
                    fc = segments.diff_segments(olds, news, np.array(keys, dtype=np.uint64), hint=self._hint,
                                                advance=advance)
                except BaseException:
                    if advance and flat:  # another width's tensors were advanced already
                        self.revert(Diff({}, flat))
                    raise
                flat.append((fast_names, fc))
                sums.update(zip(fast_names, fc.sums.tolist()))
                changed += int(fc.bounds[-1])
                total += sum(o.numel() for o in olds)
        try:
            for name in slow:
                spec = self.specs[name]
                ch = find_changes(self._views[name], tensors[name], chunk_elems=chunk_elems, dtype=spec.dtype)
                loose[name] = ch
                sums[name] = _sum_delta(name, ch)
                changed += ch.count
                total += spec.numel
            if advance and loose:
                self._write(Diff({}, loose=loose), new=True)
        except BaseException:
            if advance and flat:
                self.revert(Diff({}, flat))
            raise
        # keep the tensor order of the specs (the manifest's order)
        order = self.specs if only is None else sorted(only, key=self._order.__getitem__)
        out = Diff({n: sums[n] for n in order}, flat, loose, advanced=advance)
        if total:
            self._hint = min(1.0, max(1 / 4096, 1.5 * changed / total))
        if overlay:
            _correct(out, overlay, tensors, self)
        return out

    def _indices(self, width: int, only: Collection[str] | None) -> Iterable[int]:
        """Indices in the ``width`` group of the names to compare: all, or those of ``only``, ascending."""
        if only is None:
            return range(len(self._groups[width]))
        return sorted(i for w, i in map(self._slot.__getitem__, only) if w == width)

    # -- moving ----------------------------------------------------------------------
    def advance(self, diff: Diff) -> None:
        """Write the changes' new bits in (nothing when the compare did: ``diff.advanced``)."""
        if not diff.advanced:
            self._write(diff, new=True)

    def write_changes(self, diff: Diff, names: Sequence[str], *, new: bool) -> None:
        """Write the new (``new``) or old bits of the changes of ``names`` only: an advanced compare's tensors
        moved back to the parent while a codec reads them whole, then forward again (O(their changes); one
        kernel call per flat group of the compare on the host)."""
        rest = list(names)
        if self.device.type == "cpu" and diff.flat:
            by_group: dict[int, list[str]] = {}
            where = {n: g for g, (group, _) in enumerate(diff.flat) for n in group}
            rest = []
            for n in names:
                (by_group.setdefault(where[n], []) if n in where else rest).append(n)
            for g, group in by_group.items():
                batch = diff.batch([self.specs[n] for n in sorted(group)])
                if batch is None:  # not one flat group after all: tensor by tensor below
                    rest += group
                    continue
                segments.scatter([self._views[s.name] for s in batch.specs], batch.positions, batch.bounds,
                                 batch.bits if new else batch.old_bits)
        chs = diff.changes if rest else {}
        with torch.no_grad():
            for name in rest:
                ch = chs.get(name)
                if ch is None or not ch.count:
                    continue
                v = self._views[name]
                if v.is_cpu:
                    segments.scatter([v], ch.positions, np.array([0, ch.count], np.int64),
                                     ch.new_bits if new else ch.old_bits)
                else:
                    v[ch.positions.to(v.device)] = (ch.new_bits if new else ch.old_bits).to(v.device)

    def revert(self, diff: Diff) -> None:
        """Write the changes' old bits back (undo :meth:`advance`)."""
        self._write(diff, new=False)

    def _write(self, diff: Diff, *, new: bool) -> None:
        done: set[str] = set()
        for names, fc in diff.flat:
            if self.device.type == "cpu":
                views = [self._views[n] for n in names]
                for k, (pos, nb, ob) in enumerate(fc.parts):
                    if pos.numel():
                        segments.scatter(views, pos, fc.part_bounds(k), nb if new else ob)
                done.update(names)
        with torch.no_grad():
            for name, ch in diff.loose_changes().items():
                if ch.count and name not in done:
                    v = self._views[name]
                    v[ch.positions.to(v.device)] = (ch.new_bits if new else ch.old_bits).to(v.device)

    def gather(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """``name``'s bits at ``positions``, on the host."""
        v = self._views[name]
        return v[positions.to(v.device)].cpu()

    def at_anchor(self, name: str, positions: torch.Tensor, anchor_bits: torch.Tensor) -> torch.Tensor:
        """A host copy of ``name`` with ``anchor_bits`` at ``positions`` (the anchor's tensor, for differentials)."""
        t = self._views[name].to("cpu", copy=True)
        if positions.numel():
            t[positions] = anchor_bits
        return t


def _sum_delta(name: str, ch: Change) -> int:
    if not ch.count:
        return 0
    key = tensor_key(name)
    return (sparse_sum(key, ch.positions, ch.new_bits) - sparse_sum(key, ch.positions, ch.old_bits)) & _M64


class Pending:
    """Versions captured but not yet written into the mirror (background mode), oldest first.

    The capture side adds each version it captures (:meth:`add`) and the
    compare reads a :meth:`snapshot` before it starts; the writer forgets a
    version as soon as the mirror holds it (:meth:`prune`, after the commit).
    A version is kept as its captured :class:`Diff`, the very object queued
    for the writer, so a queued version costs no memory beyond its diff and a
    written one none at all. Safe to share between those two threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: tuple[tuple[int, Diff], ...] = ()

    def clear(self) -> None:
        with self._lock:
            self._versions = ()

    def prune(self, upto: int | None) -> None:
        """Forget what versions up to ``upto`` changed (the mirror holds them now)."""
        if upto is None:
            return
        with self._lock:
            self._versions = tuple(v for v in self._versions if v[0] > upto)

    def add(self, diff: Diff, step: int) -> None:
        """Record version ``step``'s changes, against the version captured before it (after it was captured)."""
        with self._lock:
            self._versions += ((step, diff),)

    def snapshot(self) -> tuple[tuple[int, Diff], ...]:
        """The pending versions now, ``(step, diff)`` oldest first (an immutable tuple)."""
        return self._versions


def _newest_bits(versions: Sequence[tuple[int, Diff]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per tensor that a pending version changed: the positions they changed (sorted) and the newest bits there."""
    changed: dict[str, list[Change]] = {}
    for _, d in versions:
        for name, n in d.counts().items():
            if n:
                changed.setdefault(name, []).append(d.changes[name])
    out = {}
    for name, chs in changed.items():
        if len(chs) == 1:
            out[name] = (chs[0].positions, chs[0].new_bits)
            continue
        union, inverse = torch.unique(torch.cat([c.positions for c in chs]), sorted=True, return_inverse=True)
        bits = torch.empty(union.numel(), dtype=chs[0].new_bits.dtype)
        at = 0
        for c in chs:  # oldest first: a newer version's bits overwrite an older one's
            bits[inverse[at:at + c.count]] = c.new_bits
            at += c.count
        out[name] = (union, bits)
    return out


def _correct(diff: Diff, versions: Sequence[tuple[int, Diff]], tensors: Mapping[str, torch.Tensor],
             mirror: Mirror) -> None:
    """Turn ``diff`` (against the mirror) into the changes against the last captured version."""
    touched = False
    for name, (pos, bits) in _newest_bits(versions).items():
        ch = diff.changes[name]
        spec = mirror.specs[name]
        cand = torch.unique(torch.cat([ch.positions, pos]), sorted=True)
        in_p, ip = _member(pos, cand)
        in_d, id_ = _member(ch.positions, cand)
        old = torch.empty(cand.numel(), dtype=bits.dtype)
        old[in_p] = bits[ip[in_p]]
        rest = ~in_p  # not pending: the mirror's bits there are stable, read by the compare
        old[rest] = ch.old_bits[id_[rest]]
        new = torch.empty_like(old)
        new[in_d] = ch.new_bits[id_[in_d]]
        miss = ~in_d  # pending but equal to the mirror in the compare: read the new bits themselves
        if bool(miss.any()):
            t = tensors[name].detach().reshape(-1)
            at = cand[miss]
            vals = t[at.to(t.device)]
            if vals.dtype != spec.dtype:
                vals = vals.to(spec.dtype)
            new[miss] = bits_view(vals.contiguous()).cpu()
        keep = new != old
        fixed = Change(cand[keep], new[keep], old[keep])
        diff.changes[name] = fixed
        diff.sums[name] = _sum_delta(name, fixed)
        touched = True
    if touched:
        diff.flat = []


def _member(sorted_values: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(found, index)``: whether each query value is in ``sorted_values`` and where."""
    if sorted_values.numel() == 0:
        return torch.zeros(query.numel(), dtype=torch.bool), torch.zeros(query.numel(), dtype=torch.int64)
    idx = torch.searchsorted(sorted_values, query).clamp_(max=sorted_values.numel() - 1)
    return sorted_values[idx] == query, idx
