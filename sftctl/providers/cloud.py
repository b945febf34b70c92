"""What AWS, GCP and Kubernetes share: zones, labels, readiness, throttling retries, teardown.

A cloud provider subclasses :class:`CloudProvider` and implements the *infrastructure* half:

    check()                                   credentials work, else CredentialsError (exit 4)
    offerings(accelerator, count)             what it could provision (catalog x availability)
    zones(region)                             the zones to try, in order
    create_instance(InstanceRequest) -> CloudHandle   one node, labelled; CapacityError on no capacity
    describe(handle) -> InstanceState         cheap, called every poll
    delete_instance(handle)                   idempotent; a missing instance is not an error
    list_instances(job_id | None) -> [dict]   live labelled resources (all sftctl's when None)

Handles are the provider's :class:`sftctl.types.NodeHandle` subclass (``handle_type``). A
*listing* (``list_instances``) stays a plain dict: it is what the cloud shows (its own state
words, ids as label values, no rank), read by ``sftctl down --orphans``; :meth:`CloudProvider.listed_handle`
turns one into a handle for ``delete_instance``.

This class builds the protocol of :mod:`sftctl.providers.base` on top: ``provision`` walks the
offering's region zone by zone (a zone-scoped :class:`CapacityError` blocks that zone for this
provider object and the next zone is tried; when none is left the error is raised with scope
``offering`` so the controller moves to the next offering), waits until the instance runs, and
``terminate_tagged`` deletes whatever carries the job's label. Launching the training on a cloud
node, its logs, metrics and GPU samples go through the job's storage (a node has no inbound port
the controller could reach): ``launch``, ``status``, ``stop_attempt`` and the ``read_*`` calls
delegate to ``self.channel`` (:class:`sftctl.storage.stream.NodeChannel`, the protocol's controller end).

Every resource carries the labels of :func:`labels`: ``sftctl-job``, ``sftctl-node`` and
``sftctl-managed=true``, so ``sftctl down JOB`` and ``sftctl down --orphans`` find it from the
cloud alone, even when the controller died between the API call and writing state.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import time
from typing import Callable, Generic, TypeVar, cast

from sftctl import settings
from sftctl.catalog import Offering
from sftctl.errors import CapacityError, ProviderError
from sftctl.providers.base import NodeState, NodeStatus
from sftctl.types import CloudHandle, FailureReason, KubernetesHandle, NodeHandle

#: Label / tag keys on every resource sftctl creates. Values obey GCP's label rules
#: (lowercase letters, digits, ``-`` and ``_``, at most 63 characters), which also satisfy
#: Kubernetes label values and EC2 tags.
JOB_LABEL = "sftctl-job"
NODE_LABEL = "sftctl-node"
MANAGED_LABEL = "sftctl-managed"

#: How long a node may take from the create call to RUNNING before it counts as not ready.
READY_TIMEOUT_S = 900.0
#: How long a running node's daemon may take to acknowledge an attempt (its bootstrap installs
#: sftctl first) before the node counts as LOST and is replaced.
LAUNCH_TIMEOUT_S = 900.0


def label_value(value: str) -> str:
    """``value`` made a valid GCP / Kubernetes label value (lowercase, ``[a-z0-9_-]``, <= 63)."""
    v = re.sub(r"[^a-z0-9_-]", "-", value.lower())[:63]
    return v.strip("-_") or "x"


def labels(job_id: str, node_id: str | None = None) -> dict[str, str]:
    """The labels of a resource of ``job_id`` (and of node ``node_id`` when it belongs to one)."""
    out = {MANAGED_LABEL: "true", JOB_LABEL: label_value(job_id)}
    if node_id is not None:
        out[NODE_LABEL] = label_value(node_id)
    return out


class InstanceState(str, enum.Enum):
    """An instance's life as its cloud reports it, mapped to four states."""

    PENDING = "PENDING"  # requested, booting, or a pod not yet scheduled
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"  # shutting down / terminating / preempted
    GONE = "GONE"  # terminated, deleted, or not found


@dataclasses.dataclass(frozen=True)
class InstanceRequest:
    """One node to create.

    Attributes:
        job_id, node_id, rank: who it is for (``node_id`` is unique per job and generation).
        offering: the catalog offering (instance type, accelerator count, region).
        zone: the zone to create it in (None where the cloud has no zones, e.g. Kubernetes).
        spot: spot / preemptible capacity instead of on-demand.
        bootstrap: the node's bootstrap script (bash; cloud-init user-data or a GCE
            startup-script), rendered from ``sftctl/templates/``. Holds no secret values.
        labels: the labels of :func:`labels` for this node.
        image: an image override from the spec (an AMI id, a GCE image, a container image), or
            None for the provider's default.
    """

    job_id: str
    node_id: str
    rank: int
    offering: Offering
    zone: str | None
    spot: bool = False
    bootstrap: str = ""
    labels: dict = dataclasses.field(default_factory=dict)
    image: str | None = None


def retry_throttled(is_throttle: Callable[[BaseException], bool], attempts: int = 8, max_wait_s: float = 20.0):
    """A tenacity decorator retrying calls that raise throttling errors (``is_throttle``).

    Waits are random-exponential (0.25 s x 2^n, at most ``max_wait_s``), as AWS's and Google's
    retry guidance recommend; after ``attempts`` tries the last error is re-raised.
    """
    import tenacity

    return tenacity.retry(
        retry=tenacity.retry_if_exception(is_throttle),
        wait=tenacity.wait_random_exponential(multiplier=0.25, max=max_wait_s),
        stop=tenacity.stop_after_attempt(attempts),
        reraise=True,
    )


#: the handle type of a CloudProvider subclass (``CloudProvider[AWSHandle]``): the handles it makes and takes
H = TypeVar("H", bound="CloudHandle | KubernetesHandle")


class CloudProvider(Generic[H]):
    """Base class of the cloud providers. See the module docstring for what a subclass implements.

    Args:
        channel: how ``launch`` and the ``read_*`` calls reach a node through the job's storage
            (:class:`sftctl.storage.stream.NodeChannel`); None for a provider used only to create and delete nodes.
        poll_s: seconds between ``describe`` calls while waiting for a node to run.
        ready_timeout_s: how long a node may take to run before provisioning gives up on it.
    """

    name = "cloud"
    handle_type: type[NodeHandle] = CloudHandle

    def __init__(self, channel=None, poll_s: float = 2.0, ready_timeout_s: float = READY_TIMEOUT_S):
        self.channel = channel
        self.poll_s = poll_s
        self.ready_timeout_s = ready_timeout_s
        self.blocked_zones: set[tuple[str, str]] = set()  # (instance_type, zone)
        self.launch_timeout_s = LAUNCH_TIMEOUT_S
        self._acked: set[tuple[str, int]] = set()  # (node id, attempt) the node's daemon took
        self._beat_at = -1e9  # time.monotonic() of the last heartbeat written

    # ------------------------------------------------------------ implemented per cloud

    def check(self) -> None:
        raise NotImplementedError

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        raise NotImplementedError

    def zones(self, region: str) -> list[str | None]:
        raise NotImplementedError

    def zones_for(self, offering: Offering) -> list[str | None]:
        """The zones to try for ``offering``: :meth:`zones` of its region (GCP's TPU slices list
        the TPU API's locations instead)."""
        return self.zones(offering.region)

    def create_instance(self, request: InstanceRequest) -> H:
        raise NotImplementedError

    def describe(self, handle: H) -> InstanceState:
        raise NotImplementedError

    def delete_instance(self, handle: H) -> None:
        raise NotImplementedError

    def private_ip(self, handle: H) -> str | None:
        """The node's address inside the job's network (MASTER_ADDR for rank 0), or None."""
        return None

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        raise NotImplementedError

    def listed_handle(self, listed: dict) -> H:
        """A handle for an entry of :meth:`list_instances` (for ``delete_instance``): its ids are
        label values and its rank unknown (-1)."""
        rank = listed.get("rank")
        return cast(H, self.handle_type.from_dict({**listed, "job_id": listed.get("job_id") or "",
                                                   "node_id": listed.get("node_id") or "",
                                                   "rank": rank if isinstance(rank, int) else -1}))

    # ------------------------------------------------------------ the Provider protocol

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering, *,
                  spot: bool = False, bootstrap: str = "", image: str | None = None) -> H:
        """Create one node in the first zone of ``offering.region`` with capacity; wait until it runs.
        On spot, zones go cheapest first where the offering knows their prices (``spot_zones``);
        ``blocked_zones`` (no capacity for this job, or a spot preemption's cool-down) are skipped.

        Raises:
            CapacityError: no zone of the region had capacity (scope ``offering``), or the cloud
                reported a region- or cloud-wide quota.
            ProviderError: the node did not reach RUNNING within ``ready_timeout_s`` (it is
                deleted first), or the cloud rejected the request.
        """
        zones = self.zones_for(offering)
        if spot and offering.spot_zones:  # the cheapest spot zone first (a refreshed catalog knows each)
            price = dict(offering.spot_zones)
            zones = sorted(zones, key=lambda z: price.get(z or "", float("inf")))
        tried: list[str] = []
        last: CapacityError | None = None
        for zone in zones:
            if (offering.instance_type, zone) in self.blocked_zones:
                continue
            request = InstanceRequest(job_id, node_id, rank, offering, zone, spot, bootstrap,
                                      labels(job_id, node_id), image)
            try:
                handle = self.create_instance(request)
            except CapacityError as e:
                if e.scope != "zone":
                    raise
                self.blocked_zones.add((offering.instance_type, zone))
                tried.append(f"{zone} ({e.code or 'no capacity'})")
                last = e
                continue
            return self.wait_ready(handle)
        where = ", ".join(tried) or "every zone was already blocked for this job"
        raise CapacityError(
            f"{self.name}: no capacity for {offering.instance_type} in {offering.region}: {where}",
            provider=self.name, scope="offering", region=offering.region,
            instance_type=offering.instance_type, code=last.code if last else "",
        )

    def wait_ready(self, handle: H) -> H:
        """Poll ``describe`` until RUNNING; delete the node and raise if it dies or times out."""
        end = time.monotonic() + self.ready_timeout_s
        while True:
            state = self.describe(handle)
            if state == InstanceState.RUNNING:
                ip = self.private_ip(handle)  # the rendezvous address other nodes dial
                return cast(H, handle.with_(ip=ip)) if ip else handle  # with_ keeps the class
            if state in (InstanceState.STOPPING, InstanceState.GONE) or time.monotonic() > end:
                self.delete_instance(handle)
                why = "stopped while starting" if state != InstanceState.PENDING else (
                    f"was not running after {self.ready_timeout_s:.0f} s")
                raise ProviderError(f"{self.name}: node {handle.node_id} {why}",
                                    hint="sftctl deleted it; rerun, or pick another offering")
            time.sleep(self.poll_s)

    def launch(self, handle: H, script: str, env: dict[str, str], attempt: int) -> H:
        """Hand the node its attempt's script through the job's storage."""
        self._need_channel()
        self.channel.send_launch(handle.node_id, attempt, script, env)
        return cast(H, handle.with_(attempt=attempt, launched_at=time.time()))

    def status(self, handle: H) -> NodeStatus:
        """The node's instance state, refined by the attempt's exit code from the job's storage."""
        if handle.terminated:
            return NodeStatus(NodeState.TERMINATED)
        state = self.describe(handle)
        if state in (InstanceState.GONE, InstanceState.STOPPING):
            return NodeStatus(NodeState.LOST, None, f"{self.name} instance {handle.id} is {state.value.lower()}")
        if handle.attempt is None or self.channel is None:
            return NodeStatus(NodeState.READY if state == InstanceState.RUNNING else NodeState.LOST)
        node_id, attempt = handle.node_id, handle.attempt
        code = self.channel.exit_code(node_id, attempt)
        if code is not None:
            return NodeStatus(NodeState.SUCCEEDED if code == 0 else NodeState.FAILED, code, f"exit code {code}")
        if (node_id, attempt) not in self._acked:
            if self.channel.acked(node_id, attempt):
                self._acked.add((node_id, attempt))
            elif time.time() - (handle.launched_at or time.time()) > self.launch_timeout_s:
                return NodeStatus(NodeState.LOST, None, (
                    f"its daemon did not take attempt {attempt} within {self.launch_timeout_s:.0f} s "
                    "(the bootstrap failed? see /var/lib/sftctl/<node>/bootstrap.log on the node)"))
        return NodeStatus(NodeState.RUNNING)

    def read_log(self, handle: H, offset: int) -> tuple[bytes, int]:
        if self.channel is None:
            return b"", offset
        return self.channel.read_log(handle.node_id, offset)

    def read_metrics(self, handle: H, offsets: dict[str, int]) -> list[dict]:
        return [] if self.channel is None else self.channel.read_metrics(handle.node_id, offsets)

    def read_health(self, handle: H, offsets: dict[str, int]) -> list[dict]:
        return [] if self.channel is None else self.channel.read_health(handle.node_id, offsets)

    def read_failure(self, handle: H) -> FailureReason | None:
        if self.channel is None or handle.attempt is None:
            return None
        return self.channel.read_failure(handle.node_id, handle.attempt)

    def stop_attempt(self, handle: H) -> None:
        """Ask the node's daemon to stop the running attempt (the protocol's stop request)."""
        if self.channel is not None and handle.attempt:
            self.channel.request_stop(handle.node_id, handle.attempt)

    def keepalive(self, job_id: str) -> None:
        """The controller watches ``job_id``: rewrite the heartbeat in the job's storage
        (:meth:`NodeChannel.beat`) at most every ``grace / 5`` s (1 to 60 s). A node's daemon
        powers its node off when it stops changing for ``SFTCTL_CLOUD_CONTROLLER_GRACE_S``
        (a controller killed -9 no longer leaves GPUs billing). Raises StorageError (the
        controller's outage handling takes it)."""
        grace = settings.get("SFTCTL_CLOUD_CONTROLLER_GRACE_S")
        if not grace or self.channel is None:
            return
        now = time.monotonic()
        if now - self._beat_at < max(1.0, min(60.0, grace / 5)):
            return
        self.channel.beat()
        self._beat_at = now

    def terminate(self, handle: H) -> None:
        if handle.id:
            self.delete_instance(handle)

    def terminate_tagged(self, job_id: str) -> int:
        """Delete every live resource labelled with ``job_id``; return how many there were."""
        found = self.list_instances(job_id)
        for listed in found:
            self.delete_instance(self.listed_handle(listed))
        return len(found)

    def _need_channel(self) -> None:
        if self.channel is None:
            raise ProviderError(
                f"{self.name} nodes need the job's storage to receive their script",
                hint="set storage: s3://BUCKET/PREFIX or gs://BUCKET/PREFIX in the job spec",
            )
