"""sftctl.api: the Python API the CLI is built on (a detached quickstart driven from Python, the
README's sweep, light import, errors, and the CLI's --json being the api's documents)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest

from conftest import REPO, SLEEPER, job_processes, sftctl

QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
#: heavy modules `sftctl status` does not import either (tests/test_cli.py keeps that bar)
HEAVY = ("torch", "numpy", "jax", "triton", "boto3", "google.cloud", "kubernetes", "yaml",
         "sftctl.spec", "sftctl.planner", "sftctl.controller", "sftctl.compiler",
         # the server's web framework, and its client's, with no server configured (issue 24)
         "fastapi", "starlette", "uvicorn", "httpx", "sftctl.server")


def _modules(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "; import sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_import_is_as_light_as_sftctl_status(home):
    api = _modules("import sftctl.api")
    status = _modules("from sftctl.cli import main; main(['status', '--json'])")
    assert "sftctl.api" in api
    assert [m for m in HEAVY if m in api] == []
    assert [m for m in HEAVY if m in status] == []  # the bar: what `sftctl status` costs
    heavier = sorted(m for m in api - status if not m.startswith("sftctl"))
    assert heavier == [], f"import sftctl.api loads what sftctl status does not: {heavier}"
    if "pydantic" not in status:
        assert "pydantic" not in api


def test_detached_quickstart_from_python_to_succeeded(home):
    """Issue 15: a detached quickstart driven from Python: run, poll status, read logs and events."""
    from sftctl import api
    from sftctl.types import JobStatus

    job = api.run(QUICKSTART, overrides={"train.steps": 6, "train.checkpoint_interval": 3}, detach=True)
    assert job.status in (JobStatus.PENDING, JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING)
    assert job.record.controller_pid is not None and job.record.offering.provider == "local"
    done = api.wait(job.id[:-2], timeout_s=300, poll_s=0.5)  # a unique prefix is enough
    assert done.id == job.id
    assert done.status is JobStatus.SUCCEEDED, done.failure_reason
    assert [r.rank for r in done.ranks] == [0, 1] and done.step == 6
    assert all(r.loss < r.first_loss for r in done.ranks)  # it learned something
    assert done.loss == pytest.approx(sum(r.loss for r in done.ranks) / 2)
    assert [a.status for a in done.attempts] == ["SUCCEEDED"]
    # the controller records SUCCEEDED, then terminates the nodes: api.wait returns after both
    # (it returned between the two, and a third pass beside a second suite saw RUNNING nodes)
    assert {n.status for n in done.nodes} == {"TERMINATED"}, done.nodes
    assert job_processes(job.id) == []

    lines = list(api.logs(job.id))
    text = "\n".join(map(str, lines))
    assert re.search(r"\(node [01]\) step 6/6 loss \d+\.\d{4}", text), text[-2000:]
    assert {ln.rank for ln in lines} == {0, 1} and not any(ln.notice for ln in lines)
    only0 = [str(ln) for ln in api.logs(job.id, node=0)]
    assert only0 and not any(s.startswith("(node") for s in only0)

    messages = [e.message for e in api.events(job.id) if e.kind == "status"]
    assert messages[0] == "job submitted (PENDING)"
    moves = [m.split(":")[0] for m in messages[1:]]
    assert moves == ["PENDING -> PROVISIONING", "PROVISIONING -> LAUNCHING", "LAUNCHING -> RUNNING",
                     "RUNNING -> SUCCEEDED"]

    # the CLI prints the api's documents: status --json and events --json are the same data
    assert json.loads(sftctl("status", job.id, "--json", check=True).stdout) == json.loads(json.dumps(done.to_dict()))
    events_cli = json.loads(sftctl("events", job.id, "--json", check=True).stdout)
    assert events_cli == json.loads(json.dumps(api.events_doc(job.id, api.events(job.id))))


def test_errors_are_sftctl_errors_with_exit_codes(home, tmp_path):
    from sftctl import api
    from sftctl.errors import InfeasibleError, NotFoundError, SftctlError, SpecError

    with pytest.raises(NotFoundError, match="no job 'nope'") as e:
        api.status("nope")
    assert e.value.exit_code == 2 and e.value.hint
    with pytest.raises(SpecError, match="train.steps"):
        api.load(QUICKSTART, {"train.steps": -1})
    with pytest.raises(SpecError, match="no such file"):
        api.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(InfeasibleError) as e:
        api.plan("name: x\nresources: {accelerators: [H100:8], clouds: [local]}\nrun: echo\n")
    assert e.value.exit_code == 3 and e.value.candidates
    with pytest.raises(SftctlError, match="--node 5: job .* has 2 node"):
        job = api.submit(SLEEPER).job_id
        try:
            api.logs(job, node=5)
        finally:
            api.down(job)
    # a spec as YAML text, as a path, and as a JobSpec with overrides: the same job
    text = (REPO / "examples" / "quickstart.yaml").read_text()
    a, b = api.load(QUICKSTART, ["train.steps=7"]), api.load(text.replace("workdir: ..", f"workdir: {REPO}"), {"train.steps": 7})
    c = api.load(api.load(QUICKSTART), {"train.steps": 7})
    assert a.train.steps == b.train.steps == c.train.steps == 7 and a.workdir == b.workdir == c.workdir


def _readme_sweep() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_readme_python_sweep_runs(home, monkeypatch, capsys):
    """The README's ten-line sweep, exactly as written, with a tiny step count on one node."""
    from sftctl import api

    code = _readme_sweep()
    assert len(code.strip().splitlines()) <= 10
    real_run = api.run

    def short_run(spec, overrides=(), **kw):  # the README's overrides, then a short run
        sets = [f"{k}={v}" for k, v in dict(overrides).items()] + ["train.steps=3", "resources.nodes=1"]
        return real_run(spec, sets, **kw)

    monkeypatch.setattr(api, "run", short_run)
    monkeypatch.chdir(REPO)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2, out
    losses = []
    for line in out:
        m = re.fullmatch(r"lr (\S+): SUCCEEDED, final loss (\d+\.\d+) \(mean over ranks\)", line)
        assert m, line
        losses.append(float(m.group(2)))
    assert len(set(losses)) == 2  # the learning rate reached the training script


#: modules whose code runs on a node and writes to that node's log (or to the shipper's stderr)
NODE_SIDE = {"sftctl/train/", "sftctl/node.py", "sftctl/agent.py", "sftctl/failure.py", "sftctl/storage/stream.py"}  # a folder: each module in it


def test_no_module_outside_the_cli_prints():
    """Issue 15: rendering belongs to the CLI; the api returns data. print() is allowed in cli/
    and ui/, in a tool's own ``main`` (python -m sftctl.X), and in code that runs on a node."""
    import ast

    found = []
    for path in sorted((REPO / "sftctl").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("sftctl/ui/", "sftctl/cli/") + tuple(s for s in NODE_SIDE if s.endswith("/"))) \
                or rel in NODE_SIDE:
            continue

        def walk(node, stack, rel=rel):
            for child in ast.iter_child_nodes(node):
                inner = stack + [child.name] if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else stack
                if isinstance(child, ast.Call) and getattr(child.func, "id", None) == "print" and "main" not in stack:
                    found.append(f"{rel}:{child.lineno} in {'.'.join(stack) or 'module'}")
                walk(child, inner)

        walk(ast.parse(path.read_text()), [])
    assert found == []


def test_the_cli_reaches_the_core_only_through_the_api():
    """cli.py is parsing + rendering over sftctl.api (and starts sftctl.server): it imports no
    provider, controller, state, planner, spec or compiler module (ARCHITECTURE.md, Boundaries)."""
    import ast

    used = set()
    for path in sorted((REPO / "sftctl" / "cli").glob("*.py")):  # the package, its modules importing one another
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sftctl"):
                used.add(node.module if node.module != "sftctl" else f"sftctl.{node.names[0].name}")
            elif isinstance(node, ast.Import):
                used |= {a.name for a in node.names if a.name.startswith("sftctl")}
    used = {u for u in used if u != "sftctl.cli" and not u.startswith("sftctl.cli.")}
    # sftctl.server is presentation too: the api over HTTP, which `sftctl server ...` starts
    assert used <= {"sftctl.api", "sftctl.ui", "sftctl.errors", "sftctl.types", "sftctl.paths", "sftctl.__version__",
                    "sftctl.schema", "sftctl.server", "sftctl.server.manifest", "sftctl.server.metrics",
                    "sftctl.server.users"}, used


def test_check_takes_one_name_or_a_list(home):
    """api.check("local") used to iterate the string: unknown cloud 'l'."""
    from sftctl import api

    assert [(c.cloud, c.ok) for c in api.check("local")] == [("local", True)]
    assert [c.cloud for c in api.check(["local", "aws"])] == ["local", "aws"]
    assert [c.cloud for c in api.check(("local",))] == ["local"]


@pytest.mark.parametrize("call, message", [
    (lambda api: api.status(123), "api.status: job must be a job id (str) or a JobView/JobRecord, or None, got int"),
    (lambda api: api.logs(123), "api.logs: job must be a job id (str) or a JobView/JobRecord, got int"),
    (lambda api: api.down(123), "api.down: job must be a job id (str) or a JobView/JobRecord, or None, got int"),
    (lambda api: api.events(None), "api.events: job must be a job id (str) or a JobView/JobRecord, got None"),
    (lambda api: api.wait(4.5), "api.wait: job must be a job id (str) or a JobView/JobRecord, got float"),
    (lambda api: api.catalog(accelerator=5), "api.catalog: accelerator must be an accelerator name (str), or None, got int"),
    (lambda api: api.run(None), "api.run: spec must be a path (str or os.PathLike), YAML text or a JobSpec, got None"),
    (lambda api: api.run(123), "api.run: spec must be a path (str or os.PathLike), YAML text or a JobSpec, got int"),
    (lambda api: api.run({"name": "x"}), "api.run: spec must be a path (str or os.PathLike), YAML text or a JobSpec, got dict"),
    (lambda api: api.plan(42), "api.plan: spec must be a path (str or os.PathLike), YAML text or a JobSpec, got int"),
    (lambda api: api.load(QUICKSTART, [1]), "api.load: overrides must be a list of 'key.path=value' strings or a "
     "mapping {'key.path': value}, got list[int]"),
    (lambda api: api.check([1]), "api.check: clouds must be a cloud name (str) or a list of them, or None, got list[int]"),
    (lambda api: api.logs("j", node="0"), "api.logs: node must be a node rank (int), or None, got str"),
    (lambda api: api.compile(QUICKSTART, 3), "api.compile: target must be an accelerator name (str), got int"),
])
def test_a_wrong_argument_type_is_a_type_error_naming_it(home, call, message):
    from sftctl import api

    with pytest.raises(TypeError) as e:
        call(api)
    assert str(e.value) == message
    assert not (home / "state.db").exists() or api.status() == []  # raised at the boundary: nothing recorded


def test_a_job_view_or_record_is_a_job_argument_and_purged_logs_are_an_error(home, tmp_path):
    """After down --purge, logs says the logs were purged (exit 1, as kubectl logs of a deleted
    pod), not an empty log with exit 0."""
    from sftctl import api
    from sftctl.errors import NotFoundError

    job = api.submit(SLEEPER).job_id
    view = api.status(job)
    assert api.status(view).id == api.job(view.record).id == job  # a JobView or JobRecord names its job
    assert list(api.logs(view)) == []
    [result] = api.down(view, purge=True)
    assert result.purged is not None
    with pytest.raises(NotFoundError) as e:
        api.logs(job)
    purge = [ev for ev in api.events(job) if ev.kind == "purge"]
    assert len(purge) == 1
    when = __import__("time").strftime("%Y-%m-%d %H:%M:%S", __import__("time").localtime(purge[0].ts))
    assert e.value.message == f"logs of {job} were purged (sftctl down --purge at {when})"
    assert e.value.exit_code == 1 and f"sftctl events {job}" in e.value.hint
    proc = sftctl("logs", job)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines()[0] == f"error: logs of {job} were purged (sftctl down --purge at {when})"
    assert "Traceback" not in proc.stderr


def test_a_bad_user_setting_fails_submit_before_a_job_is_recorded(home, monkeypatch):
    from sftctl import api
    from sftctl.settings import SettingError

    monkeypatch.setenv("SFTCTL_LOCAL_MAX_NODES", "x")
    for call in (api.submit, api.dry_run, api.plan):
        with pytest.raises(SettingError, match="SFTCTL_LOCAL_MAX_NODES: expected an integer, got 'x'") as e:
            call(QUICKSTART)
        assert e.value.exit_code == 2
    monkeypatch.delenv("SFTCTL_LOCAL_MAX_NODES")
    assert api.status() == []


def test_wait_returns_once_an_ended_jobs_nodes_are_down(monkeypatch):
    """api.wait: a SUCCEEDED job whose controller has not yet terminated its nodes is waited on
    until it has (views from a stand-in api.status: SUCCEEDED with a RUNNING node, then with
    TERMINATED ones); a FAILED_CONTROLLER job returns at once (no controller is left to bring
    them down); an ended job whose nodes stay up returns after WAIT_TEARDOWN_S, never raising."""
    from sftctl import api
    from sftctl.types import JobStatus, NodeState

    def view(status, *nodes):
        rec = types.SimpleNamespace(id="j1", status=status, failure_reason=None)
        return types.SimpleNamespace(id="j1", status=status, record=rec,
                                     nodes=[types.SimpleNamespace(status=n) for n in nodes])

    seq = [view(JobStatus.RUNNING, NodeState.RUNNING), view(JobStatus.SUCCEEDED, NodeState.RUNNING, NodeState.TERMINATED),
           view(JobStatus.SUCCEEDED, NodeState.TERMINATED, NodeState.REPLACED)]
    calls = []
    # wait polls status where both live (sftctl/api/_views.py)
    monkeypatch.setattr(api._views, "status", lambda job: calls.append(job) or seq[min(len(calls), len(seq)) - 1])
    done = api.wait("j1", poll_s=0)
    assert len(calls) == 3 and [n.status for n in done.nodes] == [NodeState.TERMINATED, NodeState.REPLACED]

    calls.clear()
    seq[:] = [view(JobStatus.FAILED_CONTROLLER, NodeState.RUNNING)]
    assert api.wait("j1", poll_s=0).status == JobStatus.FAILED_CONTROLLER and len(calls) == 1

    calls.clear()
    seq[:] = [view(JobStatus.FAILED, NodeState.RUNNING)]
    monkeypatch.setattr(api._views, "WAIT_TEARDOWN_S", 0.05)
    assert api.wait("j1", poll_s=0.01, timeout_s=0.0).status == JobStatus.FAILED  # timeout: the view, no raise
    assert api.wait("j1", poll_s=0.01).status == JobStatus.FAILED and len(calls) >= 3


def test_a_logs_generator_may_be_advanced_from_another_thread(home):
    """The server streams api.logs' lines from whichever worker thread serves the next chunk
    (Starlette's iterate_in_threadpool): the generator's store must work there (a CI run's
    attached-run test failed with sqlite3.ProgrammingError, 'created in a thread')."""
    import threading

    from sftctl import api
    from sftctl.state import Store

    store = Store()
    job = store.create_job("logs", {"name": "logs", "resources": {"nodes": 1}, "run": "true"})
    store.update_job(job, provider="local")
    lines = api.logs(job)  # made here, as the route makes it in its own thread
    out: list = []
    worker = threading.Thread(target=lambda: out.append(list(lines)))
    worker.start()
    worker.join(60)
    assert out == [[]]  # no node wrote yet: no line, and no error
