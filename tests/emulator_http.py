"""What the Google REST emulators share (tests/gce_emulator.py, tests/tpu_emulator.py): the JSON
HTTP handler, the server's start and stop, and long-running operations that move one stage per
read and apply their effect once done (the callers poll them, as they poll Google's)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Hashable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """Serves ``emulator.handle(method, path, body) -> (status, JSON payload)`` for GET, POST and
    DELETE, quietly (no request log)."""

    protocol_version = "HTTP/1.1"
    emulator: Any

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        status, payload = self.emulator.handle(method, self.path, body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self._serve("GET")

    def do_POST(self):  # noqa: N802
        self._serve("POST")

    def do_DELETE(self):  # noqa: N802
        self._serve("DELETE")

    def log_message(self, *args) -> None:
        pass


def start_server(emulator: Any, name: str) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """A server on 127.0.0.1 (a free port) serving ``emulator`` from a daemon thread."""
    handler = type(f"{type(emulator).__name__}Handler", (JsonHandler,), {"emulator": emulator})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True)
    thread.start()
    return server, thread


def stop_server(server: ThreadingHTTPServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(5)


def server_url(server: ThreadingHTTPServer) -> str:
    """``http://host:port``: the endpoint to give a client (``client_options={"api_endpoint": url}``)."""
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


class Operations:
    """Long-running operations by key: their JSON in ``ops`` (the caller's format: GCE's
    ``compute#operation`` with ``status``, or google.longrunning's with ``done``) and an effect
    each applies when done.

    :meth:`advance` is one read: ``step(op)`` moves the operation one stage and says whether it
    has just become done (GCE: PENDING -> RUNNING -> DONE; Cloud TPU: not done -> done), then
    ``apply(op, effect)`` runs once (``effect`` None where none was set)."""

    def __init__(self) -> None:
        self.ops: dict[Hashable, dict] = {}
        self._effects: dict[Hashable, Any] = {}

    def add(self, key: Hashable, op: dict, effect: Any = None) -> dict:
        self.ops[key] = op
        if effect is not None:
            self._effects[key] = effect
        return op

    def set_effect(self, key: Hashable, effect: Any) -> None:
        self._effects[key] = effect

    def advance(self, key: Hashable, step: Callable[[dict], bool],
                apply: Callable[[dict, Any], None]) -> dict | None:
        """The operation after one read, or None when there is none of that key."""
        op = self.ops.get(key)
        if op is not None and step(op):
            apply(op, self._effects.pop(key, None))
        return op
