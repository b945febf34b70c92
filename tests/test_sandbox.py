"""Issue 40, item 1: a user's job on a server's local nodes never acts as the server.

A real ``sftctl server`` (tests/test_server.py's :class:`Server`) with users alice and bob. Bob's
job sleeps; alice's job tries, from its ``run:``, everything the server could do: add an admin,
cancel bob's job, read state.db, bob's job files and logs and the server's environment, write
into the server's home and sftctl's package; then it plants symlinks where the controller reads
and writes its node directory. Each must fail: said in alice's log and seen in the state after
(no user mallory, bob's job RUNNING, no file written). A quickstart-like two-node job through the
server still trains in the sandbox and resumes from its checkpoint. Where bubblewrap cannot
start, the server refuses a local-node job at submit in one line, unless an admin set the
sandbox off.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, job_processes, no_traceback, sftctl, wait_for
from test_server import Server, as_user, tokens

pytestmark = pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v bwrap"], capture_output=True).returncode != 0,
                                reason="bubblewrap (bwrap) is not installed (.ci/run installs it)")

#: a value only the server's environment holds: a node must never see it
SERVER_SECRET = "server-only-9f3b2a61c0"
PACKAGE = REPO / "sftctl"


@pytest.fixture
def server(home, tmp_path):
    s = Server(home, tmp_path / "server.log", env={"LAB_SERVER_SECRET": SERVER_SECRET}).start()
    yield s
    s.stop()


def _ended(api, job: str, timeout_s: float = 300):
    from sftctl.paths import job_dir

    def report() -> str:  # what the job's controller and nodes said (pytest rotates tmp dirs away)
        logs = [job_dir(job) / "controller.log", *sorted(job_dir(job).glob("nodes/*/node.log"))]
        return "\n".join(f"== {p}\n{p.read_text(errors='replace')[-2000:]}" for p in logs if p.is_file())

    return wait_for(lambda: (v := api.status(job)).status.terminal and v, timeout_s=timeout_s,
                    what=f"job {job} to end", report=report)


def _log(api, job: str) -> str:
    return "\n".join(line.text for line in api.logs(job))


def _spec(path: Path, workdir: Path, run: str, nodes: int = 1, extra: str = "") -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(f"name: {path.stem}\nworkdir: {workdir}\nresources: {{nodes: {nodes}}}\n{extra}"
                    f"run: |\n{textwrap.indent(run, '  ')}")
    return path


ATTACKS = r"""
try() { name=$1; shift; out=$("$@" 2>&1); rc=$?; echo "TRY $name rc=$rc"; printf '%s\n' "$out" | head -c 600 | sed "s/^/OUT $name: /"; }
try useradd sftctl server user add mallory --admin
try down sftctl down @BOB@
try state head -c 64 @HOME@/state.db
try jobs ls -a @HOME@/jobs
try bobdir ls -a @HOME@/jobs/@BOB@
try boblog sh -c 'cat @HOME@/jobs/@BOB@/nodes/*/node.log'
try environ cat /proc/@PID@/environ
try pkgwrite sh -c 'echo pwned > @PKG@/pwned_by_alice.py'
try homewrite sh -c 'echo pwned > @HOME@/pwned_by_alice'
try procs sh -c 'ls /proc | grep -c "^[0-9]"'
echo "ENV-BEGIN"; env; echo "ENV-END"
"""


def _tried(log: str) -> dict[str, tuple[int, str]]:
    """``{name: (exit code, its output)}`` of every ``try`` line in ``log``."""
    out = {}
    for line in log.splitlines():
        if line.startswith("TRY "):
            name, rc = line[4:].split(" rc=")
            out[name] = (int(rc), "\n".join(o.split(": ", 1)[1] for o in log.splitlines()
                                            if o.startswith(f"OUT {name}: ")))
    return out


def test_a_users_job_on_the_servers_local_nodes_cannot_act_as_the_server(server, home, tmp_path, monkeypatch):
    from sftctl import api
    from sftctl.errors import SftctlError
    from sftctl.server.users import list_users

    t = tokens("alice", "bob", admin="admin1")
    as_user(monkeypatch, server, t["bob"])
    bob_spec = _spec(tmp_path / "bobs.yaml", tmp_path / "bob", "echo bob-private-marker\nwhile true; do sleep 1; done\n")
    bob = api.run(str(bob_spec), detach=True).id
    wait_for(lambda: "bob-private-marker" in _log(api, bob), timeout_s=120, what="bob's job to run")
    package_before = sorted(p.name for p in PACKAGE.iterdir())

    as_user(monkeypatch, server, t["alice"])
    run = (ATTACKS.replace("@BOB@", bob).replace("@HOME@", str(home.resolve()))
           .replace("@PID@", str(server.proc.pid)).replace("@PKG@", str(PACKAGE)))
    alice = api.run(str(_spec(tmp_path / "alices.yaml", tmp_path / "alice", run)), detach=True).id
    try:
        view = _ended(api, alice)
        log = _log(api, alice)
        assert view.status.value == "SUCCEEDED", (view.failure_reason, log)
        tried = _tried(log)
        assert {"useradd", "down", "state", "jobs", "bobdir", "boblog", "environ", "pkgwrite", "homewrite",
                "procs"} <= set(tried), log
        # sftctl on the node has no server state: a user it adds is in a throwaway state of the
        # node's own (the token, if it printed one, is refused by the server below)
        down_rc, down_out = tried["down"]
        assert down_rc != 0 and bob in down_out, log  # "no job <bob> ..." on the node's own empty state
        for name in ("state", "bobdir", "boblog", "environ", "pkgwrite", "homewrite"):
            assert tried[name][0] != 0, (name, log)
        assert "SQLite format 3" not in log and "bob-private-marker" not in log, log
        assert bob not in tried["jobs"][1], log  # the server's jobs directory shows only alice's own
        assert int(tried["procs"][1].strip()) < 20, log  # its own processes only, not the machine's
        env = log.split("ENV-BEGIN", 1)[1].split("ENV-END", 1)[0]
        assert SERVER_SECRET not in log, log  # the server's environment never reaches a node
        for name in ("SFTCTL_HOME=", "SFTCTL_STATE_URL=", "SFTCTL_CONFIG=", "SFTCTL_SERVER_", "XDG_CONFIG_HOME="):
            assert f"\n{name}" not in env, (name, env)
        assert f"\nHOME={home}/jobs/{alice}/" in env, env  # a home of the node's own

        # ... and the state says the same: no mallory, bob's job runs on, nothing was written
        assert "mallory" not in [u.name for u in list_users()]
        for token in (w for w in tried["useradd"][1].split() if len(w) >= 32):
            as_user(monkeypatch, server, token)
            with pytest.raises(SftctlError):
                api.status()
        as_user(monkeypatch, server, t["bob"])
        assert api.status(bob).status.value == "RUNNING"
        assert sorted(p.name for p in PACKAGE.iterdir()) == package_before
        assert not list(home.rglob("pwned_by_alice*"))
    finally:
        (PACKAGE / "pwned_by_alice.py").unlink(missing_ok=True)  # today's code wrote it: never leave it
        as_user(monkeypatch, server, t["bob"])
        api.down(bob)
    wait_for(lambda: job_processes(bob) == [], timeout_s=60, what="bob's processes to end")


def test_symlinks_a_node_plants_in_its_directory_are_never_followed_by_the_controller(server, home, tmp_path,
                                                                                       monkeypatch):
    """Attempt 1 replaces its node.log with a symlink to the server's state.db and attempt 2's
    script with a symlink to a file of the server's machine, then fails: the controller reads no
    state.db into alice's logs, and writes attempt 2's script anew instead of through the link."""
    from sftctl import api

    victim = tmp_path / "victim.txt"
    victim.write_text("original\n")
    t = tokens("alice")
    as_user(monkeypatch, server, t["alice"])
    run = textwrap.dedent(f"""\
        if [ "$SFTCTL_ATTEMPT" = 1 ]; then
          ln -sfn {victim} "$SFTCTL_NODE_DIR/node-2.sh"
          ln -sfn {home.resolve()}/state.db "$SFTCTL_NODE_DIR/node.log"
          exit 3
        fi
        echo attempt-2-ran
        """)
    job = api.run(str(_spec(tmp_path / "planter.yaml", tmp_path / "alice", run,
                            extra="recovery: {max_restarts: 1}\n")), detach=True).id
    view = _ended(api, job)
    log = _log(api, job)
    assert "SQLite format 3" not in log, log
    assert victim.read_text() == "original\n"
    assert view.status.value == "SUCCEEDED" and "attempt-2-ran" in log, (view.failure_reason, log)
    node_dir = home / "jobs" / job / "nodes" / view.nodes[0].id
    assert stat.S_ISREG((node_dir / "node-2.sh").lstat().st_mode) and stat.S_ISREG((node_dir / "node.log").lstat().st_mode)


def test_a_directory_job_storage_is_refused_for_sandboxed_nodes_in_one_line(server, home, tmp_path, monkeypatch):
    """The node daemon path (the job has ``storage:``) with a directory storage: the node would
    write where the server's controller reads and writes, following links it planted, so the
    launch is refused, naming the storage and the fix; nothing ran."""
    from sftctl import api

    t = tokens("alice")
    as_user(monkeypatch, server, t["alice"])
    store = tmp_path / "bucket"
    store.mkdir()
    spec = _spec(tmp_path / "stored.yaml", tmp_path / "alice", "echo ran > ran.txt\n",
                 extra=f"storage: {{url: {store}}}\n")
    job = api.run(str(spec), detach=True).id
    view = _ended(api, job)
    assert view.status.value == "FAILED", view
    assert "local node sandbox: the job's storage" in view.failure_reason and "is a directory of this machine" in \
        view.failure_reason, view.failure_reason
    assert not (tmp_path / "alice" / "ran.txt").exists()
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end")


QUICKSTART = REPO / "examples" / "quickstart.yaml"


def test_a_two_node_quickstart_through_the_server_trains_sandboxed_and_resumes(server, home, monkeypatch):
    """The quickstart's two ranks rendezvous on 127.0.0.1 from their sandboxes, checkpoint into
    the job's directory, fail at step 15 and resume from step 10 (its checkpoint)."""
    from sftctl import api

    t = tokens("alice")
    as_user(monkeypatch, server, t["alice"])
    job = api.run(str(QUICKSTART), ["train.steps=30", "train.checkpoint_interval=10",
                                    "env.SFTCTL_FAIL_AT_STEP=15"], detach=True).id
    view = _ended(api, job, timeout_s=600)
    log = _log(api, job)
    assert view.status.value == "SUCCEEDED", (view.failure_reason, log[-3000:])
    assert view.record.restarts == 1, log[-3000:]
    ckpts = sorted(p.name for p in (home / "jobs" / job / "checkpoints").glob("step-*"))
    assert "step-00000030" in ckpts, ckpts
    assert [a.status.value for a in view.attempts] == ["FAILED", "SUCCEEDED"], view.attempts
    assert "resumed from step 10" in log, log[-3000:]
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end")


def _fake_bwrap(tmp_path: Path) -> Path:
    """A directory holding a ``bwrap`` that cannot start (as where user namespaces are off)."""
    d = tmp_path / "fakebin"
    d.mkdir()
    b = d / "bwrap"
    b.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    b.chmod(0o755)
    return d


def test_a_server_without_a_working_bwrap_refuses_local_jobs_at_submit(home, tmp_path, monkeypatch):
    fake = _fake_bwrap(tmp_path)
    server = Server(home, tmp_path / "server.log", env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}).start()
    try:
        t = tokens("alice")
        as_user(monkeypatch, server, t["alice"])
        spec = _spec(tmp_path / "plain.yaml", tmp_path / "alice", "echo hi\n")
        proc = sftctl("run", str(spec), "--detach")
        assert proc.returncode == 2 and no_traceback(proc), proc.stderr
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert errors == [f"error: local nodes of this server run in a sandbox, but {fake}/bwrap cannot start a "
                          f"sandbox: bwrap: No permissions to create new namespace"], proc.stderr
        assert "install bubblewrap" in proc.stderr and "SFTCTL_NODE_SANDBOX=off" in proc.stderr
        from sftctl import api

        assert api.status() == []  # nothing recorded
    finally:
        server.stop()


def test_an_admin_may_set_the_sandbox_off_explicitly(home, tmp_path, monkeypatch):
    """Unsafe, and said so in the server's log: the job then runs as the server (its home)."""
    fake = _fake_bwrap(tmp_path)
    server = Server(home, tmp_path / "server.log", env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
                                                        "SFTCTL_NODE_SANDBOX": "off"}).start()
    try:
        from sftctl import api

        t = tokens("alice")
        as_user(monkeypatch, server, t["alice"])
        job = api.run(str(_spec(tmp_path / "plain.yaml", tmp_path / "alice", 'echo "home=$SFTCTL_HOME"\n')),
                      detach=True).id
        view = _ended(api, job, timeout_s=120)
        assert view.status.value == "SUCCEEDED", view.failure_reason
        assert f"home={home}" in _log(api, job)
        assert "every user's job on this machine's local nodes runs as this server" in (tmp_path / "server.log").read_text()
    finally:
        server.stop()


def test_a_setting_other_than_bwrap_or_off_is_one_line(home):
    from test_server import _free_port

    proc = subprocess.run([sys.executable, "-m", "sftctl.cli", "server", "start", "--port", str(_free_port())],
                          env={**os.environ, "SFTCTL_NODE_SANDBOX": "firejail"}, capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2 and no_traceback(proc), proc.stderr
    assert "SFTCTL_NODE_SANDBOX" in proc.stderr and "bwrap or off" in proc.stderr, proc.stderr


def test_the_node_environment_and_binds_keep_nothing_of_the_servers(home, tmp_path, monkeypatch):
    """The pieces, without a server: the scrubbed environment and the refused binds."""
    from sftctl.errors import ProviderError
    from sftctl.paths import job_dir
    from sftctl.providers import sandbox

    monkeypatch.setenv("SFTCTL_STATE_URL", "postgresql://lab:pw@db/sftctl")
    monkeypatch.setenv("SFTCTL_SERVER_TOKEN", "tok")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("KUBECONFIG", "/root/.kube/config")
    monkeypatch.setenv("SFTCTL_HEARTBEAT_S", "0.5")  # a node setting: kept
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    env = sandbox.node_environ({"MY_VAR": "1", "SFTCTL_NODE_RANK": "0"}, home=tmp_path / "nodehome")
    assert {k for k in env if k.startswith(("SFTCTL_STATE", "SFTCTL_SERVER", "SFTCTL_HOME", "AWS_", "KUBE"))} == set()
    assert env["MY_VAR"] == "1" and env["SFTCTL_HEARTBEAT_S"] == "0.5" and env["LC_ALL"] == "C.UTF-8"
    assert env["HOME"] == str(tmp_path / "nodehome") and "PATH" in env

    job_dir("j-1").mkdir(parents=True)
    for path, _what in ((home, "the home"), (home / "jobs" / "j-2", "another job's dir"), (Path("/"), "the root"),
                       (Path("/tmp"), "all of /tmp")):
        with pytest.raises(ProviderError, match="local node sandbox: workdir"):
            sandbox.check_bind(path, "j-1", "workdir")
    ok = job_dir("j-1") / "checkpoints"
    assert sandbox.check_bind(ok, "j-1", "checkpoint directory") == ok.resolve()
    assert sandbox.check_bind(tmp_path / "work", "j-1", "workdir") == (tmp_path / "work").resolve()

    # a workdir that holds the server's home (a spec beside it) is given, with the home hidden again inside it
    (home / "state.db").write_bytes(b"SQLite format 3\0")
    binds = sandbox.Binds()
    binds.add(tmp_path, "j-1", "workdir")
    binds.add(job_dir("j-1") / "nodes" / "n0", "j-1", "node directory", create=True)
    opts = sandbox.options(binds, tags={}, chdir=tmp_path)
    h, w, n = str(home.resolve()), str(tmp_path.resolve()), str((job_dir("j-1") / "nodes" / "n0").resolve())
    at = {a: opts.index(a) for a in (h, w, n)}
    assert opts[at[h] - 1] == "--tmpfs"
    # a bind of the job's is the descriptor pinned when it was checked, never its path again
    assert [opts[at[p] - 2:at[p]] for p in (w, n)] == [["--bind", f"/proc/self/fd/{binds.fds[Path(p)]}"] for p in (w, n)]
    assert at[w] < at[h] < at[n], opts  # workdir, then the home hidden in it, then the node's own dir back
    with sandbox.wrap(["sh", "-c", f"ls -A {h}; test ! -e {h}/state.db"], binds, tags={}, chdir=tmp_path) as cmd:
        assert not {h, w, n} & set(cmd.argv), cmd.argv  # the options travel on a descriptor, not the command line
        proc = subprocess.run(cmd.argv, capture_output=True, text=True, pass_fds=cmd.pass_fds)
    assert proc.stdout.split() == ["jobs"], proc.stderr
