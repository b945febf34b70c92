"""The job spec's pydantic v2 models (see :mod:`sftctl.spec`): :class:`JobSpec` and its
sections (model, train, resources, recovery, health, storage, slurm, controller), their bounds
and the accelerator forms ``H100:8`` / ``{name, count}``."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PrivateAttr, Strict, StrictBool, ValidationInfo, create_model, field_validator, model_validator

from sftctl.health.registry import Threshold as HealthThreshold, spec_thresholds
from sftctl.settings import SettingError, builtin_providers, provider_names
from sftctl.yaml12 import parse_duration_s, shown


#: Every provider's name, discovered (the packages of sftctl/providers/ and SFTCTL_PROVIDERS's:
#: :func:`sftctl.settings.provider_names`); ``resources.clouds`` takes these.
try:
    CLOUDS = provider_names()
except SettingError:  # a malformed SFTCTL_PROVIDERS is said where providers are used, not at this import
    CLOUDS = builtin_providers()


def _placement_names() -> tuple[str, ...]:
    """The controller placements: the modules of sftctl/controller/placements/ (one per placement,
    ``base`` their interface), found by listing the directory, nothing imported; ``local`` first."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "controller", "placements")
    found = [name[:-3] for name in os.listdir(root)
             if name.endswith(".py") and not name.startswith("_") and name != "base.py"]
    return tuple(sorted(found, key=lambda n: (n != "local", n)))


#: Every ``controller.place``: the placements' modules (:func:`_placement_names`).
PLACEMENTS = _placement_names()
if TYPE_CHECKING:
    CloudName = str
    PlacementName = str
else:
    CloudName = Literal[CLOUDS]
    PlacementName = Literal[PLACEMENTS]


# counts are strict: YAML's `true` is not one node
StrictPositiveInt = Annotated[int, Strict(), Gt(0)]


StrictNonNegativeInt = Annotated[int, Strict(), Ge(0)]


# Upper bounds far beyond any real job, so a typo (steps: 99999999999999999999) is one line at
# its field instead of a plan that says 5815341594913154269184.0 h
MAX_STEPS = 10**12  # steps, checkpoint_interval: a trillion steps of 1 ms is 30 years


MAX_BATCH = 10**9  # model.batch_size: global samples per step


MAX_NODES = 10**4  # resources.nodes: the largest clusters have about 10^4 GPU nodes


MAX_PER_NODE = 1024  # resources.accelerators[].count: GPUs (or local CPU workers) per node


MAX_COUNT = 10**6  # keep_checkpoints, max_restarts, straggler_window_steps


_NO_INTERPOLATION = {("setup",), ("run",)}


MAX_SPEC_BYTES = 1 << 20  # a job spec is a page of YAML; 1 MiB is far beyond any real one


#: the most one ``NAME=value`` of a process's environment may hold on Linux, in bytes with the
#: terminating NUL (MAX_ARG_STRLEN = 32 pages of 4 KiB: include/uapi/linux/binfmts.h); a longer
#: one makes exec fail with E2BIG when the node starts
ENV_ENTRY_MAX_BYTES = 131072 - 1


class _Strict(BaseModel):
    # .inf and .nan are YAML floats; no field of a spec means them (an infinite interval_s
    # reached the agent and crashed it)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """What to compile and train: the function that builds the model, a batch and the loss."""

    framework: Literal["torch", "jax"] = "torch"
    entrypoint: str = Field(description="file.py:function, relative to workdir")
    batch_size: Annotated[StrictPositiveInt, Le(MAX_BATCH)] = Field(
        16, description="global batch: samples per step, split evenly over the data-parallel ranks"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="compute dtype; bfloat16/float16 is mixed precision in both frameworks: float32 "
                    "master weights and AdamW state, matmuls in this dtype (torch: autocast; JAX: "
                    "parameters cast at the loss function's entry)",
    )
    matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest",
        description="float32 matmuls as torch.set_float32_matmul_precision runs them (SFTCTL_MATMUL_PRECISION): "
        "highest = IEEE FP32 on CUDA cores (torch's default), high = TF32 tensor cores, medium = as high on CUDA",
    )
    mask_fraction: Annotated[float, Gt(0), Le(1)] = Field(
        1.0,
        description="data-dependent shapes (torch): the fraction of a boolean mask's elements a select "
        "(logits[mask], out[train_mask], nonzero) is priced at; 1.0 = all of them, the mask's bound",
    )
    expert_capacity: Annotated[float, Gt(0)] = Field(
        1.0,
        description="MoE dispatch through nonzero (torch): tokens per expert as a multiple of the uniform "
        "top-k load (tokens x k / experts), as a capacity factor",
    )

    attention: str = Field(
        "auto",
        description="the attention kernel the job runs, which prices it: auto (HF's attn_implementation, else "
        "torch SDPA's choice per GPU), flash2, flash3, cudnn, efficient, math, triton, xformers or flex",
    )

    @field_validator("attention")
    @classmethod
    def _attention_known(cls, v: str) -> str:
        from sftctl.compiler.attention import IMPLEMENTATIONS

        if v not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention implementation {v!r}; use one of {', '.join(IMPLEMENTATIONS)}")
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str) -> str:
        if not re.fullmatch(r"[^:]+\.py:[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"expected 'file.py:function', got {v!r}")
        return v

    @property
    def entrypoint_file(self) -> str:
        return self.entrypoint.rsplit(":", 1)[0]


class TrainSpec(_Strict):
    """Training loop settings passed to the nodes as ``SFTCTL_TRAIN_STEPS`` and friends."""

    steps: Annotated[StrictPositiveInt, Le(MAX_STEPS)] = 100
    checkpoint_dir: str | None = Field(None, description="default: <job dir>/checkpoints")
    checkpoint_interval: Annotated[StrictPositiveInt, Le(MAX_STEPS)] = Field(50, description="steps between checkpoints")
    keep_checkpoints: Annotated[StrictPositiveInt, Le(MAX_COUNT)] = Field(3, description="complete checkpoints kept in the job's storage")
    resume_from: str | None = Field(
        None, description="the job id whose checkpoints in checkpoint_dir this job continues "
                          "(or 'any'); without it a checkpoint_dir holding another run's checkpoints is refused")
    compile: Literal["none", "default", "sftensor"] = Field(
        "none", description="torch.compile backend for the training script (SFTCTL_COMPILE): none = eager"
    )
    parallelism: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="data-parallel strategy (SFTCTL_PARALLELISM): ddp replicates the model, fsdp shards "
        "parameters, gradients and optimizer state over the devices (FSDP2); auto: the planner takes the fastest "
        "that fits each offering")
    activation_checkpointing: StrictBool | None = Field(
        None, description="recompute each block's activations in backward (SFTCTL_ACTIVATION_CHECKPOINTING); "
        "unset: the planner turns it on only where nothing fits without it or it is faster")
    pipeline: StrictBool = Field(
        False, description="the training script runs pipeline stages: it calls sft.prepare(model, loss_fn=...) "
        "and steps the Pipeline it returns (pipe.step(inputs, targets)) when SFTCTL_PP > 1, as torchtitan's "
        "train loop drives its pipeline schedule; true lets the planner choose layouts with pipeline "
        "parallelism (pp > 1, 1F1B or interleaved); false (default): pp = 1")


class Accelerator(_Strict):
    """One candidate accelerator and how many of it each node has (``H100:8``)."""

    name: str = Field(min_length=1)
    count: Annotated[StrictPositiveInt, Le(MAX_PER_NODE)] = 1

    def __str__(self) -> str:
        return f"{self.name}:{self.count}"


class SpotPolicy(_Strict):
    """How a spot job rides out preemptions (written as ``resources.spot: {...}``)."""

    fallback_on_demand_after: Annotated[StrictPositiveInt, Le(MAX_COUNT)] | None = Field(
        None, description="after this many preemptions the job's nodes are replaced on demand (unset: spot always)")
    zone_cooldown: str = Field("1h", description="how long a zone that took a spot node back is avoided "
                                                 "(a duration: 30m, 1h); it is kept in state.db for every job")
    preemptions_per_hour: PositiveFloat | None = Field(
        None, description="expected preemptions per node-hour for the plan's spot cost (default: sftctl's "
                          "stated assumption, planner.SPOT_PREEMPTIONS_PER_NODE_HOUR)")
    relaunch_s: PositiveFloat = Field(600.0, description="seconds from a preemption to training again (new node, "
                                                         "boot, checkpoint load): part of the plan's spot cost")

    @field_validator("zone_cooldown", mode="before")
    @classmethod
    def _cooldown_form(cls, v: object) -> object:
        parse_duration_s(v if isinstance(v, str) else repr(v))
        return v

    @property
    def zone_cooldown_s(self) -> float:
        return parse_duration_s(self.zone_cooldown)


class ResourcesSpec(_Strict):
    """What the job may run on. Any one of ``accelerators`` will do; the planner picks."""

    accelerators: list[Accelerator] = Field(
        default_factory=lambda: [Accelerator(name="cpu", count=1)], min_length=1
    )
    nodes: Annotated[StrictPositiveInt, Le(MAX_NODES)] = 1
    spot: StrictBool = Field(False, description="true, or the spot policy as a mapping: {fallback_on_demand_after: "
                                                "N, zone_cooldown: 1h, preemptions_per_hour: R, relaunch_s: S}")
    spot_policy: SpotPolicy | None = Field(None, description="resources.spot's mapping (write it there)")
    clouds: list[CloudName] | None = None
    regions: list[str] | None = None
    max_price_per_hour: PositiveFloat | None = Field(None, description="USD/h, all nodes together")
    deadline: str | None = Field(None, description="a duration: 90m, 6h, 2d")
    image: str | None = Field(None, description="node image: an AMI id, a GCE image, a container image")
    instance_profile: str | None = Field(
        None, pattern=r"^[\w+=,.@-]{1,128}$",
        description="aws: the IAM instance profile the nodes run with (how they read S3 job storage); "
                    "default $SFTCTL_AWS_INSTANCE_PROFILE",
    )
    objective: Literal["cost", "time"] = Field(
        "cost", description="cost: cheapest within deadline and price; time: fastest within price"
    )
    replan: Literal["suggest", "migrate", "off"] = Field(
        "suggest", description="after warm-up, when another offering of the plan is cheaper per token by more "
                               "than moving costs: suggest (a replan event), migrate (checkpoint, move, resume) or off")

    @model_validator(mode="before")
    @classmethod
    def _spot_mapping(cls, data: Any) -> Any:
        """``spot: {fallback_on_demand_after: 3}`` is spot with that policy."""
        if isinstance(data, dict) and isinstance(data.get("spot"), dict):
            data = {**data, "spot": True, "spot_policy": data["spot"]}
        return data

    @property
    def spot_rules(self) -> SpotPolicy:
        """The spot policy in force (the defaults where ``spot: true`` gave none)."""
        return self.spot_policy or SpotPolicy()

    @field_validator("accelerators", mode="before")
    @classmethod
    def _parse_short_form(cls, v: Any) -> Any:
        if isinstance(v, (str, dict)):
            v = [v]
        if isinstance(v, list):
            return [_parse_accelerator(a) if isinstance(a, str) else _accelerator_mapping(a) for a in v]
        return v

    @field_validator("deadline", mode="before")
    @classmethod
    def _deadline_form(cls, v: object) -> object:
        if v is not None:  # a bare number has no unit: say the forms, not "should be a string"
            parse_duration_s(v if isinstance(v, str) else repr(v))
        return v

    @property
    def deadline_s(self) -> float | None:
        """The deadline in seconds after submission, or ``None``."""
        return None if self.deadline is None else parse_duration_s(self.deadline)


class RecoverySpec(_Strict):
    """What to do when a node or the training process fails."""

    max_restarts: Annotated[StrictNonNegativeInt, Le(MAX_COUNT)] = Field(0, description="relaunches from the last checkpoint")
    min_nodes: StrictPositiveInt | None = Field(
        None, description="elastic resume: when a lost node cannot be replaced (no capacity), resume on "
        "fewer nodes, down to this many, resharding the checkpoint; the global batch stays the same by "
        "gradient accumulation (SFTCTL_GRAD_ACCUM), so resources.nodes must be a multiple of the node "
        "count it resumes on. Unset: never fewer than resources.nodes")


class _HealthHead(_Strict):
    enabled: StrictBool = True
    interval_s: PositiveFloat = Field(2.0, description="seconds between the node agent's GPU samples")
    preflight: Literal["off", "quick", "full"] | None = Field(
        None, description="each node's check before training (sftctl.preflight: matmul and all-reduce against the "
                          "predicted speed, NVML, dcgmi diag): quick, full or off; unset: quick on GPU nodes, off on CPU")


def _threshold_field(t: HealthThreshold) -> tuple[Any, Any]:
    """The spec field of a detector's threshold: a strict int for a count, else a float (finite:
    ``_Strict``), within its bounds, its default, its doc and unit as the description."""
    bounds: list[Any] = [cls(v) for cls, v in ((Gt, t.gt), (Ge, t.ge), (Lt, t.lt), (Le, t.le)) if v is not None]
    base: list[Any] = [int, Strict()] if t.integer else [float]
    kind = Annotated[tuple(base + bounds)] if len(base + bounds) > 1 else float
    return kind, Field(t.default, description=f"{t.doc} ({t.unit})")


#: the detectors' thresholds a spec sets (``health.<spec_key>``), from sftctl.health.registry
HEALTH_THRESHOLDS = spec_thresholds()


_HealthThresholds: Any = create_model(  # type: ignore[call-overload]  # fields built from the registry
    "_HealthThresholds", __base__=_HealthHead, __module__=__name__,
    **{t.spec_key: _threshold_field(t) for t in HEALTH_THRESHOLDS},
)


class HealthSpec(_HealthThresholds):
    """GPU and training health monitoring (see :mod:`sftctl.health`). ``enabled``, ``interval_s``,
    one key per detector threshold that has a spec key (declared with its detector in
    :mod:`sftctl.health.detectors`, default and bounds there), then ``metrics_address``."""

    metrics_address: str = Field(
        "127.0.0.1", description="the address the node agent's /metrics binds (SFTCTL_AGENT_ADDRESS): loopback "
                                 "unless Prometheus scrapes from elsewhere; it asks for a bearer token "
                                 "(SFTCTL_AGENT_METRICS_TOKEN, docs/health.md)")

    @field_validator("metrics_address")
    @classmethod
    def _an_ip_address(cls, v: str) -> str:
        import ipaddress

        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise ValueError("must be an IP address, e.g. 127.0.0.1 or 0.0.0.0") from None

    def thresholds(self):
        """The detectors' :class:`~sftctl.health.telemetry.Thresholds` for this spec."""
        from sftctl.health.telemetry import Thresholds

        return Thresholds(**{t.name: getattr(self, t.spec_key) for t in HEALTH_THRESHOLDS})


class StorageSpec(_Strict):
    """The job's storage: code, checkpoints, logs and GPU telemetry that outlive every node.

    ``url``: ``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX``, ``pvc://CLAIM/PREFIX`` (a Kubernetes
    PersistentVolumeClaim) or a local directory (a relative one is taken from the spec file's
    directory, or from the current directory when SFTCTL_STORAGE or --set gives it). The job
    writes under ``<url>/<job id>/``.
    """

    url: str = Field(min_length=1)
    create_bucket: StrictBool = Field(False, description="create the bucket if it does not exist")
    max_workdir_mb: PositiveFloat = Field(100.0, description="MiB: refuse to upload a bigger workdir (its files, uncompressed)")

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        scheme = v.split("://", 1)[0] if "://" in v else ""
        if scheme not in ("", "s3", "gs", "pvc", "file"):
            raise ValueError(f"unsupported storage {v!r}: use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
                             "pvc://CLAIM/PREFIX or a directory")
        if scheme in ("s3", "gs", "pvc") and not v.split("://", 1)[1].split("/", 1)[0]:
            what = "CLAIM" if scheme == "pvc" else "BUCKET"
            raise ValueError(f"storage {v!r} names no {what.lower()}: use {scheme}://{what}/PREFIX")
        return v


class SlurmSpec(_Strict):
    """How to reach a Slurm cluster and what to ask it for; overlays the ``slurm:`` section of
    ``$SFTCTL_HOME/config.yaml`` field by field (see :class:`sftctl.slurm_config.SlurmConfig`)."""

    host: str | None = Field(None, description="login node for SSH; unset: sftctl runs on a login node")
    user: str | None = None
    port: StrictPositiveInt | None = None
    key: str | None = Field(None, description="SSH identity file")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gpu_hour_usd: Annotated[float, Ge(0)] | None = Field(None, description="what a GPU-hour costs the lab; 0 = owned")
    cpu_hour_usd: Annotated[float, Ge(0)] | None = None
    cpus_per_node: StrictPositiveInt | None = None
    mem_per_node: str | None = Field(None, pattern=r"^[0-9]+[KMGT]?$", description="sbatch --mem, e.g. 64G")
    remote_dir: str | None = None
    python: str | None = None
    requeue: StrictBool | None = Field(None, description="sbatch --requeue (default true): Slurm itself "
                                       "requeues the job after preemption or a node failure")

    @field_validator("host", "user", "key", "partition", "account", "qos", "remote_dir", "python")
    @classmethod
    def _one_line(cls, v: str | None, info: ValidationInfo) -> str | None:
        from sftctl.slurm_config import NAMES, control_problem

        problem = control_problem(v)
        if problem:
            raise ValueError(f"{shown(v)}: {problem}; write it on one line")
        if info.field_name in NAMES and v is not None and any(c.isspace() for c in v):
            raise ValueError(f"{shown(v)}: a Slurm {info.field_name} name has no white space "
                             "(it would split into more sbatch options)")
        return v


class ControllerSpec(_Strict):
    """Where the job's supervising controller runs (see docs/slurm.md "Where a controller runs")."""

    place: PlacementName | None = Field(
        None, description="local: the machine that runs sftctl (the server's, when the config names one); "
        "server: the configured sftctl server; slurm: a 1-CPU Slurm job (sftctl-ctl-<job>) on the lab's "
        "cluster, reporting to the same state (Postgres, or SQLite on the cluster's shared filesystem); "
        "kubernetes: a batch/v1 Job (sftctl-ctl-<job>) in the kubernetes context and namespace, reporting "
        "to the same Postgres state. Unset: server when the config names one, else local")
    partition: str | None = Field(
        None, description="place: slurm: the partition of the controller's Slurm job (a CPU partition); "
        "default: slurm.partition, else the cluster's default partition")
    image: str | None = Field(
        None, description="place: kubernetes: the container image of the controller's Job, with sftctl "
        "installed (python -m sftctl runs); default: python:3.11-slim, the kubernetes provider's CPU image, "
        "where the pod pip-installs this sftctl version (or node.install) before it starts")

    @field_validator("partition")
    @classmethod
    def _one_name(cls, v: str | None) -> str | None:
        from sftctl.slurm_config import control_problem

        problem = control_problem(v)
        if problem:
            raise ValueError(f"{shown(v)}: {problem}; write it on one line")
        if v is not None and (not v or any(c.isspace() for c in v)):
            raise ValueError(f"{shown(v)}: a Slurm partition name is one word (no white space)")
        return v

    @field_validator("image")
    @classmethod
    def _image_one_word(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(c.isspace() for c in v)):
            raise ValueError(f"{shown(v)}: a container image reference is one word (no white space)")
        return v

    @model_validator(mode="after")
    def _partition_is_for_slurm(self) -> "ControllerSpec":
        if self.partition is not None and self.place != "slurm":
            raise ValueError("partition is for place: slurm only (the controller's Slurm job); "
                             "set place: slurm or drop partition")
        if self.image is not None and self.place != "kubernetes":
            raise ValueError("image is for place: kubernetes only (the controller's Job); "
                             "set place: kubernetes or drop image")
        return self


class JobSpec(_Strict):
    """A whole job. ``workdir`` is absolute after :func:`load_spec`."""

    # dots for a sweep's names (--set name=lr-0.001); job ids are <name>-<6 hex>
    name: str = Field(pattern=r"^[a-z][a-z0-9.-]{0,39}$")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="key: value text to tell a sweep's jobs apart (sftctl status shows them, --label k=v filters); "
                    "keys are lowercase words (a-z0-9_-, at most 63), values one line of at most 63 characters",
    )
    workdir: str = "."
    model: ModelSpec | None = None
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    env: dict[str, str] = Field(default_factory=dict)
    secrets: list[str] = Field(
        default_factory=list,
        description="names of environment variables passed from your shell to the nodes; their values "
        "are never written to the spec, state, storage, logs or templates",
    )
    storage: StorageSpec | None = None
    setup: str | None = None
    run: str = Field(min_length=1)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    slurm: SlurmSpec | None = None
    controller: ControllerSpec = Field(default_factory=ControllerSpec)
    #: where a field the spec leaves out was filled from by the user's settings (load_spec):
    #: ``{"resources.clouds": "<config file>:<line>: defaults.clouds" or "$SFTCTL_CLOUDS"}``;
    #: not part of the spec's document (model_dump), so messages can name the cause
    _defaults_from: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def defaults_from(self) -> dict[str, str]:
        return self._defaults_from

    @model_validator(mode="after")
    def _min_nodes_within_nodes(self) -> "JobSpec":
        m = self.recovery.min_nodes
        if m is not None and m > self.resources.nodes:
            # "FIELD: why": _explain puts the error at FIELD's line, not at the top level
            raise ValueError(f"recovery.min_nodes: {m} is more than resources.nodes {self.resources.nodes}; "
                             f"set it to at most {self.resources.nodes}")
        return self

    @field_validator("storage", mode="before")
    @classmethod
    def _storage_string(cls, v: Any) -> Any:
        return {"url": v} if isinstance(v, str) else v

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: list[str]) -> list[str]:
        for key in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return v

    @field_validator("labels", mode="before")
    @classmethod
    def _label_text(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for key, value in v.items():
            if not isinstance(key, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", key):
                raise ValueError(f"{shown(repr(key))} is not a label key: lowercase letters, digits, _ and - "
                                 "(at most 63), e.g. lr")
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, (int, float)):
                value = str(value)
            if not isinstance(value, str) or len(value) > 63 or not re.fullmatch(r"[^\x00-\x1f\x7f]*", value):
                raise ValueError(f"label {key}: the value must be one line of text of at most 63 characters")
            out[key] = value
        return out

    @field_validator("env", mode="before")
    @classmethod
    def _stringify_env(cls, v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for key, value in v.items():
                if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                    raise ValueError(f"{key!r} is not a valid environment variable name")
                if isinstance(value, bool):
                    value = "1" if value else "0"
                elif isinstance(value, (int, float)):
                    value = str(value)
                if isinstance(value, str) and len(f"{key}={value}".encode()) > ENV_ENTRY_MAX_BYTES:
                    raise ValueError(f"{key}: {len(value.encode()):,} bytes is more than one environment variable "
                                     f"holds on Linux ({ENV_ENTRY_MAX_BYTES:,} bytes with its name); put the data "
                                     "in a file of the workdir and pass its path")
                out[key] = value
            return out
        return v


def _parse_accelerator(text: str) -> dict[str, Any]:
    name, sep, count = text.partition(":")
    if not sep:
        return {"name": name.strip(), "count": 1}
    if not re.fullmatch(r"\s*[0-9]+\s*", count):
        raise ValueError(f"accelerator {text!r}: expected NAME or NAME:COUNT, e.g. 'H100:8'")
    return {"name": name.strip(), "count": int(count)}


def _accelerator_mapping(item: Any) -> Any:
    """An accelerator written as a one-key mapping (``{H100: eight}``, ``{H100: 8}``) is neither
    accepted form: say so, with the forms that are, instead of "name: required field is missing"."""
    if isinstance(item, dict) and len(item) == 1 and not ({"name", "count"} & set(item)):
        (name, count), = item.items()
        why = (f"the count {count!r} is not an integer" if not isinstance(count, int) or isinstance(count, bool)
               else "a mapping NAME: COUNT is not an accelerator form")
        n = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 8
        raise ValueError(f"{{{name}: {count}}}: {why}; write '{name}:{n}' or {{name: {name}, count: {n}}}")
    return item
