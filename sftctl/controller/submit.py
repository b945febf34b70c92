"""Submit-time rules of a job and what its nodes are given: the ownership of a spec's
``train.checkpoint_dir``, the secrets a node refuses to run without, the environment every node
gets (:func:`node_env`, :func:`node_env_names`), where the job keeps its storage, and the job's
provider wired to that storage (:func:`job_provider`), and where the job's controller runs
(``controller.place``: :func:`check_controller_place`; :func:`place_controller` submits it as a
Slurm job or a Kubernetes Job, :func:`stop_placed_controller` ends that job).

The api checks a spec with these before it records the job; the controller, ``down`` and the
dry-run preview build nodes' environments and providers with the same functions."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sftctl import __version__, settings
from sftctl.controller.slots import NodeSlot
from sftctl.errors import SftctlError, SpecError
from sftctl.paths import job_dir, sftctl_home
from sftctl.procs import module_argv
from sftctl.protocol import is_secret_name
from sftctl.providers import get_provider
from sftctl.providers import kubernetes as k8s_provider
from sftctl.providers import slurm as slurm_provider
from sftctl.spec import JobSpec, env_references, resolve_env
from sftctl.state import QUEUED_CONTROLLER_LEASE_S, JobRecord, Store, is_url, placed, queued_holder
from sftctl.storage import open_storage
from sftctl.storage.checkpoints import complete_checkpoint_steps
from sftctl.storage.stream import NodeChannel
from sftctl.types import FailureCode, JobStatus, NodeHandle, Plan

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
    try:
        owner = (root / OWNER_FILE).read_text().strip() or None
    except OSError:
        owner = None
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


def claim_checkpoint_dir(spec: JobSpec, job_id: str) -> None:
    """Mark the spec's ``train.checkpoint_dir`` as holding this job's checkpoints."""
    root = checkpoint_dir_path(spec)
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / OWNER_FILE).write_text(job_id + "\n")
    except OSError:  # a read-only dir: the training script's own save says so, with its error
        pass


def job_storage_url(spec: JobSpec, job_id: str) -> str | None:
    """Where this job keeps its code, checkpoints, logs and telemetry: ``<storage.url>/<job id>``."""
    if spec.storage is None:
        return None
    return f"{spec.storage.url.rstrip('/')}/{job_id}"


def job_provider(job: JobRecord, name: str | None = None):
    """The provider of ``job`` (``name`` overrides the recorded one), wired to the job's storage."""
    name = name or job.provider or "local"
    spec = JobSpec.model_validate(job.spec)
    url = job_storage_url(spec, job.id)
    if name == "slurm":  # one allocation of resources.nodes, --time from the deadline
        return get_provider(name, config=spec.slurm.model_dump() if spec.slurm else None,
                            num_nodes=spec.resources.nodes, time_limit_s=spec.resources.deadline_s)
    options = _provider_options(spec, name)
    if url is None:
        return get_provider(name, **options)

    kwargs = {}
    secret_env = secret_env_keys(spec)
    if name in ("kubernetes", "aws"):  # a Kubernetes Secret / AWS Secrets Manager carries the values
        refs = {k: v for k, v in spec.env.items() if k in secret_env
                and all(name in os.environ for name in env_references(v))}  # `down` from another shell
        kwargs = {"secrets": {**{k: os.environ[k] for k in spec.secrets if k in os.environ}, **resolve_env(refs)}}
        if name == "kubernetes":  # pods learn the world size
            kwargs["num_nodes"] = spec.resources.nodes
    return get_provider(name, channel=NodeChannel(open_storage(url), secret_keys=set(spec.secrets) | secret_env),
                        **kwargs, **options)


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


def _provider_options(spec: JobSpec, name: str) -> dict:
    """Per-cloud settings from the spec, else from this shell's configuration: the IAM instance
    profile of AWS nodes (``resources.instance_profile``, else ``$SFTCTL_AWS_INSTANCE_PROFILE``)."""
    if name == "aws":
        profile = spec.resources.instance_profile or settings.get("SFTCTL_AWS_INSTANCE_PROFILE")
        if profile:
            return {"instance_profile": profile}
    return {}


def default_install() -> str:
    """What a cloud node's bootstrap pip-installs: this sftctl's version with the cloud extras."""
    return f"sftctl[aws,gcp]=={__version__}"


def node_env(spec: JobSpec, job_id: str, plan: Plan, nodes: list[NodeSlot], rank: int, attempt: int,
             master_port: int | str, workdir_key: str | None = None) -> dict[str, str]:
    """The environment node ``rank`` of ``nodes`` gets for ``attempt`` on the plan's offering:
    the spec's ``env`` and sftctl's own variables (``nodes``: the job's slots in node-rank order,
    their handles' ``ip`` giving the addresses; ``workdir_key``: the workdir pack in job storage).

    ``SFTCTL_NODE_IPS`` is comma-separated in node-rank order; ``MASTER_ADDR``/``MASTER_PORT``
    and ``SFTCTL_RDZV_ENDPOINT`` point at node 0 for torchrun's c10d rendezvous.
    """
    offering = plan.offering
    ips = [(n.handle.ip if n.handle is not None else None) or "127.0.0.1" for n in nodes]
    env = resolve_env(spec.env)  # the spec holds ${VAR} references; values only reach the node
    env.update({k: os.environ[k] for k in spec.secrets if k in os.environ})  # values never stored
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
    env.update(
        MASTER_ADDR=ips[0],
        MASTER_PORT=str(master_port),
        **settings.node_env(rdzv_endpoint=f"{ips[0]}:{master_port}", rdzv_is_host=rank == 0),
        # torchrun reads PET_<OPTION> for each option it is not given, so `run: torchrun
        # train.py` joins the job's rendezvous without spelling out --nnodes --rdzv-*
        PET_NNODES=str(len(nodes)),
        PET_NPROC_PER_NODE=str(offering.count),
        PET_NODE_RANK=str(rank),
        PET_RDZV_BACKEND="c10d",
        PET_RDZV_ENDPOINT=f"{ips[0]}:{master_port}",
        PET_RDZV_ID=job_id,
        PET_RDZV_CONF=f"is_host={1 if rank == 0 else 0}",
        PET_MAX_RESTARTS="0",  # sftctl restarts the job itself, from its last checkpoint
    )
    if spec.model is not None:
        env.update(settings.node_env(
            model_entrypoint=spec.model.entrypoint,
            # the planned per-rank share; fewer nodes than planned (elastic) accumulate more of them
            batch_size=max(1, spec.model.batch_size // (spec.resources.nodes * offering.count)),
            dtype=spec.model.dtype,
            matmul_precision=spec.model.matmul_precision,
        ))
    return env

def node_env_names(spec: JobSpec, plan: Plan) -> set[str]:
    """The names of the environment every node of ``spec`` gets on the plan's offering (the
    spec's ``env`` and ``secrets``, sftctl's own variables): what ``run:`` may expand."""
    nodes = [NodeSlot("<node>", 0, NodeHandle(job_id="<job-id>", node_id="<node>", rank=0, ip="127.0.0.1"))]
    env = node_env(spec, "<job-id>", plan, nodes, 0, 1, 0,
                   workdir_key="<workdir pack>" if spec.storage is not None else None)
    return set(env) | set(spec.env) | set(spec.secrets)


# ------------------------------------------------------------------ where the controller runs


def check_controller_place(spec: JobSpec, label: str, *, server: bool, provider: str | None = None) -> None:
    """Refuse a ``controller.place`` that cannot work here, before anything is recorded.

    ``server``: a server runs the job's commands (this process is it, or the config names one).
    ``provider``: the planned offering's provider (None: before planning, the other checks only).
    ``place: slurm`` needs Slurm's commands (a login node: ``slurm.host`` unset) and a state the
    cluster's nodes reach: Postgres (``state.url``), or this SQLite file on the shared filesystem
    a login node and its compute nodes see; it cannot supervise local nodes. ``place: kubernetes``
    needs a Postgres ``state.url`` (a pod never sees this machine's SQLite file) and cannot
    supervise local nodes either.

    Raises:
        SpecError: one line naming ``controller.place`` and the fix (exit 2).
    """
    place = spec.controller.place
    if place == "server" and not server:
        raise SpecError(f"{label}: controller.place: server, but the config names no sftctl server",
                        hint="add server: {url, token} to the config (sftctl server start makes one), "
                             "or set controller.place: local")
    if place == "kubernetes":
        _check_kubernetes_place(label, provider)
        return
    if place != "slurm":
        return
    if provider == "local":
        raise SpecError(f"{label}: controller.place: slurm cannot supervise local nodes (they run on this machine)",
                        hint="set resources.clouds to where the nodes should run (slurm, aws, gcp, kubernetes), "
                             "or drop controller.place")
    cfg = slurm_provider.load_config(spec.slurm.model_dump() if spec.slurm else None)
    state_url = settings.get("SFTCTL_STATE_URL")
    if cfg.host and not is_url(state_url):
        raise SpecError(
            f"{label}: controller.place: slurm: the job's state is this machine's SQLite file "
            f"({state_url or sftctl_home() / 'state.db'}), which the cluster's nodes cannot reach over SSH "
            f"(slurm.host: {cfg.host})",
            hint="set state.url (SFTCTL_STATE_URL) to a Postgres database the cluster reaches, or run sftctl on "
                 "the cluster's login node, or drop controller.place")
    if cfg.host:
        raise SpecError(f"{label}: controller.place: slurm is not supported over SSH yet (slurm.host: {cfg.host})",
                        hint="run sftctl on the cluster's login node (slurm.host unset), or drop controller.place")
    why = slurm_provider.login_node_reason()
    if why:
        raise SftctlError(f"{label}: controller.place: slurm: {why}", hint="run sftctl on the cluster's login node")


def _check_kubernetes_place(label: str, provider: str | None) -> None:
    """The rules of ``controller.place: kubernetes`` (see :func:`check_controller_place`)."""
    if provider == "local":
        raise SpecError(f"{label}: controller.place: kubernetes cannot supervise local nodes (they run on this machine)",
                        hint="set resources.clouds to where the nodes should run (kubernetes, slurm, aws, gcp), "
                             "or drop controller.place")
    state_url = settings.get("SFTCTL_STATE_URL")
    if not is_url(state_url):
        raise SpecError(
            f"{label}: controller.place: kubernetes: the job's state is this machine's SQLite file "
            f"({state_url or sftctl_home() / 'state.db'}), which a pod on the cluster cannot reach",
            hint="set state.url (SFTCTL_STATE_URL) to a Postgres database the cluster reaches, "
                 "or drop controller.place")


def controller_provider(spec: JobSpec):
    """The provider that runs the controller of a placed job: Slurm's for ``controller.place:
    slurm`` (the config's ``slurm:`` section overlaid by the spec's, as for Slurm nodes), the
    Kubernetes provider (the configured context and namespace) for ``place: kubernetes``."""
    if spec.controller.place == "kubernetes":
        return get_provider("kubernetes")
    return get_provider("slurm", config=spec.slurm.model_dump() if spec.slurm else None)


def controller_argv(job_id: str, python: str | None = None) -> list[str]:
    """The argv of a placed controller: ``python -m sftctl.queue JOB`` (which becomes the
    controller once the job may start), the same for a Slurm job and a Kubernetes Job."""
    return module_argv("sftctl.queue", job_id, python=python or sys.executable)


#: ``sh -c`` program of a controller Job whose image is the default (``python:3.11-slim``, no
#: sftctl): pip-install ``$0`` unless ``python`` already imports sftctl, then exec the argv
#: (``$@``). An image that has sftctl skips the install.
_INSTALL_THEN_EXEC = ('python -c "import sftctl" 2>/dev/null || pip install --quiet --no-cache-dir "$0" '
                      '|| { echo "sftctl: cannot pip install $0 in the controller pod" >&2; exit 1; }; exec "$@"')


def controller_install() -> str:
    """What a controller Job on the default image pip-installs: ``SFTCTL_NODE_INSTALL`` when
    set (a lab's own index or wheel, as for cloud nodes), else this sftctl's version with the
    extras a controller uses (Postgres state, Kubernetes, the clouds)."""
    return settings.get("SFTCTL_NODE_INSTALL") or f"sftctl[aws,gcp,kubernetes,server]=={__version__}"


def controller_container_command(job_id: str, image: str | None) -> list[str]:
    """The container command of ``job_id``'s controller Job: :func:`controller_argv` with the
    image's ``python``; on the default image (``image`` None: python:3.11-slim, which has no
    sftctl) behind ``sh -c`` that first pip-installs :func:`controller_install` when sftctl is
    missing, as a cloud node's bootstrap does."""
    argv = controller_argv(job_id, "python")
    if image is not None:
        return argv
    return ["sh", "-c", _INSTALL_THEN_EXEC, controller_install(), *argv]


def controller_pod_env(spec: JobSpec, job_name: str, namespace: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(env, secret_env)`` of a controller's Kubernetes Job: plain values (the Job's name,
    ``SFTCTL_CONTROLLER_K8S_JOB``, and the namespace its Kubernetes nodes go to) and what the
    Secret carries (``SFTCTL_STATE_URL``, which holds the database password, and the values of
    the spec's ``secrets:`` in this shell's environment). Secrets travel by name: the state only
    ever records the spec."""
    env = {"SFTCTL_CONTROLLER_K8S_JOB": job_name, "SFTCTL_K8S_NAMESPACE": namespace, "PYTHONUNBUFFERED": "1"}
    secret_env = {"SFTCTL_STATE_URL": settings.get("SFTCTL_STATE_URL"),
                  **{k: os.environ[k] for k in spec.secrets if k in os.environ}}
    return env, secret_env


#: seconds a placed controller's Slurm job runs past the spec's deadline (``--time``): the
#: controller fails the job at its deadline and then tears its nodes down
CONTROLLER_TEARDOWN_S = 600.0


def place_controller(store: Store, job: JobRecord) -> str:
    """Submit the controller of a ``controller.place: slurm`` job as a Slurm job
    (``sftctl-ctl-<job>``, 1 CPU, ``controller.partition`` or ``slurm.partition``, ``--time`` the
    spec's deadline + :data:`CONTROLLER_TEARDOWN_S`, else the partition's default) running
    ``python -m sftctl.queue JOB`` with the config's ``slurm.python`` (default: this
    interpreter, on the shared filesystem); its output goes to the job dir's ``controller.log``.
    Until it starts, the job's lease is held for it (holder ``slurm:<id>``, for
    :data:`~sftctl.state.QUEUED_CONTROLLER_LEASE_S`), so no second controller starts and reads
    do not take the job for one without a controller. Returns the Slurm job id.

    Raises:
        ProviderError: sbatch refused it (exit 4); the job is then FAILED with that line.
    """
    spec = JobSpec.model_validate(job.spec)
    provider = controller_provider(spec)
    if spec.controller.place == "kubernetes":
        return _place_on_kubernetes(store, job, spec, provider)
    job_dir(job.id).mkdir(parents=True, exist_ok=True, mode=0o700)
    args = controller_job_args(spec, job.id, provider)
    partition = args["partition"]
    try:
        slurm_id = provider.submit_controller(job.id, **args)
    except SftctlError as e:  # no controller will come: the job fails now, with Slurm's reason
        store.transition(job.id, JobStatus.FAILED, f"its controller could not be placed on Slurm: {e.message}",
                         strict=False, code=FailureCode.PROVIDER_ERROR.value)
        raise
    store.acquire_lease(job.id, queued_holder("slurm", slurm_id), QUEUED_CONTROLLER_LEASE_S)
    store.add_event(job.id, "controller",
                    f"controller: Slurm job {slurm_id} ({slurm_provider.controller_job_name(job.id)}) in "
                    f"{'partition ' + partition if partition else 'the default partition'}",
                    {"place": "slurm", "slurm_job_id": slurm_id, "partition": partition})
    return slurm_id


def _place_on_kubernetes(store: Store, job: JobRecord, spec: JobSpec, provider) -> str:
    """Create the controller of a ``controller.place: kubernetes`` job as a Kubernetes Job
    (``sftctl-ctl-<job>``, :func:`sftctl.providers.kubernetes.controller_manifests`) running
    :func:`controller_argv` with the image's ``python``; hold the job's lease for it (holder
    ``kubernetes:<Job>``) until it starts. Returns the Job's name.

    Raises:
        ProviderError, CredentialsError: the API server refused it (exit 4); the job is FAILED.
    """
    try:
        ns = provider.namespace
        name = provider.submit_controller(job.id, **kubernetes_controller_args(spec, job.id, ns))
    except SftctlError as e:
        store.transition(job.id, JobStatus.FAILED, f"its controller could not be placed on Kubernetes: {e.message}",
                         strict=False, code=FailureCode.PROVIDER_ERROR.value)
        raise
    store.acquire_lease(job.id, queued_holder("kubernetes", name), QUEUED_CONTROLLER_LEASE_S)
    store.add_event(job.id, "controller", f"controller: Kubernetes Job {name} in namespace {ns}",
                    {"place": "kubernetes", "kubernetes_job": name, "namespace": ns})
    return name


def kubernetes_controller_args(spec: JobSpec, job_id: str, namespace: str) -> dict:
    """The keyword arguments (``argv``, ``env``, ``secret_env``, ``image``) of
    ``KubernetesProvider.submit_controller`` / ``controller_manifests`` for the controller of
    ``job_id`` in ``namespace``: what :func:`place_controller` creates and ``run --dry-run``
    shows (``image`` None: the provider's default)."""
    env, secret_env = controller_pod_env(spec, k8s_provider.controller_names(job_id)["job"], namespace)
    return {"argv": controller_container_command(job_id, spec.controller.image), "env": env,
            "secret_env": secret_env, "image": spec.controller.image}


def controller_job_args(spec: JobSpec, job_id: str, provider) -> dict:
    """The keyword arguments of ``provider.submit_controller``/``controller_script`` for the
    controller of ``job_id`` (``argv``, ``partition``, ``log``, ``chdir``, ``time_limit_s``):
    what :func:`place_controller` submits and ``run --dry-run`` shows."""
    jd = job_dir(job_id)
    deadline_s = spec.resources.deadline_s
    return {"argv": controller_argv(job_id, provider.cfg.python),
            "partition": spec.controller.partition or provider.cfg.partition,
            "log": str(jd / "controller.log"), "chdir": str(jd),
            "time_limit_s": None if deadline_s is None else deadline_s + CONTROLLER_TEARDOWN_S}


def forget_lost_queued_controller(store: Store, job: JobRecord) -> str | None:
    """A placed controller's Slurm job that left the queue without starting (an admin's
    ``scancel``, a purge) still holds the job's lease as ``slurm:<id>``, so nothing would start
    another until it expired: when Slurm no longer shows that job, give the lease up and return
    its holder (None otherwise: not placed, not queued, or still queued). Asks Slurm (``squeue``)."""
    place = placed(job.spec)
    held = store.lease(job.id) if place else None
    if held is None or not held[0].startswith(f"{place}:"):
        return None
    ctl_id = held[0].split(":", 1)[1]  # the Slurm job id / the Kubernetes Job's name
    if any(f["id"] == ctl_id for f in controller_provider(JobSpec.model_validate(job.spec)).controller_jobs(job.id)):
        return None
    if not store.release_lease(job.id, held[0]):  # it started meanwhile and took the lease over
        return None
    if place == "kubernetes":
        store.add_event(job.id, "controller", f"controller: Kubernetes Job {ctl_id} is gone without starting",
                        {"place": "kubernetes", "kubernetes_job": ctl_id})
    else:
        store.add_event(job.id, "controller", f"controller: Slurm job {ctl_id} left the queue without starting",
                        {"place": "slurm", "slurm_job_id": ctl_id})
    return held[0]


def stop_placed_controller(job: JobRecord, grace_s: float) -> list[str]:
    """End the Slurm job(s) or Kubernetes Job(s) running or waiting to run ``job``'s controller
    (placed jobs only): SIGTERM to a running one, which cancels the job and stops its nodes, then
    ``scancel`` after ``grace_s`` seconds (Slurm); the Job deleted with ``grace_s`` for its pod
    and its Secret with it (Kubernetes). Returns the ids found ([] for a job not placed)."""
    if not placed(job.spec):
        return []
    return controller_provider(JobSpec.model_validate(job.spec)).cancel_controller(job.id, grace_s)
