"""A Kubernetes API server emulator for the tests: real HTTP, real REST paths, schema-checked bodies.

No real cluster can run here, so this stands in for one the way moto stands in for AWS: the real
``kubernetes`` client talks to it over HTTP through an ordinary kubeconfig (see
:meth:`K8sEmulator.write_kubeconfig`), never through a mock of the client library.

What it serves (the paths of the core and batch APIs):

    GET  /version, /api, /apis
    GET|PATCH        /api/v1/nodes[/{name}]                      (PATCH: strategic / merge / JSON patch)
    GET|POST|DELETE  /api/v1/namespaces/{ns}/{pods,services,configmaps,secrets}[/{name}]
    GET|POST|DELETE  /apis/batch/v1/namespaces/{ns}/jobs[/{name}]

Lists honour ``labelSelector`` (``k=v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``).
Errors are ``Status`` objects in the API server's shape (404 NotFound, 409 AlreadyExists,
422 Invalid, 403 Forbidden, 401 Unauthorized, 429 TooManyRequests).

Every created object is validated against the official OpenAPI schema of Kubernetes
``SCHEMA_VERSION`` with ``kubernetes_validate`` (strict: unknown fields are errors), plus the
API server's own checks that no schema expresses (DNS names, label syntax, extended resources
whose request must equal their limit, volume mounts that name a volume, base64 secret data).
An invalid object is rejected with 422 Invalid.

A small scheduler binds pods: on a read, an unbound pod is filtered against every node
(cordoned, node affinity / nodeSelector, untolerated NoSchedule taints, allocatable resources
minus what bound pods use) and bound to the first node that fits (PodScheduled=True, still
Pending); on the next read it runs. A pod no node fits stays Pending with the scheduler's
``PodScheduled=False`` / ``Unschedulable`` condition (``0/3 nodes are available: 3 Insufficient
nvidia.com/gpu.``). Fault injection: a namespace GPU quota (403 ``exceeded quota``), N times 429
or any other status, and a bearer token that is checked (401 for any other).
"""

from __future__ import annotations

import base64
import copy
import datetime
import itertools
import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import yaml

#: The Kubernetes version whose schemas bodies are validated against (kubernetes-validate ships it).
SCHEMA_VERSION = "1.30"

#: resource (URL plural) -> (kind, apiVersion, namespaced)
RESOURCES = {
    "pods": ("Pod", "v1", True),
    "services": ("Service", "v1", True),
    "configmaps": ("ConfigMap", "v1", True),
    "secrets": ("Secret", "v1", True),
    "jobs": ("Job", "batch/v1", True),
    "nodes": ("Node", "v1", False),
}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    """A ``Status`` object as the API server writes it for an error."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.code, self.body, self.headers = code, status_body(code, reason, message, details), headers or {}


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


# ------------------------------------------------------------------ quantities and selectors


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity(value) -> float:
    """A Kubernetes resource quantity (``8``, ``500m``, ``64Gi``, ``1e3``) as a number."""
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)", str(value).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def parse_selector(text: str) -> list[tuple[str, str, list[str]]]:
    """A label selector string as ``(key, op, values)`` requirements (op: =, !=, in, notin, exists, !)."""
    reqs, text = [], (text or "").strip()
    pattern = re.compile(
        r"\s*(?:(?P<not>!)\s*(?P<nkey>[^\s,=!()]+)"
        r"|(?P<skey>[^\s,=!()]+)\s+(?P<setop>in|notin)\s*\((?P<vals>[^)]*)\)"
        r"|(?P<key>[^\s,=!()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<val>[^\s,=!()]*))?)\s*(?:,|$)"
    )
    pos = 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if not m or m.end() == pos:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: found '{text[pos:]}'")
        pos = m.end()
        if m.group("not"):
            reqs.append((m.group("nkey"), "!", []))
        elif m.group("setop"):
            reqs.append((m.group("skey"), m.group("setop"), [v.strip() for v in m.group("vals").split(",") if v.strip()]))
        elif m.group("op"):
            reqs.append((m.group("key"), "!=" if m.group("op") == "!=" else "=", [m.group("val")]))
        else:
            reqs.append((m.group("key"), "exists", []))
    return reqs


def selector_matches(reqs, labels: dict) -> bool:
    labels = labels or {}
    for key, op, values in reqs:
        has, value = key in labels, labels.get(key)
        ok = {"=": has and value == values[0], "!=": not has or value != values[0], "in": has and value in values,
              "notin": not has or value not in values, "exists": has, "!": not has}[op]
        if not ok:
            return False
    return True


def expression_matches(expr: dict, labels: dict) -> bool:
    """One ``NodeSelectorRequirement`` against a node's labels."""
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    has, value = key in labels, labels.get(key)
    if op == "In":
        return has and value in values
    if op == "NotIn":
        return not has or value not in values
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt"):
        try:
            return has and (int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0]))
        except ValueError:
            return False
    return False


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (also used for strategic merge patches of plain fields)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(target: dict, ops: list) -> dict:
    """RFC 6902 JSON patch: add, replace, remove on object paths."""
    out = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {}) if isinstance(cur, dict) else cur[int(p)]
        last = parts[-1]
        if op["op"] in ("add", "replace"):
            if isinstance(cur, list):
                cur.insert(len(cur) if last == "-" else int(last), op["value"]) if op["op"] == "add" else cur.__setitem__(int(last), op["value"])
            else:
                cur[last] = op["value"]
        elif op["op"] == "remove":
            del cur[int(last) if isinstance(cur, list) else last]
        else:
            raise ApiError(422, "Invalid", f"unsupported JSON patch op {op['op']!r}")
    return out


# ------------------------------------------------------------------ validation


def _schema_check(obj: dict) -> list[tuple[str, str]]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        field = ".".join(str(p) for p in e.absolute_path) or "<root>"
        return [(field, e.message.splitlines()[0])]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [("kind", e.message)]
    return []


def _check_labels(meta: dict, errors: list) -> None:
    for where in ("labels", "annotations"):
        for key, value in (meta.get(where) or {}).items():
            prefix, _, name = key.rpartition("/")
            if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or len(name) > 63 \
                    or not _LABEL_NAME.match(name):
                errors.append((f"metadata.{where}", f'Invalid value: "{key}": name part must consist of '
                                                    "alphanumeric characters, '-', '_' or '.'"))
            if where == "labels" and (len(str(value)) > 63 or not _LABEL_VALUE.match(str(value))):
                errors.append(("metadata.labels", f'Invalid value: "{value}": a valid label must be an empty '
                                                  "string or consist of alphanumeric characters, '-', '_' or '.'"))


def _check_pod_spec(spec: dict, path: str, errors: list) -> None:
    for field in ("hostname", "subdomain"):
        v = spec.get(field)
        if v is not None and (len(v) > 63 or not _DNS_LABEL.match(v)):
            errors.append((f"{path}.{field}", f'Invalid value: "{v}": a lowercase RFC 1123 label must consist '
                                              "of lower case alphanumeric characters or '-'"))
    volumes = {v.get("name") for v in spec.get("volumes") or []}
    names = set()
    for i, c in enumerate((spec.get("initContainers") or []) + (spec.get("containers") or [])):
        cpath = f"{path}.containers[{i}]"
        name = c.get("name", "")
        if not _DNS_LABEL.match(name) or name in names:
            errors.append((f"{cpath}.name", f'Invalid value: "{name}": must be a unique DNS label'))
        names.add(name)
        if not c.get("image"):
            errors.append((f"{cpath}.image", "Required value"))
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in volumes:
                errors.append((f"{cpath}.volumeMounts.name", f'Not found: "{m.get("name")}"'))
        for e in c.get("env") or []:
            if not _ENV_NAME.match(e.get("name", "")):
                errors.append((f"{cpath}.env.name", f'Invalid value: "{e.get("name")}": a valid environment '
                                                     "variable name must consist of alphabetic characters, digits, "
                                                     "'_', '-', or '.'"))
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for key in set(limits) | set(requests):
            for where, table in (("limits", limits), ("requests", requests)):
                if key in table:
                    try:
                        quantity(table[key])
                    except ValueError as e:
                        errors.append((f"{cpath}.resources.{where}[{key}]", f"Invalid value: {e}"))
            if "/" in key and not key.startswith("kubernetes.io/"):  # an extended resource
                if key not in limits:
                    errors.append((f"{cpath}.resources.limits", f"Required value: Limit must be set for "
                                                                f"non overcommitable resources: {key}"))
                elif key in requests and str(requests[key]) != str(limits[key]):
                    errors.append((f"{cpath}.resources.requests[{key}]", f'Invalid value: "{requests[key]}": '
                                                                         f"must be equal to {key} limit"))
    if spec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never"):
        errors.append((f"{path}.restartPolicy", f'Unsupported value: "{spec["restartPolicy"]}"'))


def validate_object(resource: str, obj: dict, namespace: str | None) -> None:
    """Raise ``ApiError`` (400 or 422) unless ``obj`` is a valid ``resource`` for this path."""
    kind, api_version, _ = RESOURCES[resource]
    if not isinstance(obj, dict):
        raise ApiError(400, "BadRequest", "the body of the request was in an unknown format")
    if obj.get("kind") != kind or obj.get("apiVersion") != api_version:
        raise ApiError(400, "BadRequest", f"the API version in the data ({obj.get('apiVersion')}) does not match "
                                          f"the expected API version ({api_version}) or kind {obj.get('kind')!r} is "
                                          f"not {kind!r}")
    meta = obj.get("metadata") or {}
    if namespace and meta.get("namespace") not in (None, namespace):
        raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                          "sent on the request")
    name = meta.get("name", "")
    errors = _schema_check(obj)
    pattern, what = (_DNS1035, "a DNS-1035 label") if resource == "services" else (_DNS_SUBDOMAIN, "a lowercase RFC 1123 subdomain")
    if not name:
        errors.append(("metadata.name", "Required value: name or generateName is required"))
    elif len(name) > (63 if resource == "services" else 253) or not pattern.match(name):
        errors.append(("metadata.name", f'Invalid value: "{name}": must be {what}'))
    _check_labels(meta, errors)
    if resource == "pods":
        _check_pod_spec(obj.get("spec") or {}, "spec", errors)
    elif resource == "jobs":
        tmpl = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
        _check_pod_spec(tmpl, "spec.template.spec", errors)
        if tmpl.get("restartPolicy") not in ("Never", "OnFailure"):
            errors.append(("spec.template.spec.restartPolicy", 'Required value: valid values: "OnFailure", "Never"'))
    elif resource in ("configmaps", "secrets"):
        for field in ("data", "stringData", "binaryData"):
            for key, value in (obj.get(field) or {}).items():
                if not _CONFIG_KEY.match(key):
                    errors.append((f"{field}[{key}]", f'Invalid value: "{key}": a valid config key must consist '
                                                      "of alphanumeric characters, '-', '_' or '.'"))
                if (resource == "secrets" and field == "data") or field == "binaryData":
                    try:
                        base64.b64decode(str(value), validate=True)
                    except ValueError:
                        errors.append((f"{field}[{key}]", "Invalid value: illegal base64 data"))
    elif resource == "services":
        spec = obj.get("spec") or {}
        for p in spec.get("ports") or []:
            if not 1 <= int(p.get("port", 0)) <= 65535:
                errors.append(("spec.ports.port", f"Invalid value: {p.get('port')}: must be between 1 and 65535"))
        for key, value in (spec.get("selector") or {}).items():
            if len(str(value)) > 63 or not _LABEL_VALUE.match(str(value)):
                errors.append((f"spec.selector[{key}]", f'Invalid value: "{value}"'))
    if errors:
        causes = [{"reason": "FieldValueInvalid", "message": f"{msg}", "field": field} for field, msg in errors]
        text = ", ".join(f"{field}: {msg}" for field, msg in errors)
        raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {text}',
                       {"name": name, "kind": kind, "causes": causes})


# ------------------------------------------------------------------ the cluster


def gpu_node(name: str, labels: dict, gpus: int = 8, resource: str = "nvidia.com/gpu", *,
             cpu: str = "96", memory: str = "1056Gi", taints: list | None = None) -> dict:
    """A ready node with ``gpus`` allocatable ``resource`` (0: a CPU-only node)."""
    alloc = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
    if gpus:
        alloc[resource] = str(gpus)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **labels}},
        "spec": {"taints": taints} if taints else {},
        "status": {"capacity": dict(alloc), "allocatable": dict(alloc),
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                   "message": "kubelet is posting ready status"}]},
    }


def default_nodes() -> list[dict]:
    """Two 8 x H100 nodes labelled by GPU Feature Discovery (an EKS node group), one GKE L4 node."""
    h100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.memory": "81559", "eks.amazonaws.com/nodegroup": "h100-pool",
            "node.kubernetes.io/instance-type": "p5.48xlarge"}
    l4 = {"cloud.google.com/gke-accelerator": "nvidia-l4", "cloud.google.com/gke-nodepool": "l4-pool",
          "node.kubernetes.io/instance-type": "g2-standard-8"}
    return [
        gpu_node("gpu-h100-a", h100),
        gpu_node("gpu-h100-b", h100),
        gpu_node("gke-l4-1", l4, gpus=1, cpu="8", memory="32Gi",
                 taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
    ]


class K8sEmulator:
    """The emulated cluster and its HTTP server. Start with :meth:`start` (or use as a context manager).

    Args:
        nodes: the cluster's nodes (default :func:`default_nodes`).
        token: the bearer token the server accepts (None: no authentication).
    """

    def __init__(self, nodes: list[dict] | None = None, token: str | None = "sftctl-emulator-token"):
        self.lock = threading.RLock()
        self.token = token
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.faults: list[dict] = []
        self.quotas: dict[str, dict[str, float]] = {}
        self.requests: list[tuple[str, str]] = []
        self._rv = itertools.count(1000)
        self._ips = itertools.count(10)
        self._bound: set[tuple[str, str]] = set()  # pods bound by the scheduler, not yet running
        for node in default_nodes() if nodes is None else nodes:
            self.add_node(node)
        self._server: ThreadingHTTPServer | None = None

    # -------------------------------------------------------------- test controls

    def add_node(self, node: dict) -> None:
        with self.lock:
            node = copy.deepcopy(node)
            node["metadata"].update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._rv)),
                                    creationTimestamp=_now())
            self.objects[("nodes", "", node["metadata"]["name"])] = node

    def inject(self, status: int, times: int = 1, method: str | None = None, resource: str | None = None,
               reason: str | None = None, message: str | None = None, retry_after: int | None = None) -> None:
        """The next ``times`` requests (of ``method`` on ``resource`` when given) fail with ``status``."""
        reason = reason or {429: "TooManyRequests", 500: "InternalError", 403: "Forbidden",
                            401: "Unauthorized", 503: "ServiceUnavailable"}.get(status, "Unknown")
        with self.lock:
            self.faults.append({"status": status, "times": times, "method": method, "resource": resource,
                                "reason": reason, "message": message, "retry_after": retry_after})

    def throttle(self, times: int, method: str | None = "POST", resource: str | None = "pods") -> None:
        """The next ``times`` matching requests get 429 TooManyRequests (as API Priority and Fairness answers)."""
        self.inject(429, times, method, resource, message="Too many requests, please try again later.",
                    retry_after=1)

    def set_quota(self, namespace: str, hard: dict[str, float], name: str = "gpu-quota") -> None:
        """A ResourceQuota: e.g. ``{"requests.nvidia.com/gpu": 8}``; pods beyond it get 403 exceeded quota."""
        with self.lock:
            self.quotas[namespace] = {"__name__": name, **hard}

    def finish_pod(self, namespace: str, name: str, exit_code: int) -> None:
        """The pod's container exited with ``exit_code`` (phase Succeeded or Failed)."""
        with self.lock:
            pod = self.objects[("pods", namespace, name)]
            pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            pod["status"]["containerStatuses"] = [{
                "name": c["name"], "ready": False, "restartCount": 0, "image": c.get("image", ""), "imageID": "",
                "state": {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error"}},
            } for c in pod["spec"]["containers"]]

    def list(self, resource: str, namespace: str | None = None, selector: str = "") -> list[dict]:
        """Stored objects (deep copies) of ``resource``, filtered by namespace and label selector."""
        reqs = parse_selector(selector)
        with self.lock:
            return [copy.deepcopy(o) for (r, ns, _), o in sorted(self.objects.items())
                    if r == resource and (namespace is None or ns == namespace)
                    and selector_matches(reqs, o["metadata"].get("labels"))]

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        with self.lock:
            o = self.objects.get((resource, namespace if RESOURCES[resource][2] else "", name))
            return copy.deepcopy(o) if o else None

    # -------------------------------------------------------------- the server

    @property
    def url(self) -> str:
        assert self._server is not None, "the emulator is not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "K8sEmulator":
        emulator = self

        class Handler(_Handler):
            cluster = emulator

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="k8s-emulator",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "K8sEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path, *, token: str | None = None, context: str = "emulator",
                         namespace: str = "default") -> Path:
        """A kubeconfig whose current context points at this server with a bearer token."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": context, "preferences": {},
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": token if token is not None else (self.token or "none")}}],
            "contexts": [{"name": context, "context": {"cluster": "emulator", "user": "tester", "namespace": namespace}}],
        }
        Path(path).write_text(yaml.safe_dump(config))
        return Path(path)

    # -------------------------------------------------------------- request handling

    def handle(self, method: str, path: str, query: dict, headers, body: bytes) -> tuple[int, dict, dict]:
        path = path.rstrip("/") or "/"  # the client asks for /api/ and /version/
        with self.lock:
            self.requests.append((method, path))
        if self.token is not None and headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized", "Unauthorized")
        route = self._route(path)
        self._fault(method, route[0] if route else None)
        if path == "/version":
            return 200, {"major": "1", "minor": SCHEMA_VERSION.split(".")[1], "gitVersion": f"v{SCHEMA_VERSION}.0",
                         "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2024-04-17T17:27:03Z",
                         "goVersion": "go1.22.2", "compiler": "gc", "platform": "linux/amd64"}, {}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}, {}
        if path == "/apis":
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": "batch", "versions": [{"groupVersion": "batch/v1", "version": "v1"}],
                 "preferredVersion": {"groupVersion": "batch/v1", "version": "v1"}}]}, {}
        if route is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        resource, namespace, name = route
        payload = None
        if body:
            try:
                payload = json.loads(body)
            except ValueError:
                raise ApiError(400, "BadRequest", "the body of the request could not be decoded as JSON") from None
        with self.lock:
            if method == "GET" and name is None:
                return 200, self._list(resource, namespace, (query.get("labelSelector") or [""])[0]), {}
            if method == "GET":
                return 200, self._read(resource, namespace, name), {}
            if method == "POST" and name is None and resource != "nodes":
                return 201, self._create(resource, namespace, payload), {}
            if method == "DELETE" and name is not None and resource != "nodes":
                return 200, self._delete(resource, namespace, name), {}
            if method == "PATCH" and name is not None:
                return 200, self._patch(resource, namespace, name, payload, headers.get("Content-Type", "")), {}
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    def _route(self, path: str):
        m = re.fullmatch(r"/api/v1/nodes(?:/([^/]+))?", path)
        if m:
            return "nodes", "", m.group(1)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/(pods|services|configmaps|secrets)(?:/([^/]+))?", path) or \
            re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/(jobs)(?:/([^/]+))?", path)
        if m:
            return m.group(2), m.group(1), m.group(3)
        return None

    def _fault(self, method: str, resource: str | None) -> None:
        with self.lock:
            for f in self.faults:
                if f["times"] > 0 and f["method"] in (None, method) and f["resource"] in (None, resource):
                    f["times"] -= 1
                    headers = {"Retry-After": str(f["retry_after"])} if f["retry_after"] is not None else {}
                    raise ApiError(f["status"], f["reason"], f["message"] or f["reason"], headers=headers)

    def _list(self, resource: str, namespace: str, selector: str) -> dict:
        kind, api_version, _ = RESOURCES[resource]
        items = []
        for obj in self.list(resource, namespace if RESOURCES[resource][2] else None, selector):
            if resource == "pods":
                obj = self._advance(obj["metadata"]["namespace"], obj["metadata"]["name"])
            obj.pop("kind", None)
            obj.pop("apiVersion", None)
            items.append(obj)
        return {"kind": f"{kind}List", "apiVersion": api_version,
                "metadata": {"resourceVersion": str(next(self._rv))}, "items": items}

    def _read(self, resource: str, namespace: str, name: str) -> dict:
        key = (resource, namespace, name)
        if key not in self.objects:
            raise not_found(resource, name)
        if resource == "pods":
            return self._advance(namespace, name)
        return copy.deepcopy(self.objects[key])

    def _create(self, resource: str, namespace: str, obj) -> dict:
        validate_object(resource, obj, namespace)
        name = obj["metadata"]["name"]
        if (resource, namespace, name) in self.objects:
            raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists',
                           {"name": name, "kind": resource})
        if resource == "pods":
            self._check_quota(namespace, obj)
        obj = copy.deepcopy(obj)
        obj["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), resourceVersion=str(next(self._rv)),
                               creationTimestamp=_now())
        if resource == "pods":
            obj["spec"].setdefault("restartPolicy", "Always")
            obj["spec"].setdefault("schedulerName", "default-scheduler")
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
            if obj["spec"].get("nodeName"):  # bound by its creator: runs on the next read
                self._bound.add((namespace, name))
        elif resource == "services":
            obj["spec"].setdefault("type", "ClusterIP")
            if obj["spec"].get("clusterIP") != "None":
                obj["spec"]["clusterIP"] = f"10.96.0.{next(self._ips) % 250}"
            obj["spec"]["clusterIPs"] = [obj["spec"]["clusterIP"]]
            obj["status"] = {"loadBalancer": {}}
        elif resource == "secrets":
            obj.setdefault("type", "Opaque")
            data = dict(obj.get("data") or {})
            for key, value in (obj.pop("stringData", None) or {}).items():
                data[key] = base64.b64encode(str(value).encode()).decode()
            obj["data"] = data
        elif resource == "jobs":
            obj["status"] = {"active": 0}
        self.objects[(resource, namespace, name)] = obj
        return copy.deepcopy(obj)

    def _delete(self, resource: str, namespace: str, name: str) -> dict:
        obj = self.objects.pop((resource, namespace, name), None)
        if obj is None:
            raise not_found(resource, name)
        self._bound.discard((namespace, name))
        if resource == "pods":  # the API server answers a pod deletion with the pod, being deleted
            obj["metadata"]["deletionTimestamp"] = _now()
            obj["metadata"]["deletionGracePeriodSeconds"] = 30
            return obj
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "kind": resource, "uid": obj["metadata"]["uid"]}}

    def _patch(self, resource: str, namespace: str, name: str, patch, content_type: str) -> dict:
        key = (resource, namespace, name)
        if key not in self.objects:
            raise not_found(resource, name)
        ctype = content_type.split(";")[0].strip()
        if ctype == "application/json-patch+json":
            new = json_patch(self.objects[key], patch)
        elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            new = merge_patch(self.objects[key], patch)
        else:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                                                        "accepted media types include: application/json-patch+json, "
                                                        "application/merge-patch+json, "
                                                        "application/strategic-merge-patch+json")
        meta = new["metadata"]
        if meta.get("name") != name:
            raise ApiError(422, "Invalid", f"{RESOURCES[resource][0]} \"{name}\" is invalid: metadata.name: "
                                           "Invalid value: field is immutable")
        checked = {k: v for k, v in new.items() if k != "status"}
        checked["metadata"] = {k: v for k, v in meta.items() if k in ("name", "namespace", "labels", "annotations")}
        validate_object(resource, checked, namespace or None)
        meta["resourceVersion"] = str(next(self._rv))
        self.objects[key] = new
        return copy.deepcopy(new)

    # -------------------------------------------------------------- quota and scheduling

    @staticmethod
    def _pod_requests(pod: dict) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in (pod.get("spec") or {}).get("containers") or []:
            res = c.get("resources") or {}
            table = {**(res.get("limits") or {}), **(res.get("requests") or {})}  # requests default to limits
            for key, value in table.items():
                out[key] = out.get(key, 0.0) + quantity(value)
        return out

    def _check_quota(self, namespace: str, pod: dict) -> None:
        hard = self.quotas.get(namespace)
        if not hard:
            return
        want = self._pod_requests(pod)
        used: dict[str, float] = {}
        for (r, ns, _), other in self.objects.items():
            if r == "pods" and ns == namespace and other["status"]["phase"] not in ("Succeeded", "Failed"):
                for key, value in self._pod_requests(other).items():
                    used[key] = used.get(key, 0.0) + value
        for key, limit in hard.items():
            if key == "__name__":
                continue
            resource = key.removeprefix("requests.")
            if want.get(resource, 0) and used.get(resource, 0) + want[resource] > limit:
                raise ApiError(403, "Forbidden", (
                    f'pods "{pod["metadata"]["name"]}" is forbidden: exceeded quota: {hard["__name__"]}, '
                    f"requested: {key}={want[resource]:g}, used: {key}={used.get(resource, 0):g}, "
                    f"limited: {key}={limit:g}"), {"name": pod["metadata"]["name"], "kind": "pods"})

    def _advance(self, namespace: str, name: str) -> dict:
        """One scheduling / kubelet step for a pod that is read; returns a copy of it."""
        pod = self.objects[("pods", namespace, name)]
        status = pod["status"]
        if status["phase"] == "Pending" and pod["spec"].get("nodeName") and (namespace, name) in self._bound:
            ip = f"10.244.{next(self._ips) % 250}.{next(self._ips) % 250}"
            self._bound.discard((namespace, name))
            status.update(phase="Running", podIP=ip, podIPs=[{"ip": ip}], hostIP="192.168.0.10", startTime=_now())
            status["conditions"] = [{"type": t, "status": "True", "lastTransitionTime": _now()}
                                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
            status["containerStatuses"] = [{
                "name": c["name"], "ready": True, "restartCount": 0, "image": c["image"], "imageID": "",
                "started": True, "state": {"running": {"startedAt": _now()}}} for c in pod["spec"]["containers"]]
        elif status["phase"] == "Pending" and not pod["spec"].get("nodeName"):
            node, message = self._schedule(pod)
            if node is not None:
                pod["spec"]["nodeName"] = node
                self._bound.add((namespace, name))
                status["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]
            else:
                status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": message, "lastTransitionTime": _now()}]
        return copy.deepcopy(pod)

    def _schedule(self, pod: dict) -> tuple[str | None, str]:
        """The first node that fits ``pod``, or None and the scheduler's FailedScheduling message."""
        nodes = [o for (r, _, _), o in sorted(self.objects.items()) if r == "nodes"]
        want = self._pod_requests(pod)
        reasons: dict[str, int] = {}
        for node in nodes:
            why = self._misfit(pod, node, want)
            if why is None:
                return node["metadata"]["name"], ""
            reasons[why] = reasons.get(why, 0) + 1
        text = ", ".join(sorted(f"{n} {why}" for why, n in reasons.items()))
        return None, f"0/{len(nodes)} nodes are available: {text}."

    def _misfit(self, pod: dict, node: dict, want: dict[str, float]) -> str | None:
        spec, labels = pod["spec"], node["metadata"].get("labels") or {}
        if (node.get("spec") or {}).get("unschedulable"):
            return "node(s) were unschedulable"
        selector = spec.get("nodeSelector") or {}
        terms = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms")
        if any(labels.get(k) != v for k, v in selector.items()) or (terms is not None and not any(
                all(expression_matches(e, labels) for e in t.get("matchExpressions") or []) for t in terms)):
            return "node(s) didn't match Pod's node affinity/selector"
        for taint in (node.get("spec") or {}).get("taints") or []:
            if taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            if not any(self._tolerates(t, taint) for t in spec.get("tolerations") or []):
                return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        alloc = node["status"].get("allocatable") or {}
        used: dict[str, float] = {}
        for (r, _, _), other in self.objects.items():
            if r == "pods" and other["spec"].get("nodeName") == node["metadata"]["name"] \
                    and other["status"]["phase"] not in ("Succeeded", "Failed"):
                for key, value in self._pod_requests(other).items():
                    used[key] = used.get(key, 0.0) + value
        for key, value in sorted(want.items()):
            if value and used.get(key, 0.0) + value > quantity(alloc.get(key, "0")):
                return f"Insufficient {key}"
        return None

    @staticmethod
    def _tolerates(toleration: dict, taint: dict) -> bool:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            return False
        if toleration.get("operator") == "Exists":
            return not toleration.get("key") or toleration["key"] == taint["key"]
        return toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", "")


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that hung up is not an error here
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    cluster: K8sEmulator

    def log_message(self, format, *args):  # quiet: the tests read the cluster, not the log
        pass

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urlsplit(self.path)
        try:
            code, payload, headers = self.cluster.handle(method, url.path, parse_qs(url.query), self.headers, body)
        except ApiError as e:
            code, payload, headers = e.code, e.body, e.headers
        except Exception as e:  # noqa: BLE001 a bug in the emulator: answer like an API server would, never hang
            code, payload, headers = 500, status_body(500, "InternalError", f"emulator: {type(e).__name__}: {e}"), {}
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_DELETE(self):
        self._serve("DELETE")

    def do_PATCH(self):
        self._serve("PATCH")

    def do_PUT(self):
        self._serve("PUT")
