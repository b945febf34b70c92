"""The :class:`~sftctl.controller.lifecycle.Controller`'s reading of its nodes (a mixin,
:class:`Draining`): each poll passes new log text and metrics to the reporter, records the
metrics and the GPU samples, and names which node runs which training rank. What the job wrote
(metrics records, its node's ``health.jsonl``) is checked first (:mod:`sftctl.health.records`):
a record the state or the detectors cannot read is dropped with a warning, never raised.
"""

from __future__ import annotations

import time
from typing import Any

from sftctl.controller.preflight import report as report_preflight
from sftctl.controller.slots import NodeSlot
from sftctl.health.records import MAX_WARNINGS, check_gpu_sample, check_metrics_record
from sftctl.spec import JobSpec
from sftctl.state import Store


class Draining:
    """The Controller's :meth:`_drain` (its attributes declared here for the type checker; the
    Controller sets them)."""

    store: Store
    job_id: str
    spec: JobSpec
    provider: Any
    reporter: Any
    monitor: Any
    nodes: list[NodeSlot]
    attempt: int
    rank_nodes: dict[int, int]
    _reported_attempt: int
    _dropped_records: int
    _agent_errors: int
    offering: Any

    def _drain(self) -> None:
        """Pass new log text and metrics of every node to the reporter; record metrics."""
        batch: list[dict] = []
        placed: dict[int, int] = {}
        for node in self.nodes:
            data, node.log_offset = self.provider.read_log(node.handle, node.log_offset)
            if data:
                text = data.decode("utf-8", "replace")
                self.reporter.log(node.rank, text)
            records = self._valid_records(node.rank, self.provider.read_metrics(node.handle, node.metric_offsets),
                                          self._check_metrics, "metrics")
            samples = [s for s in records if "step" in s]  # the rest are heartbeats
            for r in {int(s["rank"]) for s in records if s.get("rank") is not None}:
                placed[r] = node.rank
            if samples:
                self.reporter.metrics(samples)
                batch += [{**s, "rank": s.get("rank", node.rank)} for s in samples]
            if self.monitor is not None:
                self.monitor.add_metrics(node.rank, records, time.time())
                gpu = self._valid_records(node.rank, self.provider.read_health(node.handle, node.health_offsets),
                                          check_gpu_sample, "health")
                for problem in {s["agent_error"] for s in gpu if "agent_error" in s}:
                    # the agent keeps going without that part, so the job does too, but says so; the
                    # job writes these lines: MAX_WARNINGS events, each a line, then one saying so
                    self._agent_errors += 1
                    if self._agent_errors > MAX_WARNINGS + 1:
                        continue
                    line = " ".join(problem.split())
                    message = (f"node {node.rank}: health agent: {line[:300]}{'...' if len(line) > 300 else ''}"
                               if self._agent_errors <= MAX_WARNINGS else
                               f"node {node.rank}: health agent: more than {MAX_WARNINGS} errors; further ones "
                               "are not recorded")
                    self.store.add_event(self.job_id, "health", message)
                    self.reporter.event(f"warning: {message}")
                report_preflight(self.store, self.job_id, self.reporter, node.rank, gpu,
                                 self.spec.health.thresholds().preflight_min_fraction)  # issue 41: its figures and time
                self.monitor.add_gpu(node.rank, gpu)
                self.store.record_gpu_samples(self.job_id, node.rank, gpu)  # the dashboard's GPU curves
        if any(self.rank_nodes.get(r) != n for r, n in placed.items()):  # c10d decides: say which node got which rank
            self.rank_nodes.update(placed)
            pairs = sorted(self.rank_nodes.items())
            self.store.add_event(self.job_id, "ranks", "rank -> node: " + ", ".join(f"{r} -> {n}" for r, n in pairs),
                                 {"ranks": {str(r): n for r, n in pairs}})
        if batch:
            self.store.record_metrics(self.job_id, batch)
            if self._reported_attempt != self.attempt:
                self._reported_attempt = self.attempt
                first = min(int(s["step"]) for s in batch)
                self.store.add_event(self.job_id, "progress", f"attempt {self.attempt}: first step reported is {first}")

    def _check_metrics(self, record: object) -> tuple[dict | None, str | None]:
        """:func:`check_metrics_record`, and a ``rank`` below the job's world size (nodes x the
        offering's processes per node): the job writes these records, and each rank it names
        is rows of the state that every user's jobs list reads."""
        clean, problem = check_metrics_record(record)
        world = self.spec.resources.nodes * max(1, int(self.offering.count))
        if clean is not None and clean.get("rank") is not None and clean["rank"] >= world:
            return None, (f"rank: {clean['rank']} is not one of the job's {world} ranks "
                          f"({self.spec.resources.nodes} node(s) x {self.offering.count})")
        return clean, problem

    def _valid_records(self, node_rank: int, records: list, check, what: str) -> list[dict]:
        """The node's records that ``check`` (:func:`check_metrics_record` for ``what``
        "metrics", :func:`check_gpu_sample` for "health") passes, cleaned; each other one is
        dropped with a warning event naming its field (the job can write the files, so it never
        raises here), the first :data:`MAX_WARNINGS` of them, then one saying so."""
        out = []
        for record in records:
            clean, problem = check(record)
            if clean is not None:
                out.append(clean)
                continue
            self._dropped_records += 1
            if self._dropped_records > MAX_WARNINGS + 1:
                continue
            message = (f"node {node_rank}: a {what} record was dropped: {problem}"
                       if self._dropped_records <= MAX_WARNINGS else
                       f"node {node_rank}: more than {MAX_WARNINGS} invalid {what} records: "
                       "further ones are dropped without a warning")
            self.store.add_event(self.job_id, what, message)
            self.reporter.event(f"warning: {message}")
        return out
