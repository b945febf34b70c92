"""``straggler``: a rank slower than the others for ``straggler_windows`` consecutive windows of
steps -> ``replace`` its node (failure code ``straggler``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from sftctl.health.registry import Detector, History, Threshold, register
from sftctl.health.telemetry import REPLACE, Thresholds, Verdict
from sftctl.types import FailureCode


def straggler_verdicts(
    step_times: Mapping[int, Sequence[tuple[int, float]]],
    rank_to_node: Mapping[int, int],
    th: Thresholds,
    *,
    now: float = 0.0,
) -> list[Verdict]:
    """``replace`` the node of a rank that is slow in ``th.straggler_windows`` consecutive windows.

    Args:
        step_times: per global rank, ``(step, step_time_s)`` pairs (any order; a step reported
            twice, e.g. after a restart from a checkpoint, counts with its last value).
        rank_to_node: global rank -> node rank. Ranks missing from it are ignored.
        th: ``straggler_window_steps`` (W), ``straggler_ratio``, ``straggler_windows`` (K).
        now: the verdicts' ``ts`` (step times carry no time).

    Window ``w`` holds steps ``w*W .. w*W+W-1``. A rank has completed window ``w`` once it
    reported a step >= ``w*W+W-1``; the latest complete window ``L`` is the lowest such window
    over all ranks that reported. In window ``w`` a rank is slow when the median of its step
    times there exceeds ``straggler_ratio`` x the median of the *other* ranks' medians (at least
    one other rank must have steps in it). The verdict needs windows ``L-K+1 .. L`` all slow.

    Comparing with the others' median rather than all ranks' (own included) keeps a 2-rank job
    detectable: with its own median included, one rank 1.5x slower than the other would sit at
    only 1.2x the "median" of the two.
    """
    W, K = th.straggler_window_steps, th.straggler_windows
    if W < 1 or K < 1:
        return []
    per_rank: dict[int, dict[int, dict[int, float]]] = {}  # rank -> window -> step -> time
    last_complete: dict[int, int] = {}
    for rank, pairs in step_times.items():
        if rank not in rank_to_node or not pairs:
            continue
        steps: dict[int, float] = {}
        for step, t in pairs:
            if t is None or not math.isfinite(float(t)):
                continue
            steps[int(step)] = float(t)
        if not steps:
            continue
        windows: dict[int, dict[int, float]] = {}
        for step, t in steps.items():
            windows.setdefault(step // W, {})[step] = t
        per_rank[rank] = windows
        last_complete[rank] = (max(steps) + 1) // W - 1
    if len(per_rank) < 2:
        return []
    latest = min(last_complete.values())
    if latest - K + 1 < 0:
        return []
    considered = range(latest - K + 1, latest + 1)
    medians: dict[int, dict[int, float]] = {
        w: {r: statistics.median(ws[w].values()) for r, ws in per_rank.items() if w in ws}
        for w in considered
    }
    out = []
    for rank in sorted(per_rank):
        ratios, mine, theirs = [], [], []
        for w in considered:
            m = medians[w]
            others = [v for r, v in m.items() if r != rank]
            if rank not in m or not others:
                break
            ref = statistics.median(others)
            if not m[rank] > th.straggler_ratio * ref:
                break
            ratios.append(m[rank] / ref if ref > 0 else math.inf)
            mine.append(m[rank])
            theirs.append(ref)
        else:
            out.append(Verdict(
                kind="straggler", action=REPLACE, node_rank=rank_to_node[rank], gpu=None,
                evidence=(f"rank {rank}: median step time {statistics.median(mine):.3g} s vs "
                          f"others' median {statistics.median(theirs):.3g} s "
                          f"(x{min(ratios):.2f}-{max(ratios):.2f} > {th.straggler_ratio:g}) in {K} "
                          f"consecutive windows of {W} steps (steps {considered[0] * W}-"
                          f"{(considered[-1] + 1) * W - 1})"),
                ts=now,
            ))
    return out


def _run(h: History, th: Thresholds) -> list[Verdict]:
    return straggler_verdicts(h.step_times, h.rank_to_node, th, now=h.now)


DETECTOR = register(Detector(
    kind="straggler", code=FailureCode.STRAGGLER, order=60, run=_run,
    summary="a rank's compute time above the other ranks' for several consecutive windows of steps: "
            "replace its node",
    thresholds=(
        Threshold("straggler_ratio", 1.3, "x", "a rank whose median step time exceeds the median of the other "
                  "ranks' medians by this factor in a window is slow in that window",
                  spec_key="straggler_ratio", gt=1),
        Threshold("straggler_window_steps", 10, "steps", "steps per straggler window",
                  spec_key="straggler_window_steps", gt=0, le=10**6),
        Threshold("straggler_windows", 3, "windows", "consecutive slow windows before a straggler verdict",
                  spec_key="straggler_windows", gt=0),
    ),
))
