"""The vocabulary (sftctl.types): JSON round trips, provider handles, reasons."""

import json

import pytest

from sftctl.types import (
    Attempt, FailureCode, FailureReason, JobRecord, JobStatus, KubernetesHandle, LocalHandle,
    MetricsRecord, NodeHandle, Offering, Plan, PlanChoice, SlurmHandle,
)


def test_offering_round_trips_through_json():
    o = Offering("aws", "p5.48xlarge", "H100", 8, "us-east-1", 98.32, spot_usd_per_hour=39.3)
    back = Offering.from_dict(json.loads(json.dumps(o.to_dict())))
    assert back == o
    assert back.price(spot=True) == 39.3 and back.price(spot=False) == 98.32


def test_handle_parses_as_its_providers_type_and_ignores_unknown_keys():
    h = NodeHandle.parse("local", {"job_id": "j-1", "node_id": "n0", "rank": 0, "dir": "/d",
                                   "pid": 42, "from_a_newer_sftctl": True})
    assert isinstance(h, LocalHandle) and h.pid == 42 and h.dir == "/d"
    launched = h.with_(attempt=3, pid=43)
    assert (launched.attempt, launched.pid, h.attempt) == (3, 43, None)
    assert NodeHandle.parse("local", launched.to_dict()) == launched
    k = NodeHandle.parse("kubernetes", {"job_id": "j", "node_id": "n", "rank": 1, "pod": "p", "id": "p"})
    assert isinstance(k, KubernetesHandle) and k.node_name is None
    s = NodeHandle.parse("slurm", {"job_id": "j", "node_id": "n", "rank": 0, "exclude": ["node2"]})
    assert isinstance(s, SlurmHandle) and s.exclude == ["node2"]
    with pytest.raises(ValueError, match="unknown provider 'azure'"):
        NodeHandle.parse("azure", {})


def test_failure_reason_is_a_code_and_a_line():
    r = FailureReason("oom", "rank 1 ran out of memory", {"rank": 1})
    assert r.code is FailureCode.OOM and str(r) == "rank 1 ran out of memory"
    assert r.to_dict() == {"code": "oom", "message": "rank 1 ran out of memory", "data": {"rank": 1}}
    assert FailureReason.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError):
        FailureReason("not-a-code", "x")


def test_job_record_reads_state_rows():
    row = {"id": "a-1", "name": "a", "status": "RUNNING", "spec": {"name": "a"}, "created_at": 1.0,
           "updated_at": 2.0, "offering": Offering("local", "cpu", "cpu", 2, "local", 0.0).to_dict()}
    job = JobRecord.from_dict(row)
    assert job.status is JobStatus.RUNNING and not job.status.terminal
    assert isinstance(job.offering, Offering) and job.offering.count == 2
    assert job.to_dict()["status"] == "RUNNING" and job.to_dict()["offering"]["count"] == 2
    assert JobStatus.FAILED_CONTROLLER.terminal
    a = Attempt(job_id="a-1", number=1, status="FAILED", started_at=1.0, exit_code=1)
    assert Attempt.from_dict(a.to_dict()) == a
    m = MetricsRecord.from_dict({"rank": 0, "step": 5, "loss": 2.5, "ts": 3.0})
    assert (m.step, m.loss, m.step_time_s) == (5, 2.5, None)


def test_stored_handle_reads_state_rows_old_and_new():
    """state.db keeps ``handle.to_dict()``; rows written before the typed handles (fewer keys)
    and rows of nodes that never got a handle read back too."""
    assert NodeHandle.stored("local", {}) is None and NodeHandle.stored("aws", {"terminated": True}) is None
    old = {"node_id": "j-n0", "job_id": "j", "rank": 0, "dir": "/d", "ip": "127.0.0.1", "pid": 7,
           "start_ticks": 99, "attempt": 2, "exit_file": "/d/exit-2"}
    h = NodeHandle.stored("local", old)
    assert isinstance(h, LocalHandle) and (h.pid, h.attempt, h.terminated) == (7, 2, False)
    gone = h.with_(terminated=True).to_dict()
    assert {k: gone[k] for k in old} == old and gone["terminated"] is True
    assert NodeHandle.stored("local", gone).terminated


def test_job_record_plan_is_a_plan_whose_document_round_trips():
    """Issue 21: ``JobRecord.plan`` was the plan document (a dict); it is a :class:`Plan` read
    back from ``offering_json``, whose ``to_dict()`` is the document state keeps, key for key."""
    a = Offering("aws", "p5.48xlarge", "H100", 8, "us-east-1", 98.32, spot_usd_per_hour=39.3)
    b = Offering("aws", "p4d.24xlarge", "A100", 8, "us-west-2", 32.77)
    c = Offering("aws", "g5.xlarge", "A10G", 1, "us-east-1", 1.0)
    rows = [PlanChoice(a, 2, 196.64, step_time_s=0.5, total_usd=10.0, hours=0.05, mode="compile",
                       parallelism="fsdp", activation_checkpointing=True),
            PlanChoice(b, 2, 65.54, step_time_s=0.9, total_usd=12.0, hours=0.2, parallelism="ddp",
                       activation_checkpointing=False, queue_wait_s=60.0),
            PlanChoice(c, 2, 2.0, rejected=FailureReason("does_not_fit", "needs 80 GiB, has 24"))]
    plan = Plan(rows[0], "cheapest: H100", rows)
    doc = json.loads(json.dumps(plan.to_dict()))
    back = Plan.from_dict(doc)
    assert back.to_dict() == doc and back == plan
    job = JobRecord.from_dict({"id": "a-1", "name": "a", "status": "RUNNING", "spec": {}, "created_at": 1.0,
                               "updated_at": 2.0, "plan": doc})
    assert isinstance(job.plan, Plan) and job.offering == a and job.plan_reason == "cheapest: H100"
    assert job.to_dict()["plan"] == doc
    assert (job.plan.planned("parallelism"), job.plan.planned("activation_checkpointing")) == ("fsdp", True)
    moved = job.plan.with_offering(b)  # a failover: the document with its offering replaced
    assert moved.to_dict() == {**doc, "offering": b.to_dict()}
    assert (moved.planned("parallelism"), moved.planned("activation_checkpointing")) == ("ddp", False)
    assert Plan.from_dict(moved.to_dict()).offering == b
    old = Plan.from_dict({"offering": c.to_dict(), "candidates": []})  # a plan kept before most keys
    assert (old.offering, old.reason, old.planned("parallelism"), old.chosen.nodes) == (c, "", None, None)
    assert JobRecord.from_dict({"id": "a-1", "name": "a", "status": "PENDING", "spec": {}, "created_at": 1.0,
                                "updated_at": 2.0, "plan": None}).plan_reason is None
