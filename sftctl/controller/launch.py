"""Admission, then a launch request, then execution (issue 39.2; TorchX's ``submit_dryrun`` then
``schedule``, dstack's run plan then apply).

:func:`admit` turns a spec, its plan and where it goes (:class:`Where`: the job id, the node
slots and their addresses, the attempt, the rendezvous port, the workdir pack, the provider
instance that renders) into one frozen :class:`LaunchRequest`: every node's environment (secret
values never: a secret shows as ``<secret>``, an ``env:`` reference as written), its attempt
script ``node.sh``, its first-boot script and the scheduler documents its provider renders
(Kubernetes objects), the job's own scheduler documents (Slurm's ``sbatch.sh`` and
``step.sh``), its storage and the checkpoint directory it claims, and where its controller runs
(``controller.place``: the Slurm batch script or the Kubernetes Job and Secret, and the arguments
that submit them).

``run --dry-run`` prints a request (:meth:`LaunchRequest.preview`); the controller executes one
(:meth:`sftctl.controller.lifecycle.Controller._launch` gives each node the request's script and
:meth:`LaunchRequest.environment`, the bootstrap of its provisioning is the request's, and
:func:`place_controller` submits the request's placement), so the two
never drift: a test compares them byte for byte. ``api.submit`` (hence the server's) and
``api.dry_run`` admit with :class:`Checks`: the admission rules that need the plan (storage where
the nodes need it, ``controller.place`` on the planned provider) refuse before anything is
recorded; :func:`check_spec` holds the rules that need no plan (secrets set and not empty, the
checkpoint dir free, the workdir pack's size, storage for the clouds named), checked before
planning.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
from collections.abc import Mapping
from typing import Any

from sftctl import settings
from sftctl.catalog import Offering
from sftctl.controller.placements import SECRET, ControllerPlacement, Document, placement_of
from sftctl.controller.slots import NodeSlot
from sftctl.controller.submit import (
    NAMES_ONLY,
    EveryName,
    check_checkpoint_dir,
    check_checkpoint_owner,
    check_controller_place,
    checkpoint_dir_path,
    default_install,
    job_storage_url,
    node_env,
    required_secrets,
)
from sftctl.errors import SftctlError, SpecError
from sftctl.providers import provider_class
from sftctl.providers.base import RendersJobDocuments, RendersNodeDocuments, SecretStore
from sftctl.providers.cloud import InstanceRequest
from sftctl.spec import JobSpec, resolve_env
from sftctl.state import JobRecord, Store
from sftctl.storage.workdir import check_workdir_size
from sftctl.templates import render
from sftctl.types import NodeHandle, Plan, capabilities

#: the job id a request made before the job exists shows (``run --dry-run``)
PREVIEW_JOB_ID = "<job-id>"
@dataclasses.dataclass(frozen=True)
class NodeSite:
    """Where one node is: its id, rank, address (None: not known yet) and generation."""

    id: str
    rank: int
    ip: str | None = None
    generation: int = 0


@dataclasses.dataclass(frozen=True)
class Checks:
    """Admission at submit (:func:`check_spec` before planning, :func:`admit` after).

    Attributes:
        label: the spec's file, for messages.
        server: a server runs the job's commands (this process is it, or the config names one).
        serving: this process is the server (its requester is ``owner``).
        environ: where the job's ``secrets:`` and ``${VAR}`` take their values at submit (names
            and emptiness are checked; values never enter a request).
        owner: the user the job belongs to (a server's requester).
    """

    label: str
    server: bool = False
    serving: bool = False
    environ: Mapping[str, str] | None = dataclasses.field(default=None, repr=False, compare=False)
    owner: str | None = None

    @property
    def secrets_where(self) -> str:
        """Where the job's secret values come from, as messages say it."""
        return "your secrets on the server" if self.serving else "this shell"


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a job is launched: the inputs of :func:`admit` besides the spec and its plan.

    Attributes:
        job_id: the job's id (``<job-id>`` before it exists).
        nodes: the node slots in node-rank order; None: ``resources.nodes`` placeholders
            (``<job-id>-n<rank>``, address ``<node r ip>`` where the node is not this machine).
        attempt: the attempt launched.
        port: the rendezvous port (``<rendezvous port>`` before one is claimed).
        workdir_key: the workdir pack in job storage (None: not uploaded yet, shown as
            ``<workdir pack>`` when the job has storage and ``nodes`` is None).
        ranks: the node ranks rendered in full (None: every node; ``()``: none, and no scheduler
            document: admission only).
        provider: the provider instance the controller launches through (its excluded hosts,
            namespace, image); None: a fresh one of the plan's provider renders.
        secrets_ref: a cloud node's ``SFTCTL_SECRETS_REF`` (the controller's provider stored the
            values there); None: the reference the provider would store them under.
        environ: where the names of the secrets a placed controller carries are looked up
            (values never enter the request); None: this process's environment.
        namespace: a Kubernetes-placed controller's namespace (None: ``SFTCTL_K8S_NAMESPACE``,
            else ``default``; :func:`place_controller` passes its provider's).
        checks: admit at submit (:class:`Checks`); None: no check (the controller's launch).
        documents: render the scheduler documents (the job's and each node's); the controller
            leaves them out (its provider renders them from the same inputs as it submits:
            tests/test_launch_request.py holds the two equal), which keeps a launch of hundreds
            of Kubernetes nodes from rendering every manifest twice.
    """

    job_id: str = PREVIEW_JOB_ID
    nodes: tuple[NodeSite, ...] | None = None
    attempt: int = 1
    port: int | str = "<rendezvous port>"
    workdir_key: str | None = None
    ranks: tuple[int, ...] | None = None
    provider: Any = None
    secrets_ref: str | None = None
    environ: Mapping[str, str] | None = None
    namespace: str | None = None
    checks: Checks | None = None
    documents: bool = True

    @classmethod
    def of(cls, job_id: str, slots: list[NodeSlot], **kw: Any) -> "Where":
        """The controller's: its node slots (their handles' addresses) and ``kw`` as above."""
        sites = tuple(NodeSite(s.id, s.rank, s.handle.ip if s.handle is not None else None, s.generation)
                      for s in slots)
        return cls(job_id=job_id, nodes=sites, **kw)


@dataclasses.dataclass(frozen=True)
class NodeLaunch:
    """One node of a :class:`LaunchRequest`.

    Attributes:
        rank, node_id: which node.
        env: its environment with names only for what is secret: a ``secrets:`` value is
            ``<secret>``, an ``env:`` value that refers to variables is as written
            (``${MY_API_TOKEN}``); read-only.
        script: its attempt script (``node.sh``, templates/node.sh.j2).
        bootstrap: its first-boot script (a cloud VM, a pod); None where the provider boots none.
        documents: what its provider creates for it (a Kubernetes node's Secret, Service,
            ConfigMap and Pod; Secret values ``<secret>``).
    """

    rank: int
    node_id: str
    env: Mapping[str, str]
    script: str
    bootstrap: str | None
    documents: tuple[Document, ...] = ()

    def to_dict(self) -> dict:
        return {"rank": self.rank, "env": dict(self.env), "script": self.script, "bootstrap": self.bootstrap}


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """What launching a job does, rendered (:func:`admit`); no secret value is in it.

    Attributes:
        job_id, name, offering: the job, its spec's name, the plan's offering.
        attempt, node_count: the attempt and how many nodes it has.
        env_names: every variable a node gets (the spec's ``env`` and ``secrets``, sftctl's own).
        secret_names: the variables a node refuses to run without (``required_secrets``).
        filled: the variables whose values the launch fills from the job's secrets and
            environment (:meth:`environment`).
        env_templates: each filled ``env:`` variable's value as written (its references).
        storage_url: the job's storage (``<storage.url>/<job id>``), None without.
        workdir_key: the workdir pack the nodes unpack, None without storage.
        checkpoint_claim: the spec's ``train.checkpoint_dir`` this job claims (its owner file),
            None when the job keeps checkpoints in its job dir or its storage.
        controller: where the controller runs and what submits it.
        nodes: the nodes rendered in full (:attr:`Where.ranks`), in rank order.
        documents: the job's scheduler documents (Slurm's ``attempt-N/sbatch.sh`` and ``step.sh``).
    """

    job_id: str
    name: str
    offering: Offering
    attempt: int
    node_count: int
    env_names: tuple[str, ...]
    secret_names: tuple[str, ...]
    filled: tuple[str, ...]
    env_templates: Mapping[str, str]
    storage_url: str | None
    workdir_key: str | None
    checkpoint_claim: str | None
    controller: ControllerPlacement
    nodes: tuple[NodeLaunch, ...]
    documents: tuple[Document, ...]

    def node(self, rank: int) -> NodeLaunch:
        """The node of ``rank``.

        Raises:
            KeyError: that rank was not rendered."""
        for n in self.nodes:
            if n.rank == rank:
                return n
        raise KeyError(rank)

    def environment(self, rank: int, environ: Mapping[str, str]) -> dict[str, str]:
        """Node ``rank``'s environment with the values filled from ``environ`` (the job's
        :func:`sftctl.vault.job_environ`): a ``secrets:`` name ``environ`` lacks is set empty (the
        node refuses to run), an ``env:`` reference resolves as :func:`sftctl.spec.resolve_env`.

        Raises:
            SpecError: an ``env:`` reference without a default is not set in ``environ``."""
        env = dict(self.node(rank).env)
        for k in self.filled:
            if k in self.env_templates:
                env[k] = resolve_env({k: self.env_templates[k]}, environ)[k]
            else:
                env[k] = environ[k] if k in environ else ""
        return env

    def preview(self) -> dict:
        """``run --dry-run``'s document: ``{"offering", "nodes": [{"rank", "env", "script",
        "bootstrap"}], "other_nodes", "submits": [{"name", "text"}]}``: node 0 in full, the rest
        summarised so the output stays the same size for 2 nodes or 10,000 (``other_nodes``: None
        for one node, else ``{"count", "ranks": [first, last], "env_differs": [names],
        "script_lines_differ": n, "bootstrap_lines_differ": n}``, what rank 1 has that node 0 has
        not); ``submits``: the controller's documents, then the job's, then node 0's."""
        shown = [n.to_dict() for n in self.nodes[:2]]
        first = self.nodes[:1]
        submits = [d.to_dict() for d in (*self.controller.documents, *self.documents,
                                         *(d for n in first for d in n.documents))]
        if self.node_count == 1 or len(shown) < 2:
            return {"offering": self.offering.to_dict(), "nodes": shown[:1], "other_nodes": None, "submits": submits}

        def changed(a: str | None, b: str | None) -> int:
            lines = difflib.ndiff((a or "").splitlines(), (b or "").splitlines())
            return sum(line.startswith("+ ") for line in lines)

        a, b = shown
        others = {"count": self.node_count - 1, "ranks": [1, self.node_count - 1],
                  "env_differs": sorted(k for k in a["env"].keys() | b["env"].keys() if a["env"].get(k) != b["env"].get(k)),
                  "script_lines_differ": changed(a["script"], b["script"]),
                  "bootstrap_lines_differ": changed(a["bootstrap"], b["bootstrap"])}
        return {"offering": self.offering.to_dict(), "nodes": [a], "other_nodes": others, "submits": submits}


#: every variable set to a marker: the values of a node's environment that come from the job's
#: secrets or environment are those that differ between this and :data:`NAMES_ONLY`
_MARKED: Mapping[str, str] = EveryName("\x00")


def _slots(spec: JobSpec, plan: Plan, where: Where) -> list[NodeSlot]:
    """``where``'s nodes as the slots :func:`~sftctl.controller.submit.node_env` reads."""
    job_id = where.job_id
    if where.nodes is None:
        here = capabilities(plan.offering.provider).local_admission
        sites = [NodeSite(f"{job_id}-n{r}", r, "127.0.0.1" if here else f"<node {r} ip>")
                 for r in range(spec.resources.nodes)]
    else:
        sites = list(where.nodes)
    return [NodeSlot(s.id, s.rank, NodeHandle(job_id=job_id, node_id=s.id, rank=s.rank, ip=s.ip), s.generation)
            for s in sites]


def _provider(spec: JobSpec, plan: Plan, where: Where):
    """The provider instance that renders the plan's scheduler documents: the controller's, else
    (a provider that :class:`~sftctl.providers.base.RendersJobDocuments`) one for the spec, as
    ``job_provider`` makes it (Slurm: one allocation of resources.nodes, --time from the deadline)."""
    if where.provider is not None:
        return where.provider
    cls = provider_class(plan.offering.provider)
    return cls.for_plan(spec) if issubclass(cls, RendersJobDocuments) else None


def _check(spec: JobSpec, plan: Plan, checks: Checks) -> None:
    """The admission rules that need the plan (see :func:`admit`)."""
    provider = plan.offering.provider
    need_storage(spec, checks.label, provider)
    check_controller_place(spec, checks.label, server=checks.server, provider=provider)


def check_spec(spec: JobSpec, checks: Checks) -> None:
    """The admission rules that need no plan, checked before planning (:func:`admit` checks the
    rest): a ``controller.place`` that can work here, every ``secrets:`` name set (in the server:
    the owner's or the lab's stored secrets; with a server configured: yours there; else this
    shell or your stored secrets) and no secret a node would get empty, a ``train.checkpoint_dir``
    free of another run's checkpoints, a workdir pack within ``storage.max_workdir_mb``, and
    ``storage:`` where every cloud the spec names needs it.

    Raises:
        SpecError: one line naming the field and the fix (exit 2).
        SftctlError: cloud nodes without ``storage:`` (exit 2).
    """
    label, environ = checks.label, os.environ if checks.environ is None else checks.environ
    check_controller_place(spec, label, server=checks.server)
    missing = [k for k in spec.secrets if k not in environ]
    if missing:
        names = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
        hint = f"sftctl secret set {missing[0]} (the value from stdin or a prompt), or drop it from secrets"
        if checks.serving:
            raise SpecError(f"{label}: secrets: {names} not one of {checks.owner}'s secrets on this server (nor the lab's)",
                            hint=hint)
        if checks.server:
            raise SpecError(f"{label}: secrets: {names} not one of your secrets on the server (nor the lab's)", hint=hint)
        raise SpecError(f"{label}: secrets: {', '.join(missing)} not set in this shell",
                        hint="export it before sftctl run (or sftctl secret set NAME), or drop it from secrets")
    refuse_empty_secrets(spec, checks)
    check_checkpoint_dir(spec)  # another run's checkpoints would be resumed silently
    if checks.serving:  # another user's, even when asked for: their nodes would share it
        check_checkpoint_owner(spec, checks.owner)
    if spec.storage is not None:  # the nodes get the workdir as a pack: too big is said now, not at LAUNCHING
        check_workdir_size(spec.workdir, max_bytes=int(spec.storage.max_workdir_mb * 2**20))
    clouds = spec.resources.clouds
    if clouds is not None:  # known before planning: say it now (when every cloud named needs storage)
        need_storage(spec, label, "/".join(clouds))


def refuse_empty_secrets(spec: JobSpec, checks: Checks) -> None:
    """A secret the nodes would get empty (``secrets: [X]`` with X empty, ``env: {TOKEN: ${X}}``
    resolving to nothing) is refused now: a node never runs with an empty secret (issue 28).

    Raises:
        SpecError: naming the variable (exit 2).
    """
    label, environ = checks.label, os.environ if checks.environ is None else checks.environ
    for name in required_secrets(spec):
        if name in spec.env:
            if not resolve_env({name: spec.env[name]}, environ)[name]:
                raise SpecError(f"{label}: env.{name}: {spec.env[name]} is empty in {checks.secrets_where}; a node would "
                                "get an empty secret", hint="export the variable it refers to with its value")
        elif not environ.get(name):
            raise SpecError(f"{label}: secrets: {name} is empty in {checks.secrets_where}; a node would get an empty secret",
                            hint=f"export {name}=... with its value, or drop it from secrets")


def need_storage(spec: JobSpec, label: str, where: str) -> None:
    """Cloud nodes keep code, checkpoints and logs in the job's storage: refuse a spec without.
    Local and Slurm nodes keep them on a filesystem sftctl reads (Slurm: the cluster's own): the
    providers' declared ``needs_job_storage``. ``where``: the provider, or ``a/b`` for the clouds
    a spec names before it is planned (storage is needed when every one of them needs it).

    Raises:
        SftctlError: one line naming ``storage`` and what to add (exit 2).
    """
    if spec.storage is None and all(capabilities(name).needs_job_storage for name in where.split("/")):
        origin = spec.defaults_from.get("resources.clouds")
        raise SftctlError(
            f"{label}: storage: required for {where} nodes (they keep code, checkpoints and logs in the "
            "job's storage)" + (f"; the spec leaves resources.clouds out, and {origin} sets it to [{where.replace('/', ', ')}]"
                                if origin else ""),
            hint="add storage: s3://BUCKET/PREFIX (aws), gs://BUCKET/PREFIX (gcp) or pvc://CLAIM/PREFIX (kubernetes)",
        )


def admit(spec: JobSpec, plan: Plan, where: Where | None = None) -> LaunchRequest:
    """The launch request of ``spec`` on ``plan``'s offering at ``where`` (default: a dry run's
    placeholders, every node rendered). Renders; records, creates and starts nothing (a Slurm
    provider may ask ``sinfo`` how many CPUs a GPU's share is, as its submit does).

    Raises:
        SftctlError: with ``where.checks``, cloud nodes without ``storage:`` (exit 2);
        SpecError: with ``where.checks``, a ``controller.place`` that cannot work on the plan's
            provider (exit 2).
    """
    where = where or Where()
    if where.checks is not None:
        _check(spec, plan, where.checks)
    offering, job_id = plan.offering, where.job_id
    slots = _slots(spec, plan, where)
    workdir_key = where.workdir_key
    if workdir_key is None and where.nodes is None and spec.storage is not None:
        workdir_key = "<workdir pack>"
    secrets = required_secrets(spec)
    env0 = node_env(spec, job_id, plan, slots, slots[0].rank, where.attempt, where.port, workdir_key, NAMES_ONLY)
    marked = node_env(spec, job_id, plan, slots, slots[0].rank, where.attempt, where.port, workdir_key, _MARKED)
    filled = tuple(sorted(k for k in env0 if env0[k] != marked.get(k)))
    templates = {k: spec.env[k] for k in filled if k in spec.env and k not in spec.secrets}
    ranks = range(len(slots)) if where.ranks is None else [r for r in where.ranks if r < len(slots)]
    provider = _provider(spec, plan, where) if where.ranks != () and where.documents else None
    nodes = tuple(_node(spec, plan, where, slots, slots[i], workdir_key, filled, templates, provider) for i in ranks)
    documents: tuple[Document, ...] = ()
    if isinstance(provider, RendersJobDocuments):
        scripts = provider.batch_scripts(job_id, where.attempt, [s.id for s in slots], offering)
        documents = tuple(Document(f"attempt-{where.attempt}/{name}", text) for name, text in scripts.items())
    claim = checkpoint_dir_path(spec)
    return LaunchRequest(
        job_id=job_id, name=spec.name, offering=offering, attempt=where.attempt, node_count=len(slots),
        env_names=tuple(sorted(set(env0) | set(spec.env) | set(spec.secrets))), secret_names=tuple(secrets),
        filled=filled, env_templates=types.MappingProxyType(templates),
        storage_url=job_storage_url(spec, job_id), workdir_key=workdir_key,
        checkpoint_claim=str(claim) if claim is not None else None,
        controller=_placement(spec, job_id, where),
        nodes=nodes, documents=documents)


def _node(spec: JobSpec, plan: Plan, where: Where, slots: list[NodeSlot], n: NodeSlot, workdir_key: str | None,
          filled: tuple[str, ...], templates: dict[str, str], provider) -> NodeLaunch:
    """One node of :func:`admit`."""
    job_id = where.job_id
    env = node_env(spec, job_id, plan, slots, n.rank, where.attempt, where.port, workdir_key, NAMES_ONLY)
    env.update({k: templates.get(k, SECRET) for k in filled})  # names, never values
    script = render("node.sh.j2", job_id=job_id, node_id=n.id, rank=n.rank, attempt=where.attempt,
                    workdir=spec.workdir, setup=spec.setup, run=spec.run, health=spec.health.enabled,
                    secrets=required_secrets(spec))
    name = plan.offering.provider
    cls = provider_class(name)
    bootstrap = None
    if capabilities(name).boots_script:
        ref = where.secrets_ref
        if ref is None:
            ref = ""
            if issubclass(cls, SecretStore) and required_secrets(spec):  # where its secrets_ref will store them
                ref = cls.secrets_ref_for(job_id)
        bootstrap = render("bootstrap.sh.j2", job_id=job_id, node_id=n.id, rank=n.rank,
                           storage_url=job_storage_url(spec, job_id) or "", secrets_ref=ref,
                           controller_grace_s=settings.get("SFTCTL_CLOUD_CONTROLLER_GRACE_S"),
                           install=settings.get("SFTCTL_NODE_INSTALL") or default_install())
    documents: tuple[Document, ...] = ()
    if issubclass(cls, RendersNodeDocuments) and where.documents:
        documents = (_node_document(cls, spec, plan, job_id, n, bootstrap or "", provider),)
    return NodeLaunch(n.rank, n.id, types.MappingProxyType(env), script, bootstrap, documents)


def _node_document(cls, spec: JobSpec, plan: Plan, job_id: str, n: NodeSlot, bootstrap: str, provider) -> Document:
    """A node's scheduler objects as its provider creates them (``create_instance``; Kubernetes:
    ConfigMap, Service, Secret, pod), Secret values ``<secret>``: the controller's ``provider``'s
    (its namespace, image, world size, excluded machines), else a fresh one's."""
    import yaml

    request = InstanceRequest(job_id=job_id, node_id=n.id, rank=n.rank, offering=plan.offering, zone=None,
                              spot=spec.resources.spot, bootstrap=bootstrap, image=spec.resources.image)
    what, objs = cls.node_objects(request, provider=provider, secret_names=required_secrets(spec),
                                  num_nodes=spec.resources.nodes)
    return Document(f"node {n.rank}: {what}", yaml.safe_dump_all(objs, sort_keys=False))


def _placement(spec: JobSpec, job_id: str, where: Where) -> ControllerPlacement:
    """Where the controller runs and what submits it: its placement's render (see
    :class:`~sftctl.controller.placements.base.Placement`)."""
    return placement_of(spec).render(spec, job_id, where)


# ------------------------------------------------------------------ executing a placement


def place_controller(store: Store, job: JobRecord) -> str:
    """Submit the controller of a placed job (``controller.place: slurm | kubernetes``) as its
    :func:`admit`'s :class:`ControllerPlacement` says, the document ``run --dry-run`` shows
    (:meth:`Placement.place`: a Slurm job, a Kubernetes Job). Until it starts, the job's lease is
    held for it (holder ``slurm:<id>`` / ``kubernetes:<Job>``, for
    :data:`~sftctl.state.QUEUED_CONTROLLER_LEASE_S`), so no second controller starts and reads
    do not take the job for one without a controller. Returns the scheduler's id of it.

    Raises:
        ProviderError: the scheduler refused it (exit 4); the job is then FAILED with that line.
    """
    spec = JobSpec.model_validate(job.spec)

    def rendered(**changes) -> ControllerPlacement:
        return admit(spec, job.plan, Where(job_id=job.id, ranks=(), **changes)).controller

    return placement_of(spec).place(store, job, spec, rendered)
