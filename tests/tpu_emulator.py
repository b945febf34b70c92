"""A Cloud TPU API v2 emulator for the tests: a real HTTP server speaking the TPU REST API.

No TPU can run here, so the TPU half of the GCP provider is tested with the real
``google-cloud-tpu`` client (REST transport) against this server. It serves the paths that client
sends (read off ``tpu_v2/services/tpu/transports/rest_base.py``)::

    GET    /v2/projects/{p}/locations                                   locations.list
    POST   /v2/projects/{p}/locations/{z}/queuedResources               queuedResources.create
    GET    /v2/projects/{p}/locations/{z}/queuedResources               queuedResources.list (z may be -)
    GET    /v2/projects/{p}/locations/{z}/queuedResources/{id}          queuedResources.get
    DELETE /v2/projects/{p}/locations/{z}/queuedResources/{id}          queuedResources.delete
    GET    /v2/projects/{p}/locations/{z}/nodes                         nodes.list
    GET    /v2/projects/{p}/locations/{z}/nodes/{id}                    nodes.get
    GET    /v2/projects/{p}/locations/{z}/operations/{op}               operations.get

and is strict where the API is: request bodies are parsed into the official message types
(``tpu_v2.QueuedResource.from_json(body, ignore_unknown_fields=False)``: the types generated from
the same API definition as its discovery document), so an unknown field is a 400 in Google's
error format; query parameters must be fields of the method's request message; a queued
resource needs a valid id, exactly one ``nodeSpec`` whose ``parent`` is the zone it is created
in, an accelerator type that zone offers, the TPU VM runtime of that generation, labels that
follow GCP's rules, and not both ``spot`` and ``guaranteed``. Every response is itself checked
against the message type it claims to be.

State moves one step per read, as the real queue does: a queued resource is ACCEPTED ->
PROVISIONING -> ACTIVE (its node then READY, with one ``networkEndpoints`` entry per host of the
slice: ``v5litepod-16`` has 4), operations are not done at first and done on their first read.
Faults, with the shapes the API returns:

* ``stockout(zone, accelerator_type)``: the queued resource ends FAILED with
  ``failedData.error {code: 8, message: "There is no more capacity in the zone ..."}``.
* ``preempt(name)``: a spot slice is taken back: SUSPENDED, its node PREEMPTED.
* ``unhealthy(name)``: a host lost or the TPU runtime failed: the node's ``health``.
* ``deny(403)``: requests answer ``PERMISSION_DENIED``.
"""

from __future__ import annotations

import datetime
import itertools
import json
import random
import re
import threading
from urllib.parse import parse_qs, urlsplit

from google.cloud import tpu_v2
from google.cloud.location import locations_pb2
from google.longrunning import operations_pb2
from google.protobuf import json_format

from emulator_http import Operations, server_url, start_server, stop_server

#: zone -> accelerator types offered there (Cloud TPU docs, "TPU regions and zones": v5e in
#: us-central1-a, us-west4-a, europe-west4-b; v5p in us-east5-a, europe-west4-b; v6e in us-east5-b,
#: europe-west4-a, us-south1-a). Hosts per type: Cloud TPU docs per version.
V5E = {"v5litepod-1": 1, "v5litepod-4": 1, "v5litepod-8": 1, "v5litepod-16": 4, "v5litepod-32": 8}
V5P = {"v5p-8": 1, "v5p-16": 2, "v5p-32": 4}
V6E = {"v6e-1": 1, "v6e-4": 1, "v6e-8": 1, "v6e-16": 4, "v6e-32": 8}
DEFAULT_ZONES = {
    "us-central1-a": V5E, "us-central1-b": V5E, "us-west4-a": V5E, "europe-west4-b": {**V5E, **V5P},
    "us-east5-a": V5P, "us-east5-b": V6E, "us-east5-c": V6E, "europe-west4-a": V6E, "us-south1-a": V6E,
}
RUNTIMES = {"v5litepod": {"v2-alpha-tpuv5-lite"}, "v5p": {"v2-alpha-tpuv5"}, "v6e": {"v2-alpha-tpuv6e"}}
ID_RE = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
LABEL_KEY_RE = re.compile(r"[a-z][a-z0-9_-]{0,62}")
LABEL_VALUE_RE = re.compile(r"[a-z0-9_-]{0,63}")
SYSTEM_PARAMS = {"alt", "$alt", "prettyPrint", "fields", "key", "quotaUser", "$.xgafv", "access_token"}
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          409: "ALREADY_EXISTS"}
NEXT = {"CREATING": "ACCEPTED", "ACCEPTED": "PROVISIONING", "PROVISIONING": "ACTIVE", "SUSPENDING": "SUSPENDED"}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"code": status, "message": message, "status": STATUS.get(status, "UNKNOWN")}}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def checked(obj: dict, message_type) -> dict:
    """``obj`` after checking it parses strictly as ``message_type`` (an emulator bug otherwise)."""
    if hasattr(message_type, "from_json"):
        message_type.from_json(json.dumps(obj), ignore_unknown_fields=False)
    else:
        json_format.Parse(json.dumps(obj), message_type(), ignore_unknown_fields=False)
    return obj


P = r"/v2/projects/(?P<project>[^/]+)"
L = P + r"/locations/(?P<zone>[^/]+)"
ROUTES = [  # (method, regex, handler, request type, body field)
    ("GET", P + r"/locations", "list_locations", None, None),
    ("POST", L + r"/queuedResources", "create_qr", tpu_v2.CreateQueuedResourceRequest, "queued_resource"),
    ("GET", L + r"/queuedResources", "list_qr", tpu_v2.ListQueuedResourcesRequest, None),
    ("GET", L + r"/queuedResources/(?P<id>[^/:]+)", "get_qr", tpu_v2.GetQueuedResourceRequest, None),
    ("DELETE", L + r"/queuedResources/(?P<id>[^/:]+)", "delete_qr", tpu_v2.DeleteQueuedResourceRequest, None),
    ("GET", L + r"/nodes", "list_nodes", tpu_v2.ListNodesRequest, None),
    ("GET", L + r"/nodes/(?P<id>[^/:]+)", "get_node", tpu_v2.GetNodeRequest, None),
    ("GET", L + r"/operations/(?P<id>[^/:]+)", "get_operation", None, None),
]


class TPUEmulator:
    """The emulator's state and HTTP server (a context manager).

    Attributes:
        project: the one project that exists.
        zones: zone -> {accelerator type: hosts} it offers.
        queued: (zone, id) -> QueuedResource JSON; nodes: (zone, id) -> Node JSON.
        requests: every request: dicts with method, path, query, body and status.
    """

    def __init__(self, project: str = "sftctl-test", host_ip: str | None = None):
        self.project = project
        self.host_ip = host_ip  # every worker's address (a node simulator on this machine: 127.0.0.1)
        self.zones = {z: dict(t) for z, t in DEFAULT_ZONES.items()}
        self.lock = threading.RLock()
        self._server = None
        self._ids = itertools.count(random.randrange(10**15, 9 * 10**15))
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.queued: dict[tuple[str, str], dict] = {}
            self.nodes: dict[tuple[str, str], dict] = {}
            self.lro = Operations()  # (zone, id) -> Operation JSON, and (response, effect) of its done
            self.operations: dict = self.lro.ops
            self._stockouts: set[tuple[str, str | None]] = set()
            self._denied: int | None = None
            self.requests: list[dict] = []

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "TPUEmulator":
        self._server, self._thread = start_server(self, "tpu-emulator")
        return self

    def __exit__(self, *exc) -> None:
        stop_server(self._server, self._thread)

    @property
    def url(self) -> str:
        return server_url(self._server)

    # ------------------------------------------------------------------ faults

    def stockout(self, zone: str, accelerator_type: str | None = None) -> None:
        """Queued resources in ``zone`` (of ``accelerator_type``, None: any) end FAILED for capacity."""
        self._stockouts.add((zone, accelerator_type))

    def preempt(self, qr_id: str) -> None:
        """Take a spot slice back (Google's spot preemption): SUSPENDED, its node PREEMPTED."""
        with self.lock:
            for (zone, name), qr in self.queued.items():
                if name == qr_id:
                    assert "spot" in qr, f"{qr_id} is not spot: only spot slices are preempted"
                    qr["state"] = {"state": "SUSPENDED", "stateInitiator": "SERVICE"}
                    self.nodes[(zone, name)]["state"] = "PREEMPTED"
                    return
        raise KeyError(qr_id)

    def unhealthy(self, qr_id: str, health: str = "UNHEALTHY_MAINTENANCE") -> None:
        """A host of the slice is lost or its TPU runtime failed: the node's ``health``."""
        with self.lock:
            (key,) = [k for k in self.nodes if k[1] == qr_id]
            self.nodes[key]["health"] = health

    def deny(self, status: int | None) -> None:
        self._denied = status

    def live(self) -> list[str]:
        """Ids of the queued resources that exist (what would bill)."""
        with self.lock:
            return sorted(name for _, name in self.queued)

    # ------------------------------------------------------------------ dispatch

    def handle(self, method: str, raw_path: str, body: str) -> tuple[int, dict]:
        parts = urlsplit(raw_path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        parsed = json.loads(body) if body else None
        record = {"method": method, "path": parts.path, "query": query, "body": parsed}
        with self.lock:
            self.requests.append(record)
            try:
                if self._denied:
                    raise ApiError(self._denied, "The caller does not have permission")
                for m, pattern, name, request_type, body_field in ROUTES:
                    match = re.fullmatch(pattern, parts.path)
                    if m != method or match is None:
                        continue
                    params = match.groupdict()
                    if params["project"] != self.project:
                        raise ApiError(403, f"Permission denied on resource project {params['project']}.")
                    self._check_query(query, request_type, body_field)
                    status, out = 200, getattr(self, "_" + name)(params, query, parsed)
                    break
                else:
                    raise ApiError(404, f"Method not found: {method} {parts.path}")
            except ApiError as e:
                status, out = e.status, e.body
            record["status"] = status
            return status, out

    @staticmethod
    def _check_query(query: dict, request_type, body_field: str | None) -> None:
        if request_type is None:
            return
        allowed = set(SYSTEM_PARAMS)
        for f in request_type.pb().DESCRIPTOR.fields:
            if f.name not in ("parent", "name", body_field):
                allowed |= {f.name, f.json_name}
        unknown = set(query) - allowed
        if unknown:
            raise ApiError(400, f"Invalid JSON payload received. Unknown name \"{sorted(unknown)[0]}\": "
                                "Cannot bind query parameter.")

    # ------------------------------------------------------------------ locations

    def _list_locations(self, params, q, body):
        out = {"locations": [{"name": f"projects/{self.project}/locations/{z}", "locationId": z}
                             for z in sorted(self.zones)]}
        json_format.Parse(json.dumps(out), locations_pb2.ListLocationsResponse())
        return out

    # ------------------------------------------------------------------ queued resources

    def _zone(self, params) -> str:
        zone = params["zone"]
        if zone not in self.zones:
            raise ApiError(404, f"Location projects/{self.project}/locations/{zone} is not found or access is "
                                "unauthorized.")
        return zone

    def _create_qr(self, params, q, body):
        zone = self._zone(params)
        qr_id = q.get("queuedResourceId") or q.get("queued_resource_id") or ""
        if not ID_RE.fullmatch(qr_id):
            raise ApiError(400, f"Invalid queued resource id {qr_id!r}: it must match [a-z]([-a-z0-9]*[a-z0-9])?")
        try:
            tpu_v2.QueuedResource.from_json(json.dumps(body or {}), ignore_unknown_fields=False)
        except Exception as e:  # noqa: BLE001 (protobuf's ParseError: an unknown or mistyped field)
            raise ApiError(400, "Invalid JSON payload received. " + " ".join(str(e).split())) from None
        if (zone, qr_id) in self.queued:
            raise ApiError(409, f"Resource 'projects/{self.project}/locations/{zone}/queuedResources/{qr_id}' "
                                "already exists")
        if "spot" in body and "guaranteed" in body:
            raise ApiError(400, "Only one of spot, guaranteed may be set")
        specs = (body.get("tpu") or {}).get("nodeSpec") or []
        if len(specs) != 1:
            raise ApiError(400, f"tpu.node_spec: exactly one node spec is supported here, got {len(specs)}")
        spec = specs[0]
        if spec.get("parent") != f"projects/{self.project}/locations/{zone}":
            raise ApiError(400, f"tpu.node_spec[0].parent {spec.get('parent')!r} is not the queued resource's "
                                f"location projects/{self.project}/locations/{zone}")
        if not ID_RE.fullmatch(spec.get("nodeId", "")) or "multisliceParams" in spec:
            raise ApiError(400, "tpu.node_spec[0].node_id must be a valid id (multislice is not emulated)")
        node = spec.get("node") or {}
        acc = node.get("acceleratorType", "")
        if acc not in self.zones[zone]:
            raise ApiError(400, f"Accelerator type {acc!r} is not available in zone {zone}: "
                                f"{', '.join(sorted(self.zones[zone]))}")
        family = acc.rsplit("-", 1)[0]
        if node.get("runtimeVersion") not in RUNTIMES[family]:
            raise ApiError(400, f"Runtime version {node.get('runtimeVersion')!r} is not supported for {acc}; use "
                                f"{', '.join(sorted(RUNTIMES[family]))}")
        for k, v in (node.get("labels") or {}).items():
            if not LABEL_KEY_RE.fullmatch(k) or not LABEL_VALUE_RE.fullmatch(v):
                raise ApiError(400, f"Invalid label {k}={v!r}")
        qr = {**body, "name": f"projects/{self.project}/locations/{zone}/queuedResources/{qr_id}",
              "createTime": now(), "state": {"state": "ACCEPTED"}}
        failed = (zone, acc) in self._stockouts or (zone, None) in self._stockouts
        qr["_fail"] = failed
        self.queued[(zone, qr_id)] = qr
        return self._operation(zone, "create", qr["name"], {"@type": "type.googleapis.com/google.cloud.tpu.v2."
                                                            "QueuedResource", **self._public(qr)})

    @staticmethod
    def _public(qr: dict) -> dict:
        return {k: v for k, v in qr.items() if not k.startswith("_")}

    def _qr(self, params) -> tuple[str, dict]:
        zone = self._zone(params)
        qr = self.queued.get((zone, params["id"]))
        if qr is None:
            raise ApiError(404, f"Resource 'projects/{self.project}/locations/{zone}/queuedResources/"
                                f"{params['id']}' was not found")
        return zone, qr

    def _get_qr(self, params, q, body):
        zone, qr = self._qr(params)
        report = self._public(dict(qr))
        state = qr["state"]["state"]
        if qr["_fail"] and state == "PROVISIONING":
            qr["state"] = {"state": "FAILED", "failedData": {"error": {
                "code": 8, "message": f"There is no more capacity in the zone \"{zone}\"; you can try in another "
                                      "zone where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/"
                                      "regions) [EID: 0x1b2c3d4e5f607182]"}}}
        elif state in NEXT:
            qr["state"] = {"state": NEXT[state]}
            if NEXT[state] == "ACTIVE":
                self._make_node(zone, params["id"], qr)
        return checked(report, tpu_v2.QueuedResource)

    def _make_node(self, zone: str, qr_id: str, qr: dict) -> None:
        spec = qr["tpu"]["nodeSpec"][0]
        node = dict(spec["node"])
        hosts = self.zones[zone][node["acceleratorType"]]
        n = len(self.nodes) % 200
        node.update({
            "name": f"projects/{self.project}/locations/{zone}/nodes/{spec['nodeId']}", "state": "READY",
            "createTime": now(), "id": str(next(self._ids)), "health": "HEALTHY", "apiVersion": "V2",
            "queuedResource": qr["name"],
            "schedulingConfig": {"spot": True} if "spot" in qr else {},
            "networkEndpoints": [{"ipAddress": self.host_ip or f"10.130.{n}.{w + 2}", "port": 8470,
                                  "accessConfig": {"externalIp": f"35.1.{n}.{w + 2}"}} for w in range(hosts)],
        })
        self.nodes[(zone, spec["nodeId"])] = checked(node, tpu_v2.Node)

    def _delete_qr(self, params, q, body):
        zone, qr = self._qr(params)
        if self.nodes.get((zone, params["id"])) and q.get("force") not in ("true", "True", "1"):
            raise ApiError(400, f"Queued resource {params['id']} has a node: delete it with force=true")
        qr["state"] = {"state": "DELETING"}
        return self._operation(zone, "delete", qr["name"], {"@type": "type.googleapis.com/google.protobuf.Empty"},
                               effect=("delete", zone, params["id"]))

    def _list_qr(self, params, q, body):
        zone = params["zone"]
        if zone != "-":
            self._zone(params)
        items = [self._public(qr) for (z, _), qr in sorted(self.queued.items()) if zone in ("-", z)]
        return checked({"queuedResources": items}, tpu_v2.ListQueuedResourcesResponse)

    def _get_node(self, params, q, body):
        zone = self._zone(params)
        node = self.nodes.get((zone, params["id"]))
        if node is None:
            raise ApiError(404, f"Resource 'projects/{self.project}/locations/{zone}/nodes/{params['id']}' "
                                "was not found")
        return checked(dict(node), tpu_v2.Node)

    def _list_nodes(self, params, q, body):
        zone = params["zone"]
        items = [n for (z, _), n in sorted(self.nodes.items()) if zone in ("-", z)]
        return checked({"nodes": items}, tpu_v2.ListNodesResponse)

    # ------------------------------------------------------------------ operations

    def _operation(self, zone: str, verb: str, target: str, response: dict, effect=None) -> dict:
        name = f"projects/{self.project}/locations/{zone}/operations/operation-{next(self._ids)}"
        op = {"name": name, "done": False, "metadata": {
            "@type": "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata", "createTime": now(),
            "target": target, "verb": verb, "apiVersion": "v2"}}
        self.lro.add((zone, name.rsplit("/", 1)[-1]), op, (response, effect))
        return checked(dict(op), operations_pb2.Operation)

    def _get_operation(self, params, q, body):
        op = self.lro.advance((params["zone"], params["id"]), self._step, self._done)
        if op is None:
            raise ApiError(404, f"Operation {params['id']} was not found")
        return checked(dict(op), operations_pb2.Operation)

    @staticmethod
    def _step(op: dict) -> bool:
        """Done on its first read (True then)."""
        if op["done"]:
            return False
        op["done"] = True
        return True

    def _done(self, op: dict, outcome: tuple) -> None:
        response, effect = outcome
        op["response"] = response
        if effect and effect[0] == "delete":
            self.queued.pop((effect[1], effect[2]), None)
            self.nodes.pop((effect[1], effect[2]), None)


class TPUNodeSimulator(threading.Thread):
    """Plays the TPU VMs' part on this machine: for every READY node of the emulator, runs its
    ``startup-script`` (the real bootstrap, wrapped per worker by the provider) once per worker
    of the slice, with ``SFTCTL_TPU_WORKER`` set as the VM metadata would, ``SFTCTL_VENV`` at this
    Python (no pip install) and a node directory of its own; kills a slice's processes when its
    node goes away, as deleting the TPU does."""

    def __init__(self, emulator: TPUEmulator, root, env: dict | None = None):
        super().__init__(daemon=True)
        import pathlib

        self.emulator, self.root, self.env = emulator, pathlib.Path(root), env or {}
        self.procs: dict[str, list] = {}
        self.booted: list[tuple[str, int]] = []  # (node name, hosts)
        self.halt = threading.Event()

    def run(self) -> None:
        import os
        import subprocess
        import sys

        while not self.halt.wait(0.2):
            with self.emulator.lock:
                ready = {name: dict(n) for (_, name), n in self.emulator.nodes.items() if n.get("state") == "READY"}
            for name, node in ready.items():
                if name in self.procs:
                    continue
                script = node.get("metadata", {}).get("startup-script", "exit 0")
                self.procs[name] = []
                for w in range(len(node["networkEndpoints"])):
                    d = self.root / name / f"w{w}"
                    d.mkdir(parents=True)
                    env = {**os.environ, **self.env, "SFTCTL_TPU_WORKER": str(w), "SFTCTL_VENV": sys.prefix,
                           "SFTCTL_NODE_DIR": str(d / "node"), "SFTCTL_NODE_POLL_S": "0.5"}
                    with open(d / "console.log", "ab") as log:
                        self.procs[name].append(subprocess.Popen(["bash", "-c", script], cwd=d, env=env, stdout=log,
                                                                 stderr=subprocess.STDOUT, start_new_session=True))
                self.booted.append((name, len(node["networkEndpoints"])))
            for name, procs in self.procs.items():
                if name not in ready:
                    for p in procs:
                        _killpg(p)

    def close(self) -> None:
        self.halt.set()
        self.join(10)
        for procs in self.procs.values():
            for p in procs:
                _killpg(p)


def _killpg(proc) -> None:
    import os
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
