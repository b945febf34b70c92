"""A job's own measured step enters the run history only within the bound ``calibrate import``
and the server's POST keep (:data:`sftctl.controller.common.MEASURED_MAX_FACTOR` either way
of the model's prediction, one shared check): a clock glitch reporting 1e308 s or 1e-9 s per
step must not poison every later plan on the accelerator; a loaded CPU's 170x is a measurement.
Real local jobs; the plan's prediction is injected as tests/test_replan.py does."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

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
    from sftctl import api
    from sftctl.controller.lifecycle import Controller
    from sftctl.state import Store

    (tmp_path / "train.py").write_text(SCRIPT)
    spec = tmp_path / "job.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: glitch
        workdir: {tmp_path}
        run: python train.py
        env: {{STEP_S: "{step_s!r}"}}
        train: {{steps: 12}}
        health: {{enabled: false}}
        """))
    job = api.submit(str(spec)).job_id
    store = Store()
    here = store.get_job(job).plan.offering
    row = PlanChoice(dataclasses.replace(here), 1, here.usd_per_hour, step_time_s=PREDICTED_S,
                     calibrated_step_s=PREDICTED_S)
    store.update_job(job, offering_json=Plan(row, "injected", [row]).to_dict())
    status = Controller(store, job).run()
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


def test_a_loaded_cpus_170x_is_kept(home, tmp_path):
    from sftctl.state import JobStatus

    job, status, store = _run(tmp_path, 0.1195)
    assert status == JobStatus.SUCCEEDED, store.get_job(job).failure_reason
    (row,) = store.runs(job_ids=[job])
    assert row.measured_step_s == pytest.approx(0.1195) and row.predicted_step_s == pytest.approx(PREDICTED_S)
    (event,) = [e for e in store.events(job) if e.kind == "measured"]
    assert event.data["measured_s"] == pytest.approx(0.1195) and "kept" not in event.data
