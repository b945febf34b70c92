"""The vocabulary every layer speaks: what crosses from a provider to the controller, from the
planner to the CLI, from state to ``sftctl.api`` (as TorchX's ``specs/api.py`` does for its
schedulers).

Every type is a frozen dataclass (``import sftctl.types`` costs no pydantic, so ``sftctl status``
and ``import sftctl.api`` stay light). ``to_dict()`` is its JSON serialization, the one the
``--json`` outputs and the state database hold; ``from_dict()`` reads it back and ignores keys it
does not know (a newer sftctl's state stays readable).

- :class:`Offering`: one way to buy nodes (catalog rows, ``sinfo``, the local machine).
- :class:`PlanChoice`: an offering judged for a job (predicted step time, cost, why rejected);
  :class:`Plan` the chosen one, the reason and every choice.
- :class:`NodeHandle`: what a provider needs to find its node again, one subclass per provider.
- :class:`NodeState`, :class:`NodeStatus`: a node as its provider sees it.
- :class:`JobStatus`, :class:`JobRecord`, :class:`NodeRecord`, :class:`Attempt`,
  :class:`Event`: what ``state.db`` keeps.
- :class:`MetricsRecord`: one training metrics sample (``sftctl.train`` writes them).
- :class:`FailureReason`: why something failed or was ruled out, as a code a program switches
  on plus one human line; code never parses the line back.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Record")


class Record:
    """Mixin: JSON serialization of a frozen dataclass (enums as their values, nested records as dicts)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Build from ``to_dict()``'s output; unknown keys are ignored, missing ones take defaults.

        Raises:
            TypeError: a field without a default is missing.
        """
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- reasons


class FailureCode(str, enum.Enum):
    """What kind of failure (or rejection) a :class:`FailureReason` is; programs switch on it."""

    # a run on a node
    EXIT = "exit"  # the script exited non-zero (exit_code in data)
    SIGNAL = "signal"  # killed by a signal (signal number in data)
    OOM = "oom"  # the kernel's OOM killer, or CUDA out of memory
    SECRET_MISSING = "secret_missing"  # a secret the job needs is empty or not set on the node
    DISK_FULL = "disk_full"  # a checkpoint hit no space left / the file-size limit: restarting hits it again
    EXCEPTION = "exception"  # an uncaught exception (torchelastic's error file)
    NODE_LOST = "node_lost"  # the node or its process vanished without an exit code
    PREEMPTED = "preempted"  # spot/preemptible capacity taken back
    # a node's health (sftctl.health verdicts)
    GPU_FAILED = "gpu_failed"  # XID, ECC, fell off the bus
    THROTTLED = "throttled"
    STRAGGLER = "straggler"
    STALLED = "stalled"  # every process alive, no rank finished a step for twice the hang timeout
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
    ``ranking_note`` says when this row's cost interval overlaps the row ranked above it.
    ``spot_loss``: for spot, the expected preemptions and the hours and USD they cost, already in
    ``hours`` and ``total_usd``, with the interruption rate's source.
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
    ranking_note: str | None = None  # the intervals of this row and the one ranked above overlap
    spot_loss: dict | None = None  # spot: the expected preemption cost in hours/total_usd (planner._with_spot_loss)

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
            "ranking_note": self.ranking_note, "spot_loss": self.spot_loss,
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
            "reason": self.reason,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    #: The keys of :meth:`to_dict` that describe the chosen row (besides ``offering``).
    _CHOSEN_KEYS = ("nodes", "usd_per_hour", "step_time_s", "mode", "parallelism", "activation_checkpointing",
                    "total_usd")

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


# ---------------------------------------------------------------------------- nodes


class NodeState(str, enum.Enum):
    """What a node is doing: as its provider sees it (:class:`NodeStatus`), and as state keeps it
    (:attr:`NodeRecord.status`, which adds the controller's own words PROVISIONING, PENDING and
    REPLACED)."""

    READY = "READY"  # provisioned, nothing launched yet
    RUNNING = "RUNNING"  # the bootstrap script runs
    SUCCEEDED = "SUCCEEDED"  # the script exited 0
    FAILED = "FAILED"  # the script exited non-zero
    LOST = "LOST"  # the node or its process vanished without an exit code
    TERMINATED = "TERMINATED"
    PROVISIONING = "PROVISIONING"  # recorded: the provider is creating it
    PENDING = "PENDING"  # recorded: the provider's scheduler still queues it (a Slurm job waiting)
    REPLACED = "REPLACED"  # recorded: replaced after a health verdict (and terminated)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class AttemptStatus(str, enum.Enum):
    """Where an attempt (one launch of the job's script on all its nodes) is."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    ABANDONED = "ABANDONED"  # its controller was gone; ended by sftctl down

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    """A node's state, its script's exit code when it ended, and a human detail line.
    ``pending``: the provider's scheduler still queues it (a Slurm job waiting for resources);
    its state is RUNNING for the controller, which records the node as PENDING."""

    state: NodeState
    exit_code: int | None = None
    detail: str = ""
    pending: bool = False


@dataclasses.dataclass(frozen=True)
class ProviderCapabilities:
    """What a provider offers that the rest of sftctl decides by, declared once per provider on
    its handle class (:func:`capabilities`), instead of comparing provider names.

    Attributes:
        local_admission: its nodes run on this machine: a job waits for its CPUs and memory
            (:mod:`sftctl.queue`), and a dead controller's nodes stop by themselves.
        regional: its offerings live in regions that ``resources.regions`` filters.
        queue_estimate: its scheduler estimates when an allocation starts (the planner asks).
        boots_script: its nodes boot sftctl's bootstrap script (a cloud VM, a pod).
        shares_filesystem: the controller's filesystem is the nodes' (this machine; a Slurm
            cluster driven from its login node, not over SSH).
        needs_job_storage: its nodes reach the controller only through job storage.
    """

    local_admission: bool = False
    regional: bool = True
    queue_estimate: bool = False
    boots_script: bool = True
    shares_filesystem: bool = False
    needs_job_storage: bool = True


@dataclasses.dataclass(frozen=True)
class NodeHandle(Record):
    """What a provider needs to find one node again. The controller stores it in state after
    every provider call (``to_dict()``), so another process (``sftctl down``) rebuilds the
    provider's view from state alone; :meth:`parse` reads it back as the provider's subclass.

    ``attempt`` is the attempt last launched on the node (None before the first launch), ``ip``
    the address the other ranks reach it at, ``launched_at`` Unix seconds of that launch,
    ``terminated`` true once sftctl deleted the node (its provider then reports TERMINATED).
    """

    provider: ClassVar[str] = ""
    capabilities: ClassVar[ProviderCapabilities] = ProviderCapabilities()  # a cloud VM's (AWS, GCP) and a pod's
    job_id: str
    node_id: str
    rank: int
    attempt: int | None = None
    ip: str | None = None
    launched_at: float | None = None
    terminated: bool = False

    def with_(self: T, **changes: Any) -> T:
        """A copy with ``changes`` (handles are immutable)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @staticmethod
    def parse(provider: str, data: dict[str, Any]) -> "NodeHandle":
        """The handle ``data`` (a ``to_dict()``) as ``provider``'s subclass.

        Raises:
            ValueError: unknown provider.
        """
        cls = _HANDLES.get(provider)
        if cls is None:
            raise ValueError(f"unknown provider {provider!r} for a node handle")
        return cls.from_dict(data)

    @staticmethod
    def stored(provider: str, data: dict[str, Any] | None) -> "NodeHandle | None":
        """The handle state keeps for a node (``nodes.handle_json``), or None where the node
        never got one (``{}`` before its provider answered, ``{"terminated": true}`` when it
        was given up before that).

        Raises:
            ValueError: unknown provider.
        """
        if not data or "node_id" not in data:
            return None
        return NodeHandle.parse(provider, data)


@dataclasses.dataclass(frozen=True)
class LocalHandle(NodeHandle):
    """A node on this machine: its directory, and the process running its attempt (``pid`` with
    its start time in clock ticks, so a reused pid is not mistaken for it)."""

    provider: ClassVar[str] = "local"
    capabilities: ClassVar[ProviderCapabilities] = ProviderCapabilities(
        local_admission=True, regional=False, boots_script=False, shares_filesystem=True, needs_job_storage=False)
    dir: str = ""
    pid: int | None = None
    start_ticks: int | None = None
    exit_file: str | None = None


@dataclasses.dataclass(frozen=True)
class CloudHandle(NodeHandle):
    """A VM on AWS (``id`` the instance id, ``region``, ``zone``, security group ``sg``) or GCP
    (``id`` the instance name, ``zone``, ``project``)."""

    provider: ClassVar[str] = "cloud"
    id: str = ""
    region: str | None = None
    zone: str | None = None
    project: str | None = None
    instance_type: str | None = None
    spot: bool = False
    sg: str | None = None


@dataclasses.dataclass(frozen=True)
class AWSHandle(CloudHandle):
    provider: ClassVar[str] = "aws"


@dataclasses.dataclass(frozen=True)
class GCPHandle(CloudHandle):
    provider: ClassVar[str] = "gcp"


@dataclasses.dataclass(frozen=True)
class KubernetesHandle(NodeHandle):
    """A pod (``id`` == ``pod``) with its ConfigMap, headless Service and Secret in ``namespace``
    of kubeconfig context ``context``; ``node_name`` is the machine it was scheduled on."""

    provider: ClassVar[str] = "kubernetes"
    id: str = ""
    pod: str = ""
    configmap: str | None = None
    service: str | None = None
    secret: str | None = None
    namespace: str | None = None
    context: str | None = None
    hostname: str | None = None
    region: str | None = None
    instance_type: str | None = None
    accelerator: str | None = None
    node_name: str | None = None
    pod_ip: str | None = None


@dataclasses.dataclass(frozen=True)
class SlurmHandle(NodeHandle):
    """A rank of a Slurm allocation: the job's directory ``root`` on the cluster's filesystem,
    the node's ``dir`` under it, the allocation's ``slurm_job_id`` once submitted, and the Slurm
    nodes ``exclude``d from it."""

    provider: ClassVar[str] = "slurm"
    capabilities: ClassVar[ProviderCapabilities] = ProviderCapabilities(
        regional=False, queue_estimate=True, boots_script=False, shares_filesystem=True, needs_job_storage=False)
    root: str = ""
    dir: str = ""
    offering: dict[str, Any] | None = None
    exclude: list[str] = dataclasses.field(default_factory=list)
    slurm_job_id: str | None = None


_HANDLES: dict[str, type[NodeHandle]] = {
    c.provider: c for c in (LocalHandle, AWSHandle, GCPHandle, KubernetesHandle, SlurmHandle)
}


# ---------------------------------------------------------------------------- state


class JobStatus(str, enum.Enum):
    """Where a job is in its lifecycle (``sftctl.state.TRANSITIONS`` holds the legal moves)."""

    PENDING = "PENDING"
    PROVISIONING = "PROVISIONING"
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    FAILED_CONTROLLER = "FAILED_CONTROLLER"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.FAILED_CONTROLLER}
)


@dataclasses.dataclass(frozen=True)
class JobRecord(Record):
    """A job as ``state.db`` keeps it. Times are Unix seconds; ``spec`` is the validated spec as
    JSON (``env:`` holds ``${VAR}`` references, never secret values); ``offering`` the one it runs
    on once planned and ``plan`` the planner's whole :class:`Plan` (state keeps ``Plan.to_dict()``:
    offering, nodes, predicted step time, ``reason``, ``candidates``; the ``offering_json`` column);
    ``failure_reason`` the line that ended it; ``pending_reason`` why it still waits (local
    admission control)."""

    id: str
    name: str
    status: JobStatus
    spec: dict[str, Any]
    created_at: float
    updated_at: float
    spec_path: str | None = None
    provider: str | None = None
    offering: Offering | None = None
    controller_pid: int | None = None
    controller_start_ticks: int | None = None
    restarts: int = 0
    failure_reason: str | None = None
    ended_at: float | None = None
    pending_reason: str | None = None
    failure_code: str | None = None  # the FailureCode value of failure_reason
    plan: Plan | None = None
    owner: str | None = None  # the user the job belongs to (the OS user that recorded it, or a server's user)

    def __post_init__(self) -> None:
        if not isinstance(self.status, JobStatus):
            object.__setattr__(self, "status", JobStatus(self.status))
        if isinstance(self.plan, dict):
            object.__setattr__(self, "plan", Plan.from_dict(self.plan) if self.plan.get("offering") else None)
        if self.offering is None and self.plan is not None:
            object.__setattr__(self, "offering", self.plan.offering)
        if isinstance(self.offering, dict):
            object.__setattr__(self, "offering", Offering.from_dict(self.offering))

    @property
    def plan_reason(self) -> str | None:
        """The planner's one line on why this offering (None before planning)."""
        return (self.plan.reason or None) if self.plan is not None else None


@dataclasses.dataclass(frozen=True)
class NodeRecord(Record):
    """One node of a job: its rank, provider, last known status and the provider's handle as
    state keeps it (``handle``: ``NodeHandle.to_dict()``; :attr:`node_handle` reads it back)."""

    id: str
    job_id: str
    rank: int
    provider: str
    status: NodeState
    handle: dict[str, Any]
    created_at: float
    updated_at: float
    ended_at: float | None = None  # when it stopped billing (TERMINATED or REPLACED); Unix seconds

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", NodeState(self.status))

    @property
    def node_handle(self) -> NodeHandle | None:
        """The provider's typed handle, or None when the node never got one."""
        return NodeHandle.stored(self.provider, self.handle)


@dataclasses.dataclass(frozen=True)
class Cost(Record):
    """What a job has cost so far: ``node_hours`` (each node from when it was recorded to when it
    was TERMINATED or REPLACED, or until now while it may still bill) x ``price_per_hour`` (USD
    for one node of the job's offering, its spot price when the job runs on spot; None when the
    catalog has none, and then ``usd`` is None). ``source`` says which price and where it comes
    from (the offering's catalog source, as planned)."""

    usd: float | None
    price_per_hour: float | None
    source: str
    node_hours: float


@dataclasses.dataclass(frozen=True)
class CostTotal(Record):
    """Cost summed over a group of jobs (``by``: ``user``, one row per owner; ``lab``, one row
    named ``lab``) over the period [``since``, ``until``] (Unix seconds; None: open): each node's
    hours inside the period only. ``unpriced_jobs``: jobs with node-hours but no price, left out
    of ``usd``."""

    group: str
    usd: float
    node_hours: float
    jobs: int
    unpriced_jobs: int = 0
    since: float | None = None
    until: float | None = None


@dataclasses.dataclass(frozen=True)
class User(Record):
    """A user of a shared state (a lab's server): ``admin`` sees and stops every job. Their token
    is never a field: state keeps only its hash."""

    name: str
    admin: bool
    created_at: float  # Unix seconds


@dataclasses.dataclass(frozen=True)
class Attempt(Record):
    """One launch of the job's script on all its nodes (1, 2, ...); ``status`` RUNNING while it
    runs, then SUCCEEDED / FAILED / CANCELLED / ABANDONED; ``reason`` why it ended (one line),
    ``reason_code`` that reason's :class:`FailureCode` value (None before schema 3 or unknown)."""

    job_id: str
    number: int
    status: AttemptStatus
    started_at: float
    exit_code: int | None = None
    reason: str | None = None
    ended_at: float | None = None
    reason_code: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", AttemptStatus(self.status))


@dataclasses.dataclass(frozen=True)
class Event(Record):
    """One line of a job's history. ``kind``: status, plan, provision, launch, node, recovery,
    health, ...; ``data`` the structured facts behind ``message``."""

    id: int
    job_id: str
    ts: float
    kind: str
    message: str
    data: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class MetricsRecord(Record):
    """One training metrics sample of one rank, as :func:`sftctl.train.report` writes it (one
    JSON line per step): ``step`` (1-based), ``loss``, ``step_time_s`` (seconds), ``tokens_per_s``,
    ``ts`` (Unix seconds). In state, ``first_step`` / ``first_loss`` are the first sample seen."""

    rank: int
    step: int
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    ts: float | None = None
    job_id: str | None = None
    first_step: int | None = None
    first_loss: float | None = None


def capabilities(provider: str | None) -> ProviderCapabilities:
    """The declared :class:`ProviderCapabilities` of a provider (``None``: ``local``, as a job
    recorded before it had a provider). Raises ValueError for an unknown provider."""
    name = provider or "local"
    if name not in _HANDLES:
        raise ValueError(f"unknown provider {name!r}")
    return _HANDLES[name].capabilities
