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
