"""Where a job's controller runs (issue 24): ``controller.place: slurm`` against the real Slurm
cluster of tests/slurm_cluster.py (the ``cluster`` fixture of test_provider_slurm.py, which ends
each test by asserting that ``squeue`` is empty: sftctl never leaks a Slurm job)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import sftctl, status_json, wait_for, write_spec
from slurm_cluster import SlurmCluster, skip_reason
from test_provider_slurm import cluster, scontrol_job, shell_spec  # noqa: F401 (cluster: the fixture)

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

def _placed_spec(tmp_path: Path, extra: str = "sleep 4", controller: str = "{place: slurm}") -> Path:
    return write_spec(tmp_path / "placed.yaml", shell_spec(tmp_path, extra=extra).read_text()
                      + f"controller: {controller}\n")


def _squeue(cluster: SlurmCluster) -> list[dict]:
    out = cluster._run(["squeue", "-h", "-o", "%i|%j|%T|%C|%k"]).stdout
    return [dict(zip(("id", "name", "state", "cpus", "comment"), line.split("|", 4)))
            for line in out.splitlines() if line.strip()]


def test_a_controller_placed_on_slurm_runs_the_job_to_success(cluster, tmp_path, home):
    """controller.place: slurm: the controller is a 1-CPU Slurm job named sftctl-ctl-<job>,
    running inside that job (its pid's parent is slurmstepd, its environment names the job), and
    drives the job to SUCCEEDED; nothing is left in Slurm afterwards (the fixture asserts it)."""
    from sftctl.state import Store

    job = json.loads(sftctl("run", str(_placed_spec(tmp_path)), "--detach", "--json", check=True).stdout)["job_id"]
    name = f"sftctl-ctl-{job}"
    ctl = wait_for(lambda: [r for r in _squeue(cluster) if r["name"] == name and r["state"] == "RUNNING"],
                   timeout_s=60, what="the controller's Slurm job to run")[0]
    assert ctl["cpus"] == "1" and "sftctl-role=controller" in ctl["comment"] and f"sftctl-job={job}" in ctl["comment"]
    pid = wait_for(lambda: status_json(job)["controller_pid"], timeout_s=60, what="the controller to claim the job")
    owner = json.loads((home / "jobs" / job / "controller.json").read_text())
    assert owner["pid"] == pid and owner["slurm_job_id"] == ctl["id"]
    assert pid != os.getpid()
    # the recorded controller is a process of the Slurm job, not one this test or its CLI started
    assert Path(f"/proc/{pid}/comm").exists(), "the controller should still run"
    environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    assert environ["SFTCTL_CONTROLLER_SLURM_JOB_ID"] == ctl["id"]
    assert not [k for k in environ if k.startswith("SLURM_") and k != "SLURM_CONF"]  # none reach its allocations
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert Path(f"/proc/{ppid}/comm").read_text().strip() == "slurmstepd"
    holder = Store().lease(job)[0]
    assert holder.split(":")[1] == str(pid)  # the controller holds the job's lease (also on SQLite)
    wait_for(lambda: status_json(job)["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER", "CANCELLED"),
             timeout_s=120, what="the job to end")
    doc = status_json(job)
    assert doc["status"] == "SUCCEEDED", doc
    assert sftctl("logs", job).stdout.count("rank=") == 2
    events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
    assert any(e["message"].startswith(f"controller: Slurm job {ctl['id']} ({name})") for e in events), events
    log = (home / "jobs" / job / "controller.log").read_text()
    assert f"[sftctl] Slurm job {ctl['id']}: the controller of job {job}" in log
    wait_for(lambda: not [r for r in _squeue(cluster) if r["name"] == name], timeout_s=30,
             what="the controller's Slurm job to end with the job")


def test_down_of_a_job_with_a_placed_controller_leaves_no_slurm_job(cluster, tmp_path, home):
    """`sftctl down` ends the controller's Slurm job (SIGTERM: it cancels the job and stops the
    allocation itself) and leaves nothing in Slurm."""
    job = json.loads(sftctl("run", str(_placed_spec(tmp_path, extra="sleep 300")), "--detach", "--json",
                            "--set", "resources.deadline=90m", check=True).stdout)["job_id"]
    wait_for(lambda: sftctl("logs", job).stdout.count("rank=") == 2, timeout_s=90, what="the nodes to start")
    names = sorted(r["name"] for r in _squeue(cluster))
    assert names == sorted([f"sftctl-{job}", f"sftctl-ctl-{job}"]), names
    [ctl] = [r["id"] for r in _squeue(cluster) if r["name"] == f"sftctl-ctl-{job}"]
    f = scontrol_job(cluster, ctl)  # as Slurm recorded it: 1 CPU, the deadline + 10 min, never requeued
    assert (f["NumCPUs"], f["TimeLimit"], f["Requeue"], f["Partition"]) == ("1", "01:40:00", "0", "gpu"), f
    summary = sftctl("down", job, check=True).stdout
    assert job in summary and "cancelled" in summary, summary
    wait_for(lambda: cluster.jobs() == [], timeout_s=30, what="both Slurm jobs to be gone")
    assert status_json(job)["status"] == "CANCELLED"
    # the controller got the SIGTERM in its Slurm job and stopped the nodes itself
    messages = [e["message"] for e in json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]]
    assert "sftctl down: SIGTERM to the controller's Slurm job" in messages, messages
    assert "RUNNING -> CANCELLED: cancelled by SIGTERM" in messages and "its controller stopped the nodes" in summary


def test_a_queued_controller_holds_the_job_and_down_cancels_it(cluster, tmp_path, home, monkeypatch):
    """While the controller's Slurm job waits in the queue the job is not one without a
    controller (a read does not fail it, a second start is refused), and `down` cancels it."""
    from sftctl import api, state

    blocker = subprocess.run(["sbatch", "--parsable", "-N3", "--exclusive", "--output=/dev/null", "--wrap", "sleep 300"],
                             capture_output=True, text=True, check=True).stdout.strip()
    try:
        job = json.loads(sftctl("run", str(_placed_spec(tmp_path)), "--detach", "--json", check=True).stdout)["job_id"]
        queued = [r for r in _squeue(cluster) if r["name"] == f"sftctl-ctl-{job}"]
        assert [r["state"] for r in queued] == ["PENDING"]
        env_file = home / "jobs" / job / "slurm" / "controller.env"  # its environment, until it starts
        assert env_file.stat().st_mode & 0o777 == 0o600 and f"export SFTCTL_HOME={home}\n" in env_file.read_text()
        monkeypatch.setattr(state, "CONTROLLER_START_GRACE_S", 0.0)  # a plain job would be reaped now (the
        monkeypatch.setattr(state.jobs, "CONTROLLER_START_GRACE_S", 0.0)  # server reads it here, the Store there)
        assert api.status(job).status.value == "PENDING"
        from sftctl.queue import ControllerBusy

        with pytest.raises(ControllerBusy) as busy:  # the queued controller holds the lease
            api.start(job)
        assert f"slurm:{queued[0]['id']}" in busy.value.message and busy.value.exit_code == 2
        assert len([r for r in _squeue(cluster) if r["name"] == f"sftctl-ctl-{job}"]) == 1  # no second one
        # an admin cancels the queued controller: its lease goes with it and start places another
        subprocess.run(["scancel", queued[0]["id"]], check=True)
        wait_for(lambda: queued[0]["id"] not in cluster.jobs(), timeout_s=30, what="the scancel")
        api.start(job)
        again = [r for r in _squeue(cluster) if r["name"] == f"sftctl-ctl-{job}"]
        assert [r["state"] for r in again] == ["PENDING"] and again[0]["id"] != queued[0]["id"], again
        messages = [e["message"] for e in json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]]
        assert f"controller: Slurm job {queued[0]['id']} left the queue without starting" in messages, messages
        # the same seen by a server: its reconcile would give the job a controller again
        from sftctl.server import Supervisor

        subprocess.run(["scancel", again[0]["id"]], check=True)
        wait_for(lambda: again[0]["id"] not in cluster.jobs(), timeout_s=30, what="the second scancel")
        assert Supervisor().orphans() == [job]
        summary = sftctl("down", job, check=True).stdout
        assert "cancelled" in summary, summary
        wait_for(lambda: cluster.jobs() == [blocker], timeout_s=30, what="the queued controller to be cancelled")
        assert status_json(job)["status"] == "CANCELLED"
        assert not env_file.exists()  # never read by a controller: down deleted it
    finally:
        subprocess.run(["scancel", blocker], check=True)


def test_a_placed_controller_is_refused_where_it_cannot_work(cluster, tmp_path, home, monkeypatch):
    """One line naming controller.place and the fix, exit 2, nothing submitted: SQLite state with
    the cluster over SSH; place: server without a server; local nodes; a bad partition (exit 4)."""
    config = tmp_path / "config.yaml"
    config.write_text("slurm: {host: login.example.org}\n")
    monkeypatch.setenv("SFTCTL_CONFIG", str(config))
    proc = sftctl("run", str(_placed_spec(tmp_path)), "--detach")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[0]
    assert "controller.place: slurm" in line and "SQLite" in line and "over SSH" in line, proc.stderr
    assert "state.url" in proc.stderr and "Postgres" in proc.stderr
    monkeypatch.delenv("SFTCTL_CONFIG")
    proc = sftctl("run", str(_placed_spec(tmp_path, controller="{place: server}")), "--detach")
    assert proc.returncode == 2 and "controller.place: server, but the config names no sftctl server" in proc.stderr
    local = _placed_spec(tmp_path).read_text().replace("clouds: [slurm]", "clouds: [local]")
    proc = sftctl("run", str(write_spec(tmp_path / "local.yaml", local)), "--detach")
    assert proc.returncode == 2 and "controller.place: slurm cannot supervise local nodes" in proc.stderr, proc.stderr
    proc = sftctl("run", str(_placed_spec(tmp_path, controller="{place: slurm, partition: nosuch}")), "--detach")
    assert proc.returncode == 4 and "sbatch refused the controller" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr
    [failed] = json.loads(sftctl("status", "--json", "--all", check=True).stdout)["jobs"]
    # failed at once with Slurm's reason, not left PENDING for the reaper's "never started"
    assert failed["status"] == "FAILED" and failed["failure_code"] == "provider_error", failed
    assert failed["failure_reason"].startswith("its controller could not be placed on Slurm: slurm: sbatch refused")
    # no controller will read its environment (the state's URL, secrets): the file went with the refusal
    assert (home / "jobs" / failed["id"] / "slurm" / "controller.sbatch.sh").is_file()
    assert not (home / "jobs" / failed["id"] / "slurm" / "controller.env").exists()
    proc = sftctl("run", str(_placed_spec(tmp_path, controller="{place: mars}")), "--detach")
    assert proc.returncode == 2 and "controller.place" in proc.stderr and "'slurm'" in proc.stderr, proc.stderr
    assert cluster.jobs() == []


def test_down_orphans_stops_a_placed_controller_of_an_unknown_job(cluster, tmp_path, home):
    """A controller's Slurm job (sftctl-role=controller) whose job this state does not know is
    stopped by down --orphans; another home's is left alone."""
    from sftctl.providers.slurm import CONTROLLER_ROLE, comment

    mine = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--job-name=sftctl-ctl-ghost-ctl",
                           f"--comment={comment('ghost-ctl')},{CONTROLLER_ROLE}", "--wrap", "sleep 300"],
                          capture_output=True, text=True, check=True).stdout.strip()
    theirs = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--job-name=sftctl-ctl-x",
                             f"--comment=sftctl-managed=true,sftctl-job=x,sftctl-home=other,{CONTROLLER_ROLE}",
                             "--wrap", "sleep 300"], capture_output=True, text=True, check=True).stdout.strip()
    try:
        wait_for(lambda: {r["id"]: r["state"] for r in _squeue(cluster)}.get(mine) == "RUNNING", timeout_s=30,
                 what="the ghost controller to run")
        out = sftctl("down", "--orphans", check=True).stdout
        assert f"slurm: ghost-ctl (unknown job): stopped its controller's Slurm job {mine}" in out, out
        assert "removed" not in out  # a controller's job is not a node allocation
        wait_for(lambda: cluster.jobs() == [theirs], timeout_s=30, what="only the other home's job to remain")
    finally:
        subprocess.run(["scancel", mine, theirs])
    wait_for(lambda: cluster.jobs() == [], timeout_s=30, what="cleanup")


def test_an_attached_run_with_a_placed_controller_follows_the_job(cluster, tmp_path, home):
    """`sftctl run` without --detach submits the controller to Slurm and follows the job's logs
    until it ends: the exit code and the document are the job's."""
    proc = sftctl("run", str(_placed_spec(tmp_path, extra="sleep 1")), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED" and doc["provider"] == "slurm", doc
    owner = json.loads((home / "jobs" / doc["id"] / "controller.json").read_text())
    assert owner["slurm_job_id"] and owner["pid"] == doc["controller_pid"]


def test_a_server_places_the_controller_on_slurm_once(cluster, tmp_path, home, monkeypatch):
    """With a server configured the server submits the placed controller (not its own child);
    its reconciliation (every 10 s) sees the job's lease and never gives it a second controller;
    the job SUCCEEDS with the client gone."""
    pytest.importorskip("fastapi")
    from test_server import Server, as_user, tokens

    server = Server(home, tmp_path / "server.log").start()
    try:
        as_user(monkeypatch, server, tokens("alice")["alice"])
        job = json.loads(sftctl("run", str(_placed_spec(tmp_path, extra="sleep 25")), "--detach", "--json",
                                check=True).stdout)["job_id"]
        wait_for(lambda: [r for r in _squeue(cluster) if r["name"] == f"sftctl-ctl-{job}"], timeout_s=30,
                 what="the server to submit the controller")
        wait_for(lambda: status_json(job)["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER", "CANCELLED"),
                 timeout_s=150, what="the job to end")
        assert status_json(job)["status"] == "SUCCEEDED"
        events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
        placed = [e["message"] for e in events if e["message"].startswith("controller: Slurm job")]
        import httpx

        rounds = httpx.get(f"{server.url}/v1/health", timeout=10).json()["reconciles"]
        assert len(placed) == 1 and rounds >= 3, (placed, rounds)  # one controller through every reconcile
        log = (tmp_path / "server.log").read_text()
        assert f"controller of {job} submitted to Slurm" in log and "reconcile failed" not in log, log[-3000:]
    finally:
        server.stop()


def test_dry_run_shows_the_controllers_sbatch_script(cluster, tmp_path, home):
    """`run --dry-run` shows controller.sbatch.sh as place_controller would submit it; nothing
    is submitted."""
    spec = _placed_spec(tmp_path, controller="{place: slurm, partition: gpu}")
    doc = json.loads(sftctl("run", str(spec), "--dry-run", "--json", "--set", "resources.deadline=2h",
                            check=True).stdout)
    texts = {s["name"]: s["text"] for s in doc["submits"]}
    assert set(texts) == {"controller.sbatch.sh", "attempt-1/sbatch.sh", "attempt-1/step.sh"}
    ctl = texts["controller.sbatch.sh"]
    for line in ("#SBATCH --job-name=sftctl-ctl-<job-id>\n", "#SBATCH --cpus-per-task=1\n", "#SBATCH --partition=gpu\n",
                 "#SBATCH --time=0-02:10:00\n", "#SBATCH --no-requeue\n"):
        assert line in ctl, ctl
    assert "sftctl.queue" in ctl and "<job-id>" in ctl.rsplit("exec ", 1)[1]
    assert cluster.jobs() == []


def test_a_controller_placed_on_slurm_leaves_its_state_url_and_secrets_out_of_slurm(cluster, postgres, tmp_path,
                                                                                      home, monkeypatch):
    """Issue 40.6: the placed controller's sbatch is --export=NONE; its environment (the state's
    Postgres URL with its password, the spec's secret, this shell's own variables) travels in a
    0600 file the batch script reads and deletes. While the job runs and after it ends, no file
    of slurmctld's StateSaveLocation holds the password, the secret or this shell's marked
    variable; the controller still has them and the job SUCCEEDS with the secret on its nodes."""
    from urllib.parse import urlsplit

    from test_provider_slurm import (CONTROLLER_MARK, PLAIN_VALUE, SECRET_VALUE, assert_nodes_got_their_environment,
                                     assert_slurm_keeps_nothing, held_secret_run, secret_spec)

    password = "pg-pass-40-6-placed"
    url = postgres.create_database().replace("postgres@", f"postgres:{password}@", 1)
    assert urlsplit(url).password == password  # trust auth: Postgres never asks for it, sftctl still carries it
    monkeypatch.setenv("SFTCTL_STATE_URL", url)
    monkeypatch.setenv("LAB_SECRET_40", SECRET_VALUE)
    monkeypatch.setenv("SFTCTL_TEST_MARK_40", CONTROLLER_MARK)
    monkeypatch.setenv("SBATCH_EXPORT", "ALL")  # reaches the controller too: its sbatch's --export=NONE wins
    release = tmp_path / "release"
    spec = secret_spec(tmp_path, _placed_spec(tmp_path, extra=held_secret_run(release)).read_text())
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    try:
        wait_for(lambda: sftctl("logs", job).stdout.count("secret_sha=") == 2, timeout_s=120, what="the nodes to start")
        forbidden = [password, SECRET_VALUE, PLAIN_VALUE, CONTROLLER_MARK, "SFTCTL_TEST_MARK_40", "LAB_SECRET_40"]
        envs = assert_slurm_keeps_nothing(cluster, forbidden, jobs=2)  # the controller's and the allocation's
        names = sorted(e["SLURM_JOB_NAME"] for e in envs.values())
        assert names == sorted([f"sftctl-{job}", f"sftctl-ctl-{job}"]), names
        pid = status_json(job)["controller_pid"]
        environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        assert (environ["SFTCTL_STATE_URL"], environ["LAB_SECRET_40"]) == (url, SECRET_VALUE)
        assert environ["SFTCTL_HOME"] == str(home) and environ["SFTCTL_TEST_MARK_40"] == CONTROLLER_MARK
        env_file = home / "jobs" / job / "slurm" / "controller.env"
        assert not env_file.exists()  # read once by the batch script, then deleted
        release.touch()
        wait_for(lambda: status_json(job)["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER", "CANCELLED"),
                 timeout_s=120, what="the job to end")
        assert status_json(job)["status"] == "SUCCEEDED", status_json(job)
        assert_nodes_got_their_environment(job)
        assert_slurm_keeps_nothing(cluster, forbidden, jobs=0)
    finally:
        sftctl("down", job)


# ------------------------------------------------------------------ controller.place: kubernetes


@pytest.fixture
def k8s(tmp_path, monkeypatch):
    """The Kubernetes API emulator (tests/k8s_emulator.py: every body checked against the
    official schema, strictly) as the configured cluster of this test and its CLI processes."""
    from k8s_emulator import K8sEmulator

    with K8sEmulator() as c:
        monkeypatch.setenv("KUBECONFIG", str(c.write_kubeconfig(tmp_path / "kubeconfig")))
        for var in ("SFTCTL_K8S_CONTEXT", "SFTCTL_K8S_NAMESPACE", "KUBERNETES_SERVICE_HOST"):
            monkeypatch.delenv(var, raising=False)
        yield c


def _controller_jobs(k8s, job: str) -> list[dict]:
    return k8s.list("jobs", "default", f"sftctl-controller-of={job}")


def _kubelet(k8s, kjob: dict, pod_root: Path) -> subprocess.Popen:
    """Run the container of ``kjob`` as the kubelet would, as a local process: its command, its
    env with the envFrom Secret read from the cluster (base64-decoded), the emptyDir volume a
    fresh directory. The "image" is this interpreter's venv (``python`` on PATH) and the
    machine's Slurm client configuration; no SFTCTL_* variable of this test reaches it."""
    import base64
    import sys

    [container] = kjob["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SFTCTL_", "KUBECONFIG"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", HOME=str(pod_root / "root"),
               XDG_CONFIG_HOME=str(pod_root / "xdg"))
    for ref in container.get("envFrom") or []:
        secret = k8s.get("secrets", "default", ref["secretRef"]["name"])
        env.update({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})
    env.update({e["name"]: e["value"] for e in container["env"]})
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for vol in kjob["spec"]["template"]["spec"]["volumes"]:  # emptyDir: a fresh directory
        assert "emptyDir" in vol
        local = pod_root / vol["name"]
        local.mkdir(parents=True)
        env = {k: str(local) if v == mounts[vol["name"]] else v for k, v in env.items()}
    return subprocess.Popen(container["command"], env=env, cwd=pod_root, stdout=open(pod_root / "pod.log", "wb"),
                            stderr=subprocess.STDOUT)


def test_a_controller_placed_on_kubernetes_runs_the_job_to_success(cluster, pg_url, k8s, tmp_path, home):
    """controller.place: kubernetes: `run --detach` creates exactly one batch/v1 Job (schema-valid,
    restartPolicy Never, backoffLimit 0, labelled with the job) whose Secret carries the state's
    URL (never the Job's body); the queued Job holds the job's lease, so a second start places
    nothing; the Job's container, run as the kubelet would, drives the job to SUCCEEDED on Slurm
    nodes with no client attached; `down` deletes the Job and its Secret."""
    from sftctl import api
    from sftctl.controller.placements.kubernetes import controller_install
    from sftctl.queue import ControllerBusy

    job = json.loads(sftctl("run", str(_placed_spec(tmp_path, extra="sleep 2", controller="{place: kubernetes}")),
                            "--detach", "--json", check=True).stdout)["job_id"]
    [kjob] = _controller_jobs(k8s, job)
    name = kjob["metadata"]["name"]
    assert name == f"sftctl-ctl-{job}" and kjob["metadata"]["annotations"]["sftctl.dev/job-id"] == job
    pod = kjob["spec"]["template"]["spec"]
    assert (pod["restartPolicy"], kjob["spec"]["backoffLimit"]) == ("Never", 0)
    [container] = pod["containers"]
    # the default image has no sftctl: the command pip-installs it when missing (here the
    # "image" is this venv, which has it), then execs `python -m sftctl.queue JOB`
    assert container["image"] == "python:3.11-slim" and container["command"][:2] == ["sh", "-c"]
    assert container["command"][3] == controller_install() and container["command"][4] == "python"
    assert container["command"][-1] == job and "sftctl.queue" in container["command"][-2]
    assert {e["name"]: e["value"] for e in container["env"]}["SFTCTL_CONTROLLER_K8S_JOB"] == name
    assert pg_url not in json.dumps(kjob)  # the database password travels in the Secret only
    secret = k8s.get("secrets", "default", container["envFrom"][0]["secretRef"]["name"])
    import base64

    assert base64.b64decode(secret["data"]["SFTCTL_STATE_URL"]).decode() == pg_url
    assert not k8s.list("pods", "default")  # the controller is no node of the job
    # queued: the Job holds the lease; a second start is refused and creates no second Job
    with pytest.raises(ControllerBusy) as busy:
        api.start(job)
    assert f"kubernetes:{name}" in busy.value.message and busy.value.exit_code == 2
    assert len(_controller_jobs(k8s, job)) == 1
    assert status_json(job)["status"] == "PENDING"
    # the kubelet starts the pod: the container's command, on its own, with no client attached
    proc = _kubelet(k8s, kjob, tmp_path / "pod")
    try:
        wait_for(lambda: status_json(job)["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER", "CANCELLED"),
                 timeout_s=150, what="the job to end")
        assert proc.wait(timeout=60) == 0, (tmp_path / "pod" / "pod.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    doc = status_json(job)
    assert doc["status"] == "SUCCEEDED" and doc["provider"] == "slurm", doc
    assert doc["controller_pid"] == proc.pid  # the pod's process was the controller
    owner = json.loads((tmp_path / "pod" / "sftctl-home" / "jobs" / job / "controller.json").read_text())
    assert owner["kubernetes_job"] == name and owner["pid"] == proc.pid
    events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
    placed = [e["message"] for e in events if e["message"].startswith("controller: Kubernetes Job")]
    assert placed == [f"controller: Kubernetes Job {name} in namespace default"], placed
    assert len(_controller_jobs(k8s, job)) == 1
    sftctl("down", job, check=True)
    assert _controller_jobs(k8s, job) == [] and k8s.get("secrets", "default", secret["metadata"]["name"]) is None


def test_down_of_a_job_placed_on_kubernetes_deletes_its_job(cluster, pg_url, k8s, tmp_path, home):
    """`down` of a running job deletes the controller's Job (the kubelet then stops its pod with
    SIGTERM) and its Secret, and the job is CANCELLED with nothing left in Slurm."""
    job = json.loads(sftctl("run", str(_placed_spec(tmp_path, extra="sleep 300", controller="{place: kubernetes}")),
                            "--detach", "--json", check=True).stdout)["job_id"]
    [kjob] = _controller_jobs(k8s, job)
    proc = _kubelet(k8s, kjob, tmp_path / "pod")
    try:
        wait_for(lambda: status_json(job)["status"] == "RUNNING" and len(cluster.jobs()) == 1, timeout_s=90,
                 what="the nodes to start")
        summary = sftctl("down", job, check=True).stdout
        assert "cancelled" in summary, summary
        assert _controller_jobs(k8s, job) == [] and not k8s.list("secrets", "default")
        proc.terminate()  # the kubelet's SIGTERM to the pod of the deleted Job
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: cluster.jobs() == [], timeout_s=30, what="the node allocation to be gone")
    assert status_json(job)["status"] == "CANCELLED"
    messages = [e["message"] for e in json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]]
    assert "sftctl down: SIGTERM to the controller's Kubernetes Job" in messages, messages


def test_a_controller_placed_on_kubernetes_is_refused_where_it_cannot_work(cluster, postgres, k8s, tmp_path, home,
                                                                          monkeypatch):
    """One line naming controller.place and the fix, exit 2, no Job created: SQLite state;
    local nodes (with a Postgres state); image without place: kubernetes."""
    proc = sftctl("run", str(_placed_spec(tmp_path, controller="{place: kubernetes}")), "--detach")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[0]
    assert "controller.place: kubernetes" in line and "SQLite" in line, proc.stderr
    assert "state.url" in proc.stderr and "Postgres" in proc.stderr
    monkeypatch.setenv("SFTCTL_STATE_URL", postgres.create_database())
    local = _placed_spec(tmp_path, controller="{place: kubernetes}").read_text().replace("clouds: [slurm]",
                                                                                         "clouds: [local]")
    proc = sftctl("run", str(write_spec(tmp_path / "local.yaml", local)), "--detach")
    assert proc.returncode == 2 and "controller.place: kubernetes cannot supervise local nodes" in proc.stderr, \
        proc.stderr
    proc = sftctl("run", str(_placed_spec(tmp_path, controller="{place: slurm, image: x}")), "--detach")
    assert proc.returncode == 2 and "image is for place: kubernetes only" in proc.stderr, proc.stderr
    assert k8s.list("jobs", "default") == [] and cluster.jobs() == []


def test_down_orphans_deletes_a_kubernetes_controller_of_an_unknown_job(k8s, tmp_path, home):
    """A controller's Kubernetes Job (sftctl-role=controller) whose job this state does not know
    is deleted by down --orphans, with its Secret; a node pod sweep never took it for a node."""
    from sftctl.providers.kubernetes import KubernetesProvider

    name = KubernetesProvider().submit_controller("ghost-k8s", ["sleep", "300"], env={"A": "b"},
                                                  secret_env={"SFTCTL_STATE_URL": "postgresql://x"})
    assert [j["metadata"]["name"] for j in _controller_jobs(k8s, "ghost-k8s")] == [name]
    out = sftctl("down", "--orphans", check=True).stdout
    assert f"kubernetes: ghost-k8s (unknown job): stopped its controller's Kubernetes Job {name}" in out, out
    assert "removed" not in out  # not a node
    assert _controller_jobs(k8s, "ghost-k8s") == [] and not k8s.list("secrets", "default")
    assert "ghost-k8s" not in sftctl("down", "--orphans", check=True).stdout  # nothing left to find


def test_the_default_controller_image_gets_sftctl_installed_first(tmp_path):
    """A controller Job on the default image (python:3.11-slim, no sftctl) ran `python -m
    sftctl.queue` there and died at its import. Its command now pip-installs sftctl when
    `python` cannot import it, then execs the controller; an image that has it skips the install;
    a failed install is one line and exit 1. Run here with stub `python` and `pip` on PATH."""
    from sftctl.controller.placements.kubernetes import controller_container_command, controller_install

    assert controller_container_command("j1", "ghcr.io/lab/sftctl:1")[0] == "python"  # an image of the user's: as is
    cmd = controller_container_command("j1", None)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "calls"

    def stub(name: str, body: str) -> None:
        (stubs / name).write_text(f"#!/bin/sh\necho {name} \"$@\" >> {log}\n{body}\n")
        (stubs / name).chmod(0o755)

    env = {"PATH": f"{stubs}:/usr/bin:/bin"}
    for has_sftctl, pip_ok in ((False, True), (True, True), (False, False)):
        log.write_text("")
        # `python -c "import sftctl"` fails until pip ran (a marker file), or from the start
        stub("python", f'case "$2" in "import sftctl") {"exit 0" if has_sftctl else f"[ -e {tmp_path}/installed ]; exit $?"};; esac; exit 0')
        stub("pip", f"touch {tmp_path}/installed; exit 0" if pip_ok else "exit 3")
        (tmp_path / "installed").unlink(missing_ok=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
        calls = log.read_text().splitlines()
        if not pip_ok:
            assert proc.returncode == 1 and "cannot pip install" in proc.stderr, proc
            assert not any("sftctl.queue" in c for c in calls), calls
            continue
        assert proc.returncode == 0, proc
        pips = [c for c in calls if c.startswith("pip ")]
        assert pips == ([] if has_sftctl else [f"pip install --quiet --no-cache-dir {controller_install()}"]), calls
        assert calls[-1].startswith("python -c") and calls[-1].endswith(" j1") and "sftctl.queue" in calls[-1], calls


def test_dry_run_shows_the_kubernetes_controllers_job(cluster, pg_url, k8s, tmp_path, home):
    """`run --dry-run` with controller.place: kubernetes shows the controller's Job and Secret as
    place_controller would create them (the default image's install-then-exec command; the
    Secret's keys with values masked: the state URL holds the database password); nothing is
    created. Before, the dry run showed no controller at all."""
    import yaml

    from sftctl.controller.placements.kubernetes import controller_install
    from sftctl.providers.kubernetes import controller_names

    spec = _placed_spec(tmp_path, controller="{place: kubernetes}")
    out = sftctl("run", str(spec), "--dry-run", "--json", check=True).stdout
    texts = {s["name"]: s["text"] for s in json.loads(out)["submits"]}
    assert "controller: Kubernetes objects" in texts, sorted(texts)
    kjob, secret = yaml.safe_load_all(texts["controller: Kubernetes objects"])
    assert (kjob["kind"], kjob["metadata"]["name"]) == ("Job", controller_names("<job-id>")["job"])
    [container] = kjob["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "python:3.11-slim" and container["command"][:2] == ["sh", "-c"]
    assert container["command"][3] == controller_install() and container["command"][-1] == "<job-id>"
    assert secret["kind"] == "Secret" and "SFTCTL_STATE_URL" in secret["data"]
    assert pg_url not in out
    assert not k8s.list("jobs", "default") and not k8s.list("secrets", "default")
