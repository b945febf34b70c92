"""Kubernetes: one pod per node, on the cluster of a kubeconfig context (or the one we run in).

What a job gets on the cluster (every object labelled ``sftctl-managed``, ``sftctl-job`` and, for
a node's objects, ``sftctl-node``; manifests are Jinja2 templates in ``sftctl/templates/k8s/``):

    Secret     sftctl-<job>-env       once per job: the secret environment (envFrom secretRef)
    Service    sftctl-<job>           once per job, headless: pod DNS names for the rendezvous
    ConfigMap  <node>-bootstrap       per node: its bootstrap script, mounted, run as the command
    Pod        <node>                 per node: restartPolicy Never, GPU limit, node affinity

A pod's hostname is ``rank-<rank>`` and its subdomain the job's Service, so rank 0 is reachable as
``rank-0.sftctl-<job>`` from every pod of the job; that is ``MASTER_ADDR`` (and the handle's
``ip``), with ``MASTER_PORT``, ``NODE_RANK``, ``NNODES`` and ``NPROC_PER_NODE`` for torchrun.

The GPU model is chosen by the node labels clusters really carry, OR'ed as nodeSelectorTerms:
``nvidia.com/gpu.product`` (NVIDIA GPU Feature Discovery: ``NVIDIA-H100-80GB-HBM3``),
``cloud.google.com/gke-accelerator`` (GKE: ``nvidia-h100-80gb``) and
``karpenter.k8s.aws/instance-gpu-name`` (Karpenter on EKS: ``h100``); AMD GPUs by the labels of
AMD's node labeller (``amd.com/gpu.product-name``, ``amd.com/gpu.device-id``); the values that name each
accelerator are the ``identity.kubernetes_labels`` column of ``sftctl/catalog/accelerators.yaml``
(:func:`sftctl.catalog.identity.kubernetes_labels`).

A node replaced for a health verdict (:meth:`KubernetesProvider.quarantine`): the job's next pods
get node anti-affinity to the machine it ran on (``kubernetes.io/hostname NotIn [...]`` added to
every nodeSelectorTerm; needs no rights on nodes), and the node is cordoned like ``kubectl
cordon`` with the verdict in its ``sftctl.dev/cordon-reason`` annotation when the user may patch
nodes; a 403 leaves the anti-affinity alone and says so in the job's events.

Failure mapping: a pod that stays unscheduled (``PodScheduled=False``, e.g. ``Insufficient
nvidia.com/gpu``) longer than ``pending_timeout_s`` is deleted and raises a
:class:`CapacityError` of scope ``offering``; a ResourceQuota's ``exceeded quota`` (403) one of
scope ``region`` (the context); 401 and other 403s a :class:`CredentialsError`; 429 is retried
with :func:`retry_throttled`; 409 AlreadyExists on create is taken as done (idempotent).

The ``kubernetes`` package is imported inside the functions, never at module import.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import threading
import time

from sftctl import settings, templates
from sftctl.catalog import Offering
from sftctl.catalog.identity import from_node_labels, kubernetes_labels
from sftctl.errors import CapacityError, CredentialsError, ProviderError
from sftctl.types import KubernetesHandle
from sftctl.providers.cloud import (
    JOB_LABEL,
    MANAGED_LABEL,
    NODE_LABEL,
    READY_TIMEOUT_S,
    CloudProvider,
    InstanceRequest,
    InstanceState,
    label_value,
    labels,
    retry_throttled,
)

#: How long a pod may stay unscheduled before its offering counts as out of capacity.
PENDING_TIMEOUT_S = 300.0

#: torchrun's default rendezvous port (``--master-port``), served by rank 0's pod.
MASTER_PORT = 29500

#: Where the bootstrap ConfigMap is mounted in the container, and its key (the file name).
BOOTSTRAP_DIR = "/etc/sftctl/bootstrap"
BOOTSTRAP_KEY = "bootstrap.sh"

#: The container image when neither the spec nor the constructor names one, per GPU vendor.
#: NGC's monthly PyTorch release (CUDA, NCCL, torch) and ROCm's PyTorch image.
DEFAULT_IMAGES = {
    "nvidia": "nvcr.io/nvidia/pytorch:24.08-py3",
    "amd": "rocm/pytorch:latest",
    "cpu": "python:3.11-slim",
}

#: What a pod runs when it is given no bootstrap: nothing, until sftctl deletes it.
IDLE_BOOTSTRAP = "#!/usr/bin/env bash\n# sftctl: no bootstrap was given; hold the node until sftctl deletes it\nexec sleep infinity\n"

GFD_PRODUCT = "nvidia.com/gpu.product"
GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"
KARPENTER_GPU_NAME = "karpenter.k8s.aws/instance-gpu-name"
KARPENTER_GPU_MEMORY = "karpenter.k8s.aws/instance-gpu-memory"
AMD_PRODUCT = "amd.com/gpu.product-name"
AMD_DEVICE_ID = "amd.com/gpu.device-id"

#: The node label the kubelet sets to the node's hostname (Kubernetes documentation, "Well-Known
#: Labels, Annotations and Taints"): replacement pods avoid a bad machine by it.
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: Annotations sftctl writes on a node it cordons: the verdict, who cordoned it, and when (UTC).
CORDON_REASON = "sftctl.dev/cordon-reason"
CORDONED_BY = "sftctl.dev/cordoned-by"
CORDONED_AT = "sftctl.dev/cordoned-at"

GPU_RESOURCES = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}

#: Node pool labels, in the order an offering's ``instance_type`` is taken from them.
POOL_LABELS = ("cloud.google.com/gke-nodepool", "eks.amazonaws.com/nodegroup", "karpenter.sh/nodepool",
               "kubernetes.azure.com/agentpool")

#: Labels of spot / preemptible nodes (GKE, Karpenter, EKS managed node groups), preferred for spot.
SPOT_LABELS = (("cloud.google.com/gke-spot", "true"), ("karpenter.sh/capacity-type", "spot"),
               ("eks.amazonaws.com/capacityType", "SPOT"))

_HINT = "set KUBECONFIG or run `kubectl config use-context CONTEXT` (or SFTCTL_K8S_CONTEXT)"


# -------------------------------------------------------------------- names and labels


def dns_label(value: str, max_len: int = 63, prefix: str = "") -> str:
    """``prefix + value`` as an RFC 1123 DNS label (lowercase alphanumerics and ``-``, <= ``max_len``).

    Too long a name is cut and given a short hash of the whole, so two long ids stay distinct.
    """
    raw = prefix + value
    v = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-") or "x"
    if len(v) > max_len:
        v = v[: max_len - 9].rstrip("-") + "-" + hashlib.sha256(raw.encode()).hexdigest()[:8]
    return v


def names(job_id: str, node_id: str, rank: int) -> dict[str, str]:
    """The object names of one node of a job (see the module docstring)."""
    service = dns_label(job_id, prefix="sftctl-")  # an RFC 1035 label: the prefix makes it start with a letter
    pod = dns_label(node_id)
    return {
        "service": service,
        "secret": dns_label(job_id, max_len=253, prefix="sftctl-") + "-env",
        "pod": pod,
        "configmap": pod + "-bootstrap",
        "hostname": f"rank-{rank}",
    }


def node_selector_terms(accelerator: str) -> list[list[tuple[str, list[str]]]]:
    """The OR'ed nodeSelectorTerms (each an AND of ``(label, values)``) that select ``accelerator``.

    Raises:
        ProviderError: an accelerator whose node labels sftctl does not know.
    """
    entry = _gpu_entry(accelerator)
    if entry is None:
        raise ProviderError(f"kubernetes: no node labels known for accelerator {accelerator!r}",
                            hint=f"known: {', '.join(kubernetes_labels())}, cpu (the identity column of "
                                 "sftctl/catalog/accelerators.yaml names each GPU's labels)")
    name, table = entry
    terms = [[(key, table[key])] for key in (GFD_PRODUCT, GKE_ACCELERATOR, AMD_PRODUCT, AMD_DEVICE_ID) if key in table]
    if KARPENTER_GPU_NAME in table:
        term = [(KARPENTER_GPU_NAME, table[KARPENTER_GPU_NAME])]
        if KARPENTER_GPU_MEMORY in table:
            term.append((KARPENTER_GPU_MEMORY, table[KARPENTER_GPU_MEMORY]))
        terms.append(term)
    return terms


def _gpu_entry(accelerator: str) -> tuple[str, dict] | None:
    for name, table in kubernetes_labels().items():
        if name.lower() == accelerator.lower():
            return name, table
    return None


def node_accelerator(node: dict) -> tuple[str, str, int]:
    """What a node (an API ``Node`` as a dict) offers: ``(accelerator, label value, GPUs)``.

    ``accelerator`` is a catalog name (``H100``), ``"cpu"`` for a node without GPUs, or ``""`` for
    GPUs sftctl cannot name; ``label value`` the product label it was read from; ``GPUs`` the
    node's allocatable ``nvidia.com/gpu`` or ``amd.com/gpu``.
    """
    node_labels = (node.get("metadata") or {}).get("labels") or {}
    alloc = (node.get("status") or {}).get("allocatable") or {}
    gpus = {vendor: int(_quantity(alloc.get(res, "0"))) for vendor, res in GPU_RESOURCES.items()}
    if not any(gpus.values()):
        return "cpu", "", 0
    vendor = "nvidia" if gpus["nvidia"] else "amd"
    keys = (GFD_PRODUCT, GKE_ACCELERATOR, KARPENTER_GPU_NAME) if vendor == "nvidia" else (AMD_PRODUCT, AMD_DEVICE_ID)
    found = from_node_labels(node_labels, keys, memory_label=KARPENTER_GPU_MEMORY, name_label=KARPENTER_GPU_NAME)
    name, value = found if found is not None else ("", "")
    return name, value, gpus[vendor]


_QUANTITY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
                    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                    "P": 1e15, "E": 1e18}


def _quantity(value) -> float:
    """A Kubernetes resource quantity (``8``, ``95500m``, ``1056Gi``) as a number; 0 if unreadable."""
    m = re.fullmatch(r"\s*([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)\s*", str(value))
    if not m or m.group(2) not in _QUANTITY_SUFFIX:
        return 0.0
    return float(m.group(1)) * _QUANTITY_SUFFIX[m.group(2)]


# -------------------------------------------------------------------- templates


def render(name: str, **context) -> str:
    """Render ``sftctl/templates/k8s/<name>`` (YAML text); a missing variable raises an error."""
    return templates.render(f"k8s/{name}", **context)


def manifest(name: str, **context) -> dict:
    """Render template ``name`` and load it (``yaml.safe_load``): the object to send to the API."""
    import yaml

    return yaml.safe_load(render(name, **context))


def node_manifests(request: InstanceRequest, *, namespace: str, secrets: dict[str, str] | None = None,
                   image: str | None = None, num_nodes: int | None = None,
                   avoid_hosts: list[str] | None = None) -> dict[str, dict]:
    """The objects of one node: ``{"secret": ..., "service": ..., "configmap": ..., "pod": ...}``.

    ``secret`` is None when there are no secrets. ``avoid_hosts``: ``kubernetes.io/hostname``
    values the pod must not run on (machines a health verdict took out of the job), added as a
    ``NotIn`` requirement to every nodeSelectorTerm. Pure: renders, calls no API.
    """
    n = names(request.job_id, request.node_id, request.rank)
    accelerator = request.offering.accelerator
    job_labels = labels(request.job_id)
    node_labels = request.labels or labels(request.job_id, request.node_id)
    if accelerator.lower() == "cpu":
        vendor, gpus, terms = "cpu", 0, []
    else:
        entry = _gpu_entry(accelerator)
        vendor = entry[1]["vendor"] if entry else "nvidia"
        gpus, terms = request.offering.count, node_selector_terms(accelerator)
    gpu_resource = GPU_RESOURCES.get(vendor) if gpus else None
    master = f"rank-0.{n['service']}"  # rank 0's hostname (see names) in the job's Service
    env = {
        "SFTCTL_JOB_ID": request.job_id,
        "SFTCTL_NODE_ID": request.node_id,
        "SFTCTL_NODE_RANK": str(request.rank),
        "NODE_RANK": str(request.rank),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(MASTER_PORT),
        "NPROC_PER_NODE": str(max(1, request.offering.count)),
    }
    if num_nodes:
        env.update(NNODES=str(num_nodes), SFTCTL_NUM_NODES=str(num_nodes))
    common = dict(job_id=request.job_id, node_id=request.node_id, rank=request.rank, namespace=namespace,
                  master_port=MASTER_PORT, **n)
    secret = None
    if secrets:
        secret = manifest("secret.yaml.j2", labels=job_labels, data=secrets, **common)
    return {
        "secret": secret,
        "service": manifest("service.yaml.j2", labels=job_labels,
                            selector={MANAGED_LABEL: "true", JOB_LABEL: job_labels[JOB_LABEL]}, **common),
        "configmap": manifest("configmap.yaml.j2", labels=node_labels, bootstrap_key=BOOTSTRAP_KEY,
                              bootstrap=request.bootstrap or IDLE_BOOTSTRAP, **common),
        "pod": manifest(
            "pod.yaml.j2", labels=node_labels, accelerator=accelerator, env=env,
            image=request.image or image or DEFAULT_IMAGES[vendor],
            # a GPU limit is also the request (extended resources); a CPU node asks one core per process
            limits={gpu_resource: str(gpus)} if gpu_resource else {},
            requests={} if gpu_resource else {"cpu": str(max(1, request.offering.count))},
            node_selector_terms=terms, avoid_hosts=sorted(avoid_hosts or []), hostname_label=HOSTNAME_LABEL,
            tolerations=[gpu_resource] if gpu_resource else [],
            spot=request.spot, spot_labels=SPOT_LABELS, bootstrap_dir=BOOTSTRAP_DIR, bootstrap_key=BOOTSTRAP_KEY,
            secret=n["secret"] if secrets else None, **{k: v for k, v in common.items() if k != "secret"},
        ),
    }


# -------------------------------------------------------------------- API errors


#: Labels of a controller's Job, its pod and its Secret (never ``sftctl-managed``/``sftctl-job``:
#: the job's node sweeps, :meth:`KubernetesProvider.terminate_tagged` and ``list_instances``, must
#: not take the controller for a node)
CONTROLLER_ROLE_LABEL = "sftctl-role"
CONTROLLER_OF_LABEL = "sftctl-controller-of"
#: where the controller's pod keeps its SFTCTL_HOME (an emptyDir: the job dir, its log)
CONTROLLER_HOME = "/var/lib/sftctl"


def controller_names(job_id: str) -> dict[str, str]:
    """The names of ``job_id``'s controller Job and its Secret (DNS labels)."""
    job = dns_label(job_id, prefix="sftctl-ctl-", max_len=52)  # the Job controller's pod suffix fits 63
    return {"job": job, "secret": f"{job}-env"}


def controller_manifests(job_id: str, argv: list[str], *, namespace: str, env: dict[str, str],
                         secret_env: dict[str, str], image: str) -> dict:
    """The batch/v1 Job (one pod, ``restartPolicy: Never``, ``backoffLimit: 0``: a controller
    that dies is the state's to see, never run twice at once) running ``argv`` with ``env`` and
    the Secret (``secret_env``, base64, read through ``envFrom``; None when empty) of ``job_id``'s
    controller. Returns ``{"job": dict, "secret": dict | None}``; values never appear in the Job."""
    import base64

    n = controller_names(job_id)
    lab = {CONTROLLER_ROLE_LABEL: "controller", CONTROLLER_OF_LABEL: label_value(job_id)}
    ann = {"sftctl.dev/job-id": job_id}
    secret = None if not secret_env else {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": n["secret"], "namespace": namespace, "labels": lab, "annotations": ann},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(secret_env.items())}}
    container = {
        "name": "controller", "image": image, "command": list(argv),
        "env": [{"name": k, "value": v} for k, v in sorted({**env, "SFTCTL_HOME": CONTROLLER_HOME}.items())],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": [{"name": "sftctl-home", "mountPath": CONTROLLER_HOME}]}
    if secret is not None:
        container["envFrom"] = [{"secretRef": {"name": n["secret"]}}]
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": n["job"], "namespace": namespace, "labels": lab, "annotations": ann},
        "spec": {"backoffLimit": 0, "template": {
            "metadata": {"labels": lab, "annotations": ann},
            "spec": {"restartPolicy": "Never", "containers": [container],
                     "volumes": [{"name": "sftctl-home", "emptyDir": {}}]}}}}
    return {"job": job, "secret": secret}


def _status_message(e) -> str:
    """The one-line message of an ``ApiException`` (its ``Status`` body's message when there is one)."""
    text = ""
    try:
        body = json.loads(e.body or "")
        text = body.get("message") or body.get("reason") or ""
    except (TypeError, ValueError, AttributeError):
        text = (e.body or "") if isinstance(e.body, str) else ""
    text = text or str(e.reason or "")
    return " ".join(str(text).split())[:500]


def _is_throttle(e: BaseException) -> bool:
    """Whether ``e`` is the API server's 429 TooManyRequests (API Priority and Fairness)."""
    from kubernetes.client.exceptions import ApiException

    return isinstance(e, ApiException) and e.status == 429


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


class KubernetesProvider(CloudProvider):
    """Nodes as pods on a Kubernetes cluster. See the module docstring.

    Args:
        channel, poll_s, ready_timeout_s: as for :class:`CloudProvider`.
        context: the kubeconfig context (default: ``SFTCTL_K8S_CONTEXT``, else the current context).
        namespace: where the objects go (default: ``SFTCTL_K8S_NAMESPACE``, else the context's
            namespace, else ``default``).
        pending_timeout_s: how long a pod may stay unscheduled before its offering counts as out
            of capacity (:class:`CapacityError`, scope ``offering``).
        image: the container image when the spec names none (default :data:`DEFAULT_IMAGES`).
        api_client: a ready ``kubernetes.client.ApiClient`` (instead of the kubeconfig).
        kubeconfig: a kubeconfig path (default: ``KUBECONFIG``, else ``~/.kube/config``; in a pod
            without one, the in-cluster service account).
        prices: USD per accelerator-hour by ``instance_type`` or accelerator name (a cluster's
            internal chargeback rate); an offering costs rate x count. Unpriced: 0.0.
        secrets: environment variables for every pod of a job, delivered through a Secret
            (``envFrom``); a request's own ``secrets`` attribute, when it has one, is added.
        num_nodes: the job's node count for ``NNODES`` (a request's ``num_nodes`` wins).
    """

    name = "kubernetes"
    handle_type = KubernetesHandle

    def __init__(self, channel=None, poll_s: float = 2.0, ready_timeout_s: float = READY_TIMEOUT_S,
                 context: str | None = None, namespace: str | None = None,
                 pending_timeout_s: float = PENDING_TIMEOUT_S, image: str | None = None, api_client=None,
                 kubeconfig: str | None = None, prices: dict[str, float] | None = None,
                 secrets: dict[str, str] | None = None, num_nodes: int | None = None, **_):
        super().__init__(channel=channel, poll_s=poll_s, ready_timeout_s=ready_timeout_s)

        self.context = context or settings.get("SFTCTL_K8S_CONTEXT")
        self._namespace = namespace or settings.get("SFTCTL_K8S_NAMESPACE")
        self.pending_timeout_s = pending_timeout_s
        self.image = image
        self.kubeconfig = kubeconfig
        self.prices = dict(prices or {})
        self.secrets = dict(secrets or {})
        self.num_nodes = num_nodes
        self._api_client = api_client
        self._region = self.context or ("cluster" if api_client is not None else None)
        self._lock = threading.Lock()
        self._job_locks: dict[tuple[str, str], threading.Lock] = {}
        self._job_objects: set[tuple[str, str]] = set()  # (namespace, job) whose Service/Secret exist
        self.avoid_hosts: dict[str, set[str]] = {}  # job -> hostnames its next pods avoid (quarantine)

    # ---------------------------------------------------------------- configuration

    def _client(self):
        """The ``ApiClient`` (built once from the kubeconfig or the in-cluster service account)."""
        with self._lock:
            if self._api_client is None:
                self._api_client = self._load_config()
            return self._api_client

    def _load_config(self):
        from kubernetes import client, config

        path = self.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        paths = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
        if any(os.path.isfile(p) for p in paths):
            joined = os.pathsep.join(paths)
            try:
                contexts, active = config.list_kube_config_contexts(config_file=joined)
                wanted = self.context or (active or {}).get("name")
                chosen = next((c for c in contexts or [] if c.get("name") == wanted), None)
                if chosen is None:
                    known = ", ".join(c.get("name", "?") for c in contexts or []) or "none"
                    raise CredentialsError(f"kubernetes: context {wanted!r} is not in the kubeconfig {path} "
                                           f"(contexts: {known})", hint=_HINT)
                configuration = client.Configuration()
                config.load_kube_config(config_file=joined, context=wanted, client_configuration=configuration,
                                        persist_config=False)
            except CredentialsError:
                raise
            except Exception as e:  # ConfigException, YAML errors, a file that is not a kubeconfig
                raise CredentialsError(f"kubernetes: the kubeconfig {path} is not usable: {_one_line(e)}",
                                       hint=_HINT) from None
            self.context = wanted
            self._region = wanted
            if self._namespace is None:
                self._namespace = (chosen.get("context") or {}).get("namespace") or None
            return client.ApiClient(configuration)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            configuration = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=configuration)
            except Exception as e:
                raise CredentialsError(f"kubernetes: the in-cluster service account is not usable: {_one_line(e)}",
                                       hint=_HINT) from None
            self._region = self._region or "cluster"
            if self._namespace is None:
                ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
                if os.path.isfile(ns_file):
                    self._namespace = open(ns_file).read().strip() or None
            return client.ApiClient(configuration)
        raise CredentialsError(f"kubernetes: no kubeconfig at {path} and not running in a cluster", hint=_HINT)

    @property
    def namespace(self) -> str:
        self._client()
        return self._namespace or "default"

    @property
    def region(self) -> str:
        """The offerings' region: the kubeconfig context's name, or ``cluster``."""
        self._client()
        return self._region or "cluster"

    def _core(self):
        from kubernetes import client

        return client.CoreV1Api(self._client())

    # ---------------------------------------------------------------- API calls

    def _call(self, what: str, fn, *args, allow: tuple[int, ...] = (), offering: Offering | None = None, **kw):
        """``fn(*args, **kw)`` with 429 retried; an API error as an sftctl error.

        Returns None when the API answered with a status in ``allow`` (404 on delete, 409 on create).
        """
        from kubernetes.client.exceptions import ApiException

        kw.setdefault("_preload_content", False)  # raw JSON: no model parsing, any client version
        call = retry_throttled(_is_throttle)(fn)
        try:
            return call(*args, **kw)
        except ApiException as e:
            if e.status in allow:
                return None
            raise self._error(e, what, offering) from None
        except (CredentialsError, ProviderError):
            raise
        except Exception as e:  # urllib3: connection refused, DNS, TLS
            if type(e).__module__.startswith(("urllib3", "ssl", "socket")) or isinstance(e, OSError):
                host = getattr(getattr(self._client(), "configuration", None), "host", "?")
                raise ProviderError(f"kubernetes: cannot reach the API server at {host} ({what}): {_one_line(e)}",
                                    hint=_HINT) from None
            raise

    def _json(self, what: str, fn, *args, allow: tuple[int, ...] = (), **kw) -> dict | None:
        """Like :meth:`_call` for a read, answering the raw JSON (camelCase dicts, any client version)."""
        resp = self._call(what, fn, *args, allow=allow, **kw)
        return None if resp is None else json.loads(resp.data or b"{}")

    def _error(self, e, what: str, offering: Offering | None = None) -> Exception:
        message = _status_message(e)
        where = f"context {self._region}" if self._region else "the cluster"
        if e.status == 401:
            return CredentialsError(f"kubernetes: {where} rejected the credentials ({what}: 401 Unauthorized)",
                                    hint=_HINT + "; refresh an expired token")
        if e.status == 403 and "exceeded quota" in message:
            return CapacityError(
                f"kubernetes: {what}: {message}", provider=self.name, scope="region", region=self.region,
                instance_type=offering.instance_type if offering else None, code="ExceededQuota",
                hint="a ResourceQuota of the namespace is used up: free GPUs or raise the quota")
        if e.status == 403:
            return CredentialsError(f"kubernetes: {what} forbidden in namespace {self.namespace}: {message}",
                                    hint="grant the user RBAC rights on pods, services, configmaps, secrets "
                                         "(and nodes: list, patch), or " + _HINT)
        if e.status == 429:
            return ProviderError(f"kubernetes: {what}: still throttled (429) after retries: {message}",
                                 hint="the API server is overloaded; retry later")
        return ProviderError(f"kubernetes: {what} failed ({e.status} {e.reason}): {message}",
                             hint="see the message; `kubectl get events` may say more")

    # ---------------------------------------------------------------- the CloudProvider half

    def check(self) -> None:
        """Load the configuration and make one authenticated call (list pods, limit 1).

        Raises:
            CredentialsError: no or an invalid kubeconfig, a missing context, 401 or 403.
            ProviderError: the API server cannot be reached.
        """
        self._call("list pods", self._core().list_namespaced_pod, self.namespace, limit=1)

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """One offering per node pool (or GPU product) with a node of >= ``count`` ``accelerator``.

        ``accelerator`` ``cpu`` is offered by ready nodes without GPUs with >= ``count`` CPUs.
        Cordoned and NotReady nodes are left out. Prices come from the constructor's ``prices``.
        """
        items = (self._json("list nodes", self._core().list_node) or {}).get("items") or []
        best: dict[str, dict] = {}
        for node in items:
            if (node.get("spec") or {}).get("unschedulable") or not _ready(node):
                continue
            name, product, gpus = node_accelerator(node)
            alloc = (node.get("status") or {}).get("allocatable") or {}
            node_labels = (node.get("metadata") or {}).get("labels") or {}
            if accelerator.lower() == "cpu":
                if name != "cpu" or _quantity(alloc.get("cpu", "0")) < count:
                    continue
            elif name.lower() != accelerator.lower() or gpus < count:
                continue
            pool = next((node_labels[k] for k in POOL_LABELS if node_labels.get(k)), None)
            instance_type = pool or product or node_labels.get("node.kubernetes.io/instance-type") or "cpu"
            seen = best.get(instance_type)
            if seen is None or _quantity(alloc.get("cpu", "0")) > seen["cpu"]:
                best[instance_type] = {"name": name, "cpu": _quantity(alloc.get("cpu", "0")),
                                       "memory": _quantity(alloc.get("memory", "0"))}
        out = []
        for instance_type, info in sorted(best.items()):
            rate = self.prices.get(instance_type, self.prices.get(info["name"], 0.0))
            price = float(rate) * count
            out.append(Offering(
                provider=self.name, instance_type=instance_type, accelerator=info["name"], count=count,
                region=self.region, usd_per_hour=price, spot_usd_per_hour=price,
                vcpus=int(info["cpu"]) or None, memory_gib=round(info["memory"] / 2**30, 1) or None,
                source=f"kubernetes node labels and allocatable resources ({self.region})"
                       + ("; price from the sftctl price table" if rate else "; no price given: $0/h"),
                as_of=datetime.date.today().isoformat(),
            ))
        return out

    def zones(self, region: str) -> list[str | None]:
        """A cluster has no zones sftctl chooses: one pass, zone None."""
        return [None]

    def create_instance(self, request: InstanceRequest) -> KubernetesHandle:
        """Create the job's Secret and Service (once per job), then the node's ConfigMap and Pod.

        Raises:
            CapacityError: a ResourceQuota is used up (scope ``region``).
            CredentialsError, ProviderError: see :meth:`_error`.
        """
        ns = self.namespace
        secrets = {**self.secrets, **(getattr(request, "secrets", None) or {})}
        num_nodes = getattr(request, "num_nodes", None) or self.num_nodes
        with self._lock:
            avoid = sorted(self.avoid_hosts.get(request.job_id, ()))
        objs = node_manifests(request, namespace=ns, secrets=secrets, image=self.image, num_nodes=num_nodes,
                              avoid_hosts=avoid)
        core = self._core()
        self._ensure_job_objects(request, ns, objs)
        pod, cm = objs["pod"]["metadata"]["name"], objs["configmap"]["metadata"]["name"]
        self._call(f"create configmap {cm}", core.create_namespaced_config_map, ns, objs["configmap"],
                   allow=(409,), offering=request.offering)
        try:
            self._call(f"create pod {pod}", core.create_namespaced_pod, ns, objs["pod"], allow=(409,),
                       offering=request.offering)
        except Exception:  # leave nothing behind: the ConfigMap, and the job's objects if no pod uses them
            try:
                self._call(f"delete configmap {cm}", core.delete_namespaced_config_map, cm, ns, allow=(404,))
                self._release_job_objects(ns, request.job_id, pod)
            except Exception:  # best effort: the create's error is the one to report (terminate_tagged sweeps)
                pass
            raise
        n = names(request.job_id, request.node_id, request.rank)
        return KubernetesHandle(
            job_id=request.job_id, node_id=request.node_id, rank=request.rank,
            id=pod, pod=pod, configmap=cm, service=n["service"],
            secret=n["secret"] if secrets else None, namespace=ns, context=self._region,
            hostname=n["hostname"], ip=f"{n['hostname']}.{n['service']}",
            region=request.offering.region, instance_type=request.offering.instance_type,
            accelerator=request.offering.accelerator,
        )

    def _ensure_job_objects(self, request: InstanceRequest, ns: str, objs: dict) -> None:
        """Create the job's Secret and Service unless this provider already did (409 is fine)."""
        key = (ns, request.job_id)
        with self._lock:
            lock = self._job_locks.setdefault(key, threading.Lock())
        with lock:
            if key in self._job_objects:
                return
            core = self._core()
            if objs["secret"] is not None:
                name = objs["secret"]["metadata"]["name"]
                made = self._call(f"create secret {name}", core.create_namespaced_secret, ns, objs["secret"],
                                  allow=(409,), offering=request.offering)
                if made is None:  # left by an earlier run: bring its values up to date
                    self._call(f"patch secret {name}", core.patch_namespaced_secret, name, ns,
                               {"data": objs["secret"]["data"]}, offering=request.offering)
            svc = objs["service"]["metadata"]["name"]
            self._call(f"create service {svc}", core.create_namespaced_service, ns, objs["service"],
                       allow=(409,), offering=request.offering)
            self._job_objects.add(key)

    def _read_pod(self, handle: KubernetesHandle) -> dict | None:
        """The pod of ``handle`` as the API's JSON, or None when it is gone."""
        return self._json(f"read pod {handle.pod}", self._core().read_namespaced_pod, handle.pod,
                          handle.namespace or self.namespace, allow=(404,))

    def describe(self, handle: KubernetesHandle) -> InstanceState:
        """Pending -> PENDING; Running -> RUNNING; Succeeded, Failed, Unknown or being deleted ->
        STOPPING; not found -> GONE. (An unschedulable pod fails in :meth:`wait_ready`.)"""
        return _pod_state(self._read_pod(handle))

    def wait_ready(self, handle: KubernetesHandle) -> KubernetesHandle:
        """Poll the pod until it runs; return the handle with ``node_name`` and ``pod_ip``.

        Raises:
            CapacityError: the pod stayed unscheduled longer than ``pending_timeout_s`` (scope
                ``offering``; the pod is deleted first), so the controller fails over.
            ProviderError: the pod ended or vanished while starting, could not start its
                container, or did not run within ``ready_timeout_s`` (deleted first).
        """
        start = time.monotonic()
        while True:
            pod = self._read_pod(handle)
            state = _pod_state(pod)
            if state == InstanceState.RUNNING:
                return handle.with_(node_name=pod["spec"].get("nodeName"),
                                    pod_ip=(pod.get("status") or {}).get("podIP"))
            waited = time.monotonic() - start
            why = None
            if state != InstanceState.PENDING:
                why = f"stopped while starting ({_pod_detail(pod)})"
            elif _fatal_wait(pod):
                why = f"could not start its container ({_fatal_wait(pod)})"
            elif not (pod.get("spec") or {}).get("nodeName") and waited > self.pending_timeout_s:
                self.delete_instance(handle)
                message = _unschedulable(pod) or "no scheduling decision yet"
                raise CapacityError(
                    f"kubernetes: pod {handle.pod} was not scheduled within {self.pending_timeout_s:g} s: {message}",
                    provider=self.name, scope="offering", region=handle.region or self.region,
                    instance_type=handle.instance_type, code="Unschedulable",
                    hint="the cluster has no node with enough free GPUs of this kind; sftctl deleted the pod",
                )
            elif waited > self.ready_timeout_s:
                why = f"was not running after {self.ready_timeout_s:g} s ({_pod_detail(pod)})"
            if why is not None:
                self.delete_instance(handle)
                raise ProviderError(f"kubernetes: pod {handle.pod} {why}",
                                    hint="sftctl deleted it; `kubectl describe pod` of a rerun says more")
            time.sleep(self.poll_s)

    def delete_instance(self, handle: KubernetesHandle) -> None:
        """Delete the node's pod and ConfigMap (already gone is fine); with the job's last pod,
        its Service and Secret too."""
        ns = handle.namespace or self.namespace
        core = self._core()
        pod = handle.pod or handle.id
        self._call(f"delete pod {pod}", core.delete_namespaced_pod, pod, ns, allow=(404,))
        cm = handle.configmap or f"{pod}-bootstrap"
        self._call(f"delete configmap {cm}", core.delete_namespaced_config_map, cm, ns, allow=(404,))
        if handle.job_id:
            self._release_job_objects(ns, handle.job_id, pod, handle.service, handle.secret)

    def _release_job_objects(self, ns: str, job_id: str, gone_pod: str, service: str | None = None,
                             secret: str | None = None) -> None:
        """Delete the job's Service and Secret when no pod of the job but ``gone_pod`` is left."""
        core = self._core()
        selector = f"{MANAGED_LABEL}=true,{JOB_LABEL}={label_value(job_id)}"
        pods = (self._json("list pods", core.list_namespaced_pod, ns, label_selector=selector) or {}).get("items") or []
        if any(p["metadata"]["name"] != gone_pod and not p["metadata"].get("deletionTimestamp") for p in pods):
            return
        key = (ns, job_id)
        with self._lock:
            lock = self._job_locks.setdefault(key, threading.Lock())
        with lock:
            self._job_objects.discard(key)
            n = names(job_id, "", 0)
            self._call(f"delete service {n['service']}", core.delete_namespaced_service, service or n["service"], ns,
                       allow=(404,))
            self._call(f"delete secret {n['secret']}", core.delete_namespaced_secret, secret or n["secret"], ns,
                       allow=(404,))

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """The sftctl pods of the namespace (of ``job_id`` when given), each a dict with the keys
        of a :class:`KubernetesHandle` (``rank`` None where the pod does not say) and ``state``."""
        ns = self.namespace
        selector = f"{MANAGED_LABEL}=true" + (f",{JOB_LABEL}={label_value(job_id)}" if job_id else "")
        items = (self._json("list pods", self._core().list_namespaced_pod, ns, label_selector=selector)
                 or {}).get("items") or []
        out = []
        for pod in items:
            meta = pod["metadata"]
            lab, ann = meta.get("labels") or {}, meta.get("annotations") or {}
            out.append({
                "id": meta["name"], "pod": meta["name"], "namespace": meta.get("namespace") or ns,
                "configmap": f"{meta['name']}-bootstrap",
                "job_id": ann.get("sftctl.dev/job-id") or lab.get(JOB_LABEL),
                "node_id": ann.get("sftctl.dev/node-id") or lab.get(NODE_LABEL),
                "rank": int(ann["sftctl.dev/rank"]) if str(ann.get("sftctl.dev/rank", "")).isdigit() else None,
                "node_name": (pod.get("spec") or {}).get("nodeName"),
                "state": _pod_state(pod).value,
            })
        return out

    def terminate_tagged(self, job_id: str) -> int:
        """Delete the job's pods, ConfigMaps, Services and Secrets; return how many there were."""
        ns = self.namespace
        core = self._core()
        selector = f"{MANAGED_LABEL}=true,{JOB_LABEL}={label_value(job_id)}"
        kinds = (("pods", core.list_namespaced_pod, core.delete_namespaced_pod),
                 ("configmaps", core.list_namespaced_config_map, core.delete_namespaced_config_map),
                 ("services", core.list_namespaced_service, core.delete_namespaced_service),
                 ("secrets", core.list_namespaced_secret, core.delete_namespaced_secret))
        count = 0
        for kind, list_fn, delete_fn in kinds:
            items = (self._json(f"list {kind}", list_fn, ns, label_selector=selector) or {}).get("items") or []
            for obj in items:
                name = obj["metadata"]["name"]
                self._call(f"delete {kind} {name}", delete_fn, name, ns, allow=(404,))
                count += 1
        with self._lock:
            self._job_objects.discard((ns, job_id))
        return count

    # ---------------------------------------------------------------- a job's controller (controller.place)

    def _batch(self):
        from kubernetes import client

        return client.BatchV1Api(self._client())

    def submit_controller(self, job_id: str, argv: list[str], *, env: dict[str, str],
                          secret_env: dict[str, str], image: str | None = None) -> str:
        """Create the Secret (``secret_env``) and the batch/v1 Job of ``job_id``'s controller
        (:func:`controller_manifests`) in the namespace; return the Job's name. A Job or Secret
        that already exists (409) is taken as this one (idempotent).

        Raises:
            CredentialsError, ProviderError: see :meth:`_error` (exit 4).
        """
        ns = self.namespace
        objs = controller_manifests(job_id, argv, namespace=ns, env=env, secret_env=secret_env,
                                    image=image or self.image or DEFAULT_IMAGES["cpu"])
        name = objs["job"]["metadata"]["name"]
        if objs["secret"] is not None:
            self._call(f"create secret {objs['secret']['metadata']['name']}", self._core().create_namespaced_secret,
                       ns, objs["secret"], allow=(409,))
        self._call(f"create job {name}", self._batch().create_namespaced_job, ns, objs["job"], allow=(409,))
        return name

    def controller_jobs(self, job_id: str | None = None) -> list[dict]:
        """The controller Jobs of the namespace (of ``job_id`` only when given):
        ``[{"id", "job_id", "state", "name"}]`` (state: ``active``, ``succeeded``, ``failed``)."""
        selector = CONTROLLER_ROLE_LABEL + "=controller" + (
            f",{CONTROLLER_OF_LABEL}={label_value(job_id)}" if job_id is not None else "")
        items = (self._json("list jobs", self._batch().list_namespaced_job, self.namespace, label_selector=selector)
                 or {}).get("items") or []
        out = []
        for job in items:
            meta, st = job["metadata"], job.get("status") or {}
            state = "succeeded" if st.get("succeeded") else "failed" if st.get("failed") else "active"
            out.append({"id": meta["name"], "name": meta["name"], "state": state,
                        "job_id": (meta.get("annotations") or {}).get("sftctl.dev/job-id")})
        return out

    def cancel_controller(self, job_id: str, grace_s: float = 20.0) -> list[str]:
        """Delete ``job_id``'s controller Job(s) (propagation ``Background``: its pod gets SIGTERM
        and ``grace_s`` seconds, so the controller cancels the job and stops its nodes) and their
        Secret. Returns the names of the Jobs it found."""
        ns = self.namespace
        found = [f["id"] for f in self.controller_jobs(job_id)]
        for name in found:
            self._call(f"delete job {name}", self._batch().delete_namespaced_job, name, ns, allow=(404,),
                       propagation_policy="Background", grace_period_seconds=max(0, int(grace_s)))
        secret = controller_names(job_id)["secret"]
        self._call(f"delete secret {secret}", self._core().delete_namespaced_secret, secret, ns, allow=(404,))
        return found

    def cordon(self, node_name, reason: str | None = None, by: str | None = None) -> dict | None:
        """Mark a cluster node unschedulable (``kubectl cordon``): a node judged bad gets no new pods.

        ``node_name`` is the node's name, or a :class:`KubernetesHandle` whose ``node_name`` (the
        pod's ``spec.nodeName``, recorded by :meth:`wait_ready`) names it. With ``reason`` the node also
        gets the annotations :data:`CORDON_REASON` (``reason``, at most 1000 characters),
        :data:`CORDONED_BY` (``by``) and :data:`CORDONED_AT` (UTC, ISO 8601), so ``kubectl describe
        node`` says why. One strategic-merge patch; returns the patched node (API JSON), or None
        when the node is gone (404).

        Raises:
            CredentialsError: the user may not patch nodes (403) or the credentials are bad (401).
            ProviderError: the pod was never scheduled, or the API failed.
        """
        if isinstance(node_name, KubernetesHandle):
            node_name = node_name.node_name
        if not node_name:
            raise ProviderError("kubernetes: cordon needs a node name (the pod was never scheduled)")
        body: dict = {"spec": {"unschedulable": True}}
        if reason:
            at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            body["metadata"] = {"annotations": {CORDON_REASON: " ".join(reason.split())[:1000],
                                                CORDONED_BY: by or "sftctl", CORDONED_AT: at}}
        return self._json(f"cordon node {node_name}", self._core().patch_node, node_name, body, allow=(404,))

    def quarantine(self, handle: KubernetesHandle, reason: str) -> dict | None:
        """Keep the machine ``handle``'s pod ran on away from the job (called before
        :meth:`terminate` when a health verdict replaces the node; ``reason`` is the verdict).

        Always: the job's next pods get node anti-affinity to its ``kubernetes.io/hostname``
        (see :func:`node_manifests`). When the user may patch nodes: the node is cordoned with the
        verdict as :data:`CORDON_REASON` (:meth:`cordon`), so no one's pods land on it until an
        admin uncordons it. A 403 (RBAC without ``patch nodes``, usual on a shared cluster) or any
        other API error leaves the anti-affinity alone and is said in ``message``.

        Returns:
            ``{"machine": node name, "hostname": label value, "actions": ["anti-affinity",
            "cordon"?], "cordon_error": one line (when cordoning failed), "message": one line}``,
            or None when the pod was never scheduled (no machine to avoid). Raises nothing for
            API errors.
        """
        node = handle.node_name
        if not node:
            return None
        who = f"sftctl job {handle.job_id or '?'}, node {handle.node_id or '?'}"
        error = None
        try:
            obj = self.cordon(node, reason=reason, by=who)
        except (CredentialsError, ProviderError) as e:
            error, obj = e.message, self._read_node(node)
        gone = obj is None and error is None
        host = (((obj or {}).get("metadata") or {}).get("labels") or {}).get(HOSTNAME_LABEL) or node
        with self._lock:
            self.avoid_hosts.setdefault(handle.job_id or "", set()).add(host)
        avoid = f"this job's next pods avoid it ({HOSTNAME_LABEL} NotIn {host})"
        if error is not None:
            message = (f"kubernetes: could not cordon node {node} ({error}); {avoid}; a cluster admin can "
                       f"`kubectl cordon {node}`")
        elif gone:
            message = f"kubernetes: node {node} is gone; {avoid}"
        else:
            message = f"kubernetes: cordoned node {node} ({CORDON_REASON}: {reason}); {avoid}"
        out = {"machine": node, "hostname": host, "actions": ["anti-affinity"] + ([] if error or gone else ["cordon"]),
               "message": message}
        if error is not None:
            out["cordon_error"] = error
        return out

    def _read_node(self, name: str) -> dict | None:
        """The node as the API's JSON, or None when it is gone or the user may not read it."""
        try:
            return self._json(f"read node {name}", self._core().read_node, name, allow=(403, 404))
        except (CredentialsError, ProviderError):
            return None


# -------------------------------------------------------------------- pod status


def _ready(node: dict) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions) or not conditions


def _pod_state(pod: dict | None) -> InstanceState:
    if pod is None:
        return InstanceState.GONE
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return InstanceState.STOPPING
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Running":
        return InstanceState.RUNNING
    if phase in ("Succeeded", "Failed", "Unknown"):
        return InstanceState.STOPPING
    return InstanceState.PENDING


def _unschedulable(pod: dict) -> str | None:
    """The scheduler's message when the pod's PodScheduled condition is False, else None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return " ".join(str(c.get("message") or c.get("reason") or "Unschedulable").split())
    return None


def _fatal_wait(pod: dict) -> str | None:
    """A container waiting reason that no amount of waiting fixes (a bad image name, a missing
    ConfigMap or Secret), or None."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("InvalidImageName", "CreateContainerConfigError"):
            return f"{waiting['reason']}: {' '.join(str(waiting.get('message', '')).split())}".rstrip(": ")
    return None


def _pod_detail(pod: dict | None) -> str:
    if pod is None:
        return "the pod is gone"
    status = pod.get("status") or {}
    parts = [f"phase {status.get('phase', '?')}"]
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "terminated" in state:
            t = state["terminated"]
            parts.append(f"exit code {t.get('exitCode')} ({t.get('reason', '')})")
        elif "waiting" in state:
            parts.append(f"waiting: {state['waiting'].get('reason', '')}")
    message = _unschedulable(pod)
    if message:
        parts.append(message)
    return ", ".join(parts)
