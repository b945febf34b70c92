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

The package, split by job (ARCHITECTURE.md, "Layout"); every name is importable from
``sftctl.providers.kubernetes``: :mod:`~sftctl.providers.kubernetes.manifests` (labels, names,
the nodes' and a placed controller's manifests) and :mod:`~sftctl.providers.kubernetes.provider`
(:class:`KubernetesProvider`, API errors, pod status).
"""

import os
from collections.abc import Mapping
from pathlib import Path

from sftctl.providers.base import ProviderEntry
from sftctl.providers.kubernetes.manifests import (
    _HINT,
    _QUANTITY_SUFFIX,
    AMD_DEVICE_ID,
    AMD_PRODUCT,
    BOOTSTRAP_DIR,
    BOOTSTRAP_KEY,
    CONTROLLER_HOME,
    CONTROLLER_OF_LABEL,
    CONTROLLER_ROLE_LABEL,
    CORDON_REASON,
    CORDONED_AT,
    CORDONED_BY,
    DEFAULT_IMAGES,
    GFD_PRODUCT,
    GKE_ACCELERATOR,
    GPU_RESOURCES,
    HOSTNAME_LABEL,
    IDLE_BOOTSTRAP,
    KARPENTER_GPU_MEMORY,
    KARPENTER_GPU_NAME,
    MASTER_PORT,
    PENDING_TIMEOUT_S,
    POOL_LABELS,
    SPOT_LABELS,
    _gpu_entry,
    _quantity,
    controller_manifests,
    controller_names,
    dns_label,
    manifest,
    names,
    node_accelerator,
    node_manifests,
    node_selector_terms,
    render,
)
from sftctl.providers.kubernetes.provider import (
    KubernetesProvider,
    _fatal_wait,
    _is_throttle,
    _one_line,
    _pod_detail,
    _pod_state,
    _ready,
    _status_message,
    _unschedulable,
)

__all__ = [
    "AMD_DEVICE_ID", "AMD_PRODUCT", "BOOTSTRAP_DIR", "BOOTSTRAP_KEY", "CONTROLLER_HOME", "CONTROLLER_OF_LABEL",
    "CONTROLLER_ROLE_LABEL", "CORDONED_AT", "CORDONED_BY", "CORDON_REASON", "DEFAULT_IMAGES", "GFD_PRODUCT",
    "GKE_ACCELERATOR", "GPU_RESOURCES", "HOSTNAME_LABEL", "IDLE_BOOTSTRAP", "KARPENTER_GPU_MEMORY",
    "KARPENTER_GPU_NAME", "MASTER_PORT", "PENDING_TIMEOUT_S", "POOL_LABELS", "SPOT_LABELS", "_HINT",
    "_QUANTITY_SUFFIX", "_gpu_entry", "_quantity", "controller_manifests", "controller_names", "dns_label",
    "manifest", "names", "node_accelerator", "node_manifests", "node_selector_terms", "render",
    "KubernetesProvider", "_fatal_wait", "_is_throttle", "_one_line", "_pod_detail", "_pod_state", "_ready",
    "_status_message", "_unschedulable",
]


def configured_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """None when a kubeconfig (``$KUBECONFIG``, ``~/.kube/config``) or an in-cluster service
    account is here, else why not. No network call, no SDK import."""
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME", str(Path.home())))
    paths = env.get("KUBECONFIG", str(home / ".kube" / "config")).split(os.pathsep)
    if env.get("KUBERNETES_SERVICE_HOST") or any(p and Path(p).is_file() for p in paths):
        return None
    return "kubernetes: no kubeconfig (set KUBECONFIG or create ~/.kube/config)"


PROVIDER = ProviderEntry("kubernetes", "KubernetesProvider", sdk="kubernetes", extra="kubernetes",
                         configured=configured_reason)
