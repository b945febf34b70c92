"""A job must never be lost or hijacked (issue 23 items 1-2, issue 28 item 4): one live
controller per job, and a damaged or deleted state.db is said in one line, never a traceback,
never a fresh db beside a running controller's WAL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import REPO, deadline, job_processes, sftctl, status_json, wait_for, write_spec


def _gated_job(tmp_path, nodes: int = 1) -> tuple[str, object]:
    """A detached local job that runs until the returned flag file exists, then succeeds."""
    flag = tmp_path / "go"
    spec = write_spec(tmp_path / "gated.yaml", f"""\
name: gated
resources: {{nodes: {nodes}}}
run: |
  echo started
  while [ ! -e {flag} ]; do sleep 0.2; done
  echo done
""")
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
    return job, flag


def test_a_second_controller_refuses_and_the_job_still_succeeds(tmp_path, home):
    """Issue 23.1: `python -m sftctl.controller JOB` beside the live controller failed the job
    (IllegalTransition RUNNING -> PROVISIONING). It must refuse, name the live one, touch nothing."""
    from sftctl import api
    from sftctl.controller import ControllerBusy
    from sftctl.state import Store

    job, flag = _gated_job(tmp_path)
    try:
        before = Store().get_job(job)
        events_before = len(Store().events(job))
        proc = subprocess.run([sys.executable, "-m", "sftctl.controller", job], cwd=REPO,
                              capture_output=True, text=True, timeout=deadline(120))
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        line = proc.stderr.splitlines()[0]
        assert line == (f"error: job {job} already has a live controller (pid {before.controller_pid} on "
                        f"{socket.gethostname()}); this one leaves the job alone")
        with pytest.raises(ControllerBusy, match=f"pid {before.controller_pid} on "):
            api.start(job)
        with pytest.raises(ControllerBusy, match=f"pid {before.controller_pid} on "):
            api.attach(job)
        after = Store().get_job(job)
        assert (after.status.value, after.controller_pid, after.controller_start_ticks) == (
            "RUNNING", before.controller_pid, before.controller_start_ticks)
        assert len(Store().events(job)) == events_before
        flag.touch()
        wait_for(lambda: status_json(job)["status"] not in ("RUNNING", "LAUNCHING"), what="the job to end")
        assert status_json(job)["status"] == "SUCCEEDED"
    finally:
        flag.touch()
        sftctl("down", job)
    assert job_processes(job) == []


def test_a_killed_controllers_lock_does_not_block_the_next_one(home):
    """The lock is an flock: the kernel drops it with its holder, even after SIGKILL."""
    from sftctl.controller import claim_job
    from sftctl.state import Store

    store = Store()
    job = store.create_job("j", {"resources": {"nodes": 1}, "run": "true"})
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom sftctl.controller import claim_job\n"
         "from sftctl.state import Store\nlock = claim_job(Store(), sys.argv[1])\nprint('held', flush=True)\n"
         "time.sleep(600)\n", job], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        from sftctl.controller import ControllerBusy

        with pytest.raises(ControllerBusy, match=f"pid {holder.pid} on {socket.gethostname()}"):
            claim_job(store, job)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=deadline(30))
        lock = claim_job(store, job)
        assert lock.is_locked and store.get_job(job).controller_pid == os.getpid()
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
