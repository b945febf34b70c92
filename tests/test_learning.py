"""benchmarks/learning.py reduced: two GPUs' smallest published records imported through the real
CLI (``sftctl calibrate import`` of published_steps' own format, ``calibrate export``, ``calibrate
show --json``), one draw of halves, each half predicted from the other's history."""

from __future__ import annotations

import math
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import learning
import published_steps

#: the smallest models of two GPUs: GPT-2 124M on H200 (eager and compiled), GPT-3 125M and 355M on A100-80GB
NAMES = ("GPT-2 124M, eager", "GPT-2 124M, torch.compile", "GPT-3 125M, 2k, DDP", "GPT-3 355M, 2k, DDP")


def test_one_draw_on_two_gpus_learns_from_the_other_half(home, tmp_path):
    records = [r for r in published_steps.RECORDS if r["name"] in NAMES]
    assert sorted(r["name"] for r in records) == sorted(NAMES)
    rows = learning.import_records(records, tmp_path)
    for r, row in zip(records, rows):
        assert row["source"] == "imported" and row["measured_step_s"] == pytest.approx(published_steps.measured_s(r))
        assert row["predicted_step_s"] > 0 and abs(sum(row["features"].values()) - 1) < 1e-3
    predicted = learning.halves(records, rows, 0, tmp_path)
    # each GPU holds two records: each is predicted from the other one's run alone, so its
    # correction goes the way the other's measured / predicted does, a part of the way
    for i, (r, p) in enumerate(zip(records, predicted)):
        j = next(k for k, o in enumerate(records) if o["gpu"] == r["gpu"] and k != i)
        other = math.log(rows[j]["measured_step_s"] / rows[j]["predicted_step_s"])
        moved = math.log(p["calibrated_s"] / p["model_s"])
        assert p["model_s"] == rows[i]["predicted_step_s"] and p["runs"] == 1
        assert moved * other > 0 and abs(moved) < abs(other)  # one run: toward it, not all the way
        assert 1 < p["error"] < p["model_error"]  # and the interval narrows
    ev = learning.evaluate(records, predicted)
    assert set(ev["per_gpu"]) == {"H200", "A100-80GB"}
    for g in ev["per_gpu"].values():
        assert g["records"] == 2 and g["after"]["error"] < g["before"]["error"]
    assert ev["regret"]["groups"] == 0  # no job of these ran on both GPUs
