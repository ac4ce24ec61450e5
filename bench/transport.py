"""Transport benchmark over a real SeaweedFS (started here on 127.0.0.1, free ports).

(a) Wall time to publish one ~1 %-density delta step and pull it into a
    follower, against shipping the full bf16 checkpoint through the same
    server (plain s3fs upload + download of the raw bf16 bytes). Goal: >= 20x.
(b) Transfer throughput of deltastore's S3 backend (``put_many`` /
    ``get_many`` and single large objects) against plain s3fs
    (``pipe`` / ``cat`` of the same bytes, s3fs's own concurrency). Goal: >= 0.9x.

    .venv/bin/python bench/transport.py [--elems 67108864] [--density 0.01] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import torch  # noqa: E402

import deltastore as ds  # noqa: E402
from deltastore.backends import open_backend  # noqa: E402
from test_backends.servers import Seaweed  # noqa: E402

MiB = 1 << 20


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def make_state(elems: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = 4096
    n_tensors = 8
    per = elems // n_tensors // rows * rows
    return {f"model.layers.{i}.weight": (torch.randn(per // rows, rows, generator=g) * 0.02).bfloat16()
            for i in range(n_tensors)}


def perturb(state: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        bits[mask] += torch.where(torch.rand(bits.shape, generator=g)[mask] < 0.5, 1, -1).to(torch.int16)
        out[name] = bits.view(torch.bfloat16)
    return out


def bench_delta_vs_full(server: Seaweed, args) -> dict[str, float]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    opts = server.storage_options()
    state0 = make_state(args.elems)
    nbytes = sum(t.numel() * 2 for t in state0.values())
    full = b"".join(t.view(torch.int16).numpy().tobytes() for t in state0.values())

    def ship_full():
        fs.pipe_file(f"{bucket}/full/model.bin", full)
        assert len(fs.cat_file(f"{bucket}/full/model.bin")) == len(full)

    t_full = best(ship_full, args.repeat)

    times = []
    changed = 0
    for r in range(args.repeat):
        uri = f"s3://{bucket}/run-{r}"
        pub = ds.Publisher(uri, storage_options=dict(opts), anchor_every=1000)
        pub.publish(state0, step=0)
        sub = ds.Subscriber(uri, storage_options=dict(opts))
        target = {k: v.clone() for k, v in state0.items()}
        sub.pull(target)
        state1 = perturb(state0, args.density, seed=r + 1)
        t = time.perf_counter()
        info = pub.publish(state1, step=1)
        res = sub.pull(target)
        times.append(time.perf_counter() - t)
        assert res.step == 1 and all(torch.equal(target[k].view(torch.int16), state1[k].view(torch.int16))
                                     for k in state1)
        changed = info.changed
        delta_bytes = info.nbytes
    t_delta = min(times)
    # Transport only: the keys version 1 added (its objects and manifest), shipped through the same backend.
    store = open_backend(uri, **opts)
    sub0 = ds.Subscriber(uri, storage_options=dict(opts))
    m0 = sub0.manifest(0)
    keys = [k for k in store.list() if k.startswith("objects/") or k == "versions/000000000001.json"]
    keys = [k for k in keys if not any(k.endswith(o.digest.split(":", 1)[1][2:]) for o in m0.objects)]
    payload = store.get_many(keys)
    dest = open_backend(f"s3://{bucket}/transport-only", **opts)

    def ship_delta():
        dest.put_many(payload)
        dest.get_many(list(payload))

    t_transport = best(ship_delta, args.repeat)
    return {"t_transport": t_transport, "transport_bytes": sum(map(len, payload.values())),"model_bytes": nbytes, "changed": changed, "density": changed / (nbytes // 2),
            "delta_bytes": delta_bytes, "t_full": t_full, "t_delta": t_delta, "ratio": t_full / t_delta}


def bench_throughput(server: Seaweed, args) -> dict[str, float]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    backend = open_backend(f"s3://{bucket}/ds", **server.storage_options())
    n, size = args.objects, args.object_bytes
    blobs = {f"o/{i:04d}": os.urandom(size) for i in range(n)}
    big = os.urandom(args.large_bytes)
    total = n * size
    out = {}

    pairs = {
        "many_put": (lambda: backend.put_many(blobs),
                     lambda: fs.pipe({f"{bucket}/plain/{k}": v for k, v in blobs.items()})),
        "many_get": (lambda: backend.get_many(list(blobs)),
                     lambda: fs.cat([f"{bucket}/plain/{k}" for k in blobs])),
        "large_put": (lambda: backend.put("large", big), lambda: fs.pipe_file(f"{bucket}/plain/large", big)),
        "large_get": (lambda: backend.get("large"), lambda: fs.cat_file(f"{bucket}/plain/large")),
    }
    for name, (ours, plain) in pairs.items():  # interleaved, order alternating: fair on a noisy machine
        t_ours, t_plain = [], []
        for r in range(args.repeat):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                t = time.perf_counter()
                (ours, plain)[which]()
                (t_ours, t_plain)[which].append(time.perf_counter() - t)
        out[f"{name}_ours"], out[f"{name}_s3fs"] = min(t_ours), min(t_plain)
    out["many_total"] = total
    out["large_total"] = len(big)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elems", type=int, default=64 << 20, help="bf16 elements in the model (default 64 Mi = 128 MiB)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--objects", type=int, default=64)
    p.add_argument("--object-bytes", type=int, default=1 * MiB)
    p.add_argument("--large-bytes", type=int, default=128 * MiB)
    args = p.parse_args(argv)
    server = Seaweed().start()
    try:
        a = bench_delta_vs_full(server, args)
        print(f"(a) model {a['model_bytes'] / MiB:.0f} MiB bf16, {a['changed']:,} changed elements "
              f"({a['density']:.2%}), delta version {a['delta_bytes'] / MiB:.2f} MiB")
        print(f"    full checkpoint upload+download {a['t_full']:.3f} s; "
              f"delta publish+pull {a['t_delta']:.3f} s; ratio {a['ratio']:.1f}x (goal >= 20x)")
        print(f"    transport only (the step's {a['transport_bytes'] / MiB:.2f} MiB of objects + manifest, "
              f"put_many + get_many): {a['t_transport']:.3f} s; ratio {a['t_full'] / a['t_transport']:.1f}x; "
              f"the rest of the delta time is CPU (diff, encode, verify, apply)")
        b = bench_throughput(server, args)
        for what, total in (("many", b["many_total"]), ("large", b["large_total"])):
            for op in ("put", "get"):
                ours, plain = b[f"{what}_{op}_ours"], b[f"{what}_{op}_s3fs"]
                label = f"{args.objects} x {args.object_bytes / MiB:.0f} MiB" if what == "many" else \
                    f"1 x {args.large_bytes / MiB:.0f} MiB"
                print(f"(b) {op} {label}: ours {total / ours / MiB:7.1f} MiB/s, s3fs {total / plain / MiB:7.1f} MiB/s,"
                      f" ratio {plain / ours:.2f}x (goal >= 0.9x)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
