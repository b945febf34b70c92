"""GPU health end to end on the local provider: a throttling node and a hung node are caught,
replaced, and the quickstart resumes from its checkpoint and finishes."""

from __future__ import annotations

import json
import os
import re
import signal

from conftest import job_processes, process_report, sftctl, status_json, wait_for

# Two ranks share this 2-core machine with the controller and the agents, so their forward
# times are noisier than a GPU's: the straggler ratio is 2x here (1.3x by default).
QUICK = ["--set", "train.steps=90", "--set", "train.checkpoint_interval=15", "--set", "model.batch_size=8",
         "--set", "health.interval_s=1", "--set", "health.throttle_window_s=3",
         "--set", "health.straggler_ratio=2"]


def events(job_id: str) -> list[dict]:
    return json.loads(sftctl("events", job_id, "--json", check=True).stdout)["events"]


def final_loss(doc: dict) -> float:
    return next(r["loss"] for r in doc["ranks"] if r["rank"] == 0)


def test_throttling_node_is_replaced_and_training_resumes(home):
    """Node 1's agent replays HW slowdown from step 40 on (tests/fixtures/throttle_at_step.jsonl).
    Its verdict takes interval + window (4 s) of wall time after step 40: 240 small steps leave
    room for that however fast this machine trains."""
    quick = QUICK + ["--set", "train.steps=240"]
    clean = sftctl("run", "examples/quickstart.yaml", *quick, "--json")
    assert clean.returncode == 0, clean.stderr[-2000:]
    clean_doc = json.loads(clean.stdout)
    assert clean_doc["restarts"] == 0
    assert not [e for e in events(clean_doc["id"]) if e["kind"] == "health"]  # no false alarm

    proc = sftctl("run", "examples/quickstart.yaml", *quick,
                  "--set", "env.SFTCTL_TELEMETRY_REPLAY=tests/fixtures/throttle_at_step.jsonl",
                  "--set", "env.SFTCTL_TELEMETRY_REPLAY_RANK=1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED" and doc["restarts"] == 1
    evs = events(doc["id"])
    health = [e for e in evs if e["kind"] == "health"]
    assert len(health) == 1 and health[0]["data"]["kind"] == "throttle"
    assert health[0]["data"]["node_rank"] == 1 and health[0]["data"]["action"] == "replace"
    assert "HW slowdown" in health[0]["message"]
    assert any(e["kind"] == "replace" and e["message"].startswith("node 1 replaced") for e in evs)
    assert [n["rank"] for n in doc["nodes"]] == [0, 1, 1]  # node 1 was replaced by a new node
    logs = sftctl("logs", doc["id"], check=True).stdout
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", logs)]
    assert len(resumed) == 1 and resumed[0] % 15 == 0 and 30 <= resumed[0] < 240  # the last checkpoint before the verdict
    # same batches per (rank, step) and an exact restore: the loss ends where the clean run's did
    assert abs(final_loss(doc) - final_loss(clean_doc)) < 0.05
    assert job_processes(doc["id"]) == []


def test_hung_node_is_caught_by_its_missing_heartbeat(home):
    job = json.loads(sftctl("run", "examples/quickstart.yaml", *QUICK, "--set", "health.hang_timeout_s=6",
                            "--detach", "--json", check=True).stdout)["job_id"]
    wait_for(lambda: any(r["step"] >= 20 for r in status_json(job).get("ranks", [])), timeout_s=180,
             what="training to reach step 20")
    node1 = next(n["id"] for n in status_json(job)["nodes"] if n["rank"] == 1)
    from sftctl import procs

    trainers = [p for p in procs.tagged("SFTCTL_NODE_ID", node1)
                if b"train.py" in open(f"/proc/{p}/cmdline", "rb").read() and b"torchrun" not in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(trainers) == 1
    os.kill(trainers[0], signal.SIGSTOP)  # frozen: alive, but neither steps nor heartbeats
    doc = wait_for(lambda: (d := status_json(job))["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER") and d,
                   timeout_s=240, what="the job to finish")
    assert doc["status"] == "SUCCEEDED", doc["failure_reason"]
    health = [e for e in events(job) if e["kind"] == "health"]
    assert [(e["data"]["kind"], e["data"]["node_rank"]) for e in health] == [("hang", 1)]
    # the controller records the end, then tears the nodes down: give it the time
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end",
             report=lambda: process_report(job))


def test_straggling_node_is_found_by_its_compute_time_and_replaced(home):
    """Node 1's forward pass becomes 3x slower from step 30 on. Whole-step times stay equal on
    both ranks (each waits in the all-reduce), so the detector must use the compute time."""
    proc = sftctl("run", "examples/quickstart.yaml", *QUICK,
                  "--set", "health.straggler_window_steps=5", "--set", "health.straggler_windows=3",
                  "--set", "env.SFTCTL_SLOW_NODE=1", "--set", "env.SFTCTL_SLOW_FACTOR=3",
                  "--set", "env.SFTCTL_SLOW_FROM_STEP=30", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED" and doc["restarts"] == 1
    health = [e for e in events(doc["id"]) if e["kind"] == "health"]
    assert [(e["data"]["kind"], e["data"]["node_rank"], e["data"]["action"]) for e in health] == [("straggler", 1, "replace")]
    assert [n["rank"] for n in doc["nodes"]] == [0, 1, 1]


STALLING_SCRIPT = '''\
import time
from sftctl.train import report

for step in range(1, 4):  # three steps, then stuck (a deadlocked collective, a data loader that waits)
    report(step=step, loss=1.0 / step)
    time.sleep(0.2)
time.sleep(3600)  # the heartbeat thread keeps beating: alive, no progress
'''


def test_a_stalled_job_fails_with_its_own_code(home, tmp_path):
    """Every process alive, heartbeats going, no step for twice the hang timeout: the stall
    verdict ends the attempt, and with no restart left the job fails with code ``stalled`` (the
    controller's verdict table had no stall entry: it was recorded as ``unknown``)."""
    (tmp_path / "stall.py").write_text(STALLING_SCRIPT)
    spec = tmp_path / "stall.yaml"
    spec.write_text(
        f"name: stall\nworkdir: {tmp_path}\ntrain: {{steps: 100}}\nresources: {{accelerators: ['cpu:1']}}\n"
        "recovery: {max_restarts: 0}\nhealth: {interval_s: 1, hang_timeout_s: 4}\n"
        "env: {SFTCTL_HEARTBEAT_S: '1'}\nrun: python stall.py\n")
    proc = sftctl("run", str(spec), "--json", timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "FAILED" and doc["failure_code"] == "stalled", doc
    assert "stall" in doc["failure_reason"] and "the job is stuck" in doc["failure_reason"]
    health = [e for e in events(doc["id"]) if e["kind"] == "health"]
    assert [(e["data"]["kind"], e["data"]["action"]) for e in health] == [("stall", "restart")]
    assert job_processes(doc["id"]) == []
