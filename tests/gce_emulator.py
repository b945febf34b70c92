"""A Compute Engine emulator for the tests: a real HTTP server that speaks the Compute REST API.

No real GCE can run here, so the GCP provider is tested with the real ``google-cloud-compute``
client (REST transport) against this server. It serves the paths that client sends (read off
``compute_v1/services/*/transports/rest_base.py``)::

    GET    /compute/v1/projects/{p}/zones                                  zones.list
    GET    /compute/v1/projects/{p}/zones/{z}                              zones.get
    POST   /compute/v1/projects/{p}/zones/{z}/instances                    instances.insert
    GET    /compute/v1/projects/{p}/zones/{z}/instances                    instances.list
    GET    /compute/v1/projects/{p}/zones/{z}/instances/{name}             instances.get
    DELETE /compute/v1/projects/{p}/zones/{z}/instances/{name}             instances.delete
    GET    /compute/v1/projects/{p}/aggregated/instances                   instances.aggregatedList
    GET    /compute/v1/projects/{p}/zones/{z}/operations/{op}              zoneOperations.get
    POST   /compute/v1/projects/{p}/zones/{z}/operations/{op}/wait         zoneOperations.wait
    GET    /compute/v1/projects/{p}/zones/{z}/acceleratorTypes             acceleratorTypes.list
    GET    /compute/v1/projects/{p}/zones/{z}/machineTypes                 machineTypes.list
    GET    /v1/services/{service}/skus                                     Cloud Billing Catalog services.skus.list

The two catalog lists and the SKUs serve ``sftctl catalog refresh``: machine types carry
``guestCpus``, ``memoryMb`` and (for A2/A3/A4/G2) their ``accelerators`` (:data:`MACHINE_SPECS`,
GCP's published shapes); a test seeds which types and accelerator types each zone has
(``machine_types_by_zone``, ``accelerator_types_by_zone``) and the SKUs (``skus``: Cloud Billing
``Sku`` JSON, checked against ``google.cloud.billing_v1.Sku`` and its list response, as the
Compute answers are against ``compute_v1``). ``error(status, path_contains)`` answers matching
requests with a plain HTTP error (a 500 ``backendError`` by default).

and is strict where GCE is strict: request bodies are parsed into the official message types
(``compute_v1.Instance.from_json(body, ignore_unknown_fields=False)``), so an unknown field is a
400 in Google's error format; query parameters must be fields of the method's request message;
instances need a valid name, a machine type that exists in the zone, one boot disk and a
network interface; labels follow GCE's label rules; a GPU instance (guest accelerators or an
accelerator-optimized a2/a3/a4/g2 type) needs ``scheduling.onHostMaintenance = TERMINATE``, as GCE
answers ``400 Instances with guest accelerators do not support live migration.`` otherwise.
Every response the emulator sends is itself checked against the message type it claims to be.

State moves the way GCE's does, one step per read: operations PENDING -> RUNNING -> DONE (per
``zoneOperations.get`` or ``wait``), instances PROVISIONING -> STAGING -> RUNNING (per
``instances.get``); a deleted instance is STOPPING until its delete operation is DONE.

Faults are injected in-process, with the shapes GCE really returns:

* ``fail(code="ZONE_RESOURCE_POOL_EXHAUSTED", zone=..., machine_type=...)``: the insert is
  accepted, and its operation ends DONE with ``error.errors[{code, message, errorDetails}]`` and
  ``httpErrorStatusCode`` 503 (``..._WITH_DETAILS`` and ``RESOURCE_NOT_READY`` likewise).
* ``fail(code="QUOTA_EXCEEDED", metric="GPUS_ALL_REGIONS")`` (or a regional metric such as
  ``NVIDIA_T4_GPUS``): operation error ``Quota 'GPUS_ALL_REGIONS' exceeded.  Limit: 0.0 globally.``
  with a ``quotaInfo`` detail; with ``http=True`` the insert itself answers HTTP 403 with
  ``errors[{reason: quotaExceeded, domain: usageLimits}]`` instead.
* ``throttle(n)``: the next ``n`` requests answer HTTP 429 ``rateLimitExceeded`` (status
  ``RESOURCE_EXHAUSTED``, an ``ErrorInfo`` detail with reason ``RATE_LIMIT_EXCEEDED``).
* ``deny(401)`` / ``deny(403)``: requests answer ``authError`` / ``forbidden``.

Sources for the error shapes: GCE operation errors and HTTP errors quoted in public issue threads
(e.g. CCExtractor/sample-platform#901 for ZONE_RESOURCE_POOL_EXHAUSTED with errorDetails,
scylladb/scylla-cluster-tests#12477 for ``503 SERVICE UNAVAILABLE ..._WITH_DETAILS``,
GoogleCloudPlatform/marketing-analytics-jumpstart#163 for the 429 ``rateLimitExceeded`` body,
openshift/release#63296 for the live-migration 400) and Google's JSON error format
(``{"error": {"code", "message", "errors": [{"message", "domain", "reason"}], "status", "details"}}``).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import random
import re
import threading
import time
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from google.cloud import billing_v1, compute_v1
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from emulator_http import Operations, server_url, start_server, stop_server

GOOGLEAPIS = "https://www.googleapis.com/compute/v1"

#: zone -> status. us-central1-d is DOWN so that callers must filter on status.
DEFAULT_ZONES = {
    "us-central1-a": "UP", "us-central1-b": "UP", "us-central1-c": "UP", "us-central1-d": "DOWN",
    "us-central1-f": "UP", "us-east1-b": "UP", "us-east1-c": "UP", "europe-west4-a": "UP",
}
MACHINE_TYPES = {
    "a3-highgpu-8g", "a3-megagpu-8g", "a3-ultragpu-8g", "a2-highgpu-1g", "a2-highgpu-8g",
    "a2-ultragpu-1g", "a2-ultragpu-8g", "g2-standard-4", "g2-standard-8", "n1-standard-4",
    "n1-standard-8", "n1-standard-16", "e2-standard-2", "e2-standard-4", "n2-standard-8",
}
ACCELERATOR_TYPES = {
    "nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100", "nvidia-tesla-p4", "nvidia-l4",
    "nvidia-tesla-a100", "nvidia-a100-80gb", "nvidia-h100-80gb", "nvidia-h200-141gb",
    "nvidia-h100-mega-80gb", "nvidia-b200",
}
#: machine type -> (vCPUs, memory GB, (accelerator type, count) it carries or None): GCP's
#: published shapes ('GPU machine types', 'General-purpose machine family').
MACHINE_SPECS = {
    "a2-highgpu-1g": (12, 85, ("nvidia-tesla-a100", 1)), "a2-highgpu-8g": (96, 680, ("nvidia-tesla-a100", 8)),
    "a2-ultragpu-1g": (12, 170, ("nvidia-a100-80gb", 1)), "a2-ultragpu-8g": (96, 1360, ("nvidia-a100-80gb", 8)),
    "a3-highgpu-1g": (26, 234, ("nvidia-h100-80gb", 1)), "a3-highgpu-8g": (208, 1872, ("nvidia-h100-80gb", 8)),
    "a3-megagpu-8g": (208, 1872, ("nvidia-h100-mega-80gb", 8)), "a3-ultragpu-8g": (224, 2952, ("nvidia-h200-141gb", 8)),
    "a4-highgpu-8g": (224, 3968, ("nvidia-b200", 8)), "g2-standard-4": (4, 16, ("nvidia-l4", 1)),
    "g2-standard-8": (8, 32, ("nvidia-l4", 1)), "g2-standard-96": (96, 384, ("nvidia-l4", 8)),
    "n1-standard-4": (4, 15, None), "n1-standard-8": (8, 30, None), "n1-standard-16": (16, 60, None),
    "e2-standard-2": (2, 8, None), "e2-standard-4": (4, 16, None), "n2-standard-8": (8, 32, None),
}
#: accelerator type -> maximumCardsPerInstance (GCP 'GPU machine types')
MAX_CARDS = {"nvidia-tesla-t4": 4, "nvidia-tesla-v100": 8, "nvidia-tesla-p100": 4, "nvidia-tesla-p4": 4,
             "nvidia-l4": 8, "nvidia-tesla-a100": 16, "nvidia-a100-80gb": 8, "nvidia-h100-80gb": 8,
             "nvidia-h200-141gb": 8, "nvidia-h100-mega-80gb": 8, "nvidia-b200": 8}
#: Machine families whose types carry their GPUs (no guestAccelerators allowed on them).
ACCELERATOR_OPTIMIZED = ("a2", "a3", "a4", "g2")
ZONE_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "RESOURCE_NOT_READY")

NAME_RE = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
LABEL_KEY_RE = re.compile(r"[a-z][a-z0-9_-]{0,62}")
LABEL_VALUE_RE = re.compile(r"[a-z0-9_-]{0,63}")
METADATA_KEY_RE = re.compile(r"[a-zA-Z0-9_-]{1,128}")
#: A zonal resource reference, partial (``zones/Z/...``) or full URL; group 1 is the zone.
ZONAL_URL = r"(?:(?:https?://[^/]+)?/compute/v1/)?(?:projects/[^/]+/)?zones/([^/]+)/"
SYSTEM_PARAMS = {"alt", "$alt", "prettyPrint", "fields", "key", "quotaUser", "userIp", "$.xgafv",
                 "access_token", "callback", "upload_protocol", "uploadType"}
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED"}


class ApiError(Exception):
    """An HTTP error answer: ``status`` and Google's error JSON ``body``."""

    def __init__(self, status: int, body: dict):
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def error_body(status: int, message: str, reason: str, domain: str = "global", *,
               with_status: bool = False, details: list | None = None, **extra) -> dict:
    """Google's JSON error format. GCE's own errors (404 notFound, 400 invalid ...) carry no
    ``status``; errors raised by Google's front end (auth, unknown fields, rate limits) do."""
    err = {"message": message, "domain": domain, "reason": reason, **extra}
    body = {"error": {"code": status, "message": message, "errors": [err]}}
    if with_status:
        body["error"]["status"] = STATUS_NAMES.get(status, "UNKNOWN")
    if details:
        body["error"]["details"] = details
    return body


def bad_request(message: str, reason: str = "invalid") -> ApiError:
    return ApiError(400, error_body(400, message, reason))


def unknown_name_error(message: str) -> ApiError:
    return ApiError(400, error_body(
        400, message, "invalid", with_status=True,
        details=[{"@type": "type.googleapis.com/google.rpc.BadRequest",
                  "fieldViolations": [{"description": message}]}]))


def rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone(datetime.timedelta(hours=-7))).isoformat(timespec="milliseconds")


@dataclasses.dataclass
class Fault:
    """An injected insert failure: ``code`` for inserts of ``machine_type`` in ``zone`` (None: any)."""

    code: str
    machine_type: str | None = None
    zone: str | None = None
    metric: str | None = None
    http: bool = False
    times: int | None = None  # None: every matching insert

    def matches(self, machine_type: str, zone: str) -> bool:
        return (self.times is None or self.times > 0) and self.machine_type in (None, machine_type) \
            and self.zone in (None, zone)


# ---------------------------------------------------------------------------------- routes

P = r"/compute/v1/projects/(?P<project>[^/]+)"
ROUTES = [  # (method, regex, handler name, request message type)
    ("GET", P + r"/zones", "list_zones", compute_v1.ListZonesRequest),
    ("GET", P + r"/zones/(?P<zone>[^/]+)", "get_zone", compute_v1.GetZoneRequest),
    ("POST", P + r"/zones/(?P<zone>[^/]+)/instances", "insert_instance", compute_v1.InsertInstanceRequest),
    ("GET", P + r"/zones/(?P<zone>[^/]+)/instances", "list_instances", compute_v1.ListInstancesRequest),
    ("GET", P + r"/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)", "get_instance", compute_v1.GetInstanceRequest),
    ("DELETE", P + r"/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)", "delete_instance",
     compute_v1.DeleteInstanceRequest),
    ("GET", P + r"/aggregated/instances", "aggregated_instances", compute_v1.AggregatedListInstancesRequest),
    ("GET", P + r"/zones/(?P<zone>[^/]+)/operations/(?P<operation>[^/]+)", "get_operation",
     compute_v1.GetZoneOperationRequest),
    ("POST", P + r"/zones/(?P<zone>[^/]+)/operations/(?P<operation>[^/]+)/wait", "wait_operation",
     compute_v1.WaitZoneOperationRequest),
    ("GET", P + r"/zones/(?P<zone>[^/]+)/acceleratorTypes", "list_accelerator_types",
     compute_v1.ListAcceleratorTypesRequest),
    ("GET", P + r"/zones/(?P<zone>[^/]+)/machineTypes", "list_machine_types", compute_v1.ListMachineTypesRequest),
]
BILLING_SKUS = r"/v1/(?P<parent>services/[^/]+)/skus"
BODY_FIELDS = {"insert_instance": "instance_resource"}


def query_fields(request_type, path_params: set[str], body_field: str | None) -> dict[str, FieldDescriptor]:
    """The query parameters a method accepts: its request message's fields that are neither path
    parameters nor the body, by JSON name and by proto name (Google's front end takes both)."""
    out = {}
    for f in request_type.pb().DESCRIPTOR.fields:
        if f.name in path_params or f.name == body_field:
            continue
        out[f.json_name] = out[f.name] = f
    return out


class GCEEmulator:
    """The emulator's state and its HTTP server. Use as a context manager or start()/stop().

    Attributes:
        project: the one project that exists.
        zones: zone name -> ``UP`` / ``DOWN``.
        machine_types_by_zone: zone -> machine types offered there (zones not named offer all).
        requests: every request received: dicts with method, path, query, body (parsed JSON) and
            the status answered.
    """

    def __init__(self, project: str = "sftctl-test", zones: dict[str, str] | None = None):
        self.project = project
        self.zones = dict(zones or DEFAULT_ZONES)
        self.machine_types_by_zone: dict[str, set[str]] = {}
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(random.randrange(10**15, 9 * 10**15))
        self.reset()

    # ------------------------------------------------------------------ lifecycle and control

    def start(self) -> "GCEEmulator":
        self._server, self._thread = start_server(self, "gce-emulator")
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            stop_server(self._server, self._thread)
            self._server = None

    def __enter__(self) -> "GCEEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The endpoint to give the client (``client_options={"api_endpoint": url}``)."""
        assert self._server is not None
        return server_url(self._server)

    def reset(self) -> None:
        """Forget every instance, operation, fault and logged request."""
        with self.lock:
            self.instances: dict[tuple[str, str], dict] = {}  # (zone, name) -> Instance JSON
            self.lro = Operations()  # (zone, name) -> Operation JSON, and the effect of its DONE
            self.operations: dict = self.lro.ops
            self._request_ids: dict[str, tuple[str, str]] = {}
            self._deleting: dict[tuple[str, str], str] = {}  # (zone, name) -> its delete operation
            self.faults: list[Fault] = []
            self.throttles: list[list] = []  # [remaining, method or None, path substring or None]
            self.denied: tuple[int, int | None] | None = None  # (status, remaining or None)
            self.requests: list[dict] = []
            self.errors: list[list] = []  # [remaining, status, path substring]
            self.accelerator_types_by_zone: dict[str, set[str]] = {}  # zones not named offer all
            self.skus: list[dict] = []

    def fail(self, code: str = "ZONE_RESOURCE_POOL_EXHAUSTED", *, machine_type: str | None = None,
             zone: str | None = None, metric: str | None = None, http: bool = False,
             times: int | None = None) -> Fault:
        """Make inserts of ``machine_type`` (None: any) in ``zone`` (None: any) fail with ``code``.

        ``metric`` names the quota of a ``QUOTA_EXCEEDED`` (``GPUS_ALL_REGIONS`` is global, any
        other metric regional). ``http`` answers the insert call itself with an HTTP error
        instead of failing its operation. ``times``: how many inserts fail (None: all).
        """
        fault = Fault(code, machine_type, zone, metric, http, times)
        with self.lock:
            self.faults.append(fault)
        return fault

    def throttle(self, times: int, method: str | None = None, path_contains: str | None = None) -> None:
        """Answer the next ``times`` matching requests with HTTP 429 rateLimitExceeded."""
        with self.lock:
            self.throttles.append([times, method, path_contains])

    def error(self, status: int = 500, path_contains: str = "", times: int = 1_000_000) -> None:
        """Answer the next ``times`` requests whose path contains ``path_contains`` with HTTP
        ``status`` (``backendError``: not a throttle, so clients do not retry it)."""
        with self.lock:
            self.errors.append([times, status, path_contains])

    def deny(self, status: int = 401, times: int | None = None) -> None:
        """Answer requests with 401 (bad credentials) or 403 (no permission); None: until reset."""
        with self.lock:
            self.denied = (status, times)

    def set_status(self, zone: str, name: str, status: str) -> None:
        """Force an instance's status (``TERMINATED`` as after a stop or a preemption ...)."""
        with self.lock:
            self.instances[(zone, name)]["status"] = status

    def inserted(self, name: str) -> dict:
        """The body of the last accepted insert of instance ``name`` (as the client sent it)."""
        for r in reversed(self.requests):
            if r["method"] == "POST" and r["path"].endswith("/instances") and (r["body"] or {}).get("name") == name:
                return r["body"]
        raise KeyError(name)

    def count(self, method: str, path_suffix: str) -> int:
        return sum(1 for r in self.requests if r["method"] == method and r["path"].endswith(path_suffix))

    # ------------------------------------------------------------------ request dispatch

    def handle(self, method: str, raw_path: str, body_text: str) -> tuple[int, dict]:
        parts = urlsplit(raw_path)
        path = parts.path
        query = parse_qs(parts.query, keep_blank_values=True)
        body = None
        if body_text:
            try:
                body = json.loads(body_text)
            except ValueError:
                body = body_text
        with self.lock:
            entry = {"method": method, "path": path, "query": query, "body": body, "status": 200}
            self.requests.append(entry)
            try:
                return 200, self._dispatch(method, path, query, body_text)
            except ApiError as e:
                entry["status"] = e.status
                return e.status, e.body

    def _dispatch(self, method: str, path: str, query: dict, body_text: str) -> dict:
        if self.denied is not None:
            status, left = self.denied
            if left is None or left > 0:
                self.denied = (status, None if left is None else left - 1)
                raise self._auth_error(status, method, path)
        for t in self.throttles:
            if t[0] > 0 and t[1] in (None, method) and (t[2] is None or t[2] in path):
                t[0] -= 1
                raise self._throttle_error()
        for e in self.errors:
            if e[0] > 0 and e[2] in path:
                e[0] -= 1
                raise ApiError(e[1], error_body(e[1], "Internal error. Please try again or contact Google Support.",
                                                "backendError"))
        m = re.fullmatch(BILLING_SKUS, path)
        if m is not None:
            if method != "GET":
                raise ApiError(405, error_body(405, f"Method {method} not allowed on {path}", "httpMethodNotAllowed"))
            q = self._parse_query(query, billing_v1.ListSkusRequest, {"parent"}, None)
            return self._list_skus(m.group("parent"), q)
        for verb, pattern, name, request_type in ROUTES:
            m = re.fullmatch(pattern, path)
            if m is None or verb != method:
                continue
            params = m.groupdict()
            q = self._parse_query(query, request_type, set(params), BODY_FIELDS.get(name))
            if params["project"] != self.project:
                raise ApiError(404, error_body(404, f"The resource 'projects/{params['project']}' was not found",
                                               "notFound"))
            if "zone" in params and params["zone"] not in self.zones:
                raise ApiError(404, error_body(
                    404, f"The resource 'projects/{self.project}/zones/{params['zone']}' was not found", "notFound"))
            return getattr(self, "_" + name)(params, q, body_text)
        if any(re.fullmatch(p, path) for _, p, _, _ in ROUTES):
            raise ApiError(405, error_body(405, f"Method {method} not allowed on {path}", "httpMethodNotAllowed"))
        raise ApiError(404, error_body(404, f"The requested URL {path} was not found on this server.", "notFound"))

    def _parse_query(self, query: dict, request_type, path_params: set[str], body_field: str | None) -> dict:
        fields = query_fields(request_type, path_params, body_field)
        out = {}
        for key, values in query.items():
            if key in SYSTEM_PARAMS:
                continue
            f = fields.get(key)
            if f is None:
                raise unknown_name_error(
                    f"Invalid JSON payload received. Unknown name \"{key}\": Cannot bind query parameter. "
                    f"Field '{key}' could not be found in request message.")
            value = values[-1]
            if f.cpp_type in (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64,
                              FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64):
                try:
                    value = int(value)
                except ValueError:
                    raise unknown_name_error(
                        f"Invalid value at '{f.json_name}' ({f.type}), \"{value}\"") from None
            elif f.cpp_type == FieldDescriptor.CPPTYPE_BOOL:
                if value not in ("true", "false"):
                    raise unknown_name_error(f"Invalid value at '{f.json_name}' (TYPE_BOOL), \"{value}\"")
                value = value == "true"
            out[f.json_name] = value
        return out

    # ------------------------------------------------------------------ errors

    def _auth_error(self, status: int, method: str, path: str) -> ApiError:
        if status == 401:
            message = ("Request had invalid authentication credentials. Expected OAuth 2 access token, login "
                       "cookie or other valid authentication credential. See "
                       "https://developers.google.com/identity/sign-in/web/devconsole-project.")
            return ApiError(401, error_body(
                401, message, "authError", location="Authorization", locationType="header", with_status=True,
                details=[{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "ACCESS_TOKEN_EXPIRED",
                          "domain": "googleapis.com",
                          "metadata": {"service": "compute.googleapis.com", "method": "compute.v1.Compute"}}]))
        resource = path.split("/compute/v1/", 1)[-1]
        kind = "zoneOperations" if "/operations/" in path else "instances" if "/instances" in path else "zones"
        verb = {"POST": "create", "DELETE": "delete"}.get(method, "get" if path.count("/") % 2 == 0 else "list")
        if kind == "zoneOperations":
            verb = "get"
        return ApiError(status, error_body(status, f"Required 'compute.{kind}.{verb}' permission for '{resource}'",
                                           "forbidden"))

    def _throttle_error(self) -> ApiError:
        message = ("Quota exceeded for quota metric 'Queries' and limit 'Queries per minute' of service "
                   f"'compute.googleapis.com' for consumer 'project_number:{abs(hash(self.project)) % 10**12}'.")
        return ApiError(429, error_body(
            429, message, "rateLimitExceeded", domain="usageLimits", with_status=True,
            details=[{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "RATE_LIMIT_EXCEEDED",
                      "domain": "googleapis.com",
                      "metadata": {"service": "compute.googleapis.com",
                                   "quota_metric": "compute.googleapis.com/default",
                                   "quota_limit": "defaultPerMinutePerProject", "quota_location": "global",
                                   "consumer": f"projects/{self.project}"}},
                     {"@type": "type.googleapis.com/google.rpc.Help",
                      "links": [{"description": "Request a higher quota limit.",
                                 "url": "https://cloud.google.com/docs/quotas/help/request_increase"}]}]))

    def _quota_texts(self, metric: str, region: str) -> tuple[str, dict]:
        metric = metric.upper()
        if metric.endswith("_ALL_REGIONS"):
            message = f"Quota '{metric}' exceeded.  Limit: 0.0 globally."
            info = {"metricName": f"compute.googleapis.com/{metric.lower()}",
                    "limitName": f"{metric.replace('_', '-')}-per-project", "limit": 0}
        else:
            message = f"Quota '{metric}' exceeded.  Limit: 0.0 in region {region}."
            info = {"metricName": f"compute.googleapis.com/{metric.lower()}",
                    "limitName": f"{metric.replace('_', '-')}-per-project-region",
                    "dimensions": {"region": region}, "limit": 0}
        return message, info

    def _fault_operation_error(self, fault: Fault, zone: str, machine_type: str) -> tuple[dict, int, str]:
        """(operation.error, httpErrorStatusCode, httpErrorMessage) of an injected failure."""
        region = zone.rsplit("-", 1)[0]
        if fault.code in ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"):
            suffix = ("Try a different zone, or try again later." if fault.code == "ZONE_RESOURCE_POOL_EXHAUSTED"
                      else "'(resource type:compute)'.")
            err = {
                "code": fault.code,
                "message": f"The zone 'projects/{self.project}/zones/{zone}' does not have enough resources "
                           f"available to fulfill the request.  {suffix}",
                "errorDetails": [
                    {"errorInfo": {"reason": "resource_availability", "domain": "compute.googleapis.com",
                                   "metadatas": {"zone": zone, "vmType": machine_type, "attachment": "",
                                                 "zonesAvailable": ""}}},
                    {"help": {"links": [{"description": "Troubleshooting documentation",
                                         "url": "https://cloud.google.com/compute/docs/resource-error"}]}},
                    {"localizedMessage": {"locale": "en-US", "message": (
                        f"A {machine_type} VM instance is currently unavailable in the {zone} zone. Alternatively, "
                        "you can try your request again with a different VM hardware configuration or at a later "
                        "time. For more information, see the troubleshooting documentation.")}},
                ],
            }
            return {"errors": [err]}, 503, "SERVICE UNAVAILABLE"
        if fault.code == "QUOTA_EXCEEDED":
            message, info = self._quota_texts(fault.metric or "GPUS_ALL_REGIONS", region)
            return ({"errors": [{"code": "QUOTA_EXCEEDED", "message": message, "errorDetails": [{"quotaInfo": info}]}]},
                    403, "FORBIDDEN")
        if fault.code == "RESOURCE_NOT_READY":
            return ({"errors": [{"code": "RESOURCE_NOT_READY", "message": (
                f"The resource 'projects/{self.project}/zones/{zone}/machineTypes/{machine_type}' is not ready")}]},
                    400, "BAD REQUEST")
        return {"errors": [{"code": fault.code, "message": f"Injected failure {fault.code}."}]}, 400, "BAD REQUEST"

    def _fault_http_error(self, fault: Fault, zone: str) -> ApiError:
        if fault.code == "QUOTA_EXCEEDED":
            message, _ = self._quota_texts(fault.metric or "GPUS_ALL_REGIONS", zone.rsplit("-", 1)[0])
            return ApiError(403, error_body(403, message, "quotaExceeded", domain="usageLimits"))
        error, status, _ = self._fault_operation_error(fault, zone, "")
        return ApiError(status, error_body(status, error["errors"][0]["message"], fault.code))

    # ------------------------------------------------------------------ zones

    def _zone_json(self, zone: str) -> dict:
        region = zone.rsplit("-", 1)[0]
        return {"kind": "compute#zone", "id": str(2000 + sorted(self.zones).index(zone)),
                "creationTimestamp": "1969-12-31T16:00:00.000-08:00", "name": zone,
                "description": zone, "status": self.zones[zone],
                "region": f"{GOOGLEAPIS}/projects/{self.project}/regions/{region}",
                "selfLink": f"{GOOGLEAPIS}/projects/{self.project}/zones/{zone}",
                "availableCpuPlatforms": ["Intel Sapphire Rapids", "Intel Cascade Lake", "AMD Milan"],
                "supportsPzs": False}

    def _list_zones(self, params, q, body):
        items = [self._zone_json(z) for z in sorted(self.zones)]
        items = [z for z in items if self._filter_matches(q.get("filter", ""), z)]
        return self._page(q, items, "compute#zoneList", f"projects/{self.project}/zones", compute_v1.ZoneList)

    def _get_zone(self, params, q, body):
        return self._checked(self._zone_json(params["zone"]), compute_v1.Zone)

    # ------------------------------------------------------------------ catalog: types and SKUs

    def _list_accelerator_types(self, params, q, body):
        zone = params["zone"]
        names = sorted(self.accelerator_types_by_zone.get(zone, ACCELERATOR_TYPES))
        items = [{"kind": "compute#acceleratorType", "id": str(10_000 + i), "name": n,
                  "creationTimestamp": "1969-12-31T16:00:00.000-08:00", "description": n, "zone": zone,
                  "maximumCardsPerInstance": MAX_CARDS.get(n, 8),
                  "selfLink": f"{GOOGLEAPIS}/projects/{self.project}/zones/{zone}/acceleratorTypes/{n}"}
                 for i, n in enumerate(names)]
        items = [a for a in items if self._filter_matches(q.get("filter", ""), a)]
        return self._page(q, items, "compute#acceleratorTypeList",
                          f"projects/{self.project}/zones/{zone}/acceleratorTypes", compute_v1.AcceleratorTypeList)

    def _list_machine_types(self, params, q, body):
        zone = params["zone"]
        names = sorted(n for n in self.machine_types_by_zone.get(zone, MACHINE_TYPES) if n in MACHINE_SPECS)
        items = []
        for i, n in enumerate(names):
            cpus, gb, acc = MACHINE_SPECS[n]
            item = {"kind": "compute#machineType", "id": str(20_000 + i), "name": n,
                    "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
                    "description": f"{cpus} vCPUs, {gb} GB RAM", "guestCpus": cpus, "memoryMb": gb * 1024,
                    "imageSpaceGb": 0, "maximumPersistentDisks": 128, "maximumPersistentDisksSizeGb": "263168",
                    "zone": zone, "isSharedCpu": False,
                    "selfLink": f"{GOOGLEAPIS}/projects/{self.project}/zones/{zone}/machineTypes/{n}"}
            if acc:
                item["accelerators"] = [{"guestAcceleratorType": acc[0], "guestAcceleratorCount": acc[1]}]
            items.append(item)
        items = [m for m in items if self._filter_matches(q.get("filter", ""), m)]
        return self._page(q, items, "compute#machineTypeList",
                          f"projects/{self.project}/zones/{zone}/machineTypes", compute_v1.MachineTypeList)

    def _list_skus(self, parent: str, q: dict) -> dict:
        if parent != "services/6F81-5844-456A":
            raise ApiError(404, error_body(404, f"Service {parent} not found.", "notFound"))
        if q.get("currencyCode", "USD") != "USD":
            raise bad_request("Only USD is served by the emulator")
        start = int(q.get("pageToken") or 0)
        size = int(q.get("pageSize") or 5000)
        out = {"skus": self.skus[start:start + size], "nextPageToken": ""}
        if start + size < len(self.skus):
            out["nextPageToken"] = str(start + size)
        for sku in out["skus"]:
            self._checked(sku, billing_v1.Sku)
        return self._checked(out, billing_v1.ListSkusResponse)

    # ------------------------------------------------------------------ instances

    def _insert_instance(self, params, q, body_text):
        zone = params["zone"]
        if not body_text:
            raise bad_request("Required field 'resource' not specified", "required")
        try:
            compute_v1.Instance.from_json(body_text, ignore_unknown_fields=False)
        except json_format.ParseError as e:
            raise unknown_name_error(_parse_error_message(str(e))) from None
        inst = json.loads(body_text)
        if q.get("requestId") and q["requestId"] in self._request_ids:
            return self.operations[self._request_ids[q["requestId"]]]
        machine_type = self._validate_instance(zone, inst)
        name = inst["name"]
        if (zone, name) in self.instances:
            raise ApiError(409, error_body(
                409, f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' already exists",
                "alreadyExists"))
        fault = next((f for f in self.faults if f.matches(machine_type, zone)), None)
        if fault is not None and fault.times is not None:
            fault.times -= 1
        if fault is not None and fault.http:
            raise self._fault_http_error(fault, zone)
        target = f"{GOOGLEAPIS}/projects/{self.project}/zones/{zone}/instances/{name}"
        op = self._new_operation(zone, "insert", target)
        if fault is not None:
            self.lro.set_effect((zone, op["name"]), ("error", *self._fault_operation_error(fault, zone, machine_type)))
        else:
            self.instances[(zone, name)] = self._materialize(zone, inst, op["targetId"])
            self.lro.set_effect((zone, op["name"]), ("ok",))
        if q.get("requestId"):
            self._request_ids[q["requestId"]] = (zone, op["name"])
        return self._checked(op, compute_v1.Operation)

    def _validate_instance(self, zone: str, inst: dict) -> str:
        """Raise a 400 where GCE would; return the short machine type name."""
        name = inst.get("name")
        if not name:
            raise bad_request("Required field 'resource.name' not specified", "required")
        if not NAME_RE.fullmatch(name):
            raise bad_request(f"Invalid value for field 'resource.name': '{name}'. Must be a match of regex "
                              "'(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|[1-9][0-9]{0,19})'")
        mt = inst.get("machineType")
        if not mt:
            raise bad_request("Required field 'resource.machineType' not specified", "required")
        m = re.fullmatch(ZONAL_URL + r"machineTypes/([^/]+)", mt)
        offered = self.machine_types_by_zone.get(zone, MACHINE_TYPES)
        if m is None or m.group(1) != zone or m.group(2) not in MACHINE_TYPES or m.group(2) not in offered:
            short = m.group(2) if m else mt
            raise bad_request(f"Invalid value for field 'resource.machineType': '{mt}'. "
                              f"Machine type with name '{short}' does not exist in zone '{zone}'.")
        machine_type = m.group(2)
        disks = inst.get("disks") or []
        boots = [d for d in disks if d.get("boot")]
        if not disks or len(boots) != 1:
            raise bad_request("Invalid value for field 'resource.disks': ''. Exactly one boot disk must be specified.")
        init = boots[0].get("initializeParams") or {}
        if not boots[0].get("source") and not init.get("sourceImage") and not init.get("sourceSnapshot"):
            raise bad_request("Invalid value for field 'resource.disks[0]': ''. "
                              "Boot disk must have a source or initializeParams.sourceImage.")
        nics = inst.get("networkInterfaces") or []
        if not nics:
            raise bad_request("Invalid value for field 'resource.networkInterfaces': ''. "
                              "At least one network interface is required.")
        accels = inst.get("guestAccelerators") or []
        family = machine_type.split("-")[0]
        for i, acc in enumerate(accels):
            at = acc.get("acceleratorType", "")
            am = re.fullmatch(ZONAL_URL + r"acceleratorTypes/([^/]+)", at)
            if am is None or am.group(1) != zone or am.group(2) not in ACCELERATOR_TYPES:
                raise bad_request(f"Invalid value for field 'resource.guestAccelerators[{i}].acceleratorType': "
                                  f"'{at}'. Accelerator type '{at}' does not exist in zone '{zone}'.")
            if int(acc.get("acceleratorCount", 0)) < 1:
                raise bad_request(f"Invalid value for field 'resource.guestAccelerators[{i}].acceleratorCount': "
                                  f"'{acc.get('acceleratorCount', 0)}'. Must be greater than 0.")
            if family in ACCELERATOR_OPTIMIZED or family == "e2":
                raise bad_request(f"Invalid value for field 'resource.guestAccelerators[{i}]': '{at}'. "
                                  f"Machine type {machine_type} does not support guest accelerators.")
        scheduling = inst.get("scheduling") or {}
        gpu = bool(accels) or family in ACCELERATOR_OPTIMIZED
        if gpu and scheduling.get("onHostMaintenance", "MIGRATE") != "TERMINATE":
            raise bad_request("Instances with guest accelerators do not support live migration.", "badRequest")
        spot = scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible")
        if spot and scheduling.get("automaticRestart", False):
            raise bad_request("Invalid value for field 'resource.scheduling.automaticRestart': 'true'. "
                              "Spot and preemptible instances cannot be automatically restarted.")
        if spot and scheduling.get("onHostMaintenance", "MIGRATE") != "TERMINATE":
            raise bad_request("Invalid value for field 'resource.scheduling.onHostMaintenance': 'MIGRATE'. "
                              "Spot and preemptible instances must terminate on host maintenance.")
        action = scheduling.get("instanceTerminationAction")
        if action is not None and action not in ("STOP", "DELETE"):
            raise bad_request(f"Invalid value for field 'resource.scheduling.instanceTerminationAction': '{action}'.")
        if action is not None and not spot and "maxRunDuration" not in scheduling:
            raise bad_request("Invalid value for field 'resource.scheduling.instanceTerminationAction': "
                              f"'{action}'. It can only be set for Spot VMs or VMs with a maxRunDuration.")
        labels = inst.get("labels") or {}
        if len(labels) > 64:
            raise bad_request("Invalid value for field 'resource.labels': ''. At most 64 labels are allowed.")
        for k, v in labels.items():
            if not LABEL_KEY_RE.fullmatch(k):
                raise bad_request(f"Invalid value for field 'resource.labels': ''. Label key '{k}' violates format "
                                  "constraints. The key must start with a lowercase character, can only contain "
                                  "lowercase letters, numeric characters, underscores and dashes. The key can be "
                                  "at most 63 characters long.")
            if not LABEL_VALUE_RE.fullmatch(v):
                raise bad_request(f"Invalid value for field 'resource.labels': ''. Label value '{v}' violates format "
                                  "constraints. The value can only contain lowercase letters, numeric characters, "
                                  "underscores and dashes. The value can be at most 63 characters long.")
        items = (inst.get("metadata") or {}).get("items") or []
        keys = [it.get("key", "") for it in items]
        if len(set(keys)) != len(keys):
            raise bad_request("Invalid value for field 'resource.metadata': ''. Metadata has duplicate keys.")
        for k in keys:
            if not METADATA_KEY_RE.fullmatch(k):
                raise bad_request(f"Invalid value for field 'resource.metadata.items.key': '{k}'.")
        if sum(len(k) + len(it.get("value", "")) for k, it in zip(keys, items)) > 512 * 1024:
            raise bad_request("Invalid value for field 'resource.metadata': ''. Metadata exceeds 512 KB.")
        return machine_type

    def _materialize(self, zone: str, inst: dict, instance_id: str) -> dict:
        """The instance as GCE reports it: the request plus the server's output-only fields."""
        project_url = f"{GOOGLEAPIS}/projects/{self.project}"
        out = json.loads(json.dumps(inst))
        machine_type = inst["machineType"].rsplit("/", 1)[-1]
        out.update({
            "kind": "compute#instance", "id": instance_id, "creationTimestamp": rfc3339(),
            "status": "PROVISIONING", "zone": f"{project_url}/zones/{zone}",
            "machineType": f"{project_url}/zones/{zone}/machineTypes/{machine_type}",
            "selfLink": f"{project_url}/zones/{zone}/instances/{inst['name']}",
            "cpuPlatform": "Unknown CPU Platform", "labelFingerprint": "42WmSpB8rSM=",
            "fingerprint": "M5jCqMpdQhE=", "startRestricted": False, "deletionProtection": False,
        })
        for i, d in enumerate(out.get("disks", [])):
            init = d.pop("initializeParams", None) or {}
            d.update({"kind": "compute#attachedDisk", "index": i, "mode": "READ_WRITE", "type": "PERSISTENT",
                      "deviceName": init.get("diskName") or inst["name"], "interface": "SCSI",
                      "source": f"{project_url}/zones/{zone}/disks/{init.get('diskName') or inst['name']}",
                      "diskSizeGb": str(init.get("diskSizeGb", 10))})
        for i, nic in enumerate(out.get("networkInterfaces", [])):
            nic.update({"kind": "compute#networkInterface", "name": f"nic{i}",
                        "network": f"{project_url}/global/networks/" + nic.get("network", "default").rsplit("/", 1)[-1],
                        "networkIP": f"10.128.0.{len(self.instances) % 250 + 2}", "stackType": "IPV4_ONLY"})
            for ac in nic.get("accessConfigs", []):
                ac.update({"kind": "compute#accessConfig", "natIP": f"34.0.0.{len(self.instances) % 250 + 2}",
                           "networkTier": "PREMIUM"})
        for acc in out.get("guestAccelerators", []):
            short = acc["acceleratorType"].rsplit("/", 1)[-1]
            acc["acceleratorType"] = f"{project_url}/zones/{zone}/acceleratorTypes/{short}"
        if "metadata" in out:
            out["metadata"].update({"kind": "compute#metadata", "fingerprint": "kKbmg6Yk3Bk="})
        sched = out.setdefault("scheduling", {})
        sched.setdefault("onHostMaintenance", "MIGRATE")
        sched.setdefault("automaticRestart", sched.get("provisioningModel") != "SPOT")
        sched.setdefault("preemptible", False)
        sched.setdefault("provisioningModel", "STANDARD")
        return self._checked(out, compute_v1.Instance)

    def _get_instance(self, params, q, body):
        inst = self._instance(params)
        pending = self._deleting.get((params["zone"], params["instance"]))  # time passes for a delete nobody polls
        if pending is not None:
            self._advance(params["zone"], pending)
            if (params["zone"], params["instance"]) not in self.instances:
                return self._instance(params)  # gone: 404
        nxt = {"PROVISIONING": "STAGING", "STAGING": "RUNNING"}.get(inst["status"])
        report = dict(inst)
        if nxt is not None:  # one step per read, reported before the move
            inst["status"] = nxt
        return self._checked(report, compute_v1.Instance)

    def _instance(self, params) -> dict:
        inst = self.instances.get((params["zone"], params["instance"]))
        if inst is None:
            raise ApiError(404, error_body(
                404, f"The resource 'projects/{self.project}/zones/{params['zone']}/instances/{params['instance']}' "
                     "was not found", "notFound"))
        return inst

    def _delete_instance(self, params, q, body):
        inst = self._instance(params)
        if q.get("requestId") and q["requestId"] in self._request_ids:
            return self.operations[self._request_ids[q["requestId"]]]
        if (params["zone"], params["instance"]) in self._deleting:
            raise bad_request(f"The resource 'projects/{self.project}/zones/{params['zone']}/instances/"
                              f"{params['instance']}' is not ready", "resourceNotReady")
        inst["status"] = "STOPPING"
        op = self._new_operation(params["zone"], "delete", inst["selfLink"], inst["id"])
        self._deleting[(params["zone"], params["instance"])] = op["name"]
        self.lro.set_effect((params["zone"], op["name"]), ("delete", params["zone"], params["instance"]))
        if q.get("requestId"):
            self._request_ids[q["requestId"]] = (params["zone"], op["name"])
        return self._checked(op, compute_v1.Operation)

    def _list_instances(self, params, q, body):
        zone = params["zone"]
        items = [i for (z, _), i in sorted(self.instances.items()) if z == zone]
        items = [i for i in items if self._filter_matches(q.get("filter", ""), i)]
        return self._page(q, items, "compute#instanceList", f"projects/{self.project}/zones/{zone}/instances",
                          compute_v1.InstanceList)

    def _aggregated_instances(self, params, q, body):
        flt = q.get("filter", "")
        scoped: dict[str, dict] = {}
        for zone in sorted(self.zones):
            found = [i for (z, _), i in sorted(self.instances.items()) if z == zone and self._filter_matches(flt, i)]
            scope = f"zones/{zone}"
            scoped[scope] = {"instances": found} if found else {"warning": {
                "code": "NO_RESULTS_ON_PAGE", "message": f"There are no results for scope '{scope}' on this page.",
                "data": [{"key": "scope", "value": scope}]}}
        out = {"kind": "compute#instanceAggregatedList", "id": f"projects/{self.project}/aggregated/instances",
               "items": scoped, "selfLink": f"{GOOGLEAPIS}/projects/{self.project}/aggregated/instances"}
        return self._checked(out, compute_v1.InstanceAggregatedList)

    # ------------------------------------------------------------------ operations

    def _new_operation(self, zone: str, kind: str, target: str, target_id: str | None = None) -> dict:
        now = int(time.time() * 1000)
        bits = random.getrandbits
        name = f"operation-{now}-{bits(52):013x}-{bits(32):08x}-{bits(32):08x}"
        op = {
            "kind": "compute#operation", "id": str(next(self._ids)), "name": name,
            "zone": f"{GOOGLEAPIS}/projects/{self.project}/zones/{zone}", "operationType": kind,
            "targetLink": target, "targetId": target_id or str(next(self._ids)), "status": "PENDING",
            "user": "sftctl-test@sftctl-test.iam.gserviceaccount.com", "progress": 0, "insertTime": rfc3339(),
            "selfLink": f"{GOOGLEAPIS}/projects/{self.project}/zones/{zone}/operations/{name}",
        }
        return self.lro.add((zone, name), op)

    def _advance(self, zone: str, name: str) -> dict:
        op = self.lro.advance((zone, name), self._step, self._done)
        if op is None:
            raise ApiError(404, error_body(
                404, f"The resource 'projects/{self.project}/zones/{zone}/operations/{name}' was not found",
                "notFound"))
        return self._checked(dict(op), compute_v1.Operation)

    @staticmethod
    def _step(op: dict) -> bool:
        """GCE's operation stages, one per read: PENDING -> RUNNING -> DONE (True when DONE)."""
        if op["status"] == "PENDING":
            op.update(status="RUNNING", startTime=rfc3339())
        elif op["status"] == "RUNNING":
            op.update(status="DONE", progress=100, endTime=rfc3339())
            return True
        return False

    def _done(self, op: dict, effect: tuple | None) -> None:
        effect = effect or ("ok",)
        if effect[0] == "error":
            op.update(error=effect[1], httpErrorStatusCode=effect[2], httpErrorMessage=effect[3])
        elif effect[0] == "delete":
            self.instances.pop((effect[1], effect[2]), None)
            self._deleting.pop((effect[1], effect[2]), None)

    def _get_operation(self, params, q, body):
        return self._advance(params["zone"], params["operation"])

    def _wait_operation(self, params, q, body):
        # GCE's wait returns when the operation is DONE or after about 2 minutes, whichever is first;
        # "best effort", so callers loop. Here one call moves it one step, which exercises that loop.
        return self._advance(params["zone"], params["operation"])

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _checked(obj: dict, message_type) -> dict:
        """``obj`` after checking it parses strictly as ``message_type`` (an emulator bug otherwise)."""
        message_type.from_json(json.dumps(obj), ignore_unknown_fields=False)
        return obj

    def _page(self, q: dict, items: list[dict], kind: str, ident: str, message_type) -> dict:
        start = int(q.get("pageToken") or 0)
        size = int(q.get("maxResults") or 500)
        if not 0 <= size <= 500:
            raise bad_request(f"Invalid value for field 'maxResults': '{size}'. Must be less than or equal to 500")
        out = {"kind": kind, "id": ident, "items": items[start:start + size],
               "selfLink": f"{GOOGLEAPIS}/{ident}"}
        if start + size < len(items):
            out["nextPageToken"] = str(start + size)
        return self._checked(out, message_type)

    _CLAUSE = re.compile(
        r"\s*(?:AND\s+)?(?P<open>\(\s*)?(?P<field>[A-Za-z][\w.\-]*)\s*(?P<op>!=|=|:|\beq\b|\bne\b)\s*"
        r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s()]+)\s*(?P<close>\))?")

    def _filter_matches(self, flt: str, resource: dict) -> bool:
        """GCE list filter: clauses ``field = value`` / ``!=`` / ``:`` (has) / ``eq`` ``ne`` (regex),
        optionally parenthesized, joined by spaces or AND (OR is not supported here: a 400)."""
        flt = flt.strip()
        pos, clauses = 0, []
        while pos < len(flt):
            m = self._CLAUSE.match(flt, pos)
            if m is None or bool(m.group("open")) != bool(m.group("close")):
                raise bad_request(f"Invalid value for field 'filter': '{flt}'. Invalid list filter expression.")
            clauses.append((m.group("field"), m.group("op"), m.group("value").strip("\"'")))
            pos = m.end()
        for field, op, value in clauses:
            actual = resource
            for part in field.split("."):
                actual = actual.get(part) if isinstance(actual, dict) else None
            text = None if actual is None else (json.dumps(actual) if isinstance(actual, bool) else str(actual))
            if op == "=" and text != value:
                return False
            if op == "!=" and text == value:
                return False
            if op == ":" and (text is None or (value != "*" and value not in text)):
                return False
            if op == "eq" and (text is None or not re.fullmatch(value, text)):
                return False
            if op == "ne" and text is not None and re.fullmatch(value, text):
                return False
        return True


def _parse_error_message(text: str) -> str:
    """protobuf's ParseError text in the words Google's front end uses."""
    m = re.search(r'has no field named "([^"]+)" at "([^"]*)"', text)
    if m:
        where = m.group(2).split(".", 1)[1] if "." in m.group(2) else ""
        at = f"instance_resource.{where}" if where else "instance_resource"
        return f"Invalid JSON payload received. Unknown name \"{m.group(1)}\" at '{at}': Cannot find field."
    return "Invalid JSON payload received. " + " ".join(text.split())
