"""The Provider protocol: one small vocabulary every backend speaks (local, aws, gcp, kubernetes).

A provider knows nothing of the compiler or the lifecycle. The controller drives it:

    handle = provider.provision(job_id, node_id, rank, offering)   # the node exists, idle
    handle = provider.launch(handle, script, env, attempt)          # run a bootstrap script
    provider.status(handle)                                         # -> NodeStatus
    provider.read_log(handle, offset)                               # -> (bytes, next offset)
    provider.read_failure(handle)                                   # -> FailureReason | None
    provider.terminate(handle)                                      # nothing of it is left
    provider.terminate_tagged(job_id)                               # whatever exists, by tag
    provider.list_instances(job_id=None)                            # every labelled resource

What only some providers do is an optional interface below (:class:`KeepsAlive`,
:class:`Quarantines`, :class:`SecretStore`, :class:`QueueEstimate`, :class:`LiveOfferings`,
:class:`PlacesController`, :class:`BuiltForJob`, :class:`RendersJobDocuments`, :class:`RendersNodeDocuments`,
:class:`TerminatesInBatch`, :class:`BlocksZones`, :class:`UsesChannel`,
:class:`ReachesFilesystem`): a provider implements it, and the planner and controller ask
``isinstance(provider, Quarantines)``, never the provider's name or ``getattr``.

Cloud providers share :class:`sftctl.providers.cloud.CloudProvider`, which builds this protocol
from a handful of per-cloud calls (create, describe, delete, list by label).

A *handle* is the provider's :class:`sftctl.types.NodeHandle` subclass (``LocalHandle``,
``AWSHandle``, ``GCPHandle``, ``KubernetesHandle``, ``SlurmHandle``): immutable, so a call that
changes it returns a new one (``handle.with_(attempt=2)``). The controller stores
``handle.to_dict()`` in state after every call, so another process (``sftctl down``) rebuilds
the provider's view from state alone (``NodeHandle.stored(provider, data)``).
``list_instances`` returns plain dicts: a listing of what the cloud shows (its own state words,
ids as label values), not handles.
Every resource a provider creates carries the job id and node id as tags or labels, so
``terminate_tagged`` still finds it when the state lost track (a controller killed mid-call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from sftctl.errors import CapacityError
from sftctl.types import FailureReason, NodeHandle, NodeState, NodeStatus, Offering  # noqa: F401  (re-exported)


def _always(environ: Mapping[str, str]) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class ProviderEntry:
    """How sftctl finds, installs and judges one provider, declared once as ``PROVIDER`` in its
    package (``sftctl/providers/<name>/__init__.py``, or a module ``SFTCTL_PROVIDERS`` names):
    :mod:`sftctl.providers` discovers it, and the spec's ``resources.clouds`` and
    ``SFTCTL_CLOUDS`` take its name.

    Attributes:
        name: the provider's name (``resources.clouds``, ``Offering.provider``, its handle's).
        cls: the :class:`Provider` class, an attribute of the declaring module.
        sdk: the module its SDK is imported as (None: it needs none); looked up, never imported,
            to say it is missing.
        extra: the pip extra that installs the SDK.
        configured: ``configured(environ)``: None when the provider has credentials or a
            cluster here (no network call, no SDK import), else one line saying why not.
    """

    name: str
    cls: str
    sdk: str | None = None
    extra: str | None = None
    configured: Callable[[Mapping[str, str]], str | None] = _always


@runtime_checkable
class Provider(Protocol):
    """What every provider implements. Errors are :class:`sftctl.errors.ProviderError`."""

    name: str

    def check(self) -> None:
        """Raise ProviderError if this provider cannot be used here (missing SDK, credentials)."""

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """Offerings this provider could provision for ``count`` x ``accelerator`` per node."""

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering, *,
                  spot: bool = False, bootstrap: str = "", image: str | None = None) -> NodeHandle:
        """Create one node, tagged with job and node id; return its handle when it is ready.

        ``spot`` asks for spot / preemptible capacity, ``bootstrap`` is the node's boot script
        (cloud providers run it at first boot), ``image`` overrides the provider's default image.
        Raises :class:`sftctl.errors.CapacityError` when the offering has no capacity or quota.
        """

    def launch(self, handle: NodeHandle, script: str, env: dict[str, str], attempt: int) -> NodeHandle:
        """Start ``script`` (bash) on the node with ``env``; return the updated handle."""

    def status(self, handle: NodeHandle) -> NodeStatus:
        """The node's current state (cheap; called every poll)."""

    def read_log(self, handle: NodeHandle, offset: int) -> tuple[bytes, int]:
        """Log bytes of the node from ``offset`` on, and the offset to ask for next."""

    def read_metrics(self, handle: NodeHandle, offsets: dict[str, int]) -> list[dict]:
        """New training metrics samples (see :mod:`sftctl.train`) since ``offsets`` (updated)."""

    def read_health(self, handle: NodeHandle, offsets: dict[str, int]) -> list[dict]:
        """New GPU samples the node agent wrote (see :mod:`sftctl.health.telemetry`)."""

    def read_failure(self, handle: NodeHandle) -> FailureReason | None:
        """Why the handle's attempt failed, as the node found out (its failure record, see
        :mod:`sftctl.failure`); None when the node wrote none (nothing known beyond the code)."""

    def stop_attempt(self, handle: NodeHandle) -> None:
        """Stop what the current attempt runs on the node; the node stays for the next attempt."""

    def terminate(self, handle: NodeHandle) -> None:
        """Stop and delete the node and everything it started. Idempotent."""

    def terminate_tagged(self, job_id: str) -> int:
        """Terminate every live resource tagged with ``job_id``; return how many there were."""

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """Live resources labelled with ``job_id`` (every sftctl resource when None), each a dict
        with at least ``id``, ``job_id`` and ``node_id`` (for ``sftctl down --orphans``). A listing,
        not a :class:`NodeHandle`: ids may be label values and the rank unknown."""


@runtime_checkable
class KeepsAlive(Protocol):
    """A provider whose nodes outlive a dead controller unless told it still watches (Slurm's
    allocation, a cloud VM's daemon): the controller calls :meth:`keepalive` every poll."""

    def keepalive(self, job_id: str) -> None:
        """The controller of ``job_id`` still watches (cheap; rate-limited by the provider)."""


@runtime_checkable
class Quarantines(Protocol):
    """A provider that can keep a machine a health verdict condemned out of a job's next nodes
    (Slurm's ``--exclude``, Kubernetes' node anti-affinity and cordon)."""

    def quarantine(self, handle: NodeHandle, reason: str) -> dict | None:
        """Keep the machine under ``handle`` out of this job's next nodes, and out of everyone's
        where the provider may: called before ``terminate`` when a health verdict replaces the
        node (``reason``: the verdict in one line).

        Returns:
            ``{"machine", "actions": [...], "message": one line}`` for the job's events, or None
            when there was nothing to do. API errors are reported in it, never raised.
        """

    def keep_out(self, job_id: str, machines: set[str]) -> set[str]:
        """Add ``machines`` (the state's bad machines of this provider) to the job's keep-out
        list before its nodes are placed; returns those that were not on it yet."""


@runtime_checkable
class SecretStore(Protocol):
    """A provider whose nodes read the job's secret values from the cloud's secret store
    (AWS Secrets Manager, :mod:`sftctl.storage.secrets`)."""

    def secrets_ref(self, job_id: str) -> str:
        """Store the job's secret values and return where its nodes read them
        (``SFTCTL_SECRETS_REF``); "" when the job has none."""

    @classmethod
    def secrets_ref_for(cls, job_id: str) -> str:
        """Where :meth:`secrets_ref` would store them, storing nothing (``run --dry-run``)."""


@runtime_checkable
class QueueEstimate(Protocol):
    """A provider whose scheduler estimates when an allocation starts (Slurm's
    ``sbatch --test-only``): the planner adds the wait to the offering's finish time."""

    def estimate_start(self, offering: Offering, nodes: int) -> tuple[float, str]:
        """Seconds until ``nodes`` nodes of ``offering`` would start, and the line that says why."""


@runtime_checkable
class LiveOfferings(Protocol):
    """A provider whose offerings are asked of the live system when a job is planned (a
    Kubernetes cluster's nodes, a Slurm cluster's partitions), not read from the catalog.
    :meth:`for_plan` builds the instance the planner asks (a class method)."""

    @classmethod
    def for_plan(cls, spec) -> "Provider":
        """The provider the planner asks :meth:`Provider.offerings` of, for the job ``spec``."""


@runtime_checkable
class RendersJobDocuments(Protocol):
    """A provider that submits one scheduler document per attempt for all the job's nodes
    (Slurm's sbatch.sh and step.sh): ``admit`` renders them into the launch request, from the
    instance :meth:`for_plan` builds for the job's spec (or the controller's own)."""

    @classmethod
    def for_plan(cls, spec) -> "Provider":
        """The provider a job ``spec`` runs on (its scheduler settings from the spec)."""

    def batch_scripts(self, job_id: str, attempt: int, node_ids: list[str], offering: Offering) -> dict[str, str]:
        """``{file name: text}`` of the attempt's scheduler documents, as its launch submits them."""


@runtime_checkable
class RendersNodeDocuments(Protocol):
    """A provider that creates scheduler objects per node (Kubernetes: a ConfigMap, Service,
    Secret and pod): ``admit`` renders them into each node of the launch request."""

    @classmethod
    def node_objects(cls, request, *, provider=None, secret_names: Sequence[str] = (),
                     num_nodes: int | None = None) -> tuple[str, list[dict]]:
        """``(what they are, objects)`` made for ``request`` (a
        :class:`sftctl.providers.cloud.InstanceRequest`), secret values ``<secret>``: as the
        controller's ``provider`` makes them, else as a fresh one would for ``num_nodes`` nodes
        and ``secret_names``."""


@runtime_checkable
class BuiltForJob(Protocol):
    """A provider made for one job from more than its storage channel (the controller's
    ``job_provider``): Slurm from the spec's ``slurm:`` and resources (it never uses job
    storage), AWS with the job's instance profile and the secret values it stores, Kubernetes
    with the secret values of the job's Secret and the world size. A provider without it is
    ``cls(channel=...)``, or ``cls()`` for a job without storage."""

    @classmethod
    def for_job(cls, spec, channel: Callable[[], Any], secrets: Callable[[], dict[str, str]]) -> "Provider":
        """The provider for job ``spec``: ``channel()`` its job storage's channel (None without
        storage), ``secrets()`` the values of its secrets (asked only by a provider that carries
        them)."""


@runtime_checkable
class PlacesController(Protocol):
    """A provider that can run a job's controller itself (``controller.place: <its name>``):
    a Slurm job, a Kubernetes Job. Which of its calls a placement needs:"""

    def controller_jobs(self, job_id: str | None = None) -> list[dict]:
        """The controllers it runs (of ``job_id``, else every one), each ``{"id", "job_id", ...}``."""

    def cancel_controller(self, job_id: str, grace_s: float = 20.0) -> list[str]:
        """Stop ``job_id``'s controller (SIGTERM first); the ids stopped."""


@runtime_checkable
class TerminatesInBatch(Protocol):
    """A provider that ends many nodes faster together than one by one (local: one ``/proc``
    scan); :func:`terminate_all` uses it."""

    def terminate_all(self, handles: list) -> None:
        """Terminate every node of ``handles``. Idempotent."""


@runtime_checkable
class BlocksZones(Protocol):
    """A provider with zones that skips those a spot preemption put in cool-down:
    ``blocked_zones`` holds ``(instance_type, zone)`` pairs the controller adds to."""

    blocked_zones: set


@runtime_checkable
class UsesChannel(Protocol):
    """A provider whose nodes talk to the controller through job storage (a
    :class:`sftctl.storage.stream.NodeChannel`, or None without job storage)."""

    channel: Any


@runtime_checkable
class ReachesFilesystem(Protocol):
    """A provider that may or may not share the controller's filesystem per instance (Slurm
    from its login node does, over SSH it does not): ``remote`` says it does not."""

    @property
    def remote(self) -> bool:
        """True when the nodes' filesystem is not this machine's."""


#: At most this many create calls are in flight per job (cloud APIs throttle bursts; AWS's
#: RunInstances token bucket refills at 2/s with a burst of 5 per account, so more gains little).
MAX_PARALLEL_PROVISION = 16


def provision_all(provider: Provider, job_id: str, nodes: list[tuple[str, int]], offering: Offering,
                  max_parallel: int = MAX_PARALLEL_PROVISION, on_ready=None, bootstrap_for=None,
                  **kwargs) -> list[NodeHandle]:
    """Provision ``nodes`` (``(node_id, rank)`` pairs) in parallel, at most ``max_parallel`` at once.

    ``bootstrap_for(node_id, rank)``, when given, renders each node's own ``bootstrap`` script.
    ``on_ready(node_id, handle)`` is called (from a worker thread) as each node becomes ready, so
    the caller can record handles before the others finish. ``kwargs`` go to ``provision``.
    All or nothing: when any node fails, the nodes that did come up are terminated, and the
    first error is raised (a :class:`sftctl.errors.CapacityError` before any other error, so the
    caller can fail over).

    Returns:
        the handles in the order of ``nodes``.
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(node: tuple[str, int]) -> NodeHandle:
        kw = dict(kwargs)
        if bootstrap_for is not None:
            kw["bootstrap"] = bootstrap_for(node[0], node[1])
        handle = provider.provision(job_id, node[0], node[1], offering, **kw)
        if on_ready is not None:
            on_ready(node[0], handle)
        return handle

    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(nodes)))) as pool:
        futures = [pool.submit(one, n) for n in nodes]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 collected: every future must finish before cleanup
                results.append(None)
                errors.append(e)
    if errors:
        for handle in results:
            if handle is not None:
                provider.terminate(handle)
        capacity = [e for e in errors if isinstance(e, CapacityError)]
        raise (capacity or errors)[0]
    return results


def terminate_all(provider: Provider, handles: list[NodeHandle], max_parallel: int = MAX_PARALLEL_PROVISION,
                  progress=None) -> None:
    """Terminate every node of ``handles`` at once, not one after another, so a wide job comes
    down in about the time of one node: the provider's own batch ``terminate_all(handles)``
    where it has one (local: one ``/proc`` scan and one signal sweep for every node), else
    ``terminate`` from up to ``max_parallel`` threads. ``progress(line)``, when given, hears
    how many are done every few seconds of a long teardown. Idempotent, as ``terminate``; the
    first error is raised once every node has been tried."""
    import time
    from concurrent.futures import ThreadPoolExecutor, as_completed

    if not handles:
        return
    if isinstance(provider, TerminatesInBatch):
        provider.terminate_all(handles)
        return
    errors: list[Exception] = []
    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(handles)))) as pool:
        futures = [pool.submit(provider.terminate, h) for h in handles]
        said = time.monotonic()
        for done, f in enumerate(as_completed(futures), 1):
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 collected: every node is tried before one error is raised
                errors.append(e)
            if progress is not None and time.monotonic() - said > 5.0:
                progress(f"terminated {done} of {len(handles)} node(s)")
                said = time.monotonic()
    if errors:
        raise errors[0]

