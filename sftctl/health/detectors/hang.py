"""``hang``: a rank without a step report or heartbeat for ``hang_timeout_s`` -> ``replace`` its
node (failure code ``node_lost``)."""

from __future__ import annotations

from collections.abc import Mapping

from sftctl.health.detectors.common import _fmt_num
from sftctl.health.registry import Detector, History, Threshold, register
from sftctl.health.telemetry import REPLACE, Thresholds, Verdict
from sftctl.types import FailureCode

#: read by the stall detector too
HANG_TIMEOUT = Threshold("hang_timeout_s", 60.0, "s", "no step report from a rank for this long (after its "
                         "first) is a hang; no rank finishing a step for twice this long is a stall",
                         spec_key="hang_timeout_s", gt=0)


def hang_verdicts(
    last_report_ts: Mapping[int, float | tuple[float, int]],
    rank_to_node: Mapping[int, int],
    now: float,
    th: Thresholds,
    finished_ranks: frozenset[int] | set[int] = frozenset(),
) -> list[Verdict]:
    """``replace`` the node of each rank silent for ``th.hang_timeout_s`` or longer.

    Args:
        last_report_ts: per global rank, the ``ts`` of its last step report, or a
            ``(ts, step)`` pair (then the evidence names the last step). Ranks that never
            reported are absent and cannot hang (startup is not watched here).
        rank_to_node: global rank -> node rank; ranks missing from it are ignored.
        now: current time, Unix seconds.
        finished_ranks: ranks that exited normally; they are never hung.

    Several silent ranks on a node give one verdict per rank (:func:`evaluate` keeps one).
    """
    out = []
    for rank in sorted(last_report_ts):
        if rank in finished_ranks or rank not in rank_to_node:
            continue
        value = last_report_ts[rank]
        if isinstance(value, (tuple, list)):
            ts, step = float(value[0]), value[1]
        else:
            ts, step = float(value), None
        silent = now - ts
        if silent >= th.hang_timeout_s:
            last = f", last step {step}" if step is not None else ""
            out.append(Verdict(
                kind="hang", action=REPLACE, node_rank=rank_to_node[rank], gpu=None,
                evidence=(f"rank {rank}: no step report for {silent:.1f} s "
                          f"(timeout {_fmt_num(th.hang_timeout_s)} s){last}"),
                ts=now,
            ))
    return out


def _run(h: History, th: Thresholds) -> list[Verdict]:
    return hang_verdicts(h.last_reports, h.rank_to_node, h.now, th, h.finished_ranks)


DETECTOR = register(Detector(
    kind="hang", code=FailureCode.NODE_LOST, order=50, run=_run, thresholds=(HANG_TIMEOUT,),
    summary="a rank sent no step report or heartbeat for hang_timeout_s: replace its node",
))
