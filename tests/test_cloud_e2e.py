"""`sftctl run` on AWS end to end, over HTTP against moto's server: plan, fail over from an
offering with no capacity, provision through the AWS provider, boot the nodes' real user-data
(tests/node_sim.py plays EC2's part), train through the job's S3 storage, tear down; and the
crash-safety and credentials paths of the CLI."""

from __future__ import annotations

import json
import os
import signal
import time

import boto3
import pytest

from aws_faults import fault_proxy
from conftest import REPO, sftctl, status_json, wait_for
from node_sim import Ec2NodeSimulator

SPEC = """\
name: cloud-e2e
workdir: {repo}
model: {{framework: torch, entrypoint: examples/gpt/model.py:build, batch_size: 8}}
train: {{steps: 12, checkpoint_interval: 6}}
resources: {{accelerators: ["L4:1"], nodes: 2, clouds: [aws], regions: [us-east-1, us-west-2], image: {ami}}}
storage: s3://cloud-e2e/runs
health: {{enabled: false}}
env: {{OMP_NUM_THREADS: 1}}
run: >-
  torchrun --nnodes="$SFTCTL_NUM_NODES" --nproc-per-node="$SFTCTL_NPROC_PER_NODE"
  --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$MASTER_PORT" --rdzv-id="$SFTCTL_JOB_ID"
  --rdzv-conf=is_host="$SFTCTL_RDZV_IS_HOST" examples/gpt/train.py
"""


def _instances(job: str | None = None, states=("pending", "running", "stopping", "shutting-down")) -> list[dict]:
    out = []
    for region in ("us-east-1", "us-west-2"):
        filters = [{"Name": "tag:sftctl-managed", "Values": ["true"]},
                   {"Name": "instance-state-name", "Values": list(states)}]
        if job:
            filters.append({"Name": "tag:sftctl-job", "Values": [job]})
        for res in boto3.client("ec2", region_name=region).describe_instances(Filters=filters)["Reservations"]:
            out += [{**i, "region": region} for i in res["Instances"]]
    return out


@pytest.fixture
def spec(aws, tmp_path):
    boto3.client("s3").create_bucket(Bucket="cloud-e2e")
    ami = boto3.client("ec2", region_name="us-east-1").describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    path = tmp_path / "cloud.yaml"
    path.write_text(SPEC.format(repo=REPO, ami=ami))
    return path


def test_run_on_aws_fails_over_trains_through_s3_and_leaves_nothing(home, aws, spec, tmp_path):
    zones = [z["ZoneName"] for z in boto3.client("ec2", region_name="us-east-1")
             .describe_availability_zones()["AvailabilityZones"]]
    sim = Ec2NodeSimulator(tmp_path / "instances", env={"AWS_ENDPOINT_URL": aws})
    sim.start()
    try:
        with fault_proxy(aws) as proxy:
            proxy.blocked = {("g6.xlarge", z) for z in zones}  # us-east-1 has no g6.xlarge capacity
            proc = sftctl("run", str(spec), "--json", timeout=600,
                          env={**os.environ, "AWS_ENDPOINT_URL": proxy.url})
    finally:
        sim.close()
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED", doc.get("failure_reason")
    assert [r["step"] for r in doc["ranks"]] == [12, 12]
    events = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    capacity = [e["message"] for e in events if e["kind"] == "capacity"]
    assert len(capacity) == 1 and "no capacity for g6.xlarge in us-east-1" in capacity[0], capacity
    assert "g6.xlarge in us-east-1 blocked for this job" in capacity[0]
    assert "trying aws g6.xlarge in us-west-2" in capacity[0]
    # the nodes that trained were us-west-2 instances, booted from the real user-data
    assert {region for region, _ in sim.booted} == {"us-west-2"} and len(sim.booted) == 2
    assert _instances(doc["id"]) == []  # every instance terminated
    # logs came back through the bucket
    logs = sftctl("logs", doc["id"], check=True).stdout
    assert "step 12" in logs or "saved checkpoint" in logs, logs[-2000:]


def test_kill_9_of_the_controller_while_provisioning_then_down_leaves_nothing(home, aws, spec):
    with fault_proxy(aws) as proxy:
        proxy.run_delay_s = 1.0  # each RunInstances takes a second: the kill lands mid-provisioning
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url}
        job = json.loads(sftctl("run", str(spec), "--detach", "--json", env=env, check=True).stdout)["job_id"]
        wait_for(lambda: _instances(job), timeout_s=120, what="the first instance")
        pid = status_json(job)["controller_pid"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(2.5)  # a RunInstances already sent still completes: down must find it by tag
        assert status_json(job)["status"] == "FAILED_CONTROLLER"
        down = sftctl("down", job, env=env)
        assert down.returncode == 0, down.stderr
    assert _instances(job) == []
    assert json.loads(sftctl("down", "--orphans", "--json", check=True).stdout)["orphans"] == []


def test_bad_credentials_exit_4_with_one_line(home, aws, spec):
    with fault_proxy(aws) as proxy:
        proxy.auth_failure = True
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url}
        check = sftctl("check", "aws", env=env)
        assert check.returncode == 4
        assert "aws" in check.stdout and "no" in check.stdout
        run = sftctl("run", str(spec), env=env)
    assert run.returncode == 4, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    # the job's storage is checked first, before any instance: the same credentials fail there
    assert len(errors) == 1 and "access denied" in errors[0] and "s3://cloud-e2e" in errors[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert _instances() == [] or all(i["State"]["Name"] == "terminated" for i in _instances())


def test_check_without_credentials_says_what_to_set(home, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "KUBE", "CLOUDSDK"))}
    env.update(HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "none"))
    proc = sftctl("check", "--json", env=env)
    assert proc.returncode == 0  # none named, and local works (tests/test_ux.py: a named cloud that does not: 4)
    rows = {r["cloud"]: r for r in json.loads(proc.stdout)["clouds"]}
    assert rows["local"]["ok"] is True
    assert "AWS_PROFILE" in rows["aws"]["reason"] and rows["aws"]["ok"] is False
    assert "gcloud auth application-default login" in rows["gcp"]["reason"]
    assert "KUBECONFIG" in rows["kubernetes"]["reason"]


SECRET_SPEC = """\
name: cloud-secret
workdir: {workdir}
resources: {{accelerators: ["L4:1"], nodes: 1, clouds: [aws], regions: [us-west-2], image: {ami}}}
storage: s3://cloud-e2e/runs
health: {{enabled: false}}
secrets: [E2E_API_TOKEN]
env: {{DERIVED: "x-${{E2E_API_TOKEN}}"}}
run: python check.py
"""

CHECK = """\
import os, sys
ok = os.environ.get("E2E_API_TOKEN") == "tok-5ecr3t-%s" and os.environ.get("DERIVED") == "x-tok-5ecr3t-%s"
print("secrets arrived" if ok else "secrets missing: " + repr(sorted(k for k in os.environ if "E2E" in k)))
sys.exit(0 if ok else 3)
"""


def test_secrets_reach_aws_nodes_through_secrets_manager_and_are_deleted_with_the_job(home, aws, tmp_path):
    """Issue 23 item 4: an AWS node gets the job's secret values from Secrets Manager (its
    bootstrap carries only the secret's name), job storage and user data never hold a value, and
    the secret is gone when the job ends."""
    import base64
    import secrets as pysecrets

    nonce = pysecrets.token_hex(4)
    value = f"tok-5ecr3t-{nonce}"
    boto3.client("s3").create_bucket(Bucket="cloud-e2e")
    ami = boto3.client("ec2", region_name="us-west-2").describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "check.py").write_text(CHECK % (nonce, nonce))
    spec = tmp_path / "secret.yaml"
    spec.write_text(SECRET_SPEC.format(workdir=workdir, ami=ami))
    sim = Ec2NodeSimulator(tmp_path / "instances", regions=("us-west-2",), env={"AWS_ENDPOINT_URL": aws})
    sim.start()
    try:
        proc = sftctl("run", str(spec), "--json", timeout=600, env={**os.environ, "E2E_API_TOKEN": value})
        user_data = [base64.b64decode(boto3.client("ec2", region_name="us-west-2").describe_instance_attribute(
            InstanceId=i, Attribute="userData")["UserData"]["Value"]).decode() for _, i in sim.booted]
    finally:
        sim.close()
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED", doc.get("failure_reason")
    assert "secrets arrived" in sftctl("logs", doc["id"], check=True).stdout
    assert len(user_data) == 1 and f"SFTCTL_SECRETS_REF=aws-sm://us-east-1/sftctl/{doc['id']}" in user_data[0]
    assert value not in user_data[0] and nonce not in proc.stdout + proc.stderr
    s3 = boto3.client("s3")
    for obj in s3.list_objects_v2(Bucket="cloud-e2e").get("Contents", []):
        assert nonce.encode() not in s3.get_object(Bucket="cloud-e2e", Key=obj["Key"])["Body"].read(), obj["Key"]
    sm = boto3.client("secretsmanager", region_name="us-east-1")
    assert [s["Name"] for s in sm.list_secrets()["SecretList"] if doc["id"] in s["Name"]] == []
    assert _instances(doc["id"]) == []
