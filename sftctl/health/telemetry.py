"""Telemetry records and verdicts shared by the agent, the detectors and the controller.

A GPU sample is one JSON object per GPU per sampling tick. Its keys are named after the NVML
calls (nvidia-ml-py) that produce them, so a recorded stream reads like the API:

==================================  ========================================================
key                                 NVML source
==================================  ========================================================
``ts``                              sample time, Unix seconds (agent clock)
``gpu``                             device index (``nvmlDeviceGetHandleByIndex``)
``uuid``                            ``nvmlDeviceGetUUID``
``clocks_event_reasons``            ``nvmlDeviceGetCurrentClocksEventReasons`` (bitmask)
``clock_sm_mhz``                    ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``
``max_clock_sm_mhz``                ``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM)``
``temperature_gpu_c``               ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)``
``power_usage_mw``                  ``nvmlDeviceGetPowerUsage``
``enforced_power_limit_mw``         ``nvmlDeviceGetEnforcedPowerLimit``
``utilization_gpu_pct``             ``nvmlDeviceGetUtilizationRates().gpu``
``ecc_uncorrected_volatile``        ``nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)``
``remapped_rows_pending``           ``nvmlDeviceGetRemappedRows()[2]`` (isPending)
``remapped_rows_failure``           ``nvmlDeviceGetRemappedRows()[3]`` (failureOccurred)
``pcie_replay_counter``             ``nvmlDeviceGetPcieReplayCounter``
``xids``                            XIDs seen since the last sample (``nvmlEventSetWait``,
                                    ``nvmlEventTypeXidCriticalError``, ``eventData``)
``gpu_is_lost``                     a call returned ``NVML_ERROR_GPU_IS_LOST``
==================================  ========================================================

Missing keys mean "not available on this device" (e.g. no ECC on a consumer part). A node
without GPUs writes one ``{"ts": ..., "no_gpu": true}`` record.
"""

from __future__ import annotations

import dataclasses
import enum

from sftctl.types import FailureCode

# nvmlClocksEventReason* bits (nvml.h, "Clocks Event Reasons"; formerly ClocksThrottleReasons)
GPU_IDLE = 0x1
APPLICATIONS_CLOCKS_SETTING = 0x2
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SYNC_BOOST = 0x10
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
DISPLAY_CLOCK_SETTING = 0x100

# reasons that mean the hardware protects itself: a fault when sustained
HW_REASONS = HW_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN
# reasons that slow a GPU on purpose but are not faults by themselves
BENIGN_REASONS = GPU_IDLE | APPLICATIONS_CLOCKS_SETTING | SYNC_BOOST | DISPLAY_CLOCK_SETTING

REASON_NAMES = {
    GPU_IDLE: "idle", APPLICATIONS_CLOCKS_SETTING: "applications clocks", SW_POWER_CAP: "SW power cap",
    HW_SLOWDOWN: "HW slowdown", SYNC_BOOST: "sync boost", SW_THERMAL_SLOWDOWN: "SW thermal",
    HW_THERMAL_SLOWDOWN: "HW thermal", HW_POWER_BRAKE_SLOWDOWN: "HW power brake",
    DISPLAY_CLOCK_SETTING: "display clocks",
}


def reason_names(mask: int) -> list[str]:
    """The names of the bits set in a clocks-event-reasons mask."""
    return [name for bit, name in REASON_NAMES.items() if mask & bit]


class _Word(str, enum.Enum):
    """An enum whose members are their words: ``str()``, f-strings and JSON give the value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Action(_Word):
    """What the controller does about a verdict, mildest first. "reset_gpu" is carried out as a
    node replacement where the provider cannot reset a GPU (no root on the node)."""

    RESTART = "restart"  # relaunch the training processes in place, from the last checkpoint
    REPLACE = "replace"  # terminate the node, provision a new one, relaunch from the last checkpoint


RESTART = Action.RESTART
REPLACE = Action.REPLACE
ACTIONS = tuple(Action)


class VerdictKind(_Word):
    """What a detector found (:mod:`sftctl.health.detectors`); each kind owns the
    :class:`~sftctl.types.FailureCode` an attempt it ends is recorded with (:attr:`code`)."""

    GPU_LOST = "gpu_lost"
    XID = "xid"
    ECC = "ecc"
    THROTTLE = "throttle"
    HANG = "hang"
    STRAGGLER = "straggler"
    STALL = "stall"

    @property
    def code(self) -> FailureCode:
        """The failure code of an attempt this verdict ends."""
        return _VERDICT_CODES[self]


_VERDICT_CODES = {
    VerdictKind.GPU_LOST: FailureCode.GPU_FAILED, VerdictKind.XID: FailureCode.GPU_FAILED,
    VerdictKind.ECC: FailureCode.GPU_FAILED, VerdictKind.THROTTLE: FailureCode.THROTTLED,
    VerdictKind.HANG: FailureCode.NODE_LOST, VerdictKind.STRAGGLER: FailureCode.STRAGGLER,
    VerdictKind.STALL: FailureCode.STALLED,
}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A detector's finding about one node (and GPU, where it applies).

    Attributes:
        kind: a :class:`VerdictKind` (``xid``, ``ecc``, ``gpu_lost``, ``throttle``, ``hang``,
            ``straggler``, ``stall``); its ``code`` is the attempt's failure code.
        action: an :class:`Action` (``restart`` or ``replace``).
        node_rank: the node it concerns.
        gpu: the GPU index on that node, or None for node- or rank-level findings.
        evidence: one line a person can act on, with the numbers that triggered it.
        ts: time of the last sample that contributed, Unix seconds.
    """

    kind: VerdictKind
    action: Action
    node_rank: int
    gpu: int | None
    evidence: str
    ts: float

    def __post_init__(self) -> None:  # words as written ("stall", "restart") become members
        object.__setattr__(self, "kind", VerdictKind(self.kind))
        object.__setattr__(self, "action", Action(self.action))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"kind": self.kind.value, "action": self.action.value}


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Detector settings; the job spec's ``health`` section overrides them.

    Attributes:
        throttle_window_s: how long HW slowdown/thermal/power-brake must persist, seconds.
        throttle_min_fraction: share of the window's samples that must show it.
        low_clock_ratio: an SM clock below this fraction of its peers' median, under load
            (utilization >= ``busy_util_pct``), for the whole window, is throttling too.
        busy_util_pct: utilization above which a GPU counts as under load.
        straggler_ratio: a rank whose median step time exceeds the median of the other ranks'
            medians by this factor in a window of ``straggler_window_steps`` steps is slow in
            that window (see :func:`sftctl.health.detectors.straggler_verdicts`).
        straggler_window_steps: steps per straggler window.
        straggler_windows: consecutive slow windows before a straggler verdict.
        hang_timeout_s: no step report from a rank for this long (after its first) is a hang.
        app_xid_repeats: times an application XID (13, 31, 43, 45) must repeat on one GPU
            before it counts as hardware.
    """

    throttle_window_s: float = 10.0
    throttle_min_fraction: float = 0.8
    low_clock_ratio: float = 0.7
    busy_util_pct: float = 50.0
    straggler_ratio: float = 1.3
    straggler_window_steps: int = 10
    straggler_windows: int = 3
    hang_timeout_s: float = 60.0
    app_xid_repeats: int = 2
