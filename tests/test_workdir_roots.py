"""server.workdir_roots: on a server, a job's workdir is bound read-write into its local nodes'
sandbox, so with the setting a user's workdir (symlinks followed) must lie inside one of their
roots (``{user}``: the job owner's name). A real ``sftctl server`` with
``SFTCTL_SERVER_WORKDIR_ROOTS=<lab>/{user}``: alice's job in her root runs; one naming bob's
root, or a link in alice's root into bob's, is refused at submit in one line (exit 2) and
nothing is recorded or launched; a workdir that became a link into bob's after submit is
refused where the local provider binds it, and nothing runs there.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import job_processes, sftctl, wait_for
from test_server import Server, as_user, tokens

pytestmark = pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v bwrap"], capture_output=True).returncode != 0,
                                reason="bubblewrap (bwrap) is not installed (.ci/run installs it)")

HINT = ("hint: the server's admin sets the roots: server.workdir_roots in its config file "
        "(or SFTCTL_SERVER_WORKDIR_ROOTS), {user} standing for each user's name")


@pytest.fixture
def lab(tmp_path) -> Path:
    root = tmp_path / "lab"
    for user in ("alice", "bob"):
        (root / user / "proj").mkdir(parents=True)
    (root / "bob" / "proj" / "notes.txt").write_text("bob's\n")
    return root


@pytest.fixture
def server(home, tmp_path, lab):
    s = Server(home, tmp_path / "server.log", env={"SFTCTL_SERVER_WORKDIR_ROOTS": f"{lab}/{{user}}"}).start()
    yield s
    s.stop()


def _spec(path: Path, workdir: Path) -> Path:
    path.write_text(f"name: {path.stem}\nworkdir: {workdir}\nresources: {{nodes: 1}}\n"
                    f"run: |\n{textwrap.indent('echo ran > ran.txt', '  ')}\n")
    return path


def _ended(api, job: str):
    return wait_for(lambda: (v := api.status(job)).status.terminal and v, timeout_s=300, what=f"job {job} to end")


def test_alices_job_in_her_root_runs_and_bobs_root_is_refused_in_one_line(server, lab, tmp_path, monkeypatch):
    from sftctl import api

    as_user(monkeypatch, server, tokens("alice", "bob")["alice"])
    ok = sftctl("run", str(_spec(tmp_path / "mine.yaml", lab / "alice" / "proj")), "--detach")
    assert ok.returncode == 0, ok.stderr
    [mine] = api.status()
    assert _ended(api, mine.id).status.value == "SUCCEEDED"
    assert (lab / "alice" / "proj" / "ran.txt").read_text() == "ran\n"  # the bound workdir, written

    refused = sftctl("run", str(_spec(tmp_path / "theirs.yaml", lab / "bob" / "proj")), "--detach")
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"error: workdir: {lab}/bob/proj is outside alice's workdir roots on this server ({lab}/alice); "
        "put the job's files in a directory under one of them and name it as workdir", HINT]
    (lab / "alice" / "sneaky").symlink_to(lab / "bob" / "proj")  # a link in alice's root, into bob's
    linked = sftctl("run", str(_spec(tmp_path / "linked.yaml", lab / "alice" / "sneaky")), "--detach")
    assert linked.returncode == 2
    assert linked.stderr.splitlines()[0] == (
        f"error: workdir: {lab}/bob/proj is outside alice's workdir roots on this server ({lab}/alice); "
        "put the job's files in a directory under one of them and name it as workdir")

    assert [v.id for v in api.status()] == [mine.id]  # nothing recorded for the refused two
    monkeypatch.delenv("SFTCTL_SERVER_URL")
    assert [v.id for v in api.status()] == [mine.id]  # the server's state itself
    assert sorted(p.name for p in (lab / "bob" / "proj").iterdir()) == ["notes.txt"]  # nothing ran there


def test_a_workdir_that_became_a_link_into_bobs_root_is_refused_at_launch(server, lab, tmp_path, monkeypatch):
    """Submitted while alice/proj2 was her own directory, started after it became a link into
    bob's: the controller resolves it again before it packs or launches anything (for every
    provider: a storage-fed job's workdir would be uploaded to alice's bucket), and refuses
    (ProviderError); the local provider would refuse it again where it binds it."""
    from sftctl import api

    as_user(monkeypatch, server, tokens("alice")["alice"])
    mine = lab / "alice" / "proj2"
    mine.mkdir()
    job = api.submit(str(_spec(tmp_path / "swapped.yaml", mine))).job_id
    mine.rmdir()
    mine.symlink_to(lab / "bob" / "proj")
    api.start(job)
    view = _ended(api, job)
    assert view.status.value == "FAILED", view
    assert (f"workdir: {lab}/bob/proj ({mine}, links followed) is outside alice's workdir "
            f"roots on this server ({lab}/alice)") in view.failure_reason, view.failure_reason
    assert "local node sandbox" not in view.failure_reason  # the controller's check, before any provider's
    assert sorted(p.name for p in (lab / "bob" / "proj").iterdir()) == ["notes.txt"]  # nothing ran there
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end")


def test_the_roots_setting_takes_a_path_list_from_the_environment_or_a_yaml_list(home, tmp_path, monkeypatch):
    """SFTCTL_SERVER_WORKDIR_ROOTS is os.pathsep-separated (a comma is part of a path); the
    config file's server.workdir_roots a YAML list; {user} is the owner, never one that climbs."""
    from sftctl.providers import workdir_roots

    monkeypatch.setenv("SFTCTL_SERVER_WORKDIR_ROOTS", os.pathsep.join(["/srv/lab,a/{user}", "/scratch/shared"]))
    assert workdir_roots.roots("alice") == ["/srv/lab,a/alice", "/scratch/shared"]
    assert workdir_roots.roots("..") == ["/scratch/shared"]  # /srv/lab,a/.. would be the lab's parent
    assert workdir_roots.refusal("/srv/lab,a/alice/x/../y", "alice") is None
    assert workdir_roots.refusal("/srv/lab,a/alicex", "alice") is not None  # a prefix is not a parent
    assert workdir_roots.refusal("/srv/lab,a/bob", "alice") is not None
    monkeypatch.delenv("SFTCTL_SERVER_WORKDIR_ROOTS")
    assert workdir_roots.roots("alice") is None and workdir_roots.refusal("/anything", "alice") is None
    config = tmp_path / "xdg-config" / "sftctl" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("server:\n  workdir_roots:\n    - /srv/{user}\n    - ~/shared\n")
    assert workdir_roots.roots("bob") == ["/srv/bob", os.path.realpath(os.path.expanduser("~/shared"))]


def test_the_submit_route_loads_the_spec_once_to_check_and_record_it(home, lab, tmp_path, monkeypatch):
    """With the roots set, the server's submit loads the spec for the check and hands that load
    to api.submit (it loaded it twice: parse, validation and ``${VAR}`` again). The real
    application in this process (FastAPI's TestClient), alice's token, a real plan and record."""
    from fastapi.testclient import TestClient

    import sftctl.spec
    from sftctl import api
    from sftctl.server import Supervisor
    from sftctl.server.app import create_app

    monkeypatch.setenv("SFTCTL_SERVER_WORKDIR_ROOTS", f"{lab}/{{user}}")
    loads: list[str] = []
    load_spec = sftctl.spec.load_spec

    def counted(path, *args, **kw):
        loads.append(str(path))
        return load_spec(path, *args, **kw)

    monkeypatch.setattr(sftctl.spec, "load_spec", counted)
    token = tokens("alice")["alice"]
    spec = _spec(lab / "alice" / "proj" / "once.yaml", lab / "alice" / "proj")
    with TestClient(create_app(Supervisor())) as client:
        r = client.post("/v1/jobs", headers={"Authorization": f"Bearer {token}"},
                        json={"spec_text": spec.read_text(), "spec_path": str(spec), "overrides": ["name=once2"]})
        assert r.status_code == 200, r.text
        assert loads == [str(spec)]
        job = r.json()["job"]
        assert (job["name"], job["owner"]) == ("once2", "alice")
        assert api.job(job["id"]).spec["workdir"] == str(lab / "alice" / "proj")

        loads.clear()  # bob's root: refused after the one load, nothing recorded
        bad = _spec(lab / "alice" / "proj" / "bobs.yaml", lab / "bob" / "proj")
        r = client.post("/v1/jobs", headers={"Authorization": f"Bearer {token}"},
                        json={"spec_text": bad.read_text(), "spec_path": str(bad), "overrides": []})
        assert r.status_code == 403 and loads == [str(bad)], r.text
        assert [v.record.name for v in api.status()] == ["once2"]


def test_the_plan_page_refuses_a_workdir_outside_the_users_roots(server, lab):
    """The dashboard's plan page traces a pasted spec's model from its workdir: bob's root named
    there is refused in one line (403) before anything is traced, as submit refuses it; alice's
    own root plans."""
    import re
    from urllib.parse import urlencode

    import httpx

    t = tokens("alice")
    alice = httpx.Client(base_url=server.url, timeout=120)
    r = alice.post("/ui/login", content=f"token={t['alice']}", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 303, r.text
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', alice.get("/ui/plan").text).group(1)
    post = {"content-type": "application/x-www-form-urlencoded"}
    model = ("model: {framework: torch, entrypoint: 'model.py:build', batch_size: 2}\n"
             "resources: {nodes: 1}\nrun: python model.py\n")
    (lab / "bob" / "proj" / "model.py").write_text("def build(**kw):\n    raise ValueError('bob-secret-line')\n")
    bobs = alice.post("/ui/plan", headers=post, content=urlencode(
        {"spec": f"name: p\nworkdir: {lab / 'bob' / 'proj'}\n{model}", "csrf": csrf}))
    assert bobs.status_code == 403, bobs.text
    assert f"workdir: {lab / 'bob' / 'proj'} is outside alice&#39;s workdir roots" in bobs.text
    assert "bob-secret-line" not in bobs.text
    mine = alice.post("/ui/plan", headers=post, content=urlencode(
        {"spec": f"name: p\nworkdir: {lab / 'alice' / 'proj'}\nresources: {{nodes: 1}}\nrun: echo hi\n", "csrf": csrf}))
    assert mine.status_code == 200, mine.text
    assert "outside" not in mine.text
