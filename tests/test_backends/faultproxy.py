"""A TCP proxy on 127.0.0.1 that injects real network faults between a client and a server.

Rules match an HTTP request by a substring of its request line (``"PUT "``,
``"/versions/"``) and act on the next ``count`` matching requests:

* ``cut_request``: close both sides after forwarding only part of the request
  (the upload breaks mid-body; the server never completes it);
* ``drop_response``: forward the whole request, then close the client side
  instead of relaying the answer (the write lands, the client never learns it);
* ``refuse``: close the connection as soon as the request line is seen (count=-1: every time).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass


@dataclass
class Rule:
    match: str
    action: str
    count: int


class FaultProxy:
    """Forward 127.0.0.1:``port`` to ``target_port``; ``add(match, action, count)`` arms a fault."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.rules: list[Rule] = []
        self.fired: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, match: str, action: str, count: int = 1) -> None:
        assert action in ("cut_request", "drop_response", "refuse")
        with self.lock:
            self.rules.append(Rule(match, action, count))

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def close(self) -> None:
        self._stop = True
        self.sock.close()

    def _rule_for(self, chunk: bytes) -> str | None:
        line = chunk.split(b"\r\n", 1)[0].decode("latin-1", "replace")
        if not line.split(" ", 1)[0] in ("GET", "PUT", "POST", "HEAD", "DELETE"):
            return None
        with self.lock:
            for rule in self.rules:
                if rule.count != 0 and rule.match in line:
                    if rule.count > 0:
                        rule.count -= 1
                    self.fired.append((rule.action, line))
                    return rule.action
        return None

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        state = {"drop": False}

        def close_both() -> None:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

        def down() -> None:  # server -> client
            try:
                while True:
                    data = upstream.recv(65536)
                    if not data:
                        break
                    if state["drop"]:
                        break
                    client.sendall(data)
            except OSError:
                pass
            close_both()

        threading.Thread(target=down, daemon=True).start()
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                action = self._rule_for(data)
                if action == "refuse":
                    break
                if action == "cut_request":
                    upstream.sendall(data[: max(1, len(data) // 2)])
                    break
                if action == "drop_response":
                    state["drop"] = True
                upstream.sendall(data)
        except OSError:
            pass
        if not state["drop"]:
            close_both()
