"""Reasons and plans: :class:`FailureCode`, :class:`FailureReason`, :class:`Offering`,
:class:`PlanChoice`, :class:`Plan`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from sftctl.types.record import Record


class FailureCode(str, enum.Enum):
    """What kind of failure (or rejection) a :class:`FailureReason` is; programs switch on it."""

    # a run on a node
    EXIT = "exit"  # the script exited non-zero (exit_code in data)
    SIGNAL = "signal"  # killed by a signal (signal number in data)
    OOM = "oom"  # the kernel's OOM killer, or CUDA out of memory
    SECRET_MISSING = "secret_missing"  # a secret the job needs is empty or not set on the node
    WORKDIR_MISSING = "workdir_missing"  # the node never found the job's workdir bundle in job storage
    DISK_FULL = "disk_full"  # a checkpoint hit no space left / the file-size limit: restarting hits it again
    EXCEPTION = "exception"  # an uncaught exception (torchelastic's error file)
    NODE_LOST = "node_lost"  # the node or its process vanished without an exit code
    PREEMPTED = "preempted"  # spot/preemptible capacity taken back
    # a node's health (sftctl.health verdicts)
    GPU_FAILED = "gpu_failed"  # XID, ECC, fell off the bus
    THROTTLED = "throttled"
    STRAGGLER = "straggler"
    STALLED = "stalled"  # every process alive, no rank finished a step for twice the hang timeout
    PREFLIGHT_SLOW = "preflight_slow"  # a node's matmul below a fraction of its predicted rate (sftctl.preflight)
    PREFLIGHT_FAILED = "preflight_failed"  # a node's preflight check failed: dcgmi diag, NVML state, an error
    # provisioning and planning
    NO_CAPACITY = "no_capacity"  # the provider had no capacity or quota
    NOT_CONFIGURED = "not_configured"  # no credentials / SDK / cluster for this provider
    NOT_SOLD = "not_sold"  # the catalog has no such offering (or no spot price)
    DOES_NOT_FIT = "does_not_fit"  # the step does not fit the accelerator's memory
    TOO_SLOW = "too_slow"  # misses the spec's deadline
    OVER_BUDGET = "over_budget"  # above the spec's max price per hour
    EXCLUDED = "excluded"  # the spec's resources leave it out (clouds, regions)
    UNSUPPORTED = "unsupported"  # the accelerator cannot run the job as specified
    PROVIDER_ERROR = "provider_error"
    # the job as a whole
    CANCELLED = "cancelled"
    CONTROLLER_DIED = "controller_died"
    RETRIES_EXHAUSTED = "retries_exhausted"
    REPLANNED = "replanned"  # stopped at a checkpoint to move to a cheaper offering (resources.replan: migrate)
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class FailureReason(Record):
    """Why something failed or was ruled out: ``code`` for programs, ``message`` (one line) for
    people, ``data`` for the numbers behind it (exit code, signal, GiB needed ...)."""

    code: FailureCode
    message: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.code, FailureCode):
            object.__setattr__(self, "code", FailureCode(self.code))

    def __str__(self) -> str:
        return self.message


# ---------------------------------------------------------------------------- offerings and plans


@dataclasses.dataclass(frozen=True)
class Offering(Record):
    """One way to buy nodes: ``count`` x ``accelerator`` per node of ``instance_type``.

    ``usd_per_hour`` is the on-demand price of one node; ``spot_usd_per_hour`` the spot price or
    None where the catalog has none. ``source`` says where the price comes from, ``as_of`` when it
    was read (ISO 8601, possibly just year or year-month).
    ``intra_node_bytes_per_s``: unidirectional bytes/s per accelerator to the other accelerators of
    the node (None for single-accelerator nodes or where unknown). ``inter_node_bytes_per_s``:
    unidirectional bytes/s per node to other nodes (None where unknown or not applicable).
    ``bandwidth_source`` says where both bandwidths come from. ``zone``: the availability zone
    the spot price is from (the region's cheapest; empty where the source has none).
    ``spot_zones``: ``(zone, spot USD per hour per node)`` of every zone with a spot price, as a
    refreshed catalog knows them (cheapest first; empty where the source gave only the region's).
    """

    provider: str
    instance_type: str
    accelerator: str
    count: int
    region: str
    usd_per_hour: float
    spot_usd_per_hour: float | None = None
    vcpus: int | None = None
    memory_gib: float | None = None
    source: str = ""
    intra_node_bytes_per_s: float | None = None
    inter_node_bytes_per_s: float | None = None
    as_of: str = ""
    bandwidth_source: str = ""
    zone: str = ""
    spot_zones: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        # to_dict() writes pairs as lists (JSON); a stored plan's Offering(**dict) reads them back
        pairs = self.spot_zones.items() if isinstance(self.spot_zones, dict) else self.spot_zones
        object.__setattr__(self, "spot_zones", tuple((str(z), float(p)) for z, p in pairs))

    def price(self, spot: bool) -> float | None:
        """USD per hour per node, or None when the offering has no spot price and spot is asked."""
        return self.spot_usd_per_hour if spot else self.usd_per_hour


@dataclasses.dataclass(frozen=True)
class PlanChoice(Record):
    """One offering judged for a job (the planner's row).

    ``usd_per_hour`` is for all ``nodes`` (None: no spot price). ``step_time_s`` (seconds),
    ``peak_memory_bytes``, ``total_usd`` and ``hours`` are the compiler's predictions (None
    without a model). ``rejected`` says why it cannot be used (None: feasible); its ``code``
    is what programs switch on. ``queue_wait_s``: Slurm's estimate of the wait before the start.
    ``mode``: the execution mode ``step_time_s`` is predicted for; ``parallelism`` ("ddp" |
    "fsdp") and ``activation_checkpointing`` the strategy chosen for this offering, with its
    memory arithmetic in ``parallelism_reason`` and every strategy priced in ``strategies``.
    ``calibration``: what the prediction rests on and its error factor
    (:mod:`sftctl.compiler.accuracy`); ``step_time_interval_s`` the step time's interval from it;
    ``ranking_note`` (the top row only) says when the pick's cost interval overlaps the runner-up's;
    ``close_call`` gives the same comparison as data (:func:`sftctl.planner._ranking_notes`).
    ``spot_loss``: for spot, the expected preemptions and the hours and USD they cost, already in
    ``hours`` and ``total_usd``, with the interruption rate's source.
    ``features``: the predicted step's kernel-time mix (:func:`sftctl.history.kernel_mix`);
    ``calibrated_step_s``: ``step_time_s`` corrected by the run history (:mod:`sftctl.history`),
    which ``hours``, ``total_usd``, the ranking and ``step_time_interval_s`` then use; ``learned``
    its evidence (``runs``, ``weight``, ``correction``, ``sources``, ``error``, ``prior_error``).
    """

    offering: Offering
    nodes: int
    usd_per_hour: float | None
    step_time_s: float | None = None
    peak_memory_bytes: int | None = None
    devices_needed: int | None = None
    total_usd: float | None = None
    hours: float | None = None
    rejected: FailureReason | None = None
    queue_wait_s: float | None = None
    queue_detail: str | None = None
    mode: str | None = None
    note: str | None = None  # what a person should know about this prediction (precision ...)
    parallelism: str | None = None
    activation_checkpointing: bool | None = None
    parallelism_reason: str | None = None
    strategies: list | None = None  # sharding.StrategyPrediction.to_dict() each
    calibration: dict | None = None  # {"calibrated", "sources", "error"}: compiler.accuracy
    step_time_interval_s: list | None = None  # [low, high]: step_time_s / and x the error factor
    ranking_note: str | None = None  # the pick's interval overlaps the runner-up's (top row only)
    #: the pick against the runner-up (top row only): within_error, runner_up, margin, $/step, $/1M tokens
    close_call: dict | None = None
    spot_loss: dict | None = None  # spot: the expected preemption cost in hours/total_usd (planner._with_spot_loss)
    features: dict | None = None  # the step's kernel-time mix (attention, gemm, pointwise, collectives shares)
    calibrated_step_s: float | None = None  # step_time_s corrected by the run history (sftctl.history.calibrate)
    learned: dict | None = None  # that correction's evidence: runs, weight, correction, sources, error
    layout: dict | None = None  # the parallel layout (compiler.layouts.offering.layout_doc): label, each degree

    @property
    def finish_s(self) -> float | None:
        """Seconds from now to the predicted end: the queue wait plus the run (None without a model)."""
        if self.hours is None:
            return None
        return (self.queue_wait_s or 0.0) + self.hours * 3600

    def to_dict(self) -> dict[str, Any]:
        """The row of ``sftctl plan --json``'s ``candidates`` (and of the plan kept in state):
        ``rejected`` is the human line, ``rejected_code`` its :class:`FailureCode` value."""
        o = self.offering
        return {
            "provider": o.provider, "instance_type": o.instance_type,
            "accelerator": f"{o.accelerator}:{o.count}", "region": o.region, "nodes": self.nodes,
            "usd_per_hour": self.usd_per_hour, "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.peak_memory_bytes, "devices_needed": self.devices_needed,
            "total_usd": self.total_usd, "hours": self.hours,
            "rejected": None if self.rejected is None else self.rejected.message,
            "rejected_code": None if self.rejected is None else self.rejected.code.value,
            "queue_wait_s": self.queue_wait_s, "finish_s": self.finish_s,
            "mode": self.mode, "note": self.note, "parallelism": self.parallelism,
            "activation_checkpointing": self.activation_checkpointing,
            "parallelism_reason": self.parallelism_reason, "strategies": self.strategies,
            "calibration": self.calibration, "step_time_interval_s": self.step_time_interval_s,
            "ranking_note": self.ranking_note, "close_call": self.close_call, "spot_loss": self.spot_loss,
            "features": self.features, "calibrated_step_s": self.calibrated_step_s, "learned": self.learned,
            "layout": self.layout,
            "offering": o.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlanChoice":
        """Read :meth:`to_dict`'s row back (a plan written before ``rejected_code`` reads its
        rejection as code ``unknown``)."""
        rejected = data.get("rejected")
        reason = None if rejected is None else FailureReason(data.get("rejected_code") or FailureCode.UNKNOWN, rejected)
        names = {f.name for f in dataclasses.fields(cls)} - {"offering", "rejected"}
        return cls(offering=Offering.from_dict(data["offering"]), rejected=reason,
                   **{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Plan(Record):
    """The chosen :class:`PlanChoice`, the reason in one line, and every choice, best first."""

    chosen: PlanChoice
    reason: str
    candidates: list[PlanChoice]

    @property
    def offering(self) -> Offering:
        return self.chosen.offering

    def to_dict(self) -> dict[str, Any]:
        """``sftctl run``'s plan as state keeps it (``jobs.offering_json``): the chosen offering
        and strategy at the top, every choice under ``candidates``."""
        return {
            "offering": self.chosen.offering.to_dict(),
            "nodes": self.chosen.nodes,
            "usd_per_hour": self.chosen.usd_per_hour,
            "step_time_s": self.chosen.step_time_s,
            "mode": self.chosen.mode,
            "parallelism": self.chosen.parallelism,
            "activation_checkpointing": self.chosen.activation_checkpointing,
            "total_usd": self.chosen.total_usd,
            "close_call": self.chosen.close_call,
            "reason": self.reason,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    #: The keys of :meth:`to_dict` that describe the chosen row (besides ``offering``).
    _CHOSEN_KEYS = ("nodes", "usd_per_hour", "step_time_s", "mode", "parallelism", "activation_checkpointing",
                    "total_usd", "close_call")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Read :meth:`to_dict`'s document (``jobs.offering_json``) back: ``Plan.from_dict(p.to_dict())
        .to_dict() == p.to_dict()``. The chosen row is the feasible candidate on the document's
        ``offering`` (its other fields from the document's top level, which win), else one built from
        the top level alone; a document missing keys (a plan kept before they existed) reads them as
        None (``reason``: "")."""
        candidates = [PlanChoice.from_dict(c) for c in data.get("candidates") or []]
        offering = Offering.from_dict(data["offering"])
        top = {k: data.get(k) for k in cls._CHOSEN_KEYS}
        match = next((c for c in candidates if c.rejected is None and c.offering == offering), None)
        chosen = (dataclasses.replace(match, **top) if match is not None
                  else PlanChoice(offering=offering, **top))
        return cls(chosen=chosen, reason=data.get("reason") or "", candidates=candidates)

    def with_offering(self, offering: Offering) -> "Plan":
        """This plan moved to ``offering`` (a failover down the candidates): the chosen row keeps
        its other fields, so ``to_dict()`` is the old document with ``offering`` replaced."""
        return dataclasses.replace(self, chosen=dataclasses.replace(self.chosen, offering=offering))

    def planned(self, key: str) -> Any:
        """The plan's choice ``key`` (``parallelism``, ``activation_checkpointing``) for the
        offering the job runs on: after a failover that candidate's own choice, else the chosen
        row's (None: no model, or a plan made before strategies)."""
        for c in self.candidates:
            if c.rejected is None and c.offering == self.offering:
                return getattr(c, key)
        return getattr(self.chosen, key)
