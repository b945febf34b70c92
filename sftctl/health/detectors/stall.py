"""``stall``: every process alive, no rank finished a step for twice ``hang_timeout_s`` ->
``restart`` in place (failure code ``stalled``); a hung rank explains a stall away."""

from __future__ import annotations

from collections.abc import Mapping

from sftctl.health.detectors.hang import HANG_TIMEOUT
from sftctl.health.registry import Detector, History, register
from sftctl.health.telemetry import RESTART, Thresholds, Verdict
from sftctl.types import FailureCode


def stall_verdicts(
    last_steps: Mapping[int, tuple[float, int]],
    rank_to_node: Mapping[int, int],
    now: float,
    th: Thresholds,
    finished_ranks: frozenset[int] | set[int] = frozenset(),
) -> list[Verdict]:
    """The whole job stopped making progress while its processes live: no unfinished rank has
    finished a step for twice ``th.hang_timeout_s`` (``last_steps``: rank -> (arrival time,
    step)). Twice, so that a rank that froze is first caught by its missing heartbeat.

    A hung rank stops its heartbeat too and is caught by :func:`hang_verdicts` (replace its
    node); a stall with every heartbeat alive (a deadlocked collective, a stuck data loader)
    points at no one node, so the verdict is ``restart`` in place, filed under the lowest node.
    """
    pending = {r: v for r, v in last_steps.items() if r not in finished_ranks}
    if not pending:
        return []
    newest_ts, step = max(pending.values())
    idle_s = now - newest_ts
    if idle_s < 2 * th.hang_timeout_s:
        return []
    node = min(rank_to_node.get(r, 0) for r in pending)
    return [Verdict("stall", RESTART, node, None,
                    f"no rank finished a step for {idle_s:.0f} s (last step {step}) while their heartbeats "
                    f"continue: the job is stuck", now)]


def _run(h: History, th: Thresholds) -> list[Verdict]:
    if not h.last_steps:
        return []
    return stall_verdicts(h.last_steps, h.rank_to_node, h.now, th, h.finished_ranks)


DETECTOR = register(Detector(
    kind="stall", code=FailureCode.STALLED, order=70, run=_run, thresholds=(HANG_TIMEOUT,),
    explained_by=("hang",),
    summary="every rank's heartbeat alive but none finished a step for twice hang_timeout_s (a deadlocked "
            "collective, a stuck data loader): restart in place",
))
