"""Reference senders and receivers of the weight-sync formats RL frameworks ship, for ``bench/peers.py``.

Each reference is written from the peer's own source (read, not copied) and does what the peer does on
every step, on CPU tensors:

* on the sender (:meth:`PeerSync.send`): its change detection against the snapshot it keeps, its payload and
  serialisation, its compression and integrity data, and its snapshot update;
* on the receiver (:meth:`PeerSync.receive`): its integrity check, decompression, decoding, and its apply into
  the receiver's tensors (``{name: bf16 tensor}``, written in place).

Per reference, the source read, then what it does (detection; payload; snapshot update):

* ``trl-raw``, ``trl-gap_delta``: TRL's ``delta-weight-sync-v3`` branch (``async_grpo/delta_codec.py``,
  ``delta_engine.py``; the detector of ``-v2``'s ``weight_diff.BF16ChangeDetector``). bf16 ``!=`` against a
  pre-step clone; safetensors ``{name}.idx`` (int32, or gaps-1 as uint16 / uint32 per tensor) and
  ``{name}.val`` bf16; a fresh clone of every tensor.
* ``grail``: grail's ``infrastructure/delta_checkpoint.py`` and ``sparse_codec.py`` (v2).
  ``(new.float() - old.float()) != 0``; one zstd-1 frame of a JSON header and per tensor int32
  first-difference positions and raw bf16 values, plus the sha256 of the whole model; a copy of every tensor.
* ``nemo-xor``, ``nemo-overwrite``: NeMo-RL's ``utils/weight_transfer_sparse_codec.py``,
  ``utils/weight_transfer_stream.py`` and ``models/generation/vllm/vllm_sparse_delta.py``. Integer-view
  ``ne`` + ``nonzero``; gaps-1 as uint16/32/64 (or a range) and XOR'd or new bits in one zstd-1 frame, with
  the frame's blake2b-128; ``index_copy_`` at the changed positions.
* ``slime-xor``, ``slime-overwrite`` (Miles is the same code): slime's ``utils/disk_delta.py`` and
  ``megatron_utils/update_weight/update_weight_from_disk_delta.py``. Byte-level XOR (or ``!=``) of the
  whole tensor; per changed tensor a zstd-1 frame of the dense byte XOR (or u4 byte positions and the bytes),
  in safetensors, with the xxh3-128 of the new tensor; the new tensor's bytes.
* ``skyrl``: SkyRL's ``weight_sync/delta_checkpoint.py`` and ``delta_payload.py``. Byte XOR of the whole
  tensor; per changed tensor a zstd-1 frame of the dense byte XOR, in safetensors, and a JSON manifest with the
  xxh3-128 of the new tensor; XOR in place.
* ``vllm-patch``: vLLM's ``weight_transfer/base.py`` (``SparseWeightPatch``) and ``apply_sparse_patch``.
  None in vLLM: the reference compares integer views (``ne`` + ``nonzero``); int32 (int64 from 2**31
  elements) flat indices and raw values, names/shapes/counts as JSON; ``index_copy_`` at the changed
  positions.

Where the peer's receiver is not in the source read (slime/Miles apply inside SGLang's ``/pull_weights``), the
reference applies what the format says (decompress, XOR or scatter the bytes, check the xxh3-128).
Departures, each small against the figures and stated: NeMo-RL serialises its payload with ``torch.save``
(pickle); here it is safetensors + JSON, as nothing in this project crosses a store as pickle. A peer whose
trainer copies device tensors to host memory (slime, SkyRL) pays that copy here as a host copy. Thread pools
over tensors (NeMo-RL, slime, SkyRL) are capped at the ``threads`` the benchmark runs with. Receivers that
run on the GPU in the peer (NeMo-RL's dense scratch and masked XOR under vLLM's loader, vLLM's
``index_copy_``) run here on CPU tensors: the figures are the CPU cost of their algorithms, not of their GPU
kernels.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash
import zstandard
from safetensors.numpy import load as np_load
from safetensors.numpy import save as np_save
from safetensors.torch import load as pt_load
from safetensors.torch import save as pt_save

State = dict[str, torch.Tensor]

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class IntegrityError(RuntimeError):
    """A peer's own check (checksum, hash, read-back) failed on the receiver."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The flat integer view of a contiguous tensor (same storage)."""
    return t.view(_INT_BY_SIZE[t.element_size()]).reshape(-1)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The flat uint8 numpy view of a contiguous CPU tensor (same storage, writable)."""
    return t.view(torch.uint8).reshape(-1).numpy()


def _pool_map(threads: int, fn: Callable, items: Iterable) -> list:
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=threads) as ex:
        return list(ex.map(fn, items))


def _safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (its 8-byte length and JSON header)."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]).get("__metadata__", {})


def _frame(*parts: bytes) -> bytes:
    """Parts with 8-byte lengths: a manifest or checksum that travels beside a payload, counted with it."""
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _unframe(blob: bytes) -> list[bytes]:
    out, at = [], 0
    view = memoryview(blob)
    while at < len(blob):
        (n,) = struct.unpack("<Q", view[at:at + 8])
        out.append(bytes(view[at + 8:at + 8 + n]))
        at += 8 + n
    return out


class PeerSync:
    """One peer's sender (holding its snapshot) and the format its receiver applies.

    ``send(state)`` encodes the step from the sender's snapshot to ``state`` and returns the bytes a receiver
    downloads; ``receive(blob, target)`` applies them to ``target`` in place (``IntegrityError`` when the
    peer's own check fails)."""

    name = ""

    def __init__(self, base: State, threads: int = 1):
        self.threads = threads

    def send(self, state: State) -> bytes:
        raise NotImplementedError

    def receive(self, blob: bytes, target: State) -> None:
        raise NotImplementedError


# -- TRL (delta-weight-sync branch) ------------------------------------------------------------------------
class TrlPatch(PeerSync):
    """TRL's sparse patch file: ``{name}.idx`` positions (``raw`` int32, or ``gap_delta``: idx[k] - idx[k-1] - 1
    as uint16, uint32 where a gap does not fit) and ``{name}.val`` bf16, one safetensors file with the patch
    metadata in its header; every trained tensor gets its two entries (empty when unchanged). Detection: the
    pre-step bf16 clone compared with ``!=``; one ``nonzero`` over the concatenated masks, split per tensor.
    Receiver: positions decoded, values written with vLLM's ``index_copy_`` and read back (its ``verify``)."""

    def __init__(self, base: State, threads: int = 1, encoding: str = "raw"):
        super().__init__(base, threads)
        self.encoding = encoding
        self.name = f"trl-{encoding}"
        self.snap = {n: t.clone() for n, t in base.items()}

    def _encode_idx(self, idx: torch.Tensor) -> torch.Tensor:
        if self.encoding == "raw":
            return idx.to(torch.int32).contiguous()
        if idx.numel() == 0:
            return idx.to(torch.uint16)
        idx64 = idx.long()
        prev = torch.cat([idx64.new_full((1,), -1), idx64[:-1]])
        gaps = idx64 - prev - 1
        return gaps.to(torch.uint16 if int(gaps.max()) <= 0xFFFF else torch.uint32)

    def send(self, state: State) -> bytes:
        names = list(state)
        masks = [(state[n] != self.snap[n]).reshape(-1) for n in names]
        sizes = torch.tensor([m.numel() for m in masks])
        offsets = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])
        hits = torch.cat(masks).nonzero(as_tuple=True)[0]
        bounds = torch.searchsorted(hits, offsets[1:]).tolist()
        tensors, prev, changed = {}, 0, 0
        for n, end, off in zip(names, bounds, offsets.tolist()):
            idx = hits[prev:end] - off
            prev = end
            changed += idx.numel()
            tensors[f"{n}.val"] = state[n].reshape(-1).index_select(0, idx).contiguous()
            tensors[f"{n}.idx"] = self._encode_idx(idx.to(torch.int32))
        total = int(sizes.sum())
        meta = {"format": "sparse_weight_patch", "version": "1", "sparse": "True", "model_version": "0",
                "num_changed_params": str(len(names)), "total_changed_elements": str(changed),
                "total_elements": str(total), "sparsity": str(1.0 - changed / max(total, 1)),
                "encoding": self.encoding}
        blob = pt_save(tensors, metadata=meta)
        self.snap = {n: t.clone() for n, t in state.items()}  # the next step's pre-step snapshot
        return blob

    def receive(self, blob: bytes, target: State) -> None:
        encoding = _safetensors_metadata(blob)["encoding"]
        f = pt_load(blob)
        names = sorted(k[:-len(".val")] for k in f if k.endswith(".val"))
        idxs = []
        for n in names:
            raw = f[f"{n}.idx"]
            if encoding == "raw":
                idxs.append(raw.to(torch.int32))
            else:
                idxs.append((torch.cumsum(raw.long() + 1, dim=0) - 1).to(torch.int32) if raw.numel() else
                            raw.to(torch.int32))
        vals = [f[f"{n}.val"] for n in names]
        all_idx, all_val = torch.cat(idxs), torch.cat(vals)  # one host->device copy each in the peer
        at = 0
        for n, idx in zip(names, idxs):
            k = idx.numel()
            flat = target[n].view(-1)
            i, v = all_idx[at:at + k].long(), all_val[at:at + k]
            at += k
            flat.index_copy_(0, i, v)
            if not torch.equal(flat.index_select(0, i), v):
                raise IntegrityError(f"{self.name}: read-back of {n} differs")


# -- PULSE / grail sparse_codec v2 ---------------------------------------------------------------------------
def _grail_hash(state: State) -> str:
    h = hashlib.sha256()
    for n in sorted(state):
        t = state[n].detach().cpu().contiguous()
        h.update(n.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Grail(PeerSync):
    """grail's ``sparse_codec`` v2: per changed tensor (names sorted) int32 flat positions as first
    differences and the raw bf16 values, after a JSON header, in one zstd level-1 frame; the sender also
    publishes the sha256 of the whole model, which the receiver checks after its apply. Detection: the float32
    difference of new and old is nonzero (a flip between +0 and -0 is not seen)."""

    name = "grail"

    def __init__(self, base: State, threads: int = 1):
        super().__init__(base, threads)
        self.snap = {n: t.clone() for n, t in base.items()}
        self.zc = zstandard.ZstdCompressor(level=1, threads=0)

    def send(self, state: State) -> bytes:
        sparse: dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        for n, cur in state.items():
            diff = (cur.float() - self.snap[n].float()).flatten()
            mask = diff != 0
            idx = mask.nonzero(as_tuple=True)[0].to(torch.int32)
            if idx.numel():
                sparse[n] = (idx, cur.flatten()[mask], list(cur.shape))
        digest = _grail_hash(state)
        metas, chunks, offset = [], [], 0
        for n in sorted(sparse):
            idx, values, shape = sparse[n]
            flat_idx = idx.numpy().astype(np.int32)
            order = np.argsort(flat_idx)
            delta = np.diff(flat_idx[order], prepend=0).astype(np.int32)
            vals = values.view(torch.int16).numpy()[order]
            ib, vb = delta.tobytes(), vals.tobytes()
            metas.append({"name": n, "shape": shape, "num_nonzero": int(flat_idx.size), "value_dtype": "bfloat16",
                          "indices_offset": offset, "indices_size": len(ib), "values_offset": offset + len(ib),
                          "values_size": len(vb)})
            chunks += [ib, vb]
            offset += len(ib) + len(vb)
        header = json.dumps({"version": 2, "tensors": metas}, separators=(",", ":")).encode()
        payload = self.zc.compress(struct.pack("<I", len(header)) + header + b"".join(chunks))
        for n, t in state.items():  # roll the snapshot
            self.snap[n].copy_(t)
        return _frame(digest.encode(), payload)

    def receive(self, blob: bytes, target: State) -> None:
        digest, payload = _unframe(blob)
        raw = zstandard.ZstdDecompressor().decompress(payload)
        (hl,) = struct.unpack("<I", raw[:4])
        header = json.loads(raw[4:4 + hl].decode())
        if header.get("version") != 2:
            raise IntegrityError(f"grail: format version {header.get('version')}")
        start = 4 + hl
        for m in header["tensors"]:
            a = start + m["indices_offset"]
            delta = np.frombuffer(raw[a:a + m["indices_size"]], dtype=np.int32).copy()
            b = start + m["values_offset"]
            vals = torch.from_numpy(np.frombuffer(raw[b:b + m["values_size"]], dtype=np.int16).copy())
            idx = torch.from_numpy(np.cumsum(delta).astype(np.int32))
            flat = target[m["name"]].to(torch.bfloat16).flatten()  # the target itself (bf16, contiguous)
            flat[idx.long()] = vals.view(torch.bfloat16)
        if _grail_hash(target) != digest.decode():
            raise IntegrityError("grail: weights hash mismatch after apply")


# -- NeMo-RL sparse refit ----------------------------------------------------------------------------------
NEMO_CHUNK_BYTES = 64 * 1024 ** 2  # export_chunk_bytes["s3"]: tensors are encoded in chunks of this size


class NemoRL(PeerSync):
    """NeMo-RL's sparse refit payload: per changed tensor its positions (a range when contiguous, else the gaps
    idx[k] - idx[k-1] - 1 as uint16/uint32/uint64 by the largest) and its values (``xor``: new ^ old bits;
    ``overwrite``: new bits), merged into one payload, serialised, one zstd level-1 frame, and the frame's
    blake2b-128 checked by the receiver. Sender: one payload per 64 MiB chunk of tensors (a pool of encode
    workers); the snapshot takes the new bits at the changed positions once the sync succeeded. Receiver
    (vLLM's loader under a dispatch mode): a dense scratch of each tensor (zeros for xor, NaN for
    overwrite) takes the values at their positions, then the copy into the weight becomes a masked XOR / a
    masked overwrite of the whole tensor."""

    def __init__(self, base: State, threads: int = 1, encoding: str = "xor"):
        super().__init__(base, threads)
        self.encoding = encoding
        self.name = f"nemo-{encoding}"
        self.baseline = {n: t.clone() for n, t in base.items()}
        self.zc = zstandard.ZstdCompressor(level=1, threads=0)
        self.scratch = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _gaps(locations: torch.Tensor) -> torch.Tensor:
        idx = locations.numpy().astype(np.int64, copy=False)
        gaps = np.diff(idx, prepend=-1) - 1
        top = int(gaps.max())
        dtype = np.uint16 if top <= 0xFFFF else np.uint32 if top <= 0xFFFFFFFF else np.uint64
        return torch.from_numpy(np.frombuffer(gaps.astype(dtype, copy=False).tobytes(), dtype=np.uint8).copy())

    def _prepare(self, chunk: list[tuple[str, torch.Tensor]]):
        locs, vals, items, pending, at, vat = [], [], [], {}, 0, 0
        for n, t in chunk:
            cur = bits(t.detach().contiguous())
            old = bits(self.baseline[n])
            where = cur.ne(old).nonzero().view(-1)
            if not where.numel():
                continue
            new = cur[where]
            pending[n] = (where, new)
            values = new.bitwise_xor(old[where]) if self.encoding == "xor" else new
            count = int(values.numel())
            item = {"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                    "operation": self.encoding, "value_group": 0, "value_start": vat, "value_end": vat + count}
            if count == 1 or int(where[-1] - where[0] + 1) == count:
                item.update(index_encoding="range", range_start=int(where[0]), index_start=at, index_end=at)
            else:
                g = self._gaps(where)
                locs.append(g)
                item.update(index_encoding="deltas", index_start=at, index_end=at + g.numel())
                at += g.numel()
            vals.append(values)
            vat += count
            items.append(item)
        return locs, vals, items, pending

    def send(self, state: State) -> bytes:
        chunks, cur, size = [], [], 0
        for n, t in state.items():
            nbytes = t.numel() * t.element_size()
            if cur and size + nbytes > NEMO_CHUNK_BYTES:
                chunks.append(cur)
                cur, size = [], 0
            cur.append((n, t))
            size += nbytes
        if cur:
            chunks.append(cur)
        parts = _pool_map(self.threads, self._prepare, chunks)
        locs, vals, items, pending, at, vat = [], [], [], {}, 0, 0  # merge_sparse_payloads
        for l_, v_, it_, p_ in parts:
            for it in it_:
                it = dict(it, index_start=it["index_start"] + at, index_end=it["index_end"] + at,
                          value_start=it["value_start"] + vat, value_end=it["value_end"] + vat)
                items.append(it)
            at += sum(x.numel() for x in l_)
            vat += sum(x.numel() for x in v_)
            locs += l_
            vals += v_
            pending.update(p_)
        tensors = {"locations": torch.cat(locs) if locs else torch.empty(0, dtype=torch.uint8),
                   "values.0": torch.cat(vals) if vals else torch.empty(0, dtype=torch.int16)}
        body = self.zc.compress(pt_save(tensors, metadata={"items": json.dumps(items)}))
        checksum = hashlib.blake2b(body, digest_size=16).hexdigest()
        self._commit(list(pending.items()))
        return _frame(checksum.encode(), body)

    def _commit(self, updates: list) -> None:
        def commit(part):
            for n, (where, new) in part:
                target = bits(self.baseline[n])
                first, count = int(where[0]), where.numel()
                if int(where[-1]) - first + 1 == count:
                    target[first:first + count].copy_(new)
                else:
                    target.index_copy_(0, where, new)
        workers = max(1, min(4, self.threads, len(updates)))
        _pool_map(workers, commit, [updates[w::workers] for w in range(workers)])

    def _source(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if nbytes > self.scratch.numel():
            self.scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self.scratch[:nbytes].view(t.dtype).view(t.shape)

    def receive(self, blob: bytes, target: State) -> None:
        checksum, body = _unframe(blob)
        if hashlib.blake2b(body, digest_size=16).hexdigest() != checksum.decode():
            raise IntegrityError("nemo: payload checksum mismatch")
        raw = zstandard.ZstdDecompressor().decompress(body)
        items = json.loads(_safetensors_metadata(raw)["items"])
        tensors = pt_load(raw)
        packed, values = tensors["locations"], tensors["values.0"]
        for it in items:
            dest = target[it["name"]]
            count = it["value_end"] - it["value_start"]
            v = values[it["value_start"]:it["value_end"]]
            src = self._source(dest)
            if it["operation"] == "xor":
                src.zero_()
            else:
                src.fill_(float("nan"))
            sb = bits(src)
            if it["index_encoding"] == "range":
                sb.narrow(0, it["range_start"], count).copy_(v)
            else:
                raw_loc = packed[it["index_start"]:it["index_end"]].numpy()
                dtype = {2: np.uint16, 4: np.uint32, 8: np.uint64}[raw_loc.size // count]
                loc = raw_loc.view(dtype).astype(np.int64)
                loc += 1
                np.cumsum(loc, out=loc)
                loc -= 1
                sb.index_copy_(0, torch.from_numpy(loc), v)
            db = bits(dest)
            if it["operation"] == "xor":  # the loader's copy_, turned into a masked XOR
                changed = sb.ne(0)
                db.masked_scatter_(changed, db.masked_select(changed).bitwise_xor(sb.masked_select(changed)))
            else:  # the loader's copy_, turned into a masked overwrite (NaN marks "unchanged")
                changed = ~torch.isnan(src)
                dest.masked_scatter_(changed, src.masked_select(changed).to(dest.dtype))


# -- slime / Miles disk delta ------------------------------------------------------------------------------
def _xxh3(buf) -> str:
    h = xxhash.xxh3_128()
    h.update(buf)
    return h.hexdigest()


class SlimeDiskDelta(PeerSync):
    """slime's (and Miles') disk delta: per tensor (a worker pool) the new bytes against the snapshot, byte-level
    and dtype-blind: ``xor`` the dense byte XOR of the whole tensor, ``overwrite`` a u4 count, u4 byte
    positions and the new bytes there; a changed tensor's diff is one zstd level-1 frame, with the xxh3-128 of
    its new bytes; the version is a safetensors file of uint8 arrays (checksums in its metadata) plus an HF
    index JSON. The new bytes become the snapshot. Receiver: decompress, XOR (or scatter) into the local
    tensor, check the xxh3-128."""

    def __init__(self, base: State, threads: int = 1, encoding: str = "xor"):
        super().__init__(base, threads)
        self.encoding = encoding
        self.name = f"slime-{encoding}"
        self.snapshot = {n: raw_bytes(t).copy() for n, t in base.items()}

    def _diff(self, item: tuple[str, torch.Tensor]):
        n, t = item
        new = raw_bytes(t.detach().contiguous()).copy()  # the device -> host copy
        old = self.snapshot[n]
        if self.encoding == "xor":
            diff = new ^ old
            changed = int(np.count_nonzero(diff))
        else:
            mask = new != old
            changed = int(np.count_nonzero(mask))
            pos = np.flatnonzero(mask).astype("<u4")
            diff = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), new[mask]])
        if not changed:
            return n, new, None, None
        z = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(diff), dtype=np.uint8)
        return n, new, z, _xxh3(new)

    def send(self, state: State) -> bytes:
        delta, sums = {}, {}
        for n, new, z, digest in _pool_map(self.threads, self._diff, state.items()):
            self.snapshot[n] = new
            if z is not None:
                delta[n] = z
                sums[n] = digest
        blob = np_save(delta, metadata=sums) if delta else b""
        index = {"metadata": {"version": "000001", "base_version": "000000", "delta_encoding": self.encoding,
                              "compression_format": "zstd", "checksum_format": "xxh3-128"},
                 "weight_map": {n: "model-00000-of-00001.safetensors" for n in delta}}
        return _frame(json.dumps(index).encode(), blob)

    def _apply(self, job):
        n, z, digest, target = job
        patch = np.frombuffer(zstandard.ZstdDecompressor().decompress(z.tobytes()), dtype=np.uint8)
        region = raw_bytes(target[n])
        if self.encoding == "xor":
            np.bitwise_xor(region, patch, out=region)
        else:
            (k,) = patch[:4].view("<u4")
            pos = patch[4:4 + 4 * int(k)].view("<u4")
            region[pos] = patch[4 + 4 * int(k):]
        if _xxh3(region) != digest:
            raise IntegrityError(f"{self.name}: checksum mismatch for {n}")

    def receive(self, blob: bytes, target: State) -> None:
        index_raw, data = _unframe(blob)
        if not data:
            return
        sums = _safetensors_metadata(data)
        delta = np_load(data)
        _pool_map(self.threads, self._apply, [(n, z, sums[n], target) for n, z in delta.items()])


# -- SkyRL checkpoint deltas -------------------------------------------------------------------------------
class SkyRL(PeerSync):
    """SkyRL's checkpoint delta: per tensor (a worker pool) the xxh3-128 of the new bytes, the byte XOR against
    the snapshot written over the fresh copy, and, where any byte changed, one zstd level-1 frame of the whole
    XOR; the snapshot is XOR'd in place. The version: safetensors files of uint8 payloads and a JSON manifest
    (name, dtype, shape, sizes, checksum per tensor). Receiver: decompress to the recorded size, XOR into the
    local tensor, check the xxh3-128."""

    name = "skyrl"

    def __init__(self, base: State, threads: int = 1):
        super().__init__(base, threads)
        self.snapshot = {n: raw_bytes(t).copy() for n, t in base.items()}

    def _process(self, item):
        n, t = item
        current = np.empty(t.numel() * t.element_size(), dtype=np.uint8)
        np.copyto(current, raw_bytes(t.detach().contiguous()))  # the staged host copy
        base = self.snapshot[n]
        digest = _xxh3(memoryview(current))
        np.bitwise_xor(current, base, out=current)
        changed = int(np.count_nonzero(current))
        z = zstandard.ZstdCompressor(level=1).compress(memoryview(current)) if changed else None
        np.bitwise_xor(base, current, out=base)
        return n, t, z, digest

    def send(self, state: State) -> bytes:
        payload, records = {}, []
        for n, t, z, digest in _pool_map(self.threads, self._process, state.items()):
            if z is None:
                continue
            payload[n] = torch.frombuffer(bytearray(z), dtype=torch.uint8)
            records.append({"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                            "uncompressed_num_bytes": t.numel() * t.element_size(), "compressed_num_bytes": len(z),
                            "payload_file": "delta-rank00000-file000000.safetensors", "payload_key": n,
                            "checksum": digest, "checksum_algorithm": "xxh3-128"})
        manifest = {"version": 1, "base_version": 0, "tensors": records,
                    "total_uncompressed_num_bytes": sum(r["uncompressed_num_bytes"] for r in records),
                    "total_compressed_num_bytes": sum(r["compressed_num_bytes"] for r in records),
                    "payload_files": ["delta-rank00000-file000000.safetensors"] if records else []}
        return _frame(json.dumps(manifest).encode(), pt_save(payload) if payload else b"")

    def _apply(self, job):
        record, z, target = job
        patch = zstandard.ZstdDecompressor().decompress(z, max_output_size=record["uncompressed_num_bytes"])
        if len(patch) != record["uncompressed_num_bytes"]:
            raise IntegrityError(f"skyrl: patch for {record['name']} has {len(patch)} bytes")
        region = raw_bytes(target[record["name"]])
        region ^= np.frombuffer(patch, dtype=np.uint8)
        if _xxh3(memoryview(region)) != record["checksum"]:
            raise IntegrityError(f"skyrl: post-apply checksum mismatch for {record['name']}")

    def receive(self, blob: bytes, target: State) -> None:
        manifest_raw, data = _unframe(blob)
        records = json.loads(manifest_raw)["tensors"]
        if not records:
            return
        payload = pt_load(data)
        jobs = [(r, payload[r["payload_key"]].numpy().tobytes(), target) for r in records]
        _pool_map(self.threads, self._apply, jobs)


# -- vLLM sparse patches -----------------------------------------------------------------------------------
class VllmPatch(PeerSync):
    """vLLM's sparse flat patches (``update_kind="sparse_flat"``): per changed tensor int32 flat indices (int64
    where the tensor has 2**31 elements or more) and the new values in the weight's dtype, as they cross its
    transport, with names, dtypes, shapes and counts as JSON. vLLM does no change detection; the sender here
    compares integer views with its snapshot and moves the snapshot at the changed positions. Receiver:
    vLLM's ``apply_sparse_patch`` (``index_copy_``, then the read-back ``verify``)."""

    name = "vllm-patch"

    def __init__(self, base: State, threads: int = 1):
        super().__init__(base, threads)
        self.snap = {n: t.clone() for n, t in base.items()}

    def send(self, state: State) -> bytes:
        names, dtypes, shapes, counts, parts = [], [], [], [], []
        for n, t in state.items():
            cur, old = bits(t), bits(self.snap[n])
            where = cur.ne(old).nonzero().view(-1)
            if not where.numel():
                continue
            idx = where.to(torch.int32 if t.numel() < 2 ** 31 else torch.int64)
            values = t.reshape(-1).index_select(0, where)
            old.index_copy_(0, where, cur.index_select(0, where))
            names.append(n)
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(list(t.shape))
            counts.append(int(where.numel()))
            parts += [idx.numpy().tobytes(), values.view(torch.int16).numpy().tobytes()]
        info = {"update_kind": "sparse_flat", "names": names, "dtype_names": dtypes, "shapes": shapes,
                "num_updates_list": counts}
        return _frame(json.dumps(info).encode(), b"".join(parts))

    def receive(self, blob: bytes, target: State) -> None:
        info_raw, data = _unframe(blob)
        info = json.loads(info_raw)
        at = 0
        for n, shape, k in zip(info["names"], info["shapes"], info["num_updates_list"]):
            flat = target[n].data.view(-1)
            if list(target[n].shape) != shape:
                raise IntegrityError(f"vllm-patch: shape of {n}")
            wide = flat.numel() >= 2 ** 31
            ib = 8 if wide else 4
            idx = torch.frombuffer(bytearray(data[at:at + ib * k]), dtype=torch.int64 if wide else torch.int32)
            at += ib * k
            vals = torch.frombuffer(bytearray(data[at:at + 2 * k]), dtype=torch.int16).view(flat.dtype)
            at += 2 * k
            i = idx.long()
            flat.index_copy_(0, i, vals)
            if not torch.equal(flat.index_select(0, i), vals):
                raise IntegrityError(f"vllm-patch: read-back of {n} differs")


#: every reference, by name: ``factory(base, threads) -> PeerSync``
PEERS: dict[str, Callable[[State, int], PeerSync]] = {
    "trl-raw": lambda b, t: TrlPatch(b, t, "raw"),
    "trl-gap_delta": lambda b, t: TrlPatch(b, t, "gap_delta"),
    "grail": Grail,
    "nemo-xor": lambda b, t: NemoRL(b, t, "xor"),
    "nemo-overwrite": lambda b, t: NemoRL(b, t, "overwrite"),
    "slime-xor": lambda b, t: SlimeDiskDelta(b, t, "xor"),
    "slime-overwrite": lambda b, t: SlimeDiskDelta(b, t, "overwrite"),
    "skyrl": SkyRL,
    "vllm-patch": VllmPatch,
}

