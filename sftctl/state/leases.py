"""The Store's controller leases: one live controller per job across machines, by the database's
clock (:class:`sftctl.state.LeaseKeeper` holds and renews one)."""

from __future__ import annotations

from sftctl.state.connection import _Connection, _retrying


class _Leases(_Connection):
    """The Store's leases (a part of :class:`sftctl.state.Store`)."""

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
        row = self.lease_row(job_id)
        return row if row and row[1] > 0 else None

    def lease_row(self, job_id: str) -> tuple[str, float] | None:
        """The job's lease as (holder, seconds left: negative once it expired, until another
        holder takes it or its holder renews it), or None when there is no row."""
        row = self._conn.execute(f"SELECT holder, expires_at - {self._d.now} AS left_s FROM leases WHERE job_id = ?",
                                 (job_id,)).fetchone()
        return (row["holder"], row["left_s"]) if row else None
