"""A state-database (Postgres) outage under live jobs: the controllers ride it out.

A lab admin stopped Postgres for about 110 s while a local job trained: the training finished but
the job went FAILED, its nodes were torn down, its metrics stopped short of the last step; and a
PENDING job's waiter (``python -m sftctl.queue``) crashed at once with a traceback
(``wait_turn`` -> ``reap_dead_controllers``). Here a real Postgres is stopped (``pg_ctl stop -m
fast``: every connection cut) under a running job and a job waiting in the local queue, for
``OUTAGE_S``, and started again: both jobs must SUCCEED, with every step the first one reported
recorded, and each controller saying once that the database was unreachable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from conftest import REPO, deadline, sftctl, wait_for, write_spec

OUTAGE_S = 15.0  # how long Postgres stays down at the least (the admin's was 110 s)
STEPS = 30  # the running job's steps: 1-10 before the outage, the rest while the database is down

#: reports 10 steps, waits for GO, reports the rest and leaves DONE: the test ends its training
#: while the database is down (the admin's case), whatever the machine's load
TRAIN = '''
import os, time
import sftctl.train as T

for step in range(1, {steps} + 1):
    if step == 11:
        while not os.path.exists({go!r}):
            time.sleep(0.2)
    T.report(step, 1.0 / step, step_time_s=0.05)
    time.sleep(0.05)
open({done!r}, "w").close()
print("trained", flush=True)
'''


def _detach(spec) -> str:
    proc = subprocess.run([sys.executable, "-m", "sftctl.cli", "run", str(spec), "--detach", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=deadline(120))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["job_id"]


def _controller_log(job_id: str) -> str:
    from sftctl.paths import job_dir

    path = job_dir(job_id) / "controller.log"
    return path.read_text() if path.exists() else "(no controller.log)"


def test_a_running_and_a_pending_job_survive_a_postgres_outage(postgres, pg_url, home, tmp_path):
    from sftctl.state import JobStatus, Store

    work = tmp_path / "work"
    work.mkdir()
    go, done = tmp_path / "go", tmp_path / "done"
    (work / "train.py").write_text(TRAIN.format(steps=STEPS, go=str(go), done=str(done)))
    running_spec = write_spec(work / "train.yaml", "name: train\nresources: {nodes: 1}\nrun: python3 train.py\n")
    # two nodes: with the first job's one CPU held, this 2-CPU machine's queue keeps it PENDING
    pending_spec = write_spec(work / "wide.yaml", "name: wide\nresources: {nodes: 2}\nrun: echo ran\n")

    store = Store()
    running = _detach(running_spec)
    wait_for(lambda: any(m.step >= 10 for m in store.step_series(running)), timeout_s=120,
             what="the running job's tenth step", report=lambda: _controller_log(running))
    pending = _detach(pending_spec)
    wait_for(lambda: (store.get_job(pending).pending_reason or "").startswith("waiting for CPUs"), timeout_s=60,
             what="the second job to wait in the queue", report=lambda: _controller_log(pending))
    store.close()

    postgres.stop()  # pg_ctl stop -m fast: every connection cut, as an outage does
    try:
        go.touch()  # the job trains on and ends while the database is down
        wait_for(done.exists, timeout_s=120, what="the job's last step")
        time.sleep(OUTAGE_S)  # its controller sees the exit meanwhile; the waiter polls a few times
    finally:
        postgres.start()

    store = Store()
    wait_for(lambda: (store.get_job(running).status.terminal and store.get_job(pending).status.terminal)
             or "Traceback" in _controller_log(pending),  # a dead waiter leaves its job PENDING: fail now
             timeout_s=180, interval_s=1, what="both jobs to end",
             report=lambda: _controller_log(running) + "\n----\n" + _controller_log(pending))
    for job_id in (running, pending):
        job = store.get_job(job_id)
        assert job.status == JobStatus.SUCCEEDED, (job_id, job.failure_reason, _controller_log(job_id))
    steps = [m.step for m in store.step_series(running)]
    assert steps == list(range(1, STEPS + 1)), steps  # none lost while the database was down
    log = _controller_log(running)
    assert log.count("the state database is unreachable") == 1, log  # one line per outage, not per try
    assert "the state database answers again" in log, log
    pending_log = _controller_log(pending)
    assert "Traceback" not in pending_log and "error:" not in pending_log, pending_log
    assert pending_log.count("the state database is unreachable") == 1, pending_log
    assert "the state database answers again" in pending_log, pending_log
    assert sftctl("wait", running).returncode == 0


def test_the_window_is_one_per_outage_not_one_per_call(postgres, pg_url):
    """Past its window a Store tries each call once (a controller tearing down after an outage
    outlasted it must not wait a window per write); once the database answered, the next outage
    gets a whole window again."""
    import pytest

    from sftctl.errors import StateUnavailable
    from sftctl.state import Store

    store = Store()
    store.retry_window_s = 1.0
    tries: list[int] = []
    reconnect = store._reconnect
    store._reconnect = lambda: (tries.append(1), reconnect())[1]  # type: ignore[method-assign]

    def calls_past(n: int) -> list[int]:
        out = []
        for _ in range(n):
            before = len(tries)
            with pytest.raises(StateUnavailable, match="unreachable for more than 1 s"):
                store.list_jobs()
            out.append(len(tries) - before)
        return out

    for _ in range(2):  # a second outage after the database answered again
        postgres.stop()
        try:
            first, *rest = calls_past(3)
        finally:
            postgres.start()
        assert first >= 2 and rest == [1, 1], (first, rest)
        assert store.list_jobs() == []


WINDOW_S = 4.0  # the controller's outage window in the test below (queue.STATE_OUTAGE_S, 1800 s by default)

#: the controller's process only (procs.module_argv's ``runpy.run_module("sftctl.controller")``) rides
#: out a short outage
SHORT_WINDOW = f'''
import sys
if \'"sftctl.controller"\' in " ".join(sys.orig_argv):
    import sftctl.queue
    sftctl.queue.STATE_OUTAGE_S = {WINDOW_S}
'''

#: node 0 reports 10 steps, waits for GO, leaves a process of its own session behind (out of its
#: guard's reach: the teardown's terminate_tagged ends it) and fails; node 1 trains on
FAIL_ON_GO = '''
import os, subprocess, time
import sftctl.train as T

if os.environ["SFTCTL_NODE_RANK"] == "1":
    time.sleep(600)
for step in range(1, 11):
    T.report(step, 1.0 / step, step_time_s=0.05)
while not os.path.exists({go!r}):
    time.sleep(0.2)
subprocess.Popen(["sleep", "600"], start_new_session=True)
raise SystemExit(3)
'''


def test_an_outage_past_the_window_stops_the_nodes_and_the_job_is_reaped(postgres, pg_url, home, tmp_path):
    """Postgres stays down past the controller's window while the job's node fails (a write the
    controller must make): the controller removes every process of the job, says in one line
    that the state database is down and what to do, and exits; once the database is back the
    job is not left RUNNING without a controller: the next read marks it FAILED_CONTROLLER."""
    import os

    from conftest import job_processes, status_json

    from sftctl import procs
    from sftctl.state import JobStatus, Store

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SHORT_WINDOW)
    env = {**os.environ, "SFTCTL_STATE_RETRY_S": "1",  # (the window is the longer of the two)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))}
    work = tmp_path / "work"
    work.mkdir()
    go = tmp_path / "go"
    (work / "train.py").write_text(FAIL_ON_GO.format(go=str(go)))
    spec = write_spec(work / "two.yaml", "name: two\nresources: {nodes: 2}\nrun: python3 train.py\n")

    proc = subprocess.run([sys.executable, "-m", "sftctl.cli", "run", str(spec), "--detach", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=deadline(120), env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = json.loads(proc.stdout)["job_id"]
    store = Store()
    wait_for(lambda: any(m.step >= 10 for m in store.step_series(job_id)), timeout_s=120,
             what="the job's tenth step", report=lambda: _controller_log(job_id))
    job = store.get_job(job_id)
    pid, ticks = job.controller_pid, job.controller_start_ticks
    assert job.status == JobStatus.RUNNING and pid is not None, job
    assert len(job_processes(job_id)) >= 2  # both nodes run
    store.close()

    postgres.stop()  # and stays down past the window: the controller gives up meanwhile
    try:
        go.touch()
        wait_for(lambda: not procs.alive(pid, ticks), timeout_s=60, interval_s=0.5,
                 what="the controller to give up and exit", report=lambda: _controller_log(job_id))
        left = job_processes(job_id)  # every node and the stray: the controller's teardown ended them
        log = _controller_log(job_id)
    finally:
        postgres.start()
    assert left == [], (left, log)
    assert "Traceback" not in log, log
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1, log
    assert "the state database" in errors[0] and "unreachable" in errors[0], errors
    assert f"sftctl status {job_id}" in errors[0], errors  # what to do once it is back
    doc = status_json(job_id)  # a read reaps the job whose controller is gone
    assert doc["status"] == JobStatus.FAILED_CONTROLLER.value, doc
