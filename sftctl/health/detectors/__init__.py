"""Health detectors: pure functions from telemetry and step reports to :class:`Verdict` s.

Nothing here reads files, clocks or devices: the caller passes the recent history (GPU samples
in the format of :mod:`sftctl.health.telemetry`, per-rank step times, the time of each rank's
last report) and ``now``. Every function is deterministic: same input, same verdicts, same
order.

The caller decides how much history to pass. XID and ECC findings are read from *all* samples
given, so after acting on a verdict (restart, replacement) the caller should pass only samples
taken since then, or the same XID is found again.

One module per detector; each declares itself once to :mod:`sftctl.health.registry` (kind,
failure code, order, summary, thresholds, function). This package imports every module it holds
(a new detector is one file here, found by listing the package), then :func:`evaluate` runs
every registered detector.

Detectors and their actions
---------------------------

``gpu_lost``   any sample with ``gpu_is_lost`` -> ``replace`` (:mod:`.gpu_lost`).
``xid``        the action table :data:`XID_ACTIONS` (:mod:`.xid`).
``ecc``        volatile uncorrected (double-bit) ECC count > 0 at first sight or increasing, or
               ``remapped_rows_failure`` -> ``replace``. ``remapped_rows_pending`` alone is no
               fault (the row is remapped at the next GPU reset; NVIDIA: unaffected work
               continues) -> no verdict (:mod:`.ecc`).
``xgmi``       an AMD GPU whose xGMI links report an error (amd-smi ``xgmi_err``) -> ``replace``
               (:mod:`.xgmi`).
``throttle``   a hardware clocks-event reason (HW slowdown, HW thermal, HW power brake) or SW
               thermal slowdown sustained over the trailing window, or an SM clock far below its
               peers' under load for the whole window -> ``replace``. Idle, applications clocks,
               display clocks, sync boost and SW power cap never trigger (SW power cap is the
               normal state of a GPU at its power limit under load) (:mod:`.throttle`).
``hang``       a rank without a step report for ``hang_timeout_s`` -> ``replace`` its node.
``straggler``  a rank slower than the others for ``straggler_windows`` consecutive windows of
               steps -> ``replace`` its node.
``stall``      no rank finished a step for twice ``hang_timeout_s`` while all beat ->
               ``restart`` in place; a hang explains it away.

:func:`evaluate` runs them all and keeps at most one verdict per node.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence

from sftctl.health.detectors.common import ACTION_RANK, trailing_window
# the built-ins in kind order (VerdictKind's members follow the order of registration)
from sftctl.health.detectors.gpu_lost import gpu_lost_verdicts
from sftctl.health.detectors.xid import APP_XIDS, XID_ACTIONS, xid_verdicts
from sftctl.health.detectors.ecc import ecc_verdicts
from sftctl.health.detectors.xgmi import xgmi_verdicts
from sftctl.health.detectors.throttle import (
    THROTTLE_REASONS,
    busy_sm_clock_mhz,
    peers_sm_clock_by_node,
    throttle_verdicts,
)
from sftctl.health.detectors.hang import hang_verdicts
from sftctl.health.detectors.straggler import straggler_verdicts
from sftctl.health.detectors.stall import stall_verdicts
from sftctl.health.registry import History, detectors, kind_order
from sftctl.health.telemetry import Thresholds, Verdict

__all__ = [
    "APP_XIDS", "KIND_ORDER", "THROTTLE_REASONS", "XID_ACTIONS", "busy_sm_clock_mhz", "ecc_verdicts", "evaluate",
    "gpu_lost_verdicts", "hang_verdicts", "peers_sm_clock_by_node", "stall_verdicts", "straggler_verdicts",
    "throttle_verdicts", "trailing_window", "xgmi_verdicts", "xid_verdicts",
]

# every other module of the package registers its detector when imported: one file, nothing else
for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")


def __getattr__(name: str):
    if name == "KIND_ORDER":  # the registry's, as it is now (a detector may register later)
        return kind_order()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _severity(v: Verdict, order: Mapping[str, int]) -> tuple[int, int]:
    return (-ACTION_RANK.get(v.action, 0), order.get(v.kind, len(order)))


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
    """Every registered detector over a job's recent history; at most one verdict per node.

    ``last_steps`` (rank -> (arrival time, step) of its last step report) enables the stall
    detector (:func:`stall_verdicts`). A detector's verdicts are dropped while a verdict of a
    kind that explains it (``explained_by``: a hang explains a stall) is found.

    A node's verdict is its most severe one: ``replace`` over ``restart``, then the kind order
    :data:`KIND_ORDER` (gpu_lost, xid, ecc, xgmi, throttle, hang, straggler, stall, preflight), then the lowest
    GPU. The list is sorted by node rank. The low-clock test compares each node's GPUs with the
    median busy SM clock of the other nodes' GPUs (:func:`peers_sm_clock_by_node`).
    """
    history = History(gpu_samples_by_node, step_times, last_reports, rank_to_node, now,
                      frozenset(finished_ranks), last_steps)
    ranked = detectors()
    by_kind = {d.kind: d.run(history, th) for d in ranked}
    found = [v for d in ranked if not any(by_kind.get(k) for k in d.explained_by) for v in by_kind[d.kind]]
    order = {d.kind: i for i, d in enumerate(ranked)}
    best: dict[int, Verdict] = {}
    for v in found:
        key = (_severity(v, order), v.gpu if v.gpu is not None else -1)
        cur = best.get(v.node_rank)
        if cur is None or key < (_severity(cur, order), cur.gpu if cur.gpu is not None else -1):
            best[v.node_rank] = v
    return [best[n] for n in sorted(best)]
