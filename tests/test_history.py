"""Predictions that learn from every run (issue 35, items 1 and 2): the step series and run
history in the state (both dialects), a local job's predicted and measured step, the shrinkage
toward the model, `calibrate import/show/export/forget`, and the plan ranking by the corrected
figure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import REPO, sftctl, status_json, wait_for
from sftctl import history, history_import
from sftctl.errors import SpecError
from sftctl.state import STEP_SERIES_CAP, Store
from sftctl.types import RunRecord

QUICKSTART = str(Path(REPO) / "examples" / "quickstart.yaml")
MIX = {"attention": 0.15, "gemm": 0.7, "pointwise": 0.1, "collectives": 0.05}


def _run(measured: float, predicted: float = 1.0, accelerator: str = "H100", features: dict | None = MIX,
         provider: str = "aws", instance_type: str = "p5.48xlarge", source: str = "imported", label: str = "lab-a",
         mode: str = "eager", job_id: str | None = None) -> RunRecord:
    return RunRecord(job_id=job_id, accelerator=accelerator, count=8, gpus_per_node=8, nodes=1, provider=provider,
                     instance_type=instance_type, region="us-east-1", mode=mode, strategy="ddp",
                     predicted_step_s=predicted, measured_step_s=measured, measured_steps=10, features=features,
                     name="m", source=source, source_label=label, ts=1.0)


# ------------------------------------------------------------------------------ the state


def test_the_step_series_and_run_history_on_both_dialects(state_backend):
    store = Store()
    job = store.create_job("demo", {})
    store.record_metrics(job, [{"rank": r, "step": s, "loss": 1.0 / s, "step_time_s": 0.1 * s, "tokens_per_s": 5.0,
                                "lr": 1e-3, "checkpoint": s == 2, "ts": float(s)} for s in (1, 2, 3) for r in (0, 1)])
    series = store.step_series(job, rank=1)
    assert [(p.step, p.step_time_s, p.lr, p.checkpoint) for p in series] == [
        (1, 0.1, 1e-3, False), (2, 0.2, 1e-3, True), (3, pytest.approx(0.3), 1e-3, False)]
    assert len(store.step_series(job)) == 6
    (latest_0, _) = store.metrics(job)  # the latest-per-rank table is as it was
    assert latest_0.step == 3
    n = store.add_runs([_run(2.0, job_id=job, source="run"), _run(1.5, features=None)])
    assert n == 2
    store.add_runs([_run(3.0, job_id=job, source="run")])  # a job measured again: its row replaced
    rows = store.runs()
    assert [(r.source, r.measured_step_s, r.features) for r in rows] == [("imported", 1.5, None), ("run", 3.0, MIX)]
    assert rows[1].to_dict() | {"id": None} == _run(3.0, job_id=job, source="run").to_dict()  # every field kept
    assert rows[0].id < rows[1].id
    assert [r.job_id for r in store.runs(job_ids=[job])] == [job]
    assert store.runs(accelerator="h100") and not store.runs(accelerator="A100-80GB")
    assert store.forget_runs(source="imported") == 1
    assert [r.source for r in store.runs()] == ["run"]
    assert store.forget_runs(source_label="lab-a") == 1 and store.runs() == []
    with pytest.raises(ValueError):
        store.forget_runs()


def test_the_step_series_stays_bounded(state_backend, monkeypatch):
    import sftctl.state as state

    monkeypatch.setattr(state.series, "STEP_SERIES_CAP", 40)
    store = Store()
    job = store.create_job("demo", {})
    for batch in range(10):  # 100 reports of rank 0, ten at a time
        store.record_metrics(job, [{"rank": 0, "step": batch * 10 + i + 1, "step_time_s": 0.5, "ts": 1.0}
                                   for i in range(10)])
    steps = [p.step for p in store.step_series(job)]
    assert len(steps) <= 40
    assert steps[-20:] == list(range(81, 101))  # the newest points whole
    assert steps[0] == 1 and steps == sorted(steps)  # older points thinned, not dropped at the front
    assert [p.step for p in store.step_series(job, last=5)] == [96, 97, 98, 99, 100]  # what status reads
    assert STEP_SERIES_CAP == 10_000


# ------------------------------------------------------------------------------ measuring and the math


def test_the_measured_step_leaves_out_warm_up_and_checkpoint_steps():
    warm = [{"rank": 0, "step": s, "step_time_s": 5.0} for s in (1, 2, 3)]  # compilation, cache warm-up
    steady = [{"rank": 0, "step": s, "step_time_s": 0.1} for s in range(4, 10)]
    ckpt = [{"rank": 0, "step": 10, "step_time_s": 9.0, "checkpoint": True}]
    resumed = [{"rank": 0, "step": 5, "step_time_s": 7.0}, {"rank": 0, "step": 6, "step_time_s": 7.0}]  # a restart
    assert history.measured_step_s(warm + steady + ckpt + resumed) == (0.1, 6)
    assert history.measured_step_s(warm) == (None, 0)


def test_one_run_moves_a_prediction_a_little_and_twenty_most_of_the_way():
    none = history.calibrate(1.0, "H100", [], provider="aws", instance_type="p5.48xlarge", mode="eager", features=MIX)
    one = history.calibrate(1.0, "H100", [_run(2.0)], provider="aws", instance_type="p5.48xlarge", mode="eager",
                            features=MIX)
    twenty = history.calibrate(1.0, "H100", [_run(2.0)] * 20, provider="aws", instance_type="p5.48xlarge",
                               mode="eager", features=MIX)
    assert none["calibrated_step_s"] == 1.0 and none["correction"] == 1.0 and none["runs"] == 0
    # in log: one run 1/(k+1) = 20 % of the way to 2x, twenty 20/24 = 83 %
    assert one["correction"] == pytest.approx(2 ** 0.2, rel=1e-6)
    assert twenty["correction"] == pytest.approx(2 ** (20 / 24), rel=1e-6)
    assert 1.0 < one["calibrated_step_s"] < 1.2 < 1.75 < twenty["calibrated_step_s"] < 2.0
    # the STEP RANGE narrows as runs accumulate
    width = lambda c: c["interval_s"][1] / c["interval_s"][0]  # noqa: E731
    assert width(none) > width(one) > width(twenty)
    assert none["error"] == pytest.approx(history.error_factor("H100"))
    assert twenty["runs"] == 20 and twenty["sources"] == {"run": 0, "imported": 20, "labels": ["lab-a"]}


def test_a_dissimilar_steps_runs_move_it_less():
    resnet_like = {"attention": 0.0, "gemm": 0.35, "pointwise": 0.6, "collectives": 0.05}
    llama_like = {"attention": 0.18, "gemm": 0.68, "pointwise": 0.1, "collectives": 0.04}
    same = history.calibrate(1.0, "H100", [_run(2.0, features=llama_like)] * 5, features=MIX)
    other = history.calibrate(1.0, "H100", [_run(2.0, features=resnet_like)] * 5, features=MIX)
    assert history.similarity(MIX, llama_like) > 0.8 > 0.3 > history.similarity(MIX, resnet_like)
    assert same["correction"] > other["correction"] > 1.0
    # another accelerator's runs say less (only the step's shared residual); another offering's and
    # another mode's say less than this one's
    a100 = history.calibrate(1.0, "A100-80GB", [_run(2.0)] * 5, features=MIX)
    assert (a100["runs"], a100["other_accelerator_runs"]) == (0, 5) and 1.0 < a100["correction"] < same["correction"]
    here = history.calibrate(1.0, "H100", [_run(2.0)] * 5, provider="aws", instance_type="p5.48xlarge", features=MIX)
    there = history.calibrate(1.0, "H100", [_run(2.0)] * 5, provider="gcp", instance_type="a3-highgpu-8g",
                              features=MIX)
    assert here["correction"] > there["correction"] > 1.0
    eager = history.calibrate(1.0, "H100", [_run(2.0)] * 5, mode="default", features=MIX)
    assert eager["correction"] < history.calibrate(1.0, "H100", [_run(2.0)] * 5, mode="eager", features=MIX)["correction"]


def test_the_ranking_uses_the_calibrated_figure():
    """H100 is predicted cheaper per step than A100-80GB; twenty runs say H100 steps take 3x as
    long as predicted on this offering: the plan ranks A100-80GB first, says both figures."""
    from sftctl.compiler.api import OfferingPrediction
    from sftctl.compiler.sharding import StrategyPrediction
    from sftctl.compiler.step import StepPrediction
    from sftctl.planner import plan
    from sftctl.spec import load_spec

    spec_path = Path(REPO) / "examples" / "quickstart.yaml"
    spec = load_spec(spec_path, ["resources.accelerators=[\"H100:8\", \"A100-80GB:8\"]", "resources.nodes=1",
                                 "resources.clouds=[aws]", "train.steps=1000",
                                 "health.preflight=off"])  # the steps alone: no preflight minutes in the figures
    speed = {"H100": 0.10, "A100-80GB": 0.25}

    def predict(o, nodes):
        t = speed[o.accelerator]
        s = StrategyPrediction("ddp", False, 8, t, 0.0, t, 1, 2**40, {})
        return OfferingPrediction(StepPrediction(o.accelerator, 8, t, 0.0, t, 1, 2**40, 1), (s,), s, "ddp fits")

    base = plan(spec, usable={"aws": None}, predict=predict)
    assert base.chosen.offering.accelerator == "H100"
    h100 = base.chosen.offering
    runs = [_run(0.30, predicted=0.10, provider=h100.provider, instance_type=h100.instance_type, features=None,
                 mode=None)] * 20
    learned = plan(spec, usable={"aws": None}, predict=predict, history=runs)
    assert learned.chosen.offering.accelerator == "A100-80GB"
    row = next(c for c in learned.candidates if c.offering == h100)
    # no kernel mix on either side: each pair of steps alike by UNKNOWN_SIMILARITY (0.5), so in units of
    # s0^2 every run's covariance with this step and with each other run is b = 1/2 + 1/2 x 0.5 = 0.75, the
    # noise k = 4: c = 20 b / (k + (1 - b) + 20 b) ln 3 = 15 / 19.25 ln 3
    assert row.step_time_s == pytest.approx(0.10)
    assert row.calibrated_step_s == pytest.approx(0.10 * 3 ** (15 / 19.25))
    assert row.learned["runs"] == 20 and row.hours == pytest.approx(row.calibrated_step_s * 1000 / 3600)
    lo, hi = row.step_time_interval_s
    assert lo < row.calibrated_step_s < hi and hi / lo < 1.84 ** 2  # narrower than the model's own
    doc = row.to_dict()
    assert doc["step_time_s"] == pytest.approx(0.10) and doc["calibrated_step_s"] == row.calibrated_step_s
    # the A100's prediction moves through the step's shared residual only: gamma = (1 - b) rho (the A100's
    # prior is the narrower) over s0^2, each run's covariance with it gamma x 0.5, and the runs' own
    # matrix q^2 (0.75 J + 4.25 I), q = s_H100 / s_A100: c = 0.5 gamma 20 / (q^2 19.25) ln 3
    a100 = next(c for c in learned.candidates if c.offering.accelerator == "A100-80GB")
    q = math.log(history.error_factor("H100")) / math.log(history.error_factor("A100-80GB"))
    gamma = (1 - history.ACCELERATOR_SHARE) * history.CROSS_ACCELERATOR_SHARE
    assert (a100.learned["runs"], a100.learned["other_accelerator_runs"]) == (0, 20)
    assert a100.calibrated_step_s == pytest.approx(0.25 * 3 ** (0.5 * gamma * 20 / (q * q * 19.25)))
    assert 1.05 < a100.calibrated_step_s / 0.25 < row.calibrated_step_s / 0.10
    from rich.console import Console

    from sftctl.ui import plan_table

    import dataclasses

    # both accelerators without measured kernels: only the A100, which no run corrects, is "uncalibrated"
    uncal = {"calibrated": False, "sources": [], "error": 1.84}
    console = Console(width=250, record=True)
    console.print(plan_table([dataclasses.replace(c, calibration=uncal) for c in learned.candidates], 1000))
    text = console.export_text()
    assert "STEP and STEP RANGE learned from past runs (A100-80GB: 20 on other GPUs, H100: 20;" in text
    assert "* uncalibrated: no measured kernels or steps on A100-80GB;" in text
    assert f"{row.calibrated_step_s * 1e3:.1f} ms" in text  # the H100 row's STEP is the corrected figure
    assert f"{a100.calibrated_step_s * 1e3:.1f} ms" in text  # and the A100's
    # only the A100, which no run of its own corrects, keeps its `*`; $/STEP is the corrected STEP's
    assert f"{row.calibrated_step_s * 1e3:.1f} ms *" not in text and f"{a100.calibrated_step_s * 1e3:.1f} ms *" in text
    assert f"{row.usd_per_hour * row.calibrated_step_s / 3600:.5f}" in text
    # the pick is the A100, which only the H100's runs corrected
    assert "corrected by 20 on other accelerators)" in learned.reason and "20 past run(s)" not in learned.reason


# ------------------------------------------------------------------------------ a local job, end to end


def test_a_local_job_records_predicted_and_measured_step_times(home):
    job = json.loads(sftctl("run", QUICKSTART, "--set", "train.steps=10", "--set", "train.checkpoint_interval=5",
                            "--detach", "--json", check=True).stdout)["job_id"]
    wait_for(lambda: status_json(job)["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER"), timeout_s=300,
             what="the job to finish")
    doc = status_json(job)
    assert doc["status"] == "SUCCEEDED", doc.get("failure_reason")
    st = doc["step_time"]
    plan = Store().get_job(job).plan
    assert st["model_s"] == pytest.approx(plan.planned("step_time_s")) and st["model_s"] > 0
    assert st["predicted_s"] == pytest.approx(plan.planned("calibrated_step_s"))
    series = Store().step_series(job)
    assert sorted({p.rank for p in series}) == [0, 1] and len(series) == 20
    measured, n = history.measured_step_s(series)
    assert st["measured_s"] == pytest.approx(measured) and st["measured_steps"] == n == 14  # 2 x (10 - 3)
    assert st["difference"] == pytest.approx(measured / st["predicted_s"] - 1)
    (row,) = Store().runs(job_ids=[job])
    assert (row.source, row.accelerator, row.provider, row.nodes, row.gpus_per_node) == ("run", "cpu", "local", 2, 1)
    assert row.predicted_step_s == pytest.approx(st["model_s"]) and set(row.features) == set(history.MIX_KEYS)
    events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
    (measured_event,) = [e for e in events if e["kind"] == "measured"]
    assert measured_event["data"]["measured_s"] == pytest.approx(measured)
    assert events[-1]["data"]["final"]["step_time"]["measured_s"] == pytest.approx(measured)
    table = sftctl("status", env={**_env(), "COLUMNS": "200"}, check=True).stdout
    assert "PRED" in table and "ACTUAL" in table and f"{st['difference']:+.0%}" in table
    # the next plan on this machine learns from it
    replanned = json.loads(sftctl("plan", QUICKSTART, "--json", check=True).stdout)
    again = replanned["candidates"][0]
    assert "corrected by 1 past run(s)" in replanned["reason"]
    assert again["learned"]["runs"] == 1 and again["learned"]["sources"]["run"] == 1
    expected = history.calibrate(again["step_time_s"], "cpu", [row], provider="local",
                                 instance_type=again["instance_type"], mode=row.mode, features=again["features"],
                                 comm_share=again["features"]["collectives"])
    assert again["calibrated_step_s"] == pytest.approx(expected["calibrated_step_s"], rel=1e-3)
    assert again["calibrated_step_s"] != pytest.approx(again["step_time_s"], rel=1e-4)


def _env() -> dict:
    import os

    return dict(os.environ)


# ------------------------------------------------------------------------------ calibrate import / show / export / forget


def _published_line(**kw) -> str:
    rec = {"name": "GPT quickstart", "gpu": "H100", "entrypoint": "examples/gpt/model.py:build", "batch_per_gpu": 4,
           "seq_len": 256, "dtype": "float32", "mode": "eager", "gpus_per_node": 1, "nodes": 1, "parallelism": "ddp",
           "checkpointing": False, "tokens_per_s_per_gpu": 20000.0, "source": "a citation"}
    return json.dumps(rec | kw)


def test_import_show_export_forget_round_trip(home, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(Path(QUICKSTART).read_text().replace("workdir: ..", f"workdir: {REPO}"))
    runs = tmp_path / "runs.jsonl"
    runs.write_text("\n".join([
        json.dumps({"spec": "job.yaml", "accelerator": "H100", "gpus_per_node": 8, "nodes": 1, "measured_step_s": 0.05,
                    "provider": "aws", "instance_type": "p5.48xlarge", "source": "lab-past"}),
        "# a comment, then a blank line",
        "",
        json.dumps({"spec": "job.yaml", "accelerator": "h100", "gpus_per_node": 8, "nodes": 1, "measured_step_s": 0.06,
                    "mode": "eager", "source": "lab-past"}),
    ]) + "\n")
    (tmp_path / "examples").symlink_to(Path(REPO) / "examples")
    pub = tmp_path / "published.jsonl"
    pub.write_text(_published_line() + "\n")
    out = json.loads(sftctl("calibrate", "import", str(runs), "--json", check=True).stdout)
    assert out == {"imported": 2, "skipped": 0, "labels": ["lab-past"]}
    assert json.loads(sftctl("calibrate", "import", str(pub), "--json", check=True).stdout)["imported"] == 1
    shown = json.loads(sftctl("calibrate", "show", "--json", check=True).stdout)
    assert len(shown["runs"]) == 3 and {r["source"] for r in shown["runs"]} == {"imported"}
    assert sorted(r["source_label"] for r in shown["runs"]) == ["lab-past", "lab-past", "published"]
    pub_row = next(r for r in shown["runs"] if r["source_label"] == "published")
    assert pub_row["measured_step_s"] == pytest.approx(4 * 256 / 20000.0)
    for r in shown["runs"]:  # the model's prediction for each, so the correction is measured / predicted
        assert r["predicted_step_s"] > 0 and r["accelerator"] == "H100" and set(r["features"]) == set(history.MIX_KEYS)
        assert r["interval_low_s"] < r["predicted_step_s"] < r["interval_high_s"]
    assert {(g["accelerator"], g["source"], g["runs"]) for g in shown["summary"]} >= {("H100", "imported", 1)}
    table = sftctl("calibrate", "show", env={**_env(), "COLUMNS": "200"}, check=True).stdout
    assert "run history: 3 run(s)" in table and "lab-past" in table
    exported = tmp_path / "export.jsonl"
    sftctl("calibrate", "export", str(exported), check=True)
    lines = [json.loads(x) for x in exported.read_text().splitlines()]
    assert len(lines) == 3 and lines == [{k: r[k] for k in lines[0]} for r in shown["runs"]]
    assert json.loads(sftctl("calibrate", "forget", "--source", "published", "--json", check=True).stdout) == {"forgotten": 1}
    assert json.loads(sftctl("calibrate", "forget", "--imported", "--json", check=True).stdout) == {"forgotten": 2}
    assert json.loads(sftctl("calibrate", "show", "--json", check=True).stdout)["runs"] == []
    # the export comes back whole, without predicting again
    assert json.loads(sftctl("calibrate", "import", str(exported), "--json", check=True).stdout)["imported"] == 3
    again = json.loads(sftctl("calibrate", "show", "--json", check=True).stdout)["runs"]
    keep = ("accelerator", "predicted_step_s", "measured_step_s", "features", "source_label", "source")
    assert [{k: r[k] for k in keep} for r in again] == [{k: r[k] for k in keep} for r in shown["runs"]]
    # compile --json gives the model's step and the calibrated one with its evidence
    doc = json.loads(sftctl("compile", str(spec), "--target", "h100", "--json", "--out", str(tmp_path / "c"),
                            check=True).stdout)
    assert doc["learned"]["runs"] == 3 and doc["learned"]["sources"]["imported"] == 3
    assert doc["calibrated_step_s"] == pytest.approx(doc["step_time_s"] * doc["learned"]["correction"])
    assert doc["calibrated_step_s"] != pytest.approx(doc["step_time_s"], rel=1e-3)


def test_importing_an_export_twice_adds_nothing(home, tmp_path):
    """`calibrate export > h.jsonl; calibrate import h.jsonl` (twice): this lab's job's run is the
    same measurement as its exported line, so neither import adds a row (a user found it counted 3 times)."""
    store = Store()
    store.add_runs([_run(0.5, job_id="job-1", source="run", label=None), _run(0.7, label="lab-a")])
    exported = tmp_path / "h.jsonl"
    exported.write_text(sftctl("calibrate", "export", check=True).stdout)
    for _ in range(2):
        proc = sftctl("calibrate", "import", str(exported), check=True)
        assert "imported 0 run(s)" in proc.stdout and "2 already present, skipped" in proc.stdout, proc.stdout
    runs = json.loads(sftctl("calibrate", "show", "--json", check=True).stdout)["runs"]
    assert sorted((r["source"], r["measured_step_s"]) for r in runs) == [("imported", 0.7), ("run", 0.5)]
    # a new measurement in the same file is imported, the known ones still skipped
    lines = exported.read_text().splitlines()
    lines.append(json.dumps(json.loads(lines[0]) | {"measured_step_s": 0.9, "ts": 2.0}))
    exported.write_text("\n".join(lines) + "\n")
    doc = json.loads(sftctl("calibrate", "import", str(exported), "--json", check=True).stdout)
    assert (doc["imported"], doc["skipped"]) == (1, 2)
    assert len(json.loads(sftctl("calibrate", "show", "--json", check=True).stdout)["runs"]) == 3


def test_an_export_with_a_bom_reads_and_a_huge_integer_is_its_lines_error(tmp_path):
    """A file saved with a UTF-8 BOM (Windows editors) reads as its rows; a step written as a
    400-digit integer (no float holds it) is that line's error, not an OverflowError."""
    row = {k: v for k, v in _run(0.5).to_dict().items() if k != "id"}
    f = tmp_path / "h.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + (json.dumps(row) + "\n").encode())
    got = history_import.read_exported(f)
    assert got is not None and [r.measured_step_s for r in got] == [0.5]
    f.write_text(json.dumps(row) + "\n" + json.dumps(row)[:-1] + ', "measured_step_s": ' + "9" * 400 + "}\n")
    with pytest.raises(history_import.ImportError_, match=f"{f}:2: measured_step_s is too large a number \\(400 digits\\)"):
        history_import.read_exported(f)
    with pytest.raises(SpecError, match=r"runs\[0\]: .*predicted_step_s"):
        history_import.check_rows([row | {"predicted_step_s": 10 ** 400}])


@pytest.mark.parametrize("lines, line_no, says", [
    (["{}", "not json"], 1, "missing entrypoint"),
    ([_published_line(), "not json"], 2, "not JSON"),
    ([_published_line(), _published_line(), "[1, 2]"], 3, "not a JSON object"),
    ([_published_line(gpu="Z900")], 1, "gpu 'Z900' is not in the catalog"),
    ([_published_line(), _published_line(nodes=0)], 2, "nodes must be a positive integer"),
    ([_published_line(tokens_per_s_per_gpu=-5.0)], 1, "measured_step_s must be a positive number"),
    ([_published_line(entrypoint="nowhere/model.py:build")], 1, "no file"),
    ([json.dumps({"spec": "missing.yaml", "accelerator": "H100", "gpus_per_node": 1, "nodes": 1,
                  "measured_step_s": 1.0})], 1, "spec 'missing.yaml': no such file"),
    ([json.dumps({"spec": "runs.jsonl", "accelerator": "H100", "gpus_per_node": 1, "nodes": 1,
                  "measured_step_s": 1.0, "colour": "red"})], 1, "unknown field 'colour'"),
    ([_published_line(mode="turbo")], 1, "mode 'turbo' is not one of"),
    ([_published_line(), _published_line(attention="warp")], 2, "attention 'warp' is not one of"),
    ([_published_line(checkpointing=1.5)], 1, "checkpointing must be true, false or the fraction"),
    ([_published_line(torch="two")], 1, "torch must be a major.minor version"),
    ([_published_line(inter_node_bytes_per_s=0)], 1, "inter_node_bytes_per_s must be a positive number"),
    ([_published_line(reduce_dtype="int8")], 1, "reduce_dtype 'int8' is not one of"),
])
def test_a_bad_import_file_is_refused_whole_with_its_line(home, tmp_path, lines, line_no, says):
    (tmp_path / "examples").symlink_to(Path(REPO) / "examples")
    f = tmp_path / "runs.jsonl"
    f.write_text("\n".join(lines) + "\n")
    proc = sftctl("calibrate", "import", str(f))
    assert proc.returncode == 2, proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert f"{f}:{line_no}: " in first and says in first, first
    assert "Traceback" not in proc.stderr and "nothing of the file was imported" in proc.stderr
    assert Store().runs() == []


def test_a_directory_or_unreadable_import_file_is_one_clear_line(home, tmp_path):
    """A directory, a file that is not UTF-8 and a missing one: each one line naming the path and
    what is wrong with it, exit 2, nothing imported."""
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"name": "caf\xe9"}\n')
    for path, says in ((tmp_path, "is a directory, not a JSON-lines file"), (latin, "cannot be read: 'utf-8' codec"),
                       (tmp_path / "gone.jsonl", "no such file")):
        proc = sftctl("calibrate", "import", str(path))
        assert proc.returncode == 2, proc.stderr
        first = proc.stderr.strip().splitlines()[0]
        assert first.startswith("error: ") and f"{path}: {says}" in first, first
        assert "Traceback" not in proc.stderr
    assert Store().runs() == []


def test_an_imported_record_reducing_in_bf16_is_priced_so(tmp_path):
    """fms-fsdp reduce-scatters its gradients in bf16: an imported FSDP record saying
    ``reduce_dtype: bfloat16`` is priced with half the reduce-scatter bytes of the float32 default,
    as benchmarks/published_steps.py prices it, so its step is shorter (two H100 nodes: the
    reduce-scatter crosses the network)."""
    (tmp_path / "examples").symlink_to(Path(REPO) / "examples")
    f = tmp_path / "runs.jsonl"
    fsdp = {"parallelism": "fsdp", "gpus_per_node": 8, "nodes": 2, "dtype": "bfloat16"}
    f.write_text(_published_line(**fsdp) + "\n" + _published_line(**fsdp, reduce_dtype="bfloat16") + "\n")
    fp32, bf16 = history_import.read_import(f)
    assert (fp32["reduce_dtype"], bf16["reduce_dtype"]) == ("float32", "bfloat16")
    cache: dict = {}
    slow, fast = history_import.predict_record(fp32, cache), history_import.predict_record(bf16, cache)
    assert slow.strategy == fast.strategy == "fsdp"
    assert 0 < fast.predicted_step_s < slow.predicted_step_s


def test_forget_needs_what_to_forget(home):
    from sftctl import api

    proc = sftctl("calibrate", "forget")
    assert proc.returncode == 2 and "--imported or --source" in proc.stderr
    with pytest.raises(TypeError, match="api.calibrate_import: file must be a file path"):
        api.calibrate_import(3)


def test_plan_with_an_empty_history_is_the_model(home):
    """No history: calibrated_step_s is the model's, the range the accelerator's error factor,
    and plan leaves no state.db behind (it creates none)."""
    doc = json.loads(sftctl("plan", QUICKSTART, "--json", check=True).stdout)
    c = doc["candidates"][0]
    assert c["calibrated_step_s"] == c["step_time_s"] and c["learned"]["runs"] == 0
    f = c["calibration"]["error"]
    assert c["step_time_interval_s"] == pytest.approx([c["step_time_s"] / f, c["step_time_s"] * f])
    assert math.isclose(sum(c["features"].values()), 1.0, abs_tol=1e-3)
    assert not (home / "state.db").exists()


def test_through_a_server_the_history_is_the_servers_and_forgetting_is_an_admins(home, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from test_server import Server, as_user, tokens

    t = tokens("alice", admin="admin1")
    exported = tmp_path / "past.jsonl"
    exported.write_text("".join(json.dumps({k: v for k, v in _run(0.3 + i / 10).to_dict().items()
                                            if k not in ("job_id", "source")})
                                + "\n" for i in range(3)))
    server = Server(home, tmp_path / "server.log").start()
    try:
        as_user(monkeypatch, server, t["alice"])
        assert json.loads(sftctl("calibrate", "import", str(exported), "--json", check=True).stdout)["imported"] == 3
        monkeypatch.delenv("SFTCTL_SERVER_URL")  # the rows are in the server's state, not stored twice here
        assert [r.measured_step_s for r in Store().runs()] == [0.3, 0.4, 0.5]
        assert {r.source for r in Store().runs()} == {"imported"}
        Store().add_runs([_run(9.0, label="only-here")])  # this machine's own history is not the server's
        as_user(monkeypatch, server, t["alice"])
        shown = json.loads(sftctl("calibrate", "show", "--json", check=True).stdout)["runs"]
        assert len(shown) == 4  # (the test's server shares this home's state)
        proc = sftctl("calibrate", "forget", "--imported")
        assert proc.returncode == 2 and "calibrate forget: alice is not an admin of this server" in proc.stderr
        as_user(monkeypatch, server, t["admin1"])
        proc = sftctl("calibrate", "forget", "--source", "lab-a", "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == {"forgotten": 3}
        assert [r["source_label"] for r in json.loads(sftctl("calibrate", "show", "--json", check=True).stdout)["runs"]] \
            == ["only-here"]
    finally:
        server.stop()


def test_a_running_jobs_actual_is_measured_from_its_newest_steps(state_backend):
    """While a job runs, PRED is its plan's (corrected) step, ACTUAL the median of its newest
    reported steps after warm-up (api.STATUS_SERIES_ROWS of them), before any history row."""
    from sftctl import api
    from sftctl.types import Offering, Plan, PlanChoice

    store = Store()
    job = store.create_job("demo", {"resources": {"nodes": 1}, "train": {"steps": 100}})
    o = Offering("local", "local", "cpu", 1, "local", 0.0)
    row = PlanChoice(o, 1, 0.0, step_time_s=0.10, calibrated_step_s=0.125, step_time_interval_s=[0.1, 0.15])
    store.update_job(job, offering_json=Plan(row, "", [row]).to_dict())
    store.record_metrics(job, [{"rank": 0, "step": s, "step_time_s": 1.0 if s <= 3 else 0.15, "ts": float(s)}
                               for s in range(1, 11)])
    view = api._view(store, store.get_job(job))
    assert view.step_time == {"predicted_s": 0.125, "model_s": 0.10, "interval_s": [0.1, 0.15], "measured_s": 0.15,
                              "measured_steps": 7, "difference": pytest.approx(0.2), "measured_refused": False,
                              "refused_ratio": None}
    assert view.to_dict()["step_time"] == view.step_time
    assert api.JobView.from_wire(view.to_wire()).step_time == view.step_time  # as a server sends it
    from sftctl.ui import step_time_cells

    assert step_time_cells(view.step_time) == ["125.0 ms", "150.0 ms +20%"]
