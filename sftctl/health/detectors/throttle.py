"""``throttle``: a GPU that slows itself to protect the hardware, or runs far below its peers'
clock under load, for a whole window -> ``replace`` (failure code ``throttled``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

from sftctl.health.detectors.common import _by_gpu, _ts, trailing_window
from sftctl.health.registry import Detector, History, Threshold, register
from sftctl.health.telemetry import HW_REASONS, REPLACE, SW_THERMAL_SLOWDOWN, Thresholds, Verdict, reason_names
from sftctl.types import FailureCode

#: Reasons that count as throttling when sustained.
THROTTLE_REASONS = HW_REASONS | SW_THERMAL_SLOWDOWN

# A throttle window needs at least this many samples, and at least this many must show the
# reason, so one transient sample (or two samples around a sampling gap) never triggers.
_MIN_WINDOW_SAMPLES = 3
_MIN_THROTTLED_SAMPLES = 2


def busy_sm_clock_mhz(samples: Sequence[dict], th: Thresholds) -> float | None:
    """Median SM clock of one GPU's busy samples (utilization >= ``th.busy_util_pct``) in its
    trailing window of ``th.throttle_window_s`` (all samples if history is shorter); None if
    none is busy. ``samples`` are one GPU's, sorted by ``ts``."""
    usable = [s for s in samples if "clock_sm_mhz" in s and "utilization_gpu_pct" in s]
    window = trailing_window(usable, th.throttle_window_s) or usable
    clocks = [float(s["clock_sm_mhz"]) for s in window
              if float(s["utilization_gpu_pct"]) >= th.busy_util_pct]
    return statistics.median(clocks) if clocks else None


def throttle_verdicts(
    samples: Iterable[dict],
    node_rank: int,
    th: Thresholds,
    peers_sm_clock_mhz: float | None = None,
) -> list[Verdict]:
    """``replace`` for GPUs throttled over the trailing ``th.throttle_window_s`` window.

    Per GPU, over the trailing window (see :func:`trailing_window`; it must be covered by
    samples and hold at least 3 of them):

    * a reason of :data:`THROTTLE_REASONS` (HW slowdown, HW thermal, HW power brake, SW thermal)
      in at least ``th.throttle_min_fraction`` of the window's samples (and in at least 2), or
    * with ``peers_sm_clock_mhz`` given: every sample of the window busy (utilization >=
      ``th.busy_util_pct``) with an SM clock below ``th.low_clock_ratio`` x the peers' clock.

    Other reasons (idle, applications clocks, SW power cap, sync boost, display clocks) are
    ignored. Samples without the field in question (e.g. a lost GPU's) are left out of that test.
    """
    out = []
    for gpu, lst in _by_gpu(samples).items():
        verdict = _reasons_verdict(gpu, lst, node_rank, th)
        if verdict is None and peers_sm_clock_mhz:
            verdict = _low_clock_verdict(gpu, lst, node_rank, th, peers_sm_clock_mhz)
        if verdict is not None:
            out.append(verdict)
    return out


def _reasons_verdict(gpu: int, lst: list[dict], node_rank: int, th: Thresholds) -> Verdict | None:
    usable = [s for s in lst if "clocks_event_reasons" in s]
    window = trailing_window(usable, th.throttle_window_s)
    if not window or len(window) < _MIN_WINDOW_SAMPLES:
        return None
    hit = [s for s in window if int(s["clocks_event_reasons"]) & THROTTLE_REASONS]
    needed = max(_MIN_THROTTLED_SAMPLES, math.ceil(th.throttle_min_fraction * len(window) - 1e-9))
    if len(hit) < needed:
        return None
    mask = 0
    for s in hit:
        mask |= int(s["clocks_event_reasons"]) & THROTTLE_REASONS
    span = _ts(window[-1]) - _ts(window[0])
    clocks = [float(s["clock_sm_mhz"]) for s in hit if "clock_sm_mhz" in s]
    max_clocks = [float(s["max_clock_sm_mhz"]) for s in window if "max_clock_sm_mhz" in s]
    clock = ""
    if clocks:
        clock = f", SM clock {statistics.median(clocks):.0f} MHz"
        if max_clocks:
            clock += f" of max {max(max_clocks):.0f}"
    return Verdict(
        kind="throttle", action=REPLACE, node_rank=node_rank, gpu=gpu,
        evidence=(f"GPU {gpu}: {' + '.join(reason_names(mask))} in {len(hit)}/{len(window)} "
                  f"samples over {span:.1f} s{clock}"),
        ts=_ts(window[-1]),
    )


def _low_clock_verdict(
    gpu: int, lst: list[dict], node_rank: int, th: Thresholds, peers: float
) -> Verdict | None:
    usable = [s for s in lst if "clock_sm_mhz" in s and "utilization_gpu_pct" in s]
    window = trailing_window(usable, th.throttle_window_s)
    if not window or len(window) < _MIN_WINDOW_SAMPLES:
        return None
    limit = th.low_clock_ratio * peers
    if not all(float(s["utilization_gpu_pct"]) >= th.busy_util_pct
               and float(s["clock_sm_mhz"]) < limit for s in window):
        return None
    clock = statistics.median(float(s["clock_sm_mhz"]) for s in window)
    util = min(float(s["utilization_gpu_pct"]) for s in window)
    span = _ts(window[-1]) - _ts(window[0])
    return Verdict(
        kind="throttle", action=REPLACE, node_rank=node_rank, gpu=gpu,
        evidence=(f"GPU {gpu}: SM clock {clock:.0f} MHz < {th.low_clock_ratio:g} x peers' median "
                  f"{peers:.0f} MHz in {len(window)}/{len(window)} samples over {span:.1f} s "
                  f"at utilization >= {util:.0f}%"),
        ts=_ts(window[-1]),
    )


def peers_sm_clock_by_node(
    gpu_samples_by_node: Mapping[int, Sequence[dict]], th: Thresholds
) -> dict[int, float | None]:
    """For each node, the median busy SM clock (see :func:`busy_sm_clock_mhz`) of the GPUs on
    the *other* nodes; for a single node, of its own GPUs (a median over several GPUs is not
    moved much by one slow GPU). None where no GPU is busy."""
    per_node: dict[int, list[float]] = {}
    for node, samples in gpu_samples_by_node.items():
        clocks = []
        for lst in _by_gpu(samples).values():
            c = busy_sm_clock_mhz(lst, th)
            if c is not None:
                clocks.append(c)
        per_node[node] = clocks
    out: dict[int, float | None] = {}
    for node in gpu_samples_by_node:
        peers = [c for n, cs in per_node.items() if n != node for c in cs] or per_node[node]
        out[node] = statistics.median(peers) if peers else None
    return out


def _run(h: History, th: Thresholds) -> list[Verdict]:
    peers = peers_sm_clock_by_node(h.gpu_samples_by_node, th)
    return [v for node in sorted(h.gpu_samples_by_node)
            for v in throttle_verdicts(list(h.gpu_samples_by_node[node]), node, th, peers.get(node))]


DETECTOR = register(Detector(
    kind="throttle", code=FailureCode.THROTTLED, order=40, run=_run,
    summary="HW slowdown, HW thermal, HW power brake or SW thermal sustained over the window, or an SM "
            "clock far below its peers' under load: replace the node",
    thresholds=(
        Threshold("throttle_window_s", 10.0, "s", "how long HW slowdown/thermal/power-brake must persist",
                  spec_key="throttle_window_s", gt=0),
        Threshold("throttle_min_fraction", 0.8, "fraction", "share of the window's samples that must show it",
                  spec_key="throttle_min_fraction", gt=0, le=1),
        Threshold("low_clock_ratio", 0.7, "x", "an SM clock below this fraction of its peers' median, under "
                  "load, for the whole window, is throttling too", spec_key="low_clock_ratio", gt=0, lt=1),
        Threshold("busy_util_pct", 50.0, "%", "utilization above which a GPU counts as under load"),
    ),
))
