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
    return load_spec(write_spec(tmp_path / "job.yaml", f"name: job\ntrain: {{steps: {steps}, checkpoint_interval: "
                                                       f"{interval}}}\nresources: {resources}\nrun: echo\n"))


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
