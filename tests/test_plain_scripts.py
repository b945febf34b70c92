"""A plain script that never calls sftctl.train (issue 37.6): its rank is known on one node,
``plan`` says the script sets its steps, the README shows the three sftctl.train calls."""

from __future__ import annotations

import json
import re

from conftest import REPO, sftctl, write_spec

PLAIN = "name: plain\nresources: {nodes: 1}\nrun: echo plain script says hi\n"


def test_logs_rank_0_of_a_one_node_plain_script(tmp_path, home):
    spec = write_spec(tmp_path / "plain.yaml", PLAIN)
    job = json.loads(sftctl("run", str(spec), "--json", check=True).stdout)
    assert job["status"] == "SUCCEEDED"
    only = sftctl("logs", job["id"], "--rank", "0")
    assert only.returncode == 0 and "plain script says hi" in only.stdout, only.stderr
    assert job["ranks"] == [] and json.loads(sftctl("status", job["id"], "--json", check=True).stdout)["nodes"][0]["rank"] == 0
    beyond = sftctl("logs", job["id"], "--rank", "1")
    assert beyond.returncode == 2 and "--rank 1" in beyond.stderr, beyond.stderr


def test_plan_says_the_script_sets_its_steps(tmp_path, home):
    spec = write_spec(tmp_path / "plain.yaml", PLAIN)
    out = sftctl("plan", str(spec), env={**__import__("os").environ, "COLUMNS": "120"}, check=True).stdout
    assert "steps: set by your script" in out and "100 steps" not in out, out
    set_ = sftctl("plan", str(spec), "--set", "train.steps=40", env={**__import__("os").environ, "COLUMNS": "120"},
                  check=True).stdout
    assert "offerings for 40 steps" in set_ and "set by your script" not in set_, set_


def test_readme_shows_the_three_train_calls():
    from sftctl import train

    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    calls = {"report", "save_checkpoint", "load_latest_checkpoint"}
    assert calls <= set(dir(train)), sorted(calls - set(dir(train)))
    shown = [b for b in blocks if all(f"sftctl.train.{c}(" in b or f"train.{c}(" in b for c in calls)]
    assert shown, "no README python block shows sftctl.train.report, save_checkpoint and load_checkpoint"
