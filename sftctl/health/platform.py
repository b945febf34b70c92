"""What a platform already knows about its machines (issue 41.4): pure readers the providers call.

Kubernetes (:func:`node_problem`, :func:`unhealthy_hosts`): a node is kept out of sftctl's
offerings and of its pods' nodeAffinity (``kubernetes.io/hostname NotIn``, with the machines
sftctl's own verdicts marked bad) when

* SageMaker HyperPod labels it ``sagemaker.amazonaws.com/node-health-status`` ``Unschedulable``
  (deep health checks running), ``UnschedulablePendingReplacement`` or
  ``UnschedulablePendingReboot`` (failed checks), or ``sagemaker.amazonaws.com/
  deep-health-check-status`` ``InProgress`` / ``Failed``; only ``Schedulable`` / ``Passed`` pass
  (AWS, "Resilience-related Kubernetes labels by SageMaker HyperPod",
  docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-resiliency-node-labels.html);
* NVSentinel set a node condition of a fatal fault, ``status: "True"``: the GPU health monitor's
  ``Gpu*`` (``GpuMemWatch``, ``GpuNvlinkWatch``, ``GpuPcieWatch`` ...), the syslog monitor's
  ``SysLogs*`` (``SysLogsXIDError``, ``SysLogsGPUFallenOff`` ...), ``NVSwitchFatalError``,
  ``NVSwitchDown`` or ``CSPMaintenance``; or its fault-quarantine taints (``nvidia.com/gpu-xid-
  error``, ``nvidia.com/gpu-nvlink-error``, ``nvidia.com/syslog-xid-error``, ``nvidia.com/
  gpu-error``: its test suite's keys; any ``nvidia.com/*-error`` key) with ``NoSchedule`` or
  ``NoExecute``; or its state label ``dgxc.nvidia.com/nvsentinel-state`` in any state but
  ``remediation-succeeded`` (NVIDIA/NVSentinel ``docs/INTEGRATIONS.md``: "Is a node bad? Check
  Taints", "Standard Condition Types"; docs.nvidia.com/nvsentinel components/state-manager).
  Fatal faults set conditions, non-fatal ones only events, so a ``True`` condition is a fault,
  including on a node an operator uncordoned. ``nvidia.com/gpu`` itself (GKE's taint of every
  GPU node) is no fault.

Slurm (:func:`slurm_version`, :func:`requeue_option`): ``--requeue=expedite`` where the cluster's
Slurm is 25.11 or newer ("Expedited Requeue": the job restarts at once, first in the queue, and
its previous nodes run nothing else; Slurm 25.11 release notes, slurm.schedmd.com/news.html),
plain ``--requeue`` before. The version is ``sbatch --version``'s (``slurm 25.11.0``,
``slurm-wlm 22.05.8`` on Debian).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable, Mapping

HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
HYPERPOD_DEEP_HEALTH_LABEL = "sagemaker.amazonaws.com/deep-health-check-status"
#: the only values of those labels that let a node run work
HYPERPOD_OK = {HYPERPOD_HEALTH_LABEL: ("Schedulable",), HYPERPOD_DEEP_HEALTH_LABEL: ("Passed",)}
NVSENTINEL_STATE_LABEL = "dgxc.nvidia.com/nvsentinel-state"
NVSENTINEL_DONE = ("remediation-succeeded",)
NVSENTINEL_TAINTS = ("nvidia.com/gpu-xid-error", "nvidia.com/gpu-nvlink-error", "nvidia.com/syslog-xid-error",
                     "nvidia.com/gpu-error")
NVSENTINEL_CONDITION_PREFIXES = ("Gpu", "SysLogs")
NVSENTINEL_CONDITIONS = ("NVSwitchFatalError", "NVSwitchDown", "CSPMaintenance")
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: the first Slurm with ``--requeue=expedite``
EXPEDITE_SINCE = (25, 11)


def node_problem(node: Mapping) -> str | None:
    """Why the platform says the Kubernetes ``node`` (a V1Node as a dict) must not run work, in
    one line naming the label, taint or condition; None when it says nothing against it."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    for key, ok in HYPERPOD_OK.items():
        value = labels.get(key)
        if value is not None and value not in ok:
            return f"HyperPod: {key}={value}"
    state = labels.get(NVSENTINEL_STATE_LABEL)
    if state and state not in NVSENTINEL_DONE:
        return f"NVSentinel: {NVSENTINEL_STATE_LABEL}={state}"
    for taint in (node.get("spec") or {}).get("taints") or ():
        key = str(taint.get("key") or "")
        if taint.get("effect") in ("NoSchedule", "NoExecute") and (
                key in NVSENTINEL_TAINTS or (key.startswith("nvidia.com/") and key.endswith("-error"))):
            return f"NVSentinel: taint {key}={taint.get('value', '')}:{taint.get('effect')}"
    for cond in (node.get("status") or {}).get("conditions") or ():
        kind = str(cond.get("type") or "")
        if str(cond.get("status")) == "True" and (kind.startswith(NVSENTINEL_CONDITION_PREFIXES)
                                                   or kind in NVSENTINEL_CONDITIONS):
            message = " ".join(str(cond.get("message") or "").split())[:160]
            return f"NVSentinel: condition {kind}" + (f" ({message})" if message else "")
    return None


def unhealthy_hosts(nodes: Iterable[Mapping]) -> dict[str, str]:
    """``{hostname: why}`` of the nodes :func:`node_problem` keeps out; the hostname is the
    node's ``kubernetes.io/hostname`` label (what pods' nodeAffinity names), else its name."""
    out = {}
    for node in nodes:
        why = node_problem(node)
        if why:
            meta = node.get("metadata") or {}
            out[str((meta.get("labels") or {}).get(HOSTNAME_LABEL) or meta.get("name"))] = why
    return out


def kept_out_note(nodes: Iterable[Mapping]) -> str:
    """``"; N node(s) kept out by the platform's health marks (host: why, ...)"`` for an
    offering's source (what the plan shows), or "" when the platform marks none (three named)."""
    hosts = unhealthy_hosts(nodes)
    if not hosts:
        return ""
    named = ", ".join(f"{h}: {why}" for h, why in sorted(hosts.items())[:3]) + (", ..." if len(hosts) > 3 else "")
    return f"; {len(hosts)} node(s) kept out by the platform's health marks ({named})"


def listed_unhealthy_hosts(list_nodes: Callable[[], Mapping | None]) -> dict[str, str]:
    """:func:`unhealthy_hosts` of what ``list_nodes()`` returns (a V1NodeList as a dict); {}
    when it raises (RBAC without ``list nodes``: the platform's marks are then not read, and the
    scheduler still keeps cordoned and tainted nodes out on its own)."""
    try:
        doc = list_nodes() or {}
    except Exception:  # noqa: BLE001 reading the platform's marks is a help, never a reason to fail a launch
        return {}
    return unhealthy_hosts(doc.get("items") or ())


def slurm_version(text: str) -> tuple[int, int] | None:
    """``(major, minor)`` of ``sbatch --version``'s line (``slurm 25.11.0``, ``slurm-wlm
    22.05.8``), or None when it names none."""
    m = re.search(r"\bslurm(?:-wlm)?\s+(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


_versions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def asked_slurm_version(runner) -> tuple[int, int] | None:
    """The Slurm of the cluster ``runner`` reaches (a :class:`sftctl.providers.slurm.runner.Runner`:
    ``sbatch --version`` run once per runner and kept), or None when it cannot say."""
    if runner not in _versions:
        try:
            out = runner.run(["sbatch", "--version"], timeout=30, check=False).stdout
            text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        except Exception:  # noqa: BLE001 no sbatch here (a dry run): the plain --requeue
            text = ""
        _versions[runner] = slurm_version(text)
    return _versions[runner]


def requeue_option(requeue: bool, version: tuple[int, int] | None) -> str:
    """The ``#SBATCH`` requeue option: ``--no-requeue`` when ``requeue`` is off,
    ``--requeue=expedite`` on Slurm >= 25.11, else ``--requeue``."""
    if not requeue:
        return "--no-requeue"
    return "--requeue=expedite" if version is not None and version >= EXPEDITE_SINCE else "--requeue"
