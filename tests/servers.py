"""Real HTTP servers the tests talk to: moto's server (AWS), started on a free loopback port.

Each server runs as a subprocess for the whole test session and is stopped when it ends, so
`.ci/run` needs nothing running beforehand. Clients reach them through the endpoints the SDKs
already honour (``AWS_ENDPOINT_URL``), never through a mock of the client library.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} after {timeout_s} s")


@contextlib.contextmanager
def server(argv: list[str], port: int, env: dict | None = None):
    """Run ``argv`` (which must listen on ``port``) until the block ends; yield the base URL."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def moto_server():
    """moto's standalone server (``python -m moto.server``); yields its endpoint URL."""
    port = free_port()
    with server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port) as url:
        yield url


def aws_env(endpoint: str) -> dict[str, str]:
    """Environment that points boto3 at ``endpoint`` with moto's fake credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@contextlib.contextmanager
def gcs_emulator_server():
    """gcp-storage-emulator (in memory) on a free loopback port; yields its endpoint URL.

    google-cloud-storage reaches it through ``STORAGE_EMULATOR_HOST`` (see :func:`gcs_env`).
    """
    port = free_port()
    argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
            "--port", str(port), "--in-memory", "--quiet"]
    with server(argv, port) as url:
        yield url


def gcs_env(endpoint: str) -> dict[str, str]:
    """Environment that points google-cloud-storage at the emulator at ``endpoint``."""
    return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "sftctl-test"}
