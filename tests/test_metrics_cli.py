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
