"""A job's own measured step enters the run history only within the bound ``calibrate import``
and the server's POST keep (:data:`sftctl.controller.common.MEASURED_MAX_FACTOR` either way
of the model's prediction, one shared check): a clock glitch reporting 1e308 s or 1e-9 s per
step must not poison every later plan on the accelerator; a loaded CPU's 170x is a measurement.
Real local jobs; the plan's prediction is injected as tests/test_replan.py does."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap

import pytest

from conftest import run_injected, script_job, sftctl, status_json
from sftctl.types import Plan, PlanChoice

#: the model's step the injected plan predicts: 0.7 ms (a small model on a loaded CPU measures ~100x that)
PREDICTED_S = 0.0007

#: reports train.steps steps, each of $STEP_S seconds (what a glitching clock would time), no sleep
SCRIPT = textwrap.dedent("""\
    import os
    import sftctl.train as sft

    cfg = sft.config()
    for step in range(1, cfg.steps + 1):
        sft.report(step, 1.0, step_time_s=float(os.environ["STEP_S"]))
    """)


def _run(tmp_path, step_s: float):
    spec = script_job(tmp_path, "glitch", SCRIPT, f'env: {{STEP_S: "{step_s!r}"}}\ntrain: {{steps: 12}}\n')

    def injected(here):
        row = PlanChoice(dataclasses.replace(here), 1, here.usd_per_hour, step_time_s=PREDICTED_S,
                         calibrated_step_s=PREDICTED_S)
        return Plan(row, "injected", [row])

    job, status, store, _ = run_injected(spec, injected)
    return job, status, store


@pytest.mark.parametrize("step_s, ratio", [(1e308, None), (1e-9, 1e-9 / PREDICTED_S)])
def test_a_glitched_measurement_is_not_kept_and_an_event_says_why(home, tmp_path, step_s, ratio):
    from sftctl.state import JobStatus

    job, status, store = _run(tmp_path, step_s)
    assert status == JobStatus.SUCCEEDED, store.get_job(job).failure_reason
    assert store.runs(job_ids=[job]) == []  # nothing for later plans to learn from
    assert store.runs() == []
    (event,) = [e for e in store.events(job) if e.kind == "measured"]
    d = event.data
    assert d["kept"] is False and d["measured_s"] == pytest.approx(step_s) and d["model_s"] == pytest.approx(PREDICTED_S)
    assert d["max_factor"] == 1000.0 and d["measured_steps"] > 0
    if ratio is None:  # 1e308 / 7e-4 is beyond a float
        assert d["ratio"] is None and "beyond a float's range of the model's 0.7 ms" in event.message
    else:
        assert d["ratio"] == pytest.approx(ratio) and f"{ratio:.3g} x the model's 0.7 ms" in event.message
    assert event.message.startswith(f"step time: measured {step_s:g} s, not kept in the run history: ")
    assert "more than 1000x either way" in event.message


@pytest.mark.parametrize("step_s, ratio, why", [
    (1e308, None, "refused: beyond a float's range of the model's 700.0 us, not learned from"),
    (1e-9, 1e-9 / PREDICTED_S, "refused: 1.43e-06 x the model's 700.0 us, not learned from")])
def test_status_shows_a_refused_measurement_as_refused(home, tmp_path, step_s, ratio, why):
    """The measurement the controller refused is shown with the refusal (status JOB, the table,
    --json, events' final), not as the job's trusted ACTUAL nor as no measurement at all."""
    job, _, _ = _run(tmp_path, step_s)
    st = status_json(job)["step_time"]
    assert st["measured_refused"] is True and st["measured_s"] == pytest.approx(step_s) and st["measured_steps"] > 0
    assert st["refused_ratio"] == (None if ratio is None else pytest.approx(ratio))
    assert st["predicted_s"] == pytest.approx(PREDICTED_S) and st["model_s"] == pytest.approx(PREDICTED_S)
    (row,) = [j["step_time"] for j in status_json()["jobs"]]
    assert row == st
    cli = json.loads(sftctl("status", job, "--json", check=True).stdout)["step_time"]
    assert cli == st
    env = {**os.environ, "COLUMNS": "250"}
    (line,) = [ln for ln in sftctl("status", env=env, check=True).stdout.splitlines() if job in ln]
    assert f"700.0 us  {step_s:.3g} s refused" in line, line
    detail = sftctl("status", job, env=env, check=True).stdout
    assert f"step time: predicted 700.0 us, measured {step_s:.3g} s (median of {st['measured_steps']} steps after " \
           f"warm-up); {why}" in detail, detail
    final = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"][-1]["data"]["final"]
    assert final["step_time"] == st


def test_a_running_jobs_measurement_beyond_the_bound_reads_refused(home):
    """While a job runs, its newest steps' median beyond the bound reads refused too (the
    controller will not keep it), within it as before."""
    from sftctl import api
    from sftctl.state import Store
    from sftctl.types import Offering

    store = Store()
    o = Offering("local", "local", "cpu", 1, "local", 0.0)
    row = PlanChoice(o, 1, 0.0, step_time_s=PREDICTED_S, calibrated_step_s=2 * PREDICTED_S)
    for step_s, refused in ((1.0, True), (0.1195, False)):
        job = store.create_job("demo", {"resources": {"nodes": 1}, "train": {"steps": 100}})
        store.update_job(job, offering_json=Plan(row, "", [row]).to_dict())
        store.record_metrics(job, [{"rank": 0, "step": s, "step_time_s": step_s, "ts": float(s)} for s in range(1, 11)])
        st = api._view(store, store.get_job(job)).step_time
        assert st["measured_s"] == pytest.approx(step_s) and st["measured_refused"] is refused
        assert st["refused_ratio"] == (pytest.approx(step_s / PREDICTED_S) if refused else None)
        assert st["difference"] == pytest.approx(step_s / (2 * PREDICTED_S) - 1)


def test_a_loaded_cpus_170x_is_kept(home, tmp_path):
    from sftctl.state import JobStatus

    job, status, store = _run(tmp_path, 0.1195)
    assert status == JobStatus.SUCCEEDED, store.get_job(job).failure_reason
    (row,) = store.runs(job_ids=[job])
    assert row.measured_step_s == pytest.approx(0.1195) and row.predicted_step_s == pytest.approx(PREDICTED_S)
    (event,) = [e for e in store.events(job) if e.kind == "measured"]
    assert event.data["measured_s"] == pytest.approx(0.1195) and "kept" not in event.data
    st = status_json(job)["step_time"]
    assert st["measured_refused"] is False and st["refused_ratio"] is None
    assert st["measured_s"] == pytest.approx(0.1195) and st["difference"] == pytest.approx(0.1195 / PREDICTED_S - 1)
    env = {**os.environ, "COLUMNS": "250"}
    detail = sftctl("status", job, env=env, check=True).stdout
    assert f"step time: predicted 700.0 us, measured 119.5 ms {st['difference']:+.0%} (median of" in detail, detail
    assert "refused" not in detail and "refused" not in sftctl("status", env=env, check=True).stdout


def test_the_forecast_prices_the_rest_at_the_prediction_when_the_measurement_is_refused(home):
    """The server's forecast (cost so far + the remaining steps at the measured step) took a
    running job's 1e308 s median as it was: an infinite forecast. Refused, the prediction prices
    the rest; a trusted measurement still does. One node at $98.32/h for 1 h, 10 of 1000 steps."""
    import time

    from test_cost import OFFERING

    from sftctl import api
    from sftctl.server.web import forecast_usd
    from sftctl.state import JobStatus, NodeState, Store
    from sftctl.types import Offering

    store = Store()
    row = PlanChoice(Offering.from_dict(OFFERING), 1, OFFERING["usd_per_hour"], step_time_s=PREDICTED_S,
                     calibrated_step_s=PREDICTED_S)
    now = time.time()
    for step_s, priced_at in ((1e308, PREDICTED_S), (0.1195, 0.1195)):
        job = store.create_job("glitch", {"train": {"steps": 1000}, "resources": {"nodes": 1}, "run": "x"})
        store.update_job(job, provider="aws", offering_json=Plan(row, "", [row]).to_dict())
        node = store.add_node(job, 0, "aws")
        store._conn.execute("UPDATE nodes SET created_at = ?, ended_at = ? WHERE id = ?", (now - 7200, now - 3600, node))
        store.update_node(node, status=NodeState.TERMINATED)
        for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING):
            store.transition(job, s)
        store.record_metrics(job, [{"rank": 0, "step": s, "step_time_s": step_s, "ts": now - 100 + s} for s in range(1, 11)])
        view = api.status(job)
        assert view.step_time["measured_refused"] is (step_s == 1e308) and view.cost.usd == pytest.approx(98.32)
        assert forecast_usd(view) == pytest.approx(98.32 + 990 * priced_at / 3600 * 98.32)
    store.close()
