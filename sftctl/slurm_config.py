"""The Slurm provider's settings: :class:`SlurmConfig`, the one declaration of the ``slurm:``
section's fields (config file and job spec), :func:`value_problem`, the one check of a value
against a field's type, and :func:`control_problem` (no control characters: values reach sbatch's script). A leaf: it imports nothing of sftctl, so :mod:`sftctl.settings` (which
validates the config file's section when it reads the file), :mod:`sftctl.spec` and
:mod:`sftctl.providers.slurm` (which loads and uses it) all take it from here.
"""

from __future__ import annotations

import dataclasses
import typing


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    """How to reach the cluster and what to ask it for (the ``slurm:`` section of the config
    file (:mod:`sftctl.settings`) or of the job spec; the spec's fields win).

    Attributes:
        host: the login node for SSH mode; None: sftctl runs on a login node itself.
        user, port, key: SSH user, port (22) and identity file.
        partition, account, qos: passed to sbatch when given (default: the cluster's default
            partition, the user's default account and QOS).
        gpu_hour_usd: what one GPU-hour costs the lab (0: "owned"); cpu offerings cost
            ``cpu_hour_usd`` per CPU-hour.
        cpus_per_node, mem_per_node: ``--cpus-per-task`` (one task per node) and ``--mem``
            (``64G``); None: Slurm's defaults.
        remote_dir: the job files' root on the cluster in SSH mode (``~`` is the remote home).
        python: the Python with sftctl installed that nodes use (SSH mode; the login-node mode
            uses sftctl's own interpreter, which a shared filesystem makes visible).
        requeue: ``--requeue`` (Slurm requeues the job after preemption or a node failure).
        gpu_types: Slurm GPU type -> catalog accelerator, for names sftctl cannot map itself.
    """

    host: str | None = None
    user: str | None = None
    port: int = 22
    key: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gpu_hour_usd: float = 0.0
    cpu_hour_usd: float = 0.0
    cpus_per_node: int | None = None
    mem_per_node: str | None = None
    remote_dir: str = "~/.sftctl/jobs"
    python: str | None = None
    requeue: bool = True
    gpu_types: dict = dataclasses.field(default_factory=dict)
    ssh_options: tuple = ()


#: Field name -> the type names its annotation allows (``["str", "None"]``).
FIELD_KINDS = {f.name: [k.strip() for k in str(f.type).split("|")] for f in dataclasses.fields(SlurmConfig)}

_WORDS = {"str": "text (quote it: \"...\")", "int": "an integer >= 1", "float": "a number >= 0",
          "bool": "true or false", "dict": "a mapping of text to text", "tuple": "a list of text", "None": ""}


#: fields that are Slurm names: one word each on an ``#SBATCH`` line
NAMES = ("partition", "account", "qos")


def control_problem(v: typing.Any) -> str | None:
    """None when text ``v`` holds no control character (a newline, a carriage return, an escape),
    else what is wrong. A ``slurm:`` value reaches ``#SBATCH`` lines and the job's scripts:
    a newline in ``qos`` would be a shell line of its own on the compute node (issue 28)."""
    for i, ch in enumerate(v if isinstance(v, str) else ""):
        if ord(ch) < 32 or 127 <= ord(ch) < 160:
            return (f"it contains a control character ({ch!r} at position {i}), which would reach the "
                    "sbatch script as shell text")
    return None


def value_problem(key: str, v: typing.Any) -> str | None:
    """None when ``v`` fits field ``key``'s annotated types, else what would (``an integer >= 1``).
    Counts and ports are >= 1 and prices >= 0. Raises KeyError for a field SlurmConfig lacks."""
    kinds = FIELD_KINDS[key]
    if v is None and "None" in kinds:
        return None
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    texts = [v] if isinstance(v, str) else [*v, *v.values()] if isinstance(v, dict) else v if isinstance(v, list) else []
    if any(control_problem(t) for t in texts):
        return f"{_WORDS[kinds[0]]} without control characters (one line: a newline would reach the sbatch script)"
    if key in NAMES and isinstance(v, str) and any(c.isspace() for c in v):
        return "a Slurm name without white space (it would split into more sbatch options)"
    for kind in kinds:
        if kind == "str" and isinstance(v, str) and v.strip():
            return None
        if kind == "int" and number and isinstance(v, int) and v >= 1:
            return None
        if kind == "float" and number and v == v and v >= 0:
            return None
        if kind == "bool" and isinstance(v, bool):
            return None
        if kind == "dict" and isinstance(v, dict) and all(isinstance(x, str) for x in (*v, *v.values())):
            return None
        if kind == "tuple" and isinstance(v, list) and all(isinstance(x, str) for x in v):
            return None
    return " or ".join(w for w in (_WORDS.get(k, k) for k in kinds) if w)
