"""Every ``SFTCTL_*`` environment variable, declared once: name, type, default, meaning, who sets it.

Two kinds:

* **user** settings configure sftctl on the machine you run it on (``SFTCTL_HOME``, the state's
  busy timeout, cloud endpoints, caches, ...). Most can also be written in the config file (its
  ``file`` key below); the environment overrides the file, and the file overrides the default.
* **node** settings are the environment of a job's node and training processes: the controller
  exports them to every node (``SFTCTL_JOB_ID``, ``SFTCTL_NODE_RANK``, ``SFTCTL_TRAIN_STEPS``, ...;
  :func:`node_env` builds them from these declarations), the provider or node daemon adds where
  the node keeps its files (``SFTCTL_NODE_DIR``, ...), and tests set fault-injection knobs
  through a spec's ``env:``. :mod:`sftctl.train`, :mod:`sftctl.node` and :mod:`sftctl.agent`
  read them with :func:`get`.

The config file is ``$SFTCTL_CONFIG`` when set; else ``config.yaml`` in the user config
directory (``platformdirs.user_config_dir("sftctl")``: ``$XDG_CONFIG_HOME/sftctl/config.yaml``,
``~/.config/sftctl/config.yaml``); else, for configurations written before that existed,
``$SFTCTL_HOME/config.yaml``. Only the first of these that exists is read; a file that
``$SFTCTL_CONFIG`` names must exist. The file is validated as a whole when it is read (keys,
types, the ``slurm:`` section against ``SlurmConfig``); :func:`validate_all` checks every user
setting (the CLI checks the file before every command, the api every setting before it uses a
spec). Example::

    defaults: {clouds: [aws, slurm], regions: [us-east-1], storage: "s3://my-lab-bucket/sftctl"}
    state: {busy_timeout_ms: 30000}   # or {url: "postgresql://sftctl@db.lab/sftctl"}
    aws: {instance_profile: sftctl-node}
    kubernetes: {context: lab, namespace: training}
    slurm: {host: login.example.org, user: me, partition: gpu, gpu_hour_usd: 0.9}

The ``slurm:`` section is the Slurm provider's (:class:`sftctl.slurm_config.SlurmConfig`: a
login node, partition, account, and ``gpu_hour_usd``/``cpu_hour_usd``, the prices the lab pays
for its own GPUs and CPUs); a job spec's ``slurm:`` overrides it field by field.

``python -m sftctl.settings --markdown`` prints the table docs/settings.md carries (a test compares them).

Importing this module is cheap (``os``, ``typing``, :mod:`sftctl.errors`); the config file is read
(:mod:`sftctl.config_file`), with the job spec's YAML 1.2 loader (:mod:`sftctl.yaml12`, no
pydantic), the first time a user setting is asked for that the environment does not set.
:class:`SettingError` is :class:`sftctl.config_file.SettingError`.
"""

from __future__ import annotations

import functools
import os
import re
import typing

import sftctl.config_file as config_file
from sftctl.config_file import SettingError
from sftctl.types.nodes import _FINDERS

PREFIX = "SFTCTL_"
USER, NODE = "user", "node"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Setting:
    """One declared variable.

    Attributes:
        name: the environment variable, ``SFTCTL_...``.
        type: ``str``, ``path``, ``int``, ``float``, ``bool`` (1/0, true/false, yes/no, on/off),
            ``choice`` (one of ``choices``) or ``list`` (comma-separated in the environment, a
            YAML list in the file; each one of ``choices`` when given) or ``paths`` (a list of
            paths, ``os.pathsep``-separated in the environment, a YAML list in the file).
        default: the value when unset (None: unset is a state of its own); ``shown_default``
            is how the table shows a default computed at run time.
        meaning: one line for the table.
        set_by: who sets it: ``user``, ``controller`` (exported to every node), ``provider``
            (the provider or node daemon, on the node), ``tests`` (fault injection).
        scope: ``user`` (read where sftctl runs) or ``node`` (a node's environment).
        file: the dotted key in the config file, or None (environment only).
        minimum: the smallest value an ``int``/``float`` may take.
        choices: the values a ``choice`` may take.
        check: for a ``str``: called with the text; ``(problem, hint)`` when it is malformed
            (``SFTCTL_STATE_URL``: a ``scheme://`` that is not Postgres's), else None.
    """

    __slots__ = ("name", "type", "default", "meaning", "set_by", "scope", "file", "minimum", "_choices",
                 "shown_default", "check")

    def __init__(self, name: str, type: str, default: typing.Any, meaning: str, set_by: str, scope: str, *,
                 file: str | None = None, minimum: float | None = None,
                 choices: tuple | typing.Callable[[], tuple] = (), shown_default: str | None = None,
                 check: typing.Callable[[str], tuple[str, str] | None] | None = None):
        self.name, self.type, self.default, self.meaning = name, type, default, meaning
        self.set_by, self.scope, self.file = set_by, scope, file
        self.minimum, self._choices, self.shown_default = minimum, choices, shown_default
        self.check = check

    @property
    def choices(self) -> tuple:
        """The values a ``choice`` or ``list`` item may take (a callable declared is asked each
        time: :func:`provider_names` for ``SFTCTL_CLOUDS``)."""
        return self._choices() if callable(self._choices) else self._choices

    @property
    def key(self) -> str:
        """The keyword :func:`node_env` takes: ``SFTCTL_NODE_RANK`` -> ``node_rank``."""
        return self.name[len(PREFIX):].lower()

    def expected(self) -> str:
        """What a valid value looks like, for messages and the table."""
        if self.type == "int":
            return "an integer" + (f" >= {self.minimum}" if self.minimum is not None else "")
        if self.type == "float":
            return "a number" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
        if self.type == "bool":
            return "1 or 0"
        if self.type in ("choice", "list") and self.choices:
            one = " or ".join((", ".join(self.choices[:-1]), self.choices[-1])) if len(self.choices) > 1 \
                else self.choices[0]
            return f"a comma-separated list of {one}" if self.type == "list" else one
        if self.type == "list":
            return "a comma-separated list"
        if self.type == "paths":
            return f"paths separated by {os.pathsep!r}"
        return "a path" if self.type == "path" else "text"

    def parse(self, raw: str, where: str | None = None) -> typing.Any:
        """The typed value of ``raw`` (stripped). ``where`` names its origin in messages
        (default: the variable).

        Raises:
            SettingError: ``raw`` is not of this setting's type, or is below ``minimum``.
        """
        where = where or self.name
        text = raw.strip()
        if self.type in ("int", "float"):
            try:
                value = int(text) if self.type == "int" else float(text)
            except ValueError:
                raise SettingError(f"{where}: expected {'an integer' if self.type == 'int' else 'a number'}, "
                                   f"got {raw!r}", hint=self._hint()) from None
            if self.type == "float" and value != value:
                raise SettingError(f"{where}: expected a number, got {raw!r}", hint=self._hint())
            if self.minimum is not None and value < self.minimum:
                raise SettingError(f"{where}: must be >= {self.minimum}, got {value}", hint=self._hint())
            return value
        if self.type == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise SettingError(f"{where}: expected 1 or 0, got {raw!r}", hint=self._hint())
        if self.type == "choice":
            if text.lower() not in self.choices:
                raise SettingError(f"{where}: expected {self.expected()}, got {text.lower()!r}", hint=self._hint())
            return text.lower()
        if self.type == "list":
            items = [item.strip() for item in text.split(",") if item.strip()]
            bad = [item for item in items if self.choices and item not in self.choices]
            if bad or not items:
                raise SettingError(f"{where}: expected {self.expected()}, got {bad[0] if bad else raw!r}",
                                   hint=self._hint())
            return items
        if self.type == "path":
            return os.path.expanduser(text)
        if self.type == "paths":
            paths = [os.path.expanduser(p.strip()) for p in text.split(os.pathsep) if p.strip()]
            if not paths:
                raise SettingError(f"{where}: expected {self.expected()}, got {raw!r}", hint=self._hint())
            return paths
        problem = self.check(text) if self.check is not None else None
        if problem is not None:
            raise SettingError(f"{where}: {problem[0]}", hint=problem[1])
        return text

    def format(self, value: typing.Any) -> str:
        """``value`` as the environment carries it (bools as 1/0)."""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, (list, tuple)):
            return (os.pathsep if self.type == "paths" else ",").join(map(str, value))
        return str(value)

    def _hint(self) -> str:
        return f"set {self.name} to {self.expected()} ({self.meaning}), or unset it"


def _state_url_problem(text: str) -> tuple[str, str] | None:
    """``SFTCTL_STATE_URL``: a ``scheme://`` other than ``postgresql://``/``postgres://`` is an
    error (it was a SQLite file named ``mysql:/x``); no ``://`` is a SQLite file path."""
    scheme, sep, _ = text.partition("://")
    if not sep or scheme in ("postgresql", "postgres"):
        return None
    return (f"{scheme}:// is not a state database sftctl supports: use a postgresql:// (or postgres://) URL "
            "or a SQLite file path",
            "set SFTCTL_STATE_URL (config state.url) to postgresql://USER@HOST/DB (pip install 'sftctl[server]') "
            "or to a SQLite file, or unset it for $SFTCTL_HOME/state.db")


def _u(name, type, default, meaning, set_by="user", **kw) -> Setting:
    return Setting(PREFIX + name, type, default, meaning, set_by, USER, **kw)


def _n(name, type, default, meaning, set_by="controller", **kw) -> Setting:
    return Setting(PREFIX + name, type, default, meaning, set_by, NODE, **kw)


#: Every variable, user settings first, then the node environment. docs/settings.md's table is this.
DECLARED: tuple[Setting, ...] = (
    # ---- user / operator settings: read where sftctl runs
    _u("HOME", "path", None, "where sftctl keeps its state (state.db) and job files",
       shown_default="platformdirs user data dir (~/.local/share/sftctl)"),
    _u("CONFIG", "path", None, "the config file (see Settings)",
       shown_default="$XDG_CONFIG_HOME/sftctl/config.yaml, else $SFTCTL_HOME/config.yaml"),
    _u("STATE_BUSY_TIMEOUT_MS", "int", 60_000, "how long a state write waits for another writer's lock (ms)",
       file="state.busy_timeout_ms", minimum=1),
    _u("STATE_URL", "str", None, "the state database: a postgresql:// URL (a lab's shared state; "
       "pip install -e '.[server]' in a clone) or a SQLite file", file="state.url", shown_default="$SFTCTL_HOME/state.db",
       check=_state_url_problem),
    _u("STATE_RETRY_S", "float", 60.0, "how long the state database is retried while it is unreachable (s; events "
       "are held back meanwhile); a controller and a queued job ride out 1800 s at least "
       "(sftctl.queue.STATE_OUTAGE_S), longer when this is", set_by="user, tests", file="state.retry_s", minimum=0),
    _u("STATE_LEASE_S", "float", 90.0, "a controller's lease on its job in a shared (Postgres) state lasts this "
       "long unless renewed (s)", set_by="user, tests", file="state.lease_s", minimum=1),
    _u("CLOUDS", "list", None, "the clouds a spec without resources.clouds may use", file="defaults.clouds",
       choices=lambda: provider_names(), shown_default="every configured cloud"),
    _u("PROVIDERS", "list", None, "more providers, each NAME=MODULE: a module on sys.path declaring "
       "PROVIDER = sftctl.providers.base.ProviderEntry(NAME, ...)", shown_default="none"),
    _u("REGIONS", "list", None, "the regions a spec without resources.regions may use", file="defaults.regions",
       shown_default="every region"),
    _u("SERVER_URL", "str", None, "the sftctl server the CLI and sftctl.api use instead of this machine's state "
       "(sftctl server start)", file="server.url", shown_default="none: this machine"),
    _u("SERVER_TOKEN", "str", None, "your token on that server (sftctl server user add prints it)",
       file="server.token", shown_default="none"),
    _u("SERVER_RETRY_S", "float", 180.0, "how long a client following a job on that server (run, wait, logs -f) "
       "retries while the server cannot be reached, then exits 75 (s; the job goes on)", set_by="user, tests",
       file="server.retry_s", minimum=0),
    _u("SECRETS_KEY", "str", None, "the key users' secrets are encrypted with in the state (32 bytes, URL-safe "
       "base64: python -m sftctl.vault --new-key); every server on one Postgres state sets the same one",
       set_by="server admin", shown_default="$SFTCTL_HOME/secrets.key (0600, made on first use)"),
    _u("SERVER_MAX_BODY_BYTES", "int", 4 << 20, "the server refuses a request body larger than this (bytes; 413), "
       "before reading it", file="server.max_body_bytes", minimum=1024),
    _u("SERVER_MAX_OVERRIDES", "int", 200, "the server refuses a submit with more --set overrides than this",
       file="server.max_overrides", minimum=0),
    _u("SERVER_MAX_OVERRIDE_CHARS", "int", 16384, "the server refuses a submit with a --set override longer than "
       "this (characters)", file="server.max_override_chars", minimum=1),
    _u("SERVER_WRITES_PER_MINUTE", "int", 300, "the server's limit on each user's writes (submit, start, down) per "
       "minute, in bursts of as many (429 past it; 0: no limit)", file="server.writes_per_minute", minimum=0),
    _u("SERVER_WORKDIR_ROOTS", "paths", None, "a server refuses a job whose workdir (symlinks followed) lies "
       "outside these directories; {user} in one is the job's owner (set it on a shared machine)",
       set_by="server admin", file="server.workdir_roots", shown_default="none: any workdir"),
    _u("SERVER_METRICS_TOKEN", "str", None, "the token Prometheus scrapes the server's /metrics with (a secret for "
       "/metrics only; an admin's token works too)", set_by="server admin", file="server.metrics_token",
       shown_default="$SFTCTL_HOME/metrics.token (0600, made on first use)"),
    _u("SERVER_TOKEN_DAYS", "int", 90, "a token from sftctl server user add or token rotate expires after this "
       "many days unless --expires says otherwise", file="server.token_days", minimum=1),
    _u("CATALOG_OVERRIDES", "path", None, "a CSV of negotiated prices that win over the catalog's "
       "(provider,instance_type,region,usd_per_hour,spot_usd_per_hour,note)", file="catalog.overrides",
       shown_default="$XDG_CONFIG_HOME/sftctl/prices.csv"),
    _u("STORAGE", "str", None, "the job storage URL of a spec without storage: (s3://, gs://, pvc://, a directory: "
       "relative to the config file's directory, or from the environment to the current one)",
       file="defaults.storage", shown_default="none"),
    _u("LOCAL_MAX_NODES", "int", None, "the local provider refuses nodes beyond this many (capacity drills)",
       set_by="user, tests", file="local.max_nodes", minimum=0, shown_default="no limit"),
    _u("LOCAL_ADOPT_GRACE_S", "float", 0.0, "a local node outlives its killed controller by this many seconds, "
       "so a new controller of the job (python -m sftctl.controller JOB) adopts it still running (0: it stops "
       "within seconds)", set_by="user, tests", file="local.adopt_grace_s", minimum=0),
    _u("NODE_SANDBOX", "choice", None, "bwrap: each local node runs in a bubblewrap sandbox that cannot act as "
       "this sftctl (its home, state, config, credentials: docs/server.md); off: as sftctl itself "
       "(on a server unsafe: every user's job then runs as the server)", set_by="user, server",
       file="server.node_sandbox", choices=("bwrap", "off"), shown_default="bwrap under sftctl server, else off"),
    _u("SLURM_CONTROLLER_GRACE_S", "float", 300.0, "a Slurm allocation cancels itself when its controller's "
       "heartbeat has not changed for this many seconds (a controller killed -9; 0: never)",
       set_by="user, tests", minimum=0),
    _u("CONTROLLER_SLURM_JOB_ID", "str", None, "the Slurm job a controller placed on Slurm (controller.place: "
       "slurm) runs in; its batch script sets it and clears the job's other SLURM_* variables, so the node "
       "allocations it submits inherit none of them", set_by="provider", shown_default="none"),
    _u("CONTROLLER_K8S_JOB", "str", None, "the Kubernetes Job a controller placed on Kubernetes "
       "(controller.place: kubernetes) runs in; the Job's container environment sets it", set_by="provider",
       shown_default="none"),
    _u("CLOUD_CONTROLLER_GRACE_S", "float", 1800.0, "a cloud node (fed by job storage) stops its attempt and "
       "powers itself off when its controller's heartbeat in job storage has not changed for this many seconds "
       "(a controller killed -9, a laptop closed; 0: never)", set_by="user, tests", minimum=0),
    _u("AWS_INSTANCE_PROFILE", "str", None, "the IAM instance profile AWS nodes run with (a spec's "
       "resources.instance_profile wins)", file="aws.instance_profile"),
    _u("AWS_SECRETS_REGION", "str", "us-east-1", "the AWS Secrets Manager region that carries a job's secret "
       "values to its AWS nodes (one region whatever region the nodes run in)", file="aws.secrets_region"),
    _u("GCE_ENDPOINT", "str", None, "the Compute Engine API endpoint (an emulator); also counts as credentials",
       set_by="user, tests", file="gcp.endpoint", shown_default="Google's"),
    _u("TPU_ENDPOINT", "str", None, "the Cloud TPU API endpoint (an emulator); with SFTCTL_GCE_ENDPOINT set and "
       "this unset, GCP listings skip TPUs", set_by="user, tests", file="gcp.tpu_endpoint", shown_default="Google's"),
    _u("K8S_CONTEXT", "str", None, "the kubeconfig context", file="kubernetes.context",
       shown_default="the current context"),
    _u("K8S_NAMESPACE", "str", None, "the Kubernetes namespace", file="kubernetes.namespace",
       shown_default="the context's"),
    _u("PVC_MOUNT", "path", "/mnt/sftctl", "where a pvc:// storage's claim is mounted", file="kubernetes.pvc_mount"),
    _u("NODE_INSTALL", "str", None, "what a cloud node's bootstrap pip-installs", file="node.install",
       shown_default="sftctl[aws,gcp]==<this version>"),
    _u("CODEGEN_CACHE", "path", None, "generated Triton kernels and their resource records",
       file="compiler.codegen_cache", shown_default="~/.cache/sftctl/compiler/codegen"),
    _u("ACCELERATOR", "str", None, "the catalog accelerator the sftensor backend and the codegen schedule for",
       shown_default="the device's"),
    _u("SFTENSOR_FORCE", "bool", False, "sftensor backend: rewrite graphs on the CPU too (interpreted kernels)",
       set_by="user, tests"),
    _u("SFTENSOR_NO_CACHE", "bool", False, "sftensor backend: no disk cache of schedule searches"),
    _u("SFTENSOR_ANALYZE", "bool", True, "sftensor backend: build the IR report of every graph"),
    _u("BAD_MACHINE_DECAY_H", "float", 72.0, "hours a machine a health verdict condemned stays out of every job "
       "(sftctl nodes)", file="health.bad_machine_decay_h", minimum=0),
    # ---- the node environment: exported by the controller for the node and its training
    _n("JOB_ID", "str", None, "the job's id"),
    _n("NODE_RANK", "int", 0, "this node's rank", minimum=0),
    _n("NUM_NODES", "int", 1, "nodes in this attempt", minimum=1),
    _n("NODE_IPS", "str", None, "the nodes' addresses in rank order, comma-separated"),
    _n("NPROC_PER_NODE", "int", 1, "training processes per node (accelerators per node)", minimum=1),
    _n("ATTEMPT", "int", 1, "the attempt number (1, then +1 per relaunch)", minimum=1),
    _n("NODE_GENERATION", "int", 0, "0 for a rank's first node, +1 per replacement", minimum=0),
    _n("RDZV_ENDPOINT", "str", None, "host:port of node 0 for torchrun's c10d rendezvous"),
    _n("RDZV_IS_HOST", "bool", False, "1 on node 0, whose torchrun hosts the c10d store; 0 once node 0's wrapper hosts it"),
    _n("TRAIN_STEPS", "int", None, "train.steps", minimum=1, shown_default="the script's"),
    _n("BATCH_SIZE", "int", None, "sequences per step per rank", minimum=1, shown_default="the script's"),
    _n("CHECKPOINT_INTERVAL", "int", None, "train.checkpoint_interval (steps)", minimum=1,
       shown_default="the script's"),
    _n("KEEP_CHECKPOINTS", "int", 3, "train.keep_checkpoints", minimum=1),
    _n("CHECKPOINT_DIR", "path", "checkpoints", "where checkpoints go"),
    _n("DTYPE", "str", None, "model.dtype", shown_default="the script's"),
    _n("MATMUL_PRECISION", "choice", "highest", "model.matmul_precision", choices=("highest", "high", "medium")),
    _n("GRAD_ACCUM", "int", 1, "micro-batches per optimizer step (elastic resume on fewer nodes)", minimum=1),
    _n("PARALLELISM", "choice", "ddp", "the planned data-parallel strategy", choices=("ddp", "fsdp")),
    _n("ACTIVATION_CHECKPOINTING", "bool", False, "the plan recomputes activations in backward"),
    # the planned parallel layout (sftctl.compiler.layouts; the plan's LAYOUT): degrees per dimension
    _n("TP", "int", 1, "the planned layout's tensor-parallel degree (inside a node)", minimum=1),
    _n("PP", "int", 1, "the planned layout's pipeline-parallel degree (stages)", minimum=1),
    _n("CP", "int", 1, "the planned layout's context-parallel degree (sequence split)", minimum=1),
    _n("EP", "int", 1, "the planned layout's expert-parallel degree", minimum=1),
    _n("DP", "int", 1, "the planned layout's data-parallel degree", minimum=1),
    _n("DP_SHARDING", "choice", "ddp", "the data dimension: ddp, zero1 (optimizer sharded) or fsdp (ZeRO-3)",
       choices=("ddp", "zero1", "fsdp")),
    _n("MICRO_BATCHES", "int", 1, "the planned layout's micro-batches per step per data-parallel rank", minimum=1),
    _n("PP_SCHEDULE", "choice", "1f1b", "the pipeline schedule: 1f1b or interleaved", choices=("1f1b", "interleaved")),
    _n("PP_INTERLEAVE", "int", 1, "model chunks per pipeline stage (interleaved schedule)", minimum=1),
    _n("COMPILE", "str", "none", "train.compile: the torch.compile backend (none: eager)"),
    _n("MODEL_ENTRYPOINT", "str", None, "model.entrypoint (file.py:function)"),
    _n("STORAGE_URL", "str", None, "the job's storage (checkpoints and logs are uploaded there)"),
    _n("CONTROLLER_GRACE_S", "float", 0.0, "the node daemon powers its node off when the controller's heartbeat "
       "has not changed for this many seconds (the controller's SFTCTL_CLOUD_CONTROLLER_GRACE_S; 0: never)",
       set_by="provider", minimum=0),
    _n("POWEROFF", "str", "shutdown -h now", "what the node daemon runs to power its node off when the "
       "controller is gone (EC2 terminates the instance on it; GCE stops it)", set_by="tests"),
    _n("SECRETS_REF", "str", None, "where a cloud node reads the job's secret values (aws-sm://REGION/NAME; "
       "a reference, never a value)", set_by="provider"),
    _n("WORKDIR_KEY", "str", None, "the packed workdir's key in the job's storage"),
    _n("WORKDIR_STORAGE", "str", None, "the storage holding the packed workdir, when not the job's"),
    _n("HEALTH_INTERVAL_S", "float", 2.0, "health.interval_s: seconds between GPU samples", minimum=0),
    _n("AGENT_ADDRESS", "str", "127.0.0.1", "health.metrics_address: where the agent's /metrics binds"),
    _n("PREFLIGHT", "choice", "off", "health.preflight: the node's check before training (sftctl.preflight)",
       choices=("off", "quick", "full")),
    _n("PREFLIGHT_GEMM_S", "float", None, "the predicted seconds of the preflight's matmul on this node's device",
       minimum=0, shown_default="not judged"),
    _n("PREFLIGHT_REFERENCE", "choice", "compiler", "where SFTCTL_PREFLIGHT_GEMM_S comes from: the compiler's GEMM "
       "time, or the CPU matmul measured on the controller's machine", choices=("compiler", "cpu")),
    _n("PREFLIGHT_BUS_GBPS", "float", None, "the predicted all-reduce bus bandwidth across the job's nodes (GB/s)",
       minimum=0, shown_default="not predicted"),
    _n("PREFLIGHT_MIN_FRACTION", "float", 0.6, "health.preflight_min_fraction", minimum=0),
    _n("PREFLIGHT_DCGM_LEVEL", "int", 1, "the preflight's dcgmi diag -r level (2 for long jobs)", minimum=1),
    _n("PREFLIGHT_PERIODIC", "bool", False, "a matmul check at every checkpoint (a job predicted longer than "
       "health.preflight_long_job_h)"),
    # ---- the node environment: set on the node by the provider or node daemon
    _n("NODE_ID", "str", None, "the node's id", set_by="provider"),
    _n("TPU_WORKER", "int", None, "this host's worker number in its Cloud TPU slice (0 is the node itself; the TPU "
       "VM metadata's agent-worker-number when unset)", set_by="provider", shown_default="the metadata's"),
    _n("TPU_HOSTS", "int", None, "the hosts of this node's Cloud TPU slice", set_by="provider",
       shown_default="not a TPU"),
    _n("TPU_CHIPS_PER_HOST", "int", None, "the TPU chips this host drives", set_by="provider",
       shown_default="not a TPU"),
    _n("NODE_DIR", "path", ".", "the node's directory (logs, exit files, health.jsonl)", set_by="provider"),
    _n("METRICS_DIR", "path", None, "where sftctl.train.report appends step records", set_by="provider",
       shown_default="off"),
    _n("PYTHON", "path", None, "the Python with sftctl that node scripts use", set_by="provider",
       shown_default="python3"),
    _n("WORKDIR", "path", None, "the workdir the node daemon fetched from job storage", set_by="provider"),
    _n("NODE_HOME", "str", None, "tags local node processes with the sftctl home that started them",
       set_by="provider"),
    _n("SLURM_JOB_ID", "str", None, "the Slurm job of this attempt", set_by="provider"),
    _n("SLURM_NODE", "str", None, "the Slurm node this rank runs on", set_by="provider"),
    _n("VENV", "path", "/opt/sftctl", "a cloud node's sftctl virtualenv (an image with it skips the install)",
       set_by="user"),
    _n("NODE_POLL_S", "float", 1.0, "seconds between the node daemon's polls of job storage", set_by="tests",
       minimum=0),
    _n("HEARTBEAT_S", "float", 2.0, "seconds between sftctl.train's heartbeats", set_by="user, tests", minimum=0),
    _n("AGENT_PORT", "int", 0, "the node agent serves /metrics on this port (0: off)", set_by="user", minimum=0),
    _n("AGENT_METRICS_TOKEN", "str", None, "the bearer token the node agent's /metrics asks for (a secret: set it in "
       "secrets:)", set_by="user", shown_default="agent-metrics.token in the node's directory (0600, made on first use)"),
    _n("TELEMETRY_REPLAY", "path", None, "the node agent replays this recorded telemetry instead of NVML",
       set_by="tests"),
    _n("TELEMETRY_REPLAY_RANK", "int", None, "... on this node rank only (its first node)", set_by="tests",
       minimum=0, shown_default="every rank"),
    _n("FAIL_AT_STEP", "int", 0, "examples/gpt: rank 0 raises at this step unless resumed (0: never)",
       set_by="tests", minimum=0),
    _n("PREFLIGHT_SLOW_RANK", "int", None, "this node rank's first node runs its preflight matmuls slower",
       set_by="tests", minimum=0, shown_default="none"),
    _n("PREFLIGHT_SLOW_FACTOR", "float", 8.0, "... by this factor (it runs that many times the matmuls it times)",
       set_by="tests", minimum=1),
    _n("PREFLIGHT_SLOW_NET_RANK", "int", None, "this node rank's first node sends its preflight all-reduce's "
       "bytes at SFTCTL_PREFLIGHT_SLOW_NET_GBPS at most (a throttled NIC)", set_by="tests", minimum=0,
       shown_default="none"),
    _n("PREFLIGHT_SLOW_NET_GBPS", "float", 0.05, "... GB/s (it waits the bytes' time at that rate before each send)",
       set_by="tests", minimum=0),
    _n("SLOW_NODE", "int", None, "examples/gpt: this node rank's first node runs slower", set_by="tests",
       minimum=0, shown_default="none"),
    _n("SLOW_FACTOR", "float", 1.0, "... by this factor", set_by="tests", minimum=1),
    _n("SLOW_FROM_STEP", "int", 0, "... from this step on", set_by="tests", minimum=0),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in DECLARED}

_PROVIDER_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@functools.cache
def builtin_providers() -> tuple[str, ...]:
    """The providers sftctl ships: one package each under ``sftctl/providers/`` (found by
    listing the directory; nothing is imported), this machine's (``local``) first, then by name."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "providers")
    found = [e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(("_", "."))
             and os.path.isfile(os.path.join(e.path, "__init__.py"))]
    return tuple(sorted(found, key=lambda n: (n != "local", n)))


def provider_plugins(environ: typing.Mapping[str, str] | None = None) -> dict[str, str]:
    """The providers ``SFTCTL_PROVIDERS`` adds: name -> the module that declares it.

    Raises:
        SettingError: an entry is not ``NAME=MODULE``, or NAME is a built-in provider's (exit 2).
    """
    out: dict[str, str] = {}
    for item in get("SFTCTL_PROVIDERS", environ) or ():
        name, sep, module = (part.strip() for part in item.partition("="))
        if not sep or not _PROVIDER_NAME.fullmatch(name) or not _MODULE_NAME.fullmatch(module):
            raise SettingError(f"SFTCTL_PROVIDERS: expected NAME=MODULE (e.g. mycloud=mypkg.provider), got {item!r}",
                               hint=declared("SFTCTL_PROVIDERS")._hint())
        if name in builtin_providers():
            raise SettingError(f"SFTCTL_PROVIDERS: {name!r} is a built-in provider's name; give yours another",
                               hint=declared("SFTCTL_PROVIDERS")._hint())
        out[name] = module
    return out


def provider_names(environ: typing.Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Every provider's name: :func:`builtin_providers`, then :func:`provider_plugins`'s. The
    spec's ``resources.clouds`` and ``SFTCTL_CLOUDS`` take these (:mod:`sftctl.providers` finds
    each one's declaration)."""
    return builtin_providers() + tuple(provider_plugins(environ))
_BY_KEY: dict[str, Setting] = {s.key: s for s in DECLARED}


def declared(name: str) -> Setting:
    """The declaration of ``name``. Raises KeyError for a variable nobody declared (a bug)."""
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in sftctl.settings") from None


def raw(name: str, environ: typing.Mapping[str, str] | None = None) -> str | None:
    """The environment's text of ``name`` (stripped), or None when unset or empty."""
    declared(name)
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or None


def get(name: str, environ: typing.Mapping[str, str] | None = None) -> typing.Any:
    """The typed value of ``name``: the environment (``environ``, default ``os.environ``) when
    set and non-empty; else, for a user setting with a ``file`` key and ``environ`` None, the
    config file; else the declared default.

    Raises:
        SettingError: the value is malformed (the message names the variable, or the config
            file's path, line and key); the config file is malformed (exit code 2).
        KeyError: ``name`` is not declared.
    """
    s = declared(name)
    text = raw(name, environ)
    if text is not None:
        return s.parse(text)
    if s.file is not None and environ is None:
        found = _from_file(s)
        if found is not _MISSING:
            return found
    return s.default


def origin(name: str) -> str | None:
    """Where :func:`get` takes ``name``'s value from, for a message that names the cause:
    ``$SFTCTL_CLOUDS`` (the environment), ``<config file>:<line>: defaults.clouds`` (the config
    file), or None (the declared default)."""
    s = declared(name)
    if raw(name) is not None:
        return f"${name}"
    if s.file is not None:
        path, doc, lines = config_document()
        if config_file.value_in(s, path, doc, lines) is not _MISSING:
            return f"{path}:{lines.get(s.file, 1)}: {s.file}"
    return None


def validate_all() -> dict[str, typing.Any]:
    """Every user setting's typed value (environment, config file, default), after checking the
    config file as a whole (:func:`config_document`). :mod:`sftctl.api` calls it before it plans
    or submits anything, so a malformed setting fails there (exit 2), not later in a job.

    Raises:
        SettingError: the first malformed variable or config file problem (exit 2).
    """
    config_document()
    return {s.name: get(s.name) for s in DECLARED if s.scope == USER}


def node_env(**values: typing.Any) -> dict[str, str]:
    """The environment entries of node settings, by keyword: ``node_env(node_rank=1,
    rdzv_is_host=False)`` -> ``{"SFTCTL_NODE_RANK": "1", "SFTCTL_RDZV_IS_HOST": "0"}``.
    None values are left out.

    Raises:
        KeyError: a keyword that names no declared node setting.
    """
    out = {}
    for key, value in values.items():
        s = _BY_KEY.get(key)
        if s is None or s.scope != NODE:
            raise KeyError(f"SFTCTL_{key.upper()} is not a node setting declared in sftctl.settings")
        if value is not None:
            out[s.name] = s.format(value)
    return out


# --------------------------------------------------------------------------------------------
# the config file (read and checked by sftctl.config_file, given these declarations)
# --------------------------------------------------------------------------------------------

_MISSING = config_file.MISSING
#: top-level sections of the config file that belong to others (validated where they are used)
OTHER_SECTIONS = config_file.OTHER_SECTIONS


def config_path() -> str | None:
    """The config file to read: ``$SFTCTL_CONFIG``; else ``config.yaml`` in the user config
    directory when it exists; else ``$SFTCTL_HOME/config.yaml`` when it exists (the old
    location); else None (:func:`sftctl.config_file.locate`).

    Raises:
        SettingError: ``$SFTCTL_CONFIG`` names a file that does not exist, or a directory, FIFO,
            device or socket (exit 2).
    """
    return config_file.locate(raw("SFTCTL_CONFIG"), lambda: get("SFTCTL_HOME"))


def config_document() -> tuple[str | None, dict, dict]:
    """``(path, document, lines)`` of the config file: its mapping (``{}`` when there is none)
    and the line of each dotted key. Cached per file version.

    The whole file is validated when it is read (whichever setting asked): every key is
    declared (did-you-mean hint), every value has its setting's type, and the ``slurm:``
    section has :class:`sftctl.slurm_config.SlurmConfig`'s fields and types
    (:func:`sftctl.config_file.document`).

    Raises:
        SettingError: ``$SFTCTL_CONFIG`` names no file; the file cannot be read, is not YAML, is
            not a mapping, has a key no setting declares, or a value of the wrong type (the
            message names the file, line and key; exit 2).
    """
    return config_file.document(config_path(), DECLARED)


def unknown_key(dotted: str, options: list[str]) -> SettingError:
    """The error for a key of one of :data:`OTHER_SECTIONS` that its owner does not know
    (``slurm.partion``), naming the config file and line, with a did-you-mean hint."""
    path, _, lines = config_document()
    try:
        config_file.unknown(path or "config file", lines, dotted, options)
    except SettingError as e:
        return e


def _from_file(s: Setting) -> typing.Any:
    path, doc, lines = config_document()
    return config_file.value_in(s, path, doc, lines)


def section(name: str) -> tuple[str | None, dict, int]:
    """``(path, mapping, line)`` of one of :data:`OTHER_SECTIONS` of the config file (``{}``
    when absent); the caller validates its fields.

    Raises:
        SettingError: the config file is malformed, or the section is not a mapping.
    """
    path, doc, lines = config_document()
    value = doc.get(name)
    if value is None:
        return path, {}, 0
    if not isinstance(value, dict):
        raise SettingError(f"{path}:{lines.get(name, 1)}: {name}: expected a mapping", hint=f"write `{name}: {{key: value}}`")
    return path, value, lines.get(name, 1)


# --------------------------------------------------------------------------------------------
# docs/settings.md's table
# --------------------------------------------------------------------------------------------


def markdown() -> str:
    """The settings as two Markdown tables (user settings; the node environment)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def default(s: Setting) -> str:
        if s.shown_default is not None:
            return cell(s.shown_default)
        if s.default is None:
            return "unset"
        return f"`{s.format(s.default)}`"

    out = ["User settings (read where sftctl runs; the environment overrides the config file):", "",
           "| Variable | Config file key | Type | Default | Set by | Meaning |",
           "|---|---|---|---|---|---|"]
    for s in DECLARED:
        if s.scope == USER:
            out.append(f"| `{s.name}` | {f'`{s.file}`' if s.file else '-'} | {cell(s.expected())} | {default(s)} "
                       f"| {s.set_by} | {cell(s.meaning)} |")
    out += ["", "Node environment (what a node's scripts and training see; `sftctl.train` reads it):", "",
            "| Variable | Type | Default | Set by | Meaning |", "|---|---|---|---|---|"]
    for s in DECLARED:
        if s.scope == NODE:
            out.append(f"| `{s.name}` | {cell(s.expected())} | {default(s)} | {s.set_by} | {cell(s.meaning)} |")
    return "\n".join(out) + "\n"


def _import_provider_plugin(name: str) -> None:
    """How :func:`sftctl.types.capabilities` and ``NodeHandle.parse`` find a plugin provider's
    handle class before anything imported it: import the module ``SFTCTL_PROVIDERS`` names for
    ``name`` (which defines the class); here, not in :mod:`sftctl.providers`, so a light caller
    (the state's reaper, the queue's waiting stage, ``sftctl status``) needs no provider package."""
    import importlib

    module = provider_plugins().get(name)
    if module is not None:
        importlib.import_module(module)


_FINDERS.append(_import_provider_plugin)


def main(argv: list[str] | None = None) -> int:
    """``python -m sftctl.settings [--markdown]``: the table, or each user setting's value and
    where it came from."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if args:
        print("usage: python -m sftctl.settings [--markdown]", file=sys.stderr)
        return 2
    try:
        validate_all()  # a problem is one error line, before any value is shown
        path = config_path()
        for s in DECLARED:
            if s.scope == USER:
                source = "environment" if raw(s.name) else ("config" if s.file and _from_file(s) is not _MISSING
                                                             else "default")
                print(f"{s.name}={'' if get(s.name) is None else s.format(get(s.name))}  ({source})")
    except SettingError as e:
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return int(e.exit_code)
    print(f"# config file: {path or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
