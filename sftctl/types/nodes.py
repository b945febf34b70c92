"""Nodes as providers see them: :class:`NodeState`, :class:`AttemptStatus`, :class:`NodeStatus`,
:class:`ProviderCapabilities`, the typed handles (:class:`NodeHandle`, one subclass per provider)
and :func:`capabilities`."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, ClassVar

from sftctl.types.record import Record, T

#: provider name -> its handle class, filled as each class is defined (``NodeHandle.__init_subclass__``)
_HANDLES: dict[str, type["NodeHandle"]] = {}
#: how a name with no handle class yet is looked up: :mod:`sftctl.settings` adds the import of the
#: module ``SFTCTL_PROVIDERS`` names for a plugin provider, which defines it
_FINDERS: list[Callable[[str], object]] = []


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
    its handle class (:func:`capabilities`), instead of comparing provider names. What a
    provider *does* (estimate a queue's start, keep a controller alive, ...) is an interface its
    class implements instead (:mod:`sftctl.providers.base`: ``QueueEstimate``, ``KeepsAlive``, ...).

    Attributes:
        local_admission: its nodes run on this machine: a job waits for its CPUs and memory
            (:mod:`sftctl.queue`), and a dead controller's nodes stop by themselves.
        regional: its offerings live in regions that ``resources.regions`` filters.
        boots_script: its nodes boot sftctl's bootstrap script (a cloud VM, a pod).
        shares_filesystem: the controller's filesystem is the nodes' (this machine; a Slurm
            cluster driven from its login node, not over SSH).
        needs_job_storage: its nodes reach the controller only through job storage.
    """

    local_admission: bool = False
    regional: bool = True
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Each provider's handle class registers under its ``provider`` name as it is defined
        (a plugin provider's too, when its module is imported): :meth:`parse`, :func:`capabilities`."""
        super().__init_subclass__(**kwargs)
        if cls.provider and cls.provider != "cloud":
            _HANDLES[cls.provider] = cls
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
        try:
            cls = _handle_class(provider)
        except ValueError:
            raise ValueError(f"unknown provider {provider!r} for a node handle") from None
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
        regional=False, boots_script=False, shares_filesystem=True, needs_job_storage=False)
    root: str = ""
    dir: str = ""
    offering: dict[str, Any] | None = None
    exclude: list[str] = dataclasses.field(default_factory=list)
    slurm_job_id: str | None = None


def _handle_class(name: str) -> type[NodeHandle]:
    if name not in _HANDLES:
        for find in _FINDERS:  # a plugin provider's module defines its handle when imported
            try:
                find(name)
            except Exception:  # noqa: BLE001 an unknown or broken provider is "unknown" here, as before
                pass
            if name in _HANDLES:
                break
    if name not in _HANDLES:
        raise ValueError(f"unknown provider {name!r}")
    return _HANDLES[name]


def capabilities(provider: str | None) -> ProviderCapabilities:
    """The declared :class:`ProviderCapabilities` of a provider (``None``: ``local``, as a job
    recorded before it had a provider). Raises ValueError for an unknown provider."""
    return _handle_class(provider or "local").capabilities
