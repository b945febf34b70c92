"""Each accelerator's calibration (sources, error) and the plan's step intervals and ranking notes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sftctl.catalog import accelerator_names
from sftctl.compiler import accuracy
from sftctl.types import FailureCode, FailureReason, Offering, PlanChoice


def test_every_catalog_accelerator_has_a_calibration_file():
    for name in accelerator_names():
        a = accuracy.accuracy(name)
        assert (accuracy.ACCURACY_DIR / f"{name.lower()}.json").exists(), name
        assert a["sources"] and a["error"] > 1.0, name
    assert accuracy.accuracy("H200")["calibrated"] and 1.0 < accuracy.accuracy("H200")["error"] < 1.3
    l4 = accuracy.accuracy("L4")
    assert not l4["calibrated"] and "no measured" in l4["sources"][0]
    assert accuracy.accuracy("no-such-gpu")["error"] == accuracy.DEFAULT_FACTOR


def test_interval_and_overlap():
    f = accuracy.accuracy("H200")["error"]
    lo, hi = accuracy.interval("H200", 10e-3)
    assert lo == pytest.approx(10e-3 / f) and hi == pytest.approx(10e-3 * f)
    # the collectives' error counts in proportion to the step's communication
    fc = accuracy.accuracy("H200")["collectives_error"]
    assert accuracy.factor("H200", 0.0) == f
    assert accuracy.factor("H200", 0.5) == pytest.approx(math.exp(math.hypot(math.log(f), 0.5 * math.log(fc))))
    assert f < accuracy.factor("H200", 0.5) < accuracy.factor("H200", 1.0) < f * fc
    assert accuracy.overlap((1, 2), (1.5, 3)) and not accuracy.overlap((1, 2), (2.5, 3))


def _choice(acc: str, count: int, step: float, usd_h: float) -> PlanChoice:
    from sftctl.planner import _calibration

    o = Offering(provider="aws", instance_type=f"{acc}-box", accelerator=acc, count=count, region="r",
                 usd_per_hour=usd_h)
    hours = step * 1000 / 3600
    return dataclasses.replace(PlanChoice(o, 1, usd_h), step_time_s=step, hours=hours, total_usd=hours * usd_h,
                               **_calibration(acc, step))


def test_the_pick_says_when_its_cost_interval_overlaps_the_runner_up():
    """One line, on the top row only: the pick against the best row of another accelerator or
    node shape (issue 35 item 6; issue 37: one note, not one per overlapping pair)."""
    from sftctl.planner import _ranking_notes

    h200 = _choice("H200", 8, 10e-3, 60.0)      # cost 0.1667, interval x/1.15
    h100 = _choice("H100", 8, 11e-3, 56.0)      # cost 0.1711: within H200's error
    h200_r2 = dataclasses.replace(h200, offering=dataclasses.replace(h200.offering, region="r2"), usd_per_hour=61.0,
                                  total_usd=h200.total_usd * 61 / 60)  # the same shape: not the runner-up
    l4 = _choice("L4", 1, 2.0, 0.8)             # cost 0.444: 2.7x more, outside both
    ranked = _ranking_notes([h200, h200_r2, h100, l4], "cost")
    note = ranked[0].ranking_note
    fh200, fh100 = accuracy.accuracy("H200")["error"], accuracy.accuracy("H100")["error"]
    c1, c3 = h200.total_usd, h100.total_usd
    assert note == (f"may not be the cheapest: H100:8 (aws H100-box, r) is {c3 / c1 - 1:.1%} more (${c3:.3g} vs ${c1:.3g}), "
                    f"within the error (${c3 / fh100:.3g}-{c3 * fh100:.3g} vs ${c1 / fh200:.3g}-{c1 * fh200:.3g}); "
                    f"per step: H200:8 ${60 * 10e-3 / 3600:.3g}, H100:8 ${56 * 11e-3 / 3600:.3g}")
    assert note.startswith("may not be the cheapest: H100:8 (aws H100-box, r) is 2.7% more ($0.171 vs $0.167), within the error ($0.1")
    assert [c.ranking_note for c in ranked[1:]] == [None, None, None]  # one line per plan
    d = ranked[0].to_dict()
    assert d["ranking_note"] == note and PlanChoice.from_dict(d).ranking_note == note
    assert d["calibration"]["calibrated"] and d["calibration"]["error"] == pytest.approx(fh200)
    assert d["step_time_interval_s"] == pytest.approx([10e-3 / fh200, 10e-3 * fh200])
    # apart: no note
    assert [c.ranking_note for c in _ranking_notes([h200, l4], "cost")] == [None, None]
    # objective time: the step-time intervals
    note = _ranking_notes([h200, h100], "time")[0].ranking_note
    assert note == (f"may not be the fastest: H100:8 (aws H100-box, r) is 10.0% slower (11.0 ms vs 10.0 ms), within the error "
                    f"({11 / fh100:.1f} ms-{11 * fh100:.1f} ms vs {10 / fh200:.1f} ms-{10 * fh200:.1f} ms); "
                    f"per step: H200:8 ${60 * 10e-3 / 3600:.3g}, H100:8 ${56 * 11e-3 / 3600:.3g}")
    # an infeasible top row picks nothing: no note
    rejected = dataclasses.replace(h200, rejected=FailureReason(FailureCode.NO_CAPACITY, "full"))
    assert _ranking_notes([rejected, h100], "cost")[0].ranking_note is None


def test_plan_table_has_one_footnote_for_the_pick():
    from rich.console import Console

    from sftctl.planner import _ranking_notes
    from sftctl.ui import plan_table

    h200, h100 = _choice("H200", 8, 10e-3, 60.0), _choice("H100", 8, 11e-3, 56.0)
    a100 = _choice("A100-80GB", 8, 22e-3, 29.0)  # overlaps H100, which is not the pick: no line
    console = Console(width=250, record=True)
    console.print(plan_table(_ranking_notes([h200, h100, a100], "cost"), 1000))
    lines = [ln.strip() for ln in console.export_text().splitlines() if "may not be" in ln or "overlap" in ln]
    assert len(lines) == 1 and lines[0].startswith("#1: may not be the cheapest: #2 H100:8 (aws H100-box, r) is 2.7% more")


def test_plan_table_marks_uncalibrated_and_shows_the_range():
    from rich.console import Console

    from sftctl.ui import plan_table

    rows = [_choice("H200", 8, 10e-3, 60.0), _choice("L4", 1, 0.5, 0.8)]
    console = Console(width=250, record=True)
    console.print(plan_table(rows, 1000))
    text = console.export_text()
    f = accuracy.accuracy("H200")["error"]
    assert "STEP RANGE" in text and f"{10 / f:.1f} ms-{10 * f:.1f} ms" in text
    assert "500.0 ms *" in text and "* uncalibrated" in text and "L4" in text.split("* uncalibrated")[1]
