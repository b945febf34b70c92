"""The Store's connection and schema: opening SQLite (created whole, migrated under a file lock)
or Postgres (migrated under an advisory lock), write transactions, resting a connection, and
riding out a lost Postgres connection (:func:`_retrying`, :attr:`_Connection.retry_window_s`).
:class:`sftctl.state.Store` is this plus the parts in jobs.py, series.py, users.py, leases.py.

The schema version it checks against is :data:`sftctl.state.migrations.SCHEMA_VERSION`, imported
by name: a test that pretends to be an older sftctl patches it here (``sftctl.state.connection``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from sftctl import settings
from sftctl.paths import sftctl_home
from sftctl.state.dialect import SQLITE, _Dialect, _PgConn, _postgres, is_url, redact
from sftctl.state.migrations import MIGRATIONS, SCHEMA_VERSION

BUSY_TIMEOUT_MS = settings.SETTINGS["SFTCTL_STATE_BUSY_TIMEOUT_MS"].default  # the tests set a short one
LOCKED_RETRY_S = 1.0  # a controller that keeps waiting for the write lock tries again this often
HELD_RECONNECT_S = 2.0  # while events are held back, a new one tries to reconnect at most this often
_HOLDABLE = ("add_event", "record_metrics", "record_gpu_samples")  # held in memory while Postgres is unreachable
_MIGRATION_LOCK = 0x5F7C7100  # pg_advisory_xact_lock key: one migrating process at a time


def _retrying(fn):
    """A Store method that survives a lost database connection: see :attr:`Store.retry_window_s`.
    On SQLite (no such errors) it only calls ``fn``."""

    @functools.wraps(fn)
    def call(self: "_Connection", *args, **kwargs):
        try:
            if self._held:
                self._flush_held()
            result = fn(self, *args, **kwargs)
            self._unreachable_since = None  # it answers: an outage (if any) is over
            return result
        except self._d.disconnect as e:
            return self._retry(fn, e, args, kwargs)

    return call


class _Connection:
    """The Store's connection, schema and write transactions (see :class:`sftctl.state.Store`)."""

    def __init__(self, path: str | os.PathLike | None = None):
        target = str(path) if path is not None else (settings.get("SFTCTL_STATE_URL") or None)
        self.url: str | None = target if is_url(target) else None
        self.path: Path | None = None if self.url else (Path(target) if target else sftctl_home() / "state.db")
        self.where = redact(self.url) if self.url else str(self.path)
        self.busy_timeout_ms = settings.get("SFTCTL_STATE_BUSY_TIMEOUT_MS")
        #: None: a write that cannot get the lock within the busy timeout raises. A controller
        #: sets a callable instead: it is called with the error once per wait, and the write is
        #: retried until it gets the lock (a job must not fail because a reader held state.db).
        self.on_locked: Callable[[Exception], object] | None = None
        #: 0: a lost connection to Postgres is an SftctlError at once (the CLI). A controller sets
        #: ``SFTCTL_STATE_RETRY_S``: every call reconnects and retries (tenacity) until this many
        #: seconds after the outage's first retry (one window per outage, not per call: past it
        #: each call tries once, then raises); events and metrics are held in memory meanwhile
        #: (the job goes on) and written, in order and with their own times, before the next
        #: write once it is back.
        self.retry_window_s = 0.0
        self._unreachable_since: float | None = None  # time.monotonic() of the current outage's first retry
        #: called with the error once per outage while retrying (the controller reports it)
        self.on_unreachable: Callable[[BaseException], object] | None = None
        self._held: list[tuple[str, tuple, dict]] = []
        self._gpu_compacted: dict[tuple[str, int], float] = {}  # (job, node) -> last thinned at (s)
        self._reconnected_at = 0.0
        self._retrying = 0  # > 0 inside _retry: a call may be repeating one whose commit went through
        self._d = SQLITE
        try:
            if self.url:
                self._d = _postgres()
                self._conn: Any = self._open_pg()  # a sqlite3.Connection or a _PgConn
            else:
                self._conn = self._open()
        except ImportError:
            from sftctl.errors import SftctlError

            raise SftctlError(f"state.url is {self.where}, but psycopg is not installed",
                              hint="pip install 'sftctl[server]' (psycopg 3), or unset state.url for SQLite") from None
        except (sqlite3.DatabaseError, OSError, *self._d.error) as e:  # Postgres: refused, no rights, ...
            from sftctl.errors import SftctlError

            if self.url:
                from sftctl.errors import StateUnavailable

                raise StateUnavailable(f"{self.where}: cannot connect to the state database: {_one_line(e)}",
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
        # check_same_thread=False: a generator over the store (api.logs, streamed by the server) is
        # advanced by whichever worker thread serves its next chunk, one at a time; Python's SQLite is
        # built serialized (sqlite3.threadsafety 3), and a Store is never used by two threads at once
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_ms / 1000, isolation_level=None,
                               check_same_thread=False)
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

    def rest(self) -> None:
        """Close a Postgres connection until the next call needs it (which connects again, a few
        ms). A process that waits between reads (a queued job, a lease's renewals) calls it
        before each sleep, so it holds none of the server's connections (``max_connections``,
        100 by default) while it waits: a lab's hundred queued jobs never refuse a user's
        ``sftctl status``. SQLite: nothing (a file handle costs the server nothing). Held
        events and metrics stay held."""
        if self._d.shared and not self._held:
            self._conn.rest()

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
        and call ``fn`` again until it works or :attr:`retry_window_s` has passed since the
        outage's first retry (past it: one try).

        Raises:
            StateUnavailable: the database is still unreachable past the window."""
        from sftctl.errors import StateUnavailable

        if not self.retry_window_s:
            raise StateUnavailable(f"{self.where}: the state database is unreachable: {_one_line(error)}",
                              hint="check that Postgres is up, then retry") from None
        if fn.__name__ in _HOLDABLE:
            self._held.append(("_" + fn.__name__, args, {**kwargs, "ts": time.time()}))
            if time.monotonic() - self._reconnected_at > HELD_RECONNECT_S:  # back yet? (cheap, throttled)
                try:
                    self._reconnect()
                    self._flush_held()
                    self._unreachable_since = None
                except self._d.disconnect:
                    pass
            return None
        import tenacity

        if self.on_unreachable is not None:
            self.on_unreachable(error)
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
        left_s = self._unreachable_since + self.retry_window_s - time.monotonic()
        self._retrying += 1
        try:
            for attempt in tenacity.Retrying(
                stop=tenacity.stop_after_delay(max(0.0, left_s)),
                wait=tenacity.wait_exponential(multiplier=0.2, max=2.0),
                retry=tenacity.retry_if_exception_type(self._d.disconnect), reraise=True,
            ):
                with attempt:
                    self._reconnect()
                    self._flush_held()
                    result = fn(self, *args, **kwargs)
            self._unreachable_since = None
        except self._d.disconnect as e:
            raise StateUnavailable(f"{self.where}: the state database was unreachable for more than {self.retry_window_s:g} s: "
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
