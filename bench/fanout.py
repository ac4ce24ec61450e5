"""Fan-out: N follower processes pulling every step, (a) straight from one SeaweedFS server over S3, (b) through a
caching HTTP proxy (nginx ``proxy_cache``) in front of an HTTP origin (nginx serving the store folder).

    .venv/bin/python bench/fanout.py [--followers 1 8 32] [--steps 8] [--elems 3145728] [--density 0.01]
                                     [--poll 0.1] [--json PATH] [--cases s3 http-cache http-cache-refs0]

A third case, ``http-cache-refs0``, is (b) with ``refs/`` passed through the edge uncached: the trade between
the refs' one-second cache lifetime (origin polling load bounded per edge, discovery up to 1-2 s later: nginx
counts a max-age in whole seconds) and revalidating every poll at the origin (discovery at the poll interval).

Everything runs on this machine, on 127.0.0.1: SeaweedFS (``weed mini``) and two nginx (origin and edge) are
started here with their own configurations in temporary folders. A trainer publishes step 0 (an anchor) and
every follower pulls it (untimed, each in its own spawned interpreter); then, for each timed step, the trainer
publishes a ~``--density`` delta and waits until every follower has applied it before the next one (so each
step's figures are one fan-out, not overlapping ones). Followers poll every ``--poll`` seconds
(``Subscriber.versions()``: an S3 LIST for (a), a conditional GET of ``refs/index.json`` through the edge for
(b)) and pull the new version into their state.

Per step and follower: time from the trainer's commit (the manifest's ``created`` time, taken right before its
create-only write; ``publish`` returns after the ``refs/`` writes that follow it) to the follower's pull
returned (applied; one machine, one clock), split into discovery (until a poll showed the version) and the
pull itself, and the bytes and requests the follower read. Per step at the origin:
(a) what the followers read (every byte a follower reads comes from SeaweedFS), (b) the body bytes and
requests in the origin nginx's access log (what the edge fetched). Every follower hashes its state's bits
after each pull and the trainer's hash of that step must match (bit-exact, else the run fails).

The machine has 2 cores shared with other work: N follower processes, the servers and the trainer share them,
so the latency figures at N = 32 measure mostly CPU contention (32 Python processes decoding at once), not a
network; the byte and request counts do not depend on it. The projection to 1,000 servers (``project``) is
computed from the measured per-follower bytes and requests, with stated link rates, round trips and list
prices: a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MiB = 1 << 20


# -- the follower process --------------------------------------------------------------------------------
def _state_hash(state: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(name.encode())
        h.update(t.contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def _counting(backend):
    """``backend`` wrapped so that every byte and request it reads is counted (``.reads``, ``.bytes``, ``.lists``)."""
    from deltastore.backends.base import WrapperBackend

    class Counting(WrapperBackend):
        reads = 0
        bytes = 0
        lists = 0

        def _call(self, op, key, fn):  # noqa: ANN001, ANN202
            out = fn()
            if op in ("get", "get_range"):
                values = out.values() if isinstance(out, dict) else [out]
                type(self).reads += len(values)
                type(self).bytes += sum(len(v) for v in values)
            elif op == "list":
                type(self).lists += 1
            elif op in ("exists", "stat"):
                type(self).reads += 1
            return out

    return Counting(backend)


def follower(index: int, uri: str, options: dict, last_step: int, poll: float, ready, reports) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["NUMBA_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from deltastore import Subscriber
    from deltastore.backends import open_backend
    from deltastore.store import DeltaStore

    backend = _counting(open_backend(uri, **options))
    sub = Subscriber(DeltaStore(backend, uri), max_workers=2)
    target = sub.pull(step=0).state
    ready.put((index, _state_hash(target), backend.reads, backend.bytes, backend.lists))
    held = 0
    while held < last_step:
        versions = sub.versions()
        if not versions or versions[-1] <= held:
            time.sleep(poll)
            continue
        seen = time.time()
        result = sub.pull(target)
        applied = time.time()
        held = result.step
        reports.put((index, held, applied, _state_hash(target), backend.reads, backend.bytes, backend.lists, seen))


# -- the trainer side --------------------------------------------------------------------------------------
def make_model(elems: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = 512
    per = rows * 512
    n = max(1, elems // per)
    return {f"layers.{i}.weight": torch.randn(rows, 512, generator=g).to(torch.bfloat16) for i in range(n)}


def perturb(state: dict, density: float, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    for t in state.values():
        bits = t.view(torch.int16)
        mask = torch.rand(bits.shape, generator=g) < density
        bits[mask] += 1


def run_case(case: str, n: int, args, servers: dict) -> dict:
    """One configuration: N followers, ``args.steps`` timed steps. Returns its figures."""
    import torch

    from deltastore import Publisher

    torch.set_num_threads(1)
    name = f"fan-{uuid.uuid4().hex[:8]}"
    origin_log = None
    if case == "s3":
        from test_backends.conftest import make_bucket

        seaweed = servers["seaweed"]
        bucket = make_bucket("s3-seaweedfs", seaweed)
        pub_uri, pub_opts = f"s3://{bucket}/{name}", seaweed.storage_options()
        follow_uri, follow_opts = pub_uri, seaweed.storage_options()
    else:
        root = servers["root"]
        pub_uri, pub_opts = str(Path(root) / name), {}
        edge = servers["edge" if case == "http-cache" else "edge-refs-uncached"]
        follow_uri, follow_opts = f"{edge.url}/{name}", {}
        origin_log = servers["origin"]
    state = make_model(args.elems)
    pub = Publisher(pub_uri, storage_options=pub_opts, anchor_every=10_000)
    pub.publish(state, step=0)
    expected = {0: _state_hash(state)}
    ctx = mp.get_context("spawn")
    ready, reports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=follower, args=(i, follow_uri, follow_opts, args.steps, args.poll, ready, reports),
                         daemon=True) for i in range(n)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    counted: dict[int, tuple[int, int, int]] = {}  # each follower's reads, bytes, lists so far (cumulative)
    for _ in range(n):
        i, h, *counts = ready.get(timeout=args.timeout)
        if h != expected[0]:
            raise SystemExit(f"follower {i}: the anchor it pulled is not bit-exact")
        counted[i] = tuple(counts)
    startup = time.monotonic() - t0
    steps = []
    try:
        for step in range(1, args.steps + 1):
            perturb(state, args.density, step)
            lines_before = len(origin_log.requests()) if origin_log else 0
            info = pub.publish(state, step=step)
            committed = info.created  # the manifest's time, right before its create-only write (the commit point)
            expected[step] = _state_hash(state)
            got = []
            while len(got) < n:
                try:
                    got.append(reports.get(timeout=args.timeout))
                except queue.Empty:
                    raise SystemExit(f"{case} N={n} step {step}: {len(got)} of {n} followers applied it within "
                                     f"{args.timeout} s") from None
            for k, (i, s, applied, h, reads, nbytes, lists, seen) in enumerate(got):
                if s != step or h != expected[step]:
                    raise SystemExit(f"{case} N={n}: follower {i} reports step {s} hash {h[:12]}, expected step "
                                     f"{step} {expected[step][:12]}: NOT bit-exact")
                before = counted[i]  # this step's share: every read since the last report, idle polls included
                counted[i] = (reads, nbytes, lists)
                got[k] = (i, s, applied, h, reads - before[0], nbytes - before[1], lists - before[2], seen)
            record = {"step": step, "delta_bytes": info.nbytes,
                      "latency": sorted(applied - committed for _, _, applied, *_ in got),
                      "discovery": sorted(g[7] - committed for g in got),
                      "pull": sorted(g[2] - g[7] for g in got),
                      "follower_bytes": [g[5] for g in got], "follower_reads": [g[4] for g in got],
                      "follower_lists": [g[6] for g in got]}
            if origin_log:
                time.sleep(0.05)  # nginx writes its access log line after the response
                rows = origin_log.requests()[lines_before:]
                record["origin_bytes"] = sum(r[3] for r in rows)
                record["origin_requests"] = len(rows)
            else:  # every byte a follower read came from SeaweedFS
                record["origin_bytes"] = sum(record["follower_bytes"])
                record["origin_requests"] = sum(record["follower_reads"]) + sum(record["follower_lists"])
            steps.append(record)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        pub.close()
    lat = [x for r in steps for x in r["latency"]]
    per = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    return {"case": case, "followers": n, "steps": len(steps), "startup_s": startup,
            "latency_median_s": statistics.median(lat), "latency_p99_s": _quantile(lat, 0.99),
            "latency_max_s": max(lat), "delta_bytes": per("delta_bytes"),
            "discovery_median_s": statistics.median(x for r in steps for x in r["discovery"]),
            "pull_median_s": statistics.median(x for r in steps for x in r["pull"]),
            "pull_p99_s": _quantile([x for r in steps for x in r["pull"]], 0.99),
            "origin_bytes_per_step": per("origin_bytes"), "origin_requests_per_step": per("origin_requests"),
            "follower_bytes_per_step": statistics.median(x for r in steps for x in r["follower_bytes"]),
            "follower_requests_per_step": statistics.median(
                a + b for r in steps for a, b in zip(r["follower_reads"], r["follower_lists"])),
            "bit_exact": True, "per_step": steps}


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# -- the projection ----------------------------------------------------------------------------------------
PRICES = {  # list prices, USD, AWS us-east-1 (2025): a projection's inputs, check them before relying on them
    "s3_egress_internet_per_gb": 0.09,      # S3 data transfer out to the internet, first 10 TB / month
    "s3_egress_inter_region_per_gb": 0.02,  # S3 to another AWS region
    "s3_get_per_1k": 0.0004,                # S3 Standard GET
    "s3_list_per_1k": 0.005,                # S3 Standard LIST (and PUT)
    "cdn_egress_per_gb": 0.085,             # CloudFront to the internet, North America / Europe, first 10 TB
    "cdn_https_per_10k": 0.01,              # CloudFront HTTPS requests, North America
    "cdn_origin_fetch_per_gb": 0.0,         # S3 -> CloudFront: free
}


def project(results: list[dict], args, params: float = 7e9, servers: int = 1000, link_gbit: float = 1.0,
            edges: int = 20, origin_gbit: float = 25.0, rtt_bucket_s: float = 0.030, rtt_edge_s: float = 0.005,
            poll_s: float = 1.0) -> dict:
    """1,000 servers at ``link_gbit`` each pulling one step of a ``params``-parameter bf16 model at this run's
    change density: (i) straight from a bucket, (ii) behind a CDN with ``edges`` edge locations (each fetches an
    object from the origin once), (iii) a region-local relay (``deltastore mirror`` + nginx). Inputs measured
    here: a follower's bytes per changed element and its requests per step; the rest is stated below (round
    trips, link rates, list prices): a projection, not a measurement. ``origin_gbit``: a self-hosted origin's
    link (an S3 bucket's aggregate bandwidth is not the limit; its price is)."""
    first = min(r["followers"] for r in results)
    base = next(r for r in results if r["followers"] == first)
    changed = args.elems * args.density
    per_changed = base["follower_bytes_per_step"] / changed
    step_bytes = params * args.density * per_changed
    requests = base["follower_requests_per_step"]
    gb = step_bytes / 1e9
    link = link_gbit * 1e9 / 8
    origin_link = origin_gbit * 1e9 / 8
    p = PRICES
    transfer = step_bytes / link
    direct = {"origin_gb_per_step": servers * gb,
              "pull_s": requests * rtt_bucket_s + transfer,
              "self_hosted_origin_s": servers * step_bytes / origin_link,
              "egress_usd_per_step_internet": servers * gb * p["s3_egress_internet_per_gb"],
              "egress_usd_per_step_inter_region": servers * gb * p["s3_egress_inter_region_per_gb"],
              "requests_usd_per_step": servers * requests * p["s3_get_per_1k"] / 1e3,
              "list_polling_usd_per_hour": servers * 3600 / poll_s * p["s3_list_per_1k"] / 1e3}
    cdn = {"origin_gb_per_step": edges * gb,
           "pull_s": requests * rtt_edge_s + transfer,
           "self_hosted_origin_s": edges * step_bytes / origin_link,
           "egress_usd_per_step": servers * gb * p["cdn_egress_per_gb"] + edges * gb * p["cdn_origin_fetch_per_gb"],
           "requests_usd_per_step": servers * requests * p["cdn_https_per_10k"] / 1e4,
           "index_polling_usd_per_hour": servers * 3600 / poll_s * p["cdn_https_per_10k"] / 1e4}
    relay = {"origin_gb_per_step_per_region": gb,
             "egress_usd_per_step_per_region_inter_region": gb * p["s3_egress_inter_region_per_gb"],
             "relay_link_s_for_all_servers": servers * step_bytes / origin_link}
    return {"params": params, "density": args.density, "bytes_per_changed_element": per_changed,
            "step_mb_per_server": step_bytes / 1e6, "requests_per_server_step": requests, "servers": servers,
            "link_gbit": link_gbit, "edges": edges, "origin_gbit": origin_gbit, "rtt_bucket_s": rtt_bucket_s,
            "rtt_edge_s": rtt_edge_s, "poll_s": poll_s, "prices_usd": p,
            "straight_from_bucket": direct, "behind_cdn": cdn, "region_relay": relay,
            "note": "apply time on the server is not included (docs/benchmarks.md measures it per model size)"}


# -- servers -----------------------------------------------------------------------------------------------
def start_servers(cases: list[str]) -> dict:
    from test_backends.http_servers import Nginx
    from test_backends.servers import Seaweed

    servers: dict = {}
    if "s3" in cases:
        servers["seaweed"] = Seaweed().start()
    if any(c.startswith("http") for c in cases):
        root = tempfile.mkdtemp(prefix="deltastore-fanout-")
        os.chmod(root, 0o755)
        servers["root"] = root
        servers["origin"] = Nginx.static(root).start()
        servers["edge"] = Nginx.caching_proxy(servers["origin"].url).start()
        servers["edge-refs-uncached"] = Nginx.caching_proxy(servers["origin"].url, cache_refs=False).start()
    return servers


def stop_servers(servers: dict) -> None:
    for key in ("edge", "edge-refs-uncached", "origin", "seaweed"):
        if key in servers:
            servers[key].stop()
    if "root" in servers:
        shutil.rmtree(servers["root"], ignore_errors=True)


def print_table(results: list[dict], projection: dict | None) -> None:
    print(f"\n{'case':<12}{'N':>4}{'median ms':>11}{'p99 ms':>9}{'max ms':>9}{'seen ms':>9}{'pull ms':>9}"
          f"{'pull p99':>9}{'delta KiB':>11}"
          f"{'origin KiB/step':>17}{'origin req/step':>17}{'per-follower KiB':>18}{'req':>6}  bit-exact")
    for r in results:
        print(f"{r['case']:<12}{r['followers']:>4}{r['latency_median_s'] * 1e3:>11.0f}{r['latency_p99_s'] * 1e3:>9.0f}"
              f"{r['latency_max_s'] * 1e3:>9.0f}{r['discovery_median_s'] * 1e3:>9.0f}{r['pull_median_s'] * 1e3:>9.0f}"
              f"{r['pull_p99_s'] * 1e3:>9.0f}{r['delta_bytes'] / 1024:>11.1f}{r['origin_bytes_per_step'] / 1024:>17.1f}"
              f"{r['origin_requests_per_step']:>17.0f}{r['follower_bytes_per_step'] / 1024:>18.1f}"
              f"{r['follower_requests_per_step']:>6.0f}  {'yes' if r['bit_exact'] else 'NO'}")
    if projection:
        print("\nprojection (not a measurement):", json.dumps(projection, indent=1, default=float))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--followers", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--elems", type=int, default=3 * MiB, help="bf16 elements of the model (default 3M: 6 MiB)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--poll", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--cases", nargs="+", default=["s3", "http-cache", "http-cache-refs0"],
                    choices=["s3", "http-cache", "http-cache-refs0"],
                    help="http-cache-refs0: the same edge, refs/ passed through uncached (discovery at the poll "
                         "interval, every poll a conditional GET at the origin)")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--project-params", type=float, default=7e9,
                    help="model size (parameters) the projection to 1,000 servers is made for (default 7e9)")
    args = ap.parse_args()
    servers = start_servers(args.cases)
    results = []
    try:
        for n in args.followers:
            for case in args.cases:
                r = run_case(case, n, args, servers)
                results.append(r)
                print(f"{case} N={n}: median {r['latency_median_s'] * 1e3:.0f} ms, p99 {r['latency_p99_s'] * 1e3:.0f} ms, "
                      f"origin {r['origin_bytes_per_step'] / 1024:.1f} KiB and {r['origin_requests_per_step']:.0f} "
                      f"requests per step, startup {r['startup_s']:.0f} s", flush=True)
    finally:
        stop_servers(servers)
    projection = project(results, args, params=args.project_params) if results else None
    print_table(results, projection)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "projection": projection},
                                              indent=1, default=float))


if __name__ == "__main__":
    main()
