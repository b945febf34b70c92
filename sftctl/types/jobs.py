"""What the state keeps: :class:`JobStatus`, :class:`JobRecord`, :class:`NodeRecord`, costs, users,
the audit, secrets, attempts, events, metrics, steps, GPU points and the run history."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from sftctl.types.nodes import AttemptStatus, NodeHandle, NodeState
from sftctl.types.plans import Offering, Plan
from sftctl.types.record import Record


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
    admission control, a scheduler's queue; None once it ended)."""

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
    # where its secrets' values come from: "store" (submitted through a server: its owner's and the
    # lab's secrets in the state, sftctl.vault), None (this machine: the state's, else the environment)
    secrets_from: str | None = None

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
    expires_at: float | None = None  # Unix seconds; None: the token never expires

    def expired(self, now: float | None = None) -> bool:
        """Whether the user's token expired (at ``now``, Unix seconds; default: now)."""
        import time

        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at


@dataclasses.dataclass(frozen=True)
class AuditEvent(Record):
    """One admin action, recorded in the state: ``actor`` (a user's name; ``NAME (local)`` for one
    on the server's own machine), ``action`` (``user.add``, ``user.remove``, ``token.rotate``,
    ``down``, ``orphans``), ``target`` (a user or a job), ``detail`` (one line)."""

    id: int
    ts: float  # Unix seconds
    actor: str
    action: str
    target: str | None = None
    detail: str | None = None


@dataclasses.dataclass(frozen=True)
class Secret(Record):
    """A stored secret's name and where it belongs, never its value (:mod:`sftctl.vault`):
    ``scope`` ``user`` (``owner``'s own) or ``lab`` (an admin's, for every user's jobs);
    ``shadowed``: a lab secret the user's own of the same name replaces in their jobs. Times are
    Unix seconds."""

    name: str
    scope: str
    owner: str | None
    created_at: float
    updated_at: float
    shadowed: bool = False


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


@dataclasses.dataclass(frozen=True)
class StepRecord(Record):
    """One reported step of one rank as the state's step series keeps it (``metric_steps``):
    ``step_time_s`` in seconds, ``lr`` the learning rate and ``checkpoint`` whether the step wrote
    a checkpoint, each None where the report did not say; ``ts`` Unix seconds."""

    rank: int
    step: int
    ts: float
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    lr: float | None = None
    checkpoint: bool | None = None


#: the GPU measures the state's GPU series keeps (:class:`GpuPoint`), each as ``<name>_min`` and
#: ``<name>_max``: utilisation %, memory used MiB, temperature C, SM clock MHz, power W
GPU_MEASURES = ("util_pct", "memory_mib", "temp_c", "sm_clock_mhz", "power_w")


@dataclasses.dataclass(frozen=True)
class GpuPoint(Record):
    """One point of a node's GPU series as the state keeps it (``gpu_samples``; issue 36): one
    agent sample (``span_s`` 0: each ``_min`` equals its ``_max``) or, as it ages, the min and max
    of a bucket of ``span_s`` seconds from ``ts`` (Unix seconds) holding ``n`` samples.
    ``xids``: XID errors seen in it (a count); ``ecc``: the largest uncorrected volatile ECC
    counter. A measure the agent did not report is None."""

    node_rank: int
    gpu: int
    ts: float
    span_s: float = 0.0
    n: int = 1
    util_pct_min: float | None = None
    util_pct_max: float | None = None
    memory_mib_min: float | None = None
    memory_mib_max: float | None = None
    temp_c_min: float | None = None
    temp_c_max: float | None = None
    sm_clock_mhz_min: float | None = None
    sm_clock_mhz_max: float | None = None
    power_w_min: float | None = None
    power_w_max: float | None = None
    xids: int = 0
    ecc: int | None = None


@dataclasses.dataclass(frozen=True)
class RunRecord(Record):
    """One row of the run history predictions learn from (:mod:`sftctl.history`): a measured job
    of this lab (``source`` ``run``, its ``job_id``) or an imported measurement (``imported``,
    ``source_label`` its label). ``predicted_step_s`` is the model's step (seconds, before any
    correction) with its interval ``interval_low_s``..``interval_high_s``, ``measured_step_s``
    the median step after warm-up over ``measured_steps`` reports; ``count`` = ``gpus_per_node``
    x ``nodes``; ``strategy`` ``ddp``/``fsdp`` (``+ckpt``); ``features`` the step's kernel-time
    mix (``attention``, ``gemm``, ``pointwise``, ``collectives`` shares); ``ts`` Unix seconds."""

    accelerator: str
    gpus_per_node: int
    nodes: int
    predicted_step_s: float
    measured_step_s: float
    source: str
    ts: float
    count: int | None = None
    job_id: str | None = None
    provider: str | None = None
    instance_type: str | None = None
    region: str | None = None
    mode: str | None = None
    strategy: str | None = None
    interval_low_s: float | None = None
    interval_high_s: float | None = None
    measured_steps: int | None = None
    features: dict | None = None
    name: str | None = None
    source_label: str | None = None
    id: int | None = None  # the state's row id (None before it is stored)
