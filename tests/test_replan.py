"""Re-plan at a checkpoint (issue 35 item 3, ``resources.replan``): a local job whose measured
step costs more than the stored plan's alternative predicts, by more than moving costs, gets one
``replan`` event with the figures (``suggest``), none with ``off``, and with ``migrate`` moves
at its next checkpoint: the old offering's node gone before the new one starts, the steps going
on from the checkpoint."""

from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest

from conftest import job_processes, run_injected, script_job
from sftctl.types import Offering, Plan, PlanChoice, StepRecord

#: the training script: sleeps per step, checkpoints every train.checkpoint_interval steps,
#: resumes from the newest checkpoint; appends "NODE_ID TIME" per step to $SPANS
SCRIPT = textwrap.dedent("""\
    import os, time
    import sftctl.train as sft

    cfg = sft.config()
    got = sft.load_latest_checkpoint()
    start = got[0] if got else 0
    print(f"resumed from step {start}" if got else "started fresh", flush=True)
    spans = open(os.environ["SPANS"], "a")
    for step in range(start + 1, cfg.steps + 1):
        t = time.perf_counter()
        time.sleep(0.1)
        dt = time.perf_counter() - t
        ckpt = step % cfg.checkpoint_interval == 0
        if ckpt:
            sft.save_checkpoint({"step": step}, step)
        sft.report(step, 1.0, step_time_s=dt, tokens_per_s=1000 / dt, checkpoint=ckpt)
        spans.write(f"{os.environ['SFTCTL_NODE_ID']} {time.time()}\\n")
        spans.flush()
    """)

#: USD/h: the job's offering costs $1/s, the alternative $0.001/s
HERE_USD_H, THERE_USD_H = 3600.0, 3.6
THERE_STEP_S = 0.1  # the alternative's calibrated prediction: as fast, a thousandth of the price


def _spec(tmp_path, replan: str, steps: int = 40) -> str:
    return script_job(tmp_path, "replan", SCRIPT, f"env: {{SPANS: {tmp_path / 'spans.log'}}}\n"
                      f"train: {{steps: {steps}, checkpoint_interval: 10}}\nresources: {{replan: {replan}}}\n")


def _plan(here: Offering) -> tuple[Plan, Offering]:
    """The stored plan: the job's offering at $3600/h with no prediction, and another local
    offering at $3.6/h predicted at THERE_STEP_S (calibrated)."""
    there = dataclasses.replace(here, instance_type="localhost-b", usd_per_hour=THERE_USD_H)
    a = PlanChoice(dataclasses.replace(here, usd_per_hour=HERE_USD_H), 1, HERE_USD_H)
    b = PlanChoice(there, 1, THERE_USD_H, step_time_s=0.05, calibrated_step_s=THERE_STEP_S)
    return Plan(a, "injected", [a, b]), there


def _run(tmp_path, replan: str):
    job, status, store, plan = run_injected(_spec(tmp_path, replan), lambda here: _plan(here)[0])
    return job, status, store, plan, plan.candidates[1].offering


def test_a_slow_offering_gets_one_replan_event_with_its_figures(home, tmp_path):
    from sftctl.state import JobStatus

    job, status, store, plan, there = _run(tmp_path, "suggest")
    assert status == JobStatus.SUCCEEDED
    replans = [e for e in store.events(job) if e.kind == "replan"]
    assert len(replans) == 1, [e.message for e in replans]  # once per job, not every poll
    d = replans[0].data
    m, left = d["measured_step_s"], d["steps_left"]
    assert 0.1 <= m < 1.0 and 0 < left < 40 and d["measured_steps"] >= 5
    assert d["current"] == "local:localhost@local" and d["alternative"] == "local:localhost-b@local"
    assert d["usd_per_step"] == pytest.approx(HERE_USD_H / 3600 * m)
    assert d["alternative_usd_per_step"] == pytest.approx(THERE_USD_H / 3600 * THERE_STEP_S)
    assert d["tokens_per_step"] == pytest.approx(1000, rel=1e-6)
    assert d["usd_per_mtok"] == pytest.approx(d["usd_per_step"] / 1000 * 1e6)
    assert d["alternative_usd_per_mtok"] == pytest.approx(THERE_USD_H / 3600 * THERE_STEP_S / 1000 * 1e6)
    # moving, as the spot model prices a preemption: half a checkpoint interval lost here, the relaunch there
    assert d["lost_work_s"] == pytest.approx(10 * m / 2) and d["relaunch_s"] == 600.0
    assert d["move_usd"] == pytest.approx(10 * m / 2 * 1.0 + 600 * 0.001)
    assert d["saving_usd"] == pytest.approx(left * (m - 0.0001) - d["move_usd"]) and d["saving_usd"] > 0
    assert d["mode"] == "suggest"
    msg = replans[0].message
    assert f"{m * 1e3:.1f} ms/step" in msg and f"${d['usd_per_mtok']:.4g}/Mtok" in msg and "$0.1/Mtok" in msg
    assert f"saves ${d['saving_usd']:.4g}" in msg and "resources.replan: migrate" in msg
    assert not [e for e in store.events(job) if e.kind == "migrate"]  # suggest moves nothing
    assert [a.number for a in store.attempts(job)] == [1]


def test_replan_off_says_nothing(home, tmp_path):
    from sftctl.state import JobStatus

    job, status, store, _, _ = _run(tmp_path, "off")
    assert status == JobStatus.SUCCEEDED
    assert [e for e in store.events(job) if e.kind in ("replan", "migrate")] == []


def test_migrate_moves_at_a_checkpoint_and_never_runs_two_copies(home, tmp_path):
    from sftctl.state import JobStatus
    from sftctl.types import AttemptStatus

    job, status, store, plan, there = _run(tmp_path, "migrate")
    assert status == JobStatus.SUCCEEDED, store.get_job(job).failure_reason
    (replan,) = [e for e in store.events(job) if e.kind == "replan"]
    (moved,) = [e for e in store.events(job) if e.kind == "migrate"]
    assert "migrating at the next checkpoint" in replan.message
    ckpt = moved.data["checkpoint_step"]
    assert ckpt % 10 == 0 and ckpt >= 10
    old, new = moved.data["terminated"], moved.data["nodes"]
    assert len(old) == len(new) == 1 and old != new
    # the job's plan and provider moved; the old node is recorded terminated
    job_rec = store.get_job(job)
    assert job_rec.plan.offering == there and job_rec.restarts == 0
    nodes = {n.id: n for n in store.nodes(job)}
    assert nodes[old[0]].status.value == "TERMINATED"
    attempts = store.attempts(job)
    assert [(a.number, a.status) for a in attempts] == [(1, AttemptStatus.CANCELLED), (2, AttemptStatus.SUCCEEDED)]
    # the steps go on from the checkpoint on the new node
    spans = [line.split() for line in (tmp_path / "spans.log").read_text().splitlines()]
    by_node: dict[str, list[float]] = {}
    for node_id, ts in spans:
        by_node.setdefault(node_id, []).append(float(ts))
    assert set(by_node) == {old[0], new[0]}
    assert max(by_node[old[0]]) < min(by_node[new[0]])  # never two copies: the old one stopped before
    progress = [e.message for e in store.events(job) if e.kind == "progress"]
    assert f"attempt 2: first step reported is {ckpt + 1}" in progress
    assert len(by_node[new[0]]) == 40 - ckpt  # the new node did exactly the steps after the checkpoint
    assert job_processes(job) == []


def test_the_verdict_weighs_the_steps_left_against_the_move():
    """:func:`judge` on reported steps: worth it with many steps left, not with few."""
    from sftctl.controller.replan import judge
    from sftctl.spec import JobSpec

    here = Offering("local", "localhost", "cpu", 1, "local", HERE_USD_H)
    plan, _ = _plan(here)
    samples = [StepRecord.from_dict({"rank": 0, "step": s, "step_time_s": 0.5, "tokens_per_s": 2000.0, "ts": float(s)})
               for s in range(1, 11)]
    many = JobSpec.model_validate({"name": "x", "run": "echo", "train": {"steps": 1000, "checkpoint_interval": 10}})
    v = judge(plan, many, samples)
    assert (v.measured_step_s, v.measured_steps, v.steps_left, v.tokens_per_step) == (0.5, 7, 990, 1000.0)
    assert v.move_usd == pytest.approx(2.5 + 0.6) and v.worth
    assert v.saving_usd == pytest.approx(990 * (0.5 - 0.0001) - 3.1)
    few = JobSpec.model_validate({"name": "x", "run": "echo", "train": {"steps": 16, "checkpoint_interval": 10}})
    v = judge(plan, few, samples)
    assert v.steps_left == 6 and not v.worth  # 6 x $0.4999 < $3.1
    assert judge(Plan(plan.chosen, "", [plan.chosen]), many, samples) is None  # no alternative
    assert judge(plan, many, samples[:7]) is None  # 4 steps after warm-up: not yet


def test_a_bad_replan_value_is_refused_in_one_line(tmp_path):
    from conftest import sftctl

    path = tmp_path / "job.yaml"
    path.write_text("name: x\nrun: echo\nresources:\n  replan: sometimes\n")
    proc = sftctl("plan", str(path))
    assert proc.returncode == 2
    assert re.search(r"job.yaml:4: resources.replan: Input should be 'suggest', 'migrate' or 'off' \(got 'sometimes'\)",
                     proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2  # the error and its hint
