"""The AWS provider against moto's server over HTTP (the ``aws`` fixture), with a fault-injecting
reverse proxy (``tests/aws_faults.py``) for the errors moto cannot produce: no capacity in a zone,
a vCPU quota, throttling, refused credentials."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import boto3
import pytest

from sftctl.catalog import cloud_offerings
from sftctl.errors import CapacityError, CredentialsError, ExitCode
from sftctl.providers.aws import DLAMI_NAME_PATTERN, AWSProvider, quota_for
from sftctl.providers.base import NodeState, provision_all
from sftctl.providers.cloud import InstanceRequest, InstanceState, label_value
from sftctl.types import AWSHandle

from aws_faults import VCPU_MESSAGE, fault_proxy
from conftest import REPO, deadline, wait_for

REGION = "us-east-1"
P4D_ZONES = ["us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d"]  # moto's instance type offerings


def offering(instance_type: str = "p4d.24xlarge", region: str = REGION):
    return next(o for o in cloud_offerings()
                if o.provider == "aws" and o.instance_type == instance_type and o.region == region)


def provider(**kw) -> AWSProvider:
    return AWSProvider(**{"poll_s": 0.05, "teardown_timeout_s": 30.0, **kw})


def ec2(region: str = REGION):
    return boto3.client("ec2", region_name=region)


@pytest.fixture
def job() -> str:
    return f"Job_{uuid.uuid4().hex[:10]}"  # upper case and "_": tags carry label_value(job)


_AMI: list[str] = []


@pytest.fixture
def ami(aws) -> str:
    """An image moto knows (listing moto's ~1300 images takes a second: once per session)."""
    if not _AMI:
        _AMI.append(ec2().describe_images(Owners=["amazon"])["Images"][0]["ImageId"])
    return _AMI[0]


@pytest.fixture
def proxy(aws, monkeypatch):
    """A fault proxy in front of moto; this test's boto3 clients talk to it."""
    with fault_proxy(aws) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        yield p


def job_groups(job: str, region: str = REGION) -> list[dict]:
    return ec2(region).describe_security_groups(
        Filters=[{"Name": "tag:sftctl-job", "Values": [label_value(job)]}])["SecurityGroups"]


def test_end_to_end_two_nodes(aws, job, ami):
    p = provider()
    p.check()
    handles = provision_all(p, job, [("node-0", 0), ("node-1", 1)], offering(), image=ami)
    assert [h.node_id for h in handles] == ["node-0", "node-1"]
    for h in handles:
        assert isinstance(h, AWSHandle) and h.id and h.sg
        assert (h.region, h.zone, h.instance_type, h.spot) == (REGION, "us-east-1a", "p4d.24xlarge", False)
        assert p.describe(h) == InstanceState.RUNNING
        assert p.status(h).state == NodeState.READY
        assert h.ip.count(".") == 3 and not h.ip.startswith("127.")  # the rendezvous address
    assert handles[0].sg == handles[1].sg and handles[0].ip != handles[1].ip

    # one security group per job: inbound only from itself, nothing from the internet
    (group,) = job_groups(job)
    assert group["GroupId"] == handles[0].sg and group["GroupName"] == f"sftctl-{label_value(job)}"
    (rule,) = group["IpPermissions"]
    assert rule["IpProtocol"] == "-1" and not rule.get("IpRanges") and not rule.get("Ipv6Ranges")
    assert [g["GroupId"] for g in rule["UserIdGroupPairs"]] == [group["GroupId"]]

    listed = sorted(p.list_instances(job), key=lambda d: d["node_id"])
    assert [(d["id"], d["node_id"], d["job_id"]) for d in listed] == [
        (h.id, h.node_id, label_value(job)) for h in handles]

    assert AWSProvider(poll_s=0.05).terminate_tagged(job) == 2  # a fresh object: state from tags alone
    assert p.list_instances(job) == []
    assert all(p.describe(h) == InstanceState.GONE for h in handles)
    assert job_groups(job) == []
    assert p.terminate_tagged(job) == 0  # idempotent


def test_tags_on_instances_and_volumes(aws, job, ami):
    p = provider()
    (h,) = provision_all(p, job, [("n0", 0)], offering("g6.xlarge"), image=ami)
    (inst,) = [i for r in ec2().describe_instances(InstanceIds=[h.id])["Reservations"] for i in r["Instances"]]
    want = {"sftctl-managed": "true", "sftctl-job": label_value(job), "sftctl-node": "n0",
            "Name": f"sftctl-{label_value(job)}-n0"}
    assert {t["Key"]: t["Value"] for t in inst["Tags"]} == want
    volumes = ec2().describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": [h.id]}])["Volumes"]
    assert volumes and all({t["Key"]: t["Value"] for t in v["Tags"]} == want for v in volumes)
    assert inst["MetadataOptions"]["HttpTokens"] == "required"
    p.terminate_tagged(job)


def test_spot_market_options_reach_ec2(proxy, job, ami):
    p = provider()
    (h,) = provision_all(p, job, [("n0", 0)], offering("g6.xlarge"), spot=True, image=ami)
    assert h.spot is True
    (sent,) = proxy.run_instances()
    assert sent["InstanceMarketOptions.MarketType"] == "spot"
    assert sent["InstanceMarketOptions.SpotOptions.SpotInstanceType"] == "one-time"
    assert sent["InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior"] == "terminate"
    assert "KeyName" not in sent and "IamInstanceProfile.Name" not in sent  # none by default
    (inst,) = [i for r in ec2().describe_instances(InstanceIds=[h.id])["Reservations"] for i in r["Instances"]]
    assert inst["InstanceLifecycle"] == "spot"
    assert p.list_instances(job)[0]["spot"] is True
    p.terminate_tagged(job)


def test_key_pair_and_instance_profile_reach_ec2(proxy, job, ami):
    boto3.client("iam").create_instance_profile(InstanceProfileName=f"sftctl-{job}")
    ec2().create_key_pair(KeyName=f"sftctl-{job}")
    p = provider(key_name=f"sftctl-{job}", instance_profile=f"sftctl-{job}")
    p.provision(job, "n0", 0, offering("g6.xlarge"), image=ami)
    (sent,) = proxy.run_instances()
    assert sent["KeyName"] == f"sftctl-{job}" and sent["IamInstanceProfile.Name"] == f"sftctl-{job}"
    p.terminate_tagged(job)


def test_user_data_round_trips_and_holds_no_secret(aws, job, ami, monkeypatch):
    secret = f"sEcReT{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    bootstrap = "#!/bin/bash\nset -e\necho 'node 0 of job'\npython3 -m sftctl.agent &\n"
    p = provider()
    (h,) = provision_all(p, job, [("n0", 0)], offering("g6.xlarge"), bootstrap=bootstrap, image=ami)
    attr = ec2().describe_instance_attribute(InstanceId=h.id, Attribute="userData")
    user_data = base64.b64decode(attr["UserData"]["Value"]).decode()
    assert user_data == bootstrap
    for value in (secret, os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SESSION_TOKEN"]):
        assert value not in user_data
    p.terminate_tagged(job)


def test_blocked_zone_fails_over_to_the_next(proxy, job, ami):
    proxy.blocked = {("p4d.24xlarge", "us-east-1a")}
    p = provider()
    (h,) = provision_all(p, job, [("n0", 0)], offering(), image=ami)
    assert h.zone == "us-east-1b"
    assert [r["Placement.AvailabilityZone"] for r in proxy.run_instances()] == ["us-east-1a", "us-east-1b"]
    assert ("p4d.24xlarge", "us-east-1a") in p.blocked_zones
    # the next node of the job goes straight to the zone that worked
    h2 = p.provision(job, "n1", 1, offering(), image=ami)
    assert h2.zone == "us-east-1b" and len(proxy.run_instances()) == 3
    assert p.terminate_tagged(job) == 2


def test_all_zones_exhausted_is_offering_scope(proxy, job, ami):
    proxy.blocked = {("p4d.24xlarge", z) for z in P4D_ZONES}
    with pytest.raises(CapacityError) as err:
        provision_all(provider(), job, [("n0", 0), ("n1", 1)], offering(), image=ami, max_parallel=1)
    e = err.value
    assert (e.scope, e.code, e.region, e.instance_type) == ("offering", "InsufficientInstanceCapacity", REGION, "p4d.24xlarge")
    assert e.exit_code == ExitCode.PROVIDER
    # each zone that sells p4d was asked once (botocore's own retries of HTTP 500 are off; the
    # second node knew every zone blocked); us-east-1e/f, which do not sell p4d, were never asked
    zones = [r["Placement.AvailabilityZone"] for r in proxy.run_instances()]
    assert zones == P4D_ZONES
    assert provider().list_instances(job) == []


def test_vcpu_quota_is_region_scope_with_quota_code(proxy, job, ami):
    proxy.run_error = ("VcpuLimitExceeded", 400, VCPU_MESSAGE)
    with pytest.raises(CapacityError) as err:
        provider().provision(job, "n0", 0, offering(), image=ami)
    e = err.value
    assert (e.scope, e.code, e.region) == ("region", "VcpuLimitExceeded", REGION)
    assert "L-417A185B" in e.hint and "Running On-Demand P instances" in e.message
    assert len(proxy.run_instances()) == 1  # a quota is not a zone problem: no other zone was tried
    assert "\n" not in e.message


def test_throttling_is_retried_with_one_client_token(proxy, job, ami):
    proxy.throttle_run_instances = 2
    p = provider()
    (h,) = provision_all(p, job, [("n0", 0)], offering("g6.xlarge"), image=ami)
    assert p.describe(h) == InstanceState.RUNNING
    sent = proxy.run_instances()
    assert len(sent) == 3
    assert len({r["ClientToken"] for r in sent}) == 1  # a retried RunInstances cannot launch twice
    p.terminate_tagged(job)


def test_refused_credentials_are_credentials_errors(proxy, job, ami):
    proxy.auth_failure = True
    with pytest.raises(CredentialsError) as err:
        provider().check()
    assert "InvalidClientTokenId" in err.value.message and "AWS_PROFILE" in err.value.hint
    assert err.value.exit_code == ExitCode.PROVIDER == 4
    with pytest.raises(CredentialsError) as err:
        provider().provision(job, "n0", 0, offering(), image=ami)
    assert "AuthFailure" in err.value.message
    assert not any(a == "RunInstances" for a, _ in proxy.actions)


def test_missing_credentials(aws, tmp_path, monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    p = provider()
    with pytest.raises(CredentialsError) as err:
        p.check()
    assert err.value.message.startswith("aws: no usable credentials")
    assert "AWS_ACCESS_KEY_ID" in err.value.hint and "aws configure" in err.value.hint
    # offerings still come from the catalog
    assert {o.region for o in p.offerings("H100", 8)} >= {"us-east-1", "us-west-2", "eu-north-1"}


def test_offerings(aws):
    p = provider()
    got = p.offerings("a100-40gb", 8)
    assert {o.instance_type for o in got} == {"p4d.24xlarge"}
    assert {o.region for o in got} >= {"us-east-1", "us-west-2", "eu-west-1", "ap-northeast-1"}
    assert p.offerings("A100-40GB", 4) == []
    assert {o.instance_type for o in p.offerings("L4", 1)} == {"g6.xlarge", "g6.2xlarge"}  # the snapshot adds g6.2xlarge


def test_default_image_from_ssm_parameter(aws, job, ami):
    # moto refuses parameters under /aws/, so the name is configurable; the default is the DLAMI's
    name = f"/sftctl-test/{uuid.uuid4().hex}/ami-id"
    boto3.client("ssm", region_name=REGION).put_parameter(Name=name, Value=ami, Type="String")
    p = provider(ami_parameter=name)
    h = p.provision(job, "n0", 0, offering("g6.xlarge"))
    (inst,) = [i for r in ec2().describe_instances(InstanceIds=[h.id])["Reservations"] for i in r["Instances"]]
    assert inst["ImageId"] == ami
    p.terminate_tagged(job)


def test_default_image_falls_back_to_describe_images(aws, job, ami):
    tag = uuid.uuid4().hex
    builder = ec2().run_instances(ImageId=ami, InstanceType="t3.micro", MinCount=1, MaxCount=1)["Instances"][0]
    image = ec2().create_image(InstanceId=builder["InstanceId"], Name=DLAMI_NAME_PATTERN[:-1] + f" {tag}")["ImageId"]
    ec2().terminate_instances(InstanceIds=[builder["InstanceId"]])
    p = provider(ami_parameter=f"/sftctl-test/{tag}/missing", ami_name_pattern=DLAMI_NAME_PATTERN[:-1] + f" {tag}*",
                 ami_owners=("self",))
    assert p.default_image(REGION) == image
    h = p.provision(job, "n0", 0, offering("g6.xlarge"))
    (inst,) = [i for r in ec2().describe_instances(InstanceIds=[h.id])["Reservations"] for i in r["Instances"]]
    assert inst["ImageId"] == image
    p.terminate_tagged(job)


def test_delete_is_idempotent(aws, job, ami):
    p = provider()
    h = p.provision(job, "n0", 0, offering("g6.xlarge"), image=ami)
    p.terminate(h)
    p.terminate(h)
    gone = AWSHandle(job_id="j", node_id="j-n0", rank=0, id="i-0123456789abcdef0", region=REGION)
    p.delete_instance(gone)
    assert provider().describe(gone) == InstanceState.GONE
    p.terminate_tagged(job)


def test_a_batch_with_an_instance_already_gone_terminates_the_rest(aws, job, ami):
    """TerminateInstances refuses a whole batch when one id is gone; the instances are then
    terminated one by one (the fallback once handed delete_instance a dict: AttributeError)."""
    p = provider()
    h = p.provision(job, "n0", 0, offering("g6.xlarge"), image=ami)
    p._terminate_ids(REGION, [h.id, "i-0123456789abcdef0"])
    assert provider().describe(h) == InstanceState.GONE
    p.terminate_tagged(job)


def test_describe_calls_are_coalesced(proxy, job, ami):
    """Nodes polled together share DescribeInstances calls (EC2 throttles Describe* per account)."""
    p = provider(poll_s=1.0)
    labels = {"sftctl-managed": "true", "sftctl-job": label_value(job)}
    handles = [p.create_instance(InstanceRequest(job, f"n{i}", i, offering("g6.xlarge"), "us-east-1a",
                                                 labels=labels, image=ami)) for i in range(12)]
    proxy.delay_s = {"DescribeInstances": 0.2}

    def poll_round() -> int:
        before = sum(a == "DescribeInstances" for a, _ in proxy.actions)
        barrier = threading.Barrier(len(handles))
        states = [None] * len(handles)

        def one(k):
            barrier.wait()
            states[k] = p.describe(handles[k])

        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(handles))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(s in (InstanceState.PENDING, InstanceState.RUNNING) for s in states)
        return sum(a == "DescribeInstances" for a, _ in proxy.actions) - before

    poll_round()  # the first round may ask once per node: nothing is known yet
    time.sleep(0.6)  # the answers are now older than poll_s / 2
    assert poll_round() <= 2  # one call answers every node watched
    assert p.terminate_tagged(job) == 12


CHILD = """
import sys
from sftctl.catalog import cloud_offerings
from sftctl.providers.aws import AWSProvider
from sftctl.providers.base import provision_all
job, ami = sys.argv[1], sys.argv[2]
off = next(o for o in cloud_offerings() if o.provider == "aws" and o.instance_type == "g6.xlarge" and o.region == "us-east-1")
provision_all(AWSProvider(poll_s=0.05), job, [(f"n{i}", i) for i in range(8)], off, max_parallel=2, image=ami)
print("finished", flush=True)
"""


def test_kill_9_mid_provisioning_then_terminate_tagged_leaves_nothing(proxy, job, ami):
    # the first two RunInstances land, the next ones are held at the proxy: the child is killed
    # mid-provisioning however fast or slow the machine (before, it was killed once its first
    # instance showed, and a busy machine's watcher could see that only after all 8 had landed)
    proxy.hold_run_instances_after = 2
    child = subprocess.Popen([sys.executable, "-c", CHILD, job, ami], cwd=REPO, env=dict(os.environ),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher = provider()
    # both of the child's workers (max_parallel=2) wait on a held RunInstances: it sends no other
    wait_for(lambda: proxy.held == 2 or child.poll() is not None, timeout_s=120,
             what="the child's RunInstances to be held", report=lambda: f"held {proxy.held}, child rc {child.poll()}")
    assert len(watcher.list_instances(job)) == 2
    child.send_signal(signal.SIGKILL)
    out, err = child.communicate(timeout=deadline(30))
    assert child.returncode == -signal.SIGKILL and "finished" not in out, err
    # the RunInstances the child had in flight still land at EC2 after the kill
    proxy.release.set()
    wait_for(lambda: proxy.inflight == 0, timeout_s=30, what="in-flight requests")
    created = len(watcher.list_instances(job))
    assert created == len(proxy.run_instances()) == 4  # two landed before the kill, two after

    assert AWSProvider(poll_s=0.05).terminate_tagged(job) == created
    assert watcher.list_instances(job) == []
    assert job_groups(job) == []


def test_import_does_not_load_boto3():
    code = "import sys, sftctl.providers.aws, sftctl.providers; assert 'boto3' not in sys.modules, 'boto3 loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_quota_codes():
    assert quota_for("p5.48xlarge", spot=False) == ("Running On-Demand P instances", "L-417A185B")
    assert quota_for("p4d.24xlarge", spot=True) == ("All P Spot Instance Requests", "L-7212CCBC")
    assert quota_for("g6.xlarge", spot=False)[1] == "L-DB2E81BA"
    assert quota_for("g5.xlarge", spot=True)[1] == "L-3819A6DF"
    assert quota_for("m7i.large", spot=False)[1] == "L-1216C47A"
    assert quota_for("trn1.32xlarge", spot=False) is None


def test_instance_profile_from_the_spec_or_the_shell_reaches_ec2(proxy, job, ami, monkeypatch):
    """Issue 14.7: nodes read S3 job storage through an instance profile the spec (or
    $SFTCTL_AWS_INSTANCE_PROFILE) names; before, nothing could set it."""
    import dataclasses

    from sftctl.controller import job_provider
    from sftctl.spec import JobSpec
    from sftctl.types import JobRecord

    iam = boto3.client("iam")
    for name in (f"spec-{job}", f"shell-{job}"):
        iam.create_instance_profile(InstanceProfileName=name)
    boto3.client("s3").create_bucket(Bucket="sftctl-profile-test")
    spec = {"name": "p", "run": "true", "storage": "s3://sftctl-profile-test/jobs",
            "resources": {"accelerators": ["L4:1"], "instance_profile": f"spec-{job}"}}
    doc = JobRecord(id=job, name="p", status="RUNNING", provider="aws", created_at=0.0, updated_at=0.0,
                    spec=JobSpec.model_validate(spec).model_dump(mode="json"))
    monkeypatch.setenv("SFTCTL_AWS_INSTANCE_PROFILE", f"shell-{job}")
    p = job_provider(doc)
    p.poll_s = 0.05
    p.provision(job, "n0", 0, offering("g6.xlarge"), image=ami)
    p2 = job_provider(dataclasses.replace(doc, spec=JobSpec.model_validate(
        {**spec, "resources": {"accelerators": ["L4:1"]}}).model_dump(mode="json")))
    p2.poll_s = 0.05
    p2.provision(job, "n1", 1, offering("g6.xlarge"), image=ami)
    sent = proxy.run_instances()
    assert [s["IamInstanceProfile.Name"] for s in sent] == [f"spec-{job}", f"shell-{job}"]
    p.terminate_tagged(job)


def test_a_request_cut_off_by_a_killed_client_is_not_left_in_flight(proxy):
    """The fault proxy (tests/aws_faults.py) itself: a client killed mid-request leaves a body
    shorter than its Content-Length. The proxy passed it on to moto with that length, and moto
    waited for the rest until the proxy's 60 s upstream timeout, so the kill -9 test above timed
    out waiting for in-flight requests (54 s, a quiet run). Now it drops such a request."""
    import socket
    import urllib.parse

    host, port = urllib.parse.urlsplit(proxy.url).hostname, urllib.parse.urlsplit(proxy.url).port
    with socket.create_connection((host, port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                  b"Content-Length: 100\r\n\r\nAction=RunInstances")
        wait_for(lambda: proxy.inflight == 1, timeout_s=10, what="the request to reach the proxy")
    # the client is gone with 80 bytes unsent
    wait_for(lambda: proxy.inflight == 0, timeout_s=10, what="the cut-off request to be dropped")
    assert proxy.run_instances() == []  # never forwarded
