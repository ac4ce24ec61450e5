"""A small local stand-in for the Hugging Face Hub's *bucket* HTTP routes.

No Hub server can run offline, so the HF backend's tests drive the real
``huggingface_hub`` client (and the real ``hf_xet`` transfer engine) against
this server. It implements only the routes that client calls for buckets,
read from ``huggingface_hub``'s source (``HfApi.create_bucket``,
``bucket_info``, ``delete_bucket``, ``list_bucket_tree``,
``get_bucket_paths_info``, ``batch_bucket_files``, ``get_bucket_file_metadata``
/ ``download_bucket_files``):

=======  ==============================================  ==========================
method   route                                           what
=======  ==============================================  ==========================
POST     /api/buckets/{ns}/{name}                        create (409 if it exists)
GET      /api/buckets/{ns}/{name}                        bucket info
DELETE   /api/buckets/{ns}/{name}                        delete the bucket
GET      /api/buckets/{ns}/{name}/xet-{read|write}-token CAS token: ``local://DIR``
GET      /api/buckets/{ns}/{name}/tree[/{prefix}]        list files (one page)
POST     /api/buckets/{ns}/{name}/paths-info             info for given paths
POST     /api/buckets/{ns}/{name}/batch                  NDJSON add/copy/delete
HEAD     /buckets/{ns}/{name}/resolve/{path}             xet hash, refresh route, size
=======  ==============================================  ==========================

File *contents* never pass through this server: ``hf_xet`` uploads and
downloads them itself, through its ``local://DIR`` content store, exactly as
it talks to the Hub's CAS in production. The server only keeps the bucket
index (path -> xet hash, size, mtime), in memory.

Authentication: every request must carry ``Authorization: Bearer <token>``
with the server's token; otherwise 401 with the Hub's
``X-Error-Message: Invalid credentials in Authorization header``. A missing
bucket is 404 with ``X-Error-Code: RepoNotFound`` (the client maps it to
``BucketNotFoundError``).

Fault injection for tests: ``server.fail_next(route, count, status)`` makes the
next ``count`` requests whose route name is ``route`` (``"batch"``,
``"paths-info"``, ``"tree"``, ...) answer ``status`` (or, with ``status=0``,
close the connection without an answer).

``server.absent_prefix_status``: what a tree listing of a prefix that holds no
file answers: 200 with an empty page (default) or 404 ``EntryNotFound``, the
two answers a real Hub can give.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_API = "/api/buckets/"
_RESOLVE = "/buckets/"


def _iso(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class HFBucketStandin:
    """The stand-in server. ``start()`` binds 127.0.0.1 on a free port; ``endpoint`` is its URL.

    ``cas_dir`` is the folder given to ``hf_xet`` as ``local://cas_dir``;
    ``token`` is the only accepted bearer token.
    """

    def __init__(self, cas_dir: str, token: str = "hf_standin_token"):
        self.cas_dir = cas_dir
        self.token = token
        self.buckets: dict[str, dict[str, dict[str, Any]]] = {}
        self.created: dict[str, float] = {}
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []  # (method, route name), for tests
        self._faults: dict[str, list[int]] = {}
        self.absent_prefix_status = 200
        self._sizes: dict[str, int] = {}
        self._xet: Any = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HFBucketStandin:
        handler = type("Handler", (_Handler,), {"standin": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hf-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def fail_next(self, route: str, count: int = 1, status: int = 503) -> None:
        """Make the next ``count`` requests to ``route`` fail with ``status`` (0: drop the connection)."""
        with self.lock:
            self._faults.setdefault(route, []).extend([status] * count)

    def file_size(self, xet_hash: str) -> int:
        """Bytes of the file ``xet_hash`` in the CAS, counted by streaming it through ``hf_xet``."""
        import hf_xet

        with self.lock:
            if xet_hash in self._sizes:
                return self._sizes[xet_hash]
            group = self._xet
        if group is None:
            group = self._session().new_download_stream_group(endpoint=f"local://{self.cas_dir}")
            with self.lock:
                self._xet = group
        size = sum(len(chunk) for chunk in group.download_stream(hf_xet.XetFileInfo(xet_hash)))
        with self.lock:
            self._sizes[xet_hash] = size
        return size

    @staticmethod
    def _session() -> Any:
        import hf_xet

        return hf_xet.XetSession()

    def _take_fault(self, route: str) -> int | None:
        with self.lock:
            pending = self._faults.get(route)
            return pending.pop(0) if pending else None


class _Handler(BaseHTTPRequestHandler):
    standin: HFBucketStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # -- plumbing ------------------------------------------------------------------
    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.standin.token}":
            return True
        self._error(401, "Invalid credentials in Authorization header")
        return False

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        path = url.path
        if path.startswith(_API):
            parts = path[len(_API):].split("/", 3)
            if len(parts) < 2:
                return self._error(404, "not found")
            bucket_id = f"{parts[0]}/{parts[1]}"
            route = parts[2] if len(parts) > 2 else "bucket"
            rest = unquote(parts[3]) if len(parts) > 3 else ""
        elif path.startswith(_RESOLVE) and "/resolve/" in path:
            head, _, rest = path[len(_RESOLVE):].partition("/resolve/")
            bucket_id, route, rest = head, "resolve", unquote(rest)
        else:
            return self._error(404, f"no route {self.command} {path}")
        self.standin.requests.append((self.command, route))
        fault = self.standin._take_fault(route)
        if fault is not None:
            self._body()
            if fault == 0:
                self.close_connection = True
                self.connection.shutdown(2)  # drop it: the client sees a network error
                return
            return self._error(fault, f"injected fault {fault}")
        if not self._authorized():
            return
        handler = getattr(self, f"_{self.command.lower()}_{route.replace('-', '_')}", None)
        if handler is None:
            return self._error(404, f"no route {self.command} {path}")
        if route != "bucket" or self.command != "POST":
            with self.standin.lock:
                exists = bucket_id in self.standin.buckets
            if not exists:
                return self._error(404, f"bucket {bucket_id} not found", "RepoNotFound")
        handler(bucket_id, rest, parse_qs(url.query))

    do_GET = do_POST = do_DELETE = do_HEAD = _dispatch

    # -- routes ----------------------------------------------------------------------
    def _post_bucket(self, bucket_id: str, rest: str, query: dict) -> None:
        self._body()
        url = f"{self.standin.endpoint}/buckets/{bucket_id}"
        with self.standin.lock:
            exists = bucket_id in self.standin.buckets
            if not exists:
                self.standin.buckets[bucket_id] = {}
                self.standin.created[bucket_id] = time.time() * 1000
        if exists:  # the Hub's 409 body also carries the url (create_bucket(exist_ok=True) reads it)
            message = f"bucket {bucket_id} already exists"
            return self._send(409, {"error": message, "url": url}, {"X-Error-Message": message})
        self._send(200, {"url": url, "name": bucket_id})

    def _get_bucket(self, bucket_id: str, rest: str, query: dict) -> None:
        with self.standin.lock:
            files = self.standin.buckets[bucket_id]
            info = {"id": bucket_id, "private": True, "createdAt": _iso(self.standin.created[bucket_id]),
                    "size": sum(f["size"] for f in files.values()), "totalFiles": len(files)}
        self._send(200, info)

    def _delete_bucket(self, bucket_id: str, rest: str, query: dict) -> None:
        with self.standin.lock:
            self.standin.buckets.pop(bucket_id, None)
        self._send(200, {})

    def _token(self, bucket_id: str) -> None:
        body = {"accessToken": "local-cas-token", "exp": int(time.time()) + 3600,
                "casUrl": f"local://{self.standin.cas_dir}"}
        headers = {"X-Xet-Cas-Url": body["casUrl"], "X-Xet-Access-Token": body["accessToken"],
                   "X-Xet-Token-Expiration": str(body["exp"])}
        self._send(200, body, headers)

    def _get_xet_read_token(self, bucket_id: str, rest: str, query: dict) -> None:
        self._token(bucket_id)

    def _get_xet_write_token(self, bucket_id: str, rest: str, query: dict) -> None:
        self._token(bucket_id)

    def _get_tree(self, bucket_id: str, rest: str, query: dict) -> None:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = rest
        with self.standin.lock:
            files = dict(self.standin.buckets[bucket_id])
        out: list[dict[str, Any]] = []
        folders: set[str] = set()
        base = prefix.rstrip("/") + "/" if prefix else ""
        for path, entry in sorted(files.items()):
            if prefix and not (path == prefix or path.startswith(base)):
                continue
            tail = path[len(base):]
            if not recursive and "/" in tail:
                folder = base + tail.split("/", 1)[0]
                if folder not in folders:
                    folders.add(folder)
                    out.append({"type": "directory", "path": folder, "uploadedAt": _iso(entry["uploaded"])})
                continue
            out.append(self._file_entry(path, entry))
        if prefix and not out and self.standin.absent_prefix_status == 404:
            return self._error(404, f"{prefix} not found in bucket {bucket_id}", "EntryNotFound")
        self._send(200, out)

    @staticmethod
    def _file_entry(path: str, entry: dict[str, Any]) -> dict[str, Any]:
        return {"type": "file", "path": path, "size": entry["size"], "xetHash": entry["xetHash"],
                "mtime": _iso(entry["mtime"]), "uploadedAt": _iso(entry["uploaded"])}

    def _post_paths_info(self, bucket_id: str, rest: str, query: dict) -> None:
        paths = json.loads(self._body() or b"{}").get("paths", [])
        with self.standin.lock:
            files = self.standin.buckets[bucket_id]
            out = [self._file_entry(p, files[p]) for p in paths if p in files]
        self._send(200, out)

    def _post_batch(self, bucket_id: str, rest: str, query: dict) -> None:
        ops = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        failed = []
        now = time.time() * 1000
        sizes = {op["xetHash"]: self._xet_size(op["xetHash"]) for op in ops
                 if op.get("type") in ("addFile", "copyFile") and isinstance(op.get("xetHash"), str)}
        with self.standin.lock:
            files = self.standin.buckets[bucket_id]
            for op in ops:
                kind, path = op.get("type"), op.get("path")
                if not isinstance(path, str) or not path or path.startswith("/"):
                    failed.append({"path": path, "error": "invalid path"})
                elif kind in ("addFile", "copyFile"):
                    size = sizes[op["xetHash"]]
                    files[path] = {"xetHash": op["xetHash"], "size": size, "mtime": op.get("mtime") or now,
                                   "uploaded": now}
                elif kind == "deleteFile":
                    files.pop(path, None)
                else:
                    failed.append({"path": path, "error": f"unknown operation {kind!r}"})
        self._send(200 if len(failed) < len(ops) or not ops else 422, {"failed": failed})

    def _xet_size(self, xet_hash: str) -> int:
        """The size of the file ``xet_hash`` names, read back from the CAS (the client does not send it)."""
        return self.standin.file_size(xet_hash)

    def _head_resolve(self, bucket_id: str, rest: str, query: dict) -> None:
        with self.standin.lock:
            entry = self.standin.buckets[bucket_id].get(rest)
        if entry is None:
            return self._error(404, f"{rest} not found in bucket {bucket_id}", "EntryNotFound")
        refresh = f"{self.standin.endpoint}/api/buckets/{bucket_id}/xet-read-token"
        self._send(200, None, {"X-Xet-Hash": entry["xetHash"], "X-Xet-Refresh-Route": refresh,
                               "X-Linked-Size": str(entry["size"]), "Content-Length": str(entry["size"])})
