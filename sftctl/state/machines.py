"""The state's memory of bad machines (issue 41.3): a host, instance or Slurm node that a health
verdict condemned (a preflight that found it slow, an XID, a throttled GPU ...), with its zone,
so that every later job of this state keeps it out until the mark decays.

One row per (provider, machine, verdict kind): a repeated verdict counts and extends the mark.
A mark holds ``SFTCTL_BAD_MACHINE_DECAY_H`` hours after its latest verdict, then it is forgotten
(rows stay for ``sftctl nodes --all``; :meth:`_Machines.bad_machines` leaves them out).
"""

from __future__ import annotations

import dataclasses
import time

from sftctl import settings
from sftctl.state.connection import _Connection, _retrying


@dataclasses.dataclass(frozen=True)
class BadMachine:
    """A machine a verdict condemned.

    Attributes:
        provider: ``slurm``, ``kubernetes``, ``aws``, ``gcp`` ...
        machine: the Slurm node name, the Kubernetes node's hostname, the cloud instance id.
        zone: its zone ("" where the provider has none).
        kind: the verdict's kind (``preflight_slow``, ``xid``, ``throttle`` ...).
        evidence: the latest verdict's line, with its figures.
        job_id: the job whose node it was, latest.
        count: how many verdicts of that kind it had.
        first_at, at: the first and the latest verdict, Unix seconds.
        until: when the mark decays, Unix seconds.
    """

    provider: str
    machine: str
    zone: str
    kind: str
    evidence: str
    job_id: str | None
    count: int
    first_at: float
    at: float
    until: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "BadMachine":
        """The inverse of :meth:`to_dict` (a server's ``GET /v1/machines`` rows); unknown keys
        are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class _Machines(_Connection):
    """The Store's part for bad machines (see :class:`sftctl.state.Store`)."""

    def mark_bad_machine(self, provider: str, machine: str, kind: str, evidence: str, *, zone: str = "",
                         job_id: str | None = None, now: float | None = None, decay_s: float | None = None) -> None:
        """Remember that ``machine`` of ``provider`` got a verdict of ``kind`` (``evidence``: its
        line). It is kept out for ``decay_s`` seconds (default ``SFTCTL_BAD_MACHINE_DECAY_H``
        hours) from now; a repeated verdict counts and extends the mark."""
        now = time.time() if now is None else now
        if decay_s is None:
            decay_s = settings.get("SFTCTL_BAD_MACHINE_DECAY_H") * 3600.0
        with self.write() as db:
            db.execute(
                "INSERT INTO bad_machines (provider, machine, kind, zone, evidence, job_id, count, first_at, at, until) "
                "VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?, ?) ON CONFLICT (provider, machine, kind) DO UPDATE SET "
                "count = bad_machines.count + 1, zone = excluded.zone, evidence = excluded.evidence, "
                "job_id = excluded.job_id, at = excluded.at, until = excluded.until",
                (provider, machine, kind, zone, evidence, job_id, now, now, now + decay_s))

    @_retrying
    def bad_machines(self, provider: str | None = None, now: float | None = None,
                     include_decayed: bool = False) -> list[BadMachine]:
        """The machines still marked bad (of ``provider``, or all), newest verdict first;
        ``include_decayed``: the forgotten ones too."""
        now = time.time() if now is None else now
        sql = "SELECT * FROM bad_machines WHERE 1 = 1"
        args: list = []
        if provider is not None:
            sql += " AND provider = ?"
            args.append(provider)
        if not include_decayed:
            sql += " AND until > ?"
            args.append(now)
        rows = self._conn.execute(sql + " ORDER BY at DESC, machine", tuple(args)).fetchall()
        return [BadMachine(r["provider"], r["machine"], r["zone"], r["kind"], r["evidence"], r["job_id"],
                           int(r["count"]), float(r["first_at"]), float(r["at"]), float(r["until"])) for r in rows]
