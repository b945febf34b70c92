"""What a server's user or a user's job may not do: act as the server, as the controller or as
another user, with a real ``sftctl server`` on SQLite and real clients.

- a user's ``model:`` entrypoint is never imported by the server (its submit, the dashboard's
  plan page): the model's module code would run in the server's process, with its state
  (every user's token hash, the secrets key) and its environment.
"""

from __future__ import annotations

import pytest

from conftest import deadline

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from test_server import Server, as_user, tokens


def _model_that_reports(tmp_path):
    """A workdir whose ``evil.py`` writes ``ran.txt`` (the importing process's pid) when
    imported, and a spec naming it as ``model:``. Returns (spec path, marker path)."""
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran.txt"
    (work / "evil.py").write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\n"
        "def build(batch_size, dtype='float32'):\n"
        "    raise RuntimeError('never built')\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: evil\nworkdir: {work}\nmodel: {{entrypoint: evil.py:build, batch_size: 1}}\n"
                    "resources: {nodes: 1}\nrun: echo hi\n")
    return spec, marker


def test_the_server_never_imports_a_users_model_code(server, tmp_path, monkeypatch):
    """alice's submit with a ``model:`` is planned by price only on the server, with a warning
    saying so; her module never runs in the server's process."""
    import warnings

    from sftctl import api
    from sftctl.errors import SftctlWarning

    spec, marker = _model_that_reports(tmp_path)
    as_user(monkeypatch, server, tokens("alice")["alice"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = api.submit(str(spec)).job_id
    try:
        assert not marker.exists(), f"the server (pid {server.proc.pid}) ran alice's model code: pid {marker.read_text()}"
        said = [str(w.message) for w in caught if issubclass(w.category, SftctlWarning)]
        assert any("price only" in s and "model" in s for s in said), said
    finally:
        api.down(job)
        api.wait(job, timeout_s=deadline(120))


def _python_of_its_own(tmp_path):
    """A venv of this test's own (``--without-pip``) that imports sftctl and its dependencies
    from this one's site-packages: a server started with its python runs from a prefix that a
    job may try to write in, and nobody else's python is touched."""
    import site
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = next((venv / "lib").glob("python3*")) / "site-packages"
    ours = "".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages())
    (purelib / "zz_sftctl_test.pth").write_text(ours)
    return venv / "bin" / "python", purelib


def test_a_job_cannot_write_in_the_python_the_server_runs_from(home, tmp_path, monkeypatch):
    """alice's workdir is the server's site-packages: a ``.pth`` her job writes there would run
    in the server's next controller (every process of that python), as the server. The job is
    refused at launch, naming the workdir, and nothing is written there."""
    import os
    import subprocess

    import httpx

    from sftctl import api

    python, purelib = _python_of_its_own(tmp_path)
    marker = tmp_path / "ran-as-server.txt"
    planted = purelib / "alice.pth"
    s = Server(home, tmp_path / "server.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFTCTL_SERVER_")}
    with open(s.log, "ab") as out:
        s.proc = subprocess.Popen([str(python), "-m", "sftctl.cli", "server", "start", "--port", str(s.port)],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        from conftest import wait_for

        wait_for(lambda: _answers(httpx, s), timeout_s=deadline(60), what="the server to answer")
        spec = tmp_path / "plant.yaml"
        spec.write_text(f"name: plant\nworkdir: {purelib}\nresources: {{nodes: 1}}\nrun: |\n"
                        f"  echo \"import pathlib; pathlib.Path({str(marker)!r}).write_text('pwned')\" > {planted}\n")
        as_user(monkeypatch, s, tokens("alice")["alice"])
        job = api.run(str(spec), detach=True).id
        view = api.wait(job, timeout_s=deadline(180))
        assert not planted.exists(), "alice's job wrote in the server's site-packages"
        assert view.status.value == "FAILED", view.status
        assert "workdir" in (view.failure_reason or "") and str(purelib) in (view.failure_reason or ""), \
            view.failure_reason
    finally:
        planted.unlink(missing_ok=True)
        s.stop()
    assert not marker.exists()


def _answers(httpx, s) -> bool:
    assert s.proc.poll() is None, s.log.read_text()
    try:
        return httpx.get(f"{s.url}/v1/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_node_log_of_any_size_is_read_in_bounded_parts(home, tmp_path):
    """A job grows its node.log to 48 MiB of one line (a sparse ``truncate -s``: no disk, any
    size; 1 GiB OOM-killed the server serving its logs) and its health.jsonl to 40 MiB of no
    newline: the controller reads each in bounded parts and the job SUCCEEDS; ``logs`` gives
    every byte back, in lines and chunks of bounded size, the line after it too."""
    from sftctl import api
    from sftctl.api._views import LOG_CHUNK_CHARS, LOG_LINE_MAX_CHARS, log_chunks
    from sftctl.providers.local import READ_MAX_BYTES, LocalProvider
    from sftctl.state import Store

    hole = 48 << 20
    spec = tmp_path / "hole.yaml"
    spec.write_text("name: hole\nresources: {nodes: 1}\nrun: |\n"
                    f"  truncate -s {hole} $SFTCTL_NODE_DIR/node.log\n"
                    "  echo after-the-hole\n"
                    "  truncate -s 40M $SFTCTL_NODE_DIR/health.jsonl\n"
                    "  sleep 5\n")
    job = api.run(str(spec), detach=True).id
    view = api.wait(job, timeout_s=deadline(300))
    assert view.status.value == "SUCCEEDED", view.failure_reason

    store = Store()
    handle = store.nodes(job)[0].node_handle
    store.close()
    data, offset = LocalProvider().read_log(handle, 0)
    assert len(data) == offset == READ_MAX_BYTES

    chunks = list(log_chunks(job))
    lines = [line.text for c in chunks for line in c]
    assert max(len(t) for t in lines) <= LOG_LINE_MAX_CHARS
    assert max(sum(len(line.text) for line in c) for c in chunks) <= LOG_CHUNK_CHARS + LOG_LINE_MAX_CHARS
    text = "".join(lines)
    assert hole - 4096 < text.count("\0") <= hole  # the hole, after what the node wrote before it
    assert any("after-the-hole" in t for t in lines[-3:]), lines[-3:]


def test_a_checkpoint_dirs_owner_file_is_never_followed(home, tmp_path):
    """A job's ``train.checkpoint_dir`` is the node's to write: its owner file
    (``.sftctl-job``) made a symlink to the server's secrets key was read through at the next
    submit (the key came back in the error, as "checkpoints of job <key>") and written through
    at the next claim. Neither follows it: the submit says the checkpoints' owner is unknown
    and the claim replaces the link, leaving its target as it was."""
    from sftctl.controller.submit import OWNER_FILE, check_checkpoint_dir, claim_checkpoint_dir
    from sftctl.errors import SpecError
    from sftctl.spec import load_spec

    secret = tmp_path / "secrets.key"
    secret.write_text("the-servers-own-key\n")
    root = tmp_path / "ck"
    (root / "step-00000001").mkdir(parents=True)
    (root / "step-00000001" / "COMPLETE").write_text('{"step": 1}')
    (root / "step-00000001" / "state.pt").write_bytes(b"")
    (root / OWNER_FILE).symlink_to(secret)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: ck\ntrain: {{checkpoint_dir: {root}}}\nresources: {{nodes: 1}}\nrun: 'true'\n")
    spec = load_spec(str(spec_file))

    with pytest.raises(SpecError) as caught:
        check_checkpoint_dir(spec)
    assert "the-servers-own-key" not in caught.value.message + (caught.value.hint or "")
    assert "a run sftctl did not start" in caught.value.message

    claim_checkpoint_dir(root, "ck-123456")
    assert secret.read_text() == "the-servers-own-key\n"
    assert not (root / OWNER_FILE).is_symlink() and (root / OWNER_FILE).read_text() == "ck-123456\n"


def test_a_fifo_in_a_checkpoint_dir_never_hangs_a_submit(home, tmp_path):
    """A job may leave a FIFO at a checkpoint's ``COMPLETE`` in its ``train.checkpoint_dir``:
    the server's next submit naming that directory opened it for reading and waited for a
    writer forever (a worker thread each; 40 submits: every thread of the server). It is
    not a complete checkpoint: the check returns at once."""
    import os
    import threading

    from sftctl.storage.checkpoints import complete_checkpoint_steps

    root = tmp_path / "ck"
    step = root / "step-00000001"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"")
    os.mkfifo(step / "COMPLETE")
    got: list = []
    reader = threading.Thread(target=lambda: got.append(complete_checkpoint_steps(root)), daemon=True)
    reader.start()
    reader.join(timeout=deadline(60))
    hung = reader.is_alive()
    if hung:  # let the reader go: a writer that opens and closes gives it end of file
        os.close(os.open(step / "COMPLETE", os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
    assert not hung, "reading a checkpoint's COMPLETE waited on a FIFO"
    assert got == [[]]


def _peak_rss_kib(pid: int) -> int:
    """The process's peak resident memory (``VmHWM``, KiB)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_the_dashboards_log_view_keeps_only_the_lines_it_shows(server, tmp_path, monkeypatch):
    """A job's node.log grown to 256 MiB (sparse: no disk): the dashboard's log view (its last
    200 lines, refreshed every 3 s while followed) held every line of it at once; the server's
    peak memory grows by less than half the log for it."""
    from sftctl import api
    from test_web import signed_in

    t = tokens("alice")
    size = 256 << 20
    spec = tmp_path / "hole.yaml"
    spec.write_text(f"name: hole\nresources: {{nodes: 1}}\nrun: |\n  truncate -s {size} $SFTCTL_NODE_DIR/node.log\n"
                    "  echo after-the-hole\n")
    as_user(monkeypatch, server, t["alice"])
    job = api.run(str(spec), detach=True).id
    assert api.wait(job, timeout_s=deadline(300)).status.value == "SUCCEEDED"
    before = _peak_rss_kib(server.proc.pid)
    page = signed_in(server, t["alice"]).get(f"/ui/jobs/{job}/logs", timeout=deadline(120))
    assert page.status_code == 200 and "after-the-hole" in page.text
    grew = _peak_rss_kib(server.proc.pid) - before
    assert grew < size // 2 // 1024, f"the server's peak memory grew {grew:,} KiB for a {size >> 20} MiB log"


def test_a_jobs_env_never_runs_code_in_the_nodes_guard(server, tmp_path, monkeypatch):
    """A node's guard and bwrap run outside the sandbox, as the server: alice's ``env:``
    reached them, so ``PYTHONPATH`` (a ``sitecustomize.py`` of her workdir) and
    ``LD_PRELOAD`` (a library of her workdir) ran her code there, which read the server's
    secrets key. Nothing of hers runs outside the sandbox now; inside, her job gets both."""
    import shutil
    import subprocess

    from sftctl import api

    out = tmp_path / "outside"  # the sandbox hides /tmp: only a process outside can write here
    out.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "sitecustomize.py").write_text(
        f"import os\ntry:\n    open(os.path.join({str(out)!r}, 'py-%d' % os.getpid()), 'w').close()\n"
        "except OSError:\n    pass\n")
    env = {"PYTHONPATH": str(work)}
    if shutil.which("gcc"):
        (work / "evil.c").write_text(
            "#include <stdio.h>\n#include <unistd.h>\n"
            "__attribute__((constructor)) static void evil(void) {\n"
            f"  char p[4096]; snprintf(p, sizeof p, \"{out}/ld-%d\", (int)getpid());\n"
            "  FILE *f = fopen(p, \"w\"); if (f) fclose(f);\n}\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(work / "evil.so"), str(work / "evil.c")], check=True)
        env["LD_PRELOAD"] = str(work / "evil.so")
    spec = tmp_path / "env.yaml"
    spec.write_text(f"name: envjob\nworkdir: {work}\nenv: {env!r}\nresources: {{nodes: 1}}\n"
                    "run: |\n  echo \"inside PYTHONPATH=$PYTHONPATH LD_PRELOAD=$LD_PRELOAD\"\n")
    as_user(monkeypatch, server, tokens("alice")["alice"])
    job = api.run(str(spec), detach=True).id
    view = api.wait(job, timeout_s=deadline(300))
    log = "\n".join(line.text for line in api.logs(job))
    assert sorted(p.name for p in out.iterdir()) == [], "alice's code ran outside the sandbox"
    assert view.status.value == "SUCCEEDED", (view.failure_reason, log)
    assert f"inside PYTHONPATH={work} LD_PRELOAD={env.get('LD_PRELOAD', '')}" in log, log


def test_a_user_cannot_resume_from_another_users_checkpoint_dir(server, tmp_path, monkeypatch):
    """bob's ``train.checkpoint_dir`` holds his job's checkpoints; alice names it with
    ``resume_from: any``: her nodes would get it read-write (his weights; a ``state.pt`` of hers
    that his next resume loads). The server refuses her submit in one line naming the field."""
    from sftctl import api
    from sftctl.errors import SpecError

    t = tokens("alice", "bob")
    ck = tmp_path / "bobs-checkpoints"
    bob = tmp_path / "bob.yaml"
    bob.write_text(f"name: bobs\ntrain: {{checkpoint_dir: {ck}}}\nresources: {{nodes: 1}}\nrun: |\n"
                   "  mkdir -p $SFTCTL_CHECKPOINT_DIR/step-00000001 && cd $SFTCTL_CHECKPOINT_DIR/step-00000001\n"
                   "  touch state.pt && echo '{\"step\": 1}' > COMPLETE\n")
    as_user(monkeypatch, server, t["bob"])
    job = api.run(str(bob), detach=True).id
    assert api.wait(job, timeout_s=deadline(300)).status.value == "SUCCEEDED"
    assert (ck / "step-00000001" / "COMPLETE").exists()

    alice = tmp_path / "alice.yaml"
    alice.write_text(f"name: alices\ntrain: {{checkpoint_dir: {ck}, resume_from: any}}\nresources: {{nodes: 1}}\n"
                     "run: 'true'\n")
    as_user(monkeypatch, server, t["alice"])
    with pytest.raises(SpecError) as refused:
        api.submit(str(alice))
    assert "train.checkpoint_dir" in refused.value.message and "another user" in refused.value.message
    assert (ck / ".sftctl-job").read_text().strip() == job  # still bob's


def test_a_flood_of_agent_errors_is_a_bounded_number_of_events(home, tmp_path):
    """A job writes 300 distinct ``agent_error`` records of 5,000 characters to its
    health.jsonl: each became an event of the state (20,000 of them: 40 MB of the server's
    state in seconds, every one on the job's dashboard page). At most MAX_WARNINGS of them
    are recorded, each cut to a line, then one saying the rest go unsaid."""
    from sftctl import api
    from sftctl.health.records import MAX_WARNINGS

    spec = tmp_path / "flood.yaml"
    spec.write_text("name: flood\nresources: {nodes: 1}\nrun: |\n  python3 -c \"\n"
                    "  import json, os\n"
                    "  with open(os.environ['SFTCTL_NODE_DIR'] + '/health.jsonl', 'a') as f:\n"
                    "      for i in range(300):\n"
                    "          f.write(json.dumps({'ts': 1.0, 'agent_error': 'e%d ' % i + 'x' * 5000}) + '\\n')\n"
                    "  \"\n  sleep 4\n")
    job = api.run(str(spec), detach=True).id
    assert api.wait(job, timeout_s=deadline(300)).status.value == "SUCCEEDED"
    agent = [e for e in api.events(job) if "health agent" in e.message]
    assert 1 <= len(agent) <= MAX_WARNINGS + 1, len(agent)
    assert max(len(e.message) for e in agent) <= 500


def test_metrics_of_ranks_a_job_does_not_have_are_dropped(home, tmp_path):
    """A one-node, one-process job reports steps of 2,000 training ranks: each became rows of
    the state (80,000 ranks took every user's ``sftctl status`` through the server to 17 s and
    the job's to 33 s and 20 MB). Records of a rank at or past the job's world size (nodes x
    processes per node) are dropped with the bounded warnings of any invalid record."""
    from sftctl import api
    from sftctl.health.records import MAX_WARNINGS

    spec = tmp_path / "ranks.yaml"
    spec.write_text("name: ranks\nresources: {nodes: 1}\nrun: |\n  python3 -c \"\n"
                    "  import json, os, time\n"
                    "  with open(os.environ['SFTCTL_METRICS_DIR'] + '/rank-0.jsonl', 'a') as f:\n"
                    "      for i in range(2000):\n"
                    "          f.write(json.dumps({'rank': i, 'step': 1, 'loss': 1.0, 'ts': time.time()}) + '\\n')\n"
                    "  \"\n  sleep 4\n")
    job = api.run(str(spec), detach=True).id
    view = api.wait(job, timeout_s=deadline(300))
    assert view.status.value == "SUCCEEDED"
    world = view.record.spec["resources"]["nodes"] * view.record.plan.offering.count
    assert world < 2000
    assert sorted({s.rank for s in api.metrics(job)}) == list(range(world))
    warned = [e for e in api.events(job) if e.kind == "metrics"]
    assert 1 <= len(warned) <= MAX_WARNINGS + 1 and "rank" in warned[0].message, warned[:2]


def test_log_followers_never_hold_the_servers_threads(server, tmp_path, monkeypatch):
    """40 ``logs --follow`` of alice's quiet job (closed again, as a client that went away):
    each held one of the server's 40 worker threads while it waited for lines, so the server
    answered no request of anyone's until the job ended (it never does here). bob is answered
    now."""
    import asyncio

    import httpx

    from sftctl import api

    t = tokens("alice", "bob")
    spec = tmp_path / "quiet.yaml"
    spec.write_text("name: quiet\nresources: {nodes: 1}\nrun: |\n  echo started\n  sleep 100000\n")
    as_user(monkeypatch, server, t["alice"])
    job = api.run(str(spec), detach=True).id
    try:
        from conftest import wait_for

        wait_for(lambda: any("started" in line.text for line in api.logs(job)), timeout_s=deadline(120),
                 what="the job to start")

        async def follow_then_leave() -> None:
            headers = {"Authorization": f"Bearer {t['alice']}"}
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=deadline(60)) as c:
                streams = [c.stream("GET", f"/v1/jobs/{job}/logs", params={"follow": "true"}) for _ in range(40)]
                opened = await asyncio.gather(*(s.__aenter__() for s in streams))
                assert all(r.status_code == 200 for r in opened)
                await asyncio.sleep(2)
                for s in streams:
                    await s.__aexit__(None, None, None)

        asyncio.run(follow_then_leave())
        answer = httpx.get(f"{server.url}/v1/whoami", headers={"Authorization": f"Bearer {t['bob']}"},
                           timeout=deadline(60))
        assert answer.json()["name"] == "bob"
    finally:
        api.down(job)
