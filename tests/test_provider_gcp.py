"""The GCP provider: the real google-cloud-compute client (REST) against the GCE emulator.

The emulator (tests/gce_emulator.py) is a real HTTP server on a free loopback port, parsing every
body strictly into the compute_v1 message types and answering with GCE's error shapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gce_emulator import GCEEmulator

from sftctl.catalog import Offering
from sftctl.errors import CapacityError, CredentialsError, ExitCode, ProviderError
from sftctl.providers.base import NodeState, provision_all
from sftctl.providers.cloud import InstanceRequest, InstanceState, labels
from sftctl.providers.gcp import GCPProvider, instance_name, split_instance_type

ZONES = ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"]  # us-central1-d is DOWN


@pytest.fixture(scope="module")
def emulator():
    with GCEEmulator() as emu:
        yield emu


@pytest.fixture
def gce(emulator):
    emulator.reset()
    yield emulator
    emulator.reset()


def make_provider(gce: GCEEmulator, **kw) -> GCPProvider:
    from google.auth.credentials import AnonymousCredentials

    return GCPProvider(project=gce.project, credentials=AnonymousCredentials(), api_endpoint=gce.url,
                       poll_s=0.01, ready_timeout_s=30, **kw)


@pytest.fixture
def provider(gce) -> GCPProvider:
    return make_provider(gce)


def offering(provider: GCPProvider, accelerator: str, count: int = 1) -> Offering:
    """The cheapest offering of ``accelerator:count`` in us-central1 (the emulator's zones)."""
    return min((o for o in provider.offerings(accelerator, count) if o.region == "us-central1"),
               key=lambda o: o.usd_per_hour)


# ------------------------------------------------------------------------------ happy path


def test_provision_describe_terminate_two_nodes(provider, gce):
    t4 = offering(provider, "T4")
    assert t4.instance_type == "n1-standard-4+T4"
    nodes = [("train-ab12cd-n0-0a1b", 0), ("train-ab12cd-n1-2c3d", 1)]
    ready = []
    handles = provision_all(provider, "train-ab12cd", nodes, t4, bootstrap="#!/bin/bash\necho boot\n",
                            on_ready=lambda node_id, h: ready.append(node_id))
    assert sorted(ready) == sorted(n for n, _ in nodes)
    assert all(h.ip.startswith("10.128.0.") for h in handles)  # networkIP: the rendezvous address
    for (node_id, rank), h in zip(nodes, handles):
        assert h.id == instance_name(node_id) and h.zone == "us-central1-a"
        assert h.project == gce.project and h.instance_type == "n1-standard-4+T4" and h.spot is False
        assert (h.node_id, h.rank, h.job_id) == (node_id, rank, "train-ab12cd")
        assert provider.describe(h) == InstanceState.RUNNING
        assert provider.status(h).state == NodeState.READY
        body = gce.inserted(h.id)
        assert body["labels"] == labels("train-ab12cd", node_id)
        assert body["machineType"] == "zones/us-central1-a/machineTypes/n1-standard-4"
        assert body["guestAccelerators"] == [
            {"acceleratorType": "zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4", "acceleratorCount": 1}]
        assert body["scheduling"] == {"onHostMaintenance": "TERMINATE", "automaticRestart": False,
                                      "provisioningModel": "STANDARD"}
        assert {"key": "startup-script", "value": "#!/bin/bash\necho boot\n"} in body["metadata"]["items"]
        assert "deeplearning-platform-release" in body["disks"][0]["initializeParams"]["sourceImage"]
    # The create waited for the operation: PENDING -> RUNNING -> DONE is two waits per insert.
    assert gce.count("POST", "/wait") >= 4

    listed = provider.list_instances("train-ab12cd")
    assert sorted((i["id"], i["node_id"], i["job_id"], i["zone"], i["instance_type"]) for i in listed) == sorted(
        (h.id, h.node_id, "train-ab12cd", "us-central1-a", "n1-standard-4+T4") for h in handles)
    aggregated = [r for r in gce.requests if r["path"].endswith("/aggregated/instances")]
    assert aggregated[-1]["query"]["filter"] == [
        '(labels.sftctl-managed = "true") (labels.sftctl-job = "train-ab12cd")']

    provider.terminate(handles[0])
    assert provider.describe(handles[0]) == InstanceState.GONE
    assert provider.terminate_tagged("train-ab12cd") == 1
    assert provider.list_instances("train-ab12cd") == [] and provider.list_instances() == []
    provider.terminate(handles[0])  # idempotent: a missing instance is not an error


def test_spot_labels_and_list_filters(provider, gce):
    l4 = offering(provider, "L4")
    h_a = provider.provision("job-a", "job-a-n0-1111", 0, l4, spot=True, bootstrap="echo a")
    h_b = provider.provision("Job_B.x", "Job_B.x-n0-2222", 0, l4, image="projects/p/global/images/custom")
    body = gce.inserted(h_a.id)
    assert body["scheduling"] == {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
                                  "onHostMaintenance": "TERMINATE", "automaticRestart": False}
    assert body["machineType"] == "zones/us-central1-a/machineTypes/g2-standard-4"
    assert "guestAccelerators" not in body  # g2 carries its L4
    assert h_a.spot is True
    # A node id that is no valid instance name still gives one, and labels stay valid.
    assert h_b.id.startswith("sftctl-job-b-x-n0-2222-") and len(h_b.id) <= 63
    assert gce.inserted(h_b.id)["disks"][0]["initializeParams"]["sourceImage"] == "projects/p/global/images/custom"
    assert [i["id"] for i in provider.list_instances("job-a")] == [h_a.id]
    # Labels hold sanitized ids; the exact ids come back from the instance's metadata.
    assert gce.inserted(h_b.id)["labels"]["sftctl-node"] == "job_b-x-n0-2222"
    assert [(i["job_id"], i["node_id"]) for i in provider.list_instances("Job_B.x")] == [("Job_B.x", "Job_B.x-n0-2222")]
    assert provider.list_instances("job_b.x") == []  # same label value, another job
    assert sorted(i["id"] for i in provider.list_instances()) == sorted([h_a.id, h_b.id])
    assert provider.terminate_tagged("job-a") == 1
    assert [i["id"] for i in provider.list_instances()] == [h_b.id]


def test_describe_maps_gce_statuses(provider, gce):
    h = provider.provision("j", "j-n0-0000", 0, offering(provider, "A100-40GB"))
    assert provider.describe(h) == InstanceState.RUNNING
    for status in ("STOPPING", "SUSPENDING", "TERMINATED"):
        gce.set_status(h.zone, h.id, status)
        assert provider.describe(h) == InstanceState.STOPPING
    assert provider.status(h).state == NodeState.LOST
    gce.set_status(h.zone, h.id, "STAGING")
    assert provider.describe(h) == InstanceState.PENDING
    provider.delete_instance(h)
    assert provider.describe(h) == InstanceState.GONE


def test_deleting_an_instance_already_being_deleted_waits_for_it(provider, gce):
    h = provider.provision("j", "j-n0-0001", 0, offering(provider, "T4"))
    url = f"{gce.url}/compute/v1/projects/{gce.project}/zones/{h.zone}/instances/{h.id}"
    r = requests.delete(url, timeout=10)
    assert r.status_code == 200 and r.json()["operationType"] == "delete"
    assert provider.describe(h) == InstanceState.STOPPING
    provider.delete_instance(h)  # GCE answers 400 resourceNotReady; the provider waits until it is gone
    assert provider.describe(h) == InstanceState.GONE
    deletes = [r["status"] for r in gce.requests if r["method"] == "DELETE"]
    assert deletes == [200, 400]


def test_zones_are_up_zones_of_the_region_sorted(provider, gce):
    assert provider.zones("us-central1") == ZONES
    assert provider.zones("us-east1") == ["us-east1-b", "us-east1-c"]
    assert provider.zones("asia-east1") == []


def test_offerings_come_from_the_catalog(provider):
    assert {o.instance_type for o in provider.offerings("h100", 8)} == {"a3-highgpu-8g", "a3-megagpu-8g", "a3-edgegpu-8g"}
    assert {o.instance_type for o in provider.offerings("H100", 1)} == {"a3-highgpu-1g"}
    assert provider.offerings("H100", 3) == []
    assert split_instance_type("a3-highgpu-1g", "H100", 1) == ("a3-highgpu-1g", None)  # the GPU comes attached
    assert all(o.provider == "gcp" for o in provider.offerings("T4", 1))
    assert split_instance_type("n1-standard-4+T4", "T4", 1) == ("n1-standard-4", ("nvidia-tesla-t4", 1))
    assert split_instance_type("a3-ultragpu-8g", "H200", 8) == ("a3-ultragpu-8g", None)


def test_instance_names_are_rfc1035():
    import re

    for node_id in ("a-n0-0000", "UPPER_case.dots-n12-ffff", "x" * 200, "9starts-with-digit", "--"):
        name = instance_name(node_id)
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name), name
    assert instance_name("A_b") != instance_name("a-b")


def test_endpoint_from_environment(gce, monkeypatch):
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.setenv("SFTCTL_GCE_ENDPOINT", gce.url)
    monkeypatch.setenv("CLOUDSDK_CORE_PROJECT", gce.project)
    p = GCPProvider(credentials=AnonymousCredentials())
    p.check()
    assert p.project == gce.project and p.api_endpoint == gce.url


# ------------------------------------------------------------------------------ failover


def test_exhausted_first_zone_fails_over_and_blocks_it(provider, gce):
    a100 = offering(provider, "A100-40GB")
    gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED", zone="us-central1-a", machine_type="a2-highgpu-1g")
    h = provider.provision("j", "j-n0-aaaa", 0, a100)
    assert h.zone == "us-central1-b"
    assert ("a2-highgpu-1g", "us-central1-a") in provider.blocked_zones
    # The next node skips the blocked zone without asking GCE.
    inserts_before = gce.count("POST", "/instances")
    h2 = provider.provision("j", "j-n1-bbbb", 1, a100)
    assert h2.zone == "us-central1-b" and gce.count("POST", "/instances") == inserts_before + 1


def test_with_details_and_not_offered_zones_fail_over(provider, gce):
    h200 = offering(provider, "H200", 8)
    gce.machine_types_by_zone = {"us-central1-a": {"n1-standard-4"}}  # a3-ultragpu-8g not offered there
    gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", zone="us-central1-b")
    gce.fail("RESOURCE_NOT_READY", zone="us-central1-c")
    h = provider.provision("j", "j-n0-cccc", 0, h200)
    assert h.zone == "us-central1-f"
    assert {z for t, z in provider.blocked_zones if t == "a3-ultragpu-8g"} == set(ZONES[:3])
    body = gce.inserted(h.id)
    assert body["disks"][0]["initializeParams"]["diskType"].endswith("/hyperdisk-balanced")
    gce.machine_types_by_zone = {}


def test_every_zone_exhausted_is_an_offering_capacity_error(provider, gce):
    a100 = offering(provider, "A100-40GB")
    gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED", machine_type="a2-highgpu-1g")
    with pytest.raises(CapacityError) as info:
        provider.provision("j", "j-n0-dddd", 0, a100)
    e = info.value
    assert (e.scope, e.provider, e.region, e.instance_type, e.code) == (
        "offering", "gcp", "us-central1", "a2-highgpu-1g", "ZONE_RESOURCE_POOL_EXHAUSTED")
    assert all(z in e.message for z in ZONES)
    assert gce.count("POST", "/instances") == len(ZONES)
    assert provider.list_instances() == []


def test_all_or_nothing_when_one_node_has_no_capacity(provider, gce):
    t4 = offering(provider, "T4")
    gce.fail("QUOTA_EXCEEDED", metric="NVIDIA_T4_GPUS", times=1)
    with pytest.raises(CapacityError):
        provision_all(provider, "j", [("j-n0-1", 0), ("j-n1-2", 1)], t4)
    assert provider.list_instances("j") == []


@pytest.mark.parametrize("http", [False, True], ids=["operation-error", "http-403"])
def test_gpus_all_regions_quota_blocks_the_cloud(provider, gce, http):
    gce.fail("QUOTA_EXCEEDED", metric="GPUS_ALL_REGIONS", http=http)
    with pytest.raises(CapacityError) as info:
        provider.provision("j", "j-n0-eeee", 0, offering(provider, "L4"))
    e = info.value
    assert (e.scope, e.code) == ("cloud", "QUOTA_EXCEEDED")
    assert "GPUS_ALL_REGIONS" in e.message and "\n" not in e.message
    assert e.blocks("gcp", "europe-west4", "a3-highgpu-8g") and not e.blocks("aws", "us-east-1", "p5.48xlarge")
    assert gce.count("POST", "/instances") == 1  # not retried in the other zones


@pytest.mark.parametrize("http", [False, True], ids=["operation-error", "http-403"])
def test_regional_quota_blocks_the_region(provider, gce, http):
    gce.fail("QUOTA_EXCEEDED", metric="NVIDIA_T4_GPUS", http=http)
    with pytest.raises(CapacityError) as info:
        provider.provision("j", "j-n0-ffff", 0, offering(provider, "T4"))
    e = info.value
    assert (e.scope, e.region, e.code) == ("region", "us-central1", "QUOTA_EXCEEDED")
    assert "NVIDIA_T4_GPUS" in e.message
    assert e.blocks("gcp", "us-central1", "a2-highgpu-1g") and not e.blocks("gcp", "us-east1", "a2-highgpu-1g")


def test_other_operation_errors_are_provider_errors(provider, gce):
    gce.fail("UNSUPPORTED_OPERATION", zone="us-central1-a")
    with pytest.raises(ProviderError) as info:
        provider.provision("j", "j-n0-9999", 0, offering(provider, "T4"))
    assert not isinstance(info.value, CapacityError)
    assert "UNSUPPORTED_OPERATION" in info.value.message


# ------------------------------------------------------------------------------ throttling, auth


def test_throttled_calls_are_retried(provider, gce):
    gce.throttle(2, method="POST", path_contains="/instances")
    gce.throttle(1, method="GET", path_contains="/zones")
    h = provider.provision("j", "j-n0-7777", 0, offering(provider, "T4"))
    assert provider.describe(h) == InstanceState.RUNNING
    inserts = [r for r in gce.requests if r["method"] == "POST" and r["path"].endswith("/instances")]
    assert len(inserts) == 3  # two 429s, then the insert
    assert len({r["query"]["requestId"][0] for r in inserts}) == 1  # retried with the same requestId
    assert len(gce.instances) == 1


def _token_credentials():
    """OAuth-style credentials whose refresh always "succeeds" with a new token (that GCE rejects)."""
    from google.auth.credentials import Credentials

    class TokenCredentials(Credentials):
        def __init__(self):
            super().__init__()
            self.token, self.refreshes = "stale-token", 0

        def refresh(self, request):
            self.refreshes += 1
            self.token = f"token-{self.refreshes}"

    return TokenCredentials()


def test_401_is_a_credentials_error(gce):
    creds = _token_credentials()
    provider = GCPProvider(project=gce.project, credentials=creds, api_endpoint=gce.url, poll_s=0.01)
    gce.deny(401)
    with pytest.raises(CredentialsError) as info:
        provider.check()
    assert info.value.exit_code == ExitCode.PROVIDER and "401" in info.value.message
    assert "\n" not in info.value.message and creds.refreshes >= 1  # google-auth refreshed, then gave up
    with pytest.raises(CredentialsError):
        provider.create_instance(InstanceRequest("j", "j-n0-1", 0, offering(provider, "T4"), "us-central1-a"))


def test_401_with_credentials_that_cannot_refresh(provider, gce):
    gce.deny(401)
    with pytest.raises(CredentialsError):
        provider.check()


def test_403_on_insert_is_a_credentials_error(provider, gce):
    gce.deny(403)
    with pytest.raises(CredentialsError) as info:
        provider.provision("j", "j-n0-5555", 0, offering(provider, "T4"))
    assert "permission" in info.value.message


def test_check_passes_against_the_emulator(provider):
    provider.check()


def test_missing_default_credentials_is_one_line(monkeypatch, tmp_path):
    for var in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT",
                "SFTCTL_GCE_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud ADC file there
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # not on GCE: skip the metadata server probe
    with pytest.raises(CredentialsError) as info:
        GCPProvider(project="p").check()
    e = info.value
    assert "\n" not in e.message and e.message.startswith("gcp: ")
    assert "gcloud auth application-default login" in e.hint and "GOOGLE_APPLICATION_CREDENTIALS" in e.hint
    assert e.exit_code == ExitCode.PROVIDER


def test_importing_the_provider_does_not_import_the_sdk():
    import subprocess

    code = ("import sys, sftctl.providers.gcp; "
            "print(any(m.startswith(('google.cloud.compute', 'google.auth')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------ the emulator itself


def _insert_body(**overrides) -> dict:
    body = {"name": "raw-1", "machineType": "zones/us-central1-a/machineTypes/g2-standard-4",
            "disks": [{"boot": True, "initializeParams": {
                "sourceImage": "projects/debian-cloud/global/images/family/debian-12"}}],
            "networkInterfaces": [{"network": "global/networks/default"}],
            "scheduling": {"onHostMaintenance": "TERMINATE"}}
    body.update(overrides)
    return body


def _post(gce, path: str, body) -> requests.Response:
    return requests.post(f"{gce.url}/compute/v1/projects/{gce.project}/{path}", data=json.dumps(body),
                         headers={"Content-Type": "application/json"}, timeout=10)


def test_emulator_rejects_unknown_fields(gce):
    r = _post(gce, "zones/us-central1-a/instances", _insert_body(acceleratorz=[{"count": 1}]))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == 400 and err["status"] == "INVALID_ARGUMENT"
    assert 'Unknown name "acceleratorz"' in err["message"] and err["errors"][0]["reason"] == "invalid"
    r = _post(gce, "zones/us-central1-a/instances", _insert_body(scheduling={"onHostMaintenance": "TERMINATE",
                                                                             "spotty": True}))
    assert r.status_code == 400 and "instance_resource.scheduling" in r.json()["error"]["message"]
    r = requests.get(f"{gce.url}/compute/v1/projects/{gce.project}/zones?maxResultz=1", timeout=10)
    assert r.status_code == 400 and "Cannot bind query parameter" in r.json()["error"]["message"]
    assert gce.instances == {}


def test_emulator_validates_like_gce(gce):
    r = _post(gce, "zones/us-central1-a/instances", _insert_body(scheduling={}))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Instances with guest accelerators do not support live migration."
    for missing in ("name", "machineType", "disks"):
        body = _insert_body()
        del body[missing]
        r = _post(gce, "zones/us-central1-a/instances", body)
        assert r.status_code == 400 and r.json()["error"]["errors"][0]["reason"] in ("required", "invalid"), missing
    r = _post(gce, "zones/us-central1-a/instances", _insert_body(labels={"sftctl-job": "Not Valid"}))
    assert r.status_code == 400 and "Label value" in r.json()["error"]["message"]
    r = _post(gce, "zones/us-central1-a/instances", _insert_body(name="Bad_Name"))
    assert r.status_code == 400
    assert gce.instances == {}


def test_emulator_operations_and_instances_advance_per_poll(gce):
    r = _post(gce, "zones/us-central1-a/instances", _insert_body())
    assert r.status_code == 200
    op = r.json()
    assert op["status"] == "PENDING" and op["operationType"] == "insert"
    base = f"{gce.url}/compute/v1/projects/{gce.project}/zones/us-central1-a"
    seen = [requests.get(f"{base}/operations/{op['name']}", timeout=10).json()["status"] for _ in range(3)]
    assert seen == ["RUNNING", "DONE", "DONE"]
    states = [requests.get(f"{base}/instances/raw-1", timeout=10).json()["status"] for _ in range(4)]
    assert states == ["PROVISIONING", "STAGING", "RUNNING", "RUNNING"]
    r = requests.get(f"{base}/instances/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["errors"][0]["reason"] == "notFound"
    r = _post(gce, "zones/us-central1-a/instances", _insert_body())
    assert r.status_code == 409
