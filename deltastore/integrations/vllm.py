"""vLLM integration: pull versions from a store into a running engine, bit-exactly.

Three ways in, one applier underneath (see ``docs/vllm.md``):

* the worker extension :class:`DeltaStoreWorkerExtension`
  (``--worker-extension-cls deltastore.integrations.vllm.DeltaStoreWorkerExtension``),
  called with ``llm.collective_rpc("deltastore_pull", args=(uri,))`` or the
  client helper :func:`pull`;
* the weight-transfer backend ``"deltastore"``
  (``--weight-transfer-config '{"backend": "deltastore"}'``, registered when
  this module is imported inside a vLLM process), driven by the standard
  ``/start_weight_update`` / ``/update_weights`` / ``/finish_weight_update``
  routes with ``update_info={"uri": ..., "step": ...}``;
* the pull-only :class:`Follower`, which watches a store and applies new
  versions between engine steps (pause in ``keep`` mode, apply, reset the
  prefix cache, resume) — in-process for ``LLM`` or as a sidecar next to
  ``vllm serve`` (``python -m deltastore.integrations.vllm follow ...``).

Two apply paths, chosen per engine (``path="auto"``):

* **sparse** (GPU): the changed elements are written straight into vLLM's own
  parameters — fused (``qkv_proj``, ``gate_up_proj``), tensor-parallel
  shards, padded vocabularies — with ``index_put_`` into the existing storage
  (``data_ptr`` kept for CUDA graphs). The checkpoint -> parameter mapping is
  learned once by probing the model's own ``load_weights``
  (:mod:`.vllm_mapping`). O(changed) work, no host copy of the model.
* **reload** (CPU build, quantized models, anything the probe cannot map):
  a host mirror of the checkpoint tensors is updated and the changed tensors,
  with every partner that loads into the same vLLM module (q/k/v and their
  biases, gate/up), are handed to vLLM's layer-wise ``reload_weights``.

This module imports vLLM only inside functions: importing it needs no vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .. import errors as _errors
from ..checksum import full_checksum
from ..errors import (ApplyError, ChecksumMismatchError, DeltaStoreError, TargetMismatchError,
                      VersionNotFoundError)
from ..manifest import VersionRef
from ..subscriber import Subscriber
from ..tensors import bits_dtype
from .vllm_mapping import ParamMap, probe, reload_groups
from .vllm_stage import Staged, stage

log = logging.getLogger("deltastore.vllm")


def _wlog() -> logging.Logger:
    """Inside vLLM, log under its ``vllm`` logger tree so messages reach the server's log."""
    return logging.getLogger("vllm.deltastore") if "vllm" in sys.modules else log

PATHS = ("auto", "sparse", "reload")
Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


# -- small coercions: HTTP /collective_rpc passes strings only ----------------------------------
def _as_int(v: Any) -> int | None:
    if v is None or v == "" or (isinstance(v, str) and v.lower() in ("none", "null", "latest")):
        return None
    return int(v)


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _as_dict(v: Any) -> dict[str, Any]:
    if v is None or v == "":
        return {}
    if isinstance(v, str):
        v = json.loads(v)
    if not isinstance(v, dict):
        raise TypeError(f"storage_options must be a dict or a JSON object, got {type(v).__name__}")
    return dict(v)


def _error_dict(e: BaseException) -> dict[str, str]:
    return {"type": type(e).__name__, "message": str(e)}


def raise_error(err: Mapping[str, str]) -> None:
    """Re-raise a worker's error (``{"type", "message"}``) as the matching deltastore error type."""
    cls = getattr(_errors, str(err.get("type", "")), None)
    if not (isinstance(cls, type) and issubclass(cls, DeltaStoreError)):
        cls = ApplyError if err.get("type") else DeltaStoreError
        raise cls(f"{err.get('type')}: {err.get('message')}")
    raise cls(err.get("message", ""))


# -- the applier ---------------------------------------------------------------------------------
class VllmApplier:
    """Applies store versions to one vLLM worker's model. One per model (see :func:`applier_for`).

    Args:
        model: the worker's ``nn.Module`` (``model_runner.get_model()``).
        vllm_config: the worker's ``VllmConfig`` (None in unit tests).
        reload_fn: ``reload_fn(iterable of (checkpoint name, tensor))``: vLLM's
            layer-wise reload of a subset of checkpoint tensors.
        path: ``"auto"``, ``"sparse"`` or ``"reload"`` (env ``DELTASTORE_VLLM_PATH``).
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any = None, *,
                 reload_fn: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
                 path: str | None = None):
        self.model = model
        self.vllm_config = vllm_config
        self.reload_fn = reload_fn
        self.default_path = path or os.environ.get("DELTASTORE_VLLM_PATH", "auto")
        if self.default_path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.default_path!r}")
        self.version: VersionRef | None = None
        self.uri: str | None = None
        self.path: str | None = None          # path that applied the current version
        self.specs: Specs | None = None       # checkpoint tensors (from the first manifest)
        self.host: dict[str, torch.Tensor] | None = None  # reload path: flat bits per checkpoint tensor
        self.pmap: ParamMap | None = None
        self._probed = False
        self._subs: dict[tuple[str, str], Subscriber] = {}
        self._prefetched: tuple[tuple[Any, ...], Staged] | None = None
        self._last_sub: Subscriber | None = None
        self.lock = threading.RLock()
        self.allow_cpu_sparse = False  # tests only: CPU tensors that are not repacked
        self.last_result: dict[str, Any] | None = None

    # -- environment ---------------------------------------------------------------------------
    def _sub(self, uri: str, storage_options: dict[str, Any]) -> Subscriber:
        key = (uri, json.dumps(storage_options, sort_keys=True, default=str))
        sub = self._subs.get(key)
        if sub is None:
            sub = self._subs[key] = Subscriber(uri, storage_options=storage_options)
        return sub

    def _device_type(self) -> str:
        for p in self.model.parameters():
            if p.numel():
                return p.device.type
        return "cpu"

    def _tp_size(self) -> int:
        pc = getattr(self.vllm_config, "parallel_config", None)
        return int(getattr(pc, "tensor_parallel_size", 1) or 1)

    def _sparse_refusal(self) -> str | None:
        """Why the sparse in-place path cannot serve this engine (None: it can)."""
        if self._device_type() == "cpu" and not self.allow_cpu_sparse:
            return "vLLM's CPU build repacks linear weights after loading (element-wise writes need a GPU)"
        mc = getattr(self.vllm_config, "model_config", None)
        if getattr(mc, "quantization", None):
            return f"quantized weights ({mc.quantization}) cannot be patched element-wise"
        pc = getattr(self.vllm_config, "parallel_config", None)
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
            return "pipeline parallelism: a stage cannot verify the tensors of other stages"
        if self.pmap is not None and self.pmap.unmapped:
            name, why = next(iter(self.pmap.unmapped.items()))
            return f"{len(self.pmap.unmapped)} tensor(s) cannot be mapped, e.g. {name!r}: {why}"
        if self.pmap is not None:
            missing = [n for n, b in self.pmap.blocks.items() if not b]
            if missing:
                return f"{len(missing)} tensor(s) are not loaded by the model, e.g. {missing[0]!r}"
        return None

    def ensure_map(self) -> ParamMap | None:
        """Probe the model's loader once (needs the checkpoint specs from a manifest)."""
        if not self._probed and self.specs is not None:
            params = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
            with torch.no_grad():
                self.pmap = probe(self.model.load_weights, params, self.specs)
            self._probed = True
        return self.pmap

    def choose_path(self, requested: str | None) -> str:
        req = requested or self.default_path
        if req not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {req!r}")
        if req == "reload":
            return "reload"
        why = self._sparse_refusal()
        if why is None:
            self.ensure_map()
            why = self._sparse_refusal()
        if why is None:
            return "sparse"
        if req == "sparse":
            raise TargetMismatchError(f"the sparse in-place path is not available: {why}")
        return "reload"

    # -- readers -------------------------------------------------------------------------------
    def _host_reader(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        assert self.host is not None
        return self.host[name] if positions is None else self.host[name][positions]

    def _sparse_reader(self, name: str, positions: torch.Tensor | None) -> torch.Tensor:
        assert self.pmap is not None
        if positions is None:  # an old-tensor codec: O(tensor) gather from the served parameters
            positions = torch.arange(self.pmap.numel(name))
        held, bits = self.pmap.gather(name, positions)
        if self._tp_size() > 1:
            held, bits = _combine_ranks(held, bits)
        if not bool(held.all()):
            raise TargetMismatchError(f"{int((~held).sum())} changed element(s) of {name!r} are held by no worker")
        return bits

    # -- pulling -------------------------------------------------------------------------------
    def _prepare(self, sub: Subscriber, step: int | None) -> int:
        if step is None:
            step = sub.latest()
            if step is None:
                raise VersionNotFoundError(f"{sub.store.uri} holds no versions yet")
        if self.specs is None:
            m = sub.manifest(step)
            self.specs = {r.name: (r.spec.dtype, tuple(r.shape)) for r in m.tensors}
        return step

    def _stage(self, sub: Subscriber, step: int, allow_anchor: bool, path: str) -> Staged:
        if path == "sparse":
            reader = self._sparse_reader if self.version is not None else None
        else:
            reader = self._host_reader if (self.host is not None and self.version is not None) else None
        key = (sub.store.uri, step, allow_anchor, path, self.version)
        if self._prefetched is not None and self._prefetched[0] == key:
            staged = self._prefetched[1]
        else:
            staged = stage(sub, self.version if reader else None, reader, step, allow_anchor=allow_anchor,
                           specs=self.specs)
        self._prefetched = None
        return staged

    def prefetch(self, uri: str, step: int | None = None, *, allow_anchor: bool = True, path: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Fetch, verify and decode the way to ``step`` without touching the model.

        A following :meth:`pull` of the same step applies it without fetching
        again, so a server is paused only for the writes.
        """
        with self.lock:
            sub = self._sub(uri, storage_options or {})
            step = self._prepare(sub, step)
            chosen = self.choose_path(path)
            staged = self._stage(sub, step, allow_anchor, chosen)
            self._prefetched = ((sub.store.uri, step, allow_anchor, chosen, self.version), staged)
            return {"step": staged.step, "route": staged.route, "bytes_fetched": staged.bytes_fetched,
                    "elements": staged.elements()}

    def pull(self, uri: str, step: int | None = None, *, allow_anchor: bool = True, path: str | None = None,
             storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Bring the served weights to version ``step`` (default: latest). All or nothing.

        Raises the typed errors of :meth:`deltastore.Subscriber.pull`; on any
        error the engine keeps serving its previous version.
        """
        with self.lock:
            t0 = time.perf_counter()
            sub = self._sub(uri, storage_options or {})
            step = self._prepare(sub, step)
            chosen = self.choose_path(path)
            staged = self._stage(sub, step, allow_anchor, chosen)
            t1 = time.perf_counter()
            if staged.route == "none":
                written = 0
            elif chosen == "sparse":
                written = self._apply_sparse(staged)
            else:
                written = self._apply_reload(staged)
            t2 = time.perf_counter()
            if chosen == "sparse":
                self.host = None  # the parameters are the truth now; a stale mirror must not be trusted
            self.version = staged.ref
            self.uri = sub.store.uri
            self._last_sub = sub
            self.path = chosen
            self.last_result = {
                "step": staged.step, "digest": staged.ref.digest, "path": chosen, "route": staged.route,
                "versions_applied": list(staged.versions_applied), "bytes_fetched": staged.bytes_fetched,
                "elements_written": int(written),
                "tensors_written": (len(staged.pending) if staged.route == "delta"
                                    else len(staged.full or {}) if staged.route == "anchor" else 0),
                "stage_s": round(t1 - t0, 6), "apply_s": round(t2 - t1, 6),
            }
            return dict(self.last_result)

    # -- the two paths -------------------------------------------------------------------------
    def _sync(self) -> None:
        if self._device_type() == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _apply_sparse(self, staged: Staged) -> int:
        pmap = self.pmap
        assert pmap is not None
        written = 0
        with torch.no_grad():
            if staged.route == "anchor":
                assert staged.full is not None
                backups: list[tuple[torch.Tensor, torch.Tensor]] = []
                try:
                    for name, bits in staged.full.items():
                        for pv in pmap.param_views(name):
                            backups.append((pv, pv.to("cpu", copy=True)))
                        written += pmap.write_full(name, bits)
                    self._sync()
                except Exception as e:
                    for pv, old in reversed(backups):
                        pv.copy_(old.to(pv.device))
                    raise ApplyError(f"writing into the served parameters failed ({e!r}); "
                                     "the previous weights were restored") from e
                return written
            done: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            try:
                for name, (pos, bits, orig) in staged.pending.items():
                    done.append((name, pos, orig))
                    written += pmap.write(name, pos, bits)
                self._sync()
            except Exception as e:
                for name, pos, orig in reversed(done):
                    pmap.write(name, pos, orig)
                raise ApplyError(f"writing into the served parameters failed ({e!r}); "
                                 "the previous weights were restored") from e
        return written

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

    def _reload(self, host: Mapping[str, torch.Tensor], names: list[str]) -> None:
        if self.reload_fn is None:
            raise ApplyError("no reload function: the reload path needs a vLLM worker")
        assert self.specs is not None
        items = [(n, host[n].view(self.specs[n][0]).reshape(self.specs[n][1])) for n in names]
        self.reload_fn(iter(items))
        self._sync()

    def _apply_reload(self, staged: Staged) -> int:
        if staged.route == "anchor":
            assert staged.full is not None
            new_host = {n: b.clone() if not b.is_contiguous() else b for n, b in staged.full.items()}
            try:
                self._reload(new_host, list(new_host))
            except Exception as e:
                if self.host is not None:
                    try:
                        self._reload(self.host, list(self.host))
                    except Exception:
                        log.exception("deltastore: restoring the previous weights failed too")
                raise ApplyError(f"reloading the weights failed ({e!r}); the previous weights were "
                                 "reloaded") from e
            self.host = new_host
            return sum(b.numel() for b in new_host.values())
        assert self.host is not None
        changed = list(staged.pending)
        for name, (pos, bits, _orig) in staged.pending.items():
            self.host[name][pos] = bits
        send = self._groups_for(changed)
        try:
            self._reload(self.host, send)
        except Exception as e:
            for name, (pos, _bits, orig) in staged.pending.items():
                self.host[name][pos] = orig
            try:
                self._reload(self.host, send)
            except Exception:
                log.exception("deltastore: restoring the previous weights failed too")
            raise ApplyError(f"reloading the changed tensors failed ({e!r}); the previous weights were "
                             "reloaded") from e
        return sum(self.host[n].numel() for n in send)

    # -- identity and verification ---------------------------------------------------------------
    def identify(self, uri: str, step: int, *, storage_options: dict[str, Any] | None = None,
                 checkpoint_dir: str | None = None) -> dict[str, Any]:
        """Declare that the engine serves version ``step`` (it was started from its checkpoint),
        after checking every tensor's checksum, so the next pull can take deltas.

        Sparse path: the served parameters are checked. Reload path: the
        checkpoint files in ``checkpoint_dir`` (default: the engine's model
        directory) are read and checked, and become the host mirror.
        """
        with self.lock:
            sub = self._sub(uri, storage_options or {})
            manifest, digest = sub.store.manifest_with_digest(step)
            self.specs = {r.name: (r.spec.dtype, tuple(r.shape)) for r in manifest.tensors}
            path = self.choose_path(None)
            if path == "sparse":
                report = self.verify_local(manifest)
                if self._tp_size() > 1:  # each rank holds shards: combine the ranks' partial sums
                    report = combine_verify(_gather_ranks(report))
                    bad = report["bad"] + report["unproven"]
                else:
                    bad = [n for n, r in report["tensors"].items() if r.get("ok") is not True]
                if bad:
                    raise ChecksumMismatchError(f"{len(bad)} served tensor(s) differ from version {step} "
                                                f"or could not be checked: {bad[:5]}")
            else:
                host = _read_checkpoint(checkpoint_dir or _model_dir(self.vllm_config), self.specs)
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

        Tensors readable in the served parameters are checked there
        (``source: "served"``); the rest (linear weights repacked by the CPU
        build) against the host mirror that was handed to ``reload_weights``
        (``source: "host"``). Under tensor parallelism a worker holds shards:
        ``ok`` is then None for those tensors and :func:`combine_verify`
        combines the workers' partial sums.
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
                if blocks:
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


def _model_dir(vllm_config: Any) -> str:
    path = getattr(getattr(vllm_config, "model_config", None), "model", None)
    if not path or not os.path.isdir(path):
        raise VersionNotFoundError(f"the engine's model {path!r} is not a local directory; pass checkpoint_dir= "
                                   "or pull without identify (the first pull then loads a whole version)")
    return path


def _read_checkpoint(path: str, specs: Specs) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for name in st.keys():
                if name in specs:
                    t = st.get_tensor(name)
                    out[name] = t.contiguous().reshape(-1).view(bits_dtype(t.dtype)).clone()
    missing = [n for n in specs if n not in out]
    if missing:
        raise TargetMismatchError(f"checkpoint {path} lacks {len(missing)} tensor(s) of the version: {missing[:5]}")
    for n, (dtype, shape) in specs.items():
        if out[n].dtype != bits_dtype(dtype) or out[n].numel() != _numel(shape):
            raise TargetMismatchError(f"checkpoint tensor {n!r} does not match the version's {dtype}{list(shape)}")
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def applier_for(model: torch.nn.Module, vllm_config: Any = None,
                reload_fn: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None) -> VllmApplier:
    """The model's applier (created on first use and kept on the model, so the worker extension
    and the weight-transfer backend share one version and one host mirror)."""
    ap = getattr(model, "_deltastore_applier", None)
    if ap is None:
        ap = VllmApplier(model, vllm_config, reload_fn=reload_fn)
        object.__setattr__(model, "_deltastore_applier", ap)
    elif reload_fn is not None and ap.reload_fn is None:
        ap.reload_fn = reload_fn
    return ap


def vllm_reload_fn(model: torch.nn.Module, vllm_config: Any) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Any]:
    """vLLM's layer-wise in-place reload of a subset of checkpoint tensors."""
    def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]
        from vllm.model_executor.model_loader.reload import reload_weights  # type: ignore[import-not-found]

        with set_current_vllm_config(vllm_config):
            reload_weights(vllm_config, model, weights_iterator=weights, weights_path=None,
                           is_checkpoint_format=True)
    return reload


# -- the worker extension ------------------------------------------------------------------------
class DeltaStoreWorkerExtension:
    """Mixed into every vLLM worker by ``--worker-extension-cls``.

    Every method is prefixed ``deltastore_`` (vLLM refuses extension names
    that clash with the worker's). Arguments are plain data; strings are
    accepted everywhere so the HTTP ``/collective_rpc`` route works too.
    """

    def _deltastore_applier(self) -> VllmApplier:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        vllm_config = getattr(self, "vllm_config", None)

        def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]

        return applier_for(model, vllm_config, reload)

    def deltastore_pull(self, uri: str, step: int | str | None = None, allow_anchor: bool | str = True,
                        path: str | None = None, storage_options: dict[str, Any] | str | None = None,
                        raise_errors: bool | str = True) -> dict[str, Any]:
        """Apply version ``step`` (default: latest) of the store at ``uri``; returns what was done.

        With ``raise_errors=False`` an error comes back as ``{"error": {"type",
        "message"}}`` (exception types do not survive vLLM's RPC); the engine
        keeps its previous version either way.
        """
        try:
            out = self._deltastore_applier().pull(uri, _as_int(step), allow_anchor=_as_bool(allow_anchor),
                                                  path=path or None, storage_options=_as_dict(storage_options))
            _wlog().info("deltastore: serving step %d (%s path, %s route, %d elements written, apply %.3fs)",
                     out["step"], out["path"], out["route"], out["elements_written"], out["apply_s"])
            return out
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            _wlog().warning("deltastore: pull of %s step %s failed, still serving the previous version: %s: %s",
                        uri, step, type(e).__name__, e)
            return {"error": _error_dict(e), "version": self._deltastore_applier().describe()}

    def deltastore_prefetch(self, uri: str, step: int | str | None = None, allow_anchor: bool | str = True,
                            path: str | None = None, storage_options: dict[str, Any] | str | None = None,
                            raise_errors: bool | str = True) -> dict[str, Any]:
        """Fetch and verify the way to ``step`` without touching the weights (no pause needed)."""
        try:
            return self._deltastore_applier().prefetch(uri, _as_int(step), allow_anchor=_as_bool(allow_anchor),
                                                       path=path or None, storage_options=_as_dict(storage_options))
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            return {"error": _error_dict(e)}

    def deltastore_identify(self, uri: str, step: int | str, storage_options: dict[str, Any] | str | None = None,
                            checkpoint_dir: str | None = None, raise_errors: bool | str = True) -> dict[str, Any]:
        """Declare (after checking checksums) that the engine was started from version ``step``."""
        try:
            return self._deltastore_applier().identify(uri, int(step), storage_options=_as_dict(storage_options),
                                                       checkpoint_dir=checkpoint_dir or None)
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            return {"error": _error_dict(e)}

    def deltastore_version(self) -> dict[str, Any] | None:
        """``{"step", "digest", "uri", "path"}`` of the served version, or None if unknown."""
        return self._deltastore_applier().describe()

    def deltastore_verify(self, raise_errors: bool | str = True) -> dict[str, Any]:
        """Per-tensor checksums of the served weights against the manifest (see :meth:`VllmApplier.verify_local`)."""
        try:
            return self._deltastore_applier().verify_local()
        except Exception as e:
            if _as_bool(raise_errors):
                raise
            return {"error": _error_dict(e)}


# -- client side: helpers for an in-process LLM ----------------------------------------------------
def _results(results: list[Any]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        if isinstance(r, dict) and "error" in r and isinstance(r["error"], dict):
            raise_error(r["error"])
        out.append(r)
    return out


def pull(llm: Any, uri: str, step: int | None = None, *, allow_anchor: bool = True, path: str | None = None,
         storage_options: dict[str, Any] | None = None, reset_prefix_cache: bool = True) -> dict[str, Any]:
    """Apply a version on every worker of ``llm`` (a ``vllm.LLM`` started with the extension).

    Re-raises a worker's error with its deltastore type. After a successful
    apply the prefix cache is reset and the engine's weight version is set to
    ``"<step>"``. Returns worker 0's result.
    """
    res = _results(llm.collective_rpc("deltastore_pull", kwargs={
        "uri": uri, "step": step, "allow_anchor": allow_anchor, "path": path,
        "storage_options": storage_options or {}, "raise_errors": False}))
    steps = {r["step"] for r in res}
    if len(steps) != 1:
        raise ApplyError(f"workers disagree on the applied version: {sorted(steps)}")
    if reset_prefix_cache:
        llm.reset_prefix_cache()
    _set_weight_version(llm, str(res[0]["step"]))
    return res[0]


def _set_weight_version(llm: Any, label: str) -> None:
    eng = getattr(llm, "llm_engine", None)
    fn = getattr(eng, "set_weight_version", None)
    if fn is not None:
        try:
            fn(label)
        except Exception:  # older vLLM: no weight version
            log.debug("could not set the weight version", exc_info=True)


def version(llm: Any) -> dict[str, Any] | None:
    """Worker 0's ``deltastore_version()``."""
    return llm.collective_rpc("deltastore_version")[0]


def combine_verify(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the workers' ``deltastore_verify()`` reports into one verdict.

    A tensor is proven when one worker saw all of it, or when the workers'
    partial sums over distinct position sets (tensor-parallel shards;
    replicated shards counted once) add up to the whole tensor.
    """
    results = _results(results)
    steps = {r["step"] for r in results}
    if len(steps) != 1:
        return {"ok": False, "bad": [], "reason": f"workers serve different versions {sorted(steps)}"}
    names = list(results[0]["tensors"])
    bad, unproven = [], []
    for name in names:
        entries = [r["tensors"][name] for r in results]
        if any(e.get("ok") is False for e in entries):
            bad.append(name)
            continue
        if any(e.get("ok") is True for e in entries):
            continue
        served = [e for e in entries if e.get("source") == "served"]
        if not served:
            unproven.append(name)
            continue
        distinct: dict[str, tuple[int, int]] = {}
        for e in served:
            distinct[e["fingerprint"]] = (int(e["partial"], 16), int(e["count"]))
        total = sum(s for s, _ in distinct.values()) & ((1 << 64) - 1)
        count = sum(c for _, c in distinct.values())
        if count != entries[0]["numel"]:
            unproven.append(name)
        elif total != int(entries[0]["expected"], 16):
            bad.append(name)
    return {"ok": not bad and not unproven, "step": steps.pop(), "bad": bad, "unproven": unproven,
            "served": results[0].get("served", 0), "host": results[0].get("host", 0)}


def verify(llm: Any) -> dict[str, Any]:
    """Check the served weights of every worker against the manifest; raises
    :class:`ChecksumMismatchError` naming the differing tensors."""
    report = combine_verify(llm.collective_rpc("deltastore_verify", kwargs={"raise_errors": False}))
    if report["bad"]:
        raise ChecksumMismatchError(f"{len(report['bad'])} served tensor(s) differ from version "
                                    f"{report.get('step')}: {report['bad'][:5]}")
    if report["unproven"]:
        raise ChecksumMismatchError(f"{len(report['unproven'])} tensor(s) could not be checked: "
                                    f"{report['unproven'][:5]}")
    return report


# -- the pull-only follower -------------------------------------------------------------------------
class LLMControl:
    """Follower control for an in-process ``vllm.LLM`` (call :meth:`Follower.poll_once` between
    ``generate`` calls, or run the follower thread while no other thread drives the engine)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def pause(self) -> None:  # an offline LLM runs nothing between generate() calls
        pass

    def resume(self) -> None:
        pass

    def prefetch(self, uri: str, step: int, storage_options: dict[str, Any]) -> None:
        _results(self.llm.collective_rpc("deltastore_prefetch", kwargs={
            "uri": uri, "step": step, "storage_options": storage_options, "raise_errors": False}))

    def apply(self, uri: str, step: int, storage_options: dict[str, Any]) -> dict[str, Any]:
        return pull(self.llm, uri, step, storage_options=storage_options, reset_prefix_cache=False)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def set_version(self, label: str) -> None:
        _set_weight_version(self.llm, label)

    def served(self) -> dict[str, Any] | None:
        return version(self.llm)


class HTTPControl:
    """Follower control for a ``vllm serve`` process over its HTTP routes.

    transport ``"rpc"`` uses ``/collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``
    and the worker extension); ``"weight-transfer"`` uses the standard
    ``/start_weight_update`` / ``/update_weights`` / ``/finish_weight_update``
    routes (needs ``--weight-transfer-config '{"backend": "deltastore"}'``).
    """

    def __init__(self, base_url: str, *, transport: str = "rpc", timeout: float = 600.0,
                 api_key: str | None = None):
        if transport not in ("rpc", "weight-transfer"):
            raise ValueError("transport must be 'rpc' or 'weight-transfer'")
        self.base = base_url.rstrip("/")
        self.transport = transport
        self.timeout = timeout
        self.api_key = api_key or os.environ.get("VLLM_API_KEY")
        self._warned_cache = False

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + route, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        out = self._call("POST", "/collective_rpc", {"method": method, "kwargs": {
            k: (v if isinstance(v, str) else json.dumps(v)) for k, v in kwargs.items()}})
        return (out or {}).get("results", [])

    def pause(self) -> None:
        self._call("POST", "/pause?mode=keep")

    def resume(self) -> None:
        self._call("POST", "/resume")

    def prefetch(self, uri: str, step: int, storage_options: dict[str, Any]) -> None:
        if self.transport == "rpc":
            _results(self._rpc("deltastore_prefetch", {"uri": uri, "step": str(step),
                                                       "storage_options": storage_options, "raise_errors": "false"}))

    def apply(self, uri: str, step: int, storage_options: dict[str, Any]) -> dict[str, Any]:
        if self.transport == "rpc":
            res = _results(self._rpc("deltastore_pull", {"uri": uri, "step": str(step),
                                                         "storage_options": storage_options,
                                                         "raise_errors": "false"}))
            return res[0]
        self._call("POST", "/start_weight_update")
        try:
            self._call("POST", "/update_weights", {"update_info": {"uri": uri, "step": step,
                                                                   "storage_options": storage_options}})
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:2000]
            try:  # vLLM already ended the session on the failure; make sure it is closed
                self._call("POST", "/finish_weight_update", {})
            except urllib.error.HTTPError:
                pass
            raise ApplyError(f"/update_weights failed ({e.code}); the server keeps its previous version: "
                             f"{body}") from e
        self._call("POST", "/finish_weight_update", {"weight_version": str(step)})
        return {"step": step}

    def reset_prefix_cache(self) -> None:
        try:
            self._call("POST", "/reset_prefix_cache")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            if not self._warned_cache:
                log.warning("deltastore: /reset_prefix_cache is not served (set VLLM_SERVER_DEV_MODE=1); "
                            "prefix-cache entries computed with older weights may be reused")
                self._warned_cache = True

    def set_version(self, label: str) -> None:
        try:
            self._call("POST", "/update_weight_version", {"new_version": label})
        except urllib.error.HTTPError:
            pass

    def served(self) -> dict[str, Any] | None:
        if self.transport != "rpc":
            return None
        res = self._rpc("deltastore_version", {})
        return res[0] if res else None


class Follower:
    """Watch a store and keep an engine on its newest version. No trainer connection needed.

    Args:
        control: :class:`LLMControl` or :class:`HTTPControl` (anything with
            pause/resume/prefetch/apply/reset_prefix_cache/set_version).
        uri: the store.
        poll_interval: seconds between listings of the store.
        max_lag: versions the engine may trail the newest before it applies
            (0: apply every new version as soon as it is seen; 2: apply every
            third one, fewer pauses at the cost of staleness).
        max_wait: seconds a newer version may wait under ``max_lag`` before it is applied anyway.
        status_file: if set, the served version is written there as JSON after every apply.
    """

    def __init__(self, control: Any, uri: str, *, poll_interval: float = 5.0, max_lag: int = 0,
                 max_wait: float | None = None, storage_options: dict[str, Any] | None = None,
                 status_file: str | None = None):
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        if max_lag < 0:
            raise ValueError("max_lag must be >= 0")
        self.control = control
        self.uri = uri
        self.poll_interval = poll_interval
        self.max_lag = max_lag
        self.max_wait = max_wait
        self.storage_options = dict(storage_options or {})
        self.status_file = status_file
        self.sub = Subscriber(uri, storage_options=self.storage_options)
        self.served_step: int | None = None
        self.last_pause_s: float | None = None
        self.last_error: dict[str, str] | None = None
        self.applied = 0
        self._first_seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            cur = control.served()
            if cur and cur.get("step") is not None:
                self.served_step = int(cur["step"])
        except Exception:
            log.debug("could not read the served version", exc_info=True)

    def status(self) -> dict[str, Any]:
        latest = self.sub.latest()
        return {"uri": self.uri, "served_step": self.served_step, "latest_step": latest,
                "lag": self._lag(latest), "applied": self.applied, "last_pause_s": self.last_pause_s,
                "last_error": self.last_error}

    def _lag(self, latest: int | None) -> int:
        if latest is None:
            return 0
        steps = self.sub.versions()
        return sum(1 for s in steps if self.served_step is None or s > self.served_step)

    def poll_once(self) -> dict[str, Any] | None:
        """Apply the newest version if the lag rules say so; returns the apply result or None."""
        steps = self.sub.versions()
        if not steps:
            return None
        latest = steps[-1]
        if self.served_step is not None and latest <= self.served_step:
            return None
        lag = sum(1 for s in steps if self.served_step is None or s > self.served_step)
        now = time.monotonic()
        self._first_seen.setdefault(latest, now)
        waited_out = self.max_wait is not None and now - min(self._first_seen.values()) >= self.max_wait
        if self.served_step is not None and lag <= self.max_lag and not waited_out:
            return None
        return self.apply(latest)

    def apply(self, step: int) -> dict[str, Any]:
        """Prefetch (engine running), then pause in keep mode, apply, reset the prefix cache, resume."""
        try:
            self.control.prefetch(self.uri, step, self.storage_options)
        except Exception as e:  # a bad version: keep serving, report
            self.last_error = _error_dict(e)
            raise
        t0 = time.perf_counter()
        self.control.pause()
        try:
            result = self.control.apply(self.uri, step, self.storage_options)
            self.control.reset_prefix_cache()
        except Exception as e:
            self.last_error = _error_dict(e)
            raise
        finally:
            self.control.resume()
            self.last_pause_s = time.perf_counter() - t0
        self.control.set_version(str(step))
        self.served_step = step
        self.applied += 1
        self.last_error = None
        self._first_seen = {s: t for s, t in self._first_seen.items() if s > step}
        log.info("deltastore: serving step %d from %s (paused %.3fs)", step, self.uri, self.last_pause_s)
        if self.status_file:
            tmp = self.status_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"served_step": step, "uri": self.uri, "pause_s": self.last_pause_s,
                           "time": time.time(), "result": result}, f)
            os.replace(tmp, self.status_file)
        return result

    def run(self) -> None:
        """Poll until :meth:`stop`; errors are logged and the engine keeps its version."""
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:
                log.warning("deltastore: follower could not apply (still serving step %s): %s: %s",
                            self.served_step, type(e).__name__, e)
            self._stop.wait(self.poll_interval)

    def start(self) -> threading.Thread:
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="deltastore-follower", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


# -- weight-transfer backend registration ------------------------------------------------------------
def register_weight_transfer_backend() -> bool:
    """Register the ``"deltastore"`` weight-transfer backend with vLLM (idempotent).

    Happens automatically when this module is imported in a process that has
    imported vLLM (every worker started with the extension). Returns False
    when the installed vLLM has no weight-transfer API.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # type: ignore
    except ImportError:
        return False
    if "deltastore" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("deltastore", "deltastore.integrations.vllm_engine",
                                                    "DeltaStoreWeightTransferEngine")
    return True


if "vllm" in sys.modules:
    try:
        register_weight_transfer_backend()
    except Exception:  # never break a worker over an optional backend
        log.debug("could not register the deltastore weight-transfer backend", exc_info=True)


# -- command line: the sidecar follower ----------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltastore.integrations.vllm",
                                 description="deltastore tools for vLLM servers")
    sp = ap.add_subparsers(dest="cmd", required=True)
    f = sp.add_parser("follow", help="keep a running vllm serve on the newest version of a store")
    f.add_argument("--server", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    f.add_argument("--uri", required=True, help="the store")
    f.add_argument("--poll-interval", type=float, default=5.0)
    f.add_argument("--max-lag", type=int, default=0)
    f.add_argument("--max-wait", type=float, default=None)
    f.add_argument("--transport", choices=("rpc", "weight-transfer"), default="rpc")
    f.add_argument("--storage-options", default="{}", help="JSON object for the store backend")
    f.add_argument("--status-file", default=None)
    f.add_argument("--once", action="store_true", help="apply the newest version once and exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    control = HTTPControl(args.server, transport=args.transport)
    fol = Follower(control, args.uri, poll_interval=args.poll_interval, max_lag=args.max_lag,
                   max_wait=args.max_wait, storage_options=_as_dict(args.storage_options),
                   status_file=args.status_file)
    if args.once:
        res = fol.poll_once()
        print(json.dumps(res if res is not None else fol.status()))
        return 0
    try:
        fol.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
