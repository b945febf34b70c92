"""`sftctl metrics JOB` (issue 36): a job's reported steps per rank from the state's history, as a
table, a terminal plot or JSON; the server's path is in tests/test_web.py."""

from __future__ import annotations

import json
import os

from conftest import no_traceback, sftctl
from sftctl import api
from sftctl.state import Store


def test_metrics_shows_each_ranks_steps_as_table_plot_and_json(state_backend):
    store = Store()
    job = store.create_job("m", {"name": "m", "resources": {"nodes": 2}, "train": {"steps": 30}, "run": "true"})
    store.record_metrics(job, [{"rank": r, "step": s, "loss": 4.0 / s + r, "step_time_s": 0.25,
                                "tokens_per_s": 1000.0 * s, "lr": 3e-4, "ts": 1e9 + s}
                               for s in range(1, 31) for r in (0, 1)])
    doc = json.loads(sftctl("metrics", job, "--json", check=True).stdout)
    assert doc["job_id"] == job and len(doc["steps"]) == 60
    assert [(s["rank"], s["step"], s["loss"]) for s in doc["steps"][:2]] == [(0, 1, 4.0), (0, 2, 2.0)]
    assert [s.to_dict() for s in api.metrics(job, rank=1)] == [s for s in doc["steps"] if s["rank"] == 1]
    one = json.loads(sftctl("metrics", job[:6], "--rank", "1", "--json", check=True).stdout)["steps"]
    assert {s["rank"] for s in one} == {1} and len(one) == 30
    table = sftctl("metrics", job, "--last", "2", env={**os.environ, "COLUMNS": "120"}, check=True).stdout.splitlines()
    assert table[0].split() == ["RANK", "STEP", "LOSS", "STEP", "TIME", "TOK/S", "LR"]
    assert [line.split() for line in table[1:]] == [
        ["0", "29", "0.1379", "250.0", "ms", "29,000", "0.0003"], ["0", "30", "0.1333", "250.0", "ms", "30,000", "0.0003"],
        ["1", "29", "1.1379", "250.0", "ms", "29,000", "0.0003"], ["1", "30", "1.1333", "250.0", "ms", "30,000", "0.0003"]]
    plot = sftctl("metrics", job, "--plot", env={**os.environ, "COLUMNS": "80"}, check=True).stdout
    lines = plot.splitlines()
    assert lines[0].split() == ["loss", "rank", "0", "rank", "1"]
    assert lines[1].lstrip().startswith("5 │") and "•" in lines[1]  # rank 1's first loss, 4.0 + 1, tops the y axis
    assert any(line.lstrip().startswith("step 1") and line.rstrip().endswith("30") for line in lines)
    assert plot.count("│") == 2 * 16 and "tokens/s" in plot
    proc = sftctl("metrics", job, "--rank", "7")  # a rank the job does not have: said, not "no step yet"
    assert proc.returncode == 2 and no_traceback(proc)
    assert proc.stderr.splitlines()[0] == f"error: job {job} has no rank 7: its ranks reported are 0-1"
    proc = sftctl("metrics", "no-such-job")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and no_traceback(proc)


#: a job that reports through sftctl.train (whose report refuses bad values) and then writes bad
#: records itself, the way report writes its lines, as a job with its own writer may
BAD_METRICS_JOB = r'''
import json, os, pathlib, time
import sftctl.train as T

T.report(1, 0.5, step_time_s=0.1)
for args, kw, field in [((2**63, 0.5), {}, "step"), ((-5, 0.5), {}, "step"), (("3", 0.5), {}, "step"),
                        ((3, 0.5), {"step_time_s": -1.0}, "step_time_s"),
                        ((3, 0.5), {"step_time_s": float("nan")}, "step_time_s")]:
    try:
        T.report(*args, **kw)
    except ValueError as e:
        assert field in str(e), (field, str(e))
    else:
        raise SystemExit(f"report took {args} {kw}")
path = pathlib.Path(os.environ["SFTCTL_METRICS_DIR"]) / "rank-0.jsonl"
bad = [{"rank": 0, "step": 2**63, "loss": 0.5}, {"rank": 0, "step": -5, "loss": 0.5},
       {"rank": 0, "step": 3, "loss": 0.5, "step_time_s": -1.0}, {"rank": "zero", "step": 4, "loss": 0.5},
       {"rank": 0, "step": 5, "loss": "low"}, {"rank": 2**70, "heartbeat": True}, [1, 2],
       {"rank": 0, "step": 6, "loss": float("nan"), "tokens_per_s": 10**400}] + [{"rank": 0, "step": -1}] * 4
with open(path, "a") as f:
    for rec in bad:
        f.write(json.dumps(rec) + "\n")
    f.write(json.dumps({"ts": time.time(), "rank": 0, "step": 7, "loss": float("nan")}) + "\n")  # NaN: diverged
T.report(8, 0.25, step_time_s=0.1)
'''


def _run_succeeds(tmp_path, name: str, script: str):
    """``sftctl run`` (attached) of a one-node job running ``script`` as ``NAME.py``: asserts the
    job SUCCEEDED and the CLI exited 0 without a traceback; the job's view."""
    from conftest import write_spec
    from sftctl.types import JobStatus

    (tmp_path / f"{name}.py").write_text(script)
    spec = write_spec(tmp_path / f"{name}.yaml", f"name: {name}\nworkdir: {tmp_path}\nrun: python3 {name}.py\n")
    proc = sftctl("run", str(spec))
    [listed] = api.status()
    job = api.status(listed.id)
    assert job.status is JobStatus.SUCCEEDED, (job.failure_reason, proc.stdout, proc.stderr)
    assert proc.returncode == 0 and no_traceback(proc), proc.stderr
    return job


def test_a_jobs_bad_metrics_are_dropped_with_a_warning_and_the_job_succeeds(home, tmp_path):
    """A job's own metrics records can never break its controller or the state: each invalid
    record is dropped with one warning event naming the field; the valid ones are kept and the
    job that exited 0 SUCCEEDS (it was FAILED: OverflowError writing step 2**63 to SQLite)."""
    job = _run_succeeds(tmp_path, "w", BAD_METRICS_JOB)
    steps = api.metrics(job.id)
    assert [(s.rank, s.step, s.loss) for s in steps] == [(0, 1, 0.5), (0, 7, None), (0, 8, 0.25)]
    warned = [e.message for e in api.events(job.id) if e.kind == "metrics"]
    assert len(warned) == 11, warned  # 12 bad records: the first 10 named, then one line for the rest
    fields = ["step", "step", "step_time_s", "rank", "loss", "rank", "record", "tokens_per_s", "step", "step"]
    for field, text in zip(fields, warned):
        assert text.startswith(f"node 0: a metrics record was dropped: {field}: "), (field, text)
    assert warned[10] == "node 0: more than 10 invalid metrics records: further ones are dropped without a warning"
    assert "step: 9223372036854775808 is not an integer in [0, 2**63)" in warned[0]
    assert "step_time_s: -1.0 is not a finite number >= 0" in warned[2]


BAD_HEALTH_JOB = '''
import json, os, pathlib, time
# the node's health.jsonl, beside its metrics dir: the job can write it as the agent does
path = pathlib.Path(os.environ["SFTCTL_METRICS_DIR"]).parent / "health.jsonl"
now = time.time()
bad = [{"ts": now, "gpu": "zero"}, {"ts": now, "gpu": 0, "clock_sm_mhz": "fast"}, {"ts": now, "gpu": 2**70},
       {"ts": now, "gpu": 0, "xids": 5}, "text", {"ts": now, "preflight": "passed"}, {"ts": "now", "gpu": 0},
       # the controller's preflight line divided by these, and formatted a string as a number
       {"ts": now, "preflight": {"matmul": [{"gpu": None, "flops": 1e9, "measured_s": 0}]}},
       {"ts": now, "preflight": {"allreduce": {"nodes": 2, "bus_gbps": "fast"}}},
       {"ts": now, "preflight": {"matmul": "all of them"}}]
with open(path, "a") as f:
    for rec in bad:
        f.write(json.dumps(rec) + "\\n")
time.sleep(4)  # the controller reads the file while the job runs (and once more after it)
print("wrote them")
'''


def test_a_jobs_bad_health_records_are_dropped_with_a_warning_and_the_job_succeeds(home, tmp_path):
    """The node's health.jsonl is in a directory the job can write to: a record the detectors or
    the state cannot read (a GPU index "zero" was int()-ed by the state's GPU series) is dropped
    with a warning event naming its field, and the job that exited 0 SUCCEEDS."""
    job = _run_succeeds(tmp_path, "h", BAD_HEALTH_JOB)
    warned = [e.message for e in api.events(job.id) if e.kind == "health" and "was dropped" in e.message]
    fields = ["gpu", "clock_sm_mhz", "gpu", "xids", "record", "preflight", "ts", "preflight.matmul[0].measured_s",
              "preflight.allreduce.bus_gbps", "preflight.matmul"]
    assert [w.split(": ")[2] for w in warned] == fields, warned
    assert warned[0] == "node 0: a health record was dropped: gpu: 'zero' is not an integer in [0, 2**63)"


def test_check_metrics_record_cleans_a_valid_record_and_names_a_bad_field():
    from sftctl.health.records import check_metrics_record

    assert check_metrics_record({"rank": None, "ts": None, "step": 3, "loss": 2**70, "lr": 1, "x": "kept"}) == (
        {"step": 3, "loss": float(2**70), "lr": 1.0, "x": "kept"}, None)
    assert check_metrics_record({"rank": 1, "heartbeat": True}) == ({"rank": 1, "heartbeat": True}, None)
    assert check_metrics_record({"step": 1, "loss": 10**400}) == (None, f"loss: {10**400!r:.57}... is not a number")
    assert check_metrics_record({"step": 1, "checkpoint": 1}) == (None, "checkpoint: 1 is not true or false")
    assert check_metrics_record({"step": 1, "ts": "now"}) == (None, "ts: 'now' is not a finite number")
    assert check_metrics_record({"step": True}) == (None, "step: True is not an integer in [0, 2**63)")
