"""The Provider protocol: one small vocabulary every backend speaks (local, aws, gcp, kubernetes).

A provider knows nothing of the compiler or the lifecycle. The controller drives it:

    handle = provider.provision(job_id, node_id, rank, offering)   # the node exists, idle
    handle = provider.launch(handle, script, env, attempt)          # run a bootstrap script
    provider.status(handle)                                         # -> NodeStatus
    provider.read_log(handle, offset)                               # -> (bytes, next offset)
    provider.terminate(handle)                                      # nothing of it is left
    provider.terminate_tagged(job_id)                               # whatever exists, by tag

A *handle* is a JSON-able dict the provider owns; the controller stores it in state after every
call, so another process (``sftctl down``) can rebuild the provider's view from state alone.
Every resource a provider creates carries the job id and node id as tags or labels, so
``terminate_tagged`` still finds it when the state lost track (a controller killed mid-call).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol, runtime_checkable

from sftctl.catalog import Offering


class NodeState(str, enum.Enum):
    """What a node is doing, as its provider sees it."""

    READY = "READY"  # provisioned, nothing launched yet
    RUNNING = "RUNNING"  # the bootstrap script runs
    SUCCEEDED = "SUCCEEDED"  # the script exited 0
    FAILED = "FAILED"  # the script exited non-zero
    LOST = "LOST"  # the node or its process vanished without an exit code
    TERMINATED = "TERMINATED"


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    """A node's state, its script's exit code when it ended, and a human detail line."""

    state: NodeState
    exit_code: int | None = None
    detail: str = ""


@runtime_checkable
class Provider(Protocol):
    """What every provider implements. Errors are :class:`sftctl.errors.ProviderError`."""

    name: str

    def check(self) -> None:
        """Raise ProviderError if this provider cannot be used here (missing SDK, credentials)."""

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """Offerings this provider could provision for ``count`` x ``accelerator`` per node."""

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering) -> dict:
        """Create one node, tagged with job and node id; return its handle when it is ready."""

    def launch(self, handle: dict, script: str, env: dict[str, str], attempt: int) -> dict:
        """Start ``script`` (bash) on the node with ``env``; return the updated handle."""

    def status(self, handle: dict) -> NodeStatus:
        """The node's current state (cheap; called every poll)."""

    def read_log(self, handle: dict, offset: int) -> tuple[bytes, int]:
        """Log bytes of the node from ``offset`` on, and the offset to ask for next."""

    def read_metrics(self, handle: dict, offsets: dict[str, int]) -> list[dict]:
        """New training metrics samples (see :mod:`sftctl.train`) since ``offsets`` (updated)."""

    def read_health(self, handle: dict, offsets: dict[str, int]) -> list[dict]:
        """New GPU samples the node agent wrote (see :mod:`sftctl.health.telemetry`)."""

    def terminate(self, handle: dict) -> None:
        """Stop and delete the node and everything it started. Idempotent."""

    def terminate_tagged(self, job_id: str) -> int:
        """Terminate every live resource tagged with ``job_id``; return how many there were."""
