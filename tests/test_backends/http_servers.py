"""Real HTTP servers for the http(s):// read path, each on 127.0.0.1 and a free port.

* :class:`Nginx`: Debian's nginx, started in the foreground with its own configuration in a temporary
  folder: ``Nginx.static(root)`` serves a store folder with the Cache-Control headers of
  docs/backends.md; ``Nginx.caching_proxy(origin)`` is a ``proxy_cache`` in front of another server
  (what a CDN edge does: one origin request per object, concurrent misses collapsed).
* :class:`FileServer`: Python's ``http.server`` serving a folder (HTTP/1.0, no ranges, no ETag).
* :class:`HostileServer`: serves a store folder, with a ``misbehave(handler, key, body)`` hook for the
  keys it picks (truncated bodies, wrong lengths, redirect loops, trickles, endless streams).

Missing nginx fails the tests that need it (``make test`` installs it), never skips them.
"""

from __future__ import annotations

import functools
import getpass
import http.server
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from .servers import ServerStartError, _wait_http, free_port

IMMUTABLE = "public, max-age=31536000, immutable"
MUTABLE = "public, max-age=1, must-revalidate"


def nginx_binary() -> str:
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ServerStartError("nginx is missing: apt-get install -y nginx (make test installs it)")


class Nginx:
    """nginx in the foreground (``daemon off``), one worker, its configuration, logs and cache in ``dir``.

    ``requests()`` parses the access log: one ``(method, uri, status, bytes sent, cache status)`` per request.
    """

    def __init__(self, server_block: str, http_extra: str = "", tls: tuple[str, str] | None = None):
        self.tls = tls
        self.dir = tempfile.mkdtemp(prefix="deltastore-nginx-")
        os.chmod(self.dir, 0o755)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.conf = Path(self.dir) / "nginx.conf"
        self.extra_dirs: list[str] = []
        user = f"user {getpass.getuser()};" if os.geteuid() == 0 else ""
        d = self.dir
        self.conf.write_text(f"""
{user}
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    default_type application/octet-stream;
    types {{ application/json json; }}
    log_format ds '$request_method $request_uri $status $body_bytes_sent $upstream_cache_status';
    access_log {d}/access.log ds;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 100000;
    {http_extra}
    server {{
        listen 127.0.0.1:{self.port}{" ssl" if tls else ""};
        {f"ssl_certificate {tls[0]}; ssl_certificate_key {tls[1]};" if tls else ""}
        {server_block}
    }}
}}
""")

    @classmethod
    def static(cls, root: str | os.PathLike[str], extra: str = "", tls: tuple[str, str] | None = None) -> Nginx:
        """Serves the folder ``root`` (a store at ``/<name>`` for ``root/<name>``) as docs/backends.md shows;
        ``extra``: more of the server block; ``tls``: (certificate, key) files to serve https."""
        return cls(f"""
        root {os.fspath(root)};
        location ~ /(objects|versions)/ {{ add_header Cache-Control "{IMMUTABLE}"; }}
        location ~ /refs/ {{ add_header Cache-Control "{MUTABLE}"; }}
        {extra}
""", tls=tls)

    @classmethod
    def caching_proxy(cls, origin: str, cache_refs: bool = True) -> Nginx:
        """A ``proxy_cache`` in front of ``origin`` (``http://127.0.0.1:PORT``): it keeps what the origin's
        Cache-Control allows, collapses concurrent misses into one origin request (``proxy_cache_lock``) and
        passes the origin's ``Date`` (so a client can tell when the bytes it holds were made). With
        ``cache_refs=False`` it passes ``refs/`` through uncached (each poll reaches the origin)."""
        cache = tempfile.mkdtemp(prefix="deltastore-nginx-cache-")
        refs = "" if cache_refs else """
        location ~ /refs/ {
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass_header Date;
        }"""
        self = cls(refs + """
        location / {
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache ds;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 60s;
            proxy_pass_header Date;
            add_header X-Cache $upstream_cache_status;
        }
""", f"""
    proxy_cache_path {cache} levels=1:2 keys_zone=ds:16m max_size=4g inactive=10m use_temp_path=off;
    upstream origin {{ server {origin.split('://', 1)[1]}; keepalive 32; }}
""")
        self.extra_dirs = [cache]
        return self

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> Nginx:
        binary = nginx_binary()
        self.proc = subprocess.Popen([binary, "-c", str(self.conf), "-p", self.dir, "-e", f"{self.dir}/error.log"],
                                     stdout=subprocess.DEVNULL, stderr=open(Path(self.dir) / "stderr.log", "wb"))
        try:
            if self.tls:
                _wait_port(self.port, 20, self.proc)
            else:
                _wait_http(self.url + "/", 20, self.proc)
        except ServerStartError as e:
            self.stop()
            raise ServerStartError(f"nginx did not start: {e}\n{self.log_tail()}") from None
        return self

    def log_tail(self) -> str:
        out = []
        for name in ("error.log", "stderr.log"):
            try:
                out.append((Path(self.dir) / name).read_text(errors="replace")[-3000:])
            except OSError:
                pass
        return "\n".join(out)

    def requests(self) -> list[tuple[str, str, int, int, str]]:
        rows = []
        try:
            text = (Path(self.dir) / "access.log").read_text()
        except FileNotFoundError:
            return rows
        for line in text.splitlines():
            method, uri, status, sent, cache = line.split(" ")
            rows.append((method, uri, int(status), int(sent), cache))
        return rows

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for d in (self.dir, *self.extra_dirs):
            shutil.rmtree(d, ignore_errors=True)


def _wait_port(port: int, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"process exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise ServerStartError(f"port {port} did not open within {timeout:.0f} s")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class _Threaded(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


class FileServer:
    """``http.server`` serving ``root`` in a thread (HTTP/1.0: one request per connection, no Range)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.httpd = _Threaded(("127.0.0.1", 0), functools.partial(_Quiet, directory=os.fspath(root)))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> FileServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


Misbehave = Callable[["HostileHandler", str, bytes], bool]
"""``misbehave(handler, key, body) -> handled``: answer the request for ``key`` (whose true bytes are
``body``) in some broken way and return True, or return False to let the honest answer go out."""


class HostileHandler(http.server.BaseHTTPRequestHandler):
    """Serves the files of ``server.root`` (HTTP/1.1, keep-alive, Content-Length), except where
    ``server.misbehave`` takes over."""

    protocol_version = "HTTP/1.1"
    server: _HostileHTTPServer

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def key(self) -> str:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        prefix = self.server.prefix + "/"
        return path[len(prefix):] if path.startswith(prefix) else path.lstrip("/")

    def _serve(self, head: bool) -> None:
        key = self.key()
        self.server.hits.append((self.command, key))
        path = os.path.join(self.server.root, *key.split("/"))
        try:
            with open(path, "rb") as f:
                body = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            body = None
        if not head and body is not None and self.server.misbehave is not None and \
                self.server.misbehave(self, key, body):
            self.close_connection = True
            return
        if body is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    # -- building blocks for misbehaviours ----------------------------------------------------------
    def head_only(self, status: int = 200, **headers: str) -> None:
        """The status line and ``headers`` (underscores in names become dashes), nothing else yet."""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        self.wfile.flush()


class _HostileHTTPServer(_Threaded):
    root: str
    prefix: str
    misbehave: Misbehave | None
    hits: list[tuple[str, str]]


class HostileServer:
    """Serves the store folder ``root/<prefix>`` at ``/<prefix>``; ``misbehave`` (settable any time) breaks
    the answers it chooses. ``hits`` lists ``(method, key)`` of every request."""

    def __init__(self, root: str | os.PathLike[str], prefix: str = "store", misbehave: Misbehave | None = None):
        self.httpd = _HostileHTTPServer(("127.0.0.1", 0), HostileHandler)
        self.httpd.root = os.path.join(os.fspath(root), prefix)
        self.httpd.prefix = "/" + prefix
        self.httpd.misbehave = misbehave
        self.httpd.hits = []
        self.prefix = prefix
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{self.prefix}"

    @property
    def hits(self) -> list[tuple[str, str]]:
        return self.httpd.hits

    def set(self, misbehave: Misbehave | None) -> None:
        self.httpd.misbehave = misbehave

    def start(self) -> HostileServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def parse_access_log_uri(uri: str, prefix: str) -> str:
    """The store key of an access-log request URI under ``/<prefix>/``."""
    return re.sub(rf"^/{re.escape(prefix)}/", "", urllib.parse.unquote(uri))


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
