"""The Provider protocol: one small vocabulary every backend speaks (local, aws, gcp, kubernetes).

A provider knows nothing of the compiler or the lifecycle. The controller drives it:

    handle = provider.provision(job_id, node_id, rank, offering)   # the node exists, idle
    handle = provider.launch(handle, script, env, attempt)          # run a bootstrap script
    provider.status(handle)                                         # -> NodeStatus
    provider.read_log(handle, offset)                               # -> (bytes, next offset)
    provider.quarantine(handle, reason)                             # keep a bad machine out
    provider.read_failure(handle)                                   # -> FailureReason | None
    provider.terminate(handle)                                      # nothing of it is left
    provider.terminate_tagged(job_id)                               # whatever exists, by tag
    provider.list_instances(job_id=None)                            # every labelled resource

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

from typing import Protocol, runtime_checkable

from sftctl.errors import CapacityError
from sftctl.types import FailureReason, NodeHandle, NodeState, NodeStatus, Offering  # noqa: F401  (re-exported)


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

    def quarantine(self, handle: NodeHandle, reason: str) -> dict | None:
        """Keep the machine under ``handle`` out of this job's next nodes, and out of everyone's
        where the provider may: called before :meth:`terminate` when a health verdict replaces
        the node (``reason``: the verdict in one line).

        Kubernetes adds node anti-affinity to the job's next pods and cordons the node when RBAC
        allows; Slurm puts the node on the job's ``--exclude`` list; a cloud instance is deleted
        and its replacement is another machine, and a local node is this machine: None.

        Returns:
            ``{"machine", "actions": [...], "message": one line}`` for the job's events, or None
            when there was nothing to do. API errors are reported in it, never raised.
        """

    def terminate(self, handle: NodeHandle) -> None:
        """Stop and delete the node and everything it started. Idempotent."""

    def terminate_tagged(self, job_id: str) -> int:
        """Terminate every live resource tagged with ``job_id``; return how many there were."""

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """Live resources labelled with ``job_id`` (every sftctl resource when None), each a dict
        with at least ``id``, ``job_id`` and ``node_id`` (for ``sftctl down --orphans``). A listing,
        not a :class:`NodeHandle`: ids may be label values and the rank unknown."""


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
            except Exception as e:  # collected: every future must finish before cleanup
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
    batch = getattr(provider, "terminate_all", None)
    if batch is not None:
        batch(handles)
        return
    errors: list[Exception] = []
    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(handles)))) as pool:
        futures = [pool.submit(provider.terminate, h) for h in handles]
        said = time.monotonic()
        for done, f in enumerate(as_completed(futures), 1):
            try:
                f.result()
            except Exception as e:  # collected: every node is tried before one error is raised
                errors.append(e)
            if progress is not None and time.monotonic() - said > 5.0:
                progress(f"terminated {done} of {len(handles)} node(s)")
                said = time.monotonic()
    if errors:
        raise errors[0]

