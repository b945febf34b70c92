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

Split by job (ARCHITECTURE.md, "Layout"); the names below are the package's public surface,
re-exported from its modules:

- :mod:`~sftctl.state.migrations`: :data:`MIGRATIONS`, the ONE ordered list of migrations
  (``sftctl/state/migrations.py``: append yours at its very end) and :data:`SCHEMA_VERSION`;
- :mod:`~sftctl.state.dialect`: what differs between SQLite and Postgres, :func:`is_url`,
  :func:`redact`, :func:`os_user`;
- :mod:`~sftctl.state.connection`: opening, migrating, write transactions, a lost connection;
- :mod:`~sftctl.state.jobs`: :data:`TRANSITIONS`, placed controllers, jobs, nodes, attempts, events;
- :mod:`~sftctl.state.series`: metrics, step series, GPU series, run history;
- :mod:`~sftctl.state.users`: users, the audit, secrets;
- :mod:`~sftctl.state.leases`: controller leases;
- :mod:`~sftctl.state.liveness`: the verdict on a job's controller (:class:`Liveness`) and its evidence;
- :mod:`~sftctl.state.store`: :class:`Store` (the parts above in one class) and :class:`LeaseKeeper`.

A constant is read by the module that defines it (``STEP_SERIES_CAP`` in series.py,
``CONTROLLER_START_GRACE_S`` in jobs.py) or imports it (``SCHEMA_VERSION`` in connection.py): a
test that changes one patches it there, not here.
"""

from sftctl.state.connection import (BUSY_TIMEOUT_MS, HELD_RECONNECT_S, LOCKED_RETRY_S, _is_locked, _one_line,
                                     _quietly, _retrying)
from sftctl.state.dialect import SQLITE, _Dialect, _PgConn, _postgres, is_url, os_user, redact
from sftctl.state.jobs import (CONTROLLER_START_GRACE_S, HERE, QUEUED_CONTROLLER_LEASE_S, TRANSITIONS,
                               IllegalTransition, controller_died_reason, placed, queued_holder)
from sftctl.state.liveness import Liveness
from sftctl.state.machines import BadMachine
from sftctl.state.migrations import MIGRATIONS, SCHEMA_VERSION
from sftctl.state.series import GPU_COMPACT_EVERY_S, GPU_TIERS, STEP_SERIES_CAP
from sftctl.state.store import LeaseKeeper, Store
from sftctl.state.users import _token_hash
from sftctl.types import (TERMINAL, Attempt, AttemptStatus, AuditEvent, Event, GpuPoint, JobRecord, JobStatus,
                          MetricsRecord, NodeRecord, NodeState, RunRecord, StepRecord, User, capabilities)

__all__ = [
    "BUSY_TIMEOUT_MS", "HELD_RECONNECT_S", "LOCKED_RETRY_S", "SQLITE", "is_url", "os_user", "redact",
    "CONTROLLER_START_GRACE_S", "HERE", "QUEUED_CONTROLLER_LEASE_S", "TRANSITIONS", "IllegalTransition",
    "controller_died_reason", "placed", "queued_holder", "MIGRATIONS", "SCHEMA_VERSION", "GPU_COMPACT_EVERY_S",
    "GPU_TIERS", "STEP_SERIES_CAP", "LeaseKeeper", "Liveness", "Store", "BadMachine",
    # the vocabulary the Store's records are made of (from sftctl.types)
    "TERMINAL", "Attempt", "AttemptStatus", "AuditEvent", "Event", "GpuPoint", "JobRecord", "JobStatus",
    "MetricsRecord", "NodeRecord", "NodeState", "RunRecord", "StepRecord", "User", "capabilities",
    # private names tests and tools use
    "_Dialect", "_PgConn", "_postgres", "_token_hash", "_is_locked", "_one_line", "_quietly", "_retrying",
]
