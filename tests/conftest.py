"""Shared fixtures: an isolated SFTCTL_HOME (and compiler cache) per test and a way to run the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh SFTCTL_HOME for this test (in this process and in the CLI processes it starts)."""
    h = tmp_path / "home"
    monkeypatch.setenv("SFTCTL_HOME", str(h))
    # the user's own ~/.config/sftctl/config.yaml must not reach a test (sftctl.settings)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.delenv("SFTCTL_CONFIG", raising=False)
    # a cold compiler cache too, as when it lived under SFTCTL_HOME (sftctl.compiler.cache)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return h


@pytest.fixture(autouse=True, scope="session")
def _compiler_cache_outside_the_users(tmp_path_factory):
    """The compiler's disk cache (``platformdirs.user_cache_dir("sftctl")``, i.e.
    ``$XDG_CACHE_HOME/sftctl`` on Linux) goes to a temporary directory shared by the session
    (the CLI processes tests start inherit it), never to the user's ``~/.cache``. Tests that
    take ``home`` get a fresh one of their own."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


def sftctl(*args: str, timeout: float = 300, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (``python -m sftctl.cli``) and capture its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "sftctl.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=kw.pop("cwd", REPO), **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"sftctl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def status_json(job_id: str | None = None) -> dict:
    args = ["status", "--json"] + ([job_id] if job_id else [])
    return json.loads(sftctl(*args, check=True).stdout)


def wait_for(predicate, timeout_s: float = 120, interval_s: float = 0.3, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def job_processes(job_id: str) -> list[int]:
    """Live processes tagged with the job's id (the local provider's node tag)."""
    from sftctl import procs

    return procs.tagged("SFTCTL_JOB_ID", job_id)


#: A two-node job that runs until it is taken down (prints "started" first).
SLEEPER = """\
name: sleeper
resources: {nodes: 2}
run: |
  echo started
  sleep 300
"""


def write_spec(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def no_traceback(proc: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto's server for the whole session (a real HTTP server on a free loopback port)."""
    from servers import moto_server

    with moto_server() as url:
        yield url


@pytest.fixture
def aws(moto_endpoint, monkeypatch) -> str:
    """This test's process (and the CLI processes it starts) talk to moto; yields the endpoint."""
    from servers import aws_env

    for key, value in aws_env(moto_endpoint).items():
        monkeypatch.setenv(key, value)
    return moto_endpoint


@pytest.fixture(scope="session")
def gcs_endpoint():
    """gcp-storage-emulator for the whole session (a real HTTP server on a free loopback port)."""
    from servers import gcs_emulator_server

    with gcs_emulator_server() as url:
        yield url
