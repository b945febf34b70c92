"""Shared fixtures: an isolated SFTCTL_HOME (and compiler cache) per test and a way to run the real CLI."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A suite started in the background (`cmd &` in a shell without job control, as a CI runner or
# `nohup ... &` may start it) inherits SIGINT ignored, and so would every CLI it starts: the tests
# that send a child Ctrl-C then wait for ever. Each process of the suite (xdist's workers import
# this too) takes SIGINT back as a terminal's foreground run has it, so its children start with
# the default disposition and Python's KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: One lock for every copy of this suite on the machine (tests touch nothing else outside their
#: own directories). Local admission counts the CPUs of every sftctl job on the machine, whatever
#: its SFTCTL_HOME, so a test that asserts what admission says needs the machine to itself.
MACHINE_LOCK_DIR = Path(tempfile.gettempdir()) / "sftctl-tests"


@contextlib.contextmanager
def _machine(exclusive: bool):
    """Hold the machine shared (a test that runs local jobs beside others: most of them) or
    exclusive (a test that needs no other sftctl job on the machine). A turnstile keeps a waiting
    exclusive holder from being starved by a stream of shared ones: each taker passes the gate
    first, and an exclusive taker keeps the gate until the shared holders have drained."""
    import filelock

    MACHINE_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    gate = filelock.FileLock(MACHINE_LOCK_DIR / "gate.lock", is_singleton=False)
    rw = filelock.ReadWriteLock(MACHINE_LOCK_DIR / "machine.db", is_singleton=False)
    if exclusive:
        with gate, rw.write_lock():
            yield
    else:
        with gate:
            rw.acquire_read()
        try:
            yield
        finally:
            rw.release()


@pytest.fixture
def machine_to_ourselves():
    """Use for a test that asserts what local admission sees (CPUs taken, jobs counted): it waits
    until no other test on the machine (of this suite or a copy of it) runs local jobs, and keeps
    them out until it ends."""
    with _machine(exclusive=True):
        yield


@pytest.fixture
def home(tmp_path, monkeypatch, request):
    """A fresh SFTCTL_HOME for this test (in this process and in the CLI processes it starts).

    The compiler's disk cache (traces, compiled steps, searches) stays the session's: a model is
    traced once per session, not once per test. A test about the cache itself asks for a cold one
    of its own with ``@pytest.mark.cold_cache``."""
    h = tmp_path / "home"
    monkeypatch.setenv("SFTCTL_HOME", str(h))
    # the user's own ~/.config/sftctl/config.yaml must not reach a test (sftctl.settings)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.delenv("SFTCTL_CONFIG", raising=False)
    if request.node.get_closest_marker("cold_cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    if "machine_to_ourselves" in request.fixturenames:
        yield h
        return
    with _machine(exclusive=False):  # local jobs of this test share the machine with others
        yield h


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


def slowdown() -> float:
    """How many times slower than a quiet machine this one runs right now: the run queue per core,
    ``max(1, max(load_1min, load_5min) / cores)`` (1.0 on a quiet machine, 4.0 on a 2-core machine at
    load 8). Every deadline in the suite is a quiet-machine budget multiplied by this, read when the
    wait starts (and again while it goes on), so a busy, shared machine gets the time its load takes
    and a hang still ends the test."""
    try:
        load = max(os.getloadavg()[:2])
    except OSError:  # no load average on this platform: trust the quiet budgets
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def deadline(quiet_s: float) -> float:
    """A timeout in seconds for work that takes at most ``quiet_s`` seconds on a quiet machine,
    scaled by :func:`slowdown` now."""
    return quiet_s * slowdown()


def sftctl(*args: str, timeout: float = 300, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (``python -m sftctl.cli``) and capture its output.
    ``timeout`` is the quiet-machine budget in seconds; it is scaled by :func:`slowdown`."""
    proc = subprocess.run(
        [sys.executable, "-m", "sftctl.cli", *args],
        capture_output=True, text=True, timeout=deadline(timeout), cwd=kw.pop("cwd", REPO), **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"sftctl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def status_json(job_id: str | None = None) -> dict:
    """The document ``sftctl status --json [JOB]`` prints, built in this process by the api that
    builds the CLI's (tests poll it in loops: a CLI process per poll took a core's half on this
    2-core machine from the jobs being waited on). Tests of the CLI's own output call
    ``sftctl("status", "--json")``."""
    from sftctl import api

    doc = api.status(job_id).to_dict() if job_id else {"jobs": [v.to_dict() for v in api.status()]}
    return json.loads(json.dumps(doc, default=str))


def wait_for(predicate, timeout_s: float = 120, interval_s: float = 0.3, what: str = "condition",
             report=None):
    """Poll ``predicate`` until it returns a truthy value; fail the test once ``timeout_s`` (a
    quiet-machine budget) times the machine's :func:`slowdown` has passed. The slowdown is read
    again on every poll, so a load that rises during the wait extends it. ``report``: called at
    the timeout, its string added to the failure message (processes, logs: pytest rotates the
    tmp dirs of old runs away, so what is not in the message is lost)."""
    start = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        waited = time.monotonic() - start
        if waited > deadline(timeout_s):
            raise AssertionError(f"timed out after {waited:.0f} s waiting for {what} "
                                 f"(budget {timeout_s} s on a quiet machine, slowdown {slowdown():.1f}x)"
                                 + (f"\n{report()}" if report else ""))
        time.sleep(interval_s)


@pytest.fixture
def server(home, tmp_path):
    """A real ``sftctl server`` (tests/test_server.py's ``Server``) on a free port, in this test's
    ``home``, its log in ``tmp_path/server.log``; stopped after the test. A module that needs
    another (an environment of its own, another state) defines a ``server`` fixture of its own."""
    from test_server import Server

    s = Server(home, tmp_path / "server.log").start()
    yield s
    s.stop()


@pytest.fixture
def x64():
    """JAX with 64-bit types for the test (float64 references), put back after it."""
    jax = pytest.importorskip("jax")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def process_report(job_id: str) -> str:
    """For a failure message: every live process tagged with the job's id (pid, parent, state,
    node tag, command line) and the tail of each of the job's node logs under the sftctl home."""
    from sftctl import paths, procs

    lines = []
    nodes = procs.tag_values("SFTCTL_NODE_ID")
    for pid in sorted(procs.tagged("SFTCTL_JOB_ID", job_id)):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        lines.append(f"  pid {pid} ppid {ppid} {state} node {nodes.get(pid)}: {cmd[:200]}")
    for log in sorted(paths.job_dir(job_id).rglob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-8:]
        lines.append(f"  {log.relative_to(paths.job_dir(job_id))}:\n" + "\n".join(f"    {t}" for t in tail))
    return "processes of the job and its logs:\n" + ("\n".join(lines) or "  none")


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


def script_job(tmp_path: Path, name: str, script: str, fields: str) -> str:
    """A job spec running ``script`` (written as ``tmp_path/train.py``) in ``tmp_path``, health
    checks off: ``tmp_path/job.yaml``, whose path is returned. ``fields``: more top-level YAML
    lines, each ending in a newline (``env``, ``train``, ``resources``)."""
    (tmp_path / "train.py").write_text(script)
    text = f"name: {name}\nworkdir: {tmp_path}\nrun: python train.py\n{fields}health: {{enabled: false}}\n"
    return str(write_spec(tmp_path / "job.yaml", text))


def run_injected(spec: str, plan_for):
    """Submit ``spec``, store ``plan_for(offering)`` (a :class:`sftctl.types.Plan` for the
    offering the planner chose: an injected prediction) as its plan, and run its controller in
    this process to the end. Returns ``(job id, final JobStatus, Store, the injected Plan)``."""
    from sftctl import api
    from sftctl.controller.lifecycle import Controller
    from sftctl.state import Store

    job = api.submit(spec).job_id
    store = Store()
    plan = plan_for(store.get_job(job).plan.offering)
    store.update_job(job, offering_json=plan.to_dict())
    return job, Controller(store, job).run(), store, plan


def no_traceback(proc: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


os.environ.setdefault("PYTHONUNBUFFERED", "1")
# Tables are laid out for the width they are printed at: a terminal's, else $COLUMNS, else 80. The
# suite fixes one width however pytest was started (a terminal, a pipe, an xdist worker, whose
# CLI subprocesses saw 80 and wrapped the cells tests look for); a test of a narrow table sets its own.
os.environ["COLUMNS"] = "200"


@pytest.fixture(scope="session")
def postgres():
    """A real Postgres (Debian's postgresql 15) for the session: tests/pg_server.py. Skips only
    when its binaries are missing."""
    from pg_server import PostgresServer, skip_reason

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with PostgresServer() as pg:
        yield pg


@pytest.fixture
def pg_url(postgres, home, monkeypatch) -> str:
    """A new database on the session's Postgres, made this test's state (``SFTCTL_STATE_URL``,
    which the CLI processes the test starts inherit)."""
    url = postgres.create_database()
    monkeypatch.setenv("SFTCTL_STATE_URL", url)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def state_backend(request, home) -> str:
    """Run the test twice: on SQLite in its $SFTCTL_HOME, and on a new database of the session's
    real Postgres (``pg_url``). Returns ``"sqlite"`` or ``"postgres"``."""
    if request.param == "postgres":
        request.getfixturevalue("pg_url")
    return request.param


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
