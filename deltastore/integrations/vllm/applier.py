"""The applier: one vLLM worker's model brought to a store version, all or nothing.

Three apply paths, chosen for each staged piece (``path="auto"``) once it is
staged (fetched, decoded and checksum-verified by :mod:`.stage`; nothing of it
is written before that). A server several deltas behind gets one piece per
delta, each staged against what the one before it wrote:

* **native** (vLLM with ``load_checkpoint_weight_patches``): a delta's
  changed elements go through vLLM's own sparse loader, which routes
  checkpoint coordinates through the model's ``load_weights`` (fused, TP and
  EP layouts are vLLM's business). That loader reserves NaN as "unchanged"
  and has no rollback; here values that are NaN (and non-float tensors) are
  written through the probed map instead, what the loader wrote is read back
  and compared bit for bit, and any failure puts the old bits back.
* **sparse**: the changed elements are written straight into vLLM's
  parameters through the map learned by probing ``load_weights``
  (:mod:`.mapping`); an anchor is written whole the same way.
* **reload**: a host mirror of the checkpoint tensors is updated and the
  changed tensors, with every partner that loads into the same vLLM module,
  go through vLLM's layer-wise ``reload_weights``.

The in-place paths (native, sparse) serve a pull when every tensor it touches
is mapped into a parameter that the forward pass reads: on GPU normally all of
them; on vLLM's CPU build only modules without a CPU GEMM dispatch (norms,
embeddings' lookups are excluded too: their ``cpu_linear`` may hold a packed
copy), so there most pulls take the reload path. Undo: one
:class:`deltastore.pull.transaction.UndoLog` per pull, run newest first on any
failure: whole parameters go to its :class:`deltastore.pull.undo.UndoJournal`
before an anchor overwrites them; element writes (and the host mirror's) are
undone from the staged original bits; a reload by reloading the mirror once it
is back. The error follows the transaction's one rule
(:func:`deltastore.pull.transaction.failure`): a failed restore is reported as
:class:`ApplyError` with ``restored = False`` (the engine's version is then
unknown and the next pull starts from an anchor), as in
:meth:`deltastore.Subscriber.pull`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ...checksum import full_checksum
from ...errors import ApplyError, ChecksumMismatchError, TargetMismatchError, VersionNotFoundError
from ...manifest import VersionRef
from ...pull.reader import Staged
from ...pull.staging import FullState
from ...pull.subscriber import Subscriber
from ...pull.transaction import UndoLog, failure, restored_by
from ...signing import keys_from_env
from ...tensors import bits_view
from ..vllm_fp8 import check_served
from .checkpoint import Specs, model_dir, read_checkpoint
from .loaders import ReloadFn, native_patch_loader
from .mapping import ParamMap, probe, reload_groups
from .stage import stage

log = logging.getLogger("deltastore.vllm")

PATHS = ("auto", "native", "sparse", "reload")


class VllmApplier:
    """Applies store versions to one vLLM worker's model. One per model (see :func:`applier_for`).

    Args:
        model: the worker's ``nn.Module`` (``model_runner.get_model()``).
        vllm_config: the worker's ``VllmConfig`` (None in unit tests).
        reload_fn: ``reload_fn(iterable of (checkpoint name, tensor))``: vLLM's
            layer-wise reload of a subset of checkpoint tensors (with its resets).
        path: ``"auto"``, ``"native"``, ``"sparse"`` or ``"reload"`` (env ``DELTASTORE_VLLM_PATH``).
        resets: called after an in-place write (native/sparse) succeeded: the
            resets vLLM does after a reload (LoRA state, encoder and multimodal caches).
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any = None, *, reload_fn: ReloadFn | None = None,
                 path: str | None = None, resets: Callable[[], None] | None = None):
        self.model = model
        self.vllm_config = vllm_config
        self.reload_fn = reload_fn
        self.resets = resets
        self.default_path = path or os.environ.get("DELTASTORE_VLLM_PATH", "auto")
        if self.default_path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.default_path!r}")
        self.native = native_patch_loader()
        self.version: VersionRef | None = None
        self.uri: str | None = None
        self.path: str | None = None          # path that applied the current version
        self.specs: Specs | None = None       # checkpoint tensors (from the first manifest)
        self.host: dict[str, torch.Tensor] | None = None  # flat bits per checkpoint tensor (kept in sync)
        self.pmap: ParamMap | None = None
        self._probed = False
        self._subs: dict[tuple[str, str], Subscriber] = {}
        # what prefetch() staged for the next pull: its key, the first piece, the pieces still to stage
        self._prefetched: tuple[tuple[Any, ...], Staged, Iterator[Staged]] | None = None
        self._last_sub: Subscriber | None = None
        self.lock = threading.RLock()
        self.allow_cpu_sparse = False  # tests only: CPU parameters that no GEMM dispatch repacks
        self.last_result: dict[str, Any] | None = None

    # -- environment ---------------------------------------------------------------------------
    def _sub(self, uri: str, storage_options: dict[str, Any], trusted_keys: list[str] | None = None) -> Subscriber:
        """The Subscriber of ``uri``; its trusted keys are the worker's ``DELTASTORE_TRUSTED_KEYS`` when set
        (a caller cannot loosen what the server pins), else ``trusted_keys``."""
        keys = keys_from_env() or trusted_keys
        key = (uri, json.dumps(storage_options, sort_keys=True, default=str), tuple(keys or ()))
        sub = self._subs.get(key)
        if sub is None:
            sub = self._subs[key] = Subscriber(uri, storage_options=storage_options, trusted_keys=keys)
        return sub

    def _device_type(self) -> str:
        for p in self.model.parameters():
            if p.numel():
                return p.device.type
        return "cpu"

    def _tp_size(self) -> int:
        pc = getattr(self.vllm_config, "parallel_config", None)
        return int(getattr(pc, "tensor_parallel_size", 1) or 1)

    def ensure_map(self) -> ParamMap | None:
        """Probe the model's loader once (needs the checkpoint specs from a manifest)."""
        if not self._probed and self.specs is not None:
            params = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
            with torch.no_grad():
                self.pmap = probe(self.model.load_weights, params, self.specs)
            self._probed = True
        return self.pmap

    def _repacked(self, param: str) -> bool:
        """vLLM's CPU build computes with its own packed copy of a GEMM weight (``cpu_linear``)."""
        if self._device_type() != "cpu" or self.allow_cpu_sparse:
            return False
        try:
            return hasattr(self.model.get_submodule(param.rpartition(".")[0]), "cpu_linear")
        except AttributeError:
            return True

    def inplace_refusal(self, names: Iterable[str] | None = None) -> str | None:
        """Why the in-place paths cannot write tensors ``names`` (None: every tensor); None when they can."""
        mc = getattr(self.vllm_config, "model_config", None)
        if getattr(mc, "quantization", None):
            return f"quantized weights ({mc.quantization}) cannot be patched element-wise"
        pc = getattr(self.vllm_config, "parallel_config", None)
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
            return "pipeline parallelism: a stage cannot verify the tensors of other stages"
        try:
            pmap = self.ensure_map()
        except RuntimeError as e:
            return str(e)
        if pmap is None:
            return "no checkpoint specs yet"
        for name in (list(self.specs or {}) if names is None else names):
            if name in pmap.unmapped:
                return f"{name!r} cannot be mapped: {pmap.unmapped[name]}"
            blocks = pmap.blocks.get(name)
            if not blocks:
                return f"{name!r} is not loaded into any parameter"
            packed = next((b.param for b in blocks if self._repacked(b.param)), None)
            if packed is not None:
                return f"{name!r} loads into {packed!r}, which vLLM's CPU build computes from a packed copy"
        return None

    def choose_path(self, requested: str | None, staged: Staged | None = None) -> str:
        """The path for ``staged`` (None: for a whole version). Raises TargetMismatchError when the
        requested in-place path cannot serve it."""
        req = requested or self.default_path
        if req not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {req!r}")
        if req == "reload":
            return "reload"
        delta = staged is not None and staged.path == "delta"
        why = self.inplace_refusal(list(staged.changes()) if delta else None)
        if why is not None:
            if req != "auto":
                raise TargetMismatchError(f"the {req} in-place path is not available: {why}")
            return "reload"
        if delta and self.native is not None and req in ("auto", "native"):
            return "native"
        if req == "native" and delta:
            raise TargetMismatchError("the native path needs vLLM's load_checkpoint_weight_patches "
                                      "(vLLM >= 0.32); this vLLM has none")
        return "sparse"  # an anchor is written whole through the map, also when "native" was asked for

    # -- readers -------------------------------------------------------------------------------
    def _host_reader(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        assert self.host is not None
        return self.host[name] if positions is None else self.host[name][positions]

    def _param_reader(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        pmap = self.ensure_map()
        if pmap is None:
            raise TargetMismatchError("the served parameters cannot be read: no checkpoint map")
        if positions is None:  # an old-tensor codec: O(tensor) gather from the served parameters
            positions = torch.arange(pmap.numel(name))
        held, bits = pmap.gather(name, positions)
        if self._tp_size() > 1:
            held, bits = _combine_ranks(held, bits)
        if not bool(held.all()):
            raise TargetMismatchError(f"{int((~held).sum())} changed element(s) of {name!r} are held by no worker")
        return bits

    # -- pulling -------------------------------------------------------------------------------
    def _prepare(self, sub: Subscriber, step: int | None) -> int:
        if step is None:  # with trusted keys: the signed latest, never below the served version
            step = sub.resolve_latest(self.version)
        m = sub.manifest(step)
        check_served(m, self.model, self.vllm_config)  # FP8 bytes must never be served as bf16, nor back
        if self.specs is None:
            self.specs = {r.name: (r.spec.dtype, tuple(r.shape)) for r in m.tensors}
        return step

    def _pieces(self, sub: Subscriber, step: int, allow_anchor: bool) -> Iterator[Staged]:
        """The way to ``step`` staged piece by piece (:func:`.stage.stage`): what :meth:`prefetch` staged
        for this very pull first, if anything."""
        key = (sub.store.uri, step, allow_anchor, self.version)
        ahead, self._prefetched = self._prefetched, None
        if ahead is not None and ahead[0] == key:
            yield ahead[1]
            yield from ahead[2]
            return
        if ahead is not None:
            ahead[2].close()
        bits = None
        if self.version is not None:
            bits = self._host_reader if self.host is not None else self._param_reader
        yield from stage(sub.reader, self.version if bits else None, bits, step, allow_anchor=allow_anchor,
                         specs=self.specs)

    def prefetch(self, uri: str, step: int | None = None, *, allow_anchor: bool = True, path: str | None = None,
                 storage_options: dict[str, Any] | None = None,
                 trusted_keys: list[str] | None = None) -> dict[str, Any]:
        """Fetch, verify and decode the way to ``step`` without touching the model.

        A following :meth:`pull` of the same step applies it without fetching
        again, so a server is paused only for the writes. A path of several
        deltas is staged a delta at a time, each against the weights the one
        before it left: the first is staged here and the others downloaded,
        and the pull decodes each once the one before it is written.
        """
        with self.lock:
            sub = self._sub(uri, storage_options or {}, trusted_keys)
            step = self._prepare(sub, step)
            pieces = self._pieces(sub, step, allow_anchor)
            first = next(pieces)
            chosen = self.choose_path(path, first)
            self._prefetched = ((sub.store.uri, step, allow_anchor, self.version), first, pieces)
            return {"step": step, "route": first.path, "path": chosen, "bytes_fetched": first.bytes_fetched,
                    "elements": first.elements()}

    def pull(self, uri: str, step: int | None = None, *, allow_anchor: bool = True, path: str | None = None,
             storage_options: dict[str, Any] | None = None, trusted_keys: list[str] | None = None) -> dict[str, Any]:
        """Bring the served weights to version ``step`` (default: latest). All or nothing.

        ``trusted_keys`` (or the worker's ``DELTASTORE_TRUSTED_KEYS``, which wins): every manifest on the way
        must be signed by one of them (:class:`~deltastore.Subscriber`), checked before anything is fetched.

        A server several deltas behind takes them one at a time, each staged
        against what the one before it wrote, every write in one undo log
        (:class:`~deltastore.pull.transaction.UndoLog`) until the last one is
        in: it costs the single pulls added up. Raises the typed errors of
        :meth:`deltastore.Subscriber.pull`; on any error the engine keeps
        serving its previous version, except an :class:`ApplyError` with
        ``restored = False`` (a restore failed too): the version is then
        unknown and the next pull loads an anchor.
        """
        with self.lock:
            sub = self._sub(uri, storage_options or {}, trusted_keys)
            step = self._prepare(sub, step)
            log = UndoLog()
            reloaded = log.steps()  # first in the log, so undone last: once the host mirror is back
            staging = applying = 0.0
            applied: list[int] = []
            written, fetched, in_place = 0, 0, False
            tensors: set[str] = set()
            chosen, last, route = self.default_path, None, None
            reload_names: list[str] = []  # what delta pieces the reload path took changed: reloaded at the end
            pieces = self._pieces(sub, step, allow_anchor)
            try:
                while True:
                    t = time.perf_counter()
                    last = next(pieces, None)
                    staging += time.perf_counter() - t
                    if last is None:
                        break
                    chosen = self.choose_path(path, last)
                    route = route or last.path
                    t = time.perf_counter()
                    if last.path != "none":
                        written += self._apply(chosen, last, log, reload_names)
                        in_place = in_place or chosen != "reload"
                        tensors.update(last.state.bits if last.path == "anchor" else last.changes())
                    applying += time.perf_counter() - t
                    applied += last.versions_applied
                    fetched += last.bytes_fetched
                t = time.perf_counter()
                if reload_names:
                    written += self._reload_changed(reload_names, reloaded)
                applying += time.perf_counter() - t
            except BaseException as e:
                refused = log.restore()
                if not restored_by(e, refused):
                    self.version, self.host = None, None
                err = failure(e, refused)
                if err is e:
                    raise
                raise err from err.__cause__
            finally:
                pieces.close()
            log.close()
            if in_place and self.resets is not None:
                self.resets()
            assert last is None
            ref = sub.store.ref(step)
            self.version = ref
            self.uri = sub.store.uri
            self._last_sub = sub
            self.path = chosen
            self.last_result = {
                "step": step, "digest": ref.digest, "path": chosen, "route": route, "versions_applied": applied,
                "bytes_fetched": fetched, "elements_written": int(written), "tensors_written": len(tensors),
                "stage_s": round(staging, 6), "apply_s": round(applying, 6),
            }
            return dict(self.last_result)

    def _apply(self, chosen: str, staged: Staged, log: UndoLog, reload_names: list[str]) -> int:
        """Write one staged piece by the ``chosen`` path, its undo in ``log`` first; elements written."""
        if chosen == "reload":
            return self._apply_reload(staged, log, reload_names)
        written = self._apply_native(staged, log) if chosen == "native" else self._apply_sparse(staged, log)
        self._sync_host(staged, log)
        return written

    def _sync_host(self, staged: Staged, log: UndoLog) -> None:
        """Keep the host mirror equal to the served weights after an in-place write (O(changed))."""
        host = self.host
        if host is None:
            return
        undo = log.steps()
        if staged.path == "anchor":
            undo.append(lambda: setattr(self, "host", host))
            self.host = None  # the parameters are the truth now; the reload path would need an anchor
            return
        for name, (pos, bits, orig) in staged.changes().items():
            undo.append(lambda t=host[name], pos=pos, orig=orig: t.__setitem__(pos, orig))
            host[name][pos] = bits
    # -- the in-place paths ----------------------------------------------------------------------
    def _sync(self) -> None:
        if self._device_type() == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _element_undo(self, staged: Staged, log: UndoLog) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The piece's changes, each one's undo (its original bits written back through the map) in ``log``."""
        pmap = self.pmap
        assert pmap is not None
        changes = staged.changes()
        log.steps().extend(lambda name=name, pos=pos, orig=orig: pmap.write(name, pos, orig)
                           for name, (pos, _bits, orig) in changes.items())
        return changes

    def _apply_sparse(self, staged: Staged, log: UndoLog) -> int:
        pmap = self.pmap
        assert pmap is not None
        written = 0
        with torch.no_grad():
            if isinstance(staged.state, FullState):
                journal = log.journal()
                for name, bits in staged.state.bits.items():
                    for b in pmap.blocks.get(name, ()):
                        journal.save(bits_view(pmap.params[b.param]))
                    written += pmap.write_full(name, bits)
                self._sync()
                return written
            for name, (pos, bits, _orig) in self._element_undo(staged, log).items():
                written += pmap.write(name, pos, bits)
            self._sync()
        return written

    def _apply_native(self, staged: Staged, log: UndoLog) -> int:
        """vLLM's ``load_checkpoint_weight_patches`` for the non-NaN float values, our map for the rest,
        then every written element read back and compared bit for bit."""
        assert self.native is not None and self.specs is not None and self.pmap is not None
        patch_cls, load = self.native
        device = next((p.device for p in self.model.parameters() if p.numel()), torch.device("cpu"))
        changes = self._element_undo(staged, log)
        patches, ours = [], []
        for name, (pos, bits, _orig) in changes.items():
            dtype, shape = self.specs[name]
            if not dtype.is_floating_point:
                ours.append((name, pos, bits))
                continue
            nan = torch.isnan(bits.view(dtype))
            keep = ~nan
            if bool(nan.any()):  # NaN means "unchanged" to vLLM's loader: these go through our map
                ours.append((name, pos[nan], bits[nan]))
            if bool(keep.any()):
                patches.append(patch_cls(name, tuple(shape), dtype, bits[keep].view(dtype).to(device),
                                         pos[keep].to(device=device, dtype=torch.int64)))
        written = 0
        with torch.no_grad():
            if patches:
                load(self.model, patches)
            for name, pos, bits in ours:
                self.pmap.write(name, pos, bits)
            self._sync()
            for name, (pos, bits, _orig) in changes.items():
                held, got = self.pmap.gather(name, pos)
                if not bool(torch.equal(got[held], bits[held])):
                    raise ApplyError(f"vLLM's sparse loader wrote {int((got[held] != bits[held]).sum())} "
                                     f"element(s) of {name!r} differently from the staged bits")
                written += int(held.sum())
        return written

    # -- the reload path -------------------------------------------------------------------------
    def _groups_for(self, names: list[str]) -> list[str]:
        """Changed tensors plus every partner loaded into the same vLLM module."""
        assert self.specs is not None
        served = {n.rpartition(".")[0] for n, _ in self.model.named_parameters(remove_duplicate=False)}
        groups = reload_groups(list(self.specs), getattr(self.model, "packed_modules_mapping", None), served)
        if groups is None:
            return list(self.specs)  # unknown module layout: send everything
        send: list[str] = []
        wanted = set(names)
        for members in groups.values():
            if wanted.intersection(members):
                send.extend(members)
        return send

    def _reload(self, host: Mapping[str, torch.Tensor] | None, names: list[str]) -> None:
        if self.reload_fn is None:
            raise ApplyError("no reload function: the reload path needs a vLLM worker")
        if host is None:
            raise ApplyError("no host mirror of the previous weights to reload")
        assert self.specs is not None
        items = [(n, host[n].view(self.specs[n][0]).reshape(self.specs[n][1])) for n in names]
        self.reload_fn(iter(items))
        self._sync()

    def _apply_reload(self, staged: Staged, log: UndoLog, reload_names: list[str]) -> int:
        """An anchor: the new host mirror reloaded whole (undone by reloading the previous one). A delta: the
        host mirror updated (undone element by element); the changed tensors' groups are reloaded once the
        last piece is in (:meth:`_reload_changed`)."""
        undo = log.steps()
        if isinstance(staged.state, FullState):
            old = self.host
            new_host = {n: b.clone() if not b.is_contiguous() else b for n, b in staged.state.bits.items()}
            undo.append(lambda: self._reload(old, list(old or {})))
            self._reload(new_host, list(new_host))
            undo.append(lambda: setattr(self, "host", old))
            self.host = new_host
            return sum(b.numel() for b in new_host.values())
        host = self.host
        if host is None:
            raise TargetMismatchError("the reload path needs a host mirror of the served weights, which this "
                                      "engine no longer has (an in-place anchor replaced it): pull from an anchor")
        changes = staged.changes()
        for name, (pos, bits, orig) in changes.items():
            undo.append(lambda t=host[name], pos=pos, orig=orig: t.__setitem__(pos, orig))
            host[name][pos] = bits
        reload_names += changes
        return 0

    def _reload_changed(self, names: list[str], undo: list[Callable[[], object]]) -> int:
        """Reload the groups of ``names`` from the host mirror (after the pieces updated it); undone by
        reloading them again once the mirror is back (``undo``: a list the log runs after the mirror's undo)."""
        send = self._groups_for(names)
        undo.append(lambda: self._reload(self.host, send))
        self._reload(self.host, send)
        return sum(self.host[n].numel() for n in send)  # type: ignore[index]

    # -- identity and verification ---------------------------------------------------------------
    def identify(self, uri: str, step: int, *, storage_options: dict[str, Any] | None = None,
                 checkpoint_dir: str | None = None, trusted_keys: list[str] | None = None) -> dict[str, Any]:
        """Declare that the engine serves version ``step`` (it was started from its checkpoint),
        after checking every tensor's checksum, so the next pull can take deltas.

        When every tensor can be read in the served parameters they are checked
        there; otherwise the checkpoint files in ``checkpoint_dir`` (default:
        the engine's model directory) are read and checked, and become the host mirror.
        """
        with self.lock:
            sub = self._sub(uri, storage_options or {}, trusted_keys)
            manifest, digest = sub.store.manifest_with_digest(step)
            self.specs = {r.name: (r.spec.dtype, tuple(r.shape)) for r in manifest.tensors}
            path = "sparse" if self.inplace_refusal() is None else "reload"
            if path == "sparse":
                report = self.verify_local(manifest)
                if self._tp_size() > 1:  # each rank holds shards: combine the ranks' partial sums
                    from .client import combine_verify
                    report = combine_verify(_gather_ranks(report))
                    bad = report["bad"] + report["unproven"]
                else:
                    bad = [n for n, r in report["tensors"].items() if r.get("ok") is not True]
                if bad:
                    raise ChecksumMismatchError(f"{len(bad)} served tensor(s) differ from version {step} "
                                                f"or could not be checked: {bad[:5]}")
            else:
                host = read_checkpoint(checkpoint_dir or model_dir(self.vllm_config), self.specs)
                bad = [r.name for r in manifest.tensors if full_checksum(r.name, host[r.name]) != int(r.checksum, 16)]
                if bad:
                    raise ChecksumMismatchError(f"{len(bad)} checkpoint tensor(s) differ from version {step}: "
                                                f"{bad[:5]}")
                self.host = host
            self.version = VersionRef(step, digest)
            self.uri = sub.store.uri
            self._last_sub = sub
            self.path = path
            return {"step": step, "digest": digest, "path": path}

    def verify_local(self, manifest: Any = None) -> dict[str, Any]:
        """Per-tensor checksums of what this worker serves, against the manifest of its version.

        Tensors the forward pass reads from the served parameters are checked
        there (``source: "served"``); the rest (GEMM weights vLLM's CPU build
        computes from packed copies) against the host mirror that was handed
        to ``reload_weights`` (``source: "host"``). Under tensor parallelism a
        worker holds shards: ``ok`` is then None for those tensors and
        :func:`~deltastore.integrations.vllm.combine_verify` combines the workers' partial sums.
        """
        with self.lock:
            if manifest is None:
                if self.version is None or self._last_sub is None:
                    raise VersionNotFoundError("this engine's version is unknown: pull or identify first")
                manifest = self._last_sub.manifest(self.version.step)
            if self.specs is None:
                self.specs = {r.name: (r.spec.dtype, tuple(r.shape)) for r in manifest.tensors}
            try:
                pmap = self.ensure_map()
            except RuntimeError:
                pmap = None
            tensors: dict[str, dict[str, Any]] = {}
            all_ok: bool | None = True
            for rec in manifest.tensors:
                expect = int(rec.checksum, 16)
                entry: dict[str, Any] = {"expected": f"{expect:016x}", "numel": rec.numel}
                blocks = pmap.blocks.get(rec.name) if pmap is not None else None
                if blocks and not any(self._repacked(b.param) for b in blocks):
                    s, count, finger = pmap.partial_checksum(rec.name)
                    entry.update(source="served", partial=f"{s:016x}", count=count, fingerprint=f"{finger:016x}")
                    entry["ok"] = (s == expect) if count == rec.numel else None
                elif self.host is not None and rec.name in self.host:
                    entry.update(source="host", ok=full_checksum(rec.name, self.host[rec.name]) == expect)
                else:
                    entry.update(source="none", ok=None)
                if entry["ok"] is False:
                    all_ok = False
                elif entry["ok"] is None and all_ok is not False:
                    all_ok = None
                tensors[rec.name] = entry
            return {"step": manifest.step, "ok": all_ok, "tensors": tensors,
                    "served": sum(1 for e in tensors.values() if e["source"] == "served"),
                    "host": sum(1 for e in tensors.values() if e["source"] == "host")}

    def describe(self) -> dict[str, Any] | None:
        if self.version is None:
            return None
        return {"step": self.version.step, "digest": self.version.digest, "uri": self.uri, "path": self.path}


def _combine_ranks(held: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine (held, bits) across the tensor-parallel group: each position from any rank that holds it."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group  # type: ignore[import-not-found]

    group = get_tp_group().cpu_group
    vals = torch.where(held, bits.to(torch.int64), torch.zeros((), dtype=torch.int64))
    cnt = held.to(torch.int64)
    dist.all_reduce(vals, group=group)
    dist.all_reduce(cnt, group=group)
    ok = cnt > 0
    out = torch.div(vals, cnt.clamp(min=1), rounding_mode="floor").to(bits.dtype)
    return ok, out


def _gather_ranks(obj: Any) -> list[Any]:
    """``obj`` from every rank of the tensor-parallel group (a collective: all ranks must call it)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group  # type: ignore[import-not-found]

    group = get_tp_group()
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def applier_for(model: torch.nn.Module, vllm_config: Any = None, reload_fn: ReloadFn | None = None, *,
                resets: Callable[[], None] | None = None, prefer: bool = False) -> VllmApplier:
    """The model's applier (created on first use and kept on the model, so the worker extension
    and the weight-transfer backend share one version and one host mirror).

    ``prefer``: replace the applier's reload function and resets with these
    (the worker extension's, which reach the model runner's resets).
    """
    ap = getattr(model, "_deltastore_applier", None)
    if ap is None:
        ap = VllmApplier(model, vllm_config, reload_fn=reload_fn, resets=resets)
        object.__setattr__(model, "_deltastore_applier", ap)
    elif prefer or ap.reload_fn is None:
        if reload_fn is not None:
            ap.reload_fn = reload_fn
        if resets is not None:
            ap.resets = resets
    return ap
