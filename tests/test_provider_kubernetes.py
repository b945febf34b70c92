"""The Kubernetes provider: the real ``kubernetes`` client against the API emulator over HTTP.

The emulator (``tests/k8s_emulator.py``) serves the real REST paths, validates every created
object against the official schema (kubernetes-validate, strict), schedules pods by node labels
and allocatable GPUs, and injects the errors clusters really return (ResourceQuota 403, 429, 401).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from k8s_emulator import SCHEMA_VERSION, K8sEmulator, gpu_node
from sftctl.catalog import Offering
from sftctl.errors import CapacityError, CredentialsError, ExitCode, ProviderError
from sftctl.providers.base import provision_all
from sftctl.providers.cloud import InstanceRequest, InstanceState, labels
from sftctl.providers.kubernetes import (
    GFD_PRODUCT,
    GKE_ACCELERATOR,
    KARPENTER_GPU_NAME,
    KubernetesProvider,
    node_manifests,
    render,
)
from sftctl.types import KubernetesHandle, Plan

SECRET = "hf_Sup3rS3cretValue-9f8e7d"
JOB = "gpt-small-a1b2c3"
RESOURCES = ("pods", "services", "configmaps", "secrets")


@pytest.fixture
def cluster():
    with K8sEmulator() as c:
        yield c


@pytest.fixture
def kubeconfig(cluster, tmp_path, monkeypatch):
    path = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(path))
    for var in ("SFTCTL_K8S_CONTEXT", "SFTCTL_K8S_NAMESPACE", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    return path


def make_provider(**kw) -> KubernetesProvider:
    options = dict(poll_s=0.02, ready_timeout_s=20, pending_timeout_s=0.4, secrets={"HF_TOKEN": SECRET}, num_nodes=2)
    return KubernetesProvider(**{**options, **kw})


@pytest.fixture
def provider(kubeconfig):
    return make_provider()


def nodes(n: int, job: str = JOB) -> list[tuple[str, int]]:
    return [(f"{job}-n{r}-{r:04x}", r) for r in range(n)]


def h100(provider) -> Offering:
    (offering,) = provider.offerings("H100", 8)
    return offering


def left(cluster, job: str = JOB) -> dict[str, list[str]]:
    return {r: [o["metadata"]["name"] for o in cluster.list(r, "default", f"sftctl-job={job}")] for r in RESOURCES}


def request(accelerator="H100", count=8, rank=0, spot=False, bootstrap="echo boot", image=None) -> InstanceRequest:
    offering = Offering("kubernetes", "pool", accelerator, count, "ctx", 0.0)
    node_id = f"{JOB}-n{rank}-{rank:04x}"
    return InstanceRequest(JOB, node_id, rank, offering, None, spot, bootstrap, labels(JOB, node_id), image)


# ------------------------------------------------------------------ manifests


@pytest.mark.parametrize("accelerator,count", [("H100", 8), ("A100-80GB", 4), ("L4", 1), ("MI300X", 8), ("cpu", 4)])
@pytest.mark.parametrize("spot", [False, True])
def test_rendered_manifests_pass_the_official_schema_strictly(accelerator, count, spot):
    objs = node_manifests(request(accelerator, count, spot=spot), namespace="team-a",
                          secrets={"HF_TOKEN": SECRET, "WANDB_API_KEY": "w"}, num_nodes=2)
    for kind, obj in objs.items():
        for version in (SCHEMA_VERSION, kubernetes_validate.latest_version()):
            kubernetes_validate.validate(obj, version, strict=True)  # raises on any unknown or mistyped field
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["labels"]["sftctl-managed"] == "true" and meta["labels"]["sftctl-job"] == JOB, kind
    assert objs["pod"]["metadata"]["labels"]["sftctl-node"] == f"{JOB}-n0-0000"
    assert objs["configmap"]["metadata"]["labels"]["sftctl-node"] == f"{JOB}-n0-0000"


def test_pod_manifest_gpu_limit_affinity_rendezvous_and_bootstrap():
    pod = node_manifests(request("H100", 8, rank=1), namespace="default", secrets={"HF_TOKEN": SECRET},
                         num_nodes=2)["pod"]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    (c,) = spec["containers"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    by_key = {e["key"]: e["values"] for t in terms for e in t["matchExpressions"]}
    assert "NVIDIA-H100-80GB-HBM3" in by_key[GFD_PRODUCT]
    assert "nvidia-h100-80gb" in by_key[GKE_ACCELERATOR]
    assert by_key[KARPENTER_GPU_NAME] == ["h100"]
    assert len(terms) == 3  # OR'ed: one term per labelling scheme
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    env = {e["name"]: e["value"] for e in c["env"]}
    svc = f"sftctl-{JOB}"
    assert spec["hostname"] == "rank-1" and spec["subdomain"] == svc
    assert env["MASTER_ADDR"] == f"rank-0.{svc}" and env["MASTER_PORT"] == "29500"
    assert env["NODE_RANK"] == "1" and env["NNODES"] == "2" and env["NPROC_PER_NODE"] == "8"
    assert c["envFrom"] == [{"secretRef": {"name": f"sftctl-{JOB}-env"}}]
    assert c["command"] == ["/bin/bash", "/etc/sftctl/bootstrap/bootstrap.sh"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["bootstrap"]["configMap"]["name"] == f"{JOB}-n1-0001-bootstrap"


def test_amd_accelerators_ask_for_amd_gpus():
    pod = node_manifests(request("MI300X", 8), namespace="default")["pod"]
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"] == {"amd.com/gpu": "8"}
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert keys == {"amd.com/gpu.product-name", "amd.com/gpu.device-id"}
    assert "envFrom" not in c  # no secrets: no Secret


def test_cpu_pods_ask_for_no_gpu_and_select_no_gpu_label():
    pod = node_manifests(request("cpu", 4), namespace="default")["pod"]
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "4"}}
    assert "affinity" not in pod["spec"] and "tolerations" not in pod["spec"]


def test_secret_values_appear_only_base64_in_the_secret():
    secrets = {"HF_TOKEN": SECRET}
    objs = node_manifests(request(), namespace="default", secrets=secrets)
    for kind in ("pod", "configmap", "service"):
        assert SECRET not in json.dumps(objs[kind]), kind
    ctx = dict(job_id=JOB, node_id="n", rank=0, namespace="default", master_port=1, service="s", pod="p",
               configmap="c", hostname="h", secret="sftctl-x-env", labels={}, data=secrets)
    text = render("secret.yaml.j2", **ctx)
    assert SECRET not in text
    assert base64.b64decode(yaml.safe_load(text)["data"]["HF_TOKEN"]).decode() == SECRET


def test_bootstrap_of_any_text_survives_the_yaml_round_trip():
    nasty = "#!/bin/bash\nset -e\necho \"a: b\" '{x}' {{ y }} %s & <tag> # 😀 \\n\tend\n\n  indented\n---\n"
    objs = node_manifests(request(bootstrap=nasty), namespace="default")
    assert objs["configmap"]["data"]["bootstrap.sh"] == nasty


# ------------------------------------------------------------------ against the emulator


def test_provision_two_nodes_describe_and_terminate(provider, cluster):
    offering = h100(provider)
    handles = provision_all(provider, JOB, nodes(2), offering, bootstrap="echo node-bootstrap")
    assert [h.rank for h in handles] == [0, 1]
    assert {h.node_name for h in handles} == {"gpu-h100-a", "gpu-h100-b"}  # 8 GPUs each: one pod per node
    assert all(provider.describe(h) == InstanceState.RUNNING for h in handles)
    assert handles[0].ip == f"rank-0.sftctl-{JOB}"

    created = left(cluster)
    assert sorted(created["pods"]) == sorted(h.pod for h in handles)
    assert created["services"] == [f"sftctl-{JOB}"] and created["secrets"] == [f"sftctl-{JOB}-env"]
    assert len(created["configmaps"]) == 2
    for resource in RESOURCES:
        for obj in cluster.list(resource, "default", f"sftctl-job={JOB}"):
            assert obj["metadata"]["labels"]["sftctl-managed"] == "true"
    pod = cluster.get("pods", "default", handles[1].pod)
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["MASTER_ADDR"] == handles[0].ip and env["NODE_RANK"] == "1" and env["NNODES"] == "2"
    cm = cluster.get("configmaps", "default", handles[1].configmap)
    assert cm["data"]["bootstrap.sh"] == "echo node-bootstrap"
    for obj in (pod, cm, cluster.get("services", "default", f"sftctl-{JOB}")):
        assert SECRET not in json.dumps(obj)
    secret = cluster.get("secrets", "default", f"sftctl-{JOB}-env")
    assert base64.b64decode(secret["data"]["HF_TOKEN"]).decode() == SECRET
    listed = provider.list_instances(JOB)
    assert sorted((i["job_id"], i["node_id"]) for i in listed) == [(JOB, n) for n, _ in nodes(2)]
    assert provider.list_instances(None) == listed

    for h in handles:
        provider.terminate(h)
    assert all(provider.describe(h) == InstanceState.GONE for h in handles)
    assert provider.terminate_tagged(JOB) == 0  # the last node took the Service and the Secret with it
    assert left(cluster) == {r: [] for r in RESOURCES}
    assert provider.list_instances(JOB) == []


def test_terminate_tagged_finds_every_object_of_the_job(provider, cluster):
    provision_all(provider, JOB, nodes(1), h100(provider))
    provision_all(provider, "other-job-ffffff", nodes(1, "other-job-ffffff"), h100(provider))
    assert provider.terminate_tagged(JOB) == 4  # pod, configmap, service, secret
    assert left(cluster) == {r: [] for r in RESOURCES}
    assert len(left(cluster, "other-job-ffffff")["pods"]) == 1  # another job's objects stay


def test_pending_past_the_timeout_is_a_capacity_error_and_the_pod_is_deleted(provider, cluster):
    offering = h100(provider)
    with pytest.raises(CapacityError) as info:
        provision_all(provider, JOB, nodes(3), offering)  # two nodes of 8 GPUs; the third pod never fits
    e = info.value
    assert e.scope == "offering" and e.code == "Unschedulable" and e.provider == "kubernetes"
    assert e.blocks("kubernetes", offering.region, offering.instance_type)
    assert "Insufficient nvidia.com/gpu" in e.message and "0/3 nodes are available" in e.message
    assert "\n" not in e.message
    assert left(cluster) == {r: [] for r in RESOURCES}  # the pending pod and the two that ran


def test_quota_exceeded_is_a_capacity_error_of_the_region(provider, cluster):
    cluster.set_quota("default", {"requests.nvidia.com/gpu": 8})
    offering = h100(provider)
    with pytest.raises(CapacityError) as info:
        provision_all(provider, JOB, nodes(2), offering)
    e = info.value
    assert e.scope == "region" and e.code == "ExceededQuota" and e.region == offering.region
    assert "exceeded quota" in e.message and e.exit_code == ExitCode.PROVIDER
    assert e.blocks("kubernetes", offering.region, "any-other-pool")
    assert left(cluster) == {r: [] for r in RESOURCES}


def test_throttled_requests_are_retried(provider, cluster):
    cluster.throttle(2, method="POST", resource="pods")
    (handle,) = provision_all(provider, JOB, nodes(1), h100(provider))
    assert provider.describe(handle) == InstanceState.RUNNING
    assert cluster.requests.count(("POST", "/api/v1/namespaces/default/pods")) == 3


def test_create_is_idempotent_on_already_exists(provider, cluster):
    req = request()
    first = provider.create_instance(req)
    again = make_provider(secrets={"HF_TOKEN": "rotated"})  # a second process, a retried call
    assert again.create_instance(req).pod == first.pod
    assert len(left(cluster)["pods"]) == 1
    secret = cluster.get("secrets", "default", f"sftctl-{JOB}-env")
    assert base64.b64decode(secret["data"]["HF_TOKEN"]).decode() == "rotated"


def test_pod_phases_map_to_instance_states(provider, cluster):
    (handle,) = provision_all(provider, JOB, nodes(1), h100(provider))
    cluster.finish_pod("default", handle.pod, 1)
    assert provider.describe(handle) == InstanceState.STOPPING
    assert provider.status(handle).state.value == "LOST"
    provider.terminate(handle)
    assert provider.describe(handle) == InstanceState.GONE


def test_bad_token_is_a_one_line_credentials_error(cluster, kubeconfig, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "bad", token="expired")))
    with pytest.raises(CredentialsError) as info:
        make_provider().check()
    e = info.value
    assert "401" in e.message and "\n" not in e.message and e.exit_code == ExitCode.PROVIDER
    assert "KUBECONFIG" in e.hint and "kubectl config use-context" in e.hint
    with pytest.raises(CredentialsError):
        make_provider().offerings("H100", 8)


@pytest.mark.parametrize("problem", ["missing", "garbage", "unknown-context"])
def test_unusable_kubeconfig_is_a_credentials_error(problem, kubeconfig, tmp_path, monkeypatch):
    if problem == "missing":
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nope"))
        monkeypatch.setenv("HOME", str(tmp_path))
    elif problem == "garbage":
        (tmp_path / "garbage").write_text("clusters: [this is: not, a kubeconfig\n")
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "garbage"))
    else:
        monkeypatch.setenv("SFTCTL_K8S_CONTEXT", "prod-cluster")
    with pytest.raises(CredentialsError) as info:
        make_provider().check()
    assert "\n" not in info.value.message and info.value.message.startswith("kubernetes: ")
    assert "KUBECONFIG" in info.value.hint


def test_unreachable_api_server_is_a_one_line_provider_error(cluster, tmp_path, monkeypatch):
    from servers import free_port

    config = yaml.safe_load(cluster.write_kubeconfig(tmp_path / "kc").read_text())
    config["clusters"][0]["cluster"]["server"] = f"http://127.0.0.1:{free_port()}"  # nothing listens
    (tmp_path / "kc").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kc"))
    with pytest.raises(ProviderError) as info:
        make_provider().check()
    assert "cannot reach the API server" in info.value.message and "\n" not in info.value.message


def test_rbac_forbidden_is_a_credentials_error_not_capacity(provider, cluster):
    cluster.inject(403, method="POST", resource="pods",
                   message='pods is forbidden: User "dev" cannot create resource "pods" in API group "" '
                           'in the namespace "default"')
    with pytest.raises(CredentialsError) as info:
        provision_all(provider, JOB, nodes(1), h100(provider))
    assert "cannot create resource" in info.value.message
    assert left(cluster) == {r: [] for r in RESOURCES}


def test_offerings_from_node_labels_and_allocatable_gpus(provider, cluster):
    offering = h100(provider)
    assert (offering.provider, offering.instance_type, offering.accelerator, offering.count) == \
        ("kubernetes", "h100-pool", "H100", 8)
    assert offering.region == "emulator" and offering.usd_per_hour == 0.0  # the context's name, unpriced
    assert provider.offerings("H100", 16) == []  # no node has 16
    (l4,) = provider.offerings("L4", 1)
    assert (l4.instance_type, l4.accelerator) == ("l4-pool", "L4")
    assert provider.offerings("A100-80GB", 1) == [] and provider.offerings("cpu", 1) == []
    priced = make_provider(prices={"H100": 2.5, "l4-pool": 0.5})
    assert priced.offerings("H100", 4)[0].usd_per_hour == 10.0  # per accelerator-hour x count
    assert priced.offerings("L4", 1)[0].usd_per_hour == 0.5


def test_offerings_read_karpenter_amd_and_cpu_only_nodes(tmp_path, monkeypatch):
    karpenter = {KARPENTER_GPU_NAME: "a100", "karpenter.k8s.aws/instance-gpu-memory": "81920",
                 "karpenter.sh/nodepool": "gpu-a100"}
    amd = {"amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM"}
    cordoned = gpu_node("gpu-t4", {GFD_PRODUCT: "Tesla-T4"}, gpus=1)
    cordoned["spec"]["unschedulable"] = True
    with K8sEmulator(nodes=[gpu_node("k-a100", karpenter), gpu_node("mi300x-1", amd, 8, "amd.com/gpu"),
                            gpu_node("cpu-1", {}, gpus=0, cpu="16"), cordoned]) as c:
        monkeypatch.setenv("KUBECONFIG", str(c.write_kubeconfig(tmp_path / "kc", context="lab")))
        monkeypatch.delenv("SFTCTL_K8S_CONTEXT", raising=False)
        p = make_provider()
        (a100,) = p.offerings("A100-80GB", 8)
        assert (a100.instance_type, a100.region) == ("gpu-a100", "lab")
        assert p.offerings("A100-40GB", 8) == []  # Karpenter's GPU memory label tells them apart
        (mi,) = p.offerings("MI300X", 8)
        assert mi.instance_type == "AMD_Instinct_MI300X_OAM"
        (cpu,) = p.offerings("cpu", 8)
        assert cpu.accelerator == "cpu" and cpu.vcpus == 16
        assert p.offerings("T4", 1) == []  # a cordoned node offers nothing
        (handle,) = provision_all(p, JOB, nodes(1), mi)
        assert handle.node_name == "mi300x-1"
        pod = c.get("pods", "default", handle.pod)
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"amd.com/gpu": "8"}
        (on_cpu,) = provision_all(p, "cpu-job-0000ff", nodes(1, "cpu-job-0000ff"), cpu)
        assert on_cpu.node_name == "cpu-1"


def test_cordon_marks_the_node_unschedulable(provider, cluster):
    (handle,) = provision_all(provider, JOB, nodes(1), h100(provider))
    provider.cordon(handle.node_name)
    assert cluster.get("nodes", "", handle.node_name)["spec"]["unschedulable"] is True
    provider.cordon("gpu-h100-b" if handle.node_name == "gpu-h100-a" else "gpu-h100-a")
    provider.terminate(handle)
    assert provider.offerings("H100", 8) == []
    with pytest.raises(CapacityError) as info:
        provision_all(provider, JOB, nodes(1), Offering("kubernetes", "h100-pool", "H100", 8, "emulator", 0.0))
    assert "node(s) were unschedulable" in info.value.message


VERDICT = "xid: XID 79 on GPU 3: GPU has fallen off the bus"


def _terms(pod: dict) -> list[dict]:
    return pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]


@pytest.mark.parametrize("accelerator,count", [("H100", 8), ("cpu", 4)])
def test_avoided_machines_are_a_notin_hostname_in_every_term(accelerator, count):
    plain = node_manifests(request(accelerator, count), namespace="default")["pod"]
    pod = node_manifests(request(accelerator, count), namespace="default", avoid_hosts=["gpu-b", "gpu-a"])["pod"]
    for version in (SCHEMA_VERSION, kubernetes_validate.latest_version()):
        kubernetes_validate.validate(pod, version, strict=True)
    notin = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-a", "gpu-b"]}
    if accelerator == "cpu":  # no GPU label to select: one term that only avoids
        assert "affinity" not in plain["spec"]
        assert _terms(pod) == [{"matchExpressions": [notin]}]
    else:  # the terms are OR'ed: each one must exclude the machines
        assert [t["matchExpressions"] for t in _terms(pod)] == [t["matchExpressions"] + [notin] for t in _terms(plain)]
        assert len(_terms(pod)) == 3


def test_quarantine_cordons_with_the_verdict_and_the_replacement_avoids_the_machine(provider, cluster):
    (handle,) = provision_all(provider, JOB, nodes(1), h100(provider))
    bad = handle.node_name
    done = provider.quarantine(handle, VERDICT)
    assert done["machine"] == bad and done["hostname"] == bad and done["actions"] == ["anti-affinity", "cordon"]
    assert "cordon_error" not in done and VERDICT in done["message"]
    node = cluster.get("nodes", "", bad)
    assert node["spec"]["unschedulable"] is True
    ann = node["metadata"]["annotations"]
    assert ann["sftctl.dev/cordon-reason"] == VERDICT
    assert ann["sftctl.dev/cordoned-by"] == f"sftctl job {JOB}, node {handle.node_id}"
    assert ann["sftctl.dev/cordoned-at"].endswith("Z")
    provider.terminate(handle)
    (new,) = provision_all(provider, JOB, [(f"{JOB}-n0-0100", 0)], h100(provider))
    assert new.node_name != bad
    pod = cluster.get("pods", "default", new.pod)
    assert all({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [bad]} in t["matchExpressions"]
               for t in _terms(pod))
    # another job's pods are not this job's business: no anti-affinity, only the cordon keeps them off
    other = node_manifests(request(), namespace="default")["pod"]
    assert not any(e["operator"] == "NotIn" for t in _terms(other) for e in t["matchExpressions"])


def test_quarantine_without_rbac_on_nodes_falls_back_to_anti_affinity(provider, cluster):
    (handle,) = provision_all(provider, JOB, nodes(1), h100(provider))
    bad = handle.node_name
    cluster.inject(403, method="PATCH", resource="nodes",
                   message=f'nodes "{bad}" is forbidden: User "alice" cannot patch resource "nodes" in API group "" '
                           "at the cluster scope")
    done = provider.quarantine(handle, VERDICT)
    assert done["actions"] == ["anti-affinity"] and done["hostname"] == bad
    assert "cannot patch resource" in done["cordon_error"] and "\n" not in done["message"]
    assert done["message"].startswith(f"kubernetes: could not cordon node {bad} (")
    assert f"kubectl cordon {bad}" in done["message"]
    assert not cluster.get("nodes", "", bad)["spec"].get("unschedulable")
    assert "sftctl.dev/cordon-reason" not in (cluster.get("nodes", "", bad)["metadata"].get("annotations") or {})
    provider.terminate(handle)
    (new,) = provision_all(provider, JOB, [(f"{JOB}-n0-0100", 0)], h100(provider))
    assert new.node_name != bad  # the other H100 node, by anti-affinity alone
    # with both machines avoided, the next pod has nowhere to go: capacity, as the scheduler says
    provider.quarantine(new, VERDICT)
    provider.terminate(new)
    with pytest.raises(CapacityError) as info:
        provision_all(provider, JOB, [(f"{JOB}-n0-0200", 0)], h100(provider))
    assert "didn't match Pod's node affinity/selector" in info.value.message


def test_a_pod_never_scheduled_has_no_machine_to_quarantine(provider):
    assert provider.quarantine(KubernetesHandle(job_id=JOB, node_id="n", rank=0, id="p", pod="p"), VERDICT) is None


def test_controller_quarantines_the_machine_of_a_node_replaced_for_a_verdict(kubeconfig, cluster, home, tmp_path):
    from sftctl.controller import Controller
    from sftctl.spec import JobSpec
    from sftctl.state import Store

    store = Store()
    spec = JobSpec.model_validate({"name": "quar", "resources": {"nodes": 1, "accelerators": ["H100:8"]},
                                   "storage": str(tmp_path / "storage"), "run": "true"})
    job = store.create_job("quar", spec.model_dump(mode="json"))
    (offering,) = make_provider().offerings("H100", 8)
    store.update_job(job, provider="kubernetes", offering_json={"offering": offering.to_dict(), "candidates": []})
    ctrl = Controller(store, job)
    ctrl.provider.poll_s, ctrl.provider.pending_timeout_s = 0.02, 5
    ctrl._provision_on(offering)
    bad = ctrl.nodes[0].handle.node_name
    # a LOST node (no verdict) is replaced but its machine is not suspected: the first fit again
    ctrl._replace(0)
    assert ctrl.nodes[0].handle.node_name == bad
    assert not any(n["spec"].get("unschedulable") for n in cluster.list("nodes"))
    ctrl._replace(0, quarantine=VERDICT)
    node = cluster.get("nodes", "", bad)
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"]["sftctl.dev/cordon-reason"] == VERDICT
    (event,) = [e for e in store.events(job) if e.kind == "quarantine"]
    assert event.message.startswith(f"node 0: kubernetes: cordoned node {bad} (")
    assert event.data["machine"] == bad and event.data["actions"] == ["anti-affinity", "cordon"]
    # the replacement of rank 0 could not go back to its machine
    assert ctrl.nodes[0].handle.node_name not in (None, bad)


# ------------------------------------------------------------------ the emulator itself


def test_emulator_speaks_the_api_servers_shapes(cluster, kubeconfig):
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    api = config.new_client_from_config(config_file=str(kubeconfig))
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    assert client.VersionApi(api).get_code().minor == SCHEMA_VERSION.split(".")[1]
    assert "v1" in client.CoreApi(api).get_api_versions().versions
    assert "batch" in [g.name for g in client.ApisApi(api).get_api_versions().groups]

    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bad"},
           "spec": {"containers": [{"name": "c", "image": "i", "resources": {
               "limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "4"}}}]}}
    with pytest.raises(ApiException) as info:
        core.create_namespaced_pod("default", bad)
    body = json.loads(info.value.body)
    assert info.value.status == 422 and body["kind"] == "Status" and body["reason"] == "Invalid"
    assert "must be equal to nvidia.com/gpu limit" in body["message"]
    assert body["details"]["causes"][0]["field"].startswith("spec.containers[0].resources.requests")

    with pytest.raises(ApiException) as info:
        core.read_namespaced_pod("absent", "default")
    assert info.value.status == 404 and json.loads(info.value.body)["reason"] == "NotFound"

    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "labels": {"a": "1"}},
           "spec": {"template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "c", "image": "busybox"}]}}}}
    batch.create_namespaced_job("default", job)
    with pytest.raises(ApiException) as info:
        batch.create_namespaced_job("default", job)
    assert info.value.status == 409 and json.loads(info.value.body)["reason"] == "AlreadyExists"
    assert [j.metadata.name for j in batch.list_namespaced_job("default", label_selector="a in (1,2)").items] == ["j"]
    assert batch.list_namespaced_job("default", label_selector="a!=1").items == []
    batch.delete_namespaced_job("j", "default")
    assert batch.list_namespaced_job("default").items == []


def test_emulator_rejects_unknown_fields_strictly(cluster):
    from k8s_emulator import ApiError, validate_object

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "i", "gpus": 8}]}}
    with pytest.raises(ApiError) as info:
        validate_object("pods", pod, "default")
    assert info.value.code == 422 and "'gpus' was unexpected" in info.value.body["message"]


def test_the_provider_module_does_not_import_the_sdk():
    code = "import sys, sftctl.providers.kubernetes; assert 'kubernetes' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_planner_offers_what_the_cluster_has(kubeconfig):
    """A cluster has no catalog: plan() ranks the GPU nodes it reads from the cluster's labels."""
    from sftctl.planner import plan
    from sftctl.spec import JobSpec

    spec = JobSpec.model_validate({"name": "k8s-plan", "run": "true", "resources": {
        "accelerators": ["H100:8", "L4:1"], "nodes": 1, "clouds": ["kubernetes"]}})
    chosen = plan(spec, usable={"local": None, "aws": "no", "gcp": "no", "kubernetes": None})
    assert chosen.offering.provider == "kubernetes"
    offered = {(c.offering.accelerator, c.offering.count) for c in chosen.candidates if c.rejected is None}
    assert ("H100", 8) in offered and ("L4", 1) in offered


def test_dry_run_preview_shows_the_manifests(tmp_path, monkeypatch):
    """Issue 28: ``run --dry-run`` shows each node's Kubernetes objects as they would be created;
    the Secret carries placeholders, never a value."""
    import yaml

    from sftctl import api
    from sftctl.controller import preview

    monkeypatch.setenv("HF_TOKEN", SECRET)
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(f"""\
name: k8s-preview
workdir: {tmp_path}
resources: {{accelerators: ["H100:8"], nodes: 2, clouds: [kubernetes]}}
storage: {{url: pvc://claim/jobs}}
secrets: [HF_TOKEN]
run: echo hi
""")
    spec = api.load(spec_path)
    doc = preview(spec, Plan.from_dict({"offering": Offering("kubernetes", "pool", "H100", 8, "ctx", 0.0).to_dict()}))
    # node 0's objects; the other nodes are summarised (issue 26: bounded for any node count)
    assert [s["name"] for s in doc["submits"]] == ["node 0: Kubernetes objects"]
    assert doc["other_nodes"]["count"] == 1
    objs = list(yaml.safe_load_all(doc["submits"][0]["text"]))
    assert [o["kind"] for o in objs] == ["Secret", "Service", "ConfigMap", "Pod"]
    assert SECRET not in doc["submits"][0]["text"]
    pod = objs[-1]
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8"}


def test_controller_job_manifest_passes_the_schema_and_keeps_secrets_in_the_secret():
    """controller.place: kubernetes: the controller's Job and Secret pass the official schema
    strictly; the Job names its Secret (envFrom) and never carries a value; its labels are not
    a node's (the job's sweeps never take the controller for a node)."""
    from sftctl.providers.kubernetes import controller_manifests

    objs = controller_manifests(JOB, ["python", "-c", "pass", JOB], namespace="default",
                                env={"SFTCTL_CONTROLLER_K8S_JOB": f"sftctl-ctl-{JOB}"},
                                secret_env={"SFTCTL_STATE_URL": f"postgresql://u:{SECRET}@db/x"}, image="img:1")
    for obj in objs.values():
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    job, secret = objs["job"], objs["secret"]
    assert SECRET not in json.dumps(job) and SECRET in base64.b64decode(secret["data"]["SFTCTL_STATE_URL"]).decode()
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert (job["spec"]["backoffLimit"], job["spec"]["template"]["spec"]["restartPolicy"]) == (0, "Never")
    for obj in (job, secret, job["spec"]["template"]):
        assert "sftctl-job" not in obj["metadata"]["labels"] and "sftctl-managed" not in obj["metadata"]["labels"]
        assert obj["metadata"]["labels"]["sftctl-controller-of"] == JOB
