"""Each job's accumulated cost (offering price x node-hours, spot price where spot, the price's
source) in `status --json` and sftctl.api, and costs per user and per lab over a period."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import sftctl
from sftctl import api
from sftctl.errors import SftctlError
from sftctl.state import JobStatus, NodeState, Store

OFFERING = {"provider": "aws", "instance_type": "p5.48xlarge", "accelerator": "H100", "count": 8,
            "region": "us-east-1", "usd_per_hour": 98.32, "spot_usd_per_hour": 40.0,
            "source": "AWS price list API", "as_of": "2026-11"}
T0 = 1_700_000_000.0  # a fixed past time: the spans below are exact
H = 3600.0


def _job(store: Store, name: str, owner: str, spans: list[tuple[float, float | None]], *, spot: bool = False,
         status: JobStatus = JobStatus.SUCCEEDED, offering: dict = OFFERING, provider: str = "aws") -> str:
    """A job with a plan and nodes billing over ``spans`` (Unix seconds; None: not ended)."""
    job = store.create_job(name, {"name": name, "resources": {"nodes": len(spans), "spot": spot}, "run": "true"},
                           owner=owner)
    store.update_job(job, provider=provider, offering_json={"offering": offering})
    for rank, (start, end) in enumerate(spans):
        node = store.add_node(job, rank, provider)
        if end is not None:
            store.update_node(node, status=NodeState.TERMINATED)
        store._conn.execute("UPDATE nodes SET created_at = ?, ended_at = ? WHERE id = ?", (start, end, node))
    if status != JobStatus.PENDING:
        for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING):
            store.transition(job, s)
        if status != JobStatus.RUNNING:
            store.transition(job, status, None if status == JobStatus.SUCCEEDED else "test", strict=False)
    return job


def test_a_jobs_cost_is_price_times_node_hours_with_its_source(state_backend):
    store = Store()
    done = _job(store, "done", "alice", [(T0, T0 + 2 * H), (T0, T0 + 1.5 * H)])
    spot = _job(store, "spot", "bob", [(T0, T0 + H)], spot=True)
    unpriced = _job(store, "nospot", "bob", [(T0, T0 + H)], spot=True, offering={**OFFERING, "spot_usd_per_hour": None})
    cost = api.status(done).cost
    assert (cost.node_hours, cost.price_per_hour) == (3.5, 98.32) and cost.usd == pytest.approx(344.12)
    assert cost.source == "on-demand price of aws p5.48xlarge in us-east-1: AWS price list API (2026-11)"
    cost = api.status(spot).cost
    assert (cost.usd, cost.price_per_hour, cost.node_hours) == (40.0, 40.0, 1.0) and cost.source.startswith("spot price of")
    cost = api.status(unpriced).cost
    assert (cost.usd, cost.price_per_hour, cost.node_hours) == (None, None, 1.0)
    assert cost.source == "no spot price for aws p5.48xlarge in us-east-1 in the catalog"
    by_id = {v.id: v.cost for v in api.status()}  # the list computes the same, from one query
    assert by_id[done] == api.status(done).cost and by_id[spot].usd == 40.0
    pending = store.create_job("unplanned", {"name": "unplanned", "resources": {"nodes": 1}, "run": "true"})
    assert api.status(pending).cost is None


def test_a_live_job_bills_until_now(state_backend):
    store = Store()
    started = time.time() - 0.5 * H
    job = _job(store, "live", "alice", [(started, None)], status=JobStatus.RUNNING)
    before = api.status(job).cost.node_hours
    assert 0.5 <= before < 0.6
    assert api.status(job).cost.node_hours >= before  # still counting


def test_a_dead_controllers_nodes_bill_until_down_but_local_ones_stop_with_it(state_backend):
    """A cloud node may outlive its dead controller (billing until sftctl down); a local one is
    stopped by its guard within seconds, so its hours end with the job."""
    store = Store()
    started = time.time() - 0.5 * H
    cloud = _job(store, "cloud", "alice", [(started, None)], status=JobStatus.FAILED_CONTROLLER)
    local = _job(store, "local", "alice", [(started, None)], status=JobStatus.FAILED_CONTROLLER, provider="local")
    for job in (cloud, local):
        store._conn.execute("UPDATE jobs SET ended_at = ? WHERE id = ?", (started + 0.25 * H, job))
    assert api.status(local).cost.node_hours == pytest.approx(0.25)
    assert api.status(cloud).cost.node_hours >= 0.5


def test_costs_per_user_and_per_lab_over_a_period(state_backend):
    store = Store()
    _job(store, "a1", "alice", [(T0, T0 + 2 * H)])
    _job(store, "a2", "alice", [(T0 + 10 * H, T0 + 11 * H)], spot=True)
    _job(store, "b1", "bob", [(T0 + H, T0 + 4 * H), (T0 + H, T0 + 2 * H)])
    users = {t.group: t for t in api.costs(by="user")}
    assert set(users) == {"alice", "bob"}
    assert (users["alice"].jobs, users["alice"].node_hours) == (2, 3.0)
    assert users["alice"].usd == pytest.approx(2 * 98.32 + 40.0)
    assert (users["bob"].jobs, users["bob"].node_hours) == (1, 4.0) and users["bob"].usd == pytest.approx(4 * 98.32)
    (lab,) = api.costs(by="lab")
    assert (lab.group, lab.jobs, lab.node_hours) == ("lab", 3, 7.0) and lab.usd == pytest.approx(6 * 98.32 + 40.0)
    # the period [T0 + 1.5 h, T0 + 3 h]: alice's first half hour, bob's 1.5 h + 0.5 h; a2 is outside
    users = {t.group: t for t in api.costs(by="user", since=T0 + 1.5 * H, until=T0 + 3 * H)}
    assert (users["alice"].jobs, users["alice"].node_hours) == (1, 0.5)
    assert (users["bob"].node_hours, users["bob"].since, users["bob"].until) == (2.0, T0 + 1.5 * H, T0 + 3 * H)
    assert api.costs(by="lab", since=T0 + 20 * H) == []
    with pytest.raises(SftctlError, match="by must be 'user' or 'lab'"):
        api.costs(by="team")
    with pytest.raises(SftctlError, match=r"since \(\d{4}-\d\d-\d\d \d\d:\d\d\) is after until") as e:
        api.costs(since=T0 + H, until=T0)
    assert "swap them" in e.value.hint
    with pytest.raises(TypeError, match="since must be Unix seconds"):
        api.costs(since="yesterday")


def test_status_json_and_table_show_the_cost(state_backend):
    store = Store()
    job = _job(store, "shown", "alice", [(T0, T0 + 2 * H)])
    proc = sftctl("status", "--json")
    assert proc.returncode == 0, proc.stderr
    (doc,) = json.loads(proc.stdout)["jobs"]
    assert doc["cost"] == {"usd": 196.64, "price_per_hour": 98.32, "node_hours": 2.0,
                           "source": "on-demand price of aws p5.48xlarge in us-east-1: AWS price list API (2026-11)"}
    assert json.loads(sftctl("status", job, "--json").stdout)["cost"]["usd"] == 196.64
    wide = sftctl("status", env={**os.environ, "COLUMNS": "200"}, check=True).stdout.splitlines()
    assert wide[0].split()[-2:] == ["COST", "NOTE"] and "$196.64" in next(x for x in wide if x.startswith(job))
    narrow = sftctl("status", env={**os.environ, "COLUMNS": "60"}, check=True).stdout
    assert "COST" not in narrow.splitlines()[0] and job in narrow  # the first column to go when it does not fit
    # one job in detail: the cost, its node-hours, price and the price's source (the README says so)
    detail = sftctl("status", job, env={**os.environ, "COLUMNS": "200"}, check=True).stdout.splitlines()
    assert ("cost: $196.64 (2.00 node-hours at $98.32/h, on-demand price of aws p5.48xlarge in us-east-1: "
            "AWS price list API (2026-11))") in detail
    unpriced = _job(store, "unpriced", "alice", [(T0, T0 + H)], spot=True, offering={**OFFERING, "spot_usd_per_hour": None})
    assert ("cost: - (1.00 node-hours; no price: no spot price for aws p5.48xlarge in us-east-1 in the catalog)"
            in sftctl("status", unpriced, env={**os.environ, "COLUMNS": "200"}, check=True).stdout.splitlines())


def test_sftctl_costs_prints_per_user_and_lab_and_refuses_bad_periods(state_backend):
    store = Store()
    _job(store, "a1", "alice", [(T0, T0 + 2 * H)])
    _job(store, "b1", "bob", [(T0 + H, T0 + 4 * H), (T0 + H, T0 + 2 * H)])
    doc = json.loads(sftctl("costs", "--json", check=True).stdout)
    assert [(c["group"], c["jobs"], c["node_hours"]) for c in doc["costs"]] == \
        [(c.group, c.jobs, c.node_hours) for c in api.costs()] == [("alice", 1, 2.0), ("bob", 1, 4.0)]
    lab = json.loads(sftctl("costs", "--by", "lab", "--json", check=True).stdout)["costs"]
    assert [(c["group"], c["node_hours"]) for c in lab] == [("lab", 6.0)] and lab[0]["usd"] == pytest.approx(6 * 98.32)
    # 2023-11-15 00:00 UTC is T0 + 6,400 s: the last 800 s of alice's job and of bob's 2nd node
    since = json.loads(sftctl("costs", "--since", "2023-11-15", "--json", check=True).stdout)["costs"]
    assert [(c["group"], c["since"]) for c in since] == [("alice", 1_700_006_400.0), ("bob", 1_700_006_400.0)]
    assert since[0]["node_hours"] == pytest.approx(800 / H)
    assert since[1]["node_hours"] == pytest.approx((T0 + 4 * H - 1_700_006_400.0 + 800) / H)
    assert json.loads(sftctl("costs", "--since", "1d", "--json", check=True).stdout) == {"costs": []}
    table = sftctl("costs", env={**os.environ, "COLUMNS": "120"}, check=True).stdout.splitlines()
    assert table[0].split() == ["USER", "JOBS", "NODE-HOURS", "USD", "UNPRICED", "JOBS"]
    assert table[1].split() == ["alice", "1", "2.00", "$196.64"]
    for args, line in ((["--since", "yesterday"], "error: --since 'yesterday': expected a duration ago (7d, 12h, 30m) "
                        "or a date (2026-01-31)"), (["--by", "team"], "error: --by 'team': expected user or lab")):
        proc = sftctl("costs", *args)
        assert proc.returncode == 2 and proc.stderr.splitlines()[0] == line, proc.stderr
