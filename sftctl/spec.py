"""The job spec: pydantic v2 models and a YAML loader whose errors name the field and its line.

A job spec is a YAML file (see ``examples/quickstart.yaml``)::

    name: quickstart
    workdir: ..                       # relative to this file
    model: {framework: torch, entrypoint: examples/gpt/model.py:build, batch_size: 32}
    train: {steps: 300, checkpoint_interval: 100}
    resources: {accelerators: ["cpu:1"], nodes: 2}
    run: torchrun ... examples/gpt/train.py

Rules the loader enforces, so a typo is never silently accepted:

* unknown keys are errors, with a did-you-mean hint; duplicate keys are errors;
* ``${VAR}`` and ``${VAR:-default}`` are replaced from the environment in every string except
  ``setup`` and ``run`` (those are shell scripts; the node's shell expands them); ``$${`` is a
  literal ``${``; an unset variable without a default is an error naming its field and line;
* ``--set key.path=value`` overrides (value parsed as a YAML scalar) are validated like the file,
  and errors name the override instead of a line.

Every problem raises :class:`sftctl.errors.SpecError` (exit code 2) with one line of the form
``job.yaml:12: resources.acelerators: unknown field; did you mean 'accelerators'?``.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le

import yaml
from pydantic import (
    model_validator,
    BaseModel,
    StrictBool,
    ConfigDict,
    Field,
    PositiveFloat,
    PrivateAttr,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from sftctl.errors import SpecError
# the YAML 1.2 loader with line numbers lives in sftctl.yaml12 (light: sftctl.settings reads the
# config file with it); these names stay importable from here
from sftctl.yaml12 import (  # noqa: F401
    Path_,
    _build,
    _check_depth,
    _compose,
    _dotted,
    _Located,
    _Loader,
    parse_duration_s,
    shown,
)

CLOUDS = ("local", "aws", "gcp", "kubernetes", "slurm")
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
    clouds: list[Literal["local", "aws", "gcp", "kubernetes", "slurm"]] | None = None
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


class HealthSpec(_Strict):
    """GPU and training health monitoring (see :mod:`sftctl.health`). Thresholds default to
    :class:`sftctl.health.telemetry.Thresholds`."""

    enabled: StrictBool = True
    interval_s: PositiveFloat = Field(2.0, description="seconds between the node agent's GPU samples")
    throttle_window_s: PositiveFloat = 10.0
    throttle_min_fraction: float = Field(0.8, gt=0, le=1)
    low_clock_ratio: float = Field(0.7, gt=0, lt=1)
    straggler_ratio: float = Field(1.3, gt=1)
    straggler_window_steps: Annotated[StrictPositiveInt, Le(MAX_COUNT)] = 10
    straggler_windows: StrictPositiveInt = 3
    hang_timeout_s: PositiveFloat = 60.0
    metrics_address: str = Field(
        "127.0.0.1", description="the address the node agent's /metrics binds (SFTCTL_AGENT_ADDRESS); it "
                                 "has no authentication, so loopback unless Prometheus scrapes from elsewhere")

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

        return Thresholds(**self.model_dump(exclude={"enabled", "interval_s", "metrics_address"}))


class StorageSpec(_Strict):
    """The job's storage: code, checkpoints, logs and GPU telemetry that outlive every node.

    ``url``: ``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX``, ``pvc://CLAIM/PREFIX`` (a Kubernetes
    PersistentVolumeClaim) or a local directory. The job writes under ``<url>/<job id>/``.
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
    """Where the job's supervising controller runs (see README "Where a controller runs")."""

    place: Literal["local", "server", "slurm", "kubernetes"] | None = Field(
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

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,39}$")
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


# --------------------------------------------------------------------------- YAML with lines

_VAR = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(value: Any, path: Path_, loc: _Located, environ: typing.Mapping[str, str]) -> Any:
    if path[:1] and (path[0],) in _NO_INTERPOLATION:
        return value
    if isinstance(value, dict):
        return {k: _interpolate(v, path + (k,), loc, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, path + (i,), loc, environ) for i, v in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value
    if len(path) == 2 and path[0] == "env":  # kept as a reference: _check_env_references
        return value
    return _expand(value, environ, lambda name: _unset(name, path, loc))


def _unset(name: str, path: Path_, loc: _Located) -> SpecError:
    return SpecError(f"{loc.where(path)}: {_dotted(path)}: ${{{name}}} is not set in the environment",
                     hint=f"export {name}=..., or write ${{{name}:-default}}; $${{ gives a literal ${{")


def _check_env_references(data: dict, loc: _Located, environ: typing.Mapping[str, str]) -> None:
    """Each ``${VAR}`` of an ``env:`` value (file or ``--set``) is set or has a default now; the
    value itself stays the reference, resolved when a node's environment is built (resolve_env)."""
    env = data.get("env")
    if isinstance(env, dict):
        for key, value in env.items():
            if isinstance(key, str) and isinstance(value, str):
                _expand(value, environ, lambda name: _unset(name, ("env", key), loc))


def _expand(value: str, environ: typing.Mapping[str, str], unset: typing.Callable[[str], Exception]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "$${":
            return "${"
        name, default = m.group(1), m.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise unset(name)

    return _VAR.sub(sub, value)


def env_references(value: str) -> list[str]:
    """The environment variables a stored ``env:`` value refers to (``${NAME}``, ``${NAME:-d}``),
    in order; ``$${`` is a literal, not a reference."""
    return [m.group(1) for m in _VAR.finditer(value) if m.group(1)]


#: variables the shell or every machine sets itself: never reported as unset in ``run:``
_SHELL_SET = frozenset("""HOME PATH USER LOGNAME SHELL PWD OLDPWD HOSTNAME HOSTTYPE OSTYPE MACHTYPE UID EUID
PPID RANDOM SRANDOM SECONDS LINENO BASHPID BASH BASH_VERSION BASH_SOURCE BASH_LINENO FUNCNAME IFS PS1 PS2 PS4
SHLVL TERM LANG TMPDIR REPLY OPTARG OPTIND PIPESTATUS EPOCHSECONDS EPOCHREALTIME GROUPS""".split())
_SHELL_REF = re.compile(r"\\\$|\$\$|\$\{#?([A-Za-z_][A-Za-z0-9_]*)(:?[-=?+])?|\$([A-Za-z_][A-Za-z0-9_]*)")
_SINGLE_QUOTED = re.compile(r"'[^']*'")


def unset_shell_references(script: str, known: typing.Iterable[str],
                           environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """The variables a ``run:``/``setup:`` shell script expands (``$NAME``, ``${NAME}``) that
    nothing sets: not in ``known`` (the node's environment: the spec's ``env`` and ``secrets``,
    sftctl's own variables), not in ``environ`` (what the node inherits: this shell's, for local
    nodes; pass ``{}`` for nodes that do not), not the shell's own (``$HOME``, ``$RANDOM``), not
    assigned in the script (``NAME=``, ``for NAME in``, ``read NAME``), not given a default
    (``${NAME:-x}``). The node's shell expands each to nothing. In order, each once; text in
    single quotes and ``$$``/``\\$`` are not expansions."""
    known = set(known) | _SHELL_SET
    environ = os.environ if environ is None else environ
    text = _SINGLE_QUOTED.sub("", script)
    out: list[str] = []
    for m in _SHELL_REF.finditer(text):
        name = m.group(1) or m.group(3)
        if not name or m.group(2) or name in known or name in environ or name in out:
            continue
        if name.startswith(("SFTCTL_", "PET_")):  # sftctl's node variables, some set by the node itself
            continue
        if re.search(rf"(^|[\s;&|(]){name}=|\bfor\s+{name}\b|\bread\b[^\n;]*\b{name}\b", script, re.M):
            continue
        out.append(name)
    return out


def resolve_env(env: typing.Mapping[str, str], environ: typing.Mapping[str, str] | None = None) -> dict[str, str]:
    """The spec's ``env`` as a node gets it: each ``${VAR}`` replaced from ``environ`` (default
    ``os.environ``, the controller's: ``sftctl run`` or the controller it starts, which inherits
    it). A spec keeps the references (state.db, events, logs hold ``${MY_API_TOKEN}``, never its
    value); only the node's environment holds the values.

    Raises:
        SpecError: a variable without a default is not set (it was when the spec was loaded).
    """
    environ = os.environ if environ is None else environ
    return {k: _expand(v, environ, lambda name, k=k: SpecError(
        f"env.{k}: ${{{name}}} is not set in the environment of the controller",
        hint=f"export {name}=... in the shell that runs sftctl")) for k, v in env.items()}


# --------------------------------------------------------------------------- overrides


def _apply_override(data: dict, assignment: str, loc: _Located) -> None:
    key, sep, raw = assignment.partition("=")
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"--set {shown(assignment)}: the value is longer than {MAX_SPEC_BYTES:,} characters")
    shown_ = shown(assignment)
    key = key.strip()
    if not sep or not key:
        raise SpecError(
            f"--set {shown_}: expected key.path=value", hint="e.g. --set train.steps=20"
        )
    flow = raw.strip()[:1] in ("[", "{")
    try:
        if flow:
            _check_depth(raw, _Located(f"--set {shown_}"))
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else raw
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        digits = raw.strip().lstrip("+-")
        why = f"a number of {len(digits):,} digits" if digits.isdigit() else shown(str(e).splitlines()[0])
        raise SpecError(f"--set {shown_}: cannot read the value: {why}",
                        hint="give a number of a sensible size, or quote a string") from None
    except yaml.YAMLError as e:
        if flow:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise SpecError(f"--set {shown_}: cannot read {shown(raw)} as a YAML list or mapping: {problem}",
                            hint="e.g. --set 'resources.accelerators=[H100:8, A100-80GB:8]'") from None
        value = raw
    if value is None or not isinstance(value, (str, int, float, bool, list, dict)) or (
        isinstance(value, (list, dict)) and not flow
    ):
        value = raw
    parts: list[Any] = [int(p) if re.fullmatch(r"[0-9]+", p) else p for p in key.split(".")]
    if any(p == "" for p in parts):
        raise SpecError(f"--set {shown_}: empty segment in {key!r}", hint="e.g. train.steps")
    negative = next((p for p in parts if isinstance(p, str) and re.fullmatch(r"-[0-9]+", p)), None)
    if negative is not None:
        head = ".".join(str(p) for p in parts[:parts.index(negative)])
        raise SpecError(f"--set {shown_}: {head}: index {negative}: list indexes count from 0; negative ones are not "
                        "supported", hint=f"give the item's position (0 is the first), or set the whole list: "
                                          f"--set '{head}=[...]'")
    if parts[0] == "env" and value is not raw:  # env values are the text written: env.UMASK=0022
        value = _build(yaml.compose(raw, Loader=_Loader), _Located(f"--set {shown_}"), tuple(parts))
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = tuple(parts[: i + 1])
        if isinstance(node, dict) and isinstance(part, str):
            if last:
                node[part] = value
            else:
                nxt = node.get(part)
                if nxt is None and isinstance(parts[i + 1], int):  # a list the spec leaves to its default
                    raise SpecError(
                        f"--set {shown_}: {_dotted(here)}: not set in the spec (its default applies), "
                        f"so it has no item {parts[i + 1]}",
                        hint=f"set the whole list: --set '{'.'.join(str(p) for p in here)}=[...]'")
                if nxt is None:
                    nxt = node[part] = {}
                elif here == ("storage",) and isinstance(nxt, str):  # storage: URL is {url: URL}
                    nxt = node[part] = {"url": nxt}
                node = nxt
        elif isinstance(node, list) and isinstance(part, int):
            if part >= len(node):
                raise SpecError(
                    f"--set {shown_}: {_dotted(here)}: index {part} is out of range "
                    f"(the list has {len(node)} items)"
                )
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            raise SpecError(
                f"--set {shown_}: {_dotted(here[:-1]) or 'top level'} is not a "
                f"{'list' if isinstance(part, int) else 'mapping'}",
                hint="check the key path against the spec",
            )
    loc.overrides[tuple(parts)] = shown_


# --------------------------------------------------------------------------- validation errors


def _field_model_at(path: Path_) -> type[BaseModel] | None:
    """The pydantic model class that a document path points into, if any."""
    model: Any = JobSpec
    for part in path:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    for arg in typing.get_args(tp) or ():
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return tp


def _explain(err: dict, loc: _Located) -> SpecError:
    path = model_path = tuple(p for p in err["loc"] if isinstance(p, (str, int)))
    if path[:2] == ("resources", "spot_policy"):  # written as resources.spot: {...}
        path = ("resources", "spot") + path[2:]
    field = _dotted(path) or "top level"
    where = loc.where(path)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _field_model_at(model_path[:-1])
        allowed = sorted(f for f in parent.model_fields if f != "spot_policy") if parent else []  # written as spot
        close = difflib.get_close_matches(str(path[-1]), allowed, n=1, cutoff=0.6)
        suggestion = f"; did you mean '{close[0]}'?" if close else ""
        return SpecError(
            f"{where}: {field}: unknown field{suggestion}",
            hint=f"fields allowed here: {', '.join(allowed)}" if allowed else None,
        )
    if kind == "missing":
        return SpecError(
            f"{where}: {field}: required field is missing",
            hint="see examples/quickstart.yaml for a complete spec",
        )
    msg = re.sub(r" or instance of \w+", "", err["msg"].removeprefix("Value error, "))
    named = re.fullmatch(r"([a-z_]+(?:\.[a-z_]+)+): (.*)", msg, re.S) if kind == "value_error" and not path else None
    if named:  # a check across fields (a model validator) names the field it is about
        path = tuple(named.group(1).split("."))
        field, where, msg = named.group(1), loc.where(path), named.group(2)
    msg = msg.replace("a valid dictionary", "a mapping (key: value lines)")
    got = err.get("input")
    got_text = "" if isinstance(got, (dict, list)) or kind == "value_error" else f" (got {shown(repr(got))})"
    hint = "README.md 'The job spec' lists every field's type"
    if kind == "less_than_equal":  # the bounds (MAX_STEPS, ...) are far beyond any real job
        hint = "that is far beyond any real job; check the value for a typo"
    if kind == "string_type":  # YAML read an unquoted value as a number, bool or null
        hint = "quote values meant as strings; " + hint
    return SpecError(f"{where}: {field}: {msg}{got_text}", hint=hint)


# --------------------------------------------------------------------------- entry point


def unknown_accelerator(i: int, name: str, where: str | None = None) -> SpecError | None:
    """The error for ``resources.accelerators[i]`` naming an accelerator sftctl does not know
    (:func:`sftctl.catalog.accelerator_names`), at ``where`` (``file:line``) when given; else None."""
    from sftctl.catalog import accelerator_names
    from sftctl.catalog.accelerators import suggest_accelerators

    known = {n.lower(): n for n in accelerator_names()}
    if name.lower() in known:
        return None
    close = suggest_accelerators(name, list(known.values()))
    return SpecError(
        (f"{where}: " if where else "") + f"resources.accelerators[{i}]: unknown accelerator {name!r}"
        + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""),
        hint=f"known accelerators: {', '.join(known.values())} (sftctl catalog lists offerings)",
    )


def default_name(path: Path) -> str:
    """A job name from the spec file's stem that always passes ``name``'s pattern: lowercase,
    runs of other characters as one dash, ``job-`` in front of a stem that does not start with
    a letter (``2024-exp.yaml`` -> ``job-2024-exp``), at most 40 characters."""
    stem = re.sub(r"[^a-z0-9-]+", "-", path.stem.lower()).strip("-")
    if not stem[:1].isalpha():
        stem = f"job-{stem}".rstrip("-")
    return stem[:40].rstrip("-")


def _read_spec_file(path: Path) -> str:
    """The spec's text. Type and size are checked before reading: a FIFO, a device such as
    /dev/zero, or a file over MAX_SPEC_BYTES is refused, never read (nor waited on)."""
    import stat

    try:
        st = path.stat()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file", hint="give the path to a job spec YAML") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SpecError(f"{path}: is a directory, not a job spec", hint="give the path to a job spec YAML")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise SpecError(f"{path}: is {kind}, not a job spec file", hint="give the path to a job spec YAML file")
    if st.st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {st.st_size:,} bytes; a job spec is at most {MAX_SPEC_BYTES:,}",
                        hint="is this the right file? keep data in the workdir, not in the spec")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # the file may have grown since stat
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec: {e.strerror or e}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES:,} bytes", hint="is this the right file?")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}): not a job spec",
                        hint="give the path to a job spec YAML file") from None


def _user_defaults(data: dict) -> dict[str, str]:
    """Fill ``resources.clouds``, ``resources.regions`` and ``storage`` that the spec leaves out
    from the user's settings (``SFTCTL_CLOUDS``/``defaults.clouds`` of the config file, ...:
    :mod:`sftctl.settings`); return where each filled field came from (``{"resources.clouds":
    "<file>:<line>: defaults.clouds"}``, see :func:`sftctl.settings.origin`). Raises
    SettingError (exit 2) for a malformed setting."""
    from sftctl import settings

    filled: dict[str, str] = {}
    for key, name in (("clouds", "SFTCTL_CLOUDS"), ("regions", "SFTCTL_REGIONS")):
        value = settings.get(name)
        resources = data.get("resources", {})
        if value is not None and isinstance(resources, dict) and key not in resources:
            data["resources"] = {**resources, key: value}
            filled[f"resources.{key}"] = settings.origin(name) or name
    storage = settings.get("SFTCTL_STORAGE")
    if storage is not None and "storage" not in data:
        data["storage"] = storage
        filled["storage"] = settings.origin("SFTCTL_STORAGE") or "SFTCTL_STORAGE"
    return filled


def load_spec(
    path: str | os.PathLike,
    overrides: typing.Sequence[str] = (),
    environ: typing.Mapping[str, str] | None = None,
    *,
    text: str | None = None,
) -> JobSpec:
    """Read, interpolate, override and validate a job spec.

    Args:
        path: the YAML file; with ``text``, only the name errors give it, and the directory
            relative paths are taken from (``sftctl.api`` passes ``<spec>`` for YAML text).
        text: the YAML itself instead of the file's content.
        overrides: ``key.path=value`` strings from ``--set``, applied in order after the file.
        environ: the environment for ``${VAR}``; defaults to ``os.environ``.

    Returns:
        The validated :class:`JobSpec`, with ``workdir`` made absolute (relative paths are taken
        from the spec file's directory) and ``name`` defaulted to the file's stem.

    Raises:
        SpecError: for every problem with the file or an override (exit code 2), naming the
            field and its line.
    """
    path = Path(path)
    loc = _Located(str(path))
    if text is None:
        text = _read_spec_file(path)
    elif len(text.encode()) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {len(text.encode()):,} bytes; a job spec is at most {MAX_SPEC_BYTES:,}")
    data = _compose(text, loc)
    if not isinstance(data, dict):
        raise SpecError(
            f"{path}:1: the spec must be a mapping of fields (name, run, resources, ...)",
            hint="see examples/quickstart.yaml",
        )
    data = _interpolate(data, (), loc, os.environ if environ is None else environ)
    for assignment in overrides:
        _apply_override(data, assignment, loc)
    _check_env_references(data, loc, os.environ if environ is None else environ)
    filled = _user_defaults(data)
    data.setdefault("name", default_name(path))
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # an error caused by a --set override is the one the user is looking at
        errors.sort(key=lambda err: not loc.where(tuple(p for p in err["loc"] if isinstance(p, (str, int)))).startswith("--set"))
        first = _explain(errors[0], loc)
        if len(errors) > 1:
            first.message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise first from None
    spec._defaults_from.update(filled)
    workdir = (path.parent / spec.workdir).resolve()
    if not workdir.is_dir():
        raise SpecError(
            f"{loc.where(('workdir',))}: workdir: {workdir} is not a directory",
            hint="workdir is relative to the spec file's directory",
        )
    if spec.model is not None and not (workdir / spec.model.entrypoint_file).is_file():
        raise SpecError(
            f"{loc.where(('model', 'entrypoint'))}: model.entrypoint: "
            f"{spec.model.entrypoint_file} not found in workdir {workdir}",
            hint="the entrypoint's file is relative to workdir",
        )
    if spec.model is not None:
        _check_entrypoint_function(workdir, spec.model.entrypoint_file, spec.model.entrypoint,
                                   loc.where(("model", "entrypoint")))
    for i, acc in enumerate(spec.resources.accelerators):
        error = unknown_accelerator(i, acc.name, loc.where(("resources", "accelerators", i)))
        if error is not None:
            raise error
    return spec.model_copy(update={"workdir": str(workdir)})


def _check_entrypoint_function(workdir: Path, name: str, entrypoint: str, where: str) -> None:
    """A ``model.entrypoint`` function the file does not define is said at load, with a
    did-you-mean, in milliseconds: the file is parsed (:mod:`ast`), never imported (importing
    it imports torch: 20 s). What the module's top level binds counts (``def``, ``class``,
    assignments, imports, also inside ``if``/``try``/``with``); a file Python cannot parse, one
    that binds names dynamically (``from x import *``, a module ``__getattr__``, ``globals()``)
    or raises at its top level is left to the tracer."""
    import ast

    func = entrypoint.rpartition(":")[2]
    file = workdir / name
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError, OSError):
        return
    names: set[str] = set()
    functions: list[str] = []
    dynamic = False

    def visit(body: list) -> None:
        nonlocal dynamic
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                functions.append(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        dynamic = True
                    names.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            for child in ("body", "orelse", "finalbody", "handlers"):  # if/try/with/for blocks
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = getattr(node, child, None)
                    if isinstance(inner, list):
                        visit(inner)
            if isinstance(node, ast.Raise) or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and any(
                    isinstance(n, ast.Name) and n.id in ("globals", "setattr", "exec") for n in ast.walk(node)):
                dynamic = True  # what its import does is the tracer's to say

    visit(tree.body)
    if func in names or dynamic or "__getattr__" in names:
        return
    close = difflib.get_close_matches(func, functions, n=1, cutoff=0.6)
    raise SpecError(
        f"{where}: model.entrypoint: {name} has no function {func!r}"
        + (f"; did you mean '{close[0]}'?" if close else ""),
        hint=f"defined in {name}: {', '.join(functions[:10]) or 'none'}" + (" ..." if len(functions) > 10 else ""),
    )
