"""GCP Compute Engine: nodes are GCE instances created with ``google-cloud-compute`` (REST).

``google.cloud.compute_v1`` and ``google.auth`` are imported inside this module's functions only,
so importing :mod:`sftctl.providers` (``sftctl status``) never loads them.

Configuration, first match wins:

* project: the ``project`` argument, ``CLOUDSDK_CORE_PROJECT``, ``GOOGLE_CLOUD_PROJECT``, then the
  project of Application Default Credentials (``google.auth.default()``).
* credentials: the ``credentials`` argument (tests pass ``AnonymousCredentials``), else ADC
  (``gcloud auth application-default login`` or ``GOOGLE_APPLICATION_CREDENTIALS``); anonymous
  when the endpoint is an emulator's (``SFTCTL_GCE_ENDPOINT``) and the project is set.
* endpoint: the ``api_endpoint`` argument or ``SFTCTL_GCE_ENDPOINT`` (an emulator), else Google's;
  the Cloud TPU API's: ``tpu_endpoint`` or ``SFTCTL_TPU_ENDPOINT`` (an emulated GCE without one
  has no TPU API: its listings skip TPUs).

An offering whose instance type is a Cloud TPU accelerator type (``v5litepod-16``, ``v6e-8``) is
a TPU VM slice: :mod:`sftctl.providers.gcp_tpu` creates it as a queued resource, one sftctl node
per slice, every host of it running the node daemon; this class hands it every call about such an
offering or handle.

A node is one instance named after its node id (:func:`instance_name`), in a zone of the
offering's region, labelled with :func:`sftctl.providers.cloud.labels`, booting a Deep Learning
VM image (NVIDIA driver and CUDA preinstalled) that runs the bootstrap as its ``startup-script``.
GPUs come with the machine type for accelerator-optimized families (a2, a3, a4, g2); the
catalog's ``n1-standard-4+T4`` form means an N1 type plus ``guestAccelerators``. Every GPU
instance sets ``onHostMaintenance: TERMINATE`` (GCE cannot live-migrate GPUs and rejects the
insert otherwise) and ``automaticRestart: false`` (a node that went away is replaced by the
controller, not restarted behind its back); spot nodes use ``provisioningModel: SPOT`` with
``instanceTerminationAction: DELETE`` so a preempted node leaves nothing billable behind.

Errors, from the insert call itself or from its zone operation's ``error.errors``:

=============================================================  ===============================
``ZONE_RESOURCE_POOL_EXHAUSTED[_WITH_DETAILS]``,                :class:`CapacityError` zone
``RESOURCE_NOT_READY``, machine type not offered in the zone
``QUOTA_EXCEEDED`` / 403 ``quotaExceeded``, regional metric     :class:`CapacityError` region
the same with a global metric (``GPUS_ALL_REGIONS``)            :class:`CapacityError` cloud
401, 403 (other than quota and rate limits)                     :class:`CredentialsError`
429 / 403 ``rateLimitExceeded``                                 retried (``retry_throttled``)
anything else                                                   :class:`ProviderError`
=============================================================  ===============================
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from sftctl.catalog import Offering, cloud_offerings
from sftctl.catalog.identity import from_gce_accelerator_type, gce_accelerator_type
from sftctl.errors import CapacityError, CredentialsError, ProviderError, SftctlError
from sftctl.types import GCPHandle
from sftctl.providers import gcp_tpu
from sftctl.providers.base import NodeState, NodeStatus, ProviderEntry
from sftctl.providers.cloud import (
    JOB_LABEL, MANAGED_LABEL, NODE_LABEL, READY_TIMEOUT_S, CloudProvider, InstanceRequest, InstanceState,
    label_value, retry_throttled,
)

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"

#: Deep Learning VM family with the NVIDIA driver and CUDA 12.4 (Google's ``deeplearning-platform-release``).
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11"
BOOT_DISK_GB = 200  # DLVM images need >= 50 GB; checkpoints and datasets caches live here too

#: Machine families whose types carry their GPUs.
ACCELERATOR_OPTIMIZED = ("a2", "a3", "a4", "g2")

ZONE_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "RESOURCE_NOT_READY")
THROTTLE_REASONS = ("rateLimitExceeded", "userRateLimitExceeded")
#: Metadata keys holding the exact job and node id (label values are lowercased and truncated).
JOB_ID_KEY, NODE_ID_KEY = "sftctl-job-id", "sftctl-node-id"
NOT_IN_ZONE = re.compile(r"(?:Machine|Accelerator) type .* does not exist in zone")

#: GCE instance status -> the four states the base class knows. GCE's TERMINATED means stopped.
STATUS = {
    "PROVISIONING": InstanceState.PENDING, "STAGING": InstanceState.PENDING, "REPAIRING": InstanceState.PENDING,
    "PENDING": InstanceState.PENDING, "RUNNING": InstanceState.RUNNING, "STOPPING": InstanceState.STOPPING,
    "SUSPENDING": InstanceState.STOPPING, "SUSPENDED": InstanceState.STOPPING,
    "TERMINATED": InstanceState.STOPPING, "STOPPED": InstanceState.STOPPING,
}

CREDENTIALS_HINT = ("run `gcloud auth application-default login` (or set GOOGLE_APPLICATION_CREDENTIALS to a "
                    "service account key file) and set a project: `gcloud config set project PROJECT` or "
                    "CLOUDSDK_CORE_PROJECT")


def instance_name(node_id: str) -> str:
    """A GCE instance name (RFC 1035: ``[a-z]([-a-z0-9]{0,61}[a-z0-9])?``) for ``node_id``.

    ``sftctl-`` plus the node id lowercased with other characters as ``-``; when that changed the
    id or is too long, a hash of the id keeps distinct ids distinct.
    """
    base = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", node_id.lower())).strip("-")
    name = f"sftctl-{base}" if base else "sftctl-node"
    if base != node_id or len(name) > 63:
        digest = hashlib.sha1(node_id.encode()).hexdigest()[:8]
        name = f"{name[:54].rstrip('-')}-{digest}"
    return name


def split_instance_type(instance_type: str, accelerator: str, count: int) -> tuple[str, tuple[str, int] | None]:
    """``(machine type, (accelerator type, count) or None)`` of a catalog instance type.

    ``n1-standard-4+T4`` -> ``("n1-standard-4", ("nvidia-tesla-t4", count))``; ``a2-highgpu-1g``
    -> ``("a2-highgpu-1g", None)`` (the machine type carries its GPUs). The part after ``+`` is a
    catalog accelerator name or already a GCE accelerator type (``nvidia-...``).

    Raises:
        ProviderError: an accelerator sftctl cannot name in GCE's terms.
    """
    if "+" not in instance_type:
        return instance_type, None
    machine, acc = instance_type.split("+", 1)
    gce = acc if acc.startswith("nvidia-") else gce_accelerator_type(acc) or gce_accelerator_type(accelerator)
    if gce is None:
        raise ProviderError(f"gcp: no GCE accelerator type known for {acc!r} (instance type {instance_type})",
                            hint="give its identity.gce_accelerator_type in sftctl/catalog/accelerators.yaml")
    return machine, (gce, count)


def catalog_instance_type(machine_type: str, accelerators: list[tuple[str, int]]) -> str:
    """The catalog's instance type of an instance: the inverse of :func:`split_instance_type`."""
    machine = machine_type.rsplit("/", 1)[-1]
    if not accelerators:
        return machine
    gce = accelerators[0][0].rsplit("/", 1)[-1]
    return f"{machine}+{from_gce_accelerator_type(gce) or gce}"


def _google_message(e) -> str:
    """Google's own message of an api_core exception (without the ``METHOD URL:`` prefix)."""
    try:
        message = e.response.json()["error"]["message"]
    except Exception:  # noqa: BLE001 no response, not JSON: api_core's text is all there is
        message = getattr(e, "message", None) or str(e)
    return " ".join(str(message).split())


def _reasons(e) -> set[str]:
    return {err.get("reason", "") for err in (getattr(e, "errors", None) or []) if isinstance(err, dict)}


def _is_throttle(e: BaseException) -> bool:
    from google.api_core import exceptions as gexc

    if isinstance(e, gexc.TooManyRequests):
        return True
    return isinstance(e, gexc.Forbidden) and bool(_reasons(e) & set(THROTTLE_REASONS))


class GCPProvider(CloudProvider[GCPHandle]):
    """Nodes on Google Compute Engine. See the module docstring.

    Args:
        channel, poll_s, ready_timeout_s: as for :class:`CloudProvider`. ``ready_timeout_s`` also
            bounds how long a create or delete operation may take.
        project: the GCP project (else from the environment or ADC).
        credentials: ``google.auth`` credentials (else ADC).
        api_endpoint: the Compute API endpoint, e.g. ``http://127.0.0.1:8080`` for an emulator.
        tpu_endpoint: the Cloud TPU API endpoint (an emulator), else ``SFTCTL_TPU_ENDPOINT``, else Google's.
    """

    name = "gcp"
    handle_type = GCPHandle

    def __init__(self, channel=None, poll_s: float = 2.0, ready_timeout_s: float = READY_TIMEOUT_S,
                 project: str | None = None, credentials=None, api_endpoint: str | None = None,
                 tpu_endpoint: str | None = None, **_):
        super().__init__(channel, poll_s, ready_timeout_s)
        self._project_arg = project
        self._credentials_arg = credentials
        from sftctl import settings

        self.api_endpoint = api_endpoint or settings.get("SFTCTL_GCE_ENDPOINT")
        self.tpu_endpoint = tpu_endpoint or settings.get("SFTCTL_TPU_ENDPOINT")
        self._tpu_slices: gcp_tpu.TPUSlices | None = None
        self._lock = threading.Lock()
        self._auth: tuple[object, str] | None = None
        self._clients: dict[str, object] = {}

    # ------------------------------------------------------------------ credentials and clients

    def _resolve(self) -> tuple[object, str]:
        """``(credentials, project)``, resolved once. Raises CredentialsError (one line + hint)."""
        with self._lock:
            if self._auth is not None:
                return self._auth
            credentials = self._credentials_arg
            project = (self._project_arg or os.environ.get("CLOUDSDK_CORE_PROJECT")
                       or os.environ.get("GOOGLE_CLOUD_PROJECT"))
            if credentials is None and self.api_endpoint and project:  # an emulator takes anyone
                from google.auth.credentials import AnonymousCredentials

                credentials = AnonymousCredentials()
            if credentials is None or not project:
                import google.auth
                from google.auth.exceptions import DefaultCredentialsError

                try:
                    adc, adc_project = google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
                except DefaultCredentialsError as e:
                    if credentials is None:
                        raise CredentialsError(
                            "gcp: no Google credentials found: " + " ".join(str(e).split()),
                            hint=CREDENTIALS_HINT) from None
                    adc, adc_project = None, None
                credentials = credentials or adc
                project = project or adc_project
            if not project:
                raise CredentialsError("gcp: no project is set", hint=CREDENTIALS_HINT)
            self._auth = (credentials, project)
            return self._auth

    @property
    def project(self) -> str:
        return self._resolve()[1]

    def _client(self, kind: str):
        """The ``compute_v1`` client ``kind`` (instances, zone_operations, zones), REST transport."""
        credentials, _ = self._resolve()
        with self._lock:
            if kind not in self._clients:
                from google.cloud import compute_v1

                cls = {"instances": compute_v1.InstancesClient, "zone_operations": compute_v1.ZoneOperationsClient,
                       "zones": compute_v1.ZonesClient}[kind]
                options = {"api_endpoint": self.api_endpoint} if self.api_endpoint else None
                self._clients[kind] = cls(credentials=credentials, transport="rest", client_options=options)
            return self._clients[kind]

    def _call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, retried on throttling; auth-library failures as sftctl errors."""
        from google.auth import exceptions as auth_exc

        try:
            return retry_throttled(_is_throttle)(fn)(*args, **kwargs)
        except auth_exc.TransportError as e:
            raise ProviderError("gcp: could not reach Google's auth servers: " + " ".join(str(e).split()),
                                hint="check the network connection and retry") from None
        except auth_exc.GoogleAuthError as e:  # a refresh that failed (expired, revoked, anonymous)
            raise CredentialsError("gcp: the Google credentials were rejected or could not be refreshed: "
                                   + " ".join(str(e).split()), hint=CREDENTIALS_HINT) from None

    def _api_error(self, e, what: str, request: InstanceRequest | None = None) -> SftctlError:
        """The sftctl error for api_core exception ``e`` raised while doing ``what``."""
        message, reasons = _google_message(e), _reasons(e)
        code = getattr(e, "code", None)
        if request is not None:
            if "quotaExceeded" in reasons or "QUOTA_EXCEEDED" in reasons:
                return self._quota_error(message, "", request)
            zone_code = next((c for c in ZONE_CODES if c in reasons or c in message), None)
            if zone_code is None and code == 400 and NOT_IN_ZONE.search(message):
                zone_code = "NOT_OFFERED_IN_ZONE"
            if zone_code is not None:
                return self._zone_error(zone_code, message, request)
        if code == 401:
            return CredentialsError(f"gcp: {what}: the credentials were rejected (401): {message}",
                                    hint=CREDENTIALS_HINT)
        if code == 403 and not reasons & set(THROTTLE_REASONS):
            if "accessNotConfigured" in reasons or "SERVICE_DISABLED" in message:
                return CredentialsError(f"gcp: {what}: the Compute Engine API is not enabled: {message}",
                                        hint="gcloud services enable compute.googleapis.com")
            return CredentialsError(f"gcp: {what}: permission denied (403): {message}",
                                    hint="grant the account roles/compute.instanceAdmin.v1 and "
                                         "roles/iam.serviceAccountUser on the project")
        if _is_throttle(e):
            return ProviderError(f"gcp: {what}: still throttled after retries: {message}",
                                 hint="wait a minute and retry; fewer parallel nodes throttle less")
        return ProviderError(f"gcp: {what} failed ({code}): {message}")

    def _zone_error(self, code: str, message: str, request: InstanceRequest) -> CapacityError:
        o = request.offering
        return CapacityError(
            f"gcp: no capacity for {o.instance_type} in {request.zone} ({code}): {message}",
            provider=self.name, scope="zone", region=o.region, zone=request.zone,
            instance_type=o.instance_type, code=code, hint="sftctl tries the region's other zones")

    def _quota_error(self, message: str, metric: str, request: InstanceRequest) -> CapacityError:
        """A QUOTA_EXCEEDED: scope ``cloud`` for a global quota (``GPUS_ALL_REGIONS``), else ``region``."""
        if not metric:
            m = re.search(r"Quota '([A-Za-z0-9_\-]+)' exceeded", message)
            metric = m.group(1) if m else ""
        metric = metric.rsplit("/", 1)[-1].upper().replace("-", "_")
        global_quota = "ALL_REGIONS" in metric or "globally" in message
        o = request.offering
        where = "all regions" if global_quota else o.region
        return CapacityError(
            f"gcp: quota {metric or '(unnamed)'} exceeded for {o.instance_type} in {where}: {message}",
            provider=self.name, scope="cloud" if global_quota else "region", region=o.region, zone=request.zone,
            instance_type=o.instance_type, code="QUOTA_EXCEEDED",
            hint=f"request a higher {metric or 'GPU'} quota (console: IAM & Admin > Quotas), "
                 "or allow other regions or clouds")

    def _operation_error(self, op, request: InstanceRequest) -> SftctlError:
        """The sftctl error for a DONE operation whose ``error.errors`` is not empty."""
        errors = list(op.error.errors)
        text = "; ".join(f"{er.code}: {' '.join(er.message.split())}" for er in errors)
        for er in errors:
            if er.code in ZONE_CODES:
                return self._zone_error(er.code, " ".join(er.message.split()), request)
        for er in errors:
            if er.code == "QUOTA_EXCEEDED":
                metric = next((d.quota_info.metric_name or d.quota_info.limit_name
                               for d in er.error_details if "quota_info" in d), "")
                return self._quota_error(" ".join(er.message.split()), metric, request)
        status = op.http_error_status_code
        if status in (401, 403):
            return CredentialsError(f"gcp: creating {op.target_link.rsplit('/', 1)[-1]} was refused ({status}): {text}",
                                    hint=CREDENTIALS_HINT)
        return ProviderError(f"gcp: creating an instance in {request.zone} failed: {text}")

    def _wait_operation(self, project: str, zone: str, op, timeout_s: float):
        """Wait for zone operation ``op`` to be DONE (``zoneOperations.wait``, looped: GCE's wait
        returns after about two minutes even when the operation still runs); return it DONE."""
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        if op.status == compute_v1.Operation.Status.DONE:
            return op
        name = op.name
        ops = self._client("zone_operations")
        end = time.monotonic() + timeout_s
        while True:
            started = time.monotonic()
            try:
                op = self._call(ops.wait, project=project, zone=zone, operation=name)
            except gexc.GoogleAPICallError as e:
                raise self._api_error(e, f"waiting for operation {name}") from None
            if op.status == compute_v1.Operation.Status.DONE:
                return op
            if time.monotonic() > end:
                raise ProviderError(f"gcp: operation {name} in {zone} not done after {timeout_s:.0f} s",
                                    hint="see it with `gcloud compute operations describe`")
            if time.monotonic() - started < self.poll_s:  # a wait that did not block: do not spin
                time.sleep(self.poll_s)

    # ------------------------------------------------------------------ Cloud TPU slices

    def _tpu(self) -> gcp_tpu.TPUSlices:
        """The TPU API half (created once): see :mod:`sftctl.providers.gcp_tpu`."""
        with self._lock:
            if self._tpu_slices is None:
                self._tpu_slices = gcp_tpu.TPUSlices(self._resolve, self.tpu_endpoint, self.poll_s,
                                                     self.ready_timeout_s, call=self._call)
            return self._tpu_slices

    def _tpu_workers(self, handle: GCPHandle) -> list[tuple[str, str]]:
        """``(node id, internal address)`` of every worker of a TPU slice, worker 0 first."""
        ips = self._tpu().endpoints(handle)
        if not ips:
            raise ProviderError(f"gcp: TPU slice {handle.id} has no hosts (gone?)")
        return list(zip(gcp_tpu.worker_node_ids(handle.node_id, len(ips)), ips))

    def zones_for(self, offering: Offering) -> list[str]:
        """A TPU slice's zones are the TPU API's locations of the region; else GCE's zones."""
        if gcp_tpu.is_tpu(offering.instance_type):
            return self._tpu().zones(offering.region)
        return self.zones(offering.region)

    def launch(self, handle: GCPHandle, script: str, env: dict[str, str], attempt: int) -> GCPHandle:
        """Hand the attempt to the node; on a TPU slice to every worker's daemon, each with its
        ``jax.distributed`` environment (:func:`sftctl.providers.gcp_tpu.worker_env`)."""
        if not gcp_tpu.is_tpu(handle.instance_type):
            return super().launch(handle, script, env, attempt)
        self._need_channel()
        workers = self._tpu_workers(handle)
        _family, chips, hosts = gcp_tpu.slice_shape(handle.instance_type)
        for w, (node_id, _ip) in enumerate(workers):
            self.channel.send_launch(node_id, attempt, script,
                                     {**env, **gcp_tpu.worker_env(hosts, w, workers[0][1], chips // hosts)})
        return handle.with_(attempt=attempt, launched_at=time.time())

    def status(self, handle: GCPHandle) -> NodeStatus:
        """A TPU slice's attempt ends when every worker's does: the first failed worker's exit
        code fails it; a worker whose daemon has not taken the attempt after ``launch_timeout_s``
        makes the slice LOST (replaced); else the slice's state as :meth:`CloudProvider.status`
        reads worker 0's."""
        first = super().status(handle)
        if (not gcp_tpu.is_tpu(handle.instance_type) or handle.attempt is None or self.channel is None
                or first.state not in (NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.FAILED)):
            return first
        _family, _chips, hosts = gcp_tpu.slice_shape(handle.instance_type)
        codes = [self.channel.exit_code(node_id, handle.attempt)
                 for node_id in gcp_tpu.worker_node_ids(handle.node_id, hosts)]
        for w, code in enumerate(codes):
            if code not in (None, 0):
                return NodeStatus(NodeState.FAILED, code, f"TPU worker {w} exited with code {code}")
        late = time.time() - (handle.launched_at or time.time()) > self.launch_timeout_s
        for w, node_id in enumerate(gcp_tpu.worker_node_ids(handle.node_id, hosts)):
            if late and codes[w] is None and (node_id, handle.attempt) not in self._acked:
                if not self.channel.acked(node_id, handle.attempt):
                    return NodeStatus(NodeState.LOST, None, (
                        f"TPU worker {w}'s daemon did not take attempt {handle.attempt} within "
                        f"{self.launch_timeout_s:.0f} s (a lost host? see /var/lib/sftctl/<node>.w{w}/bootstrap.log)"))
                self._acked.add((node_id, handle.attempt))
        if all(code == 0 for code in codes):
            return NodeStatus(NodeState.SUCCEEDED, 0, "exit code 0 on every TPU worker")
        return NodeStatus(NodeState.RUNNING)

    def stop_attempt(self, handle: GCPHandle) -> None:
        """Ask the node's daemon (every worker's, on a TPU slice) to stop the running attempt."""
        if not gcp_tpu.is_tpu(handle.instance_type) or self.channel is None or not handle.attempt:
            return super().stop_attempt(handle)
        _family, _chips, hosts = gcp_tpu.slice_shape(handle.instance_type)
        for node_id in gcp_tpu.worker_node_ids(handle.node_id, hosts):
            self.channel.request_stop(node_id, handle.attempt)

    # ------------------------------------------------------------------ CloudProvider

    def check(self) -> None:
        """Credentials resolve and can list the project's zones.

        Raises:
            CredentialsError: no ADC, no project, 401/403, the Compute API disabled, unknown project.
            ProviderError: any other API failure.
        """
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        _, project = self._resolve()
        zones = self._client("zones")
        try:
            self._call(lambda: zones.list(request=compute_v1.ListZonesRequest(project=project, max_results=1)))
        except gexc.NotFound:
            raise CredentialsError(f"gcp: project {project!r} was not found", hint=CREDENTIALS_HINT) from None
        except gexc.GoogleAPICallError as e:
            raise self._api_error(e, f"listing the zones of project {project}") from None

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """The catalog's GCP offerings of ``count`` x ``accelerator`` per node."""
        return [o for o in cloud_offerings() if o.provider == self.name
                and o.accelerator.lower() == accelerator.lower() and o.count == count]

    def zones(self, region: str) -> list[str]:
        """The zones of ``region`` whose status is UP, sorted by name."""
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        project = self.project
        client = self._client("zones")

        def fetch() -> list[str]:
            return [z.name for z in client.list(request=compute_v1.ListZonesRequest(project=project))
                    if z.region.rsplit("/", 1)[-1] == region and z.status == "UP"]

        try:
            return sorted(self._call(fetch))
        except gexc.GoogleAPICallError as e:
            raise self._api_error(e, f"listing the zones of {region}") from None

    def instance_resource(self, request: InstanceRequest, name: str):
        """The ``compute_v1.Instance`` to insert for ``request``."""
        from google.cloud import compute_v1

        o, zone = request.offering, request.zone
        machine, accel = split_instance_type(o.instance_type, o.accelerator, o.count)
        family = machine.split("-")[0]
        gpu = accel is not None or family in ACCELERATOR_OPTIMIZED or o.accelerator.lower() != "cpu"
        image = request.image or DEFAULT_IMAGE
        if "/" not in image:
            image = f"global/images/{image}"
        # A3 Ultra and A4 boot from Hyperdisk only; the others take Persistent Disk.
        disk_type = "hyperdisk-balanced" if machine.startswith(("a3-ultragpu", "a4-")) else "pd-balanced"
        items = [compute_v1.Items(key="install-nvidia-driver", value="True"),
                 # Labels hold sanitized ids; metadata keeps them exact for list_instances.
                 compute_v1.Items(key=JOB_ID_KEY, value=request.job_id),
                 compute_v1.Items(key=NODE_ID_KEY, value=request.node_id)]
        if request.bootstrap:
            items.append(compute_v1.Items(key="startup-script", value=request.bootstrap))
        scheduling = compute_v1.Scheduling(
            on_host_maintenance="TERMINATE" if gpu or request.spot else "MIGRATE",
            automatic_restart=False,
            provisioning_model="SPOT" if request.spot else "STANDARD",
        )
        if request.spot:
            scheduling.instance_termination_action = "DELETE"
        return compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{machine}",
            labels=dict(request.labels),
            metadata=compute_v1.Metadata(items=items),
            disks=[compute_v1.AttachedDisk(
                boot=True, auto_delete=True, type_="PERSISTENT",
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=image, disk_size_gb=BOOT_DISK_GB, disk_type=f"zones/{zone}/diskTypes/{disk_type}",
                    labels=dict(request.labels)))],
            # An ephemeral external IP gives the node egress (pip, the job's storage) without a
            # Cloud NAT; nothing listens for inbound traffic: the controller talks through storage.
            network_interfaces=[compute_v1.NetworkInterface(
                network="global/networks/default",
                access_configs=[compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])],
            service_accounts=[compute_v1.ServiceAccount(email="default", scopes=[CLOUD_PLATFORM_SCOPE])],
            guest_accelerators=[compute_v1.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{accel[0]}", accelerator_count=accel[1])]
            if accel else [],
            scheduling=scheduling,
        )

    def create_instance(self, request: InstanceRequest) -> GCPHandle:
        """Insert the node's instance in ``request.zone`` and wait for the insert operation.

        Raises:
            CapacityError: zone exhausted or type not offered there (zone), quota (region / cloud).
            CredentialsError: 401 / 403.
            ProviderError: anything else GCE refused, with Google's message.
        """
        if gcp_tpu.is_tpu(request.offering.instance_type):
            return self._tpu().create(request, instance_name(request.node_id))
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        project = self.project
        name = instance_name(request.node_id)
        insert = compute_v1.InsertInstanceRequest(
            project=project, zone=request.zone, instance_resource=self.instance_resource(request, name),
            request_id=str(uuid.uuid4()),  # the same id on every retry: GCE creates the instance once
        )
        client = self._client("instances")
        try:
            op = self._call(client.insert_unary, request=insert)
        except gexc.GoogleAPICallError as e:
            raise self._api_error(e, f"creating {name} in {request.zone}", request) from None
        handle = GCPHandle(job_id=request.job_id, node_id=request.node_id, rank=request.rank, id=name,
                           zone=request.zone, project=project, instance_type=request.offering.instance_type,
                           spot=request.spot)
        try:
            op = self._wait_operation(project, request.zone, op, self.ready_timeout_s)
        except SftctlError:
            with contextlib.suppress(SftctlError):  # the instance may come up later: leave nothing behind
                self.delete_instance(handle)
            raise
        if op.error.errors:
            raise self._operation_error(op, request)
        return handle

    def describe(self, handle: GCPHandle) -> InstanceState:
        """The instance's state: PROVISIONING/STAGING -> PENDING, RUNNING, STOPPING/SUSPENDING/
        TERMINATED (stopped) -> STOPPING, not found -> GONE. A TPU slice: its queued resource's
        state (:meth:`sftctl.providers.gcp_tpu.TPUSlices.describe`)."""
        if gcp_tpu.is_tpu(handle.instance_type):
            return self._tpu().describe(handle)
        from google.api_core import exceptions as gexc

        client = self._client("instances")
        try:
            inst = self._call(client.get, project=handle.project or self.project, zone=handle.zone,
                              instance=handle.id)
        except gexc.NotFound:
            return InstanceState.GONE
        except gexc.GoogleAPICallError as e:
            raise self._api_error(e, f"describing {handle.id}") from None
        return STATUS.get(inst.status, InstanceState.PENDING)

    def private_ip(self, handle: GCPHandle) -> str | None:
        """The instance's internal address (``networkInterfaces[0].networkIP``); a TPU slice's
        worker 0's."""
        if gcp_tpu.is_tpu(handle.instance_type):
            ips = self._tpu().endpoints(handle)
            return ips[0] if ips else None
        from google.api_core import exceptions as gexc

        try:
            inst = self._call(self._client("instances").get, project=handle.project or self.project,
                              zone=handle.zone, instance=handle.id)
        except gexc.GoogleAPICallError:
            return None
        return inst.network_interfaces[0].network_i_p if inst.network_interfaces else None

    def delete_instance(self, handle: GCPHandle) -> None:
        """Delete the instance and wait for it to be gone; a missing instance is not an error.
        A TPU slice: its queued resource, with its node."""
        if gcp_tpu.is_tpu(handle.instance_type):
            return self._tpu().delete(handle.with_(project=handle.project or self.project))
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        project, zone = handle.project or self.project, handle.zone
        client = self._client("instances")
        delete = compute_v1.DeleteInstanceRequest(project=project, zone=zone, instance=handle.id,
                                                  request_id=str(uuid.uuid4()))
        try:
            op = self._call(client.delete_unary, request=delete)
        except gexc.NotFound:
            return
        except gexc.GoogleAPICallError as e:
            if "resourceNotReady" not in _reasons(e):
                raise self._api_error(e, f"deleting {handle.id}") from None
            # Already being deleted (another `sftctl down`, or a cleanup racing this one): wait for it.
            end = time.monotonic() + self.ready_timeout_s
            while self.describe(handle) != InstanceState.GONE:
                if time.monotonic() > end:
                    raise ProviderError(f"gcp: {handle.id} in {zone} is still being deleted after "
                                        f"{self.ready_timeout_s:.0f} s",
                                        hint=f"check: gcloud compute instances describe {handle.id} "
                                             f"--zone {zone}") from None
                time.sleep(self.poll_s)
            return
        op = self._wait_operation(project, zone, op, self.ready_timeout_s)
        errors = [er for er in op.error.errors if er.code != "RESOURCE_NOT_FOUND"]
        if errors:
            text = "; ".join(f"{er.code}: {' '.join(er.message.split())}" for er in errors)
            raise ProviderError(f"gcp: deleting {handle.id} in {zone} failed: {text}",
                                hint=f"delete it by hand: gcloud compute instances delete {handle.id} --zone {zone}")

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """Every instance labelled ``sftctl-managed=true`` (and ``sftctl-job=job_id``), any zone,
        then every such TPU queued resource (where there is a TPU API: Google's, or an emulator's
        when GCE's is one)."""
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        project = self.project
        flt = f'(labels.{MANAGED_LABEL} = "true")'
        if job_id is not None:
            flt += f' (labels.{JOB_LABEL} = "{label_value(job_id)}")'
        client = self._client("instances")

        def fetch() -> list[dict]:
            out = []
            request = compute_v1.AggregatedListInstancesRequest(project=project, filter=flt)
            pager = client.aggregated_list(request=request)
            for _scope, scoped in pager:
                for inst in scoped.instances:
                    meta = {it.key: it.value for it in inst.metadata.items}
                    inst_job = meta.get(JOB_ID_KEY) or inst.labels.get(JOB_LABEL)
                    if job_id is not None and JOB_ID_KEY in meta and meta[JOB_ID_KEY] != job_id:
                        continue  # another job whose id sanitizes to the same label value
                    accels = [(a.accelerator_type, a.accelerator_count) for a in inst.guest_accelerators]
                    out.append({
                        "id": inst.name, "zone": inst.zone.rsplit("/", 1)[-1], "project": project,
                        "instance_type": catalog_instance_type(inst.machine_type, accels),
                        "job_id": inst_job, "node_id": meta.get(NODE_ID_KEY) or inst.labels.get(NODE_LABEL),
                        "spot": inst.scheduling.provisioning_model == "SPOT", "status": inst.status,
                    })
            return out

        try:
            found = self._call(fetch)
        except gexc.GoogleAPICallError as e:
            raise self._api_error(e, "listing sftctl's instances") from None
        if self.tpu_endpoint or not self.api_endpoint:
            try:
                found += self._tpu().list(job_id)
            except CredentialsError as e:  # a project that never enabled the TPU API has no TPUs
                if "not enabled" not in e.message:
                    raise
        return found


def configured_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """None when Google's Application Default Credentials (or a GCE emulator) are set up here,
    else why not (``environ``: None for this process's, and the config file). No network call
    and no SDK import."""
    from sftctl import settings

    env = os.environ if environ is None else environ
    home = Path(env.get("HOME", str(Path.home())))
    adc = Path(env.get("CLOUDSDK_CONFIG", home / ".config" / "gcloud")) / "application_default_credentials.json"
    if env.get("GOOGLE_APPLICATION_CREDENTIALS") or settings.get("SFTCTL_GCE_ENDPOINT", environ) or adc.is_file():
        return None
    return "gcp: no credentials (run gcloud auth application-default login, or set GOOGLE_APPLICATION_CREDENTIALS)"


PROVIDER = ProviderEntry("gcp", "GCPProvider", sdk="google.cloud.compute_v1", extra="gcp",
                         configured=configured_reason)
