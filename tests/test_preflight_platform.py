"""Issue 41.4: what the platform already knows keeps bad machines out.

Kubernetes: HyperPod's ``sagemaker.amazonaws.com/node-health-status`` labels (AWS docs,
"Resilience-related Kubernetes labels by SageMaker HyperPod"), NVSentinel's node conditions,
fault-quarantine taints and state label (NVIDIA/NVSentinel ``docs/INTEGRATIONS.md``, its State
Manager page) on nodes of the API emulator (tests/k8s_emulator.py, the real ``kubernetes``
client): such nodes leave the offerings and every pod's nodeAffinity excludes them.

Slurm: ``--requeue=expedite`` from Slurm 25.11 on (its release notes), ``--requeue`` before; the
version is what ``sbatch --version`` prints: Debian's real slurm-wlm 22.05 here, and a fake
``sbatch`` on PATH that prints a 25.11 version line.
"""

from __future__ import annotations

import os

import pytest

from k8s_emulator import K8sEmulator, default_nodes, gpu_node
from sftctl.health.platform import node_problem, requeue_option, slurm_version, unhealthy_hosts


def _node(name: str = "n1", labels: dict | None = None, taints: list | None = None,
          conditions: list | None = None) -> dict:
    node = gpu_node(name, labels or {}, taints=taints)
    node["status"]["conditions"] += conditions or []
    return node


def test_the_platforms_marks_of_a_kubernetes_node_and_only_those():
    assert node_problem(_node()) is None
    # GKE taints every GPU node nvidia.com/gpu=present:NoSchedule: no fault
    assert node_problem(_node(taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])) is None
    hp = "sagemaker.amazonaws.com/node-health-status"
    assert node_problem(_node(labels={hp: "Schedulable"})) is None
    for value in ("Unschedulable", "UnschedulablePendingReplacement", "UnschedulablePendingReboot"):
        assert node_problem(_node(labels={hp: value})) == f"HyperPod: {hp}={value}"
    deep = "sagemaker.amazonaws.com/deep-health-check-status"
    assert node_problem(_node(labels={deep: "Passed"})) is None
    assert node_problem(_node(labels={deep: "Failed"})) == f"HyperPod: {deep}=Failed"
    # NVSentinel: a fatal fault is a condition with status True; False is its recovery
    mem = {"type": "GpuMemWatch", "status": "True", "reason": "HardwareFailure",
           "message": "[DCGM_FR_FAULTY_MEMORY] GPU memory failure detected on GPU 0 - RecommendedAction: RESTART_VM"}
    assert node_problem(_node(conditions=[mem])) == (
        "NVSentinel: condition GpuMemWatch ([DCGM_FR_FAULTY_MEMORY] GPU memory failure detected on GPU 0 - "
        "RecommendedAction: RESTART_VM)")
    assert node_problem(_node(conditions=[{**mem, "status": "False"}])) is None
    assert node_problem(_node(conditions=[{"type": "SysLogsXIDError", "status": "True"}])) == \
        "NVSentinel: condition SysLogsXIDError"
    assert node_problem(_node(conditions=[{"type": "MemoryPressure", "status": "True"}])) is None  # kubelet's own
    xid = {"key": "nvidia.com/gpu-xid-error", "value": "true", "effect": "NoSchedule"}
    assert node_problem(_node(taints=[xid])) == "NVSentinel: taint nvidia.com/gpu-xid-error=true:NoSchedule"
    assert node_problem(_node(taints=[{**xid, "effect": "PreferNoSchedule"}])) is None  # a warning, not a fault
    state = "dgxc.nvidia.com/nvsentinel-state"
    assert node_problem(_node(labels={state: "quarantined"})) == f"NVSentinel: {state}=quarantined"
    assert node_problem(_node(labels={state: "remediation-succeeded"})) is None
    assert unhealthy_hosts([_node("a", {hp: "Unschedulable"}), _node("b")]) == {"a": f"HyperPod: {hp}=Unschedulable"}


@pytest.fixture
def kubeconfig_for(tmp_path, monkeypatch):
    def use(cluster):
        monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "kubeconfig")))
        for var in ("SFTCTL_K8S_CONTEXT", "SFTCTL_K8S_NAMESPACE", "KUBERNETES_SERVICE_HOST"):
            monkeypatch.delenv(var, raising=False)
    return use


def test_kubernetes_nodes_the_platform_marks_leave_the_offerings_and_every_pods_affinity(kubeconfig_for):
    from sftctl.providers.base import provision_all
    from sftctl.providers.kubernetes import KubernetesProvider
    from test_provider_kubernetes import JOB, nodes

    h100 = {k: v for k, v in default_nodes()[0]["metadata"]["labels"].items() if k != "kubernetes.io/hostname"}
    hyperpod = gpu_node("hp-1", {**h100, "sagemaker.amazonaws.com/node-health-status": "UnschedulablePendingReplacement"})
    sentinel = gpu_node("ns-1", h100)
    sentinel["status"]["conditions"].append({"type": "GpuNvlinkWatch", "status": "True", "reason": "HardwareFailure",
                                             "message": "[DCGM_FR_NVLINK_DOWN] NVLink down"})
    healthy = gpu_node("ok-1", {**h100, "sagemaker.amazonaws.com/node-health-status": "Schedulable"})
    l4 = gpu_node("l4-bad", {"cloud.google.com/gke-accelerator": "nvidia-l4"}, gpus=1,
                  taints=[{"key": "nvidia.com/gpu-xid-error", "value": "true", "effect": "NoSchedule"}])
    with K8sEmulator(nodes=[hyperpod, sentinel, healthy, l4]) as cluster:
        kubeconfig_for(cluster)
        provider = KubernetesProvider(poll_s=0.02, ready_timeout_s=20, pending_timeout_s=5, num_nodes=3)
        assert provider.offerings("L4", 1) == []  # its only node has NVSentinel's taint
        (offering,) = provider.offerings("H100", 8)
        assert offering.source.endswith(
            "; 3 node(s) kept out by the platform's health marks (hp-1: HyperPod: sagemaker.amazonaws.com/"
            "node-health-status=UnschedulablePendingReplacement, l4-bad: NVSentinel: taint nvidia.com/gpu-xid-error="
            "true:NoSchedule, ns-1: NVSentinel: condition GpuNvlinkWatch ([DCGM_FR_NVLINK_DOWN] NVLink down))")
        handles = provision_all(provider, JOB, nodes(1), offering)
        assert [h.node_name for h in handles] == ["ok-1"]
        pod = cluster.get("pods", "default", handles[0].pod)
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        notin = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["hp-1", "l4-bad", "ns-1"]}
        assert all(notin in t["matchExpressions"] for t in terms)
        for h in handles:
            provider.terminate(h)


def test_slurm_requeue_is_expedited_from_25_11_and_plain_before():
    assert slurm_version("slurm-wlm 22.05.8\n") == (22, 5)
    assert slurm_version("slurm 25.11.0") == (25, 11) and slurm_version("slurm 26.05.1") == (26, 5)
    assert slurm_version("sbatch: fatal: Could not establish a configuration source") is None
    assert requeue_option(True, (25, 11)) == "--requeue=expedite"
    assert requeue_option(True, (25, 5)) == "--requeue" and requeue_option(True, None) == "--requeue"
    assert requeue_option(False, (25, 11)) == "--no-requeue"


def _sbatch_script(config: dict | None = None) -> str:
    from sftctl.catalog import Offering
    from sftctl.providers.slurm import SlurmProvider

    provider = SlurmProvider(config={"partition": "debug", **(config or {})})
    offering = Offering(provider="slurm", instance_type="debug", accelerator="cpu", count=1, region="lab",
                        usd_per_hour=0.0)
    return provider.batch_scripts("job-1", 1, ["a", "b"], offering)["sbatch.sh"]


def _requeue_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("#SBATCH --") and "requeue" in ln]


def test_the_rendered_sbatch_script_asks_the_clusters_slurm_for_its_requeue(tmp_path, monkeypatch, home):
    # Debian's real Slurm (22.05): sbatch --version answers with a configuration to read
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=lab\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=debug Nodes=n1\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert _requeue_lines(_sbatch_script()) == ["#SBATCH --requeue"]
    assert _requeue_lines(_sbatch_script({"requeue": False})) == ["#SBATCH --no-requeue"]
    # a 25.11 cluster: sbatch prints its version line
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'slurm 25.11.0' && exit 0\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert _requeue_lines(_sbatch_script()) == ["#SBATCH --requeue=expedite"]
    assert _requeue_lines(_sbatch_script({"requeue": False})) == ["#SBATCH --no-requeue"]
    # no Slurm configuration at all (a dry run elsewhere): the plain option
    fake.write_text("#!/bin/sh\necho 'sbatch: fatal: Could not establish a configuration source' >&2\nexit 1\n")
    assert _requeue_lines(_sbatch_script()) == ["#SBATCH --requeue"]
