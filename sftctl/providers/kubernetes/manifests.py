"""What the Kubernetes provider puts on a cluster, before any API call: the node labels that name
an accelerator (:func:`node_selector_terms`, :func:`node_accelerator`), objects' names, the
nodes' manifests from ``sftctl/templates/k8s/`` (:func:`node_manifests`) and a placed
controller's Job and Secret (:func:`controller_manifests`)."""

from __future__ import annotations

import hashlib
import re

from sftctl import templates
from sftctl.catalog.identity import from_node_labels, kubernetes_labels
from sftctl.errors import ProviderError
from sftctl.providers.cloud import (
    JOB_LABEL,
    MANAGED_LABEL,
    InstanceRequest,
    label_value,
    labels,
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
