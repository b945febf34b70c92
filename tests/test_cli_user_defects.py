"""Defects a new user found running the README's commands: each asserted through the real CLI."""

from __future__ import annotations

import shutil

from conftest import SLEEPER, sftctl, status_json, wait_for, write_spec

PLAIN = """\
name: plain
run: |
  echo hello
"""


def test_a_plain_script_bar_shows_no_step_total(tmp_path, home):
    """No train.steps in the spec: the attached bar has no total (status shows "-"), not 0/100."""
    proc = sftctl("run", str(write_spec(tmp_path / "plain.yaml", PLAIN)))
    assert proc.returncode == 0, proc.stderr
    bar = [line for line in proc.stdout.splitlines() if line.startswith("succeeded")]
    assert bar and "0/100" not in bar[-1] and "0/?" in bar[-1], proc.stdout
    job = status_json()["jobs"][0]
    assert job["steps"] is None


def test_a_set_train_steps_is_the_bar_total(tmp_path, home):
    proc = sftctl("run", str(write_spec(tmp_path / "plain.yaml", PLAIN)), "--set", "train.steps=7")
    assert proc.returncode == 0, proc.stderr
    assert any(line.startswith("succeeded") and "0/7" in line for line in proc.stdout.splitlines()), proc.stdout


def test_logs_of_a_job_whose_directory_was_deleted_says_so(tmp_path, home):
    spec = write_spec(tmp_path / "sleeper.yaml", SLEEPER)
    job = sftctl("run", str(spec), "--detach", check=True).stdout.strip()
    try:
        wait_for(lambda: status_json(job)["status"] == "RUNNING", timeout_s=300, what="RUNNING")
        gone = home / "jobs" / job
        shutil.rmtree(gone)
        proc = sftctl("logs", job)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert proc.stdout == ""
        assert f"{gone}: the directory of job {job} is gone" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        sftctl("down", job)


SHORT = """\
name: short
run: echo go
"""


def test_a_relative_home_is_taken_from_the_directory_sftctl_started_in(tmp_path, home, monkeypatch):
    """SFTCTL_HOME=relhome: the controller and the nodes (started in other directories) use the
    same home as the CLI, <cwd>/relhome, and the job succeeds (it failed: node-1.sh not found)."""
    write_spec(tmp_path / "short.yaml", SHORT)
    monkeypatch.setenv("SFTCTL_HOME", "relhome")
    proc = sftctl("run", "short.yaml", cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    jobs = list((tmp_path / "relhome" / "jobs").iterdir())
    assert len(jobs) == 1 and jobs[0].name.startswith("short-"), jobs
    listed = sftctl("status", "--json", cwd=tmp_path, check=True).stdout
    assert '"SUCCEEDED"' in listed, listed
