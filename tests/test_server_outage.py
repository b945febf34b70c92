"""A client following a job (``sftctl wait``, ``logs -f``, an attached ``run``) rides out a server
restart; after ``server.retry_s`` it exits 75 saying the job goes on. A state database outage
reaches a user as 503 and one line (never the database's URL), and ``/v1/health`` reports it."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, deadline, wait_for
from test_server import as_user, tokens

#: waits at its first line until ``go`` appears in its workdir, then prints "done"
GATED = "name: gated\nworkdir: {work}\nresources: {{nodes: 1}}\nrun: |\n  echo started\n" \
        "  while [ ! -f go ]; do sleep 0.2; done\n  echo done\n"

RETRYING = "server unreachable, retrying; the job goes on on the server"


def _gated_job(tmp_path, monkeypatch, server) -> str:
    from sftctl import api

    work = tmp_path / "work"
    work.mkdir()
    spec = tmp_path / "gated.yaml"
    spec.write_text(GATED.format(work=work))
    as_user(monkeypatch, server, tokens("alice")["alice"])
    job = api.run(str(spec), detach=True).id
    wait_for(lambda: any("started" in line.text for line in api.logs(job)), timeout_s=120, what="the job to start")
    return job


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    import os

    return subprocess.Popen([sys.executable, "-m", "sftctl.cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def test_wait_and_logs_follow_ride_out_a_server_restart(server, tmp_path, monkeypatch):
    job = _gated_job(tmp_path, monkeypatch, server)
    waiter = _cli("wait", job)
    follower = _cli("logs", "-f", job)
    wait_for(lambda: (tmp_path / "server.log").exists(), what="the server's log")
    import time

    time.sleep(deadline(3))  # both are following (not a timed assertion: only an overlap with the outage)
    server.kill()
    time.sleep(deadline(3))  # the server is down for a few of wait's polls
    (tmp_path / "work" / "go").touch()  # the job ends while the server is down (its controller lives on)
    server.start()
    out, err = waiter.communicate(timeout=deadline(180))
    assert waiter.returncode == 0, (out, err)
    assert out.split() == [job, "SUCCEEDED"], out
    assert err.count(RETRYING) == 1 and "cannot be reached" not in err, err
    out, err = follower.communicate(timeout=deadline(180))
    assert follower.returncode == 0, (out, err)
    assert out.splitlines() == ["[sftctl] node 0: run (attempt 1)", "started", "done",  # resumed where it was:
                                "[sftctl] node 0: run exited with code 0"], out  # no line twice, none lost
    assert err.count(RETRYING) == 1, err


def test_an_attached_run_rides_out_a_server_restart_and_exits_with_the_jobs_code(server, tmp_path, monkeypatch):
    from sftctl import api

    work = tmp_path / "work"
    work.mkdir()
    spec = tmp_path / "gated.yaml"
    spec.write_text(GATED.format(work=work).replace("echo done", "echo done; exit 3"))
    as_user(monkeypatch, server, tokens("alice")["alice"])
    run = _cli("run", str(spec))
    job = wait_for(lambda: next((v.id for v in api.status() if any("started" in x.text for x in api.logs(v.id))), None),
                   timeout_s=120, what="the attached job to start")
    server.kill()
    import time

    time.sleep(deadline(3))  # down for a few of the follower's reads
    (work / "go").touch()
    server.start()
    out, err = run.communicate(timeout=deadline(180))
    assert run.returncode == 1 and api.status(job).status.value == "FAILED", (out, err)  # the job's own outcome
    assert err.count(RETRYING) == 1 and "cannot be reached" not in err, err
    assert (out + err).count("done") == 1, (out, err)  # its log, resumed: no line twice


def test_past_the_retry_window_wait_exits_75_saying_the_job_goes_on(server, tmp_path, monkeypatch):
    from sftctl import api

    job = _gated_job(tmp_path, monkeypatch, server)
    ended = api.run(str(tmp_path / "gated.yaml"), ["run=echo quick"], detach=True).id
    api.wait(ended)
    waiter = _cli("wait", ended, job, env={"SFTCTL_SERVER_RETRY_S": "2"})
    assert waiter.stdout.readline().split() == [ended, "SUCCEEDED"]  # both resolved: now it waits for `job`
    server.kill()
    out, err = waiter.communicate(timeout=deadline(120))
    assert waiter.returncode == 75, (out, err)
    assert err.count(RETRYING) == 1 and f"job {job} goes on" in err, err
    assert f"hint: sftctl wait {job} or sftctl logs -f {job} follows it again" in err, err
    follower = _cli("logs", "-f", job, env={"SFTCTL_SERVER_RETRY_S": "2"})  # down from its start: 75 too
    out, err = follower.communicate(timeout=deadline(120))
    assert follower.returncode == 75 and err.count(RETRYING) == 1 and f"job {job} goes on" in err, (out, err)
    server.start()
    (tmp_path / "work" / "go").touch()
    waiter = _cli("wait", "--json", job)
    out, err = waiter.communicate(timeout=deadline(180))
    assert waiter.returncode == 0 and json.loads(out)["jobs"][0]["status"] == "SUCCEEDED", (out, err)


UNAVAILABLE = "the server's database is unavailable; try again shortly"


def test_a_database_outage_is_503_one_line_without_its_url_and_health_says_so(postgres, pg_url, server,
                                                                              tmp_path, monkeypatch):
    import httpx

    from conftest import sftctl

    token = tokens("alice")["alice"]
    as_user(monkeypatch, server, token)
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{server.url}/v1/health", timeout=30).json()["database"] == "up"
    postgres.stop()
    try:
        r = httpx.get(f"{server.url}/v1/jobs", headers=auth, timeout=60)
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, (r.status_code, r.text)
        assert r.json()["error"] == UNAVAILABLE and r.json()["hint"] is None, r.text
        assert "postgres" not in r.text and "sftctl-pg" not in r.text, r.text  # no URL, no socket path
        proc = sftctl("status", "--json")
        assert proc.returncode == 4 and proc.stderr.splitlines() == [f"error: {UNAVAILABLE}"], proc.stderr
        assert json.loads(proc.stdout)["error"] == UNAVAILABLE  # --json: still one document
        health = httpx.get(f"{server.url}/v1/health", timeout=60)
        assert health.status_code == 503 and health.json()["ok"] is False, health.text
        assert health.json()["database"] == "down" and "postgresql" not in health.text, health.text
        live = httpx.get(f"{server.url}/v1/health", params={"live": "true"}, timeout=60)  # a liveness probe's
        assert live.status_code == 200 and live.json()["ok"] is True, live.text
    finally:
        postgres.start()
    log = (tmp_path / "server.log").read_text()
    assert "state database" in log and "Traceback" not in log, log[-3000:]  # the details: in the server's log
    health = httpx.get(f"{server.url}/v1/health", timeout=60)
    assert health.status_code == 200 and health.json()["ok"] is True and health.json()["database"] == "up"


def test_wait_json_against_a_server_that_never_comes_up_exits_75_naming_it(home):
    import os

    from conftest import sftctl
    from test_server import _free_port

    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    env = {**os.environ, "SFTCTL_SERVER_URL": url, "SFTCTL_SERVER_TOKEN": "t", "SFTCTL_SERVER_RETRY_S": "1"}
    proc = sftctl("wait", "--json", "j-1", "j-2", timeout=120, env=env)
    assert proc.returncode == 75, (proc.stdout, proc.stderr)
    doc = json.loads(proc.stdout)  # one document, as a job lost mid-wait gives
    assert doc["exit_code"] == 75 and doc["jobs"] == [] and doc["running"] == ["j-1", "j-2"], doc
    assert doc["error"].startswith(f"the sftctl server at {url} cannot be reached: "), doc
    assert doc["error"].endswith("; gave up after 1 s (server.retry_s)"), doc
    assert "sftctl server start" in doc["hint"] and doc["hint"].endswith("; then sftctl wait j-1 j-2"), doc
    assert proc.stderr.splitlines() == [RETRYING, f"error: {doc['error']}", f"hint: {doc['hint']}"], proc.stderr


def test_wait_started_while_the_server_is_down_waits_once_it_is_back(server, tmp_path, monkeypatch):
    from sftctl import api

    job = _gated_job(tmp_path, monkeypatch, server)
    server.kill()
    waiter = _cli("wait", job)
    assert waiter.stderr.readline().rstrip("\n") == RETRYING  # it retries, where it exited 4
    server.start()
    (tmp_path / "work" / "go").touch()
    out, err = waiter.communicate(timeout=deadline(180))
    assert waiter.returncode == 0, (out, err)
    assert out.split() == [job, "SUCCEEDED"] and "error" not in err, (out, err)
    assert api.status(job).status.value == "SUCCEEDED"


def _silent_server() -> tuple[str, list, "threading.Event"]:  # noqa: F821 - a string annotation
    """A socket server (a daemon thread) that accepts every connection and never answers: its
    URL, the accepted sockets (kept open) and an event that stops it."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    accepted: list = []
    stop = threading.Event()

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    accepted.append(listener.accept()[0])
                except TimeoutError:
                    continue
            for s in accepted:
                s.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", accepted, stop


def test_logs_follow_gives_up_on_a_server_that_accepts_and_never_answers(home, monkeypatch, caplog):
    import threading

    from sftctl import api, remote

    url, accepted, stop = _silent_server()
    monkeypatch.setenv("SFTCTL_SERVER_URL", url)
    monkeypatch.setenv("SFTCTL_SERVER_TOKEN", "t")
    # a window of 6 reads of 1 s: on a busy machine (a full CI run) a 2 s window held one read only
    monkeypatch.setenv("SFTCTL_SERVER_RETRY_S", "6")
    monkeypatch.setattr(remote, "FOLLOW_READ_S", 1.0)
    monkeypatch.setattr(remote, "RETRY_FIRST_S", 0.05)
    raised: list = []

    def follow() -> None:
        try:
            list(api.logs("j-1", follow=True))
        except Exception as e:  # noqa: BLE001 - the test reads it
            raised.append(e)

    try:
        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        follower.join(deadline(120))  # a bound on a hang, not a timing: 1 s reads, a 6 s window
        assert not follower.is_alive(), "logs -f still waits on a server that never answers"
    finally:
        stop.set()
    [e] = raised
    assert isinstance(e, remote.ServerLost) and e.exit_code == 75 and e.job == "j-1", repr(e)
    assert e.message == (f"the sftctl server at {url} accepted the connection but did not answer for 1 s; "
                         "gave up after 6 s (server.retry_s): job j-1 goes on, supervised by the server"), e.message
    assert len(accepted) >= 2, accepted  # it asked again within the window
    assert [r.getMessage() for r in caplog.records if r.name == "sftctl.remote"] == [RETRYING]


def test_a_follow_of_a_quiet_job_gets_keep_alive_lines(server, tmp_path, monkeypatch):
    import os

    import httpx

    job = _gated_job(tmp_path, monkeypatch, server)  # writes "started", then nothing until go
    headers = {"Authorization": f"Bearer {os.environ['SFTCTL_SERVER_TOKEN']}"}  # its owner's
    with httpx.stream("GET", f"{server.url}/v1/jobs/{job}/logs", params={"follow": True}, headers=headers,
                      timeout=httpx.Timeout(deadline(60))) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["text"] == "[sftctl] node 0: run (attempt 1)"
        assert json.loads(next(lines))["text"] == "started"
        assert next(lines) == ""  # within the read timeout: the server says it is there
    (tmp_path / "work" / "go").touch()


def test_logs_follow_tells_of_an_outage_once_however_often_the_server_answers_and_goes_silent(home, monkeypatch,
                                                                                                 caplog):
    """A server that answers the request and then says nothing, over and over, is one outage (one
    notice) until a line comes; one after that line is another."""
    from sftctl import remote

    monkeypatch.setenv("SFTCTL_SERVER_RETRY_S", "600")
    monkeypatch.setattr(remote, "RETRY_FIRST_S", 0.001)
    client = remote.Client("http://127.0.0.1:9", "t")

    def silent_after(*lines: dict):
        yield from lines
        raise remote.Unreachable("silent", hint=None)

    def down():
        raise remote.Unreachable("refused", hint=None)

    a, b = {"text": "a", "rank": 0}, {"text": "b", "rank": 0}
    opens = iter([down, lambda: silent_after(), down, lambda: silent_after(None), down, lambda: silent_after(a),
                  down, lambda: iter([a, b])])  # a refused open, an open that answers and then nothing ...
    monkeypatch.setattr(client, "_stream", lambda path, params, read_s: next(opens)())
    texts = [d["text"] for d in client.follow_lines("j-1", "/v1/jobs/j-1/logs", {"follow": True})]
    assert texts == ["a", "b"]  # resumed: "a" once
    told = [r.getMessage() for r in caplog.records if r.name == "sftctl.remote"]
    assert told == [remote.RETRYING] * 3, told  # the first outage, one after a keep-alive, one after "a"


def test_wait_json_timeout_rides_out_a_server_lost_at_the_timeout(home, monkeypatch, capsys, caplog):
    """At --timeout, wait --json reads every job's status as it waited, riding out the server:
    one lost then is exit 75 with its document, not one unretried request's exit 4."""
    from sftctl import api
    from sftctl.cli import main
    from test_server import _free_port

    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there: the server is gone at the timeout
    monkeypatch.setenv("SFTCTL_SERVER_URL", url)
    monkeypatch.setenv("SFTCTL_SERVER_TOKEN", "t")
    monkeypatch.setenv("SFTCTL_SERVER_RETRY_S", "1")
    monkeypatch.setattr(api, "job_ids", lambda jobs: list(jobs))  # resolved while it answered

    def timed_out(job: str, *, timeout_s: float | None = None):
        raise TimeoutError(f"job {job} is still RUNNING after {timeout_s:.3g} s")  # as api.wait's, it answering

    monkeypatch.setattr(api, "wait", timed_out)
    code = main(["wait", "--timeout", "0", "--json", "j-1", "j-2"])
    out = capsys.readouterr().out
    assert code == 75, out
    doc = json.loads(out)  # one document
    assert doc["exit_code"] == 75 and doc["jobs"] == [] and doc["running"] == ["j-1", "j-2"], doc
    assert doc["error"].startswith(f"the sftctl server at {url} cannot be reached: "), doc
    assert doc["error"].endswith("; gave up after 1 s (server.retry_s): job j-1 goes on, supervised by the server"), doc
    assert doc["hint"] == "sftctl wait j-1 j-2 or sftctl logs -f j-1 follows it again once the server is back", doc
    assert [r.getMessage() for r in caplog.records if r.name == "sftctl.remote"] == [RETRYING]


def test_wait_with_a_timeout_gives_up_on_a_lost_server_at_its_timeout(home, monkeypatch):
    """api.wait's retries of a lost server end at its timeout_s, not server.retry_s later: a
    `wait --timeout 1` against a server gone for good ends at once with exit 75, saying the
    server was still unreachable at the timeout (the job's state unknown, not "still RUNNING")."""
    import threading

    from sftctl import api, remote
    from test_server import _free_port

    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    monkeypatch.setenv("SFTCTL_SERVER_URL", url)
    monkeypatch.setenv("SFTCTL_SERVER_TOKEN", "t")
    monkeypatch.setenv("SFTCTL_SERVER_RETRY_S", "600")
    monkeypatch.setattr(remote, "RETRY_FIRST_S", 0.05)
    raised: list = []

    def wait() -> None:
        try:
            api.wait("j-1", timeout_s=1.0)
        except Exception as e:  # noqa: BLE001 - the test reads it
            raised.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(deadline(120))  # a bound on a hang (the 600 s window), not a timing
    assert not waiter.is_alive(), "wait --timeout 1 still retries a lost server"
    [e] = raised
    assert isinstance(e, remote.ServerLost) and e.exit_code == 75 and e.job == "j-1", repr(e)
    assert e.message.startswith(f"the sftctl server at {url} cannot be reached: "), e.message
    assert e.message.endswith("; still unreachable at the timeout: job j-1 goes on, supervised by the server"), e.message
    assert e.hint == "sftctl wait j-1 again once the server is back", e.hint


def test_logs_follow_gives_up_on_a_server_whose_every_reopen_answers_then_goes_silent(home, monkeypatch, caplog):
    """A server that answers each reopen of the follow and then says nothing (its log reader
    stuck: no keep-alive line either) is a lost server: one notice at the first silence, and
    exit 75 once the silence outlasts server.retry_s, however often the reopens succeed."""
    import threading

    from sftctl import remote

    monkeypatch.setenv("SFTCTL_SERVER_RETRY_S", "0.5")
    client = remote.Client("http://127.0.0.1:9", "t")
    opens: list[int] = []

    def answered_then_silent(path, params, read_s):
        opens.append(1)

        def stream():
            raise remote.Silent("the sftctl server at http://127.0.0.1:9 accepted the connection but did not "
                                f"answer for {read_s:g} s", hint=None)
            yield  # a generator: the silence comes as it is read, after the open answered

        return stream()

    monkeypatch.setattr(client, "_stream", answered_then_silent)
    raised: list = []

    def follow() -> None:
        try:
            list(client.follow_lines("j-1", "/v1/jobs/j-1/logs", {"follow": True}))
        except Exception as e:  # noqa: BLE001 - the test reads it
            raised.append(e)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    follower.join(deadline(60))  # a bound on a hang, not a timing: a 0.5 s window
    assert not follower.is_alive(), f"logs -f still reopens a silent server ({len(opens)} opens)"
    [e] = raised
    assert isinstance(e, remote.ServerLost) and e.exit_code == 75, repr(e)
    assert e.message.endswith("did not answer for 30 s; gave up after 0.5 s (server.retry_s): job j-1 goes on, "
                              "supervised by the server"), e.message
    assert len(opens) >= 2  # it did ask again
    assert [r.getMessage() for r in caplog.records if r.name == "sftctl.remote"] == [RETRYING]
