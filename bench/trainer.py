"""What publishing costs the training loop, and how sharded publishing spreads the upload.

    python bench/trainer.py [--scale 4] [--ranks 1 2 4] [--run dither-lr1e-5]

(a) ``Publisher(background=True)``: the time ``publish()`` blocks the loop per
    step, against the bare bit-compare (``torch.ne(old, new).nonzero()``) of the
    same tensors and against a synchronous publish (diff + encode + upload +
    commit), all measured in the same run. Goal: blocking <= compare + 10 %.
(b) ``ShardedPublisher`` over 1, 2 and 4 gloo ranks on CPU: bytes each rank
    uploads per step and the time of a publish.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _trace
import deltastore as ds


def blocking(states, workdir):
    compare, sync_ms, block_ms = [], [], []
    with ds.Publisher(os.path.join(workdir, "sync")) as pub:
        pub.publish(states[0], step=0)
        for i in range(1, len(states)):
            t0 = time.perf_counter()
            pub.publish(states[i], step=i)
            sync_ms.append((time.perf_counter() - t0) * 1e3)
    pub = ds.Publisher(os.path.join(workdir, "bg"), background=True, max_pending=len(states))
    pub.publish(states[0], step=0).result()
    for i in range(1, len(states)):
        old, new = states[i - 1], states[i]
        t0 = time.perf_counter()
        for k in new:
            torch.ne(old[k].view(torch.int16).reshape(-1), new[k].view(torch.int16).reshape(-1)).nonzero()
        compare.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        pub.publish(new, step=i)
        block_ms.append((time.perf_counter() - t0) * 1e3)
        pub.flush()  # keep the writer idle so the next measurement is not disturbed by it
    pub.close()
    return statistics.median(compare), statistics.median(block_ms), statistics.median(sync_ms)


def _rank(rank, world, port, uri, run, scale, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from deltastore.publish.sharded import ShardedPublisher

    tr = _trace.load(run)
    pub = ShardedPublisher(uri, anchor_every=10**6)
    sent = {"bytes": 0}
    put = pub.store.put_object

    def counting_put(data):
        sent["bytes"] += len(data)
        return put(data)

    pub.store.put_object = counting_put
    per_step = []
    for step, state in tr.iter_states():
        state = _trace.scaled(state, scale)
        shards = []
        for name, t in state.items():
            chunks = t.chunk(world)
            if rank < len(chunks):
                row0 = sum(c.shape[0] for c in chunks[:rank])
                row = t[0].numel() if t.dim() > 1 else 1
                shards.append((name, chunks[rank].contiguous(), row0 * row, tuple(t.shape)))
        before = sent["bytes"]
        dist.barrier()
        t0 = time.perf_counter()
        pub.publish(shards, step=step)
        ms = (time.perf_counter() - t0) * 1e3
        if step:
            per_step.append((sent["bytes"] - before, ms))
    pub.close()
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{statistics.mean(b for b, _ in per_step)} {statistics.median(m for _, m in per_step)}\n")
    dist.destroy_process_group()


def sharded(world, run, scale, workdir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = os.path.join(workdir, f"ranks{world}")
    mp.start_processes(_rank, args=(world, port, uri, run, scale, workdir), nprocs=world, join=True,
                       start_method="spawn")
    rows = []
    for r in range(world):
        with open(os.path.join(workdir, f"rank{r}.txt")) as f:
            b, ms = f.read().split()
            rows.append((float(b), float(ms)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--run", default="dither-lr1e-5")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args()
    torch.set_num_threads(2)
    tr = _trace.load(a.run)
    states = [_trace.scaled(s, a.scale) for _, s in tr.iter_states()]
    mb = sum(t.numel() * 2 for t in states[0].values()) / 1e6
    with tempfile.TemporaryDirectory() as d:
        c, b, s = blocking(states, d)
        print(f"(a) {a.run}, {mb:.1f} MB bf16, median per step:")
        print(f"    bare compare {c:.1f} ms | publish() blocks {b:.1f} ms ({b / c:.2f}x compare) | "
              f"synchronous publish {s:.1f} ms ({s / c:.2f}x compare)")
        print(f"(b) ShardedPublisher, {a.run}, {mb:.1f} MB bf16, per step:")
        print(f"    {'ranks':>5} {'bytes per rank (mean)':>22} {'max/min':>8} {'publish ms (median)':>20}")
        for world in a.ranks:
            rows = sharded(world, a.run, a.scale, d)
            per_rank = [b for b, _ in rows]
            print(f"    {world:>5} {statistics.mean(per_rank):>22,.0f} "
                  f"{max(per_rank) / max(min(per_rank), 1):>8.2f} {max(ms for _, ms in rows):>20.1f}")


if __name__ == "__main__":
    main()
