"""A job's node as the controller holds it: :class:`NodeSlot`.

One slot per node rank. A slot is recorded in state (``nodes`` table, its ``id``) before its
provider creates the node; ``handle`` is the provider's typed handle once provisioned. A
replacement is a new slot (a new node id, ``generation`` + 1) in the same rank. The read offsets
of the node's log, metrics and GPU-health streams live in the slot: every attempt appends to the
same streams, so they survive relaunches and are dropped with the slot."""

from __future__ import annotations

import dataclasses

from sftctl.types import NodeHandle


@dataclasses.dataclass
class NodeSlot:
    """One node of the running job.

    Attributes:
        id: the node id state keeps (``<job>-n<rank>-<hex>``).
        rank: the node rank, 0..n-1 (renumbered by an elastic resume).
        handle: the provider's handle; None until provisioned.
        generation: how many times this rank was replaced (``SFTCTL_NODE_GENERATION``).
        detail: what the provider last said of the running node (a Slurm pending reason), "" if nothing.
        log_offset: bytes of the node log already read.
        metric_offsets, health_offsets: the provider's read positions in the node's metrics and
            GPU-health streams (opaque to the controller; the provider's ``read_metrics`` and
            ``read_health`` advance them in place).
    """

    id: str
    rank: int
    handle: NodeHandle | None = None
    generation: int = 0
    detail: str = ""
    log_offset: int = 0
    metric_offsets: dict[str, int] = dataclasses.field(default_factory=dict)
    health_offsets: dict[str, int] = dataclasses.field(default_factory=dict)
