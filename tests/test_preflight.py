"""Issue 41, preflight: each node checks itself against its predicted speed before training.

The detector is pure (records in, verdicts out); the node's check runs for real (a real CPU
matmul timed against this machine's reference, a fake ``dcgmi`` that reports a failed test); a
real two-node local job with a node made slow (it runs 8x the matmuls it times: the CPU
seconds it measures are real) gets ``preflight_slow``, is replaced before its first step and succeeds,
its healthy second attempt's preflight passing with its time reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, deadline, write_spec
from test_preflight_nodes import _replaced_once, _run, two_node_spec

from sftctl.health import detectors
from sftctl.health.detectors.preflight import judge
from sftctl.health.monitor import HealthMonitor
from sftctl.health.telemetry import Thresholds, VerdictKind
from sftctl.spec import load_spec
from sftctl.types import FailureCode


def _record(measured_s: float, predicted_s: float | None, **extra) -> dict:
    mm = {"gpu": 0, "shape": [8192, 8192, 8192], "dtype": "bfloat16", "flops": 2.0 * 8192 ** 3,
          "measured_s": measured_s, "predicted_s": predicted_s, "reference": "compiler"}
    return {"ts": 100.0, "preflight": {"when": "start", "level": "quick", "matmul": [mm], "errors": [], **extra}}


def test_a_slow_or_faulty_record_is_a_verdict_with_its_figures_and_a_healthy_one_is_none():
    # 2.2 ms predicted (the compiler's H100 figure is about that), measured 4.4 ms: 50% < 0.6
    slow = judge(_record(4.4e-3, 2.2e-3), 1, 0.6)
    assert [(v.kind, v.action, v.node_rank, v.gpu) for v in slow] == [("preflight_slow", "replace", 1, 0)]
    assert "GPU 0 matmul 8192x8192x8192 bfloat16 at 249.9 TFLOP/s, 50% of predicted 499.8 TFLOP/s (< 0.6)" in slow[0].evidence
    assert VerdictKind(slow[0].kind).code == FailureCode.PREFLIGHT_SLOW
    assert judge(_record(3.0e-3, 2.2e-3), 1, 0.6) == []  # 73%: within the fraction
    assert judge(_record(3.0e-3, None), 1, 0.6) == []  # no prediction: recorded, not judged
    assert judge(_record(3.0e-3, 2.2e-3), 1, 0.8)[0].kind == "preflight_slow"  # the threshold decides
    bad = judge(_record(2.2e-3, 2.2e-3, dcgm={"level": 1, "failed": ["PCIe (GPU 3): replay rate"]},
                        nvml={"problems": ["GPU 2: NVLink link(s) 4 down"], "notes": ["GPU 0: persistence mode off"]}),
                0, 0.6)
    assert [(v.kind, v.node_rank) for v in bad] == [("preflight_failed", 0)]
    assert bad[0].evidence == ("start check: dcgmi diag -r 1 failed: PCIe (GPU 3): replay rate; "
                               "GPU 2: NVLink link(s) 4 down")  # a note is no fault


def test_the_monitor_keeps_preflight_records_and_the_registry_judges_them():
    th = Thresholds(preflight_min_fraction=0.6)
    assert "preflight_slow" in detectors.KIND_ORDER and "preflight_failed" in detectors.KIND_ORDER
    mon = HealthMonitor(th, total_steps=10)
    mon.add_gpu(0, [_record(2.3e-3, 2.2e-3)])
    mon.add_gpu(1, [{"ts": 99.0, "gpu": 0, "clock_sm_mhz": 1980}, _record(9.0e-3, 2.2e-3)])
    verdicts = mon.verdicts(101.0)
    assert [(v.kind, v.node_rank) for v in verdicts] == [("preflight_slow", 1)]
    assert "24%" in verdicts[0].evidence
    mon.reset_node(1)  # replaced: its record goes with it
    assert mon.verdicts(102.0) == []


def test_a_failed_dcgmi_diag_fails_the_node_before_training(tmp_path):
    """A fake ``dcgmi`` (DCGM 3's JSON layout) reports a failed test: the node's preflight exits
    86 with a ``preflight_failed`` failure record naming it, after its real CPU matmul."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    doc = {"DCGM GPU Diagnostic": {"test_categories": [
        {"category": "Deployment", "tests": [{"name": "Denylist", "results": [{"status": "Pass"}]}]},
        {"category": "Integration", "tests": [{"name": "PCIe", "results": [
            {"gpu_id": "0", "status": "Fail", "info": "GPU 0 PCIe link width x8 below x16"}]}]}]}}
    dcgmi = bin_dir / "dcgmi"
    dcgmi.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat <<'EOF'\n{json.dumps(doc)}\nEOF\nexit 226\n")
    dcgmi.chmod(0o755)
    node = tmp_path / "node"
    node.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SFTCTL_NODE_DIR": str(node),
           "SFTCTL_PREFLIGHT": "quick", "SFTCTL_PREFLIGHT_REFERENCE": "cpu", "SFTCTL_PREFLIGHT_GEMM_S": "1.0",
           "SFTCTL_NODE_RANK": "0", "SFTCTL_NUM_NODES": "1", "SFTCTL_ATTEMPT": "3", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "sftctl.preflight"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=deadline(120))
    assert proc.returncode == 86, proc.stderr[-2000:]
    assert (tmp_path / "args").read_text().split() == ["diag", "-r", "1", "-j"]
    failure = json.loads((node / "failure-3.json").read_text())
    assert failure["code"] == "preflight_failed"
    assert "dcgmi diag -r 1 failed: PCIe (GPU 0): GPU 0 PCIe link width x8 below x16" in failure["message"]
    record = json.loads((node / "health.jsonl").read_text().splitlines()[-1])["preflight"]
    assert record["dcgm"]["rc"] == 226 and record["matmul"][0]["measured_s"] > 0
    assert record["matmul"][0]["predicted_s"] == 1.0  # a 0.1 GFLOP matmul never takes 1 s: not slow


def test_a_slow_node_is_replaced_before_the_first_step_and_the_job_succeeds(tmp_path, home):
    doc, events = _run(tmp_path, two_node_spec("preflight", SFTCTL_PREFLIGHT_SLOW_RANK=1))
    verdict, pre = _replaced_once(doc, events, "preflight_slow")  # from the node's exit or its record
    assert "CPU matmul 384x384x384 float32 at" in verdict["message"] and "of this machine's" in verdict["message"]
    failed = [e["data"] for e in pre if not e["data"]["passed"]]
    assert [d["node_rank"] for d in failed] == [1]
    mm = failed[0]["matmul"][0]
    assert mm["measured_s"] > mm["predicted_s"] / 0.3  # measured, not written in: 8x slower than its reference
    passed = [e for e in pre if e["data"]["passed"]]
    assert sorted(e["data"]["node_rank"] for e in passed) == [0, 1]  # attempt 2: both nodes, the new node 1
    for e in passed:
        assert e["data"]["elapsed_s"] > 0 and f"in {e['data']['elapsed_s']:.1f} s" in e["message"]
        assert e["data"]["allreduce"]["nodes"] == 2 and e["data"]["allreduce"]["bus_gbps"] > 0
    attempts = doc.get("attempts") or []
    if attempts:
        assert attempts[0]["reason_code"] == "preflight_slow"


def test_a_long_jobs_checkpoint_checks_the_device_and_a_slow_one_is_a_verdict(tmp_path, monkeypatch):
    """Item 2: ``sftctl.train.save_checkpoint`` of a job with periodic checks on runs the matmul
    of its device after the checkpoint; on the node made slow it is the detector's verdict."""
    from sftctl import preflight, train

    node = tmp_path / "node"
    node.mkdir()
    reference_s = preflight.time_matmul("cpu", batches=10)
    monkeypatch.setenv("SFTCTL_NODE_DIR", str(node))
    monkeypatch.setenv("SFTCTL_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("SFTCTL_PREFLIGHT_GEMM_S", repr(reference_s))
    monkeypatch.setenv("SFTCTL_PREFLIGHT_REFERENCE", "cpu")
    train.save_checkpoint({"step": 5}, 5)
    assert not (node / "health.jsonl").exists()  # periodic checks off (a short job): nothing ran
    monkeypatch.setenv("SFTCTL_PREFLIGHT_PERIODIC", "1")
    monkeypatch.setenv("SFTCTL_NODE_RANK", "1")
    monkeypatch.setenv("SFTCTL_PREFLIGHT_SLOW_RANK", "1")
    train.save_checkpoint({"step": 10}, 10)
    records = [json.loads(x) for x in (node / "health.jsonl").read_text().splitlines()]
    assert [r["preflight"]["when"] for r in records] == ["checkpoint"]
    mm = records[0]["preflight"]["matmul"][0]
    assert mm["gpu"] is None and mm["measured_s"] > reference_s / 0.6  # measured ~8x slower
    mon = HealthMonitor(Thresholds(), total_steps=100)
    mon.add_gpu(1, records)
    [v] = mon.verdicts(records[0]["ts"] + 1)
    assert (v.kind, v.node_rank, v.action) == ("preflight_slow", 1, "replace")
    assert v.evidence.startswith("checkpoint check: CPU matmul 384x384x384 float32 at")


def test_the_plan_counts_the_preflights_stated_time(tmp_path):
    """An H100 node's plan: 1000 steps of 0.1 s, plus 15 s (quick) or 45 s (full) and dcgmi diag's
    15 s; a job predicted longer than preflight_long_job_h pays -r 2's 120 s instead; off: none."""
    from sftctl.planner import plan
    from test_planner import ALL_USABLE, fixed_predictor

    def seconds(health: str, steps: int = 1000) -> float:
        s = load_spec(write_spec(tmp_path / "job.yaml", f"name: job\ntrain: {{steps: {steps}}}\nresources: "
                                 f"{{accelerators: [H100:8], clouds: [aws]}}\nhealth: {health}\nrun: echo\n"))
        return plan(s, ALL_USABLE, fixed_predictor({"H100": 0.1})).chosen.hours * 3600

    assert seconds("{preflight: 'off'}") == pytest.approx(100)
    assert seconds("{}") == pytest.approx(100 + 15 + 15)  # unset: quick on a GPU node
    assert seconds("{preflight: full}") == pytest.approx(100 + 45 + 15)
    assert seconds("{preflight_long_job_h: 0.01}") == pytest.approx(100 + 15 + 120)  # 100 s > 36 s: -r 2
