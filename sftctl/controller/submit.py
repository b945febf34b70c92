"""Submit-time rules of a job and what its nodes are given: the ownership of a spec's
``train.checkpoint_dir``, the secrets a node refuses to run without, the environment every node
gets (:func:`node_env`, :func:`node_env_names`), where the job keeps its storage, and the job's
provider wired to that storage (:func:`job_provider`), and where the job's controller runs
(``controller.place``: :func:`check_controller_place`; the arguments that submit it as a Slurm
job or a Kubernetes Job, which :func:`sftctl.controller.launch.place_controller` submits;
:func:`stop_placed_controller` ends that job).

The api checks a spec with these before it records the job; the controller, ``down`` and the
dry-run preview build nodes' environments and providers with the same functions."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sftctl import __version__, settings
from sftctl.compiler.layouts.offering import launch_env
from sftctl.controller.placements import placement_of
from sftctl.controller.preflight import preflight_env
from sftctl.controller.slots import NodeSlot
from sftctl.errors import SpecError
from sftctl.paths import job_dir
from sftctl.planner import per_rank_batch
from sftctl.protocol import is_secret_name
from sftctl.providers import checked_class
from sftctl.providers.base import BuiltForJob
from sftctl.spec import JobSpec, env_references, resolve_env
from sftctl.state import JobRecord, Store
from sftctl.storage import open_storage
from sftctl.storage.checkpoints import complete_checkpoint_steps
from sftctl.storage.stream import NodeChannel
from sftctl.types import NodeHandle, Plan
from sftctl.types.layout import Layout

OWNER_FILE = ".sftctl-job"  # in a spec's train.checkpoint_dir: the job whose checkpoints it holds


def checkpoint_dir_path(spec: JobSpec) -> Path | None:
    """The spec's own ``train.checkpoint_dir`` on this machine (relative to the workdir, where
    the nodes run), or None when the job keeps checkpoints in its job dir or its storage."""
    if spec.train.checkpoint_dir is None or spec.storage is not None:
        return None
    return (Path(spec.workdir) / os.path.expanduser(spec.train.checkpoint_dir)).resolve()


def check_checkpoint_dir(spec: JobSpec) -> None:
    """Refuse a ``train.checkpoint_dir`` that holds another run's checkpoints (a new job would
    silently resume its weights) unless ``train.resume_from`` names that job (or is ``any``).

    Raises:
        SpecError: the directory holds complete checkpoints of another job or of an unknown run.
    """
    root = checkpoint_dir_path(spec)
    if root is None or not root.is_dir():
        return
    steps = complete_checkpoint_steps(root)
    if not steps:
        return
    owner = _read_owner(root)
    wanted = spec.train.resume_from
    if wanted == "any" or (wanted is not None and wanted == owner):
        return
    whose = f"job {owner}" if owner else "a run sftctl did not start"
    if wanted is not None:
        raise SpecError(f"train.resume_from: {wanted} but {root} holds the checkpoints of {whose}",
                        hint=f"set train.resume_from: {owner or 'any'}, or give an empty train.checkpoint_dir")
    raise SpecError(
        f"train.checkpoint_dir: {root} holds checkpoints of {whose} (up to step {steps[-1]}); "
        "this job would resume from them",
        hint=f"to continue that run set train.resume_from: {owner or 'any'}; for a fresh start use another "
             "checkpoint_dir (or none: each job gets its own)",
    )


def check_checkpoint_owner(spec: JobSpec, user: str | None) -> None:
    """In a server, refuse a ``train.checkpoint_dir`` that holds the checkpoints of another
    user's job (its owner file names a job of the state whose owner is not ``user``), even
    with ``resume_from: any``: the nodes get it read-write (that user's weights, and a
    checkpoint the other user's next resume would load).

    Raises:
        SpecError: one line naming the field and the fix (exit 2).
    """
    root = checkpoint_dir_path(spec)
    owner = _read_owner(root) if root is not None and root.is_dir() else None
    if owner is None:
        return
    store = Store()
    try:
        job = store.get_job(owner)
    finally:
        store.close()
    if job is not None and job.owner != user:
        raise SpecError(f"train.checkpoint_dir: {root} holds the checkpoints of another user's job; "
                        f"a job may use only its owner's",
                        hint="give a checkpoint_dir of your own (or none: each job gets its own)")


def claim_checkpoint_dir(root: str | os.PathLike | None, job_id: str) -> None:
    """Mark ``root``, a spec's ``train.checkpoint_dir`` (:func:`checkpoint_dir_path`; the launch
    request's ``checkpoint_claim``), as holding this job's checkpoints; None: nothing to claim."""
    if root is None:
        return
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / OWNER_FILE).unlink(missing_ok=True)  # a link a node left there: the name, never its target
        fd = os.open(root / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(job_id + "\n")
    except OSError:  # a read-only dir: the training script's own save says so, with its error
        pass


#: the most bytes of an owner file read (a job id is a few dozen)
OWNER_MAX_BYTES = 256


def _read_owner(root: Path) -> str | None:
    """The job id in ``root``'s :data:`OWNER_FILE`, or None: missing, unreadable, not a regular
    file, a symlink (the job's nodes write in ``root``: a link to the server's secrets key was
    read through and shown in an error) or not a job id's text."""
    import stat

    try:
        fd = os.open(root / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        text = f.read(OWNER_MAX_BYTES).decode("utf-8", "replace").strip()
    return text if text and text.isprintable() and len(text) < OWNER_MAX_BYTES else None


def job_storage_url(spec: JobSpec, job_id: str) -> str | None:
    """Where this job keeps its code, checkpoints, logs and telemetry: ``<storage.url>/<job id>``."""
    if spec.storage is None:
        return None
    return f"{spec.storage.url.rstrip('/')}/{job_id}"


def job_provider(job: JobRecord, name: str | None = None, environ: Mapping[str, str] | None = None):
    """The provider of ``job`` (``name`` overrides the recorded one), wired to the job's storage.
    ``environ``: where the secret values a Kubernetes or AWS provider carries come from (the
    controller passes :func:`sftctl.vault.job_environ`); None: this environment, except for a job
    submitted through a server, whose provider then carries none (``down``, ``logs``: nothing
    is launched)."""
    name = name or job.provider or "local"
    spec = JobSpec.model_validate(job.spec)
    url = job_storage_url(spec, job.id)
    secret_env = secret_env_keys(spec)

    def channel() -> NodeChannel | None:
        return None if url is None else NodeChannel(open_storage(url), secret_keys=set(spec.secrets) | secret_env)

    def secrets() -> dict[str, str]:  # what a Kubernetes Secret / AWS Secrets Manager carries
        env = environ
        if env is None:
            env = {} if job.secrets_from == "store" else os.environ  # never the server's environment
        refs = {k: v for k, v in spec.env.items() if k in secret_env
                and all(n in env for n in env_references(v))}  # `down` from another shell
        return {**{k: env[k] for k in spec.secrets if k in env}, **resolve_env(refs, env)}

    cls = checked_class(name)
    if issubclass(cls, BuiltForJob):  # Slurm's spec config, AWS's profile, the secrets they carry
        return cls.for_job(spec, channel, secrets)
    ch = channel()
    return cls() if ch is None else cls(channel=ch)


def secret_env_keys(spec: JobSpec) -> set[str]:
    """The ``env:`` variables that carry a secret: their value refers to a variable named in
    ``secrets:`` or one whose name says it is secret (``${MY_API_TOKEN}``, see
    :func:`sftctl.protocol.is_secret_name`). Job storage holds their names, not values;
    on Kubernetes the job's Secret carries them."""
    return {k for k, v in spec.env.items()
            if any(name in spec.secrets or is_secret_name(name) for name in env_references(v))}


def required_secrets(spec: JobSpec) -> list[str]:
    """The variables a node refuses to run without (``templates/node.sh.j2``): every name in
    ``secrets:`` and every ``env:`` variable that carries a secret (:func:`secret_env_keys`), so
    a secret that did not arrive stops the attempt with a line naming it, never runs empty."""
    names = set(spec.secrets) | secret_env_keys(spec)
    return sorted(n for n in names if n.isascii() and n.isidentifier())


def default_install() -> str:
    """What a cloud node's bootstrap pip-installs: this sftctl's version with the cloud extras."""
    return f"sftctl[aws,gcp]=={__version__}"


def store_port(port: int | str) -> int | str:
    """The port of the job's c10d rendezvous store (``SFTCTL_RDZV_ENDPOINT``, hosted by node 0's
    wrapper: sftctl/train/rendezvous.py) for the job's claimed ``port`` (``MASTER_PORT``): the
    next one, which the claim covers too (ports.claim_rendezvous_port). A placeholder (the dry
    run's ``<rendezvous port>``) gives ``<rendezvous port>+1``."""
    return port + 1 if isinstance(port, int) else f"{port}+1"


def node_env(spec: JobSpec, job_id: str, plan: Plan, nodes: list[NodeSlot], rank: int, attempt: int,
             master_port: int | str, workdir_key: str | None = None,
             environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment node ``rank`` of ``nodes`` gets for ``attempt`` on the plan's offering:
    the spec's ``env`` and sftctl's own variables (``nodes``: the job's slots in node-rank order,
    their handles' ``ip`` giving the addresses; ``workdir_key``: the workdir pack in job storage).
    ``environ``: where ``${VAR}`` and ``secrets:`` take their values (the controller passes
    :func:`sftctl.vault.job_environ`); then a ``secrets:`` name it lacks is set empty, so the
    node refuses to run rather than inherit a value of that name from the controller's
    environment. None: this process's environment (a name it lacks is left out).

    ``SFTCTL_NODE_IPS`` is comma-separated in node-rank order; ``MASTER_ADDR``/``MASTER_PORT``
    (``master_port``) and ``SFTCTL_RDZV_ENDPOINT`` (``master_port`` + 1: torchrun's c10d store,
    which node 0's wrapper hosts, sftctl/train/rendezvous.py) point at node 0.
    """
    offering = plan.offering
    ips = [(n.handle.ip if n.handle is not None else None) or "127.0.0.1" for n in nodes]
    if environ is None:
        env = resolve_env(spec.env)  # the spec holds ${VAR} references; values only reach the node
        env.update({k: os.environ[k] for k in spec.secrets if k in os.environ})  # values never stored
    else:
        env = resolve_env(spec.env, environ)
        env.update({k: environ[k] if k in environ else "" for k in spec.secrets})
    url = job_storage_url(spec, job_id)
    if url is not None:  # nodes keep checkpoints on their disk and in the job's storage
        env.update(settings.node_env(storage_url=url))
        if workdir_key:
            env.update(settings.node_env(workdir_key=workdir_key, workdir_storage=spec.storage.url))
        if spec.train.checkpoint_dir:
            env.update(settings.node_env(checkpoint_dir=spec.train.checkpoint_dir))
    else:
        env.update(settings.node_env(
            checkpoint_dir=spec.train.checkpoint_dir or str(job_dir(job_id) / "checkpoints")))
    # the node's SFTCTL_* variables: names and formats from sftctl.settings
    env.update(settings.node_env(
        keep_checkpoints=spec.train.keep_checkpoints,
        compile=spec.train.compile,
        # the strategy the plan chose for this offering (sftctl.train.prepare runs it)
        parallelism=plan.planned("parallelism") or (
            spec.train.parallelism if spec.train.parallelism != "auto" else "ddp"),
        activation_checkpointing=bool(plan.planned("activation_checkpointing")
                                      or spec.train.activation_checkpointing),
        grad_accum=max(1, spec.resources.nodes // len(nodes)),
        job_id=job_id,
        node_rank=rank,
        num_nodes=len(nodes),
        node_ips=",".join(ips),
        nproc_per_node=offering.count,
        attempt=attempt,
        node_generation=next(n.generation for n in nodes if n.rank == rank),
        health_interval_s=spec.health.interval_s,
        agent_address=spec.health.metrics_address,
        checkpoint_interval=spec.train.checkpoint_interval,
        train_steps=spec.train.steps,
    ))
    # the plan's parallel layout (issue 38): SFTCTL_TP, ...; after an elastic resume on fewer nodes,
    # resized to the ranks left, as each rank resizes it (sftctl.train.mesh), so that what
    # `run --dry-run` and `logs` show is what the ranks run
    layout = plan.planned("layout")
    world = None
    if layout and len(nodes) < spec.resources.nodes:
        world = Layout.from_dict(layout).world * len(nodes) // spec.resources.nodes
    env.update(launch_env(layout, world=world))
    # torchrun's c10d store: on this machine's nodes the claim's second port, hosted by node 0's
    # wrapper; elsewhere (a cloud's firewall opens the one port) MASTER_PORT, where the wrapper
    # stands aside and node 0's torchrun hosts it (sftctl/train/rendezvous.py)
    rdzv_port = store_port(master_port) if offering.provider == "local" else master_port
    env.update(
        MASTER_ADDR=ips[0],
        MASTER_PORT=str(master_port),
        **settings.node_env(rdzv_endpoint=f"{ips[0]}:{rdzv_port}", rdzv_is_host=rank == 0),
    )
    env.update(torchrun_env(num_nodes=len(nodes), nproc_per_node=offering.count, rank=rank,
                            endpoint=f"{ips[0]}:{rdzv_port}", job_id=job_id, is_host=rank == 0))
    if spec.model is not None:
        env.update(settings.node_env(
            model_entrypoint=spec.model.entrypoint,
            # the planned per-rank share; fewer nodes than planned (elastic) accumulate more of them
            batch_size=per_rank_batch(spec.model.batch_size, offering.count, spec.resources.nodes, exact=False),
            dtype=spec.model.dtype,
            matmul_precision=spec.model.matmul_precision,
        ))
    env.update(preflight_env(spec, plan))  # health.preflight: what the node checks itself against (issue 41)
    return env


def torchrun_env(num_nodes: int, nproc_per_node: int, rank: int, endpoint: str, job_id: str,
                 is_host: bool, backend: str = "c10d") -> dict[str, str]:
    """torchrun's options for node ``rank`` as its ``PET_<OPTION>`` variables: torchrun reads one
    for each option it is not given, so ``run: torchrun train.py`` joins the job's rendezvous
    (``endpoint``, ``host:port``; id ``job_id``) without spelling out ``--nnodes --rdzv-*``.

    ``PET_NODE_RANK`` only with ``backend="static"``: a c10d rendezvous assigns node ranks
    itself, ignores ``--node-rank`` and warns on every node but 0 that it does (torch's
    ``torch/distributed/run.py``: ``node_rank is only used for static rdzv_backend``); the rank
    stays in ``SFTCTL_NODE_RANK``. ``PET_MAX_RESTARTS=0``: sftctl restarts the job itself, from
    its last checkpoint."""
    env = {
        "PET_NNODES": str(num_nodes),
        "PET_NPROC_PER_NODE": str(nproc_per_node),
        "PET_RDZV_BACKEND": backend,
        "PET_RDZV_ENDPOINT": endpoint,
        "PET_RDZV_ID": job_id,
        "PET_RDZV_CONF": f"is_host={1 if is_host else 0}",
        "PET_MAX_RESTARTS": "0",
    }
    if backend == "static":
        env["PET_NODE_RANK"] = str(rank)
    return env


class EveryName(Mapping):
    """An environment in which every variable is set to ``value`` (default empty): :func:`node_env`
    builds the names a node gets without reading any value (:func:`node_env_names`, the dry run's
    preview); with another value, the variables whose value comes from the environment show."""

    def __init__(self, value: str = ""):
        self.value = value

    def __getitem__(self, name: str) -> str:
        return self.value

    def __contains__(self, name: object) -> bool:
        return True

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


#: see :class:`EveryName`
NAMES_ONLY: Mapping[str, str] = EveryName()


def node_env_names(spec: JobSpec, plan: Plan) -> set[str]:
    """The names of the environment every node of ``spec`` gets on the plan's offering (the
    spec's ``env`` and ``secrets``, sftctl's own variables): what ``run:`` may expand."""
    nodes = [NodeSlot("<node>", 0, NodeHandle(job_id="<job-id>", node_id="<node>", rank=0, ip="127.0.0.1"))]
    env = node_env(spec, "<job-id>", plan, nodes, 0, 1, 0,
                   workdir_key="<workdir pack>" if spec.storage is not None else None, environ=NAMES_ONLY)
    return set(env) | set(spec.env) | set(spec.secrets)


# ------------------------------------------------------------------ where the controller runs


def check_controller_place(spec: JobSpec, label: str, *, server: bool, provider: str | None = None) -> None:
    """Refuse a ``controller.place`` that cannot work here, before anything is recorded: the
    placement's own rules (:meth:`sftctl.controller.placements.base.Placement.check`: ``server``
    needs a configured server, ``slurm`` a login node and a state the cluster reaches,
    ``kubernetes`` a Postgres state; neither supervises nodes of this machine).

    ``server``: a server runs the job's commands (this process is it, or the config names one).
    ``provider``: the planned offering's provider (None: before planning, the other checks only).

    Raises:
        SpecError: one line naming ``controller.place`` and the fix (exit 2).
    """
    placement_of(spec).check(spec, label, server=server, provider=provider)


def stop_placed_controller(job: JobRecord, grace_s: float) -> list[str]:
    """End the scheduler's job(s) running or waiting to run ``job``'s placed controller (SIGTERM
    to a running one, which cancels the job and stops its nodes; :meth:`Placement.cancel`: Slurm's
    ``scancel`` after ``grace_s`` seconds, the Kubernetes Job deleted with ``grace_s`` for its pod).
    Returns the ids found ([] for a controller of this machine)."""
    return placement_of(job.spec).cancel(job, grace_s)
