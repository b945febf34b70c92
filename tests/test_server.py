"""sftctl server (issue 24): a real server process on a loopback port, its users' tokens, and
clients (sftctl.api in this process, the CLI in subprocesses) whose config names it.

- users cannot cross: a second user neither sees, reads the logs of, nor stops the first's job;
- the laptop closing: the client that submitted a job is killed; a GPU fault is replayed into
  one node; the server's controller replaces it and the job SUCCEEDS with no client attached;
- the server killed -9 mid-job and started again: the job SUCCEEDS, with no node started twice.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, deadline, job_processes, no_traceback, process_report, sftctl, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from sftctl.api import WAIT_TEARDOWN_S
from sftctl.server import RECONCILE_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``sftctl server start`` as a process of its own (a session of its own: killed -9 alone)."""

    def __init__(self, home: Path, log: Path, env: dict[str, str] | None = None):
        self.home, self.log, self.port, self.extra_env = home, log, _free_port(), env or {}
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SFTCTL_SERVER_")}, **self.extra_env}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "server", "start", "--port", str(self.port)],
                                         cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        import httpx

        def up():
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout_s=60, what="the server to answer")
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def as_user(monkeypatch, server: Server, token: str) -> None:
    """This process's sftctl.api (and the CLI processes it starts) talk to ``server`` as the
    token's user."""
    monkeypatch.setenv("SFTCTL_SERVER_URL", server.url)
    monkeypatch.setenv("SFTCTL_SERVER_TOKEN", token)


def tokens(*names: str, admin: str | None = None) -> dict[str, str]:
    from sftctl.server.users import add_user

    out = {n: add_user(n) for n in names}
    if admin:
        out[admin] = add_user(admin, admin=True)
    return out


SLEEPER = "name: sleeper\nresources: {nodes: 1}\nrun: |\n  echo started\n  sleep 300\n"


def test_a_long_log_comes_through_the_server_whole_and_in_order(server, tmp_path, monkeypatch):
    """5,000 lines (more than two of log_chunks' chunks of 2,048): through the server the same
    lines, in order, as this machine's state has them; each chunk at most 2,048 lines."""
    from sftctl import api
    from sftctl.api._views import LOG_CHUNK_LINES, log_chunks

    spec = tmp_path / "many.yaml"
    spec.write_text("name: many\nresources: {nodes: 1}\nrun: |\n  python3 -c \"[print('line', i) for i in range(5000)]\"\n")
    as_user(monkeypatch, server, tokens("alice")["alice"])
    job = api.run(str(spec), detach=True).id
    assert api.wait(job, timeout_s=deadline(300)).status.value == "SUCCEEDED"
    remote = [line.text for line in api.logs(job)]
    assert [t for t in remote if t.startswith("line ")] == [f"line {i}" for i in range(5000)]
    monkeypatch.delenv("SFTCTL_SERVER_URL")
    chunks = list(log_chunks(job))
    assert len(chunks) >= 3 and all(0 < len(c) <= LOG_CHUNK_LINES for c in chunks)
    assert [line.text for c in chunks for line in c] == remote == [line.text for line in api.logs(job)]


def test_a_user_cannot_see_read_or_stop_another_users_job(server, tmp_path, monkeypatch):
    from sftctl import api
    from sftctl.errors import NotFoundError, SftctlError

    t = tokens("alice", "bob", admin="admin1")
    spec = tmp_path / "sleeper.yaml"
    spec.write_text(SLEEPER)
    as_user(monkeypatch, server, t["alice"])
    assert api.status() == []  # the server's list, cached for a second ...
    job = api.run(str(spec), detach=True).id
    assert [v.id for v in api.status()] == [job]  # ... is forgotten at a submit through it
    follow = api.logs(job, follow=True)  # streamed: the job sleeps 300 s after its first line
    assert next(line.text for line in follow if not line.notice) == "[sftctl] node 0: run (attempt 1)"
    assert next(follow).text == "started" and api.status(job).status.value == "RUNNING"
    follow.close()

    as_user(monkeypatch, server, t["bob"])
    assert api.status() == []
    for call in (lambda: api.status(job), lambda: list(api.logs(job)), lambda: api.events(job),
                 lambda: api.down(job), lambda: api.status(job[:8])):
        with pytest.raises(NotFoundError, match="of yours"):
            call()
    with pytest.raises(SftctlError, match="not an admin"):
        api.status(all_users=True)
    for args in (["logs", job], ["down", job], ["status", job], ["events", job]):  # the CLI: one line, exit 2
        proc = sftctl(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")] == \
            [f"error: no job '{job}' of yours (bob) on this server"] and no_traceback(proc)
    proc = sftctl("status", "--all-users", "--json")
    assert proc.returncode == 2 and json.loads(proc.stdout)["exit_code"] == 2

    monkeypatch.setenv("SFTCTL_SERVER_TOKEN", "not-a-token")
    proc = sftctl("status")
    assert proc.returncode == 4 and "knows no user with this token" in proc.stderr and no_traceback(proc)

    as_user(monkeypatch, server, t["admin1"])  # an admin sees every user's jobs
    assert [v.id for v in api.status(all_users=True)] == [job]
    assert api.status() == []  # ... and, without --all-users, their own

    [lab] = api.costs(by="lab")  # the admin's: every user's jobs
    assert lab.group == "lab" and lab.jobs == 1 and lab.node_hours > 0

    as_user(monkeypatch, server, t["bob"])
    assert api.costs() == []  # bob's own jobs cost nothing yet; alice's row is not his to see
    with pytest.raises(SftctlError, match="not an admin"):
        api.costs(by="lab")

    as_user(monkeypatch, server, t["alice"])
    assert [(c.group, c.jobs) for c in api.costs()] == [("alice", 1)]
    assert api.status(job).status.value == "RUNNING"  # bob's tries left it alone
    doc = json.loads(sftctl("status", job, "--json", check=True).stdout)
    assert doc["id"] == job and doc["status"] == "RUNNING" and doc["nodes"][0]["rank"] == 0
    [down] = api.down(job)
    assert down.status == "CANCELLED"
    wait_for(lambda: job_processes(job) == [], timeout_s=30, what="the job's processes to end")


def test_an_admins_down_of_a_users_job_names_the_admin_to_its_owner(server, tmp_path, monkeypatch):
    """alice's job taken down by admin bob: her status, events and job page say "taken down by
    admin bob" (the audit has it too); her own down of her other job reads as before."""
    import httpx

    from sftctl import api

    t = tokens("alice", admin="bob")
    spec = tmp_path / "sleeper.yaml"
    spec.write_text(SLEEPER)
    as_user(monkeypatch, server, t["alice"])
    theirs, mine = (api.run(str(spec), detach=True).id for _ in range(2))
    for job in (theirs, mine):  # running, its controller alive: the down signals it
        wait_for(lambda job=job: any(line.text == "started" for line in api.logs(job)), timeout_s=120, what=f"{job} to start")
    as_user(monkeypatch, server, t["bob"])
    proc = sftctl("down", theirs, check=True)
    assert proc.stdout.startswith(f"{theirs}: cancelled by admin bob, "), proc.stdout
    as_user(monkeypatch, server, t["alice"])
    sftctl("down", mine, check=True)

    reason = "taken down by admin bob"
    doc = json.loads(sftctl("status", theirs, "--json", check=True).stdout)
    assert (doc["status"], doc["failure_reason"]) == ("CANCELLED", reason), doc
    assert f"reason: {reason}" in sftctl("status", theirs, env={**os.environ, "COLUMNS": "200"}, check=True).stdout
    events = [(e.kind, e.message) for e in api.events(theirs)]
    assert ("status", f"RUNNING -> CANCELLED: {reason}") in events, events
    assert any(k == "down" and m.startswith("sftctl down by admin bob: SIGTERM to the controller (pid ") for k, m in events), events
    assert reason in sftctl("events", theirs, env={**os.environ, "COLUMNS": "200"}, check=True).stdout
    page = httpx.Client(base_url=server.url, timeout=30)
    assert page.post("/ui/login", content=f"token={t['alice']}",
                     headers={"content-type": "application/x-www-form-urlencoded"}).status_code == 303
    assert reason in page.get(f"/ui/jobs/{theirs}").text

    view = api.status(mine)  # her own down: as it always read
    assert (view.status.value, view.failure_reason) == ("CANCELLED", "cancelled by sftctl down")
    assert not any("admin" in e.message for e in api.events(mine))
    from sftctl.server.users import audit_events

    assert [(e.actor, e.target, e.detail) for e in audit_events(None) if e.action == "down"] == \
        [("bob", theirs, "owner alice")]
    for job in (theirs, mine):
        wait_for(lambda job=job: job_processes(job) == [], timeout_s=60, what=f"{job}'s processes to end")


# A two-node job whose ranks step and checkpoint to a file; past step 3 they wait for the test's
# go-ahead (a file), so a fault replayed at step 5 comes only once the test allows it.
LOOP = """\
import os, pathlib, time
from sftctl.train import report
rank = int(os.environ["SFTCTL_NODE_RANK"])
work = pathlib.Path(os.environ["WORK"])
ckpt = work / f"ckpt-{rank}"
start = int(ckpt.read_text()) if ckpt.exists() else 0
print(f"rank {rank} resumes from {start}", flush=True)
for step in range(start + 1, STEPS + 1):
    while step > 3 and not (work / "go").exists():
        time.sleep(0.2)
    report(step=step, loss=1.0 / step)
    (work / f"ckpt-{rank}.tmp").write_text(str(step))
    os.replace(work / f"ckpt-{rank}.tmp", ckpt)
    time.sleep(0.3)
print(f"rank {rank} done", flush=True)
"""


def test_down_orphans_through_the_server_is_an_admins_and_sweeps_the_servers_machine(server, home, monkeypatch):
    """``down --orphans`` with a server configured: the server sweeps its own state and providers
    (here: a node process of its home whose job no state knows); a plain user is refused."""
    t = tokens("alice", admin="admin1")
    tags = {"SFTCTL_JOB_ID": "ghost-0001", "SFTCTL_NODE_ID": "ghost-0001-n0", "SFTCTL_NODE_HOME": str(home.resolve())}
    ghost = subprocess.Popen(["sleep", "300"], env={**os.environ, **tags}, start_new_session=True)
    try:
        as_user(monkeypatch, server, t["alice"])
        proc = sftctl("down", "--orphans")
        assert proc.returncode == 2 and no_traceback(proc), proc.stderr
        assert proc.stderr.splitlines()[0] == "error: down --orphans: alice is not an admin of this server"
        assert ghost.poll() is None
        as_user(monkeypatch, server, t["admin1"])
        proc = sftctl("down", "--orphans", "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert "local" in doc["checked"], doc
        assert "local: ghost-0001 (unknown job): removed 1 resource(s)" in doc["orphans"], doc
        assert ghost.wait(timeout=30) is not None
    finally:
        if ghost.poll() is None:
            ghost.kill()


def loop_job(tmp_path: Path, steps: int, replay: Path | None = None) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "loop.py").write_text(LOOP.replace("STEPS", str(steps)))
    env = {"WORK": str(work)}
    if replay is not None:
        env.update(SFTCTL_TELEMETRY_REPLAY=str(replay), SFTCTL_TELEMETRY_REPLAY_RANK="1")
    spec = tmp_path / "loop.yaml"
    spec.write_text(f"name: loop\nworkdir: {work}\nresources: {{nodes: 2}}\n"
                    f"health: {{enabled: true, interval_s: 0.5}}\nrecovery: {{max_restarts: 1}}\n"
                    f"env: {json.dumps(env)}\nrun: python loop.py\n")
    return spec


def xid79_at_step(path: Path, step: int) -> Path:
    """tests/fixtures/xid79.jsonl with its first XID record held until training reached ``step``."""
    records = [json.loads(line) for line in (REPO / "tests/fixtures/xid79.jsonl").read_text().splitlines() if line]
    first = next(i for i, r in enumerate(records) if r.get("xids"))
    records[first]["at_step"] = step
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def server_on(state_backend, server):
    """conftest's ``server`` on each state backend: SQLite in $SFTCTL_HOME, then a real Postgres
    (``state_backend`` is named first, so its SFTCTL_STATE_URL is set before the server starts)."""
    return server


def test_the_laptop_closes_and_the_server_recovers_the_job(server_on, state_backend, tmp_path, monkeypatch):
    from sftctl import api

    server = server_on
    t = tokens("alice", "bob")
    spec = loop_job(tmp_path, steps=30, replay=xid79_at_step(tmp_path / "xid79.jsonl", 5))
    as_user(monkeypatch, server, t["alice"])
    client = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(spec)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    job = wait_for(lambda: next((v.id for v in api.status() if v.status.value == "RUNNING"), None), timeout_s=120,
                   what="the submitted job to run")
    wait_for(lambda: (tmp_path / "work" / "ckpt-1").exists(), timeout_s=60, what="rank 1 to step")
    os.killpg(client.pid, signal.SIGKILL)  # the laptop closes
    client.wait(timeout=30)
    killed_at = time.time()
    (tmp_path / "work" / "go").touch()  # training goes on past step 3: the fault comes at step 5

    # the controller records the end, then brings the nodes down: the view `wait` returns is the
    # one with every node down (comparing with a view read at the recorded end raced the teardown)
    view = wait_for(lambda: (v := api.status(job)).status.terminal and _nodes_down(v) and v, timeout_s=240 + WAIT_TEARDOWN_S,
                    what="the job to end and its nodes to come down", report=lambda: _node_rows(job))
    assert view.status.value == "SUCCEEDED", view.failure_reason
    assert [n.status.value for n in view.nodes] == ["TERMINATED", "REPLACED", "TERMINATED"], _node_rows(job)
    evs = api.events(job)
    health = [e for e in evs if e.kind == "health"]
    assert health and health[0].data["node_rank"] == 1 and health[0].data["action"] == "replace", health
    assert health[0].ts > killed_at  # found and acted on with no client attached
    assert [n.rank for n in view.nodes] == [0, 1, 1] and view.record.restarts == 1
    logs = "\n".join(line.text for line in api.logs(job))
    assert "rank 1 resumes from 0" in logs and "rank 1 done" in logs
    resumed = [int(w.split()[-1]) for w in logs.splitlines() if w.startswith("rank 1 resumes from") and not w.endswith(" 0")]
    assert resumed and resumed[0] >= 4, logs  # from its checkpoint, not from the start

    proc = sftctl("wait", job, "--json")  # a client back after the job ended: same exit code and document
    assert proc.returncode == 0 and json.loads(proc.stdout)["jobs"][0]["status"] == "SUCCEEDED"
    assert json.loads(proc.stdout)["jobs"][0] == view.to_dict()

    as_user(monkeypatch, server, t["bob"])  # a second user sees nothing of it
    assert api.status() == []
    assert sftctl("wait", job).returncode == 2
    proc = sftctl("status", "--json", check=True)
    assert json.loads(proc.stdout) == {"jobs": []}


def test_the_server_killed_mid_job_restarts_and_the_job_succeeds_once(server, tmp_path, monkeypatch):
    from sftctl import api

    t = tokens("alice")
    spec = loop_job(tmp_path, steps=12)
    as_user(monkeypatch, server, t["alice"])
    job = api.run(str(spec), detach=True).id
    wait_for(lambda: (tmp_path / "work" / "ckpt-1").exists() and int((tmp_path / "work" / "ckpt-1").read_text() or 0) >= 3,
             timeout_s=120, what="rank 1 to reach step 3")
    controller = api.status(job).record.controller_pid
    server.kill()
    from sftctl import procs

    node_ids = set(procs.tag_values("SFTCTL_NODE_ID").values()) & {n.id for n in _nodes(job)}
    assert len(node_ids) == 2  # both nodes live on without the server
    server.start()  # reconciles: the job's controller lives on (a session of its own), nothing is started twice
    assert "reconciled: 0 job(s) given a controller" in server.log.read_text()
    (tmp_path / "work" / "go").touch()  # the job waited at step 3 for the restart
    view = wait_for(lambda: (v := api.status(job)).status.terminal and v, timeout_s=180, what="the job to end")
    assert view.status.value == "SUCCEEDED", view.failure_reason
    assert view.record.controller_pid == controller and view.record.restarts == 0
    assert sorted(n.rank for n in view.nodes) == [0, 1]  # the provider's nodes: two, never replaced
    assert node_ids == {n.id for n in view.nodes}


def _nodes_down(view) -> bool:
    """Whether every node of the job is down: TERMINATED, or REPLACED (terminated when replaced;
    a replaced node's record never becomes TERMINATED), as ``sftctl wait`` judges it."""
    return all(n.status.value in ("TERMINATED", "REPLACED") for n in view.nodes)


def _node_rows(job: str) -> str:
    from sftctl import api

    return "\n".join(f"node {n.rank} {n.id}: {n.status.value}" for n in api.status(job).nodes) + "\n" + "\n".join(
        f"{e.kind}: {e.message}" for e in api.events(job))


def _nodes(job: str):
    from sftctl.state import Store

    return Store().nodes(job)


def test_the_kubernetes_manifest_is_a_valid_deployment_service_and_secret(home, monkeypatch):
    """``sftctl server manifest --kubernetes``: three objects, each valid against Kubernetes'
    schema (kubernetes-validate, strict); the Deployment's probe and Service target its port."""
    import kubernetes_validate
    import yaml

    from k8s_emulator import SCHEMA_VERSION
    from sftctl.server.manifest import kubernetes

    proc = sftctl("server", "manifest", "--kubernetes", "--port", "9000", "--namespace", "lab", check=True)
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert [d["kind"] for d in docs] == ["Secret", "Deployment", "Service"]
    for d in docs:
        kubernetes_validate.validate(d, SCHEMA_VERSION, strict=True)
        assert d["metadata"]["namespace"] == "lab"
    secret, deploy, service = docs
    [c] = deploy["spec"]["template"]["spec"]["containers"]
    assert c["command"][-4:] == ["--host", "0.0.0.0", "--port", "9000"] and c["ports"][0]["containerPort"] == 9000
    assert c["readinessProbe"]["httpGet"]["path"] == "/v1/health"
    assert c["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert service["spec"]["ports"][0]["port"] == 9000 and service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    with_secret = [d for d in yaml.safe_load_all(kubernetes(secrets={"WANDB_API_KEY": "k\"ey"})) if d][0]
    kubernetes_validate.validate(with_secret, SCHEMA_VERSION, strict=True)
    import base64

    assert base64.b64decode(with_secret["data"]["WANDB_API_KEY"]).decode() == "k\"ey"


def test_the_systemd_unit_runs_this_sftctl_and_leaves_controllers_running(home):
    proc = sftctl("server", "manifest", "--systemd", "--port", "9001", check=True)
    unit = proc.stdout
    [start] = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    assert start.startswith(f"ExecStart={sys.executable} ") and start.endswith("server start --host 0.0.0.0 --port 9001")
    assert "KillMode=process" in unit and f"SFTCTL_HOME={home}" in unit
    assert sftctl("server", "manifest").returncode == 2


def test_ctrl_c_of_an_attached_run_leaves_the_job_to_the_server(server, tmp_path, monkeypatch):
    from sftctl import api

    t = tokens("alice")
    as_user(monkeypatch, server, t["alice"])
    spec = tmp_path / "sleeper.yaml"
    spec.write_text(SLEEPER)
    out_path, err_path = tmp_path / "client.out", tmp_path / "client.err"
    with open(out_path, "w") as out, open(err_path, "w") as errf:
        client = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(spec)], cwd=REPO,
                                  stdout=out, stderr=errf, text=True)
    job = wait_for(lambda: next((v.id for v in api.status() if v.status.value == "RUNNING"), None), timeout_s=90,
                   what="the job to run")
    # the client follows the job once it shows the node's first line: a Ctrl-C before that came
    # while it still asked the server to start the job (RUNNING there, the answer on its way)
    wait_for(lambda: "started" in out_path.read_text() + err_path.read_text() or client.poll() is not None,
             timeout_s=90, what="the client to follow the job's logs")
    client.send_signal(signal.SIGINT)
    client.wait(timeout=deadline(60))
    err = err_path.read_text()
    # once (a fresh clone's .ci/run beside another suite) this exited 4 with its stderr unseen:
    # the message carries the client's stderr and the server log's tail now
    seen = f"client stderr:\n{err}\nserver log:\n{server.log.read_text()[-3000:]}"
    assert client.returncode == 130 and "Traceback" not in err, seen
    # the good outcome said plainly, not as an error (issue 37)
    assert f"{job} goes on, supervised by the server: sftctl logs -f {job} watches it again" in err, seen
    assert "error:" not in err, seen
    assert api.status(job).status.value == "RUNNING"
    assert api.down(job)[0].status == "CANCELLED"


STEPPER = """\
import time
from sftctl.train import report
for step in range(1, 13):
    report(step=step, loss=1.0 / step)
    time.sleep(0.4)
print("stepper done", flush=True)
"""


def test_an_attached_run_through_the_server_shows_status_steps_and_loss(server, tmp_path, monkeypatch):
    """``sftctl run`` attached through a server reports as a local attached run: the status
    lines, the bar at the last step with its loss, and the loss summary (issue 37: the bar stayed
    at ``pending 0/12 loss -`` after SUCCEEDED; only log lines came through)."""
    t = tokens("alice")
    as_user(monkeypatch, server, t["alice"])
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "stepper.py").write_text(STEPPER)
    spec = tmp_path / "work" / "stepper.yaml"
    spec.write_text("name: stepper\nresources: {nodes: 1}\ntrain: {steps: 12}\nrun: python stepper.py\n")
    proc = sftctl("run", str(spec), env={**os.environ, "COLUMNS": "120"})
    seen = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nserver log:\n{server.log.read_text()[-3000:]}"
    assert proc.returncode == 0 and no_traceback(proc), seen
    out = proc.stdout.splitlines()
    assert "(node 0) stepper done" in out, seen
    events = [ln[2:] for ln in out if ln.startswith("▸ ")]
    assert "PROVISIONING" in events and "RUNNING" in events and "SUCCEEDED" in events, seen
    assert events.index("PROVISIONING") < events.index("RUNNING") < events.index("SUCCEEDED"), seen
    [bar] = [ln for ln in out if "12/12" in ln]
    assert bar.split()[0] == "succeeded" and "loss 0.0833" in bar, seen
    [summary] = [ln for ln in out if ln.endswith("(mean over ranks)")]
    assert " SUCCEEDED in " in summary and summary.endswith(", loss 1.0000 -> 0.0833 (mean over ranks)"), seen


def test_a_port_in_use_is_one_line(server):
    proc = sftctl("server", "start", "--port", str(server.port))
    assert proc.returncode == 2 and no_traceback(proc)
    assert proc.stderr.startswith(f"error: sftctl server: cannot listen on 127.0.0.1:{server.port}: ")


def test_secrets_travel_by_name_the_owners_store_holds_their_values(home, tmp_path, monkeypatch):
    """A spec's ``secrets:`` name a variable; the node gets its owner's stored value of it
    (``sftctl secret set``), never the server's environment's nor the client's (which the request
    does not carry); one the owner has not set is refused, exit 2 (issue 40: was the server's
    environment for every user)."""
    server = Server(home, tmp_path / "server.log", env={"LAB_TOKEN": "the-servers-value"}).start()
    try:
        from sftctl import api

        t = tokens("alice")
        as_user(monkeypatch, server, t["alice"])
        monkeypatch.setenv("LAB_TOKEN", "alices-shell-value")
        api.secret_set("LAB_TOKEN", "alices-stored-value")
        (tmp_path / "work").mkdir()
        spec = tmp_path / "work" / "secret.yaml"
        spec.write_text('name: secret\nsecrets: [LAB_TOKEN]\nresources: {nodes: 1}\n'
                        'run: \'echo "token=$LAB_TOKEN"\'\n')
        proc = sftctl("run", str(spec), "--json")
        assert proc.returncode == 0, proc.stderr
        job = json.loads(proc.stdout)["id"]
        assert [line.text for line in api.logs(job) if line.text.startswith("token=")] == ["token=alices-stored-value"]
        spec.write_text(spec.read_text().replace("LAB_TOKEN]", "LAB_TOKEN, NOT_ON_THE_SERVER]"))
        monkeypatch.setenv("NOT_ON_THE_SERVER", "x")
        proc = sftctl("run", str(spec), "--detach")
        assert proc.returncode == 2 and no_traceback(proc)
        assert (f"error: {spec}: secrets: NOT_ON_THE_SERVER is not one of alice's secrets on this server "
                "(nor the lab's)") in proc.stderr
    finally:
        server.stop()


def test_the_server_and_its_controller_killed_restart_adopts_the_job(state_backend, home, tmp_path, monkeypatch):
    """The server's machine loses its processes (the server and the job's controller, kill -9;
    the local guard stops the nodes): the restarted server gives the job a new controller, which
    adopts it from state (on Postgres once the dead controller's lease expired: 5 s here). It
    SUCCEEDS, and the provider never has more than one live node per rank."""
    import threading

    from sftctl import api, procs
    from sftctl.providers.local import LocalProvider

    monkeypatch.setenv("SFTCTL_STATE_LEASE_S", "5")
    server = Server(home, tmp_path / "server.log").start()
    t = tokens("alice")
    spec = loop_job(tmp_path, steps=12)
    as_user(monkeypatch, server, t["alice"])
    job = api.run(str(spec), detach=True).id
    provider = LocalProvider()
    seen: list[int] = []
    done = threading.Event()

    def count():  # the nodes with live processes at the provider, every 0.3 s, until the test ends
        while not done.is_set():
            seen.append(len({r["node_id"] for r in provider.list_instances(job) if r["node_id"]}))
            time.sleep(0.3)

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    try:
        wait_for(lambda: int((tmp_path / "work" / "ckpt-1").read_text() or 0) >= 3
                 if (tmp_path / "work" / "ckpt-1").exists() else False, timeout_s=120, what="rank 1 to reach step 3")
        controller = api.status(job).record
        server.kill()
        os.kill(controller.controller_pid, signal.SIGKILL)
        wait_for(lambda: not procs.alive(controller.controller_pid, controller.controller_start_ticks), what="the kill")
        server.start()
        wait_for(lambda: f"controller of {job} started" in server.log.read_text(), timeout_s=60,
                 what="the restarted server to give the job a controller")
        (tmp_path / "work" / "go").touch()
        # ended and torn down: a node's processes may outlive the end it recorded by a moment
        # (its guard's exit); the controller's teardown ends whatever is left
        view = wait_for(lambda: (v := api.status(job)).status.terminal and _nodes_down(v) and v,
                        timeout_s=180 + WAIT_TEARDOWN_S, what="the job to end and its nodes to come down",
                        report=lambda: _node_rows(job))
        assert view.status.value == "SUCCEEDED", view.failure_reason
        assert view.record.controller_pid != controller.controller_pid
        assert [e for e in api.events(job) if e.kind == "adopt"], [e.kind for e in api.events(job)]
    finally:
        done.set()
        counter.join()
        server.stop()
    assert max(seen) == 2, seen  # never a duplicate node at the provider
    assert sorted({n.rank for n in view.nodes}) == [0, 1]
    # recorded down, a node's processes may still be on their way out (its guard's exit): give them the time
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end",
             report=lambda: process_report(job))


def test_two_servers_on_one_postgres_one_controller_per_job(postgres, pg_url, home, tmp_path, monkeypatch):
    """Two servers, each with a home of its own (two machines: no file lock in common), share one
    Postgres. A job submitted to the first has its one controller there; the second shows it to
    its user (one place for the team's jobs) and, through reconciliations while it runs, never
    starts a controller for it (the controller's lease in the database)."""
    import httpx

    from sftctl import api

    a = Server(home, tmp_path / "a.log").start()
    b = Server(tmp_path / "home-b", tmp_path / "b.log", env={"SFTCTL_HOME": str(tmp_path / "home-b")}).start()
    try:
        t = tokens("alice")  # the users are the database's: one token for both servers
        spec = loop_job(tmp_path, steps=6)
        as_user(monkeypatch, a, t["alice"])
        job = api.run(str(spec), detach=True).id
        wait_for(lambda: (tmp_path / "work" / "ckpt-1").exists(), timeout_s=120, what="the job to step")
        started = [ln for ln in a.log.read_text().splitlines() if f"controller of {job} started" in ln]
        assert len(started) == 1
        rounds = httpx.get(f"{b.url}/v1/health").json()["reconciles"]
        wait_for(lambda: httpx.get(f"{b.url}/v1/health").json()["reconciles"] >= rounds + 2, timeout_s=60,
                 what="two reconciliations on the second server while the job runs")
        as_user(monkeypatch, b, t["alice"])
        assert [v.id for v in api.status()] == [job] and api.status(job).status.value == "RUNNING"
        (tmp_path / "work" / "go").touch()
        view = wait_for(lambda: (v := api.status(job)).status.terminal and v, timeout_s=120, what="the job to end")
        assert view.status.value == "SUCCEEDED", view.failure_reason
        assert f"started (pid {view.record.controller_pid})" in started[0]  # the first server's, all along
        assert "controller of" not in b.log.read_text()
    finally:
        b.stop()
        a.stop()


def test_labels_and_overrides_travel_through_the_server(server, tmp_path, monkeypatch):
    """A sweep through a server (issue 37.7): --label and --set reach the server in the spec's
    request; status filters by label and shows the overrides of one job."""
    t = tokens("alice")
    as_user(monkeypatch, server, t["alice"])
    spec = tmp_path / "echo.yaml"
    spec.write_text("name: echo\nresources: {nodes: 1}\nlabels: {team: nlp}\nrun: echo hi\n")
    ids = [json.loads(sftctl("run", str(spec), "--detach", "--json", "--set", f"name=lr-{lr}", "--label", f"lr={lr}",
                             check=True).stdout)["job_id"] for lr in ("0.1", "0.2")]
    sftctl("wait", *ids, check=True)
    only = json.loads(sftctl("status", "--label", "lr=0.2", "--json", check=True).stdout)["jobs"]
    assert [(j["id"], j["labels"]) for j in only] == [(ids[1], {"team": "nlp", "lr": "0.2"})]
    one = json.loads(sftctl("status", ids[0], "--json", check=True).stdout)
    assert one["overrides"] == ["name=lr-0.1", "labels.lr=0.1"] and one["labels"] == {"team": "nlp", "lr": "0.1"}


def test_the_api_answers_an_unknown_route_in_its_own_error_document(server):
    """A client of another version calling a route this server lacks gets the API's error
    document (one line and a hint, as every /v1 error), not FastAPI's ``{"detail": "Not Found"}``."""
    import httpx

    token = tokens("alice")["alice"]
    headers = {"Authorization": f"Bearer {token}"}
    r = httpx.get(f"{server.url}/v1/jobs-of-the-future", headers=headers, timeout=30)
    assert r.status_code == 404
    assert r.json() == {"error": "no such route: GET /v1/jobs-of-the-future",
                        "hint": "sftctl and the server may be different versions (sftctl --version; "
                                "GET /v1/health gives the server's)", "exit_code": 2, "kind": "SftctlError"}
    r = httpx.delete(f"{server.url}/v1/health", headers=headers, timeout=30)
    assert r.status_code == 405 and r.json()["error"] == "method not allowed on: DELETE /v1/health"
    assert httpx.get(f"{server.url}/v1/nope", timeout=30).status_code == 401  # the token still first


def test_a_postgres_outage_is_one_line_in_the_servers_log_not_a_traceback_per_round(postgres, pg_url, home,
                                                                                   tmp_path):
    """Postgres stopped under a running server for two reconcile rounds (10 s each): the log
    says so once and once that it is back; before, every round logged a traceback."""
    log = tmp_path / "server.log"
    server = Server(home, log).start()
    try:
        postgres.stop()
        try:
            # the first round that finds it down (a busy machine's round may come well after 10 s,
            # and a fixed 25 s then saw none), then time for another round that must stay quiet
            wait_for(lambda: "reconcile paused: " in log.read_text(), timeout_s=90,
                     what="a reconcile round to find the state database down", report=lambda: log.read_text()[-3000:])
            time.sleep(RECONCILE_S + 2)
        finally:
            postgres.start()
        wait_for(lambda: "reconcile resumed" in log.read_text(), timeout_s=90, what="the server to reconcile again")
    finally:
        server.stop()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert text.count("reconcile paused: ") == 1 and "cannot connect to the state database" in text, text[-3000:]
    assert text.count("reconcile resumed: the state database answers again") == 1
