"""Each accelerator's calibration (sources, error) and the plan's step intervals and ranking notes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sftctl.catalog import accelerator_names
from sftctl.compiler import accuracy
from sftctl.types import Offering, PlanChoice


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


def test_ranking_says_when_intervals_overlap():
    from sftctl.planner import _ranking_notes

    h200 = _choice("H200", 8, 10e-3, 60.0)      # cost 0.167, interval x/1.15
    h100 = _choice("H100", 8, 11e-3, 56.0)      # cost 0.171: within H200's error
    l4 = _choice("L4", 1, 2.0, 0.8)             # cost 0.444: 2.7x more, outside both
    ranked = _ranking_notes([h200, h100, dataclasses.replace(h100, offering=dataclasses.replace(
        h100.offering, region="r2")), l4], "cost")
    assert ranked[0].ranking_note is None
    assert "overlaps #1 (H200:8)" in ranked[1].ranking_note
    assert ranked[2].ranking_note is None  # the same pair is said once
    assert ranked[3].ranking_note is None or "L4" not in ranked[3].ranking_note
    d = ranked[1].to_dict()
    f = accuracy.accuracy("H100")["error"]
    assert d["calibration"]["calibrated"] and d["calibration"]["error"] == pytest.approx(f)
    assert d["step_time_interval_s"] == pytest.approx([11e-3 / f, 11e-3 * f])
    assert PlanChoice.from_dict(d).ranking_note == ranked[1].ranking_note


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
