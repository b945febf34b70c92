"""`sftctl server start` on a free loopback port for a benchmark's run (benchmarks/dashboard_pages.py,
benchmarks/server_status.py): started, waited on until GET /v1/health answers 200, terminated."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sftctl_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield the URL (``http://127.0.0.1:PORT``) of an `sftctl server start` process run with
    ``env`` (None: this process's environment: its SFTCTL_HOME is the server's state) in a
    session of its own, its output discarded, once it answers GET /v1/health (polled every
    0.2 s, 300 tries of up to 2 s each; SystemExit if it never does). Terminated on exit (30 s)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "server", "start", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise SystemExit("the server did not answer")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
