"""A real Postgres on this machine for the tests: Debian's ``postgresql`` 15 (``initdb``, ``pg_ctl``).

Everything lives in one temporary directory of its own (data directory, log, the unix socket):
``listen_addresses=''``, so no TCP port is opened and the machine's own Postgres, if any, is
never touched. Postgres refuses to run as root, so when the tests run as root (CI does) the
server runs as the ``postgres`` user (``runuser -u postgres --``); the directory is outside
pytest's ``tmp_path`` (whose parents only root can enter) and owned by that user.

    with PostgresServer() as pg:
        url = pg.create_database()     # postgresql://postgres@/t_1?host=/tmp/sftctl-pg-...
        pg.stop(); pg.start()          # an outage: the data directory stays

Durability is traded for speed (``fsync=off``): the data dies with the test session anyway.
Tests skip, with :func:`skip_reason`, only when the binaries are missing.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time

BIN_DIRS = ("/usr/lib/postgresql/15/bin", "/usr/local/bin", "/usr/bin")
RUN_AS = "postgres"


def _bin(name: str) -> str | None:
    return next((f"{d}/{name}" for d in BIN_DIRS if os.access(f"{d}/{name}", os.X_OK)), None) or shutil.which(name)


def skip_reason() -> str | None:
    """None when a server can start here, else why not (for ``pytest.skip``)."""
    missing = [b for b in ("initdb", "pg_ctl") if _bin(b) is None]
    if missing:
        return f"Postgres is not installed ({', '.join(missing)} missing): apt-get install postgresql (.ci/run does)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(RUN_AS)
        except KeyError:
            return f"running as root, and there is no {RUN_AS} user to run Postgres as (apt-get install postgresql makes it)"
    return None


class PostgresServer:
    """A throwaway Postgres cluster (see the module docstring). ``start_s``: how long the last
    :meth:`start` took (initdb included on the first)."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="sftctl-pg-")
        self.data = os.path.join(self.root, "data")
        self.log = os.path.join(self.root, "postgres.log")
        self._as_root = os.geteuid() == 0
        if self._as_root:
            ent = pwd.getpwnam(RUN_AS)
            os.chown(self.root, ent.pw_uid, ent.pw_gid)
        self._names = itertools.count(1)
        self.start_s: float | None = None

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = (("runuser", "-u", RUN_AS, "--") if self._as_root else ()) + argv
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if proc.returncode != 0:
            log = open(self.log).read()[-3000:] if os.path.exists(self.log) else ""
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}\n{log}")
        return proc

    def start(self) -> "PostgresServer":
        t0 = time.monotonic()
        if not os.path.exists(self.data):
            self._run(_bin("initdb"), "-D", self.data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        options = f"-c listen_addresses='' -k {self.root} -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(_bin("pg_ctl"), "-D", self.data, "-l", self.log, "-w", "-t", "120", "-o", options, "start")
        self.start_s = time.monotonic() - t0
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnects every client, as an outage does)."""
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            self._run(_bin("pg_ctl"), "-D", self.data, "-m", mode, "-w", "-t", "120", "stop")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@/{dbname}?host={self.root}"

    def create_database(self) -> str:
        """A new, empty database; its URL."""
        import psycopg

        name = f"t_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PostgresServer":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
