"""Sweeps (issue 37.7): several jobs of one spec told apart by labels and by the --set overrides
they were submitted with; ``status`` of several ids; ``wait --json`` prints every job's status."""

from __future__ import annotations

import json

import pytest

from conftest import sftctl, status_json, wait_for, write_spec

ECHO = "name: sweep\nresources: {nodes: 1}\nlabels: {team: nlp}\nrun: echo lr=$LR\n"
SLEEPY = "name: sleepy\nresources: {nodes: 1}\nrun: sleep 120\n"


def test_labels_are_validated_text_and_names_take_dots(tmp_path):
    from sftctl.errors import SpecError
    from sftctl.spec import load_spec

    spec = write_spec(tmp_path / "s.yaml", "name: s\nlabels: {lr: 0.0010, team: nlp}\nrun: echo\n")
    s = load_spec(spec, ["name=lr-0.001", "labels.bs=032"])
    assert s.name == "lr-0.001"
    assert s.labels == {"lr": "0.0010", "team": "nlp", "bs": "032"}  # the text as written
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path / "b.yaml", "name: s\nlabels: {'Bad Key': x}\nrun: echo\n"))
    assert e.value.message.startswith(f"{tmp_path / 'b.yaml'}:2: labels: ") and "'Bad Key'" in e.value.message
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path / "c.yaml", "name: s\nlabels: {a: [1, 2]}\nrun: echo\n"))
    assert "labels" in e.value.message


def test_a_sweep_labelled_filtered_and_waited_on(tmp_path, home):
    spec = write_spec(tmp_path / "sweep.yaml", ECHO)
    ids = []
    for lr in ("0.001", "0.01"):
        out = sftctl("run", str(spec), "--detach", "--json", "--set", f"name=lr-{lr}", "--set", f"env.LR={lr}",
                     "--label", f"lr={lr}", "--label", "sweep=a", check=True).stdout
        ids.append(json.loads(out)["job_id"])
    assert ids[0].startswith("lr-0.001-") and ids[1].startswith("lr-0.01-")
    # wait --json prints every job's status, also when it ends in a failure (here: success)
    done = sftctl("wait", *ids, "--json")
    assert done.returncode == 0, done.stderr
    assert [j["id"] for j in json.loads(done.stdout)["jobs"]] == ids
    both = json.loads(sftctl("status", *ids, "--json", check=True).stdout)["jobs"]
    assert [j["id"] for j in both] == ids
    assert [j["labels"] for j in both] == [{"team": "nlp", "lr": "0.001", "sweep": "a"},
                                          {"team": "nlp", "lr": "0.01", "sweep": "a"}]
    only = json.loads(sftctl("status", "--label", "lr=0.01", "--json", check=True).stdout)["jobs"]
    assert [j["id"] for j in only] == [ids[1]]
    assert json.loads(sftctl("status", "--label", "lr=9", "--json", check=True).stdout)["jobs"] == []
    table = sftctl("status", env={**__import__("os").environ, "COLUMNS": "200"}, check=True).stdout
    assert "LABELS" in table and "lr=0.01" in table, table
    detail = sftctl("status", ids[0], env={**__import__("os").environ, "COLUMNS": "200"}, check=True).stdout
    assert "--set name=lr-0.001 --set env.LR=0.001" in detail, detail
    assert status_json(ids[0])["overrides"] == ["name=lr-0.001", "env.LR=0.001", "labels.lr=0.001", "labels.sweep=a"]
    bad = sftctl("run", str(spec), "--detach", "--label", "nolabel")
    assert bad.returncode == 2 and "--label nolabel" in bad.stderr and "k=v" in bad.stderr, bad.stderr


def test_wait_timeout_json_prints_every_jobs_status(tmp_path, home):
    spec = write_spec(tmp_path / "sleepy.yaml", SLEEPY)
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    try:
        wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
        proc = sftctl("wait", job, "--timeout", "1", "--json")
        assert proc.returncode == 124, proc.stderr
        doc = json.loads(proc.stdout)
        assert [j["id"] for j in doc["jobs"]] == [job] and doc["jobs"][0]["status"] == "RUNNING"
        assert "timeout" in doc["error"] and doc["exit_code"] == 124
    finally:
        sftctl("down", job)
