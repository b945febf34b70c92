"""What the node wrapper (sftctl/templates/node.sh.j2) and the torchrun environment
(sftctl/controller/submit.py) tell a user: a failed setup's own last words in the job's reason,
a killed run as one sftctl line (no bash job report), no torchrun warning about a node rank
c10d ignores. Each test failed before its fix. Local provider, one-line jobs."""

from __future__ import annotations

import json
import logging
import os

import pytest

from conftest import job_processes, sftctl, status_json, write_spec


def _run(tmp_path, name: str, body: str) -> tuple[str, dict]:
    spec = write_spec(tmp_path / f"{name}.yaml", f"name: {name}\nhealth: {{enabled: false}}\n{body}")
    proc = sftctl("run", str(spec), "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert job_processes(doc["id"]) == [], "the job left processes behind"
    return doc["id"], doc


def test_a_failed_setup_says_what_it_printed_on_stderr(tmp_path, home):
    """The reason (run --json, status --json, the events) ends with setup's last stderr line,
    not only the exit code; stdout lines and blank lines after it do not count."""
    job, doc = _run(tmp_path, "setupfail", "setup: |\n"
                    "  echo 'collecting torch==9.9' \n"
                    "  echo 'ERROR: no matching distribution found for torch==9.9' >&2\n"
                    "  echo '' >&2\n"
                    "  echo 'done on stdout'\n"
                    "  exit 3\n"
                    "run: echo never\n")
    want = "node 0 exited with code 3: setup failed: ERROR: no matching distribution found for torch==9.9"
    assert doc["failure_reason"] == want
    status = status_json(job)
    assert status["failure_reason"] == want
    events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
    assert any(e["message"].endswith("no matching distribution found for torch==9.9") for e in events), events
    logs = sftctl("logs", job, check=True).stdout
    assert "ERROR: no matching distribution found for torch==9.9" in logs  # still in the log, as it came


def test_a_failed_setup_line_is_cut_to_200_characters(tmp_path, home):
    _, doc = _run(tmp_path, "setuplong", "setup: |\n  printf 'x%.0s' $(seq 500) >&2\n  exit 1\nrun: echo never\n")
    reason = doc["failure_reason"]
    assert reason.startswith("node 0 exited with code 1: setup failed: xxx")
    tail = reason.split("setup failed: ", 1)[1]
    assert len(tail) == 200 and tail.endswith("...")


def test_a_setup_that_prints_nothing_still_says_setup_failed(tmp_path, home):
    _, doc = _run(tmp_path, "setupquiet", "setup: exit 4\nrun: echo never\n")
    assert doc["failure_reason"] == "node 0 exited with code 4: setup failed"


def test_a_killed_run_is_one_sftctl_line_not_bashs_job_report(tmp_path, home):
    """SIGKILL of the run: the log says which node and which signal in sftctl's words; bash's
    ``line N: PID Killed  bash -c ...`` report of its child is not there."""
    job, doc = _run(tmp_path, "killed", "run: |\n  \"$SFTCTL_PYTHON\" -c \"import os, signal; os.kill(os.getpid(), signal.SIGKILL)\"\n")
    assert doc["failure_reason"] == "node 0 exited with code 137: killed by SIGKILL (signal 9)"
    logs = sftctl("logs", job, check=True).stdout
    assert "Killed" not in logs and "bash -c" not in logs, logs
    assert "[sftctl] node 0: failed: killed by SIGKILL (signal 9)" in logs, logs


def test_a_killed_setup_is_one_sftctl_line_too(tmp_path, home):
    job, doc = _run(tmp_path, "setupkilled", "setup: |\n  \"$SFTCTL_PYTHON\" -c \"import os; os.kill(os.getpid(), 9)\"\n"
                    "run: echo never\n")
    assert doc["failure_reason"] == "node 0 exited with code 137: setup failed: killed by SIGKILL (signal 9)"
    logs = sftctl("logs", job, check=True).stdout
    assert "Killed" not in logs and "bash -e -c" not in logs, logs


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _torchrun_config(monkeypatch, env: dict) -> tuple[object, list[str]]:
    """torchrun's own reading of ``env`` (its PET_* variables): its launch config and the
    warnings it logged, as ``torchrun train.py`` on a node does before starting anything."""
    run = pytest.importorskip("torch.distributed.run")
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("PET_"):
            monkeypatch.setenv(name, value)
    kept = _Kept()
    run.logger.addHandler(kept)  # torch's own logger: pytest's caplog does not see it
    try:
        args = run.parse_args(["train.py"])
        config, _, _ = run.config_from_args(args)
    finally:
        run.logger.removeHandler(kept)
    return config, kept.lines


def test_torchrun_warns_of_a_node_rank_with_c10d(monkeypatch):
    """What the next test relies on: the warning is seen here when the node rank is there."""
    _, warnings = _torchrun_config(monkeypatch, {"PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2",
                                                 "PET_RDZV_ENDPOINT": "127.0.0.1:29501"})
    assert [w for w in warnings if "node_rank is only used for static rdzv_backend" in w], warnings


def test_torchrun_gets_a_node_rank_only_with_the_static_backend(tmp_path, home, monkeypatch):
    """With c10d (sftctl's rendezvous) torchrun ignores a node rank and warns on every node but 0
    that it does: node 1's environment has none and torchrun warns nothing; a static rendezvous,
    which needs it, gets it."""
    from sftctl import api
    from sftctl.controller.slots import NodeSlot
    from sftctl.controller.submit import node_env
    from sftctl.spec import load_spec
    from sftctl.types import NodeHandle

    spec_file = write_spec(tmp_path / "t.yaml", "name: t\nresources: {nodes: 2}\nrun: torchrun train.py\n")
    spec = load_spec(spec_file)
    plan = api.plan(spec)
    nodes = [NodeSlot(f"n{r}", r, NodeHandle(job_id="j", node_id=f"n{r}", rank=r, ip="127.0.0.1")) for r in (0, 1)]
    env = node_env(spec, "j", plan, nodes, 1, 1, 29500)
    assert env["PET_RDZV_BACKEND"] == "c10d" and "PET_NODE_RANK" not in env
    assert env["SFTCTL_NODE_RANK"] == "1"  # the rank stays there for scripts and logs
    config, warnings = _torchrun_config(monkeypatch, env)
    assert config.rdzv_backend == "c10d" and (config.min_nodes, config.max_nodes) == (2, 2)
    assert not [w for w in warnings if "node_rank" in w], warnings

    from sftctl.controller.submit import torchrun_env

    static = torchrun_env(num_nodes=2, nproc_per_node=1, rank=1, endpoint="127.0.0.1:29500", job_id="j",
                          is_host=False, backend="static")
    assert static["PET_NODE_RANK"] == "1" and static["PET_RDZV_BACKEND"] == "static"
    assert torchrun_env(num_nodes=2, nproc_per_node=1, rank=1, endpoint="127.0.0.1:29501", job_id="j",
                        is_host=False) == {k: v for k, v in env.items() if k.startswith("PET_")}


def test_an_elastic_resume_on_fewer_nodes_exports_the_layout_resized_to_them(tmp_path, home):
    """The plan's layout (pp2 x dp2 on two 2-rank nodes) is exported as planned while both nodes
    run; resumed on one node, the controller exports it resized to the 2 ranks left (the data
    degree absorbs the loss: pp2 dp1, each micro-batch twice as large), as each rank resizes it
    (sftctl.train.mesh), so `run --dry-run` and the node's env say what runs."""
    import dataclasses

    from sftctl import api
    from sftctl.compiler.layouts.offering import layout_doc
    from sftctl.controller.slots import NodeSlot
    from sftctl.controller.submit import node_env
    from sftctl.spec import load_spec
    from sftctl.types import NodeHandle
    from sftctl.types.layout import Layout

    spec = load_spec(write_spec(tmp_path / "t.yaml", "name: t\nresources: {nodes: 2}\nrun: torchrun train.py\n"))
    plan = api.plan(spec)
    doc = layout_doc(Layout(pp=2, dp=2, micro_batches=2), "search")
    plan = dataclasses.replace(plan, candidates=[], chosen=dataclasses.replace(plan.chosen, layout=doc))
    nodes = [NodeSlot(f"n{r}", r, NodeHandle(job_id="j", node_id=f"n{r}", rank=r, ip="127.0.0.1")) for r in (0, 1)]
    both = node_env(spec, "j", plan, nodes, 0, 1, 29500)
    assert (both["SFTCTL_PP"], both["SFTCTL_DP"], both["SFTCTL_MICRO_BATCHES"]) == ("2", "2", "2")
    one = node_env(spec, "j", plan, nodes[:1], 0, 2, 29500)
    assert (one["SFTCTL_PP"], one["SFTCTL_DP"], one["SFTCTL_MICRO_BATCHES"]) == ("2", "1", "2")
