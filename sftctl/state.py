"""Durable state: jobs, nodes, attempts, events, metrics, users and controller leases.

Two backends behind one :class:`Store`, one schema and one ordered list of migrations
(:data:`MIGRATIONS`; what differs between them is the small :class:`_Dialect`):

* **SQLite**, the default, with nothing to set up (described below). Only ``sqlite3`` is
  imported: ``sftctl status`` stays as light as it was.
* **Postgres**, when ``state.url`` (``SFTCTL_STATE_URL``) is a ``postgresql://`` URL: a lab's
  shared state, used by several machines at once. psycopg 3 (``pip install 'sftctl[server]'``)
  is imported only then. Migrations run in one transaction under an advisory lock. A job's
  controller holds a lease on it in the database (:meth:`Store.acquire_lease`,
  :class:`LeaseKeeper`), so two machines never both run it, and liveness is the lease
  (:meth:`Store.reap_dead_controllers`), not a pid of this machine. A controller's Store rides
  out an unreachable database (:attr:`Store.retry_window_s`).

The SQLite file is ``$SFTCTL_HOME/state.db``, readable by its owner only (0600). Shell scripts start many
``sftctl`` processes at once, so every write is one short ``BEGIN IMMEDIATE`` transaction under a
generous busy timeout: writers queue instead of failing with "database is locked". The schema
carries a version (``PRAGMA user_version``) and is migrated forward on open, under a file lock.

The store also enforces the job lifecycle: :meth:`Store.transition` is a compare-and-set on the
job's status, so a controller and a concurrent ``sftctl down`` can never both win::

    PENDING -> PROVISIONING -> LAUNCHING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
                                  ^            |
                                  +- RECOVERING <-+        (restart from the last checkpoint)

Any live status may also go to FAILED, CANCELLED, or FAILED_CONTROLLER (the controller process
died; ``sftctl down`` still cleans its nodes up).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

from sftctl import settings
from sftctl.paths import sftctl_home
from sftctl.types import (TERMINAL, Attempt, AttemptStatus, Event, JobRecord, JobStatus, MetricsRecord,  # noqa: F401
                          NodeRecord, NodeState, User, capabilities)  # (re-exported)


_UNBILLED = {NodeState.TERMINATED, NodeState.REPLACED}  # a node in these stopped billing
_USER_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")
_ENDINGS = {JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.FAILED_CONTROLLER}
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.PENDING: frozenset({JobStatus.PROVISIONING} | _ENDINGS),
    JobStatus.PROVISIONING: frozenset({JobStatus.LAUNCHING} | _ENDINGS),
    JobStatus.LAUNCHING: frozenset({JobStatus.RUNNING, JobStatus.RECOVERING} | _ENDINGS),  # a launch cut short
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.RECOVERING} | _ENDINGS),
    JobStatus.RECOVERING: frozenset({JobStatus.PROVISIONING, JobStatus.LAUNCHING} | _ENDINGS),
    **{s: frozenset() for s in TERMINAL},
}

SCHEMA_VERSION = 8
# Each migration takes the schema from version i to i + 1, on SQLite and on Postgres alike.
# Append; never change what a landed one does. Types are written as tokens the dialect fills in
# ({real}, {int}, {autoid}; see _Dialect); {os_user} is this machine's user as an SQL literal.
# Statements are separated by ";" (never one inside a literal).
MIGRATIONS: list[str] = [
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        status TEXT NOT NULL,
        spec_json TEXT NOT NULL,
        spec_path TEXT,
        provider TEXT,
        offering_json TEXT,
        controller_pid {int},
        controller_start_ticks {int},
        restarts {int} NOT NULL DEFAULT 0,
        failure_reason TEXT,
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL,
        ended_at {real}
    );
    CREATE INDEX jobs_status ON jobs(status);
    CREATE TABLE nodes (
        id TEXT PRIMARY KEY,
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        rank {int} NOT NULL,
        provider TEXT NOT NULL,
        status TEXT NOT NULL,
        handle_json TEXT NOT NULL DEFAULT '{}',
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL
    );
    CREATE INDEX nodes_job ON nodes(job_id);
    CREATE TABLE attempts (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        number {int} NOT NULL,
        status TEXT NOT NULL,
        exit_code {int},
        reason TEXT,
        started_at {real} NOT NULL,
        ended_at {real},
        PRIMARY KEY (job_id, number)
    );
    CREATE TABLE events (
        id {autoid},
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        ts {real} NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        data_json TEXT
    );
    CREATE INDEX events_job ON events(job_id, id);
    CREATE TABLE metrics (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        rank {int} NOT NULL,
        step {int} NOT NULL,
        loss {real},
        step_time_s {real},
        tokens_per_s {real},
        first_step {int},
        first_loss {real},
        ts {real} NOT NULL,
        PRIMARY KEY (job_id, rank)
    );
    """,
    # 2: why a job still waits in PENDING (local admission control: CPUs or memory taken)
    """
    ALTER TABLE jobs ADD COLUMN pending_reason TEXT;
    """,
    # 3: the code of each failure line (sftctl.types.FailureCode), for programs; the line stays
    """
    ALTER TABLE jobs ADD COLUMN failure_code TEXT;
    ALTER TABLE attempts ADD COLUMN reason_code TEXT;
    """,
    # 4: the version in a table both dialects read (SQLite keeps PRAGMA user_version too: an
    # older sftctl reads that one, and refuses a newer file)
    """
    CREATE TABLE schema_version (version {int} NOT NULL);
    INSERT INTO schema_version (version) VALUES (4);
    """,
    # 5: users and their tokens (sha256 of a random 32-byte token: never the token), and who owns
    # each job (the local OS user for jobs recorded before)
    """
    CREATE TABLE users (
        name TEXT PRIMARY KEY,
        admin {int} NOT NULL DEFAULT 0,
        token_hash TEXT NOT NULL UNIQUE,
        created_at {real} NOT NULL
    );
    ALTER TABLE jobs ADD COLUMN owner TEXT;
    UPDATE jobs SET owner = {os_user};
    CREATE INDEX jobs_owner ON jobs(owner, created_at);
    """,
    # 6: one live controller per job across machines: a lease with an expiry, renewed by heartbeat
    """
    CREATE TABLE leases (
        job_id TEXT PRIMARY KEY REFERENCES jobs(id) ON DELETE CASCADE,
        holder TEXT NOT NULL,
        acquired_at {real} NOT NULL,
        expires_at {real} NOT NULL
    );
    """,
    # 7: when a node stopped billing (TERMINATED or REPLACED): node-hours, hence cost
    """
    ALTER TABLE nodes ADD COLUMN ended_at {real};
    UPDATE nodes SET ended_at = updated_at WHERE status IN ('TERMINATED', 'REPLACED');
    """,
    # 8: zones that took a spot node back, avoided by every job until the cool-down ends
    """
    CREATE TABLE blocked_zones (
        provider TEXT NOT NULL,
        instance_type TEXT NOT NULL,
        zone TEXT NOT NULL,
        until {real} NOT NULL,
        reason TEXT NOT NULL,
        job_id TEXT,
        PRIMARY KEY (provider, instance_type, zone)
    );
    """,
]
assert len(MIGRATIONS) == SCHEMA_VERSION

BUSY_TIMEOUT_MS = settings.SETTINGS["SFTCTL_STATE_BUSY_TIMEOUT_MS"].default  # the tests set a short one
LOCKED_RETRY_S = 1.0  # a controller that keeps waiting for the write lock tries again this often
HELD_RECONNECT_S = 2.0  # while events are held back, a new one tries to reconnect at most this often
_HOLDABLE = ("add_event", "record_metrics")  # held in memory while Postgres is unreachable
_MIGRATION_LOCK = 0x5F7C7100  # pg_advisory_xact_lock key: one migrating process at a time
CONTROLLER_START_GRACE_S = 30.0  # a job may wait this long for its controller to record its pid


#: controller.place values whose controller runs off the submitting machine, in a scheduler's job:
#: its process is never judged by a pid here; it holds the job's lease in the state (also on
#: SQLite), and while it waits in the scheduler's queue the lease is ``queued_holder``'s
PLACED = frozenset({"slurm", "kubernetes"})
#: seconds the lease of a placed controller still queued at its scheduler lasts: past it (the
#: scheduler lost or dropped the job unseen) the job counts as without a controller
QUEUED_CONTROLLER_LEASE_S = 24 * 3600.0


def placed(spec: dict | None) -> str | None:
    """The spec's ``controller.place`` (a stored spec's document) when the controller runs in a
    scheduler's job elsewhere (:data:`PLACED`: ``"slurm"``, ``"kubernetes"``), else None."""
    place = ((spec or {}).get("controller") or {}).get("place")
    return place if place in PLACED else None


def queued_holder(scheduler: str, scheduler_job_id: str) -> str:
    """The lease holder that stands for a placed controller still queued at its scheduler
    (``slurm:1234``); the controller takes it over when it starts (:meth:`LeaseKeeper.acquire`)."""
    return f"{scheduler}:{scheduler_job_id}"


def controller_died_reason(job_id: str, pid: int | None, nodes_removed: bool = False, local: bool = False) -> str:
    """The failure line of a job whose controller is gone (code ``controller_died``): what
    happened, then what became of its nodes (``sftctl down`` rewrites it with ``nodes_removed``).
    ``local``: the job's nodes are local processes, which stop by themselves once their
    controller is gone (:func:`sftctl.procs.guard`); cloud and Slurm nodes may still run."""
    what = f"the controller (pid {pid}) exited without finishing the job" if pid else "the controller never started"
    if nodes_removed:
        return what + "; sftctl down removed its nodes"
    if local:
        return what + f"; its local nodes stop by themselves within seconds (sftctl down {job_id} removes what is left)"
    return what + f"; its nodes may still run: sftctl down {job_id}"


class IllegalTransition(Exception):
    """A programming error: the controller asked for a transition the lifecycle forbids."""


class _Dialect:
    """What differs between SQLite and Postgres, in one place: the types the migrations' tokens
    stand for, how a write transaction starts, row locks, the database's clock, which errors
    mean a duplicate key or a lost connection. Every statement is written once, with ``?``
    placeholders (:class:`_PgConn` turns them into psycopg's ``%s``), ``ON CONFLICT`` upserts
    and ``RETURNING``, which both speak."""

    def __init__(self, name: str, tokens: dict[str, str], begin: str, for_update: str, now: str,
                 integrity: tuple = (), disconnect: tuple = (), error: tuple = ()):
        self.name, self.tokens, self.begin, self.for_update, self.now = name, tokens, begin, for_update, now
        self.integrity, self.disconnect, self.error = integrity, disconnect, error

    @property
    def shared(self) -> bool:
        """Several machines may use this database (leases mean something across them)."""
        return self.name == "postgres"

    def statements(self, migration: str) -> list[str]:
        """The migration's statements with this dialect's types."""
        for token, value in {**self.tokens, "os_user": _sql_literal(os_user())}.items():
            migration = migration.replace("{" + token + "}", value)
        return [x.strip() for x in migration.split(";") if x.strip()]


SQLITE = _Dialect(
    "sqlite", {"real": "REAL", "int": "INTEGER", "autoid": "INTEGER PRIMARY KEY AUTOINCREMENT"},
    begin="BEGIN IMMEDIATE", for_update="", now="((julianday('now') - 2440587.5) * 86400.0)",
    integrity=(sqlite3.IntegrityError,),
)


def _postgres() -> _Dialect:
    import psycopg  # the `server` extra: only a Postgres store imports it

    return _Dialect(
        "postgres", {"real": "DOUBLE PRECISION", "int": "BIGINT",
                     "autoid": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"},
        begin="BEGIN", for_update=" FOR UPDATE", now="(EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION)",
        integrity=(psycopg.errors.IntegrityError,),
        disconnect=(psycopg.OperationalError, psycopg.InterfaceError), error=(psycopg.Error,),
    )


class _PgConn:
    """A psycopg connection that speaks like :class:`sqlite3.Connection` does here: ``execute``
    takes ``?`` placeholders and returns a cursor whose rows are dicts."""

    _translated: dict[str, str] = {}

    def __init__(self, url: str):
        import psycopg
        from psycopg.rows import dict_row

        self.raw = psycopg.connect(url, autocommit=True, row_factory=dict_row, connect_timeout=10)

    def execute(self, sql: str, params: Any = ()):
        q = self._translated.get(sql)
        if q is None:
            q = self._translated[sql] = sql.replace("%", "%%").replace("?", "%s")
        return self.raw.execute(q, tuple(params))

    def close(self) -> None:
        self.raw.close()


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def os_user() -> str:
    """This machine's user: the owner of the jobs it records (``jobs.owner``) unless told."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (some containers)
        return str(os.getuid())


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages: never print a secret)."""
    return re.sub(r"(password=)[^&\s]*", r"\1***", re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url))


def is_url(target: str | None) -> bool:
    """Whether a ``state.url`` names a Postgres database (else it is a SQLite path)."""
    return bool(target) and target.split("://", 1)[0] in ("postgresql", "postgres")


def _retrying(fn):
    """A Store method that survives a lost database connection: see :attr:`Store.retry_window_s`.
    On SQLite (no such errors) it only calls ``fn``."""

    @functools.wraps(fn)
    def call(self: "Store", *args, **kwargs):
        try:
            if self._held:
                self._flush_held()
            return fn(self, *args, **kwargs)
        except self._d.disconnect as e:
            return self._retry(fn, e, args, kwargs)

    return call


class Store:
    """The state database. One instance per process; cheap to open (a few ms).

    Args:
        path: a SQLite file, or a ``postgresql://`` URL; default: the setting
            ``SFTCTL_STATE_URL`` (config ``state.url``) when set, else ``$SFTCTL_HOME/state.db``.

    Raises:
        SftctlError: the database cannot be opened (a damaged SQLite file, Postgres unreachable
            or refusing, psycopg not installed: ``pip install 'sftctl[server]'``) or its schema is
            newer than this sftctl's.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        target = str(path) if path is not None else (settings.get("SFTCTL_STATE_URL") or None)
        self.url: str | None = target if is_url(target) else None
        self.path: Path | None = None if self.url else (Path(target) if target else sftctl_home() / "state.db")
        self.where = redact(self.url) if self.url else str(self.path)
        self.busy_timeout_ms = settings.get("SFTCTL_STATE_BUSY_TIMEOUT_MS")
        #: None: a write that cannot get the lock within the busy timeout raises. A controller
        #: sets a callable instead: it is called with the error once per wait, and the write is
        #: retried until it gets the lock (a job must not fail because a reader held state.db).
        self.on_locked = None
        #: 0: a lost connection to Postgres is an SftctlError at once (the CLI). A controller sets
        #: ``SFTCTL_STATE_RETRY_S``: every call reconnects and retries (tenacity) for up to this
        #: many seconds; events and metrics are held in memory meanwhile (the job goes on) and
        #: written, in order and with their own times, before the next write once it is back.
        self.retry_window_s = 0.0
        #: called with the error once per outage while retrying (the controller reports it)
        self.on_unreachable = None
        self._held: list[tuple[str, tuple, dict]] = []
        self._reconnected_at = 0.0
        self._retrying = 0  # > 0 inside _retry: a call may be repeating one whose commit went through
        self._d = SQLITE
        try:
            if self.url:
                self._d = _postgres()
                self._conn = self._open_pg()
            else:
                self._conn = self._open()
        except ImportError:
            from sftctl.errors import SftctlError

            raise SftctlError(f"state.url is {self.where}, but psycopg is not installed",
                              hint="pip install 'sftctl[server]' (psycopg 3), or unset state.url for SQLite") from None
        except (sqlite3.DatabaseError, OSError, *self._d.error) as e:  # Postgres: refused, no rights, ...
            from sftctl.errors import SftctlError

            if self.url:
                raise SftctlError(f"{self.where}: cannot connect to the state database: {_one_line(e)}",
                                  hint="check state.url (SFTCTL_STATE_URL) and that Postgres is up") from None
            raise SftctlError(
                f"{self.path}: cannot open the state database: {e}",
                hint=("retry: a busy machine can fail an open for a moment; if it persists the file is "
                      "damaged: sftctl down --orphans stops the jobs it still finds, then move it aside "
                      f"(mv {self.path} {self.path}.bad) and sftctl starts a new one"),
            ) from None

    @property
    def dialect(self) -> _Dialect:
        return self._d

    # ---------------------------------------------------------------- connection and schema

    def _open_pg(self) -> _PgConn:
        """Connect, and migrate under a transaction-scoped advisory lock (Postgres's DDL is
        transactional: a migration applies whole or not at all)."""
        import psycopg

        from sftctl.errors import SftctlError

        conn = _PgConn(self.url)
        try:
            version = conn.execute("SELECT version FROM schema_version").fetchone()["version"]
        except psycopg.errors.UndefinedTable:
            version = 0
        if version != SCHEMA_VERSION:
            conn.execute("BEGIN")
            try:
                conn.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
                exists = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL AS e").fetchone()["e"]
                version = conn.execute("SELECT version FROM schema_version").fetchone()["version"] if exists else 0
                if version <= SCHEMA_VERSION:
                    self._apply(conn, version)
                conn.execute("COMMIT")
            except BaseException:
                _quietly(conn.execute, "ROLLBACK")
                conn.close()
                raise
        if version > SCHEMA_VERSION:
            conn.close()
            raise SftctlError(f"{self.where}: state schema version {version} is newer than this sftctl "
                              f"understands ({SCHEMA_VERSION})", hint="upgrade sftctl (pip install -U sftctl)")
        return conn

    def _apply(self, conn, version: int) -> None:
        """Run the migrations after ``version`` inside the caller's transaction."""
        for i in range(version, SCHEMA_VERSION):
            for statement in self._d.statements(MIGRATIONS[i]):
                conn.execute(statement)
            if i + 1 >= 4:  # the table exists from migration 4 on
                conn.execute("UPDATE schema_version SET version = ?", (i + 1,))
            if self._d is SQLITE:
                conn.execute(f"PRAGMA user_version = {i + 1}")

    def _open(self) -> sqlite3.Connection:
        from sftctl.errors import SftctlError

        damaged = self._damage()
        if damaged is not None:
            raise SftctlError(f"{self.path}: {damaged}", hint=(
                "sftctl down --orphans stops the jobs it still finds (by their job directories and "
                f"provider tags); then move the files aside (mv {self.path}* to a backup) and sftctl "
                "starts a new one"))
        if not self.path.exists():
            self._create()
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_ms / 1000, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:  # whatever the journal mode: never touch a newer schema
            conn.close()
            raise SftctlError(
                f"{self.path}: state schema version {version} is newer than this sftctl "
                f"understands ({SCHEMA_VERSION})",
                hint="upgrade sftctl (pip install -U sftctl)",
            )
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if version < SCHEMA_VERSION or mode != "wal":
            from filelock import FileLock

            with FileLock(str(self.path) + ".lock"):
                conn.execute("PRAGMA journal_mode = WAL")
                self._migrate(conn)
        return conn

    def _damage(self) -> str | None:
        """What is wrong with the file before SQLite opens it, or None.

        sftctl creates ``state.db`` whole (see :meth:`_create`), so: missing while its ``-wal``
        or ``-shm`` is there means it was deleted (maybe under a running controller, whose log a
        fresh file would take in: never create one then); 0 bytes means it was truncated,
        whatever the WAL holds. An ``OSError`` of these checks (a path that cannot be read) is
        said too.
        """
        try:
            if not self.path.exists():
                left = [Path(str(self.path) + x) for x in ("-wal", "-shm") if Path(str(self.path) + x).exists()]
                if left and not self.path.exists():  # again: another process may have just
                    # linked a new one into place and opened its WAL between the two checks
                    return (f"the state database was deleted while {' and '.join(p.name for p in left)} remained "
                            "(a controller may still run): the jobs it recorded are lost, and sftctl will not "
                            "create a new database beside them")
                return None
            size = self.path.stat().st_size  # never open() it: closing any descriptor of the file
            # drops this process's POSIX locks on it, SQLite's included (a live connection's WAL lock)
        except OSError as e:
            return f"cannot read the state database: {e.strerror or e}"
        if size == 0:
            return "the state database is empty (0 bytes): it was truncated, and the jobs it recorded are lost"
        # (a file overwritten or cut after its header fails at its first query: "file is not a
        # database" or "database disk image is malformed", which the CLI says in one line)
        return None

    def _create(self) -> None:
        """Create the database whole: schema built in a temporary file, then linked into place,
        so ``state.db`` is never an empty file (an empty one means it was truncated)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f"{self.path.name}.new-{os.getpid()}-{secrets.token_hex(3)}")
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        try:
            conn = sqlite3.connect(tmp, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                self._migrate(conn)
            finally:
                conn.close()
            try:
                os.link(tmp, self.path)
            except FileExistsError:  # another process created it first: theirs is as good
                pass
        finally:
            for suffix in ("", "-wal", "-shm"):
                Path(str(tmp) + suffix).unlink(missing_ok=True)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._apply(conn, conn.execute("PRAGMA user_version").fetchone()[0])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @property
    def schema_version(self) -> int:
        if self._d is SQLITE:
            return self._conn.execute("PRAGMA user_version").fetchone()[0]
        return self._conn.execute("SELECT version FROM schema_version").fetchone()["version"]

    @contextlib.contextmanager
    def write(self) -> Iterator[Any]:
        """One write transaction, taken up front (SQLite: ``BEGIN IMMEDIATE``, so it never
        deadlocks; Postgres: ``BEGIN``, rows locked with ``FOR UPDATE`` where a read decides).

        Raises:
            sqlite3.OperationalError: another process held the write lock for longer than the
                busy timeout, and ``on_locked`` is None (else this waits and retries).
        """
        waited = False
        while True:
            try:
                self._conn.execute(self._d.begin)
                break
            except sqlite3.OperationalError as e:
                if self.on_locked is None or not _is_locked(e):
                    raise
                if not waited:
                    self.on_locked(e)
                    waited = True
                time.sleep(LOCKED_RETRY_S)
        try:
            yield self._conn
        except BaseException:
            _quietly(self._conn.execute, "ROLLBACK", swallow=self._d.disconnect)
            raise
        self._conn.execute("COMMIT")

    def close(self) -> None:
        """Write what is held back (see :attr:`retry_window_s`), then close the connection."""
        try:
            if self._held:
                self._flush_held()
        finally:
            self._conn.close()

    # ---------------------------------------------------------------- a lost connection (Postgres)

    def _retry(self, fn, error: BaseException, args: tuple, kwargs: dict):
        """``fn`` failed with a lost connection: hold an event or metrics back, or reconnect
        and call ``fn`` again until it works or :attr:`retry_window_s` has passed."""
        from sftctl.errors import SftctlError

        if not self.retry_window_s:
            raise SftctlError(f"{self.where}: the state database is unreachable: {_one_line(error)}",
                              hint="check that Postgres is up, then retry") from None
        if fn.__name__ in _HOLDABLE:
            self._held.append(("_" + fn.__name__, args, {**kwargs, "ts": time.time()}))
            if time.monotonic() - self._reconnected_at > HELD_RECONNECT_S:  # back yet? (cheap, throttled)
                try:
                    self._reconnect()
                    self._flush_held()
                except self._d.disconnect:
                    pass
            return None
        import tenacity

        if self.on_unreachable is not None:
            self.on_unreachable(error)
        self._retrying += 1
        try:
            for attempt in tenacity.Retrying(
                stop=tenacity.stop_after_delay(self.retry_window_s),
                wait=tenacity.wait_exponential(multiplier=0.2, max=2.0),
                retry=tenacity.retry_if_exception_type(self._d.disconnect), reraise=True,
            ):
                with attempt:
                    self._reconnect()
                    self._flush_held()
                    result = fn(self, *args, **kwargs)
        except self._d.disconnect as e:
            raise SftctlError(f"{self.where}: the state database was unreachable for {self.retry_window_s:g} s: "
                              f"{_one_line(e)}", hint="check that Postgres is up (state.retry_s sets the window)") from None
        finally:
            self._retrying -= 1
        return result

    def _reconnect(self) -> None:
        self._reconnected_at = time.monotonic()
        _quietly(self._conn.close, swallow=(Exception,))
        self._conn = _PgConn(self.url)

    def _flush_held(self) -> None:
        """Write the events and metrics held back while the database was unreachable, oldest
        first, each event with the time it happened. Raises a lost connection's error."""
        while self._held:
            name, args, kwargs = self._held[0]
            getattr(self, name)(*args, **kwargs)
            self._held.pop(0)

    @property
    def held(self) -> int:
        """How many events and metrics batches wait for the database to be back."""
        return len(self._held)

    # ---------------------------------------------------------------- jobs

    @_retrying
    def create_job(self, name: str, spec: dict, spec_path: str | None = None, owner: str | None = None) -> str:
        """Record a new PENDING job and return its id (``<name>-<6 hex>``). ``owner``: the user
        it belongs to (default: this machine's user, :func:`os_user`)."""
        now = time.time()
        while True:
            job_id = f"{name}-{secrets.token_hex(3)}"
            try:
                with self.write() as db:
                    db.execute(
                        "INSERT INTO jobs (id, name, status, spec_json, spec_path, owner, created_at,"
                        " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (job_id, name, JobStatus.PENDING.value, json.dumps(spec), spec_path, owner or os_user(),
                         now, now),
                    )
                    self._event(db, job_id, "status", "job submitted (PENDING)")
                return job_id
            except self._d.integrity:
                continue

    @_retrying
    def get_job(self, job_id: str) -> JobRecord | None:
        """The job ``job_id`` (exact id), or None."""
        row = self._conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    @_retrying
    def list_jobs(self, statuses: set[JobStatus] | None = None, owner: str | None = None) -> list[JobRecord]:
        """All jobs, newest first, optionally only those with one of ``statuses`` and only those
        of ``owner`` (a user's name)."""
        where, params = [], []
        if statuses is not None:  # in SQL: a waiting job asks for the live ones every few seconds
            wanted = [JobStatus(s).value for s in statuses]
            where.append(f"status IN ({','.join('?' * len(wanted))})")
            params += wanted
        if owner is not None:
            where.append("owner = ?")
            params.append(owner)
        sql = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY created_at DESC"
        return [_job(r) for r in self._conn.execute(sql, params).fetchall()]

    @_retrying
    def update_job(self, job_id: str, **fields: Any) -> None:
        """Set columns of a job (values that are dicts are stored as JSON)."""
        fields = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in fields.items()}
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.write() as db:
            db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))

    @_retrying
    def transition(
        self, job_id: str, new: JobStatus, reason: str | None = None, *, strict: bool = True,
        code: str | None = None,
    ) -> bool:
        """Move a job to ``new`` if the lifecycle allows it from its current status.

        ``reason`` is the human line; ``code`` its :class:`sftctl.types.FailureCode` value. For an
        ending (FAILED, CANCELLED, FAILED_CONTROLLER) they become the job's ``failure_reason`` and
        ``failure_code``; the status event carries the code in its data.

        Returns True if the job moved. A transition out of a terminal status returns False (the
        job already ended, e.g. ``sftctl down`` won the race). Any other forbidden transition
        raises :class:`IllegalTransition` when ``strict``, else returns False.
        """
        now = time.time()
        with self.write() as db:
            row = db.execute("SELECT status FROM jobs WHERE id = ?" + self._d.for_update, (job_id,)).fetchone()
            if row is None:
                raise KeyError(job_id)
            old = JobStatus(row["status"])
            if old == new and self._retrying:  # a retry of this very call, whose commit went through
                return True
            if new not in TRANSITIONS[old]:
                if old.terminal or not strict:
                    return False
                raise IllegalTransition(f"{job_id}: {old.value} -> {new.value}")
            ended = now if new.terminal else None
            db.execute(
                "UPDATE jobs SET status = ?, updated_at = ?, ended_at = COALESCE(?, ended_at),"
                " failure_reason = COALESCE(?, failure_reason), failure_code = COALESCE(?, failure_code) WHERE id = ?",
                (new.value, now, ended, reason if new in _ENDINGS else None, code if new in _ENDINGS else None, job_id),
            )
            message = f"{old.value} -> {new.value}" + (f": {reason}" if reason else "")
            self._event(db, job_id, "status", message, {"code": code} if code else None)
        return True

    def reap_dead_controllers(self) -> list[str]:
        """Mark live jobs whose controller process is gone as FAILED_CONTROLLER; return their ids.

        Liveness compares the recorded pid *and* its start time, so a reused pid is not mistaken
        for the controller; on a shared (Postgres) state it is the job's unexpired lease (the
        controller may run on another machine). A cloud or Slurm job's nodes may still run: ``sftctl down`` removes
        them; local nodes stop by themselves (:func:`sftctl.procs.guard`).
        """
        from sftctl import procs

        live = [s.value for s in JobStatus if not s.terminal]
        rows = self._conn.execute(
            f"SELECT id, controller_pid, controller_start_ticks, created_at, provider, spec_json FROM jobs"
            f" WHERE status IN ({','.join('?' * len(live))})",
            live,
        ).fetchall()
        # a controller placed in a scheduler's job runs on another machine: judged by the lease
        elsewhere = {r["id"] for r in rows if '"place"' in (r["spec_json"] or "")
                     and placed(json.loads(r["spec_json"]))}
        leased = None
        # controllers run on other machines (a shared state, or a controller placed in a Slurm
        # job): a live one holds an unexpired lease, or its scheduler's queue holds it for it
        if self._d.shared or elsewhere:
            leased = {r["job_id"] for r in self._conn.execute(
                f"SELECT job_id FROM leases WHERE expires_at > {self._d.now}").fetchall()}
        reaped = []
        for r in rows:
            pid = r["controller_pid"]
            if pid is None and time.time() - r["created_at"] < CONTROLLER_START_GRACE_S:
                continue
            by_lease = self._d.shared or r["id"] in elsewhere
            if by_lease and r["id"] in leased:
                continue
            if not by_lease and pid is not None and procs.alive(pid, r["controller_start_ticks"]):
                continue
            reason = controller_died_reason(r["id"], pid, local=capabilities(r["provider"]).local_admission)
            if self.transition(r["id"], JobStatus.FAILED_CONTROLLER, reason, strict=False, code="controller_died"):
                reaped.append(r["id"])
        return reaped

    # ---------------------------------------------------------------- nodes

    @_retrying
    def add_node(self, job_id: str, rank: int, provider: str, status: NodeState = NodeState.PROVISIONING) -> str:
        """Record a node before it is created, so a crash mid-provisioning still knows of it."""
        now = time.time()
        node_id = f"{job_id}-n{rank}-{secrets.token_hex(2)}"
        with self.write() as db:
            db.execute(
                "INSERT INTO nodes (id, job_id, rank, provider, status, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (node_id, job_id, rank, provider, NodeState(status).value, now, now),
            )
        return node_id

    @_retrying
    def update_node(self, node_id: str, *, status: NodeState | None = None, handle: dict | None = None,
                    rank: int | None = None) -> None:
        """Set a node's rank, status or handle. A status that ends its billing (TERMINATED,
        REPLACED) records ``ended_at`` once."""
        now = time.time()
        with self.write() as db:
            if rank is not None:  # an elastic resume renumbers the nodes that are left
                db.execute("UPDATE nodes SET rank = ?, updated_at = ? WHERE id = ?", (rank, now, node_id))
            if status is not None:
                status = NodeState(status)
                db.execute(
                    "UPDATE nodes SET status = ?, updated_at = ?, ended_at = COALESCE(ended_at, ?) WHERE id = ?",
                    (status.value, now, now if status in _UNBILLED else None, node_id),
                )
            if handle is not None:
                db.execute(
                    "UPDATE nodes SET handle_json = ?, updated_at = ? WHERE id = ?",
                    (json.dumps(handle), now, node_id),
                )

    @_retrying
    def nodes(self, job_id: str) -> list[NodeRecord]:
        """The job's nodes (replaced ones too), by rank then creation time."""
        rows = self._conn.execute(
            "SELECT * FROM nodes WHERE job_id = ? ORDER BY rank, created_at", (job_id,)
        ).fetchall()
        return [NodeRecord.from_dict({**dict(r), "handle": json.loads(r["handle_json"])}) for r in rows]

    @_retrying
    def node_spans(self, job_id: str | None = None) -> dict[str, list[tuple[float, float | None]]]:
        """Each job's nodes as (created_at, ended_at) in Unix seconds (ended_at None: it may still
        bill), for one job or all: what cost is computed from, in one query."""
        sql = "SELECT job_id, created_at, ended_at FROM nodes" + (" WHERE job_id = ?" if job_id else "")
        spans: dict[str, list[tuple[float, float | None]]] = {}
        for r in self._conn.execute(sql, (job_id,) if job_id else ()).fetchall():
            spans.setdefault(r["job_id"], []).append((r["created_at"], r["ended_at"]))
        return spans

    # ---------------------------------------------------------------- attempts

    @_retrying
    def start_attempt(self, job_id: str) -> int:
        """Open the next attempt (1, 2, ...) of a job and return its number."""
        with self.write() as db:
            db.execute("SELECT id FROM jobs WHERE id = ?" + self._d.for_update, (job_id,))  # one at a time
            n = db.execute(
                "SELECT COALESCE(MAX(number), 0) + 1 AS n FROM attempts WHERE job_id = ?", (job_id,)
            ).fetchone()["n"]
            db.execute(
                "INSERT INTO attempts (job_id, number, status, started_at) VALUES (?, ?, ?, ?)",
                (job_id, n, AttemptStatus.RUNNING.value, time.time()),
            )
        return n

    @_retrying
    def end_attempt(self, job_id: str, number: int, status: AttemptStatus, exit_code: int | None,
                    reason: str | None, code: str | None = None) -> None:
        """End attempt ``number`` with ``status``: ``reason`` the line why, ``code`` its FailureCode value."""
        with self.write() as db:
            db.execute(
                "UPDATE attempts SET status = ?, exit_code = ?, reason = ?, reason_code = ?, ended_at = ?"
                " WHERE job_id = ? AND number = ?",
                (AttemptStatus(status).value, exit_code, reason, code, time.time(), job_id, number),
            )

    @_retrying
    def end_open_attempts(self, job_id: str, status: AttemptStatus, reason: str, code: str | None = None) -> int:
        """End the job's attempts still marked RUNNING with ``status`` (CANCELLED, or ABANDONED
        when their controller is gone); return how many."""
        with self.write() as db:
            cur = db.execute(
                "UPDATE attempts SET status = ?, reason = ?, reason_code = ?, ended_at = ?"
                " WHERE job_id = ? AND status = ?",
                (AttemptStatus(status).value, reason, code, time.time(), job_id, AttemptStatus.RUNNING.value),
            )
        return cur.rowcount

    @_retrying
    def attempts(self, job_id: str) -> list[Attempt]:
        """The job's attempts, first first."""
        rows = self._conn.execute(
            "SELECT * FROM attempts WHERE job_id = ? ORDER BY number", (job_id,)
        ).fetchall()
        return [Attempt.from_dict(dict(r)) for r in rows]

    # ---------------------------------------------------------------- events and metrics

    @staticmethod
    def _event(db: Any, job_id: str, kind: str, message: str, data: dict | None = None,
               ts: float | None = None) -> None:
        db.execute(
            "INSERT INTO events (job_id, ts, kind, message, data_json) VALUES (?, ?, ?, ?, ?)",
            (job_id, time.time() if ts is None else ts, kind, message, json.dumps(data) if data else None),
        )

    @_retrying
    def add_event(self, job_id: str, kind: str, message: str, data: dict | None = None) -> None:
        """Append an event (``kind``: status, plan, provision, launch, node, recovery, ...)."""
        self._add_event(job_id, kind, message, data)

    def block_zone(self, provider: str, instance_type: str, zone: str, until: float, reason: str,
                   job_id: str | None = None) -> None:
        """Avoid ``zone`` for ``instance_type`` on ``provider`` until ``until`` (epoch seconds):
        it took a spot node back (``reason``). A later block of the same zone extends it."""
        with self.write() as db:
            db.execute(
                "INSERT INTO blocked_zones (provider, instance_type, zone, until, reason, job_id) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (provider, instance_type, zone) DO UPDATE SET until = CASE WHEN excluded.until > blocked_zones.until THEN excluded.until "
                "ELSE blocked_zones.until END, "
                "reason = excluded.reason, job_id = excluded.job_id",
                (provider, instance_type, zone, until, reason, job_id))

    @_retrying
    def blocked_zones(self, provider: str, now: float | None = None) -> dict[tuple[str, str], float]:
        """``{(instance type, zone): until}`` of ``provider``'s zones still in their cool-down."""
        now = time.time() if now is None else now
        rows = self._conn.execute("SELECT instance_type, zone, until FROM blocked_zones WHERE provider = ? AND until > ?",
                                  (provider, now)).fetchall()
        return {(r["instance_type"], r["zone"]): r["until"] for r in rows}

    def _add_event(self, job_id: str, kind: str, message: str, data: dict | None = None,
                   ts: float | None = None) -> None:
        with self.write() as db:
            self._event(db, job_id, kind, message, data, ts)

    @_retrying
    def events(self, job_id: str, after_id: int = 0) -> list[Event]:
        """The job's events with an id above ``after_id``, oldest first."""
        rows = self._conn.execute(
            "SELECT * FROM events WHERE job_id = ? AND id > ? ORDER BY id", (job_id, after_id)
        ).fetchall()
        return [Event.from_dict({**dict(r), "data": json.loads(r["data_json"]) if r["data_json"] else None})
                for r in rows]

    @_retrying
    def record_metrics(self, job_id: str, samples: list[dict]) -> None:
        """Keep the latest sample per rank, and the first one ever seen. ``samples`` (in the order
        they were written) are dicts with rank, step, loss, step_time_s, tokens_per_s, ts, as
        :mod:`sftctl.train` writes them."""
        self._record_metrics(job_id, samples)

    def _record_metrics(self, job_id: str, samples: list[dict], ts: float | None = None) -> None:
        if not samples:
            return
        first: dict[int, dict] = {}
        last: dict[int, dict] = {}
        for s in samples:
            r = int(s["rank"])
            first.setdefault(r, s)
            last[r] = s
        with self.write() as db:
            for r, s in last.items():
                f = first[r]
                db.execute(
                    "INSERT INTO metrics (job_id, rank, step, loss, step_time_s, tokens_per_s,"
                    " first_step, first_loss, ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (job_id, rank) DO UPDATE SET step = excluded.step,"
                    " loss = excluded.loss, step_time_s = excluded.step_time_s,"
                    " tokens_per_s = excluded.tokens_per_s, ts = excluded.ts",
                    (
                        job_id, r, int(s["step"]), s.get("loss"), s.get("step_time_s"),
                        s.get("tokens_per_s"), int(f["step"]), f.get("loss"), s.get("ts", ts or time.time()),
                    ),
                )

    @_retrying
    def metrics(self, job_id: str | None = None) -> list[MetricsRecord]:
        """Latest metrics per rank, for one job or all jobs."""
        if job_id is None:
            rows = self._conn.execute("SELECT * FROM metrics ORDER BY job_id, rank").fetchall()
        else:
            rows = self._conn.execute(
                "SELECT * FROM metrics WHERE job_id = ? ORDER BY rank", (job_id,)
            ).fetchall()
        return [MetricsRecord.from_dict(dict(r)) for r in rows]

    # ---------------------------------------------------------------- users

    @_retrying
    def create_user(self, name: str, admin: bool = False) -> str:
        """Create user ``name`` and return their token: ``sft_`` + 43 URL-safe characters (32
        random bytes). Only the token's SHA-256 is stored; the token is shown this once.

        Raises:
            SftctlError: the name is empty or not ``[A-Za-z0-9._@-]``, or the user exists (exit 2).
        """
        from sftctl.errors import ExitCode, SftctlError

        if not _USER_NAME.fullmatch(name or ""):
            raise SftctlError(f"user name {name!r} is not valid", hint="use letters, digits and . _ @ - (at most 64)",
                              exit_code=ExitCode.USAGE)
        token = "sft_" + secrets.token_urlsafe(32)
        try:
            with self.write() as db:
                db.execute("INSERT INTO users (name, admin, token_hash, created_at) VALUES (?, ?, ?, ?)",
                           (name, int(bool(admin)), _token_hash(token), time.time()))
        except self._d.integrity:
            raise SftctlError(f"user {name} already exists", hint="choose another name",
                              exit_code=ExitCode.USAGE) from None
        return token

    @_retrying
    def user_for_token(self, token: str) -> User | None:
        """The user whose token this is, or None (an unknown, malformed or empty token).
        The lookup is by the token's hash; the hashes are compared in constant time."""
        import hmac

        if not isinstance(token, str) or not token:
            return None
        digest = _token_hash(token)
        row = self._conn.execute("SELECT * FROM users WHERE token_hash = ?", (digest,)).fetchone()
        if row is None or not hmac.compare_digest(row["token_hash"], digest):
            return None
        return _user(row)

    @_retrying
    def list_users(self) -> list[User]:
        """Every user, by name."""
        return [_user(r) for r in self._conn.execute("SELECT * FROM users ORDER BY name").fetchall()]

    # ---------------------------------------------------------------- leases

    @_retrying
    def acquire_lease(self, job_id: str, holder: str, ttl_s: float, replacing: str | None = None) -> bool:
        """Become the job's one live controller for ``ttl_s`` seconds, by the database's clock
        (the same for every machine). True when ``holder`` now holds the lease: it was free,
        expired, already ``holder``'s (then it is extended), or ``replacing``'s (a holder known to
        be dead: :class:`LeaseKeeper` names one of its own host whose process is gone). Atomic:
        one upsert whose update applies only to such a row (SQLite under ``BEGIN IMMEDIATE``,
        Postgres under the row's lock that ``ON CONFLICT DO UPDATE`` takes)."""
        now = self._d.now
        with self.write() as db:
            row = db.execute(
                f"INSERT INTO leases (job_id, holder, acquired_at, expires_at) VALUES (?, ?, {now}, {now} + ?)"
                " ON CONFLICT (job_id) DO UPDATE SET holder = excluded.holder,"
                " acquired_at = CASE WHEN leases.holder = excluded.holder THEN leases.acquired_at"
                " ELSE excluded.acquired_at END, expires_at = excluded.expires_at"
                f" WHERE leases.holder = excluded.holder OR leases.expires_at < {now} OR leases.holder = ?"
                " RETURNING holder",
                (job_id, holder, float(ttl_s), replacing),
            ).fetchone()
        return row is not None

    @_retrying
    def renew_lease(self, job_id: str, holder: str, ttl_s: float) -> bool:
        """Extend ``holder``'s lease to ``ttl_s`` seconds from now; False when it is not
        ``holder``'s any more (another controller took it after it expired)."""
        with self.write() as db:
            cur = db.execute(f"UPDATE leases SET expires_at = {self._d.now} + ? WHERE job_id = ? AND holder = ?",
                             (float(ttl_s), job_id, holder))
        return cur.rowcount == 1

    @_retrying
    def release_lease(self, job_id: str, holder: str) -> bool:
        """Give the lease up (only ``holder``'s); False when it was not held by ``holder``."""
        with self.write() as db:
            cur = db.execute("DELETE FROM leases WHERE job_id = ? AND holder = ?", (job_id, holder))
        return cur.rowcount == 1

    @_retrying
    def lease(self, job_id: str) -> tuple[str, float] | None:
        """The job's live lease as (holder, seconds left), or None when none is held."""
        row = self._conn.execute(f"SELECT holder, expires_at - {self._d.now} AS left_s FROM leases WHERE job_id = ?",
                                 (job_id,)).fetchone()
        return (row["holder"], row["left_s"]) if row and row["left_s"] > 0 else None


class LeaseKeeper:
    """Holds a job's lease (:meth:`Store.acquire_lease`) for a controller and renews it from a
    daemon thread every ``ttl_s / 6`` seconds, on a connection of its own.

    ``holder`` is ``host:pid:start_ticks``: the same after ``exec`` (``python -m sftctl.queue``
    becomes the controller, same pid), so the controller takes its waiting stage's lease over;
    and a lease of a dead process of this host (a controller killed -9) is taken over at once,
    without waiting for it to expire.
    A renewal that finds the lease gone (this process was frozen or cut off for longer than
    ``ttl_s``, and another controller took the job) calls ``on_lost``: by default it says so in
    the ``sftctl.controller`` log and ends this process at once with exit code 3, without touching the job, whose
    nodes are the new holder's now.
    """

    def __init__(self, store: Store, job_id: str, ttl_s: float | None = None, on_lost=None):
        import socket

        from sftctl import procs

        self.store, self.job_id = store, job_id
        self.ttl_s = float(ttl_s if ttl_s is not None else settings.get("SFTCTL_STATE_LEASE_S"))
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{procs.start_ticks(os.getpid())}"
        self.on_lost = on_lost or self._exit
        self._stop = None
        self._thread = None

    def acquire(self) -> bool:
        """Take the lease and start renewing it; False (nothing started) when another holds it."""
        import threading

        if not self.store.acquire_lease(self.job_id, self.holder, self.ttl_s):
            held = self.store.lease(self.job_id)
            dead = held[0] if held and (self.dead_here(held[0]) or held[0] == self.queued_as()) else None
            if dead is None or not self.store.acquire_lease(self.job_id, self.holder, self.ttl_s, replacing=dead):
                return False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.job_id}", daemon=True)
        self._thread.start()
        return True

    @staticmethod
    def queued_as() -> str | None:
        """The holder that stood for this process while its scheduler queued it (a controller
        placed in Slurm job N, ``SFTCTL_CONTROLLER_SLURM_JOB_ID``: ``slurm:N``,
        :func:`queued_holder`; one placed in Kubernetes Job N, ``SFTCTL_CONTROLLER_K8S_JOB``:
        ``kubernetes:N``), or None outside such a job."""
        slurm_job = settings.get("SFTCTL_CONTROLLER_SLURM_JOB_ID")
        if slurm_job:
            return queued_holder("slurm", slurm_job)
        k8s_job = settings.get("SFTCTL_CONTROLLER_K8S_JOB")
        return queued_holder("kubernetes", k8s_job) if k8s_job else None

    @staticmethod
    def dead_here(holder: str) -> bool:
        """``holder`` names a process of this host that is gone (killed -9: its lease has not
        expired yet, but nobody renews it). A holder of another host is never judged from here."""
        import socket

        from sftctl import procs

        host, pid, ticks = (holder.rsplit(":", 2) + ["", ""])[:3]
        try:
            pid, ticks = int(pid), int(ticks)
        except ValueError:
            return False
        return host == socket.gethostname() and not procs.alive(pid, ticks)

    def _renew(self) -> None:
        store = Store(self.store.url or self.store.path)
        store.retry_window_s = self.store.retry_window_s or settings.get("SFTCTL_STATE_RETRY_S")
        try:
            while not self._stop.wait(self.ttl_s / 6):
                try:
                    kept = store.renew_lease(self.job_id, self.holder, self.ttl_s)
                except Exception:  # unreachable past the retry window: try again next beat
                    continue
                if not kept:
                    self.on_lost(self)
                    return
        finally:
            _quietly(store.close)

    def release(self, keep: bool = False) -> None:
        """Stop renewing; give the lease up unless ``keep`` (this process execs its successor)."""
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=30)
        if not keep:
            self.store.release_lease(self.job_id, self.holder)

    @staticmethod
    def _exit(keeper: "LeaseKeeper") -> None:
        import logging

        logging.getLogger("sftctl.controller").error(
            "error: job %s: this controller lost its lease (%s) to another controller; it stops without "
            "touching the job", keeper.job_id, keeper.holder)
        logging.shutdown()
        os._exit(3)


def _is_locked(e: sqlite3.OperationalError) -> bool:
    text = str(e).lower()
    return "locked" in text or "busy" in text


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _quietly(fn, *args, swallow: tuple = (Exception,)) -> None:
    try:
        fn(*args)
    except swallow:
        pass


def _token_hash(token: str) -> str:
    """SHA-256 of a token (hex). Tokens are 32 random bytes: a salt or a slow hash adds nothing."""
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()


def _user(row: Any) -> User:
    return User(name=row["name"], admin=bool(row["admin"]), created_at=row["created_at"])


def _job(row: Any) -> JobRecord:
    job = dict(row)
    job["spec"] = json.loads(job.pop("spec_json"))
    plan = job.pop("offering_json")
    job["plan"] = json.loads(plan) if plan else None  # JobRecord takes its offering from it
    return JobRecord.from_dict(job)
