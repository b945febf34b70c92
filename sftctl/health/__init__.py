"""GPU and training health: telemetry samples, sources, detectors (pure), and their verdicts.

Data flow: the node agent (``python -m sftctl.agent``) reads a :mod:`sources` source every few
seconds and appends :class:`~sftctl.health.telemetry.GpuSample` records as JSON lines to the
node's ``health.jsonl``; the controller reads them through the provider, together with the
training ranks' step reports, and runs :mod:`detectors` over the recent history. A verdict
names its action (restart in place, replace the node) and carries its evidence; the
controller's policy acts on it. All I/O sits in the sources and the agent.

Each detector is one module of :mod:`sftctl.health.detectors` that declares itself to
:mod:`sftctl.health.registry`; importing any part of this package registers them all, so the
vocabulary derived from the registry (``telemetry.VerdictKind``, ``telemetry.Thresholds``, the
spec's ``health:`` keys) is whole wherever it is used.
"""

from sftctl.health import detectors  # noqa: F401  (registers the built-in detectors)
