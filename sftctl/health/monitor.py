"""A job's recent health history, fed by the controller and judged by the detectors. No I/O.

The controller hands over what it read each poll (GPU samples per node, step reports per rank)
with the time it read them; :meth:`HealthMonitor.verdicts` runs
:func:`sftctl.health.detectors.evaluate` over the trailing window. Step reports are timed by
their arrival at the controller, not by the node's clock, so a node whose clock drifts is not
mistaken for a hung one.
"""

from __future__ import annotations

import collections

from sftctl.health import detectors
from sftctl.health.telemetry import Thresholds, Verdict


class HealthMonitor:
    """History of one job's nodes and ranks.

    Args:
        thresholds: detector settings.
        total_steps: the job's ``train.steps``; a rank that reported it has finished.
        keep_s: seconds of GPU samples to keep per node (at least the throttle window).
    """

    def __init__(self, thresholds: Thresholds, total_steps: int, keep_s: float | None = None):
        self.th = thresholds
        self.total_steps = total_steps
        self.keep_s = keep_s or max(60.0, 3 * thresholds.throttle_window_s)
        self.gpu: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.step_times: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
        self.last_report: dict[int, float] = {}
        self.last_step: dict[int, tuple[float, int]] = {}  # rank -> (arrival time, step)
        self.rank_to_node: dict[int, int] = {}
        self.finished: set[int] = set()

    def add_gpu(self, node_rank: int, samples: list[dict]) -> None:
        """GPU samples from a node's agent and the node's preflight records (other records
        without a ``gpu`` index are skipped)."""
        q = self.gpu[node_rank]
        for s in samples:
            if "gpu" in s or "preflight" in s:
                q.append(s)
        while q and q[-1].get("ts", 0) - q[0].get("ts", 0) > self.keep_s:
            q.popleft()

    def add_metrics(self, node_rank: int, samples: list[dict], now: float) -> None:
        """Step reports and heartbeats (:mod:`sftctl.train`) from ranks on ``node_rank``, read at
        ``now``. Either one proves the rank's process lives."""
        for s in samples:
            rank = int(s.get("rank", node_rank))
            self.rank_to_node[rank] = node_rank
            self.last_report[rank] = now
            if "step" not in s:
                continue  # a heartbeat
            self.last_step[rank] = (now, int(s["step"]))
            # a rank's own compute time when reported (step times equalise under synchronous DP)
            own = s.get("compute_time_s", s.get("step_time_s"))
            if own is not None:
                self.step_times[rank].append((int(s["step"]), float(own)))
            if int(s["step"]) >= self.total_steps:
                self.finished.add(rank)
        window = self.th.straggler_window_steps * (self.th.straggler_windows + 2)
        for times in self.step_times.values():
            if len(times) > window:
                del times[: len(times) - window]

    def reset_training(self) -> None:
        """A new attempt starts: step history and hang timers start over."""
        self.step_times.clear()
        self.last_report.clear()
        self.last_step.clear()
        self.finished.clear()

    def reset_node(self, node_rank: int) -> None:
        """The node was replaced: forget its GPUs."""
        self.gpu.pop(node_rank, None)

    def verdicts(self, now: float) -> list[Verdict]:
        """At most one verdict per node, most severe first in node order (see detectors.evaluate)."""
        return detectors.evaluate(
            {n: list(q) for n, q in self.gpu.items()},
            dict(self.step_times),
            dict(self.last_report),
            dict(self.rank_to_node),
            now,
            self.th,
            finished_ranks=frozenset(self.finished),
            last_steps=dict(self.last_step),
        )
