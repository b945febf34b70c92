"""The vocabulary every layer speaks: what crosses from a provider to the controller, from the
planner to the CLI, from state to ``sftctl.api`` (as TorchX's ``specs/api.py`` does for its
schedulers).

Every type is a frozen dataclass (``import sftctl.types`` costs no pydantic, so ``sftctl status``
and ``import sftctl.api`` stay light). ``to_dict()`` is its JSON serialization, the one the
``--json`` outputs and the state database hold; ``from_dict()`` reads it back and ignores keys it
does not know (a newer sftctl's state stays readable).

- :class:`Offering`: one way to buy nodes (catalog rows, ``sinfo``, the local machine).
- :class:`PlanChoice`: an offering judged for a job (predicted step time, cost, why rejected);
  :class:`Plan` the chosen one, the reason and every choice.
- :class:`NodeHandle`: what a provider needs to find its node again, one subclass per provider.
- :class:`NodeState`, :class:`NodeStatus`: a node as its provider sees it.
- :class:`JobStatus`, :class:`JobRecord`, :class:`NodeRecord`, :class:`Attempt`,
  :class:`Event`: what ``state.db`` keeps.
- :class:`MetricsRecord`: one training metrics sample (``sftctl.train`` writes them).
- :class:`Layout`: a parallel layout (tp, pp, cp, ep, dp degrees, the data dimension's sharding,
  micro-batches, pipeline schedule): the planner prices it, the plan carries it, training runs it.
- :class:`FailureReason`: why something failed or was ruled out, as a code a program switches
  on plus one human line; code never parses the line back.

The package, split by job (ARCHITECTURE.md, "Layout"); every name is importable from
``sftctl.types``: :mod:`~sftctl.types.record` (:class:`Record`), :mod:`~sftctl.types.plans`
(reasons, offerings, plans), :mod:`~sftctl.types.layout` (:class:`Layout`), :mod:`~sftctl.types.nodes` (node states, handles, capabilities),
:mod:`~sftctl.types.jobs` (what the state keeps).
"""

from sftctl.types.jobs import (
    GPU_MEASURES,
    TERMINAL,
    Attempt,
    AuditEvent,
    Cost,
    CostTotal,
    Event,
    GpuPoint,
    JobRecord,
    JobStatus,
    MetricsRecord,
    NodeRecord,
    RunRecord,
    Secret,
    StepRecord,
    User,
)
from sftctl.types.nodes import (
    _HANDLES,
    AttemptStatus,
    AWSHandle,
    CloudHandle,
    GCPHandle,
    KubernetesHandle,
    LocalHandle,
    NodeHandle,
    NodeState,
    NodeStatus,
    ProviderCapabilities,
    SlurmHandle,
    capabilities,
)
from sftctl.types.layout import Layout
from sftctl.types.plans import FailureCode, FailureReason, Offering, Plan, PlanChoice
from sftctl.types.record import Record, T, _plain

__all__ = [
    "Record", "T", "_plain", "Layout", "FailureCode", "FailureReason", "Offering", "Plan", "PlanChoice", "AWSHandle",
    "AttemptStatus", "CloudHandle", "GCPHandle", "KubernetesHandle", "LocalHandle", "NodeHandle", "NodeState",
    "NodeStatus", "ProviderCapabilities", "SlurmHandle", "_HANDLES", "capabilities", "Attempt", "AuditEvent",
    "Cost", "CostTotal", "Event", "GPU_MEASURES", "GpuPoint", "JobRecord", "JobStatus", "MetricsRecord",
    "NodeRecord", "RunRecord", "Secret", "StepRecord", "TERMINAL", "User",
]
