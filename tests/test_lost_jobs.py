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
import threading
import time

import pytest

from conftest import REPO, deadline, job_processes, process_report, sftctl, status_json, wait_for, write_spec


def _gated_job(tmp_path, nodes: int = 1, env: dict | None = None) -> tuple[str, object]:
    """A detached local job that runs until the returned flag file exists, then succeeds
    (``env``: added to the environment of its controller and nodes)."""
    flag = tmp_path / "go"
    spec = write_spec(tmp_path / "gated.yaml", f"""\
name: gated
resources: {{nodes: {nodes}}}
run: |
  echo started
  while [ ! -e {flag} ]; do sleep 0.2; done
  echo done
""")
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True,
                            **({"env": {**os.environ, **env}} if env else {})).stdout)["job_id"]
    wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
    return job, flag


def test_a_second_controller_refuses_and_the_job_still_succeeds(tmp_path, home):
    """Issue 23.1: `python -m sftctl.controller JOB` beside the live controller failed the job
    (IllegalTransition RUNNING -> PROVISIONING). It must refuse, name the live one, touch nothing."""
    from sftctl import api
    from sftctl.queue import ControllerBusy
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
    # the controller records the end, then tears the nodes down: give it the time
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end",
             report=lambda: process_report(job))


def test_a_killed_controllers_lock_does_not_block_the_next_one(home):
    """The lock is an flock: the kernel drops it with its holder, even after SIGKILL."""
    from sftctl.queue import claim_job
    from sftctl.state import Store

    store = Store()
    job = store.create_job("j", {"resources": {"nodes": 1}, "run": "true"})
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom sftctl.queue import claim_job\n"
         "from sftctl.state import Store\nlock = claim_job(Store(), sys.argv[1])\nprint('held', flush=True)\n"
         "time.sleep(600)\n", job], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        from sftctl.queue import ControllerBusy

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


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_state_db_lost_mid_run_is_said_in_one_line_and_down_orphans_stops_the_job(tmp_path, home, damage):
    """Issue 23.2 / 28.4: a state.db deleted or truncated under a running job. Before: `events`
    and `down` printed a traceback, `status` said "no jobs yet" (the WAL made a 0-byte file look
    fine), and a new db was created beside the running controller's WAL. Now every command says
    what happened in one line (exit 2), nothing is created, and `down --orphans` finds the job by
    its job directory and stops it."""
    job, flag = _gated_job(tmp_path, nodes=2)
    db = home / "state.db"
    try:
        assert (home / "state.db-wal").exists()
        pid = status_json(job)["controller_pid"]
        if damage == "deleted":
            db.unlink()
            expected = "the state database was deleted while state.db-wal and state.db-shm remained"
        else:
            os.truncate(db, 0)
            expected = "the state database is empty (0 bytes): it was truncated"
        for args in (("status",), ("status", job), ("events", job), ("down", job), ("logs", job)):
            proc = sftctl(*args)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
            (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
            assert line.startswith(f"error: {db}: {expected}"), (args, line)
            assert db.exists() == (damage == "truncated")  # never a new db beside the WAL
        assert len(job_processes(job)) >= 2  # the job still runs: nothing above touched it
        proc = sftctl("down", "--orphans")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith(f"state: {db}: {expected}") and lines[0].endswith("every job counts as unknown")
        assert f"local: {job} (unknown job): stopped its controller (pid {pid}), which removed its nodes" in lines
        wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's nodes to stop")
    finally:
        flag.touch()
        for suffix in ("", "-wal", "-shm"):  # a fresh state for the fixture's cleanup
            (home / f"state.db{suffix}").unlink(missing_ok=True)


def test_a_queued_jobs_waiting_controller_holds_the_job_too(tmp_path, home):
    """A job waiting its turn (the light `python -m sftctl.queue` stage) has its controller too:
    a second controller refuses, and the job runs once admitted."""
    cpus = os.cpu_count() or 1
    if cpus < 2:
        pytest.skip("needs 2 CPUs")
    hog, flag = _gated_job(tmp_path, nodes=cpus)
    spec = write_spec(tmp_path / "later.yaml", "name: later\nresources: {nodes: 1}\nrun: echo later ran\n")
    later = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    try:
        wait_for(lambda: status_json(later)["pending_reason"], what="the later job to queue")
        pid = status_json(later)["controller_pid"]
        proc = subprocess.run([sys.executable, "-m", "sftctl.controller", later], cwd=REPO,
                              capture_output=True, text=True, timeout=deadline(120))
        assert proc.returncode == 2 and f"already has a live controller (pid {pid} on " in proc.stderr, proc.stderr
        assert status_json(later)["status"] == "PENDING"
        flag.touch()
        wait_for(lambda: status_json(later)["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"), timeout_s=180,
                 what="the later job to end")
        assert status_json(later)["status"] == "SUCCEEDED"
    finally:
        flag.touch()
        for j in (hog, later):
            sftctl("down", j)


def test_rows_damaged_inside_a_readable_db_are_one_line_not_a_traceback(home):
    """A state.db whose pages survived but whose values did not (a new user's stress run left a
    job with provider '\\x00\\x00\\x00\\x00\\x00'): status, events and down each say one line, exit
    non-zero, and --debug still shows the traceback."""
    import sqlite3

    from sftctl.state import JobStatus, Store

    store = Store()
    job = store.create_job("damaged", {"resources": {"nodes": 1}, "run": "true"})
    store.transition(job, JobStatus.PROVISIONING, "test")
    store._conn.close()
    with sqlite3.connect(home / "state.db") as conn:
        conn.execute("UPDATE jobs SET provider = ?, controller_pid = NULL, created_at = 0 WHERE id = ?",
                     ("\x00" * 5, job))
    for args in (["status"], ["status", "--json"], ["events", job], ["down", "--all"]):
        proc = sftctl(*args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout, (args, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "unknown provider" in lines[0], (args, proc.stderr)
    assert "Traceback" in sftctl("status", "--debug").stderr


@pytest.mark.parametrize("died_in", ["RUNNING", "LAUNCHING", "RECOVERING", "PROVISIONING"])
def test_a_new_controller_adopts_a_running_job_whose_controller_was_killed(tmp_path, home, died_in):
    """Issue 23 (lost jobs): `python -m sftctl.controller JOB` for a RUNNING job whose controller
    was killed -9 failed the job ("controller error: IllegalTransition(RUNNING -> PROVISIONING)").
    Now the new controller adopts it from state: it keeps the recorded nodes, finds that their
    processes went with the old controller (the local guard), abandons that attempt and
    relaunches (no restart counted: max_restarts is 0), and the job SUCCEEDS, never with more
    nodes at the provider than the job has. ``died_in``: the status the state is moved to after
    the kill, as if the controller had died there (mid-launch, mid-recovery, mid-provisioning:
    there the recorded nodes are removed and two new ones provisioned)."""
    from sftctl import procs
    from sftctl.providers.local import LocalProvider
    from sftctl.state import JobStatus, NodeState, Store

    job, flag = _gated_job(tmp_path, nodes=2)
    provider = LocalProvider()
    seen: list[int] = []

    def nodes_up() -> int:
        """Nodes with live processes at the provider (by node id: a process that exits between
        the provider's /proc scans may show without its node tag)."""
        n = len({r["node_id"] for r in provider.list_instances(job) if r["node_id"]})
        seen.append(n)
        return n

    adopter = None
    try:
        wait_for(lambda: nodes_up() == 2, what="both nodes to run")
        store = Store()
        before = store.get_job(job)
        recorded = [n.id for n in store.nodes(job)]
        os.kill(before.controller_pid, signal.SIGKILL)
        wait_for(lambda: not procs.alive(before.controller_pid, before.controller_start_ticks), what="the kill")
        wait_for(lambda: nodes_up() == 0, timeout_s=60, what="the guard to stop the dead controller's nodes",
                 report=lambda: process_report(job))
        # no `sftctl status` here: it would mark the job FAILED_CONTROLLER (terminal) before the restart
        assert store.get_job(job).status == JobStatus.RUNNING
        path = {"RUNNING": [], "LAUNCHING": [JobStatus.RECOVERING, JobStatus.LAUNCHING],
                "RECOVERING": [JobStatus.RECOVERING], "PROVISIONING": [JobStatus.RECOVERING, JobStatus.PROVISIONING]}
        for status in path[died_in]:
            assert store.transition(job, status, "test: as if the controller died here")
        adopter = subprocess.Popen([sys.executable, "-m", "sftctl.controller", job], cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def running_again() -> bool:
            now = store.get_job(job)
            assert not now.status.terminal, now.failure_reason  # before: IllegalTransition(RUNNING -> PROVISIONING)
            live = [n for n in store.nodes(job) if n.status not in (NodeState.TERMINATED, NodeState.REPLACED)]
            assert len(live) <= 2, live  # never two records of one rank
            return len(store.attempts(job)) == 2 and now.status == JobStatus.RUNNING and nodes_up() == 2

        wait_for(running_again, timeout_s=120, what="the adopted job to run again on 2 nodes")
        flag.touch()
        out, _ = adopter.communicate(timeout=deadline(120))
        assert adopter.returncode == 0, out
        after = store.get_job(job)
        assert after.status == JobStatus.SUCCEEDED, (after.failure_reason, out)
        assert max(seen) == 2
        adopted = [e for e in store.events(job) if e.kind == "adopt"]
        if died_in == "PROVISIONING":
            (removed,) = adopted
            assert removed.message.startswith("removed 2 node(s) left by a controller that died while provisioning")
            assert len({n.id for n in store.nodes(job)} - set(recorded)) == 2
        else:
            (adopt,) = adopted
            assert adopt.data["nodes"] == recorded and adopt.data["status"] == died_in and adopt.data["attempt"] == 1
        attempts = store.attempts(job)
        assert [(a.number, a.status.value, a.reason_code) for a in attempts] == [
            (1, "ABANDONED", "controller_died"), (2, "SUCCEEDED", None)]
        assert after.restarts == 0
        nodes = store.nodes(job)
        # every node recorded is down now; no rank ever had two live nodes
        assert all(n.status in (NodeState.TERMINATED, NodeState.REPLACED) for n in nodes)
        assert sorted({n.rank for n in nodes}) == [0, 1]
    finally:
        flag.touch()
        if adopter is not None and adopter.poll() is None:
            adopter.kill()
            adopter.wait()
        sftctl("down", job)
    # the controller records the end, then tears the nodes down: give it the time
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end",
             report=lambda: process_report(job))


def test_a_new_controller_keeps_the_nodes_that_outlived_the_killed_one(tmp_path, home):
    """Issue 23 (lost jobs), the nodes still alive: with SFTCTL_LOCAL_ADOPT_GRACE_S the local
    nodes outlive their controller killed -9; the next controller adopts the job with the same
    nodes, the same processes and the same attempt (their guard now watches it), and the job
    SUCCEEDS with no relaunch. Before: IllegalTransition(RUNNING -> PROVISIONING), job FAILED."""
    from sftctl import procs
    from sftctl.controller import adopt
    from sftctl.providers.local import LocalProvider
    from sftctl.state import JobStatus, Store

    job, flag = _gated_job(tmp_path, nodes=2, env={"SFTCTL_LOCAL_ADOPT_GRACE_S": "600"})
    provider = LocalProvider()

    def up() -> dict[str, bool]:
        """node id -> its first process (the guard the controller started) still runs, for
        each node with live processes at the provider."""
        first = {n.id: (n.handle.get("pid"), n.handle.get("start_ticks")) for n in Store().nodes(job)}
        return {r["node_id"]: procs.alive(*first.get(r["node_id"], (None, None)))
                for r in provider.list_instances(job) if r["node_id"]}

    try:
        wait_for(lambda: len(up()) == 2 and "started" in (sftctl("logs", job).stdout or ""), what="both nodes to run")
        store = Store()
        before = store.get_job(job)
        nodes_before = up()
        os.kill(before.controller_pid, signal.SIGKILL)
        wait_for(lambda: not procs.alive(before.controller_pid, before.controller_start_ticks), what="the kill")
        # the guards have looked at their gone controller 3 times by now (they leave no trace of
        # it to wait for: a quiet machine's 3 polls, scaled by the load)
        time.sleep(deadline(3 * procs.GUARD_POLL_S))
        assert up() == nodes_before == {n: True for n in nodes_before}
        assert store.get_job(job).status == JobStatus.RUNNING
        ended: list = []
        adopter = threading.Thread(target=lambda: ended.append(adopt(Store(), job)))  # as a server would
        adopter.start()
        wait_for(lambda: any(e.kind == "adopt" for e in store.events(job)), what="the adoption")
        time.sleep(deadline(3 * procs.GUARD_POLL_S))  # 3 more polls, with the adopter
        assert up() == nodes_before  # kept: the same processes, nothing started twice
        flag.touch()
        adopter.join(timeout=deadline(120))
        assert ended == [JobStatus.SUCCEEDED], store.get_job(job).failure_reason
        after = store.get_job(job)
        assert (after.restarts, after.controller_pid) == (0, os.getpid())
        assert [(a.number, a.status.value) for a in store.attempts(job)] == [(1, "SUCCEEDED")]
        assert sorted(n.id for n in store.nodes(job)) == sorted(nodes_before)  # no node replaced or added
        (ev,) = [e for e in store.events(job) if e.kind == "adopt"]
        assert ev.data["attempt"] == 1 and sorted(ev.data["nodes"]) == sorted(nodes_before)
    finally:
        flag.touch()
        sftctl("down", job)
    # the controller records the end, then tears the nodes down: give it the time
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end",
             report=lambda: process_report(job))


def test_down_of_an_ended_job_never_signals_the_process_recorded_as_its_controller(home):
    """A job run attached from a script (or adopted by a server) records that process as its
    controller; once the job ended, `sftctl down JOB` sent it SIGTERM and then SIGKILL."""
    from sftctl import procs
    from sftctl.state import JobStatus, Store

    store = Store()
    job = store.create_job("ended", {"name": "ended", "resources": {"nodes": 1}, "run": "true"})
    script = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        store.update_job(job, controller_pid=script.pid, controller_start_ticks=procs.start_ticks(script.pid))
        for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.SUCCEEDED):
            store.transition(job, s)
        proc = sftctl("down", job)
        assert proc.returncode == 0, proc.stderr
        assert script.poll() is None  # before: killed
        assert store.get_job(job).status == JobStatus.SUCCEEDED
    finally:
        script.kill()
        script.wait()


@pytest.mark.parametrize("stat", ["", "123 (python", "123 (py) S 1"])
def test_start_ticks_of_a_process_gone_mid_read_is_none(tmp_path, monkeypatch, stat):
    """A node's guard (`procs.guard`) asks `start_ticks` about its controller every second; a
    /proc stat read as the process exits can come back empty or cut off. That raised (ValueError,
    IndexError) where it means "gone", and an exception ends the guard, leaving its node running
    unwatched. Now it is None; the guard also survives any exception of one poll (it retries)."""
    from sftctl import procs

    (tmp_path / "123").mkdir()
    (tmp_path / "123" / "stat").write_text(stat)
    monkeypatch.setattr(procs, "_PROC", tmp_path)
    assert procs.start_ticks(123) is None
    assert not procs.alive(123)
