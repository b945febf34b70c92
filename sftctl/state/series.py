"""The Store's series: the latest metrics per rank, every reported step (``metric_steps``,
bounded by :data:`STEP_SERIES_CAP`, read here), the GPU samples thinned by age (:data:`GPU_TIERS`)
and the run history (``run_history``)."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from sftctl.state.connection import _Connection, _retrying
from sftctl.types import GpuPoint, MetricsRecord, RunRecord, StepRecord

#: the most rows ``metric_steps`` keeps per job and rank: past it, every other row of the older
#: half is dropped (Store._record_steps), so a week at one report a second stays at <= this many
STEP_SERIES_CAP = 10_000
#: how ``gpu_samples`` thins a node's GPU series as it ages (Store._compact_gpu): (age in s past
#: which, bucket width in s): the newest hour whole, then min/max per minute up to 7 days old,
#: then per 10 minutes. Retention: every point while the job is in the state; at one sample a
#: second a GPU keeps <= 3,600 + 10,080 + 144 per day past the 7th points (13,680 for a week)
GPU_TIERS: tuple[tuple[float, float], ...] = ((3600.0, 60.0), (7 * 86400.0, 600.0))
#: a controller thins a node's GPU series at most this often (seconds)
GPU_COMPACT_EVERY_S = 60.0


class _Series(_Connection):
    """The Store's metrics, step series, GPU series and run history (a part of :class:`sftctl.state.Store`)."""

    # ---------------------------------------------------------------- metrics

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
            self._record_steps(db, job_id, samples, ts)

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

    # ---------------------------------------------------------------- step series and run history

    def _record_steps(self, db: Any, job_id: str, samples: list[dict], ts: float | None) -> None:
        """Append every sample to ``metric_steps`` (step, loss, step time, tokens/s, learning rate
        ``lr`` and ``checkpoint`` when the report has them), then keep each touched rank's series
        bounded: past :data:`STEP_SERIES_CAP` rows, every other row of its older half goes (the
        newest half stays whole; older points thin by halves as the job ages; checkpoint steps
        are kept). Issue 36's dashboard reads the same rows (:meth:`step_series`)."""
        now = ts or time.time()
        for s in samples:
            ck = s.get("checkpoint")
            db.execute(
                "INSERT INTO metric_steps (job_id, rank, step, loss, step_time_s, tokens_per_s, lr, checkpoint, ts)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, int(s["rank"]), int(s["step"]), s.get("loss"), s.get("step_time_s"), s.get("tokens_per_s"),
                 s.get("lr"), None if ck is None else int(bool(ck)), s.get("ts", now)))
        for rank in {int(s["rank"]) for s in samples}:
            n = db.execute("SELECT COUNT(*) AS n FROM metric_steps WHERE job_id = ? AND rank = ?",
                           (job_id, rank)).fetchone()["n"]
            if n > STEP_SERIES_CAP:
                db.execute(
                    "DELETE FROM metric_steps WHERE id IN (SELECT id FROM (SELECT id, checkpoint,"
                    " ROW_NUMBER() OVER (ORDER BY id) AS rn FROM metric_steps WHERE job_id = ? AND rank = ?) t"
                    " WHERE t.rn <= ? AND t.rn % 2 = 0 AND (t.checkpoint IS NULL OR t.checkpoint = 0))",
                    (job_id, rank, n // 2))

    @_retrying
    def step_series(self, job_id: str, rank: int | None = None, last: int | None = None,
                    after: float | None = None) -> list[StepRecord]:
        """The job's reported steps, oldest first per rank (:class:`StepRecord` each). At most
        :data:`STEP_SERIES_CAP` per rank (older points thinned); ``last``: only the newest
        ``last`` rows of the job (all ranks together), as ``status`` reads a running job's;
        ``after``: only steps reported after that time (Unix seconds; the dashboard's updates)."""
        q = "SELECT id, rank, step, loss, step_time_s, tokens_per_s, lr, checkpoint, ts FROM metric_steps WHERE job_id = ?"
        args: tuple = (job_id,)
        if rank is not None:
            q, args = q + " AND rank = ?", args + (rank,)
        if after is not None:
            q, args = q + " AND ts > ?", args + (float(after),)
        if last is not None:
            q, args = f"SELECT * FROM ({q} ORDER BY id DESC LIMIT ?) t", args + (int(last),)
        rows = self._conn.execute(q + " ORDER BY rank, id", args).fetchall()
        return [StepRecord.from_dict({**dict(r), "checkpoint": None if r["checkpoint"] is None else bool(r["checkpoint"])})
                for r in rows]

    # ---------------------------------------------------------------- GPU series (issue 36)

    _GPU_KEYS = (("util_pct", "utilization_gpu_pct", 1.0), ("memory_mib", "memory_used_mib", 1.0),
                 ("temp_c", "temperature_gpu_c", 1.0), ("sm_clock_mhz", "clock_sm_mhz", 1.0),
                 ("power_w", "power_usage_mw", 1e-3))
    _GPU_COLUMNS = ("node_rank", "gpu", "ts", "span_s", "n", *(f"{m}_{e}" for m, _, _ in _GPU_KEYS for e in ("min", "max")),
                    "xids", "ecc")

    @_retrying
    def record_gpu_samples(self, job_id: str, node_rank: int, samples: list[dict], now: float | None = None) -> None:
        """Append a node's GPU samples (:mod:`sftctl.health.telemetry`'s records; those without a
        ``gpu`` index are skipped) to ``gpu_samples``, then, at most every
        :data:`GPU_COMPACT_EVERY_S` per node, thin the node's older points (:data:`GPU_TIERS`).
        ``now``: the time the thinning ages points against (Unix seconds; default the clock)."""
        self._record_gpu_samples(job_id, node_rank, samples, now)

    def _record_gpu_samples(self, job_id: str, node_rank: int, samples: list[dict], now: float | None = None,
                            ts: float | None = None) -> None:
        rows = []
        for s in samples:
            if "gpu" not in s:  # a lost GPU's record stays: its XIDs count
                continue
            values = []
            for _, key, scale in self._GPU_KEYS:
                v = s.get(key)
                v = None if not isinstance(v, (int, float)) or isinstance(v, bool) else float(v) * scale
                values += [v, v]
            ecc = s.get("ecc_uncorrected_volatile")
            rows.append((job_id, int(node_rank), int(s["gpu"]), float(s.get("ts") or ts or time.time()), 0.0, 1,
                         *values, len(s.get("xids") or ()), int(ecc) if isinstance(ecc, (int, float)) else None))
        if not rows:
            return
        now = time.time() if now is None else now
        cols = ("job_id",) + self._GPU_COLUMNS
        with self.write() as db:
            for row in rows:
                db.execute(f"INSERT INTO gpu_samples ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", row)
            last = self._gpu_compacted.get((job_id, node_rank), -1e18)
            if now - last >= GPU_COMPACT_EVERY_S:
                self._gpu_compacted[(job_id, node_rank)] = now
                self._compact_gpu(db, job_id, node_rank, now)

    def _compact_gpu(self, db: Any, job_id: str, node_rank: int, now: float) -> None:
        """Thin the node's points older than each tier's age into buckets of its width: min of
        the mins, max of the maxes, XIDs summed, the largest ECC counter. Only whole buckets past
        the age are merged, so each bucket is written once per tier."""
        for age_s, width in GPU_TIERS:
            edge = math.floor((now - age_s) / width) * width
            rows = db.execute(f"SELECT id, {', '.join(self._GPU_COLUMNS)} FROM gpu_samples WHERE job_id = ?"
                              " AND node_rank = ? AND ts < ? AND span_s < ? ORDER BY ts",
                              (job_id, node_rank, edge, width)).fetchall()
            if not rows:
                continue
            buckets: dict[tuple[int, float], list] = {}
            for r in rows:
                buckets.setdefault((r["gpu"], math.floor(r["ts"] / width) * width), []).append(r)
            cols = ("job_id",) + self._GPU_COLUMNS
            for (gpu, start), group in buckets.items():
                if len(group) == 1 and group[0]["span_s"] == width:
                    continue
                merged: list = [job_id, node_rank, gpu, start, width, sum(int(r["n"]) for r in group)]
                for m, _, _ in self._GPU_KEYS:
                    lows = [r[f"{m}_min"] for r in group if r[f"{m}_min"] is not None]
                    highs = [r[f"{m}_max"] for r in group if r[f"{m}_max"] is not None]
                    merged += [min(lows) if lows else None, max(highs) if highs else None]
                eccs = [r["ecc"] for r in group if r["ecc"] is not None]
                merged += [sum(int(r["xids"]) for r in group), max(eccs) if eccs else None]
                ids = [r["id"] for r in group]
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    db.execute(f"DELETE FROM gpu_samples WHERE id IN ({', '.join('?' * len(chunk))})", chunk)
                db.execute(f"INSERT INTO gpu_samples ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", merged)

    @_retrying
    def gpu_series(self, job_id: str, node_rank: int | None = None, since: float | None = None) -> list[GpuPoint]:
        """The job's GPU points (:class:`~sftctl.types.GpuPoint`), per node and GPU oldest first;
        ``since``: only points from that time on (Unix seconds)."""
        q = f"SELECT {', '.join(self._GPU_COLUMNS)} FROM gpu_samples WHERE job_id = ?"
        args: list = [job_id]
        if node_rank is not None:
            q, args = q + " AND node_rank = ?", args + [int(node_rank)]
        if since is not None:
            q, args = q + " AND ts >= ?", args + [float(since)]
        rows = self._conn.execute(q + " ORDER BY node_rank, gpu, ts", args).fetchall()
        return [GpuPoint.from_dict(dict(r)) for r in rows]

    _HISTORY_COLUMNS = ("job_id", "accelerator", "count", "gpus_per_node", "nodes", "provider", "instance_type",
                        "region", "mode", "strategy", "predicted_step_s", "interval_low_s", "interval_high_s",
                        "measured_step_s", "measured_steps", "features", "name", "source", "source_label", "ts")

    def add_runs(self, runs: list[RunRecord]) -> int:
        """Append run-history rows in ONE transaction: all or none. A row with a ``job_id``
        replaces that job's earlier row (a job is measured once, its latest measurement kept).
        Returns the count."""
        cols = [c if c != "features" else "features_json" for c in self._HISTORY_COLUMNS]
        with self.write() as db:
            for r in runs:
                if r.job_id:
                    db.execute("DELETE FROM run_history WHERE job_id = ?", (r.job_id,))
                values = [(json.dumps(r.features) if r.features else None) if c == "features" else getattr(r, c)
                          for c in self._HISTORY_COLUMNS]
                db.execute(f"INSERT INTO run_history ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                           values)
        return len(runs)

    @_retrying
    def runs(self, accelerator: str | None = None, source: str | None = None,
             job_ids: list[str] | None = None) -> list[RunRecord]:
        """The run history, oldest first, of one accelerator (case-insensitive), one ``source``
        (``run`` | ``imported``) or these jobs."""
        q, args = "SELECT * FROM run_history WHERE 1 = 1", []
        if accelerator is not None:
            q, args = q + " AND LOWER(accelerator) = ?", args + [accelerator.lower()]
        if source is not None:
            q, args = q + " AND source = ?", args + [source]
        if job_ids is not None:
            if not job_ids:
                return []
            q, args = q + f" AND job_id IN ({', '.join('?' * len(job_ids))})", args + list(job_ids)
        rows = self._conn.execute(q + " ORDER BY id", tuple(args)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            raw = d.pop("features_json")
            out.append(RunRecord.from_dict({**d, "features": json.loads(raw) if raw else None}))
        return out

    def forget_runs(self, *, source: str | None = None, source_label: str | None = None) -> int:
        """Delete run-history rows of ``source`` (``run`` | ``imported``) and/or ``source_label``;
        returns how many went. Raises ValueError when neither is given (never all at once by accident)."""
        if source is None and source_label is None:
            raise ValueError("forget_runs needs source or source_label")
        q, args = "DELETE FROM run_history WHERE 1 = 1", []
        if source is not None:
            q, args = q + " AND source = ?", args + [source]
        if source_label is not None:
            q, args = q + " AND source_label = ?", args + [source_label]
        with self.write() as db:
            return db.execute(q, tuple(args)).rowcount
