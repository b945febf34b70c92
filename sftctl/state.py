"""Durable state: one SQLite file (WAL) holding jobs, nodes, attempts, events and metrics.

The file is ``$SFTCTL_HOME/state.db``, readable by its owner only (0600). Shell scripts start many
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
import json
import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

from sftctl import settings
from sftctl.paths import sftctl_home
from sftctl.types import (TERMINAL, Attempt, AttemptStatus, Event, JobRecord, JobStatus, MetricsRecord,  # noqa: F401
                          NodeRecord, NodeState, capabilities)  # (re-exported)


_ENDINGS = {JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.FAILED_CONTROLLER}
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.PENDING: frozenset({JobStatus.PROVISIONING} | _ENDINGS),
    JobStatus.PROVISIONING: frozenset({JobStatus.LAUNCHING} | _ENDINGS),
    JobStatus.LAUNCHING: frozenset({JobStatus.RUNNING} | _ENDINGS),
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.RECOVERING} | _ENDINGS),
    JobStatus.RECOVERING: frozenset({JobStatus.PROVISIONING, JobStatus.LAUNCHING} | _ENDINGS),
    **{s: frozenset() for s in TERMINAL},
}

SCHEMA_VERSION = 3
# Each migration takes the schema from version i to i + 1. Append; never edit a landed one.
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
        controller_pid INTEGER,
        controller_start_ticks INTEGER,
        restarts INTEGER NOT NULL DEFAULT 0,
        failure_reason TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        ended_at REAL
    );
    CREATE INDEX jobs_status ON jobs(status);
    CREATE TABLE nodes (
        id TEXT PRIMARY KEY,
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        rank INTEGER NOT NULL,
        provider TEXT NOT NULL,
        status TEXT NOT NULL,
        handle_json TEXT NOT NULL DEFAULT '{}',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX nodes_job ON nodes(job_id);
    CREATE TABLE attempts (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        number INTEGER NOT NULL,
        status TEXT NOT NULL,
        exit_code INTEGER,
        reason TEXT,
        started_at REAL NOT NULL,
        ended_at REAL,
        PRIMARY KEY (job_id, number)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        data_json TEXT
    );
    CREATE INDEX events_job ON events(job_id, id);
    CREATE TABLE metrics (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        rank INTEGER NOT NULL,
        step INTEGER NOT NULL,
        loss REAL,
        step_time_s REAL,
        tokens_per_s REAL,
        first_step INTEGER,
        first_loss REAL,
        ts REAL NOT NULL,
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
]
assert len(MIGRATIONS) == SCHEMA_VERSION

BUSY_TIMEOUT_MS = settings.SETTINGS["SFTCTL_STATE_BUSY_TIMEOUT_MS"].default  # the tests set a short one
LOCKED_RETRY_S = 1.0  # a controller that keeps waiting for the write lock tries again this often
CONTROLLER_START_GRACE_S = 30.0  # a job may wait this long for its controller to record its pid


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


class Store:
    """The state database. One instance per process; cheap to open (a few ms).

    Args:
        path: the SQLite file; default ``$SFTCTL_HOME/state.db``.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else sftctl_home() / "state.db"
        self.busy_timeout_ms = settings.get("SFTCTL_STATE_BUSY_TIMEOUT_MS")
        #: None: a write that cannot get the lock within the busy timeout raises. A controller
        #: sets a callable instead: it is called with the error once per wait, and the write is
        #: retried until it gets the lock (a job must not fail because a reader held state.db).
        self.on_locked = None
        try:
            self._conn = self._open()
        except (sqlite3.DatabaseError, OSError) as e:
            from sftctl.errors import SftctlError

            raise SftctlError(
                f"{self.path}: cannot open the state database: {e}",
                hint=("retry: a busy machine can fail an open for a moment; if it persists the file is "
                      "damaged: sftctl down --orphans stops the jobs it still finds, then move it aside "
                      f"(mv {self.path} {self.path}.bad) and sftctl starts a new one"),
            ) from None

    # ---------------------------------------------------------------- connection and schema

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
                if left:
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

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for i in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[i].split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {i + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @property
    def schema_version(self) -> int:
        return self._conn.execute("PRAGMA user_version").fetchone()[0]

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front (``BEGIN IMMEDIATE``) so it never deadlocks.

        Raises:
            sqlite3.OperationalError: another process held the write lock for longer than the
                busy timeout, and ``on_locked`` is None (else this waits and retries).
        """
        waited = False
        while True:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
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
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def close(self) -> None:
        self._conn.close()

    # ---------------------------------------------------------------- jobs

    def create_job(self, name: str, spec: dict, spec_path: str | None = None) -> str:
        """Record a new PENDING job and return its id (``<name>-<6 hex>``)."""
        now = time.time()
        while True:
            job_id = f"{name}-{secrets.token_hex(3)}"
            try:
                with self.write() as db:
                    db.execute(
                        "INSERT INTO jobs (id, name, status, spec_json, spec_path, created_at,"
                        " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (job_id, name, JobStatus.PENDING.value, json.dumps(spec), spec_path, now, now),
                    )
                    self._event(db, job_id, "status", "job submitted (PENDING)")
                return job_id
            except sqlite3.IntegrityError:
                continue

    def get_job(self, job_id: str) -> JobRecord | None:
        """The job ``job_id`` (exact id), or None."""
        row = self._conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def list_jobs(self, statuses: set[JobStatus] | None = None) -> list[JobRecord]:
        """All jobs, newest first, optionally only those with one of ``statuses``."""
        if statuses is None:
            rows = self._conn.execute("SELECT * FROM jobs ORDER BY created_at DESC").fetchall()
        else:  # in SQL: a waiting job asks for the live ones every few seconds
            wanted = [JobStatus(s).value for s in statuses]
            rows = self._conn.execute(f"SELECT * FROM jobs WHERE status IN ({','.join('?' * len(wanted))})"
                                      " ORDER BY created_at DESC", wanted).fetchall()
        return [_job(r) for r in rows]

    def update_job(self, job_id: str, **fields: Any) -> None:
        """Set columns of a job (values that are dicts are stored as JSON)."""
        fields = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in fields.items()}
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.write() as db:
            db.execute(f"UPDATE jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))

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
            row = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(job_id)
            old = JobStatus(row["status"])
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
        for the controller. A cloud or Slurm job's nodes may still run: ``sftctl down`` removes
        them; local nodes stop by themselves (:func:`sftctl.procs.guard`).
        """
        from sftctl import procs

        live = [s.value for s in JobStatus if not s.terminal]
        rows = self._conn.execute(
            f"SELECT id, controller_pid, controller_start_ticks, created_at, provider FROM jobs"
            f" WHERE status IN ({','.join('?' * len(live))})",
            live,
        ).fetchall()
        reaped = []
        for r in rows:
            pid = r["controller_pid"]
            if pid is None and time.time() - r["created_at"] < CONTROLLER_START_GRACE_S:
                continue
            if pid is not None and procs.alive(pid, r["controller_start_ticks"]):
                continue
            reason = controller_died_reason(r["id"], pid, local=capabilities(r["provider"]).local_admission)
            if self.transition(r["id"], JobStatus.FAILED_CONTROLLER, reason, strict=False, code="controller_died"):
                reaped.append(r["id"])
        return reaped

    # ---------------------------------------------------------------- nodes

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

    def update_node(self, node_id: str, *, status: NodeState | None = None, handle: dict | None = None,
                    rank: int | None = None) -> None:
        with self.write() as db:
            if rank is not None:  # an elastic resume renumbers the nodes that are left
                db.execute("UPDATE nodes SET rank = ?, updated_at = ? WHERE id = ?", (rank, time.time(), node_id))
            if status is not None:
                db.execute(
                    "UPDATE nodes SET status = ?, updated_at = ? WHERE id = ?",
                    (NodeState(status).value, time.time(), node_id),
                )
            if handle is not None:
                db.execute(
                    "UPDATE nodes SET handle_json = ?, updated_at = ? WHERE id = ?",
                    (json.dumps(handle), time.time(), node_id),
                )

    def nodes(self, job_id: str) -> list[NodeRecord]:
        """The job's nodes (replaced ones too), by rank then creation time."""
        rows = self._conn.execute(
            "SELECT * FROM nodes WHERE job_id = ? ORDER BY rank, created_at", (job_id,)
        ).fetchall()
        return [NodeRecord.from_dict({**dict(r), "handle": json.loads(r["handle_json"])}) for r in rows]

    # ---------------------------------------------------------------- attempts

    def start_attempt(self, job_id: str) -> int:
        """Open the next attempt (1, 2, ...) of a job and return its number."""
        with self.write() as db:
            n = db.execute(
                "SELECT COALESCE(MAX(number), 0) + 1 FROM attempts WHERE job_id = ?", (job_id,)
            ).fetchone()[0]
            db.execute(
                "INSERT INTO attempts (job_id, number, status, started_at) VALUES (?, ?, ?, ?)",
                (job_id, n, AttemptStatus.RUNNING.value, time.time()),
            )
        return n

    def end_attempt(self, job_id: str, number: int, status: AttemptStatus, exit_code: int | None,
                    reason: str | None, code: str | None = None) -> None:
        """End attempt ``number`` with ``status``: ``reason`` the line why, ``code`` its FailureCode value."""
        with self.write() as db:
            db.execute(
                "UPDATE attempts SET status = ?, exit_code = ?, reason = ?, reason_code = ?, ended_at = ?"
                " WHERE job_id = ? AND number = ?",
                (AttemptStatus(status).value, exit_code, reason, code, time.time(), job_id, number),
            )

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

    def attempts(self, job_id: str) -> list[Attempt]:
        """The job's attempts, first first."""
        rows = self._conn.execute(
            "SELECT * FROM attempts WHERE job_id = ? ORDER BY number", (job_id,)
        ).fetchall()
        return [Attempt.from_dict(dict(r)) for r in rows]

    # ---------------------------------------------------------------- events and metrics

    @staticmethod
    def _event(db: sqlite3.Connection, job_id: str, kind: str, message: str, data: dict | None = None) -> None:
        db.execute(
            "INSERT INTO events (job_id, ts, kind, message, data_json) VALUES (?, ?, ?, ?, ?)",
            (job_id, time.time(), kind, message, json.dumps(data) if data else None),
        )

    def add_event(self, job_id: str, kind: str, message: str, data: dict | None = None) -> None:
        """Append an event (``kind``: status, plan, provision, launch, node, recovery, ...)."""
        with self.write() as db:
            self._event(db, job_id, kind, message, data)

    def events(self, job_id: str, after_id: int = 0) -> list[Event]:
        """The job's events with an id above ``after_id``, oldest first."""
        rows = self._conn.execute(
            "SELECT * FROM events WHERE job_id = ? AND id > ? ORDER BY id", (job_id, after_id)
        ).fetchall()
        return [Event.from_dict({**dict(r), "data": json.loads(r["data_json"]) if r["data_json"] else None})
                for r in rows]

    def record_metrics(self, job_id: str, samples: list[dict]) -> None:
        """Keep the latest sample per rank, and the first one ever seen. ``samples`` (in the order
        they were written) are dicts with rank, step, loss, step_time_s, tokens_per_s, ts, as
        :mod:`sftctl.train` writes them."""
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
                        s.get("tokens_per_s"), int(f["step"]), f.get("loss"), s.get("ts", time.time()),
                    ),
                )

    def metrics(self, job_id: str | None = None) -> list[MetricsRecord]:
        """Latest metrics per rank, for one job or all jobs."""
        if job_id is None:
            rows = self._conn.execute("SELECT * FROM metrics ORDER BY job_id, rank").fetchall()
        else:
            rows = self._conn.execute(
                "SELECT * FROM metrics WHERE job_id = ? ORDER BY rank", (job_id,)
            ).fetchall()
        return [MetricsRecord.from_dict(dict(r)) for r in rows]


def _is_locked(e: sqlite3.OperationalError) -> bool:
    text = str(e).lower()
    return "locked" in text or "busy" in text


def _job(row: sqlite3.Row) -> JobRecord:
    job = dict(row)
    job["spec"] = json.loads(job.pop("spec_json"))
    plan = job.pop("offering_json")
    job["plan"] = json.loads(plan) if plan else None  # JobRecord takes its offering from it
    return JobRecord.from_dict(job)
