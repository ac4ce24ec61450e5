"""deltastore mirror / mirror_store: a verified, version-aware copy; valid at every moment, resumable, idempotent,
and a region-local relay (S3 -> local disk served by nginx -> Subscribers on http://)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import deltastore as ds
from deltastore.backends.local import LocalBackend
from deltastore.errors import CorruptObjectError, MirrorConflictError, StoreIndexError
from deltastore.index import INDEX_KEY, WINDOW, latest_step
from deltastore.store import DeltaStore, object_key, version_key
from deltastore.pull.verify import verify_store
from test_backends.conftest import seaweed_server  # noqa: F401 - the suite's real S3 server (SeaweedFS)
from test_backends.conftest import make_bucket
from test_backends.http_servers import HostileServer, Nginx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def model(seed: int = 0, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 64, generator=g).to(torch.bfloat16),
            "v": torch.randn(rows, 32, generator=g).to(torch.bfloat16)}


def advance(w: dict, step: int) -> None:
    w["w"][step % w["w"].shape[0], :16] += 1
    w["v"][(3 * step) % w["v"].shape[0], :4] -= 1


def publish(uri, steps, w=None, **kwargs):
    """Publish ``steps`` into ``uri``; returns the weights of each step."""
    w = w if w is not None else model()
    states = {}
    with ds.Publisher(uri, **kwargs) as pub:
        for s in steps:
            advance(w, s)
            pub.publish(w, step=s)
            states[s] = {k: v.clone() for k, v in w.items()}
    return states


def assert_valid(path) -> list[int]:
    """The destination is a valid store: every version whole (objects present and matching, chains replayed),
    and refs/latest and the index naming only versions it holds, with their digests. Returns its versions."""
    store = DeltaStore(LocalBackend(path))
    report = verify_store(store)
    assert report.ok, report.problems
    steps = store.versions()
    if store.backend.exists(INDEX_KEY):
        for e in store.read_index().entries:
            assert e.step in steps, f"the index names {e.step}, not there"
            assert store.ref(e.step).digest == e.digest
    if store.backend.exists("refs/latest"):
        assert latest_step(store.backend.get("refs/latest")) in steps
    return steps


def test_copies_in_order_verified_and_idempotent(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    states = publish(src, range(1, 11), anchor_every=4)
    order = []
    report = ds.mirror_store(src, dst, on_version=lambda step, n, b: order.append(step))
    assert report.copied == order == list(range(1, 11)) and report.objects > 0
    assert assert_valid(dst) == list(range(1, 11))
    for s in range(1, 11):  # manifests byte for byte (digests, parents, signatures stay valid)
        assert open(os.path.join(dst, version_key(s)), "rb").read() == open(os.path.join(src, version_key(s)), "rb").read()
    for key in (INDEX_KEY, "refs/latest"):
        assert open(os.path.join(dst, key), "rb").read() == open(os.path.join(src, key), "rb").read()
    again = ds.mirror_store(src, dst)
    assert again.copied == [] and again.objects == 0 and sorted(again.present) == list(range(1, 11))
    pulled = ds.Subscriber(dst).pull().state
    assert all(torch.equal(bits(pulled[k]), bits(states[10][k])) for k in pulled)
    publish(src, range(11, 14), w=states[10], anchor_every=4)
    assert ds.mirror_store(src, dst).copied == [11, 12, 13]


def test_cli(tmp_path):
    from deltastore.cli import main

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    publish(src, range(3))
    assert main(["mirror", src, dst]) == 0
    assert main(["mirror", src, src]) == 2
    assert assert_valid(dst) == [0, 1, 2]


@pytest.fixture
def slow_source(tmp_path):
    """A store with 24 versions served over HTTP with 15 ms per request (so a mirror can be killed mid-copy)."""
    os.chmod(tmp_path, 0o755)
    states = publish(str(tmp_path / "store"), range(24), w=model(1, rows=256), anchor_every=6)

    def slow(h, key, body):
        time.sleep(0.015)
        return False

    server = HostileServer(tmp_path, misbehave=slow).start()
    yield server, states
    server.stop()


@pytest.mark.slow
def test_resumes_after_kills(slow_source, tmp_path):
    """A mirror killed (SIGKILL) at random moments leaves a valid store each time; the next run completes it."""
    server, states = slow_source
    dst = str(tmp_path / "dst")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "deltastore", "mirror", server.url, dst, "--workers", "2"]
    rng = random.Random(7)
    seen_partial = 0
    held = 0
    for _ in range(3):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60  # kill once this run has copied a version, a random moment later
        while _count(dst) <= held and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        steps = assert_valid(dst)
        held = len(steps)
        seen_partial += 0 < held < 24
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert seen_partial, "no kill landed mid-copy: the test did not test resuming"
    assert assert_valid(dst) == list(range(24))
    pulled = ds.Subscriber(dst).pull().state
    assert all(torch.equal(bits(pulled[k]), bits(states[23][k])) for k in pulled)


def _count(dst: str) -> int:
    try:
        return len(os.listdir(os.path.join(dst, "versions")))
    except FileNotFoundError:
        return 0


def test_tampered_source_copies_nothing_of_that_version(tmp_path):
    os.chmod(tmp_path, 0o755)
    with ds.Publisher(str(tmp_path / "store")) as pub:
        w = model(2)
        for s in range(1, 5):
            advance(w, s)
            pub.publish(w, step=s)
        bad = {object_key(o.digest) for o in pub.store.manifest(3).objects}

    def flip(h, key, body):
        if key not in bad:
            return False
        h.head_only(200, Content_Length=str(len(body)))
        h.wfile.write(body[:-1] + bytes([body[-1] ^ 1]))
        return True

    server = HostileServer(tmp_path, misbehave=flip).start()
    dst = str(tmp_path / "dst")
    try:
        with pytest.raises(CorruptObjectError):
            ds.mirror_store(server.url, dst, src_options={"deadline": 2})
        assert assert_valid(dst) == [1, 2]
        assert not os.path.exists(os.path.join(dst, version_key(3)))

        def other_manifest(h, key, body):
            if key != version_key(3):
                return False
            other = body.replace(b'"metadata":{}', b'"metadata":{"x":1}')
            h.head_only(200, Content_Length=str(len(other)))
            h.wfile.write(other)
            return True

        server.set(other_manifest)
        with pytest.raises(StoreIndexError):
            ds.mirror_store(server.url, dst, src_options={"deadline": 2})
        assert assert_valid(dst) == [1, 2]
        server.set(None)
        assert ds.mirror_store(server.url, dst).copied == [3, 4]
    finally:
        server.stop()


def test_verify_manifest_seam(tmp_path):
    """``verify_manifest(data, step)`` sees every manifest's bytes before anything of it is copied; what it
    raises stops the copy there."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    publish(src, range(1, 6))
    seen = []

    class Untrusted(Exception):
        pass

    def verify(data, step):
        seen.append(step)
        assert json.loads(data)["step"] == step
        if step == 4:
            raise Untrusted(f"version {step} is not signed by a trusted key")

    with pytest.raises(Untrusted):
        ds.mirror_store(src, dst, verify_manifest=verify)
    assert 4 in seen and not os.path.exists(os.path.join(dst, version_key(4)))
    assert not os.path.exists(os.path.join(dst, version_key(5)))  # planned, refused before any copy
    latest_seen = []
    ds.mirror_store(src, dst, verify_manifest=lambda d, s: None, verify_latest=latest_seen.append)
    assert assert_valid(dst) == [1, 2, 3, 4, 5] and latest_seen


def test_conflicting_destination(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    publish(src, range(3))
    publish(dst, range(3), w=model(9))
    with pytest.raises(MirrorConflictError):
        ds.mirror_store(src, dst)
    assert assert_valid(dst) == [0, 1, 2]


def test_http_source_beyond_the_index_window(tmp_path):
    """An HTTP source names only its recent window and last anchors; the mirror walks parents down to an
    anchor, so a joiner on the copy can start there."""
    os.chmod(tmp_path, 0o755)
    n = WINDOW + 16
    states = publish(str(tmp_path / "store"), range(n), w=model(3, rows=16), anchor_every=40)
    server = Nginx.static(tmp_path).start()
    dst = str(tmp_path / "dst")
    try:
        report = ds.mirror_store(f"{server.url}/store", dst)
    finally:
        server.stop()
    steps = assert_valid(dst)
    assert steps == list(range(n)) and report.copied == steps
    joiner = ds.Subscriber(dst).pull()
    assert all(torch.equal(bits(joiner.state[k]), bits(states[n - 1][k])) for k in joiner.state)


def test_relay_s3_to_nginx_to_http_followers(seaweed_server, tmp_path):  # noqa: F811
    """The region-local relay: a trainer publishes to S3 (SeaweedFS); ``mirror --follow`` copies to a local
    folder that nginx serves; a follower on http:// pulls every step, bit-exact, never seeing half a version."""
    os.chmod(tmp_path, 0o755)
    bucket = make_bucket("s3-seaweedfs", seaweed_server)
    src = f"s3://{bucket}/run"
    opts = seaweed_server.storage_options()
    relay = tmp_path / "relay"
    server = Nginx.static(tmp_path).start()
    stop = threading.Event()
    w = model(4)
    pub = ds.Publisher(src, storage_options=opts, anchor_every=5)
    advance(w, 0)
    pub.publish(w, step=0)
    errors = []

    def follow():
        try:
            ds.mirror_store(src, str(relay), follow=True, poll_interval=0.1, stop=stop, src_options=opts)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not (relay / "refs" / "index.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sub = ds.Subscriber(f"{server.url}/relay", storage_options={"deadline": 10})
        target = sub.pull().state
        for step in range(1, 8):
            advance(w, step)
            pub.publish(w, step=step)
            deadline = time.monotonic() + 60
            while (sub.versions() or [-1])[-1] < step and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sub.pull(target).step == step
            assert all(torch.equal(bits(target[k]), bits(w[k])) for k in w), step
        assert not errors, errors
    finally:
        stop.set()
        thread.join(30)
        pub.close()
        server.stop()
    assert assert_valid(relay) == list(range(8))


def test_signed_store_through_a_mirror_and_http(tmp_path):
    """With trusted keys the mirror copies only signed versions, byte for byte, so a follower of the copy over
    http:// checks the trainer's signatures and the signed latest; an unsigned source is refused before
    anything is copied."""
    from deltastore.errors import UnsignedVersionError
    from deltastore.signing import SigningKey

    os.chmod(tmp_path, 0o755)
    key = SigningKey.generate()
    src, dst = str(tmp_path / "src"), str(tmp_path / "relay")
    states = publish(src, range(1, 5), signing_key=key, anchor_every=3)
    report = ds.mirror_store(src, dst, trusted_keys=[key.public])
    assert report.copied == [1, 2, 3, 4]
    for k in ("refs/latest", INDEX_KEY):
        assert open(os.path.join(dst, k), "rb").read() == open(os.path.join(src, k), "rb").read()
    server = Nginx.static(tmp_path).start()
    try:
        sub = ds.Subscriber(f"{server.url}/relay", trusted_keys=[key.public], max_latest_age=600)
        result = sub.pull()
        assert result.step == 4 and result.signed_by == key.key_id and result.latest_age is not None
        assert all(torch.equal(bits(result.state[k]), bits(states[4][k])) for k in result.state)
    finally:
        server.stop()
    unsigned = str(tmp_path / "unsigned")
    publish(unsigned, range(2))
    with pytest.raises(UnsignedVersionError):
        ds.mirror_store(unsigned, str(tmp_path / "copy"), trusted_keys=[key.public])
    assert not os.path.exists(os.path.join(tmp_path, "copy", "versions"))
