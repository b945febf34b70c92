"""Health detectors: pure functions from telemetry and step reports to :class:`Verdict` s.

Nothing here reads files, clocks or devices: the caller passes the recent history (GPU samples
in the format of :mod:`sftctl.health.telemetry`, per-rank step times, the time of each rank's
last report) and ``now``. Every function is deterministic: same input, same verdicts, same
order.

The caller decides how much history to pass. XID and ECC findings are read from *all* samples
given, so after acting on a verdict (restart, replacement) the caller should pass only samples
taken since then, or the same XID is found again.

Detectors and their actions
---------------------------

``gpu_lost``   any sample with ``gpu_is_lost`` -> ``replace``.
``xid``        the action table :data:`XID_ACTIONS` (below).
``ecc``        volatile uncorrected (double-bit) ECC count > 0 at first sight or increasing, or
               ``remapped_rows_failure`` -> ``replace``. ``remapped_rows_pending`` alone is no
               fault (the row is remapped at the next GPU reset; NVIDIA: unaffected work
               continues) -> no verdict.
``throttle``   a hardware clocks-event reason (HW slowdown, HW thermal, HW power brake) or SW
               thermal slowdown sustained over the trailing window, or an SM clock far below its
               peers' under load for the whole window -> ``replace``. Idle, applications clocks,
               display clocks, sync boost and SW power cap never trigger (SW power cap is the
               normal state of a GPU at its power limit under load).
``hang``       a rank without a step report for ``hang_timeout_s`` -> ``replace`` its node.
``straggler``  a rank slower than the others for ``straggler_windows`` consecutive windows of
               steps -> ``replace`` its node.

:func:`evaluate` runs them all and keeps at most one verdict per node.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

from sftctl.health.telemetry import (
    HW_REASONS,
    REPLACE,
    RESTART,
    SW_THERMAL_SLOWDOWN,
    Thresholds,
    Verdict,
    reason_names,
)

# ---------------------------------------------------------------------------------------------
# XID action table
#
# From NVIDIA's "XID Errors" documentation (r555, https://docs.nvidia.com/deploy/xid-errors/,
# "Analyzing Xid Errors with the Xid Catalog": resolution buckets RESTART_APP / RESET_GPU /
# CONTACT_SUPPORT ...). Mapping used here: RESTART_APP -> ``restart``; anything that needs a GPU
# reset, a reboot or hardware service -> ``replace`` (sftctl has no root on the node to reset a
# GPU, so a reset is done as a node replacement); informational events -> no verdict.
# Application XIDs (usually a bug or bad input in the program, not the GPU) restart, unless the
# same XID repeats ``Thresholds.app_xid_repeats`` times on one GPU: then the GPU is suspect.
# ---------------------------------------------------------------------------------------------

#: XIDs caused by the application in the common case.
APP_XIDS = frozenset({13, 31, 43, 45})

#: XID -> (action or None for "informational, no verdict", short description)
XID_ACTIONS: dict[int, tuple[str | None, str]] = {
    13: (RESTART, "graphics engine exception"),
    31: (RESTART, "GPU memory page fault"),
    43: (RESTART, "GPU stopped processing"),
    45: (RESTART, "preemptive cleanup, due to previous errors"),
    48: (REPLACE, "double-bit ECC error"),
    61: (REPLACE, "internal micro-controller breakpoint/warning"),
    62: (REPLACE, "internal micro-controller halt"),
    63: (None, "ECC page retirement or row remapping recording event"),
    64: (REPLACE, "ECC page retirement or row remapping recording failure"),
    74: (REPLACE, "NVLink error"),
    79: (REPLACE, "GPU has fallen off the bus"),
    92: (REPLACE, "high single-bit ECC error rate"),
    94: (RESTART, "contained ECC error"),
    95: (REPLACE, "uncontained ECC error"),
    119: (REPLACE, "GSP RPC timeout"),
    120: (REPLACE, "GSP error"),
}

#: Reasons that count as throttling when sustained.
THROTTLE_REASONS = HW_REASONS | SW_THERMAL_SLOWDOWN

#: Verdict kinds in tie-break order (earlier wins among verdicts with the same action).
KIND_ORDER = ("gpu_lost", "xid", "ecc", "throttle", "hang", "straggler", "stall")

_ACTION_RANK = {RESTART: 0, REPLACE: 1}

# A throttle window needs at least this many samples, and at least this many must show the
# reason, so one transient sample (or two samples around a sampling gap) never triggers.
_MIN_WINDOW_SAMPLES = 3
_MIN_THROTTLED_SAMPLES = 2


# ---------------------------------------------------------------------------------------------
# helpers


def _by_gpu(samples: Iterable[dict]) -> dict[int, list[dict]]:
    """Samples grouped by GPU index, each list sorted by ``ts`` (stable). Skips node records."""
    out: dict[int, list[dict]] = {}
    for s in samples:
        gpu = s.get("gpu")
        if gpu is None:
            continue
        out.setdefault(int(gpu), []).append(s)
    for lst in out.values():
        lst.sort(key=lambda s: float(s.get("ts", 0.0)))
    return dict(sorted(out.items()))


def _ts(sample: dict) -> float:
    return float(sample.get("ts", 0.0))


def trailing_window(samples: Sequence[dict], window_s: float) -> list[dict] | None:
    """The samples of the trailing window of ``window_s`` seconds, or None if history is short.

    ``samples`` must be sorted by ``ts``. The window ends at the last sample and starts at the
    latest sample taken at or before ``last ts - window_s``, so it always spans at least
    ``window_s`` (sampling jitter only lengthens it slightly). None when no sample is that old,
    i.e. the history does not cover a whole window yet, or when that sample is more than
    ``window_s`` older still (a sampling gap longer than the window: the samples after it do
    not cover the window).
    """
    if not samples:
        return None
    cutoff = _ts(samples[-1]) - window_s
    start = None
    for i in range(len(samples) - 1, -1, -1):
        if _ts(samples[i]) <= cutoff:
            start = i
            break
    if start is None or _ts(samples[start]) < cutoff - window_s:
        return None
    return list(samples[start:])


def _fmt_num(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


# ---------------------------------------------------------------------------------------------
# GPU detectors


def gpu_lost_verdicts(samples: Iterable[dict], node_rank: int, th: Thresholds) -> list[Verdict]:
    """``replace`` for every GPU with a ``gpu_is_lost`` sample (first such sample is the evidence)."""
    del th  # no settings: a lost GPU is acted on at once
    out = []
    for gpu, lst in _by_gpu(samples).items():
        lost = [s for s in lst if s.get("gpu_is_lost")]
        if lost:
            out.append(Verdict(
                kind="gpu_lost", action=REPLACE, node_rank=node_rank, gpu=gpu,
                evidence=(f"GPU {gpu}: NVML reports the GPU is lost (NVML_ERROR_GPU_IS_LOST) in "
                          f"{len(lost)}/{len(lst)} samples, first at ts {_ts(lost[0]):.1f}"),
                ts=_ts(lost[-1]),
            ))
    return out


def xid_verdicts(samples: Iterable[dict], node_rank: int, th: Thresholds) -> list[Verdict]:
    """One verdict per GPU that reported XIDs needing action; see :data:`XID_ACTIONS`.

    Each sample's ``xids`` lists the XIDs seen since the previous sample, so occurrences are
    counted over all samples given. An application XID (:data:`APP_XIDS`) seen
    ``th.app_xid_repeats`` times or more on one GPU (the same code) is ``replace``; fewer is
    ``restart``. Unknown XIDs are ``restart`` and say so. Informational XIDs (63) alone give no
    verdict. The GPU's verdict is the one of its most severe XID; the evidence lists the others.
    """
    out = []
    for gpu, lst in _by_gpu(samples).items():
        counts: dict[int, int] = {}
        last_ts: dict[int, float] = {}
        for s in lst:
            for x in s.get("xids") or ():
                x = int(x)
                counts[x] = counts.get(x, 0) + 1
                last_ts[x] = _ts(s)
        findings = []  # (action rank, -first-seen order, xid, action, text)
        for order, (xid, n) in enumerate(counts.items()):
            action, desc = XID_ACTIONS.get(xid, (RESTART, None))
            if action is None:
                continue
            if desc is None:
                text = f"XID {xid} seen {n}x, unknown to the action table (restart by default)"
            elif xid in APP_XIDS:
                if n >= th.app_xid_repeats:
                    action = REPLACE
                    text = (f"application XID {xid} ({desc}) seen {n}x on this GPU "
                            f"(>= {th.app_xid_repeats}: treated as a GPU fault)")
                else:
                    text = f"application XID {xid} ({desc}) seen {n}x"
            else:
                text = f"XID {xid} ({desc}) seen {n}x"
            findings.append((_ACTION_RANK[action], -order, xid, action, text))
        if not findings:
            continue
        findings.sort(reverse=True)
        _, _, xid, action, text = findings[0]
        others = sorted((f[2], counts[f[2]]) for f in findings[1:])
        info = sorted((x, n) for x, n in counts.items() if XID_ACTIONS.get(x, (RESTART,))[0] is None)
        extra = ", ".join(f"XID {x} x{n}" for x, n in others + info)
        evidence = f"GPU {gpu}: {text}" + (f"; also {extra}" if extra else "")
        out.append(Verdict(kind="xid", action=action, node_rank=node_rank, gpu=gpu,
                           evidence=evidence, ts=last_ts[xid]))
    return out


def ecc_verdicts(samples: Iterable[dict], node_rank: int, th: Thresholds) -> list[Verdict]:
    """``replace`` for a GPU whose volatile uncorrected ECC count is > 0 at first sight or grows,
    or that reports ``remapped_rows_failure``. A pending row remap alone gives no verdict."""
    del th
    out = []
    for gpu, lst in _by_gpu(samples).items():
        reason = None
        ts = 0.0
        first = prev = None
        first_ts = 0.0
        for s in lst:
            if "ecc_uncorrected_volatile" not in s:
                continue
            value = int(s["ecc_uncorrected_volatile"])
            if prev is None:
                first, first_ts = value, _ts(s)
            if (prev is None and value > 0) or (prev is not None and value > prev):
                ts = _ts(s)
                if prev is None:
                    reason = f"volatile uncorrected ECC errors {value} at first sample"
                else:
                    reason = (f"volatile uncorrected ECC errors {first} -> {value} over "
                              f"{ts - first_ts:.1f} s")
            prev = value
        failed = [s for s in lst if s.get("remapped_rows_failure")]
        if failed:
            text = "row remapping failure reported (remapped_rows_failure)"
            reason = f"{reason}; {text}" if reason else text
            ts = max(ts, _ts(failed[-1]))
        if reason:
            out.append(Verdict(kind="ecc", action=REPLACE, node_rank=node_rank, gpu=gpu,
                               evidence=f"GPU {gpu}: {reason}", ts=ts))
    return out


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


# ---------------------------------------------------------------------------------------------
# training detectors


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


# ---------------------------------------------------------------------------------------------
# all together


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


def _severity(v: Verdict) -> tuple[int, int]:
    kind = KIND_ORDER.index(v.kind) if v.kind in KIND_ORDER else len(KIND_ORDER)
    return (-_ACTION_RANK.get(v.action, 0), kind)


def evaluate(
    gpu_samples_by_node: Mapping[int, Sequence[dict]],
    step_times: Mapping[int, Sequence[tuple[int, float]]],
    last_reports: Mapping[int, float | tuple[float, int]],
    rank_to_node: Mapping[int, int],
    now: float,
    th: Thresholds,
    finished_ranks: frozenset[int] | set[int] = frozenset(),
    last_steps: Mapping[int, tuple[float, int]] | None = None,
) -> list[Verdict]:
    """All detectors over a job's recent history; at most one verdict per node.

    ``last_steps`` (rank -> (arrival time, step) of its last step report) enables the stall
    detector (:func:`stall_verdicts`).

    A node's verdict is its most severe one: ``replace`` over ``restart``, then the kind order
    :data:`KIND_ORDER` (gpu_lost, xid, ecc, throttle, hang, straggler), then the lowest GPU.
    The list is sorted by node rank. The low-clock test compares each node's GPUs with the
    median busy SM clock of the other nodes' GPUs (:func:`peers_sm_clock_by_node`).
    """
    found: list[Verdict] = []
    peers = peers_sm_clock_by_node(gpu_samples_by_node, th)
    for node in sorted(gpu_samples_by_node):
        samples = list(gpu_samples_by_node[node])
        found += gpu_lost_verdicts(samples, node, th)
        found += xid_verdicts(samples, node, th)
        found += ecc_verdicts(samples, node, th)
        found += throttle_verdicts(samples, node, th, peers.get(node))
    found += hang_verdicts(last_reports, rank_to_node, now, th, finished_ranks)
    found += straggler_verdicts(step_times, rank_to_node, th, now=now)
    if last_steps and not any(v.kind == "hang" for v in found):  # a hung rank explains the stall
        found += stall_verdicts(last_steps, rank_to_node, now, th, finished_ranks)
    best: dict[int, Verdict] = {}
    for v in found:
        key = (_severity(v), v.gpu if v.gpu is not None else -1)
        cur = best.get(v.node_rank)
        if cur is None or key < (_severity(cur), cur.gpu if cur.gpu is not None else -1):
            best[v.node_rank] = v
    return [best[n] for n in sorted(best)]
