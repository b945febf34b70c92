"""The job lifecycle and the Store's jobs, nodes, attempts and events.

:data:`TRANSITIONS` (the legal moves; :meth:`_Jobs.transition` is a compare-and-set on them),
:func:`placed`/:func:`queued_holder` (a controller placed in a scheduler's job), and
:meth:`_Jobs.reap_dead_controllers` (which reads :data:`CONTROLLER_START_GRACE_S` from here).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from sftctl import procs
from sftctl.state.connection import _Connection, _retrying
from sftctl.state.dialect import os_user
from sftctl.state.liveness import Liveness, dead_here, lock_held, process_here
from sftctl.types import (TERMINAL, Attempt, AttemptStatus, Event, JobRecord, JobStatus, NodeRecord, NodeState,
                          capabilities)

_UNBILLED = {NodeState.TERMINATED, NodeState.REPLACED}  # a node in these stopped billing
_ENDINGS = {JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.FAILED_CONTROLLER}
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.PENDING: frozenset({JobStatus.PROVISIONING} | _ENDINGS),
    JobStatus.PROVISIONING: frozenset({JobStatus.LAUNCHING} | _ENDINGS),
    JobStatus.LAUNCHING: frozenset({JobStatus.RUNNING, JobStatus.RECOVERING} | _ENDINGS),  # a launch cut short
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.RECOVERING} | _ENDINGS),
    JobStatus.RECOVERING: frozenset({JobStatus.PROVISIONING, JobStatus.LAUNCHING} | _ENDINGS),
    **{s: frozenset() for s in TERMINAL},
}
CONTROLLER_START_GRACE_S = 30.0  # a job may wait this long for its controller to record its pid

#: controller.place values whose controller is a process of this machine (judged by its pid and
#: lock): ``local`` (also a spec without one) and ``server`` (the server's child). Every other
#: placement (controller/placements/: slurm, kubernetes, any added there) runs off the submitting
#: machine, in a scheduler's job: its process is never judged by a pid here; it holds the job's
#: lease in the state (also on SQLite), and while it waits in the scheduler's queue the lease is
#: ``queued_holder``'s
HERE = frozenset({"local", "server"})
#: seconds the lease of a placed controller still queued at its scheduler lasts: past it (the
#: scheduler lost or dropped the job unseen) the job counts as without a controller
QUEUED_CONTROLLER_LEASE_S = 24 * 3600.0


def placed(spec: dict | None) -> str | None:
    """The spec's ``controller.place`` (a stored spec's document) when the controller runs in a
    scheduler's job elsewhere (not :data:`HERE`: ``"slurm"``, ``"kubernetes"``), else None."""
    place = ((spec or {}).get("controller") or {}).get("place")
    return place if place and place not in HERE else None


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


class _Jobs(_Connection):
    """The Store's jobs, nodes, attempts, events and blocked zones (a part of :class:`sftctl.state.Store`)."""

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
        ``failure_code``; the status event carries the code in its data. Any ending, SUCCEEDED
        too, clears ``pending_reason`` (a waiter killed or cancelled left its last note there).

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
            db.execute(  # an ended job waits for nothing: its pending_reason goes
                "UPDATE jobs SET status = ?, updated_at = ?, ended_at = COALESCE(?, ended_at),"
                " failure_reason = COALESCE(?, failure_reason), failure_code = COALESCE(?, failure_code)"
                + (", pending_reason = NULL" if new.terminal else "") + " WHERE id = ?",
                (new.value, now, ended, reason if new in _ENDINGS else None, code if new in _ENDINGS else None, job_id),
            )
            message = f"{old.value} -> {new.value}" + (f": {reason}" if reason else "")
            self._event(db, job_id, "status", message, {"code": code} if code else None)
        return True

    _UNSET: Any = object()

    if TYPE_CHECKING:  # the Store's leases part (:class:`sftctl.state.leases._Leases`) has it
        def lease(self, job_id: str) -> tuple[str, float] | None: ...

        def lease_row(self, job_id: str) -> tuple[str, float] | None: ...

    def controller_liveness(self, job: JobRecord, *, elsewhere: bool | None = None,
                            lease: Any = _UNSET, lock: bool = True, now: float | None = None) -> Liveness:
        """The verdict on ``job``'s controller from the state and this machine (one judgement for
        every caller: :meth:`reap_dead_controllers`, :func:`sftctl.queue.check_no_live_controller`,
        and through :meth:`sftctl.controller.placements.base.Placement.alive` the server, ``start``
        and ``down``), in this order:

        1. Where the lease decides (a shared (Postgres) state, whose controllers may run on other
           machines, or ``elsewhere``: a controller placed in a scheduler's job, default
           :func:`placed` of the job's spec): an unexpired lease is alive (its holder named), unless
           the holder is a process of this host that is gone (:func:`sftctl.state.liveness.dead_here`).
           An expired lease whose holder still runs on this host (same pid and start time) is alive
           too: a state outage longer than the lease stopped its renewals, and it renews as soon as
           the state answers (a reaper polling just then must not fail a live job). Elsewhere, the
           recorded pid (alive, same start time: never a reused pid) is alive.
        2. The job's controller lock of this ``$SFTCTL_HOME`` held by a process (unless ``lock``
           is false: the reaper, which polls every few seconds in every waiting job, never
           takes the lock even for an instant, so a controller's claim never meets it).
        3. No pid recorded within :data:`CONTROLLER_START_GRACE_S` of its submission: unknown
           (``alive`` None; its client is starting it: a spawner records the pid, or takes the
           lease in the child's name, first).
        4. Else dead (never started, exited, killed, or its lease gone).

        ``lease``: the job's lease as :meth:`lease_row` returns it (expired too), when the caller
        read every job's at once; ``now``: Unix time (default: the clock). Never asks a scheduler."""
        now = time.time() if now is None else now
        pid, ticks = job.controller_pid, job.controller_start_ticks
        if elsewhere is None:
            elsewhere = placed(job.spec) is not None
        gone = ""
        if self._d.shared or elsewhere:
            held = self.lease_row(job.id) if lease is self._UNSET else lease
            if held is not None and held[1] > 0 and not dead_here(held[0]):
                here = process_here(held[0])
                return Liveness(True, f"holds the job's lease as {held[0]} ({held[1]:.0f} s left)", "lease", held[0],
                                *(here or (None, None)))
            if held is not None and held[1] <= 0 and (here := process_here(held[0])) is not None:
                return Liveness(True, f"its lease expired {-held[1]:.0f} s ago, but its holder {held[0]} still runs "
                                      "on this host (it renews once the state answers)", "lease", held[0], *here)
            if held is None:
                gone = "no lease is held"
            elif held[1] > 0 or dead_here(held[0]):
                gone = f"its lease holder {held[0]} was a process of this host that is gone"
            else:
                gone = f"its lease expired {-held[1]:.0f} s ago ({held[0]})"
        elif pid is not None and procs.alive(pid, ticks):
            return Liveness(True, f"pid {pid} runs on this machine", "pid", None, pid, ticks)
        else:
            gone = "no pid is recorded" if pid is None else f"pid {pid} is gone"
        if lock and lock_held(job.id):
            return Liveness(True, "a process holds its controller lock on this machine", "lock")
        if pid is None and now - job.created_at < CONTROLLER_START_GRACE_S:
            return Liveness(None, f"no pid recorded yet, {now - job.created_at:.0f} s after submission "
                                  f"(its client starts it within {CONTROLLER_START_GRACE_S:.0f} s)", "grace")
        return Liveness(False, gone)

    @_retrying  # its read of every lease too: a lost connection is retried, never a raw driver error
    def reap_dead_controllers(self) -> list[str]:
        """Mark live jobs whose controller is gone (:meth:`controller_liveness` says dead) as
        FAILED_CONTROLLER; return their ids. A job still within its start grace is left alone. A
        cloud or Slurm job's nodes may still run: ``sftctl down`` removes them; local nodes stop by
        themselves (:func:`sftctl.procs.guard`)."""
        jobs = self.list_jobs({s for s in JobStatus if not s.terminal})
        leases: dict[str, tuple[str, float]] = {}
        if self._d.shared or any(placed(j.spec) for j in jobs):  # every lease in one read
            leases = {r["job_id"]: (r["holder"], r["left_s"]) for r in self._conn.execute(
                f"SELECT job_id, holder, expires_at - {self._d.now} AS left_s FROM leases").fetchall()}
        reaped = []
        for job in jobs:
            if self.controller_liveness(job, lease=leases.get(job.id), lock=False).alive is not False:
                continue
            reason = controller_died_reason(job.id, job.controller_pid, local=capabilities(job.provider).local_admission)
            if self.transition(job.id, JobStatus.FAILED_CONTROLLER, reason, strict=False, code="controller_died"):
                reaped.append(job.id)
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
    def events_of_kind(self, kind: str, job_ids: list[str]) -> list[Event]:
        """The events of kind ``kind`` of these jobs (an empty list: none), oldest first."""
        rows: list[Any] = []
        for at in range(0, len(job_ids), 500):  # SQLite's older builds take 999 parameters at most
            ids = job_ids[at:at + 500]
            rows += self._conn.execute(
                f"SELECT * FROM events WHERE kind = ? AND job_id IN ({', '.join('?' * len(ids))})", (kind, *ids)).fetchall()
        rows.sort(key=lambda r: r["id"])
        return [Event.from_dict({**dict(r), "data": json.loads(r["data_json"]) if r["data_json"] else None})
                for r in rows]


def _job(row: Any) -> JobRecord:
    job = dict(row)
    job["spec"] = json.loads(job.pop("spec_json"))
    plan = job.pop("offering_json")
    job["plan"] = json.loads(plan) if plan else None  # JobRecord takes its offering from it
    return JobRecord.from_dict(job)
