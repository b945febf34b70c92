"""``preflight_slow`` and ``preflight_failed``: a node's active check (:mod:`sftctl.preflight`)
against the speed sftctl predicted for it -> ``replace`` (failure codes ``preflight_slow``,
``preflight_failed``).

The node writes one record per check into its ``health.jsonl`` (next to the agent's GPU
samples): ``{"ts": ..., "preflight": {...}}`` with the figures below. The same :func:`judge`
runs on the node (which then exits before training, its failure record naming the verdict) and
here, over the records the controller read: both sides agree by construction.

A record's ``preflight`` object (every figure in SI units; optional parts may be absent):

=====================  ======================================================================
key                    meaning
=====================  ======================================================================
``when``               ``start`` (before the first step of an attempt) or ``checkpoint``
``level``              ``quick`` or ``full`` (the spec's ``health.preflight``)
``elapsed_s``          seconds the whole check took on the node
``matmul``             list, one per device: ``gpu`` (index, None for the CPU), ``shape``
                       ``[m, n, k]``, ``dtype``, ``flops`` (2mnk), ``measured_s`` (best of the
                       repetitions), ``predicted_s`` (the compiler's GEMM time for the node's
                       accelerator, or the CPU reference measured on the controller's machine),
                       ``reference`` (``compiler`` or ``cpu``)
``allreduce``          ``nodes``, ``bytes``, ``measured_s``, ``bus_gbps`` (GB/s, nccl-tests'
                       bus bandwidth: 2(n-1)/n x bytes / time), ``predicted_bus_gbps`` or None,
                       ``reference`` (``compiler``, ``cpu``), ``send_gbps`` (list: node r's send
                       of the buffer to node r+1, GB/s, timed by the receiver), ``slow_node``
                       (the node :func:`blame` names, or None)
``dcgm``               ``level`` (1 or 2), ``failed`` (test names and their messages), ``rc``;
                       or ``skipped`` (why: ``dcgmi`` not installed)
``nvml``               ``problems`` (list of lines: a fault, e.g. an NVLink down, a PCIe link
                       narrower than its maximum, ECC mode pending a change) and ``notes``
                       (not faults: persistence mode off)
``errors``             lines: a check that could not run (a CUDA error, a timeout)
=====================  ======================================================================

Verdicts (one per record at most per kind; pure, no clock):

* ``preflight_slow``: a device's ``measured_s`` above ``predicted_s / preflight_min_fraction``
  (its rate below that fraction of the prediction); the evidence names both rates.
* ``preflight_slow`` of the all-reduce: its ``bus_gbps`` below ``preflight_min_fraction`` of
  ``predicted_bus_gbps``, on the node whose sends :func:`blame` names (every node of the
  collective measures the same time; a node's own sends tell which one slows it). A slow
  all-reduce where no node stands out (a slow fabric, a busy machine) is reported, not judged.
* ``preflight_failed``: ``dcgm.failed``, ``nvml.problems`` or ``errors`` not empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sftctl.health.registry import Detector, History, Threshold, register
from sftctl.health.telemetry import REPLACE, Verdict
from sftctl.types import FailureCode

MIN_FRACTION = Threshold(
    "preflight_min_fraction", 0.6, "fraction",
    "a node whose preflight matmul runs below this fraction of its predicted rate is replaced "
    "before training (preflight_slow)", spec_key="preflight_min_fraction", gt=0, le=1)
LONG_JOB_H = Threshold(
    "preflight_long_job_h", 4.0, "h",
    "jobs predicted to run longer get dcgmi diag -r 2 at preflight and a matmul check at every "
    "checkpoint", spec_key="preflight_long_job_h", gt=0)


def _gflops(flops: float, seconds: float) -> str:
    rate = flops / seconds / 1e9
    return f"{rate / 1e3:.1f} TFLOP/s" if rate >= 1e3 else f"{rate:.2f} GFLOP/s"


def latest(samples: Sequence[dict]) -> dict | None:
    """The newest preflight record among one node's samples (by ``ts``), or None."""
    found = [s for s in samples if isinstance(s.get("preflight"), dict)]
    return max(found, key=lambda s: float(s.get("ts", 0.0))) if found else None


def slow(record: Mapping, node_rank: int, min_fraction: float) -> list[Verdict]:
    """``preflight_slow`` verdicts of one record: every device whose matmul ran below
    ``min_fraction`` of its predicted rate (the slowest first)."""
    pre = record.get("preflight") or {}
    out = []
    for mm in pre.get("matmul") or ():
        measured, predicted = mm.get("measured_s"), mm.get("predicted_s")
        if not measured or not predicted or measured <= 0 or predicted <= 0:
            continue
        fraction = predicted / measured
        if fraction >= min_fraction:
            continue
        gpu = mm.get("gpu")
        flops = float(mm.get("flops") or 0.0)
        shape = "x".join(str(x) for x in mm.get("shape") or ())
        what = f"GPU {gpu}" if gpu is not None else "CPU"
        ref = "predicted" if mm.get("reference") == "compiler" else "this machine's reference"
        rates = (f"{_gflops(flops, measured)}, {fraction:.0%} of {ref} {_gflops(flops, predicted)}"
                 if flops else f"{measured * 1e3:.2f} ms vs {ref} {predicted * 1e3:.2f} ms ({fraction:.0%})")
        out.append((fraction, Verdict(
            kind="preflight_slow", action=REPLACE, node_rank=node_rank, gpu=gpu,
            evidence=(f"{pre.get('when', 'start')} check: {what} matmul {shape} {mm.get('dtype', '')} at {rates} "
                      f"(< {min_fraction:g})"),
            ts=float(record.get("ts", 0.0)))))
    return [v for _, v in sorted(out, key=lambda fv: fv[0])]


#: a node is blamed for a slow all-reduce only where its sends ran below this fraction of the
#: other nodes' median: loopback gloo sends of 4 MiB (best of 5) of two healthy local nodes on
#: this repository's busy 2-core machine differed by up to 2.4x (0.41), nodes capped at <= 0.25
#: GB/s sent at <= 0.12 of the other's (benchmarks/preflight.py, results/preflight.json)
STANDS_OUT = 0.25


def blame(send_gbps: Sequence[float] | None, predicted_bus_gbps: float | None, min_fraction: float) -> int | None:
    """The node that slows an all-reduce: the one whose sends (GB/s, one per node) ran below
    ``min_fraction`` of the predicted bus bandwidth and below :data:`STANDS_OUT` of the other
    nodes' median (the slowest such one), else None (no node stands out, or nothing to compare)."""
    import statistics

    sends = list(send_gbps or ())
    if len(sends) < 2 or not predicted_bus_gbps:
        return None
    out = []
    for r, g in enumerate(sends):
        others = statistics.median(sends[:r] + sends[r + 1:])
        if g < min_fraction * predicted_bus_gbps and g < STANDS_OUT * others:
            out.append((g, r))
    return min(out)[1] if out else None


def slow_allreduce(record: Mapping, node_rank: int, min_fraction: float) -> list[Verdict]:
    """The ``preflight_slow`` verdict of a record's all-reduce (at most one), on the node that
    :func:`blame` names: its bus bandwidth below ``min_fraction`` of the predicted one."""
    import statistics

    pre = record.get("preflight") or {}
    ar = pre.get("allreduce") or {}
    bus, predicted, sends = ar.get("bus_gbps"), ar.get("predicted_bus_gbps"), ar.get("send_gbps") or []
    if not bus or not predicted or bus >= min_fraction * predicted:
        return []
    if blame(sends, predicted, min_fraction) != node_rank:
        return []
    others = statistics.median(sends[:node_rank] + sends[node_rank + 1:])
    ref = "predicted" if ar.get("reference") == "compiler" else "this machine's reference"
    return [Verdict(
        kind="preflight_slow", action=REPLACE, node_rank=node_rank, gpu=None,
        evidence=(f"{pre.get('when', 'start')} check: all-reduce over {ar.get('nodes')} nodes at {bus:.3g} GB/s bus, "
                  f"{bus / predicted:.0%} of {ref} {predicted:.3g} GB/s (< {min_fraction:g}); node {node_rank}'s "
                  f"sends {sends[node_rank]:.3g} GB/s, the other nodes' {others:.3g} GB/s"),
        ts=float(record.get("ts", 0.0)))]


def failed(record: Mapping, node_rank: int) -> list[Verdict]:
    """The ``preflight_failed`` verdict of one record (at most one): DCGM's failed tests, NVML's
    problems and the checks that could not run, in that order, in one line."""
    pre = record.get("preflight") or {}
    lines = []
    dcgm = pre.get("dcgm") or {}
    if dcgm.get("failed"):
        lines.append(f"dcgmi diag -r {dcgm.get('level', 1)} failed: " + "; ".join(str(x) for x in dcgm["failed"]))
    lines += [str(p) for p in (pre.get("nvml") or {}).get("problems") or ()]
    lines += [str(e) for e in pre.get("errors") or ()]
    if not lines:
        return []
    return [Verdict(kind="preflight_failed", action=REPLACE, node_rank=node_rank, gpu=None,
                    evidence=f"{pre.get('when', 'start')} check: " + "; ".join(lines),
                    ts=float(record.get("ts", 0.0)))]


def judge(record: Mapping, node_rank: int, min_fraction: float) -> list[Verdict]:
    """Every verdict of one preflight record: ``preflight_failed`` first, then ``preflight_slow``
    (the matmul's, then the all-reduce's)."""
    return failed(record, node_rank) + slow(record, node_rank, min_fraction) + slow_allreduce(
        record, node_rank, min_fraction)


def _newest(h: History) -> dict[int, dict]:
    return {n: r for n in sorted(h.gpu_samples_by_node) if (r := latest(list(h.gpu_samples_by_node[n])))}


def _run_slow(h: History, th) -> list[Verdict]:
    return [v for n, r in _newest(h).items()
            for v in (slow(r, n, th.preflight_min_fraction) + slow_allreduce(r, n, th.preflight_min_fraction))[:1]]


def _run_failed(h: History, th) -> list[Verdict]:
    return [v for n, r in _newest(h).items() for v in failed(r, n)]


FAILED = register(Detector(
    kind="preflight_failed", code=FailureCode.PREFLIGHT_FAILED, order=80, run=_run_failed,
    summary="the node's preflight (dcgmi diag, NVML clocks/ECC/PCIe/NVLink, the checks themselves) found a "
            "fault: replace the node before training",
))
SLOW = register(Detector(
    kind="preflight_slow", code=FailureCode.PREFLIGHT_SLOW, order=85, run=_run_slow,
    summary="the node's preflight matmul, or its share of the all-reduce, ran below "
            "health.preflight_min_fraction of its predicted rate: replace the node before training (at start, "
            "or at a checkpoint of a long job)",
    thresholds=(MIN_FRACTION, LONG_JOB_H),
))
