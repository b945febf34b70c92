"""Cloud TPU VM slices on GCP: the TPU half of the ``gcp`` provider (``google-cloud-tpu``, REST).

A TPU offering is a catalog row whose instance type is a Cloud TPU accelerator type
(``v5litepod-8``, ``v5litepod-16``, ``v5p-16``, ``v6e-8`` ...; :func:`slice_shape`). The
:class:`~sftctl.providers.gcp.GCPProvider` hands every call about such an offering or handle to a
:class:`TPUSlices`, so a TPU job is an ordinary ``gcp`` job: one sftctl *node* is one slice (all
its chips, ``count`` in the catalog), whatever number of TPU VM hosts ("workers") it has.

Creating a slice is a **queued resource** (``projects.locations.queuedResources.create``, the way
Google provisions v5e, v5p and v6e): one ``nodeSpec`` naming the node after the sftctl node id
(:func:`sftctl.providers.gcp.instance_name`), the accelerator type, the TPU VM runtime of its
generation (:data:`RUNTIME_VERSIONS`), the job's labels, and the bootstrap as the
``startup-script``, which the TPU VM runs on every worker; ``spot: {}`` for spot capacity. The
request waits in the queue until Google has the capacity (``WAITING_FOR_RESOURCES`` /
``ACCEPTED`` / ``PROVISIONING``), at most ``ready_timeout_s``; ``FAILED`` for lack of capacity is
a zone :class:`CapacityError` (the next zone of the region is tried), any other failure a
:class:`ProviderError` with Google's message; the queued resource is deleted first either way.
A spot slice that Google takes back goes ``SUSPENDING``/``SUSPENDED`` (its node ``PREEMPTED``):
:meth:`TPUSlices.describe` says STOPPING, and the controller's spot handling replaces it.
Deleting is ``queuedResources.delete`` with ``force=true`` (the node goes with it).

Every host of the slice runs the node daemon: the bootstrap is wrapped (:func:`worker_bootstrap`)
so that worker ``w`` (the TPU VM metadata ``agent-worker-number``) is sftctl node
``<node id>`` for ``w = 0`` and ``<node id>.w<w>`` for the others (:func:`worker_node_ids`).
:func:`worker_env` is what each worker's attempt adds to the job's environment so that the JAX
script's ``jax.distributed.initialize()`` sees every host: ``JAX_COORDINATOR_ADDRESS`` (worker 0's
internal address, port :data:`JAX_COORDINATOR_PORT`), ``JAX_NUM_PROCESSES`` (hosts),
``JAX_PROCESS_ID`` (the worker). JAX reads ``JAX_COORDINATOR_ADDRESS`` itself and, on a TPU VM,
finds the process count and id in the TPU metadata; a script that passes them
(``jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]), ...)``) runs
the same way anywhere (tests/test_provider_gcp_tpu.py starts two such processes).

The TPU API endpoint is the ``tpu_endpoint`` argument or ``SFTCTL_TPU_ENDPOINT`` (an emulator),
else Google's. Errors: 401/403 :class:`CredentialsError`; 429 retried; a 400 naming the
accelerator type (not offered in that zone) a zone :class:`CapacityError`; quota (403/429
``RESOURCE_EXHAUSTED`` with a quota message) a region :class:`CapacityError`.
"""

from __future__ import annotations

import re
import shlex
import time
import uuid

from sftctl.errors import CapacityError, CredentialsError, ProviderError, SftctlError
from sftctl.providers.cloud import JOB_LABEL, MANAGED_LABEL, InstanceRequest, InstanceState, label_value
from sftctl.types import GCPHandle

#: TPU VM software version per accelerator-type family (Cloud TPU docs, "TPU software versions":
#: v5e ``v2-alpha-tpuv5-lite``, v5p ``v2-alpha-tpuv5``, v6e ``v2-alpha-tpuv6e``).
RUNTIME_VERSIONS = {"v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
#: Chips per TPU VM host of a multi-host slice, and the most chips a single-host slice has
#: (Cloud TPU docs "TPU v5e", "TPU v5p", "TPU v6e": v5e and v6e multi-host slices have 4 chips per
#: VM, single-host up to 8; v5p has 4 chips per VM; v5p names count TensorCores, 2 per chip).
CHIPS_PER_HOST = {"v5litepod": 4, "v5p": 4, "v6e": 4}
SINGLE_HOST_MAX_CHIPS = {"v5litepod": 8, "v5p": 4, "v6e": 8}
CORES_PER_CHIP = {"v5litepod": 1, "v5p": 2, "v6e": 1}
#: The port worker 0 serves ``jax.distributed``'s coordinator on (JAX's documented default is
#: any free port the caller names; MaxText and Google's TPU guides use 8476).
JAX_COORDINATOR_PORT = 8476
_TYPE = re.compile(r"^(v5litepod|v5p|v6e)-(\d+)$")

#: Queued resource state -> the four states the cloud base class knows.
QR_STATES = {
    "CREATING": InstanceState.PENDING, "ACCEPTED": InstanceState.PENDING,
    "WAITING_FOR_RESOURCES": InstanceState.PENDING, "PROVISIONING": InstanceState.PENDING,
    "ACTIVE": InstanceState.RUNNING, "SUSPENDING": InstanceState.STOPPING, "SUSPENDED": InstanceState.STOPPING,
    "DELETING": InstanceState.STOPPING, "FAILED": InstanceState.STOPPING,
}
#: Node states under an ACTIVE queued resource that mean the slice is not usable.
NODE_GONE = {"PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING", "HIDDEN"}
#: Node health values that mean a host of the slice is lost or its TPU runtime failed
#: (``tpu_v2.Node.Health``: the runtime stopped answering, or a host under maintenance).
NODE_UNHEALTHY = {"TIMEOUT", "UNHEALTHY_TENSORFLOW", "UNHEALTHY_MAINTENANCE"}
#: Words of a FAILED queued resource's error that mean "no capacity" (Google's messages:
#: "There is no more capacity in the zone", "Insufficient capacity", google.rpc.Code 8).
CAPACITY_WORDS = ("capacity", "resource_exhausted", "stockout", "not enough resources")

METADATA_WORKER = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number"


def slice_shape(instance_type: str) -> tuple[str, int, int] | None:
    """``(family, chips, hosts)`` of a Cloud TPU accelerator type, None for anything else.

    ``v5litepod-8`` -> ("v5litepod", 8, 1); ``v5litepod-16`` -> ("v5litepod", 16, 4);
    ``v5p-16`` (16 TensorCores) -> ("v5p", 8, 2); ``v6e-16`` -> ("v6e", 16, 4).
    """
    m = _TYPE.match(instance_type or "")
    if m is None:
        return None
    family, n = m.group(1), int(m.group(2))
    chips = max(1, n // CORES_PER_CHIP[family])
    hosts = 1 if chips <= SINGLE_HOST_MAX_CHIPS[family] else chips // CHIPS_PER_HOST[family]
    return family, chips, hosts


def is_tpu(instance_type: str | None) -> bool:
    """Whether a catalog instance type is a Cloud TPU slice."""
    return slice_shape(instance_type or "") is not None


def worker_node_ids(node_id: str, hosts: int) -> list[str]:
    """The sftctl node id of each worker of a slice: ``node_id`` for worker 0, ``node_id.w<w>``."""
    return [node_id] + [f"{node_id}.w{w}" for w in range(1, hosts)]


def worker_env(hosts: int, worker: int, coordinator_ip: str, chips_per_host: int) -> dict[str, str]:
    """The environment worker ``worker`` of a ``hosts``-host slice adds to the job's: what
    ``jax.distributed.initialize()`` needs (coordinator ``ip:port``, process count and id), the
    worker and host count, and the chips each host drives."""
    return {
        "JAX_COORDINATOR_ADDRESS": f"{coordinator_ip}:{JAX_COORDINATOR_PORT}",
        "JAX_NUM_PROCESSES": str(hosts), "JAX_PROCESS_ID": str(worker),
        "SFTCTL_TPU_WORKER": str(worker), "SFTCTL_TPU_HOSTS": str(hosts),
        "SFTCTL_TPU_CHIPS_PER_HOST": str(chips_per_host),
    }


def worker_bootstrap(bootstrap: str) -> str:
    """The node bootstrap made per worker: after its ``export SFTCTL_NODE_ID=...`` line, a worker
    other than 0 (``$SFTCTL_TPU_WORKER``, else the TPU VM metadata ``agent-worker-number``)
    appends ``.w<worker>`` to its node id, so every host runs its own node daemon."""
    if not bootstrap:
        return bootstrap
    snippet = (
        '\n# Cloud TPU: every worker of the slice runs this; worker w > 0 is node "$SFTCTL_NODE_ID.w$w"\n'
        f'_w="${{SFTCTL_TPU_WORKER:-$(curl -sf -H "Metadata-Flavor: Google" {shlex.quote(METADATA_WORKER)} || echo 0)}}"\n'
        'export SFTCTL_TPU_WORKER="$_w"\n'
        '[ "$_w" = 0 ] || export SFTCTL_NODE_ID="$SFTCTL_NODE_ID.w$_w"\n'
    )
    lines = bootstrap.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("export SFTCTL_NODE_ID="):
            return "\n".join(lines[:i + 1]) + snippet + "\n".join(lines[i + 1:])
    raise ProviderError("gcp: the node bootstrap sets no SFTCTL_NODE_ID: cannot make it per TPU worker",
                        hint="a bug in sftctl/templates/bootstrap.sh.j2")


def _google_message(e) -> str:
    try:
        message = e.response.json()["error"]["message"]
    except Exception:  # noqa: BLE001 no response, not JSON
        message = getattr(e, "message", None) or str(e)
    return " ".join(str(message).split())


def _is_throttle(e: BaseException) -> bool:
    from google.api_core import exceptions as gexc

    return isinstance(e, gexc.TooManyRequests) and "quota" not in _google_message(e).lower()


class TPUSlices:
    """The Cloud TPU API calls of the ``gcp`` provider (see the module docstring).

    Args:
        project_credentials: a callable returning ``(credentials, project)`` (the GCP
            provider's resolution: ADC, project from the environment).
        endpoint: the TPU API endpoint (an emulator), None for Google's.
        poll_s: seconds between reads of a queued resource.
        ready_timeout_s: how long a queued resource may wait for capacity and provisioning.
        call: the provider's call wrapper (throttle retries, auth errors as sftctl errors).
    """

    def __init__(self, project_credentials, endpoint: str | None, poll_s: float, ready_timeout_s: float, call=None):
        self._auth = project_credentials
        self.endpoint = endpoint
        self.poll_s = poll_s
        self.ready_timeout_s = ready_timeout_s
        self._call = call or (lambda fn, *a, **k: fn(*a, **k))
        self._client_obj = None

    # ------------------------------------------------------------------ client and errors

    def _client(self):
        if self._client_obj is None:
            from google.cloud import tpu_v2

            credentials, _ = self._auth()
            options = {"api_endpoint": self.endpoint} if self.endpoint else None
            self._client_obj = tpu_v2.TpuClient(credentials=credentials, transport="rest", client_options=options)
        return self._client_obj

    def _retried(self, fn, *args, **kwargs):
        from sftctl.providers.cloud import retry_throttled

        return self._call(retry_throttled(_is_throttle)(fn), *args, **kwargs)

    def _error(self, e, what: str, request: InstanceRequest | None = None) -> SftctlError:
        message, code = _google_message(e), getattr(e, "code", None)
        low = message.lower()
        if request is not None:
            o = request.offering
            if "quota" in low and code in (403, 429):
                return CapacityError(f"gcp: TPU quota exceeded for {o.instance_type} in {o.region}: {message}",
                                     provider="gcp", scope="region", region=o.region, zone=request.zone,
                                     instance_type=o.instance_type, code="QUOTA_EXCEEDED",
                                     hint="request more TPU quota (console: IAM & Admin > Quotas, "
                                          "TPUS_PER_TPU_FAMILY or the preemptible one for spot)")
            if code == 400 and "accelerator" in low and ("not" in low or "unsupported" in low):
                return self._zone_error("NOT_OFFERED_IN_ZONE", message, request)
        if code == 401:
            return CredentialsError(f"gcp: {what}: the credentials were rejected (401): {message}",
                                    hint="gcloud auth application-default login")
        if code == 403:
            if "SERVICE_DISABLED" in message or "has not been used" in message:
                return CredentialsError(f"gcp: {what}: the Cloud TPU API is not enabled: {message}",
                                        hint="gcloud services enable tpu.googleapis.com")
            return CredentialsError(f"gcp: {what}: permission denied (403): {message}",
                                    hint="grant the account roles/tpu.admin and roles/iam.serviceAccountUser")
        return ProviderError(f"gcp: {what} failed ({code}): {message}")

    @staticmethod
    def _zone_error(code: str, message: str, request: InstanceRequest) -> CapacityError:
        o = request.offering
        return CapacityError(f"gcp: no TPU capacity for {o.instance_type} in {request.zone} ({code}): {message}",
                             provider="gcp", scope="zone", region=o.region, zone=request.zone,
                             instance_type=o.instance_type, code=code, hint="sftctl tries the region's other zones")

    # ------------------------------------------------------------------ the calls

    def zones(self, region: str) -> list[str]:
        """The TPU locations (zones) of ``region`` (``projects.locations.list``), sorted."""
        from google.api_core import exceptions as gexc
        from google.cloud.location import locations_pb2

        _, project = self._auth()
        client = self._client()
        try:
            got = self._retried(client.list_locations, locations_pb2.ListLocationsRequest(name=f"projects/{project}"))
        except gexc.GoogleAPICallError as e:
            raise self._error(e, f"listing the TPU locations of {region}") from None
        return sorted(loc.location_id for loc in got.locations if loc.location_id.rsplit("-", 1)[0] == region)

    def queued_resource(self, request: InstanceRequest, name: str):
        """The ``tpu_v2.QueuedResource`` to create for ``request`` (one node named ``name``)."""
        from google.cloud import tpu_v2

        o = request.offering
        family, _chips, _hosts = slice_shape(o.instance_type)
        _, project = self._auth()
        metadata = {"sftctl-job-id": request.job_id, "sftctl-node-id": request.node_id}
        if request.bootstrap:
            metadata["startup-script"] = worker_bootstrap(request.bootstrap)
        node = tpu_v2.Node(
            accelerator_type=o.instance_type,
            runtime_version=request.image or RUNTIME_VERSIONS[family],
            labels=dict(request.labels), metadata=metadata,
            network_config=tpu_v2.NetworkConfig(enable_external_ips=True),
            description=f"sftctl job {request.job_id} node {request.node_id}",
        )
        spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=f"projects/{project}/locations/{request.zone}",
                                                  node_id=name, node=node)
        qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
        if request.spot:
            qr.spot = tpu_v2.QueuedResource.Spot()
        return qr

    def create(self, request: InstanceRequest, name: str) -> GCPHandle:
        """Queue the slice and wait until it is ACTIVE (capacity granted, every host READY).

        Raises:
            CapacityError: FAILED for capacity, or the type not offered in the zone (zone); quota (region).
            CredentialsError: 401 / 403.
            ProviderError: any other failure, or still queued after ``ready_timeout_s`` (deleted first).
        """
        from google.api_core import exceptions as gexc
        from google.cloud import tpu_v2

        _, project = self._auth()
        parent = f"projects/{project}/locations/{request.zone}"
        create = tpu_v2.CreateQueuedResourceRequest(parent=parent, queued_resource_id=name,
                                                    queued_resource=self.queued_resource(request, name),
                                                    request_id=str(uuid.uuid4()))
        client = self._client()
        try:
            op = self._retried(client.create_queued_resource, request=create)
            op.result(timeout=self.ready_timeout_s, polling=_polling(self.poll_s, self.ready_timeout_s))
        except gexc.GoogleAPICallError as e:
            raise self._error(e, f"queueing TPU {name} in {request.zone}", request) from None
        handle = GCPHandle(job_id=request.job_id, node_id=request.node_id, rank=request.rank, id=name,
                           zone=request.zone, project=project, instance_type=request.offering.instance_type,
                           spot=request.spot, region=request.offering.region)
        end = time.monotonic() + self.ready_timeout_s
        while True:
            qr = self._get_qr(handle)
            state = tpu_v2.QueuedResourceState.State(qr.state.state).name if qr is not None else "GONE"
            if state == "ACTIVE":
                return handle
            if state in ("FAILED", "SUSPENDED", "SUSPENDING", "GONE") or time.monotonic() > end:
                error = qr.state.failed_data.error if qr is not None and state == "FAILED" else None
                message = " ".join((error.message if error is not None else "").split())
                self.delete(handle)
                if state == "FAILED" and any(w in message.lower() for w in CAPACITY_WORDS):
                    raise self._zone_error("STOCKOUT", message, request)
                if state == "FAILED":
                    raise ProviderError(f"gcp: TPU {name} in {request.zone} failed: {message or 'no reason given'}")
                raise ProviderError(f"gcp: TPU {name} in {request.zone} was {state.lower()} after "
                                    f"{self.ready_timeout_s:.0f} s in the queue (sftctl deleted it)",
                                    hint="retry later, or allow other zones, regions or accelerators")
            time.sleep(self.poll_s)

    def _get_qr(self, handle: GCPHandle):
        from google.api_core import exceptions as gexc

        name = f"projects/{handle.project}/locations/{handle.zone}/queuedResources/{handle.id}"
        try:
            return self._retried(self._client().get_queued_resource, name=name)
        except gexc.NotFound:
            return None
        except gexc.GoogleAPICallError as e:
            raise self._error(e, f"reading queued resource {handle.id}") from None

    def node(self, handle: GCPHandle):
        """The slice's ``tpu_v2.Node``, None when it does not exist."""
        from google.api_core import exceptions as gexc

        name = f"projects/{handle.project}/locations/{handle.zone}/nodes/{handle.id}"
        try:
            return self._retried(self._client().get_node, name=name)
        except gexc.NotFound:
            return None
        except gexc.GoogleAPICallError as e:
            raise self._error(e, f"reading TPU node {handle.id}") from None

    def describe(self, handle: GCPHandle) -> InstanceState:
        """ACTIVE with a READY node -> RUNNING; queued -> PENDING; SUSPENDING/SUSPENDED (spot
        preemption), DELETING, FAILED, a PREEMPTED/TERMINATED node or an unhealthy one (a lost
        host, a failed TPU runtime: :data:`NODE_UNHEALTHY`) -> STOPPING; gone -> GONE."""
        from google.cloud import tpu_v2

        qr = self._get_qr(handle)
        if qr is None:
            return InstanceState.GONE
        state = QR_STATES.get(tpu_v2.QueuedResourceState.State(qr.state.state).name, InstanceState.PENDING)
        if state != InstanceState.RUNNING:
            return state
        node = self.node(handle)
        if node is None:
            return InstanceState.GONE
        node_state = tpu_v2.Node.State(node.state).name
        if node_state in NODE_GONE or tpu_v2.Node.Health(node.health).name in NODE_UNHEALTHY:
            return InstanceState.STOPPING  # the controller replaces the slice, resuming from its checkpoint
        return InstanceState.RUNNING if node_state == "READY" else InstanceState.PENDING

    def endpoints(self, handle: GCPHandle) -> list[str]:
        """The internal address of every worker of the slice, worker 0 first ([] when gone)."""
        node = self.node(handle)
        return [] if node is None else [ep.ip_address for ep in node.network_endpoints]

    def delete(self, handle: GCPHandle) -> None:
        """Delete the queued resource and its node (``force``) and wait; a missing one is fine."""
        from google.api_core import exceptions as gexc
        from google.cloud import tpu_v2

        name = f"projects/{handle.project}/locations/{handle.zone}/queuedResources/{handle.id}"
        client = self._client()
        try:
            op = self._retried(client.delete_queued_resource, request=tpu_v2.DeleteQueuedResourceRequest(
                name=name, force=True, request_id=str(uuid.uuid4())))
            op.result(timeout=self.ready_timeout_s, polling=_polling(self.poll_s, self.ready_timeout_s))
        except gexc.NotFound:
            return
        except gexc.GoogleAPICallError as e:
            raise ProviderError(f"gcp: deleting TPU {handle.id} in {handle.zone} failed: {_google_message(e)}",
                                hint=f"gcloud compute tpus queued-resources delete {handle.id} --zone {handle.zone} "
                                     "--force") from None

    def list(self, job_id: str | None = None) -> list[dict]:
        """Every sftctl queued resource (``sftctl-managed=true`` on its node), of ``job_id`` when
        given, in any zone (``locations/-``)."""
        from google.api_core import exceptions as gexc
        from google.cloud import tpu_v2

        _, project = self._auth()
        client = self._client()

        def fetch() -> list[dict]:
            out = []
            for qr in client.list_queued_resources(parent=f"projects/{project}/locations/-"):
                for spec in qr.tpu.node_spec:
                    node = spec.node
                    if node.labels.get(MANAGED_LABEL) != "true":
                        continue
                    meta = dict(node.metadata)
                    inst_job = meta.get("sftctl-job-id") or node.labels.get(JOB_LABEL)
                    if job_id is not None and (meta.get("sftctl-job-id", job_id) != job_id
                                               or node.labels.get(JOB_LABEL) != label_value(job_id)):
                        continue
                    zone = spec.parent.rsplit("/", 1)[-1]
                    out.append({"id": qr.name.rsplit("/", 1)[-1], "zone": zone, "project": project,
                                "instance_type": node.accelerator_type, "job_id": inst_job,
                                "node_id": meta.get("sftctl-node-id"), "spot": "spot" in qr,
                                "status": tpu_v2.QueuedResourceState.State(qr.state.state).name})
            return out

        try:
            return self._retried(fetch)
        except gexc.GoogleAPICallError as e:
            raise self._error(e, "listing sftctl's TPU queued resources") from None


def _polling(poll_s: float, timeout_s: float):
    """An api_core polling policy for the TPU API's long-running operations: every ``poll_s``
    growing to 4x, until ``timeout_s`` (api_core's ``DEFAULT_POLLING`` starts at 1 s)."""
    from google.api_core.future import polling

    return polling.DEFAULT_POLLING.with_delay(initial=max(0.01, poll_s), maximum=max(0.05, poll_s * 4),
                                              multiplier=1.5).with_timeout(timeout_s)
