"""``plan`` and ``compile`` price the same step, and ``plan`` says why it has none.

1. The quickstart runs 2 local nodes of ``cpu:1``: the launcher gives each rank
   ``model.batch_size // (nodes x per node)`` = 16 of 32 (controller/submit.py's
   ``SFTCTL_BATCH_SIZE``). ``compile --target cpu`` priced all 32 on one device (0.53 s) while
   ``plan`` priced 16 (0.27 s compute + the all-reduce): compile now splits the batch with the
   planner's own ``per_rank_batch``.
2. A spec without ``model:`` has no step time: ``plan``'s title promised "for 100 steps" and a
   TOTAL $ column of ``-``; it now says why (the field to add), in the text and in ``--json``.
"""

from __future__ import annotations

import json

import pytest

from conftest import REPO, sftctl, write_spec

QUICKSTART = str(REPO / "examples" / "quickstart.yaml")


def test_compile_prices_the_rank_plan_prices(home, tmp_path):
    """compile --target cpu's step is plan's local row's compute, to the last digit: one rank's
    16 of the batch of 32, over the 2 nodes the spec asks for."""
    plan = json.loads(sftctl("plan", QUICKSTART, "--json", check=True).stdout)
    (row,) = [c for c in plan["candidates"] if c["provider"] == "local"]
    (chosen,) = [s for s in row["strategies"] if s["parallelism"] == row["parallelism"]
                 and s["activation_checkpointing"] == row["activation_checkpointing"]]
    assert row["nodes"] == 2 and chosen["world_size"] == 2
    doc = json.loads(sftctl("compile", QUICKSTART, "--target", "cpu", "--json", "--out", str(tmp_path / "c"),
                            check=True).stdout)
    assert (doc["batch_size"], doc["per_rank_batch"], doc["ranks"]) == (32, 16, 2)
    assert doc["per_step"] == {"count": 16 * 128, "unit": "tokens"}  # one rank's 16 sequences of 128
    assert doc["step_time_s"] == pytest.approx(chosen["compute_time_s"], rel=1e-9)
    # plan's step is that plus the gradient all-reduce, which compile leaves to plan
    assert row["step_time_s"] == pytest.approx(doc["step_time_s"] + chosen["comm_time_s"], rel=1e-9)
    assert any("one data-parallel rank of 2: batch 16 of model.batch_size 32" in n for n in doc["notes"])


def test_compile_of_one_rank_is_the_whole_batch(home, tmp_path):
    """--set resources.nodes=1: one rank, so compile prices all 32 and plan's compute is the same."""
    one = ("--set", "resources.nodes=1")
    plan = json.loads(sftctl("plan", QUICKSTART, "--json", *one, check=True).stdout)
    (row,) = [c for c in plan["candidates"] if c["provider"] == "local"]
    ddp = next(s for s in row["strategies"] if s["parallelism"] == row["parallelism"]
               and s["activation_checkpointing"] == row["activation_checkpointing"])
    doc = json.loads(sftctl("compile", QUICKSTART, "--target", "cpu", "--json", "--out", str(tmp_path / "c"), *one,
                            check=True).stdout)
    assert (doc["per_rank_batch"], doc["ranks"]) == (32, 1)
    assert doc["step_time_s"] == pytest.approx(ddp["compute_time_s"], rel=1e-9)


def test_compile_refuses_a_batch_the_ranks_cannot_split(home, tmp_path):
    proc = sftctl("compile", QUICKSTART, "--target", "cpu", "--set", "model.batch_size=33", "--out", str(tmp_path / "c"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    text = " ".join(proc.stderr.split())
    assert "model.batch_size 33 does not split evenly over 2 data-parallel ranks" in text
    assert "make model.batch_size a multiple of nodes x accelerators per node" in text


NO_MODEL = """\
name: script-only
run: python train.py
train:
  steps: 100
resources:
  accelerators: ["cpu:1"]
  nodes: 2
"""


def test_plan_without_a_model_says_why_it_has_no_total(home, tmp_path):
    spec = write_spec(tmp_path / "job.yaml", NO_MODEL)
    proc = sftctl("plan", str(spec))
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "offerings for 100 steps on 2 node(s), by $/H: no step time" in text and "TOTAL $ for" not in text
    assert ("no step time: the spec has no `model:` to trace, so no TIME or TOTAL $ (ranked by $/H); add model: "
            "{framework, entrypoint, batch_size, dtype} (docs/spec.md) to predict them") in text
    doc = json.loads(sftctl("plan", str(spec), "--json", check=True).stdout)
    assert doc["no_step_time"].startswith("no step time: the spec has no `model:` to trace")
    assert "add model: {framework, entrypoint, batch_size, dtype}" in doc["no_step_time"]
    assert doc["chosen"]["total_usd"] is None and doc["chosen"]["step_time_s"] is None


def test_plan_without_a_model_or_steps_promises_no_total_for_the_default(home, tmp_path):
    """No train.steps either: the title said "(TOTAL $ for 100)", the default's total it had not."""
    spec = write_spec(tmp_path / "job.yaml", NO_MODEL.replace("train:\n  steps: 100\n", ""))
    text = " ".join(sftctl("plan", str(spec), check=True).stdout.split())
    assert "offerings steps: set by your script on 2 node(s), by $/H: no step time" in text
    assert "TOTAL $ for" not in text and "no step time: the spec has no `model:` to trace" in text


def test_plan_without_a_model_says_it_when_nothing_fits_too(home, tmp_path):
    """The refused plan (exit 3) has the same line, in its table and its --json."""
    spec = write_spec(tmp_path / "job.yaml", NO_MODEL.replace("nodes: 2", "nodes: 4096"))
    proc = sftctl("plan", str(spec))
    assert proc.returncode == 3
    assert "no step time: the spec has no `model:` to trace" in " ".join(proc.stdout.split())
    doc = json.loads(sftctl("plan", str(spec), "--json").stdout)
    assert doc["exit_code"] == 3 and doc["no_step_time"].startswith("no step time")


def test_plan_with_a_model_promises_its_total_and_has_no_such_line(home):
    doc = json.loads(sftctl("plan", QUICKSTART, "--json", check=True).stdout)
    assert "no_step_time" not in doc and doc["chosen"]["total_usd"] == 0.0
    text = " ".join(sftctl("plan", QUICKSTART, check=True).stdout.split())
    assert "offerings for 300 steps on 2 node(s)" in text and "no step time" not in text
