"""The node agent: ``python -m sftctl.agent``. Samples every GPU of this node every few seconds,
appends the samples to the node's ``health.jsonl`` (JSON lines, see
:mod:`sftctl.health.telemetry`), and serves the latest ones in Prometheus text format under
dcgm-exporter's metric names (``--port``, ``/metrics``).

The node bootstrap (``templates/node.sh.j2``) starts it next to the training on every node.
Settings come from flags or the node's environment:

* ``--out`` / ``$SFTCTL_NODE_DIR/health.jsonl``
* ``--interval`` / ``$SFTCTL_HEALTH_INTERVAL_S`` (seconds, default 2)
* ``--replay`` / ``$SFTCTL_TELEMETRY_REPLAY``: read a recorded stream instead of NVML (fault
  injection). With ``$SFTCTL_TELEMETRY_REPLAY_RANK`` it applies to that node rank only, and only
  to the first node of that rank (``$SFTCTL_NODE_GENERATION`` 0): a replacement node is healthy.
* ``--metrics-dir`` / ``$SFTCTL_METRICS_DIR``: the training's step reports, for ``at_step``
* ``--port`` / ``$SFTCTL_AGENT_PORT``: serve ``/metrics`` (off when unset)
* ``--address`` / ``$SFTCTL_AGENT_ADDRESS``: the address it binds (default 127.0.0.1; the spec's
  ``health.metrics_address`` opens it to a Prometheus elsewhere)

``/metrics`` asks for ``Authorization: Bearer TOKEN`` (:func:`metrics_token`): the local
provider's nodes share the server's network, so without it any job could read another job's
agent. TOKEN is ``$SFTCTL_AGENT_METRICS_TOKEN`` (the job's ``secrets:``), else the text of
:data:`TOKEN_FILE` beside ``--out`` (the node's directory), made 0600 on first use. No header:
401; another token: 403 (compared with :func:`hmac.compare_digest`).

It never fails a node: an unreadable GPU is a sample saying so, a machine without GPUs writes
one ``no_gpu`` record. SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import stat
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from sftctl import settings
from sftctl.health.prometheus import render
from sftctl.paths import create_private_file
from sftctl.health.sources import NoGpuSource, open_source
from sftctl.protocol import NodeDir


def _replay_path(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    path = settings.get("SFTCTL_TELEMETRY_REPLAY")
    if not path:
        return None
    rank = settings.get("SFTCTL_TELEMETRY_REPLAY_RANK")
    if rank is not None and rank != settings.get("SFTCTL_NODE_RANK"):
        return None
    if settings.get("SFTCTL_NODE_GENERATION") != 0:
        return None  # the replacement of a faulty node is healthy
    return path


#: the agent's /metrics token when ``$SFTCTL_AGENT_METRICS_TOKEN`` is unset: this file, 0600,
#: in the node's directory (beside ``--out``), made on first use
TOKEN_FILE = "agent-metrics.token"


def metrics_token(directory: Path) -> str:
    """The bearer token ``/metrics`` asks for: ``$SFTCTL_AGENT_METRICS_TOKEN`` when set, else
    the text of ``directory/``:data:`TOKEN_FILE` (32 random bytes, URL-safe; made now, mode
    0600, when missing; an existing one is kept, so a restarted agent keeps its token).

    Raises:
        OSError: the file cannot be made or read, is a link (``ELOOP``), or is readable by
            others or empty (``EPERM``, naming why).
    """
    configured = settings.get("SFTCTL_AGENT_METRICS_TOKEN")
    if configured:
        return configured
    path = directory / TOKEN_FILE
    create_private_file(path, secrets.token_urlsafe(32) + "\n")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
        mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        token = f.read().strip()
    if mode & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {mode:o}); remove it and a new one is made")
    if not token:
        raise PermissionError(f"{path} is empty; remove it and a new one is made")
    return token


def _serve(port: int, latest: list, lock: threading.Lock, address: str = "127.0.0.1", *, token: str) -> None:
    """Serve ``/metrics`` on ``address:port`` (loopback unless the spec's
    ``health.metrics_address`` opens it) to a request with ``Authorization: Bearer token``:
    no such header, 401 (``WWW-Authenticate: Bearer``); another token, 403; another path, 404.

    Raises:
        OSError: the address cannot be bound.
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    expected = token.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/metrics":
                self.send_error(404)
                return
            scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                self._refuse(401, "send Authorization: Bearer TOKEN: the node's $SFTCTL_AGENT_METRICS_TOKEN, "
                                  f"else its {TOKEN_FILE}")
                return
            if not hmac.compare_digest(given.strip().encode(), expected):
                self._refuse(403, "that is not this agent's metrics token")
                return
            with lock:
                body = render(list(latest), socket.gethostname()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _refuse(self, code: int, why: str) -> None:
            body = f"{why}\n".encode()
            self.send_response(code)
            if code == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((address, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sftctl.agent",
        description="Sample this node's GPUs into a JSON-lines file and serve them to Prometheus.",
    )

    node_dir = settings.get("SFTCTL_NODE_DIR")
    ap.add_argument("--out", default=str(NodeDir(Path(node_dir)).health), help="JSON-lines file to append samples to")
    ap.add_argument("--interval", type=_positive, default=_positive(str(settings.get("SFTCTL_HEALTH_INTERVAL_S"))),
                    help="seconds between samples")
    ap.add_argument("--replay", default=None, help="read a recorded stream instead of NVML (fault injection)")
    ap.add_argument("--metrics-dir", default=settings.get("SFTCTL_METRICS_DIR"),
                    help="the training's step reports, for replay records with at_step")
    ap.add_argument("--port", type=int, default=settings.get("SFTCTL_AGENT_PORT"),
                    help="serve /metrics on this port (0: off)")
    ap.add_argument("--address", default=settings.get("SFTCTL_AGENT_ADDRESS"),
                    help="address /metrics binds (default loopback; the spec's health.metrics_address)")
    ap.add_argument("--count", type=_non_negative, default=0, help="stop after this many samples (0: until SIGTERM)")
    args = ap.parse_args(argv)
    os.umask(0o077)  # its samples are the job's files: owner-only

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", buffering=1) as f:
        def problem(message: str) -> None:
            """Say it in the stream (the controller turns it into an event) and keep going."""
            f.write(json.dumps({"ts": time.time(), "agent_error": message}) + "\n")
            print(f"sftctl agent: {message}", file=sys.stderr, flush=True)

        try:
            source = open_source(replay_path=_replay_path(args.replay), metrics_dir=args.metrics_dir)
        except Exception as e:  # noqa: BLE001 a bad replay file: report it, sample nothing, never kill the node
            problem(f"cannot read telemetry: {type(e).__name__}: {e}")
            source = NoGpuSource()
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        latest: list[dict] = []
        last_xid: dict[int, dict] = {}  # per GPU, the last sample with an XID: /metrics keeps it
        lock = threading.Lock()
        if args.port:
            try:
                _serve(args.port, latest, lock, args.address, token=metrics_token(out.parent))
            except OSError as e:
                problem(f"cannot serve /metrics on port {args.port}: {e.strerror or e}; sampling goes on")
        ticks = 0
        while not stop.is_set():
            now = time.time()
            try:
                samples = source.sample()
            except Exception as e:  # noqa: BLE001 a broken source is a sample saying so, never a dead agent
                samples = [{"agent_error": f"{type(e).__name__}: {e}"}]
            for s in samples:
                s.setdefault("ts", now)
                f.write(json.dumps(s) + "\n")
                if s.get("xids") and "gpu" in s:
                    last_xid[s["gpu"]] = s
            gpus = [s for s in samples if "gpu" in s]
            if gpus:
                with lock:
                    latest[:] = [x for g, x in sorted(last_xid.items()) if x not in gpus] + gpus
            ticks += 1
            if args.count and ticks >= args.count:
                break
            stop.wait(args.interval)
    return 0


def _positive(text: str) -> float:
    """A finite number of seconds above 0 (``inf`` and ``nan`` are refused: ``Event.wait(inf)``
    raises OverflowError)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
