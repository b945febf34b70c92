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
``memory_used_mib``                 ``nvmlDeviceGetMemoryInfo().used`` in MiB (NVML source only)
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
from typing import TYPE_CHECKING

from sftctl.health.registry import Detector, get_detector, on_register, thresholds as registered_thresholds
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
    """What a detector found: one member per registered detector (:mod:`sftctl.health.registry`),
    named after its kind (``VerdictKind.STALL == "stall"``); each kind owns the
    :class:`~sftctl.types.FailureCode` an attempt it ends is recorded with (:attr:`code`). The
    built-in kinds: ``gpu_lost``, ``xid``, ``ecc``, ``xgmi``, ``throttle``, ``hang``, ``straggler``, ``stall``,
    ``preflight_failed``, ``preflight_slow``."""

    @property
    def code(self) -> FailureCode:
        """The failure code of an attempt this verdict ends (its detector's ``code``)."""
        return get_detector(self.value).code


def _add_kind(detector: Detector) -> None:
    """Make ``detector.kind`` a member of :class:`VerdictKind` (the enum grows with the registry)."""
    cls, value, name = VerdictKind, detector.kind, detector.kind.upper()
    if value in cls._value2member_map_:
        return
    member = str.__new__(cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls  # type: ignore[attr-defined]  # what Enum's own members carry
    member._sort_order_ = len(cls._member_names_)  # type: ignore[attr-defined]
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses to touch members
    cls._member_names_.append(name)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member


on_register(_add_kind)


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

    if TYPE_CHECKING:  # what the dataclass's __init__ takes: a member or its word
        def __init__(self, kind: VerdictKind | str, action: Action | str, node_rank: int, gpu: int | None,
                     evidence: str, ts: float) -> None: ...

    def __post_init__(self) -> None:  # words as written ("stall", "restart") become members
        object.__setattr__(self, "kind", VerdictKind(self.kind))
        object.__setattr__(self, "action", Action(self.action))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"kind": self.kind.value, "action": self.action.value}


class Thresholds:
    """Detector settings: one attribute per registered :class:`~sftctl.health.registry.Threshold`
    (its ``name``), its ``default`` unless given; the job spec's ``health`` section sets those
    with a spec key (``sftctl.spec.HealthSpec.thresholds``). Immutable and hashable.

    The built-in ones (see each detector's module under :mod:`sftctl.health.detectors`):
    ``throttle_window_s``, ``throttle_min_fraction``, ``low_clock_ratio``, ``busy_util_pct``
    (throttle), ``straggler_ratio``, ``straggler_window_steps``, ``straggler_windows``
    (straggler), ``hang_timeout_s`` (hang, stall), ``app_xid_repeats`` (xid).

    Raises:
        TypeError: a keyword that names no registered threshold.
    """

    __slots__ = ("_values",)

    def __init__(self, **values: float) -> None:
        known = registered_thresholds()
        for name in values:
            if name not in known:
                raise TypeError(f"Thresholds() got an unexpected keyword argument {name!r}")
        object.__setattr__(self, "_values", {n: values.get(n, t.default) for n, t in known.items()})

    def __getattr__(self, name: str):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            try:  # registered after this instance was made: its default
                return registered_thresholds()[name].default
            except KeyError:
                raise AttributeError(f"'Thresholds' object has no attribute {name!r}") from None

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"cannot assign to field {name!r}: Thresholds are immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, Thresholds) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return f"Thresholds({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def replace(self, **changes: float) -> "Thresholds":
        """A copy with ``changes`` applied."""
        return Thresholds(**(self._values | changes))

    def __reduce__(self):  # pickle and copy through the constructor (attributes cannot be set)
        return (_thresholds, (dict(self._values),))


def _thresholds(values: dict) -> Thresholds:
    return Thresholds(**values)
