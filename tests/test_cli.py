"""The CLI end to end on the local provider, with tiny shell jobs (the quickstart has its own file)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from conftest import REPO, SLEEPER, deadline, job_processes, no_traceback, sftctl, status_json, wait_for, write_spec

TINY = """\
name: tiny
resources: {nodes: 2}
run: |
  echo "hello from node $SFTCTL_NODE_RANK of $SFTCTL_NUM_NODES ips=$SFTCTL_NODE_IPS rdzv=$SFTCTL_RDZV_ENDPOINT"
"""


def test_attached_run_succeeds_and_reports(tmp_path, home):
    spec = write_spec(tmp_path / "tiny.yaml", TINY)
    proc = sftctl("run", str(spec), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # --json: one document on stdout, nothing else
    assert doc["status"] == "SUCCEEDED" and doc["exit_code"] == 0
    assert [n["status"] for n in doc["nodes"]] == ["TERMINATED", "TERMINATED"]
    assert "(node 1) hello from node 1 of 2 ips=127.0.0.1,127.0.0.1" in proc.stderr
    assert doc["plan"].startswith("chose local localhost (cpu:1) x 2 node(s)")
    logs = sftctl("logs", doc["id"], check=True).stdout
    assert "(node 0) hello from node 0 of 2" in logs and "(node 1) hello from node 1 of 2" in logs
    only1 = sftctl("logs", doc["id"], "--node", "1", check=True).stdout
    assert "hello from node 1" in only1 and "hello from node 0" not in only1
    events = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    kinds = [e["message"] for e in events if e["kind"] == "status"]
    assert kinds == ["job submitted (PENDING)", "PENDING -> PROVISIONING", "PROVISIONING -> LAUNCHING: attempt 1",
                     "LAUNCHING -> RUNNING", "RUNNING -> SUCCEEDED"]
    assert job_processes(doc["id"]) == []


def test_failed_job_restarts_then_fails_with_exit_1(tmp_path, home):
    spec = write_spec(tmp_path / "bad.yaml", "name: bad\nrecovery: {max_restarts: 1}\nrun: echo attempt $SFTCTL_ATTEMPT; exit 3\n")
    proc = sftctl("run", str(spec), "--json")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["status"] == "FAILED" and doc["restarts"] == 1 and doc["exit_code"] == 1  # sftctl's own, as wait's
    waited = sftctl("wait", doc["id"], "--json")
    assert waited.returncode == 1 and json.loads(waited.stdout)["exit_code"] == 1
    assert doc["failure_reason"] == "node 0 exited with code 3" and doc["failure_code"] == "exit"
    assert [(a["number"], a["status"], a["exit_code"]) for a in doc["attempts"]] == [(1, "FAILED", 3), (2, "FAILED", 3)]
    assert [a["reason_code"] for a in doc["attempts"]] == ["exit", "exit"]
    assert "attempt 2" in sftctl("logs", doc["id"], check=True).stdout


def test_twenty_concurrent_detached_runs(tmp_path, home):
    spec = write_spec(tmp_path / "tiny.yaml", TINY.replace("nodes: 2", "nodes: 1"))
    procs_ = [
        subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(spec), "--detach", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for _ in range(20)
    ]
    ids = []
    for p in procs_:
        out, err = p.communicate(timeout=deadline(120))
        assert p.returncode == 0, err
        ids.append(json.loads(out)["job_id"])
    assert len(set(ids)) == 20

    def all_done():
        jobs = {j["id"]: j for j in status_json()["jobs"]}
        return jobs if all(jobs[i]["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER") for i in ids) else None

    jobs = wait_for(all_done, timeout_s=240, what="20 detached jobs to finish")
    assert sorted(jobs) == sorted(ids)
    assert {jobs[i]["status"] for i in ids} == {"SUCCEEDED"}


def test_down_cancels_a_running_detached_job(tmp_path, home):
    spec = write_spec(tmp_path / "sleeper.yaml", SLEEPER)
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
    wait_for(lambda: len(job_processes(job)) >= 2, what="node processes")
    out = sftctl("down", job, check=True).stdout
    assert out.startswith(f"{job}: ")
    doc = status_json(job)
    assert doc["status"] == "CANCELLED"
    assert job_processes(job) == []
    assert all(n["status"] == "TERMINATED" for n in doc["nodes"])


def test_sigkilled_controller_then_down_leaves_nothing(tmp_path, home):
    spec = write_spec(tmp_path / "sleeper.yaml", SLEEPER)
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
    wait_for(lambda: len(job_processes(job)) >= 2, what="node processes")
    os.kill(status_json(job)["controller_pid"], signal.SIGKILL)
    doc = wait_for(lambda: (d := status_json(job))["status"] == "FAILED_CONTROLLER" and d, what="FAILED_CONTROLLER")
    assert "exited without finishing the job" in doc["failure_reason"]
    # its local nodes stop by themselves (sftctl.procs.guard, tests/test_lifecycle.py); down
    # may find them still stopping or gone: either way it releases both and leaves nothing
    table = sftctl("status", check=True).stdout
    assert job in table and "FAILED_CONTROLLER" in table
    sftctl("down", job, check=True)
    assert job_processes(job) == []
    doc = status_json(job)
    assert doc["status"] == "FAILED_CONTROLLER"  # what happened stays on record
    assert all(n["status"] == "TERMINATED" for n in doc["nodes"])
    events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
    assert events[-1]["kind"] == "down" and "released 2 node(s)" in events[-1]["message"]
    assert doc["failure_reason"].endswith("exited without finishing the job; sftctl down removed its nodes")
    assert doc["failure_code"] == "controller_died"
    assert [(a["status"], a["reason_code"]) for a in doc["attempts"]] == [("ABANDONED", "controller_died")]


def _as_from_a_terminal() -> None:
    """In the child, before exec: SIGINT back to its default, as a terminal's foreground job has it.
    A suite started in the background (``nohup pytest &``, CI scripts) runs with SIGINT ignored,
    every child inherits that, and Python leaves an ignored SIGINT ignored, so Ctrl-C could never
    be delivered and the test would wait out its deadline."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_cancels_attached_run(tmp_path, home):
    spec = write_spec(tmp_path / "sleeper.yaml", SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(spec)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal)
    # the timeouts guard against a hang, they measure nothing: a busy 2-core machine needs minutes
    job = wait_for(lambda: (j := status_json()["jobs"]) and j[0]["status"] == "RUNNING" and j[0]["id"],
                   timeout_s=300, what="RUNNING")
    wait_for(lambda: len(job_processes(job)) >= 2, timeout_s=300, what="node processes")
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=deadline(300))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err and "cancelled by the user (Ctrl-C)" in out
    assert status_json(job)["status"] == "CANCELLED"
    assert job_processes(job) == []


def test_down_all_and_usage_errors(tmp_path, home):
    assert sftctl("status", "nope").returncode == 2
    assert sftctl("down").returncode == 2
    assert sftctl("logs", "nope").returncode == 2
    proc = sftctl("run", str(write_spec(tmp_path / "x.yaml", "name: x\nresources: {accelerators: [H100:8]}\nrun: echo\n")))
    assert proc.returncode == 3 and "no offering can run 1 node(s) of H100:8" in proc.stderr and no_traceback(proc)
    assert sftctl("down", "--all", check=True).stdout.strip() == "nothing to take down"


def test_status_does_not_import_heavy_modules(home):
    code = (
        "import sys; from sftctl.cli import main; rc = main(['status', '--json']);"
        "heavy = [m for m in ('torch', 'jax', 'triton', 'boto3', 'google.cloud', 'kubernetes', 'numpy') if m in sys.modules];"
        "print('HEAVY', heavy, rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("HEAVY [] 0")


def test_status_table_shows_newest_jobs_and_all_on_request(home):
    from sftctl.state import JobStatus, Store

    store = Store()
    spec = {"resources": {"nodes": 1}, "train": {"steps": 5}, "run": "true"}
    ids = []
    for _ in range(55):
        ids.append(store.create_job("old", spec))
        store.transition(ids[-1], JobStatus.CANCELLED, "test")
    live = store.create_job("live", spec)
    from sftctl import procs

    store.update_job(live, controller_pid=os.getpid(), controller_start_ticks=procs.start_ticks(os.getpid()))
    table = sftctl("status", check=True).stdout
    assert live in table and "... and 6 older finished job(s): sftctl status --all" in table
    assert ids[0] not in table and ids[-1] in table
    full = sftctl("status", "--all", check=True).stdout
    assert all(i in full for i in ids) and "older finished" not in full
    assert len(status_json()["jobs"]) == 56


def test_run_checks_storage_before_creating_anything(tmp_path, home):
    spec = write_spec(tmp_path / "tiny.yaml", TINY)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for bad in (str(blocker), "/proc/sftctl-not-here"):
        proc = sftctl("run", str(spec), "--set", f"storage={bad}")
        assert proc.returncode == 4 and no_traceback(proc), proc.stderr
        assert proc.stderr.startswith(f"error: storage file://{bad}: cannot create the directory"), proc.stderr
    assert status_json()["jobs"] == []


def test_down_orphans_spares_another_homes_local_nodes(tmp_path, home):
    from sftctl.providers.local import HOME_TAG, LocalProvider

    env = {**os.environ, "SFTCTL_JOB_ID": "other-home-job", HOME_TAG: str(tmp_path / "elsewhere")}
    other = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        wait_for(lambda: other.pid in job_processes("other-home-job"), timeout_s=10, what="the tagged process")
        assert LocalProvider().list_instances(None) == []
        assert "other-home-job" not in sftctl("down", "--orphans", check=True).stdout
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_run_refuses_a_secret_that_is_not_set(tmp_path, home):
    spec = write_spec(tmp_path / "tiny.yaml", TINY)
    env = {k: v for k, v in os.environ.items() if k != "SFTCTL_TEST_SECRET"}
    proc = sftctl("run", str(spec), "--set", "secrets=[SFTCTL_TEST_SECRET]", env=env)
    assert proc.returncode == 2 and no_traceback(proc)
    assert "secrets: SFTCTL_TEST_SECRET not set" in proc.stderr.splitlines()[0], proc.stderr
    assert status_json()["jobs"] == []


def test_a_cloud_job_without_storage_is_refused_before_anything(home, tmp_path):
    """Cloud nodes keep everything in the job's storage: no storage, one line and exit 2, before
    planning when the spec already rules this machine out, after it when the plan picks a cloud."""
    spec = tmp_path / "cloud.yaml"
    spec.write_text("name: c\nresources: {accelerators: ['H100:8'], clouds: [aws, gcp]}\nrun: 'true'\n")
    proc = sftctl("run", str(spec))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "storage: required for aws/gcp nodes" in line
    assert status_json()["jobs"] == []  # nothing was created
