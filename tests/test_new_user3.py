"""What a researcher new to sftctl broke in the prediction features (`calibrate import` of
absurd figures), each through the real CLI in a fresh SFTCTL_HOME."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import REPO, sftctl
from sftctl.state import Store
from sftctl.types import RunRecord

QUICKSTART = Path(REPO) / "examples" / "quickstart.yaml"


def _exported(**kw) -> str:
    """One line of `calibrate export` (imported as it is, without predicting)."""
    row = {"accelerator": "H100", "count": 8, "gpus_per_node": 8, "nodes": 1, "mode": "eager",
           "predicted_step_s": 0.05, "measured_step_s": 0.06, "source": "imported", "source_label": "lab", "ts": 1.0}
    return json.dumps(row | kw)


def _spec_line(measured) -> str:
    return ('{"spec": "job.yaml", "accelerator": "H100", "gpus_per_node": 8, "nodes": 1, '
            f'"measured_step_s": {measured}}}')


def _refused(f: Path, line_no: int, *says: str) -> str:
    proc = sftctl("calibrate", "import", str(f))
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith(f"error: {f}:{line_no}: "), first
    for s in says:
        assert s in first, first
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert "nothing of the file was imported" in proc.stderr
    assert Store().runs() == []
    return first


@pytest.mark.parametrize("measured", [1e308, 1e-300, 5000.0, 1e-6])
def test_an_exported_run_far_from_its_prediction_is_refused(home, tmp_path, measured):
    """A step measured 1e308 s made every later plan on H100 NaN (STEP `nan s`, `NaN` in `plan
    --json`), 1e-300 s made it 0.0 us: a measured / predicted beyond 1000x either way is refused,
    naming the line, and nothing of the file is stored."""
    f = tmp_path / "h.jsonl"
    f.write_text(_exported() + "\n# a comment\n\n" + _exported(measured_step_s=measured) + "\n")
    first = _refused(f, 4, "measured_step_s", "the model's 50 ms", "1000x")
    assert f"{measured:g}" in first


def test_a_spec_record_far_from_its_prediction_is_refused_and_a_near_one_kept(home, tmp_path):
    (tmp_path / "job.yaml").write_text(QUICKSTART.read_text().replace("workdir: ..", f"workdir: {REPO}"))
    f = tmp_path / "runs.jsonl"
    f.write_text(_spec_line(1e308) + "\n")
    _refused(f, 1, "measured_step_s 1e+308 s", "H100:8")
    f.write_text(_spec_line(0.5) + "\n" + _spec_line(1e-300) + "\n")
    _refused(f, 2, "measured_step_s 1e-300 s")
    # a measurement of the model's order of magnitude is taken
    f.write_text(_spec_line(0.002) + "\n")
    doc = json.loads(sftctl("calibrate", "import", str(f), "--json", check=True).stdout)
    assert doc == {"imported": 1, "skipped": 0, "labels": ["runs"]}
    predicted = Store().runs()[0].predicted_step_s
    assert 0.002 / 1000 < predicted < 0.002 * 1000


@pytest.mark.parametrize("line", [_spec_line("1" + "0" * 400), _exported(measured_step_s=10 ** 400)])
def test_an_integer_too_large_for_a_float_is_one_line(home, tmp_path, line):
    """A measured step written as a 401-digit integer was `internal error: OverflowError: int too
    large to convert to float` (exit 1)."""
    (tmp_path / "job.yaml").write_text(QUICKSTART.read_text().replace("workdir: ..", f"workdir: {REPO}"))
    f = tmp_path / "runs.jsonl"
    first = _exported() if '"predicted_step_s"' in line else _spec_line(0.002)
    f.write_text(first + "\n" + line + "\n")
    _refused(f, 2, "measured_step_s", "too large")


def test_a_servers_store_refuses_rows_far_from_their_prediction(home):
    """The server's end of `calibrate import` (POST /v1/calibrate/runs: api.calibrate_store)
    checks the same bound, for a client that did not (an older sftctl, a script)."""
    from sftctl import api
    from sftctl.errors import SpecError

    good = json.loads(_exported())
    with pytest.raises(SpecError, match=r"^runs\[1\]: measured_step_s 60 s is 1.2e\+03 x the model's 50 ms"):
        api.calibrate_store([good, good | {"measured_step_s": 60.0}])
    with pytest.raises(SpecError, match=r"^runs\[0\]: measured_step_s is too large a number \(401 digits\)"):
        api.calibrate_store([good | {"measured_step_s": 10 ** 400}])
    assert Store().runs() == []
    assert api.calibrate_store([good]) == 1 and Store().runs()[0].measured_step_s == 0.06


def test_plan_json_stays_json_when_the_history_overflows(home, tmp_path):
    """A history row measured at 1.7e308 s (a state written before imports were bounded, or a
    script reporting absurd step times) made `plan --json` print `NaN` 245 times: not JSON (RFC
    8259), and `jq` refuses it. Every `--json` document gives null for a figure that is not finite."""
    Store().add_runs([RunRecord(accelerator="H100", gpus_per_node=8, nodes=1, count=8, predicted_step_s=1e-3,
                                measured_step_s=1.7e308, source="run", ts=1.0, job_id="old-1")])
    spec = tmp_path / "job.yaml"
    spec.write_text(QUICKSTART.read_text().replace("workdir: ..", f"workdir: {REPO}")
                    .replace('accelerators: ["cpu:1"]', 'accelerators: ["H100:8"]').replace("nodes: 2", "nodes: 1"))
    proc = sftctl("plan", str(spec), "--json")
    assert proc.returncode == 3, proc.stderr  # no cloud credentials: ranked, nothing it may start

    def no_constant(name):
        raise AssertionError(f"not JSON: {name} in plan --json")

    doc = json.loads(proc.stdout, parse_constant=no_constant)
    row = doc["candidates"][0]
    assert row["offering"]["accelerator"] == "H100" and row["step_time_s"] > 0
    assert row["calibrated_step_s"] is None and row["learned"]["runs"] == 1


def test_export_to_a_path_it_cannot_write_is_one_line(home, tmp_path):
    """`calibrate export /no/such/dir/h.jsonl` was `internal error: FileNotFoundError` (exit 1)."""
    Store().add_runs([RunRecord.from_dict(json.loads(_exported()) | {"source": "imported"})])
    for path, says in ((tmp_path / "no" / "dir" / "h.jsonl", "No such file or directory"),
                       (tmp_path, "Is a directory")):
        proc = sftctl("calibrate", "export", str(path))
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        first = proc.stderr.strip().splitlines()[0]
        assert first == f"error: calibrate export {path}: cannot write it: {says}", first
        assert "internal error" not in proc.stderr and "give a file in a folder that exists" in proc.stderr
    out = tmp_path / "h.jsonl"
    sftctl("calibrate", "export", str(out), check=True)
    assert [json.loads(x)["measured_step_s"] for x in out.read_text().splitlines()] == [0.06]


def test_forgetting_a_label_no_run_has_names_the_labels(home):
    """`calibrate forget --source lab-pats` (a typo for lab-past) said only `forgot 0 run(s)`."""
    Store().add_runs([RunRecord.from_dict(json.loads(_exported(source_label=s)) | {"source": "imported"})
                      for s in ("lab-past", "published")])
    proc = sftctl("calibrate", "forget", "--source", "lab-pats", env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("forgot 0 run(s): no run has source label 'lab-pats' "
                                   "(labels: lab-past, published)"), proc.stdout
    assert json.loads(sftctl("calibrate", "forget", "--source", "lab-pats", "--json", check=True).stdout) == {"forgotten": 0}
    assert sftctl("calibrate", "forget", "--source", "published", check=True).stdout.strip() == "forgot 1 run(s)"
    assert len(Store().runs()) == 1
