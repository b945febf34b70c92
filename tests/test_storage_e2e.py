"""Job storage end to end: the quickstart on local nodes that talk to the controller only through
an S3 bucket on moto's server, with one node lost mid-run and replaced by a fresh node that has
no local checkpoint, so the run can only resume from the bucket's checkpoint."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import boto3

from conftest import job_processes, process_report, sftctl, status_json, wait_for
from sftctl import procs

QUICKSTART = "examples/quickstart.yaml"


def _daemon_pid(node_id: str) -> int | None:
    """The node daemon (``python -m sftctl.node``) of a local node fed by job storage."""
    for pid in procs.tagged("SFTCTL_NODE_ID", node_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"sftctl.node" in a for a in cmd):
            return pid
    return None


def _bucket_keys(bucket: str, prefix: str = "") -> list[str]:
    s3 = boto3.client("s3")
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def test_quickstart_on_s3_replaces_a_lost_node_and_resumes_from_the_bucket(home, aws, tmp_path):
    boto3.client("s3").create_bucket(Bucket="sftctl-e2e")
    secret = "s3cr3t-value-never-stored"
    job = json.loads(sftctl(
        "run", QUICKSTART, "--detach", "--json",
        "--set", "storage=s3://sftctl-e2e/runs", "--set", "train.steps=40",
        "--set", "train.checkpoint_interval=10", "--set", "recovery.max_restarts=2",
        "--set", "health.enabled=false", "--set", "secrets=[HF_TOKEN]",
        env={**os.environ, "HF_TOKEN": secret}, check=True,
    ).stdout)["job_id"]
    prefix = f"runs/{job}/"
    # the first checkpoint is complete in the bucket: lose node 1 (its daemon dies, no exit code)
    wait_for(lambda: f"{prefix}checkpoints/step-00000010/MANIFEST.json" in _bucket_keys("sftctl-e2e", prefix),
             timeout_s=240, what="checkpoint 10 in the bucket")
    doc = status_json(job)
    node1 = next(n for n in doc["nodes"] if n["rank"] == 1)
    pid = wait_for(lambda: _daemon_pid(node1["id"]), timeout_s=30, what="node 1's daemon")
    os.kill(pid, signal.SIGKILL)

    wait_for(lambda: status_json(job)["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER"),
             timeout_s=400, what="the job to finish")
    doc = status_json(job)
    assert doc["status"] == "SUCCEEDED", doc.get("failure_reason")
    assert doc["restarts"] >= 1
    assert [r["step"] for r in doc["ranks"]] == [40, 40]
    events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
    replaced = [e["message"] for e in events if e["kind"] == "replace"]
    assert replaced and replaced[0].startswith("node 1 replaced"), events
    # the replacement node is a fresh directory: whatever resumed, resumed from the bucket
    logs = sftctl("logs", job, check=True).stdout
    resumed = [line for line in logs.splitlines() if "resumed from step" in line]
    assert resumed and all("resumed from step 0" not in line for line in resumed), logs[-3000:]
    keys = _bucket_keys("sftctl-e2e")
    assert f"{prefix}checkpoints/step-00000040/MANIFEST.json" in keys
    assert any(k.startswith("runs/workdir/") for k in keys)  # uploaded once, under the storage root
    # logs reached the controller through the bucket, and no secret value was stored anywhere
    assert any(k.startswith(f"{prefix}nodes/") and "/node.log/" in k for k in keys)
    s3 = boto3.client("s3")
    for key in keys:
        if "/workdir/" in key or key.startswith("runs/workdir/"):
            continue
        assert secret.encode() not in s3.get_object(Bucket="sftctl-e2e", Key=key)["Body"].read(), key
    assert secret not in (home / "state.db").read_bytes().decode("latin-1")
    # the controller records the end, then tears the nodes down: give it the time
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end",
             report=lambda: process_report(job))


def test_run_checks_the_bucket_first_and_creates_it_only_when_asked(home, aws, tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\nresources: {nodes: 1}\nrun: echo hi\n")
    proc = sftctl("run", str(spec), "--set", "storage=s3://sftctl-not-there/p")
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: storage s3://sftctl-not-there/p: the bucket sftctl-not-there does not exist")
    assert "create_bucket: true" in proc.stderr
    assert status_json()["jobs"] == []  # refused before anything was created
    # a string storage takes a field by --set; create_bucket makes the bucket
    sftctl("run", str(spec), "--set", "storage=s3://sftctl-made/p", "--set", "storage.create_bucket=true",
           check=True)
    assert "sftctl-made" in [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]
