"""Spot as a policy: the plan's spot cost carries the expected preemption loss; the spec's
``resources.spot: {...}`` mapping; a preempted zone blocked for a cool-down (state.db)."""

from __future__ import annotations

import pytest

from conftest import write_spec
from sftctl.errors import SpecError
from sftctl.planner import SPOT_PREEMPTIONS_PER_NODE_HOUR, plan
from sftctl.spec import load_spec
from test_planner import ALL_USABLE, fixed_predictor


def _spec(tmp_path, resources: str, steps: int = 36000, interval: int = 600):
    # no preflight: its stated minutes would move the hours these figures are made of
    return load_spec(write_spec(tmp_path / "job.yaml", f"name: job\ntrain: {{steps: {steps}, checkpoint_interval: "
                                                       f"{interval}}}\nresources: {resources}\n"
                                                       "health: {preflight: 'off'}\nrun: echo\n"))


def test_spot_cost_includes_the_expected_loss_per_preemption(tmp_path):
    # 36000 steps of 1 s = 10 h on 2 nodes; a checkpoint every 600 steps: 300 s of work lost on
    # average, + 600 s relaunch = 0.25 h per preemption; 2 nodes x 10 h / 24 h = 0.8333 preemptions
    s = _spec(tmp_path, "{accelerators: [L4:8], clouds: [aws], nodes: 2, spot: true}")
    p = plan(s, ALL_USABLE, fixed_predictor({"L4": 1.0}))
    loss = p.chosen.spot_loss
    assert loss["rate_source"].startswith("stated default: 1 preemption per 24 node-hours")
    assert loss["preemptions_per_node_hour"] == SPOT_PREEMPTIONS_PER_NODE_HOUR
    assert loss["expected_preemptions"] == pytest.approx(2 * 10 / 24)
    assert (loss["lost_work_s"], loss["relaunch_s"]) == (300.0, 600.0)
    assert loss["extra_hours"] == pytest.approx(2 * 10 / 24 * 0.25)
    assert p.chosen.hours == pytest.approx(10 + 2 * 10 / 24 * 0.25)
    assert p.chosen.total_usd == pytest.approx(p.chosen.hours * p.chosen.usd_per_hour)
    assert p.chosen.to_dict()["spot_loss"] == loss
    # a stated rate and relaunch time are used, and named as the source
    s = _spec(tmp_path, "{accelerators: [L4:8], clouds: [aws], spot: {preemptions_per_hour: 0.5, relaunch_s: 1800}}")
    loss = plan(s, ALL_USABLE, fixed_predictor({"L4": 1.0})).chosen.spot_loss
    assert loss["rate_source"] == "resources.spot.preemptions_per_hour"
    assert loss["expected_preemptions"] == pytest.approx(0.5 * 10)
    assert loss["loss_per_preemption_h"] == pytest.approx((300 + 1800) / 3600)
    # on demand: no preemption cost
    s = _spec(tmp_path, "{accelerators: [L4:8], clouds: [aws]}")
    p = plan(s, ALL_USABLE, fixed_predictor({"L4": 1.0}))
    assert p.chosen.spot_loss is None and p.chosen.hours == pytest.approx(10)


def test_frequent_preemptions_make_on_demand_the_cheaper_pick(tmp_path):
    """Spot at a third of the price loses when preemptions waste more than it saves."""
    on_demand = plan(_spec(tmp_path, "{accelerators: [L4:8], clouds: [aws]}"), ALL_USABLE,
                     fixed_predictor({"L4": 1.0})).chosen.total_usd
    calm = plan(_spec(tmp_path, "{accelerators: [L4:8], clouds: [aws], spot: {preemptions_per_hour: 0.01}}"),
                ALL_USABLE, fixed_predictor({"L4": 1.0})).chosen.total_usd
    stormy = plan(_spec(tmp_path, "{accelerators: [L4:8], clouds: [aws], spot: {preemptions_per_hour: 30}}",
                        interval=3000), ALL_USABLE, fixed_predictor({"L4": 1.0})).chosen.total_usd
    assert calm < on_demand < stormy


@pytest.mark.parametrize("value, message", [
    ("{fallback_on_demand_after: 0}", "resources.spot.fallback_on_demand_after: Input should be greater than 0"),
    ("{zone_cooldown: 5}", "resources.spot.zone_cooldown: expected a positive duration"),
    ("{fallback_on_demand: 1}", "resources.spot.fallback_on_demand: unknown field; did you mean 'fallback_on_demand_after'?"),
])
def test_spot_policy_errors_name_the_field_and_line(tmp_path, value, message):
    with pytest.raises(SpecError) as e:
        _spec(tmp_path, f"{{accelerators: [L4:8], spot: {value}}}")
    assert e.value.message == f"{tmp_path / 'job.yaml'}:3: {message}" or message in e.value.message
    assert ":3: " in e.value.message


def test_spot_mapping_is_spot_with_a_policy(tmp_path):
    s = _spec(tmp_path, "{accelerators: [L4:8], spot: {fallback_on_demand_after: 2, zone_cooldown: 30m}}")
    assert s.resources.spot is True
    assert (s.resources.spot_rules.fallback_on_demand_after, s.resources.spot_rules.zone_cooldown_s) == (2, 1800)
    assert _spec(tmp_path, "{accelerators: [L4:8], spot: true}").resources.spot_rules.fallback_on_demand_after is None


def test_blocked_zones_are_kept_in_state_until_their_cool_down_ends(state_backend):
    from sftctl.state import Store

    store = Store()
    store.block_zone("gcp", "a3-highgpu-8g", "us-central1-a", until=1000.0, reason="preempted")
    store.block_zone("gcp", "a3-highgpu-8g", "us-central1-a", until=500.0, reason="again")  # never shortens
    store.block_zone("aws", "p5.48xlarge", "us-east-1a", until=2000.0, reason="preempted")
    assert store.blocked_zones("gcp", now=999.0) == {("a3-highgpu-8g", "us-central1-a"): 1000.0}
    assert store.blocked_zones("gcp", now=1000.0) == {}
    assert store.blocked_zones("aws", now=0.0) == {("p5.48xlarge", "us-east-1a"): 2000.0}


SPOT_SPEC = """\
name: spot
run: echo
resources: {{accelerators: [T4:1], clouds: [gcp], regions: [us-central1],
             spot: {{fallback_on_demand_after: 2, zone_cooldown: 2h}}}}
storage: gs://{bucket}/runs
health: {{enabled: false}}
"""


def _monitor(controller, timeout_s: float):
    """``controller._monitor()`` under an alarm, so a node that never shows lost fails the test
    (the controller's store is this thread's: SQLite connections stay on their thread)."""
    import signal

    def expired(*_):
        raise TimeoutError(f"no failure seen within {timeout_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(max(1, int(timeout_s)))
    try:
        return controller._monitor()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_preempted_spot_node_is_replaced_in_another_zone_then_on_demand(home, gcs_endpoint, monkeypatch, tmp_path):
    """A replayed GCE preemption (the spot VM goes TERMINATED) through the controller, the GCP
    provider and the GCE emulator: the zone is blocked in state.db, the replacement lands in the
    next zone; after fallback_on_demand_after (2) preemptions the replacement is on demand."""
    import uuid

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs

    from conftest import deadline
    from gce_emulator import GCEEmulator
    from servers import gcs_env
    from sftctl import api
    from sftctl.controller.lifecycle import REPLACE, Controller
    from sftctl.state import Store
    from sftctl.types import FailureCode

    for key, value in gcs_env(gcs_endpoint).items():
        monkeypatch.setenv(key, value)
    bucket = f"spot-{uuid.uuid4().hex[:10]}"
    gcs.Client(project="sftctl-test", credentials=AnonymousCredentials()).create_bucket(bucket)
    with GCEEmulator() as gce:
        monkeypatch.setenv("SFTCTL_GCE_ENDPOINT", gce.url)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", gce.project)
        path = tmp_path / "spot.yaml"
        path.write_text(SPOT_SPEC.format(bucket=bucket))
        job = api.submit(str(path))
        store = Store()
        c = Controller(store, job.job_id)
        try:
            c._provision()
            first = c.nodes[0].handle
            assert (first.zone, first.spot) == ("us-central1-a", True)
            zones = []
            for n in (1, 2):
                h = c.nodes[0].handle
                gce.set_status(h.zone, h.id, "TERMINATED")  # GCE took the spot VM back
                failure = _monitor(c, deadline(60))
                assert (failure.reason.code, failure.action, failure.node_rank) == (FailureCode.PREEMPTED, REPLACE, 0)
                assert failure.reason.data["zone"] == h.zone and failure.reason.data["count"] == n
                c._replace(0)
                zones.append((c.nodes[0].handle.zone, c.nodes[0].handle.spot))
            assert zones == [("us-central1-b", True), ("us-central1-c", False)]  # then on demand
            last = gce.inserted(c.nodes[0].handle.id)["scheduling"]
            assert last.get("provisioningModel", "STANDARD") == "STANDARD"
            itype = c.offering.instance_type
            assert set(store.blocked_zones("gcp")) == {(itype, "us-central1-a"), (itype, "us-central1-b")}
            events = [(e.kind, e.message, e.data) for e in api.events(job.job_id) if e.kind in ("spot", "replace")]
            kinds = [k for k, _, _ in events]
            assert kinds == ["spot", "replace", "spot", "spot", "replace"]
            assert "taken back in us-central1-a" in events[0][1] and "avoided for 2h" in events[0][1]
            assert events[1][2]["zone"] == "us-central1-b" and events[1][2]["spot"] is True
            assert "fallback_on_demand_after 2" in events[3][1] and events[3][2]["fallback_on_demand"] is True
            assert events[4][2]["zone"] == "us-central1-c" and events[4][2]["spot"] is False
            # a later controller (another job, or this one restarted) avoids the zones in their cool-down
            again = Controller(store, job.job_id)
            again.spot.seed(again.provider)
            assert {(itype, "us-central1-a"), (itype, "us-central1-b")} <= again.provider.blocked_zones
            assert again.spot.spot is False  # its count comes from the job's events: still on demand
        finally:
            c._teardown()


def test_spot_nodes_go_to_the_cheapest_zone_first_and_skip_blocked_ones(home, monkeypatch):
    import dataclasses

    from gce_emulator import GCEEmulator
    from test_provider_gcp import make_provider

    with GCEEmulator() as gce:
        provider = make_provider(gce)
        t4 = min((o for o in provider.offerings("T4", 1) if o.region == "us-central1"), key=lambda o: o.usd_per_hour)
        priced = dataclasses.replace(t4, spot_zones=(("us-central1-f", 0.11), ("us-central1-c", 0.12),
                                                      ("us-central1-a", 0.2)))
        h = provider.provision("j", "j-n0-0001", 0, priced, spot=True)
        assert h.zone == "us-central1-f"
        provider.blocked_zones.add((t4.instance_type, "us-central1-f"))
        assert provider.provision("j", "j-n0-0002", 0, priced, spot=True).zone == "us-central1-c"
        assert provider.provision("j", "j-n0-0003", 0, priced).zone == "us-central1-a"  # on demand: zone order


def test_a_lone_preempted_node_moves_to_another_region_when_its_zones_are_blocked(home, gcs_endpoint, monkeypatch,
                                                                                 tmp_path):
    """Every zone of the job's region is in its cool-down (stored in state.db): the replacement
    of a one-node job's preempted spot node fails over to the plan's offering in another region."""
    import uuid

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs

    from conftest import deadline
    from gce_emulator import GCEEmulator
    from servers import gcs_env
    from sftctl import api
    from sftctl.controller.lifecycle import Controller
    from sftctl.state import Store
    from sftctl.types import FailureCode

    for key, value in gcs_env(gcs_endpoint).items():
        monkeypatch.setenv(key, value)
    bucket = f"spot-{uuid.uuid4().hex[:10]}"
    gcs.Client(project="sftctl-test", credentials=AnonymousCredentials()).create_bucket(bucket)
    with GCEEmulator() as gce:
        monkeypatch.setenv("SFTCTL_GCE_ENDPOINT", gce.url)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", gce.project)
        path = tmp_path / "spot.yaml"
        path.write_text(SPOT_SPEC.format(bucket=bucket).replace("regions: [us-central1]", "regions: [us-central1, us-east1]"))
        job = api.submit(str(path))
        store = Store()
        c = Controller(store, job.job_id)
        try:
            c._provision()
            h = c.nodes[0].handle
            region = c.offering.region
            other = ({"us-central1", "us-east1"} - {region}).pop()
            for zone in (z for z, st in gce.zones.items() if z.startswith(region + "-")):
                store.block_zone("gcp", c.offering.instance_type, zone, until=2e9, reason="an earlier preemption")
            gce.set_status(h.zone, h.id, "TERMINATED")
            failure = _monitor(c, deadline(60))
            assert failure.reason.code is FailureCode.PREEMPTED
            c._replace(0)
            moved = c.nodes[0].handle
            assert (c.offering.region, moved.zone.rsplit("-", 1)[0], moved.spot) == (other, other, True)
            assert store.get_job(job.job_id).plan.offering.region == other  # the plan in state moved too
            events = [(e.kind, e.message) for e in api.events(job.job_id) if e.kind in ("spot", "capacity", "replace")]
            assert [k for k, _ in events] == ["spot", "capacity", "replace"]
            assert f"in {other}" in events[1][1] and f"in {moved.zone}" in events[2][1]
        finally:
            c._teardown()
