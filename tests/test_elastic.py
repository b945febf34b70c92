"""Elastic resume: a node of the quickstart is lost for good (the machine lends no replacement),
and with recovery.min_nodes the job resumes on the nodes that are left, keeping the global batch
by gradient accumulation, and finishes."""

from __future__ import annotations

import json
import re

import pytest

from conftest import sftctl, job_processes

pytest.importorskip("torch")

# The replayed throttle starts at step 40 and takes interval + window (4 s) to be judged: 200
# steps leave room for that however fast this machine trains (60 once finished before it).
QUICK = ["--set", "train.steps=200", "--set", "train.checkpoint_interval=15", "--set", "model.batch_size=8",
         "--set", "health.interval_s=1", "--set", "health.throttle_window_s=3"]


def test_lost_node_without_capacity_resumes_on_fewer_nodes(home, monkeypatch):
    monkeypatch.setenv("SFTCTL_LOCAL_MAX_NODES", "2")  # the two first nodes, no replacement
    proc = sftctl("run", "examples/quickstart.yaml", *QUICK, "--set", "recovery.min_nodes=1",
                  "--set", "env.SFTCTL_TELEMETRY_REPLAY=tests/fixtures/throttle_at_step.jsonl",
                  "--set", "env.SFTCTL_TELEMETRY_REPLAY_RANK=1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED" and doc["restarts"] == 1
    evs = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    elastic = [e for e in evs if e["kind"] == "elastic"]
    assert len(elastic) == 1 and elastic[0]["data"] == {"nodes": 1, "planned_nodes": 2, "grad_accum": 2}
    assert "could not be replaced" in elastic[0]["message"] and "global batch kept" in elastic[0]["message"]
    logs = sftctl("logs", doc["id"], check=True).stdout
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", logs)]
    assert len(resumed) == 1 and resumed[0] % 15 == 0 and resumed[0] >= 15
    assert "world_size 1 " in logs and "batch 4/rank x 2 accumulated" in logs  # same global batch of 8
    assert job_processes(doc["id"]) == []


def test_without_min_nodes_the_job_fails_as_before(home, monkeypatch):
    monkeypatch.setenv("SFTCTL_LOCAL_MAX_NODES", "2")
    proc = sftctl("run", "examples/quickstart.yaml", *QUICK,
                  "--set", "env.SFTCTL_TELEMETRY_REPLAY=tests/fixtures/throttle_at_step.jsonl",
                  "--set", "env.SFTCTL_TELEMETRY_REPLAY_RANK=1", "--json")
    assert proc.returncode == 4, proc.stderr[-3000:]  # a provider error, as a failed replacement was
    doc = json.loads(proc.stdout)
    assert doc["status"] == "FAILED"
    evs = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    assert any(e["kind"] == "elastic" and "recovery.min_nodes is 2" in e["message"] for e in evs)
