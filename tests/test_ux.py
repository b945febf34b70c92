"""What users trip over (issue 14): each test here failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, SLEEPER, deadline, job_processes, no_traceback, process_report, sftctl, status_json, wait_for, write_spec

# An interpreter without the cloud SDKs (the README's plain `.[torch]` install): a meta-path
# finder refuses them the way a missing distribution does.
NO_SDKS = textwrap.dedent("""\
    import sys
    class _NoSdk:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("kubernetes", "google", "boto3", "botocore"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoSdk())
    from sftctl.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _credentials_everywhere(tmp_path) -> dict:
    """A HOME with a kubeconfig, GCP and AWS credentials set: every cloud looks configured."""
    h = tmp_path / "user"
    (h / ".kube").mkdir(parents=True)
    (h / ".kube" / "config").write_text("apiVersion: v1\nkind: Config\n")
    adc = tmp_path / "adc.json"
    adc.write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBE", "GOOGLE_"))}
    return {**env, "HOME": str(h), "GOOGLE_APPLICATION_CREDENTIALS": str(adc), "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y"}


def test_check_and_down_orphans_without_cloud_sdks_name_the_extra(tmp_path, home):
    """Item 1: no traceback when credentials exist but an SDK does not; every cloud names its extra."""
    env = _credentials_everywhere(tmp_path)

    def run(*a):
        return subprocess.run([sys.executable, "-c", NO_SDKS, *a], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=120)

    proc = run("check", "--json")
    assert no_traceback(proc), proc.stderr
    assert proc.returncode == 0  # none named and local works (exit 4 only when a named one does not)
    rows = {r["cloud"]: r for r in json.loads(proc.stdout)["clouds"]}
    for cloud, sdk in (("aws", "boto3"), ("gcp", "google.cloud.compute_v1"), ("kubernetes", "kubernetes")):
        assert rows[cloud]["ok"] is False
        assert rows[cloud]["reason"] == f"{cloud}: its SDK ({sdk}) is not installed"
        assert rows[cloud]["hint"] == f"pip install -e '.[{cloud}]' in sftctl's clone"
    table = run("check")
    assert no_traceback(table) and "pip install -e '.[kubernetes]'" in table.stdout
    proc = run("down", "--orphans")
    assert proc.returncode == 0 and no_traceback(proc), proc.stderr
    assert proc.stdout.splitlines() == [f"{c}: skipped ({c}: its SDK ({s}) is not installed)"
                                        for c, s in (("aws", "boto3"), ("gcp", "google.cloud.compute_v1"),
                                                     ("kubernetes", "kubernetes"))]


def test_a_server_configured_without_httpx_names_the_extra(tmp_path, home):
    """A `.[torch]` install pointed at a server: `status` was "internal error: ModuleNotFoundError:
    No module named 'httpx'"; now one line naming the extra, exit 2, as a Postgres state without psycopg."""
    no_httpx = NO_SDKS.replace('("kubernetes", "google", "boto3", "botocore")', '("httpx",)')
    env = {**os.environ, "SFTCTL_SERVER_URL": "http://127.0.0.1:1", "SFTCTL_SERVER_TOKEN": "x"}
    for args in (("status",), ("logs", "some-job"), ("run", "examples/quickstart.yaml", "--detach")):
        proc = subprocess.run([sys.executable, "-c", no_httpx, *args], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=deadline(120))
        assert proc.returncode == 2 and no_traceback(proc), (args, proc.stderr)
        lines = proc.stderr.splitlines()
        assert lines[0] == "error: server.url is http://127.0.0.1:1, but httpx is not installed", proc.stderr
        assert lines[1] == ("hint: pip install 'sftctl[server]' (httpx), or unset server.url "
                            "(SFTCTL_SERVER_URL) to use this machine's state"), proc.stderr


def test_every_read_path_sees_a_dead_controller(tmp_path, home):
    """Item 2: `logs --follow` returns, and `events` shows FAILED_CONTROLLER, once the controller died."""
    spec = write_spec(tmp_path / "sleeper.yaml", SLEEPER)
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    try:
        wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
        wait_for(lambda: "started" in sftctl("logs", job, "--node", "1").stdout, what="node 1's first line")
        from sftctl.state import Store

        os.kill(Store().get_job(job).controller_pid, signal.SIGKILL)
        # events, not status, is the first command run after the controller died
        events = wait_for(lambda: [e for e in json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
                                   if "FAILED_CONTROLLER" in e["message"]], what="events to see the dead controller")
        assert "exited without finishing the job" in events[0]["message"]
        proc = sftctl("logs", job, "--follow", timeout=120)  # the nodes still sleep for minutes
        assert proc.returncode == 0 and "(node 1) started" in proc.stdout
        assert "exited without finishing the job" in proc.stderr and f"sftctl down {job}" in proc.stderr
    finally:
        sftctl("down", job)
    assert job_processes(job) == []


def test_logs_follow_returns_when_the_controller_dies_while_following(tmp_path, home):
    """Item 2: a follower already attached when the controller dies returns too."""
    spec = write_spec(tmp_path / "sleeper.yaml", SLEEPER.replace("nodes: 2", "nodes: 1"))
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    try:
        wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
        follower = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "logs", job, "--follow"], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            from sftctl.state import Store

            os.kill(Store().get_job(job).controller_pid, signal.SIGKILL)
            out, err = follower.communicate(timeout=120)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
        assert follower.returncode == 0 and "exited without finishing the job" in err, err
    finally:
        sftctl("down", job)
    assert job_processes(job) == []


def test_sighup_cancels_an_attached_run_and_tears_it_down(tmp_path, home):
    """Item 3: a closed terminal (SIGHUP) is handled like Ctrl-C: the job is cancelled, the nodes go."""
    spec = write_spec(tmp_path / "sleeper.yaml", SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(spec)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job = wait_for(lambda: (j := status_json()["jobs"]) and j[0]["status"] == "RUNNING" and j[0]["id"],
                       what="RUNNING")
        wait_for(lambda: len(job_processes(job)) >= 2, what="node processes")
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 129, err  # 128 + SIGHUP
    doc = status_json(job)
    assert doc["status"] == "CANCELLED" and doc["failure_reason"] == "cancelled: the terminal closed (SIGHUP)"
    assert all(n["status"] == "TERMINATED" for n in doc["nodes"])
    assert job_processes(job) == []


def test_a_closed_stdout_does_not_end_the_job(tmp_path, home):
    """Item 3: `sftctl run job.yaml | head` : the reader goes away, the job still runs to success."""
    flag = tmp_path / "go"
    spec = write_spec(tmp_path / "talker.yaml", f"""\
name: talker
run: |
  echo first
  while [ ! -e {flag} ]; do sleep 0.1; done
  for i in $(seq 1 200); do echo "line $i"; done
""")
    proc = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(spec)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:  # like head: read a little, then leave
            if "(node 0) first" in line:
                break
        proc.stdout.close()
        flag.write_text("")
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (job,) = status_json()["jobs"]
    assert job["status"] == "SUCCEEDED", job["failure_reason"]
    assert job_processes(job["id"]) == []


def _render(renderable, width: int) -> list[str]:
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, highlight=False).print(renderable)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 120, 200])
def test_plan_table_never_cuts_a_number_and_groups_reasons(tmp_path, width):
    """Item 4: at 80/120/200 columns every price and name is whole, each long reason is printed
    once under the table (before: 1,621 lines at 120 columns for gpt2-small, '21' for 21.96 at 80)."""
    from sftctl.errors import InfeasibleError
    from sftctl.planner import plan
    from sftctl.spec import load_spec
    from sftctl.ui import plan_table

    spec = load_spec(write_spec(tmp_path / "big.yaml", "name: big\nresources: {accelerators: "
                                "[H100:8, H200:8, A100-80GB:8, A100-40GB:8, L4:1, A10G:1, T4:1, V100:1]}\nrun: 'true'\n"))
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("AWS_", "GOOGLE_", "KUBE"))}
    try:
        try:
            candidates = plan(spec).candidates
        except InfeasibleError as e:
            candidates = e.candidates
    finally:
        os.environ.update(env)
    assert len(candidates) >= 10
    lines = _render(plan_table(candidates, 100), width)
    assert all(len(line) <= width for line in lines)
    reasons = {c.rejected.message for c in candidates if c.rejected}
    # the table, its header, the notes (the hidden columns, the reasons, older prices' "!"); a
    # long region name folds where REGION (never hidden, issue 37) has not its whole width
    table = plan_table(candidates, 100)
    shown, widths = table.layout(width)
    w = widths[[c.name for c in table.cols].index("REGION")]
    folded = sum(2 * (len(c.offering.region) > w) for c in candidates)  # a hyphenated name: up to 3 lines
    assert len(lines) <= len(candidates) + 2 * len(reasons) + 6 + folded
    text = "\n".join(lines)
    for c in candidates:
        assert f"{c.usd_per_hour:,.2f}" in text and f"{c.offering.accelerator}:{c.offering.count}" in text
    joined = " ".join(text.split())
    for r in reasons:  # each reason once, folded at word boundaries
        assert joined.count(" ".join(r.split())) == 1, r
    if width == 80:
        assert "hidden at 80 columns" in text


def test_catalog_at_80_columns_keeps_accelerators_and_prices_whole(home):
    """Item 4: `catalog` at 80 columns printed `A100-80GB:` for `A100-80GB:8`."""
    doc = json.loads(sftctl("catalog", "--json", check=True).stdout)["offerings"]
    proc = sftctl("catalog", env={**os.environ, "COLUMNS": "80"}, check=True)
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    for o in doc:
        row = next(line for line in lines  # an instance type is sold in many regions: its own row
                   if line.split()[:2] == [o["provider"], o["instance_type"]] and o["region"] in line.split())
        assert f"{o['accelerator']}:{o['count']}" in row.split()
        assert f"{o['usd_per_hour']:.3f}" in row.split()


def test_text_columns_share_the_width_left_over():
    """compile's kernel table at 150 columns gave KERNEL its whole label and SCHEDULE 20 cells:
    each schedule folded over 7 lines. Two text columns now split the spare width."""
    from types import SimpleNamespace

    from sftctl.ui import kernels_table

    cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "split_k": 1, "num_warps": 8, "BLOCK_K": 64, "num_stages": 4,
           "GROUP_M": 4, "layout": "as_is"}
    k = SimpleNamespace(index=465, label="pointwise pow+sub+sqrt+reciprocal+mul+add+div x444 tensors (multi-tensor)",
                        time_s=1.2e-3, bound="memory", arithmetic_intensity=0.5, roofline_fraction=0.88, config=cfg)
    table = kernels_table([k], top=1)
    shown, widths = table.layout(150)
    kernel, schedule = widths[1], widths[7]
    assert abs(kernel - schedule) <= 1, (kernel, schedule)
    assert len(_render(table, 150)) <= 4  # header + the row over at most 3 lines (was 7)


def test_jobs_and_events_tables_fit_80_columns(home):
    """Item 4: ids, statuses and steps whole; a long reason folds instead of stretching the table."""
    from sftctl.state import JobStatus, Store
    from sftctl.ui import events_table, jobs_table

    store = Store()
    job = store.create_job("a-rather-long-job-name", {"resources": {"nodes": 2}, "train": {"steps": 300}, "run": "x"})
    store.transition(job, JobStatus.FAILED, "node 1 exited with code 137: killed by the kernel's OOM killer " * 3)
    doc = {"id": job, "status": "FAILED", "resources": "local cpu:1 x2", "step": 120, "steps": 300, "loss": 2.123456,
           "tokens_per_s": 12345.0, "created_at": 0.0, "ended_at": 10.0, "restarts": 0,
           "failure_reason": store.get_job(job).failure_reason}
    lines = _render(jobs_table([doc]), 80)
    assert all(len(line) <= 80 for line in lines)
    assert job in lines[1] and "FAILED" in lines[1] and "120/300" in lines[1]
    lines = _render(events_table([e.to_dict() for e in store.events(job)]), 80)
    assert all(len(line) <= 80 for line in lines) and len(lines) > 3


def test_local_jobs_queue_while_the_cpus_are_taken(tmp_path, home, machine_to_ourselves):
    """Item 5: a local job waits PENDING, with a reason and no process, while other local jobs
    hold the machine's CPUs; it runs once they are released."""
    cpus = os.cpu_count() or 1
    hog = write_spec(tmp_path / "hog.yaml", SLEEPER.replace("name: sleeper", "name: hog").replace("nodes: 2", f"nodes: {cpus}"))
    small = write_spec(tmp_path / "small.yaml", "name: small\nrun: echo small ran\n")
    a = json.loads(sftctl("run", str(hog), "--detach", "--json", check=True).stdout)["job_id"]
    b = None
    try:
        wait_for(lambda: status_json(a)["status"] == "RUNNING", what="the first job RUNNING")
        b = json.loads(sftctl("run", str(small), "--detach", "--json", check=True).stdout)["job_id"]
        doc = wait_for(lambda: (d := status_json(b))["pending_reason"] and d, what="the second job to queue")
        assert doc["status"] == "PENDING" and job_processes(b) == []
        assert doc["pending_reason"] == (f"waiting for CPUs: {cpus} of this machine's {cpus} are taken by 1 local "
                                         "job(s), this job needs 1")
        assert doc["pending_reason"] in sftctl("status", env={**os.environ, "COLUMNS": "200"}, check=True).stdout
        sftctl("down", a, check=True)
        done = wait_for(lambda: (d := status_json(b))["status"] in ("SUCCEEDED", "FAILED") and d, what="the second job")
        assert done["status"] == "SUCCEEDED" and done["pending_reason"] is None
        assert "small ran" in sftctl("logs", b, check=True).stdout
        kinds = [e["kind"] for e in json.loads(sftctl("events", b, "--json", check=True).stdout)["events"]]
        # one admission event per wait, whatever reasons follow (issue 27 item 3): the reason may
        # change while it waits (jobs of this home come and go, the machine's free memory moves);
        # `status` shows the current one. The machine is ours only for the exact reason above.
        assert kinds.count("admission") == 1
    finally:
        for job in (a, b):
            if job:
                sftctl("down", job)
    # `down` of an ended job leaves its controller's teardown to finish: give it the time
    for j in (a, b):
        if j:
            wait_for(lambda j=j: job_processes(j) == [], timeout_s=60, what=f"job {j}'s processes to end",
                     report=lambda j=j: process_report(j))


BARRIER_MODEL = '''
import os, time
import torch

def build(batch_size=2, dtype="float32"):
    with open(os.environ["TRACE_LOG"], "a") as f:
        f.write("build\\n")
    # hold this trace until every process has asked for the model: without sharing, all trace
    while open(os.environ["TRACE_LOG"]).read().count("asked") < 3:
        time.sleep(0.05)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(batch_size, 4), torch.randn(batch_size, 2)
    return model, (x, y), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()
'''


@pytest.mark.cold_cache
def test_concurrent_cold_traces_of_one_model_trace_it_once(tmp_path, home):
    """Item 5: three cold runs of one model share its trace (one traces, two wait and read)."""
    (tmp_path / "m.py").write_text(BARRIER_MODEL)
    log = tmp_path / "trace.log"
    code = ("import os, sys; from sftctl.compiler.driver import trace_model\n"
            "open(os.environ['TRACE_LOG'], 'a').write('asked\\n')\n"
            f"g = trace_model('torch', 'm.py:build', {str(tmp_path)!r}, 2, 'float32'); print(len(g.nodes))")
    env = {**os.environ, "TRACE_LOG": str(log)}
    ps = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    try:
        for p in ps:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            outs.append(out.strip())
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(set(outs)) == 1 and int(outs[0]) > 0
    assert log.read_text().count("build") == 1


def test_keep_checkpoints_reaches_the_training_script(tmp_path, home):
    """Item 6: `train.keep_checkpoints: 2` keeps two checkpoints (it kept 3 whatever the spec said)."""
    spec = write_spec(tmp_path / "keep.yaml", """\
name: keep
train: {keep_checkpoints: 2}
run: |
  "$SFTCTL_PYTHON" -c "
  import os, sftctl.train as t
  for s in range(5):
      t.save_checkpoint({'step': s}, s)
  print('kept', sorted(os.listdir(os.environ['SFTCTL_CHECKPOINT_DIR'])))
  "
""")
    proc = sftctl("run", str(spec), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "kept ['step-00000003', 'step-00000004']" in sftctl("logs", json.loads(proc.stdout)["id"], check=True).stdout


def _one_clear_line(proc, *needles):
    assert proc.returncode == 2 and no_traceback(proc), proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and len(error[0]) < 300, proc.stderr[:1000]
    for n in needles:
        assert n in error[0], error[0]
    return error[0]


def test_hostile_specs_get_one_line_and_exit_2(tmp_path, home):
    """Item 10: huge numbers, deep nesting, FIFOs, devices and huge files: one line, exit 2,
    nothing read that is not a regular file of sensible size, never a hang or a traceback."""
    ok = write_spec(tmp_path / "ok.yaml", "name: ok\nrun: echo\n")
    _one_clear_line(sftctl("plan", str(ok), "--set", "train.steps=" + "9" * 5000, timeout=60),
                    "--set train.steps=999", "5,000 digits")
    big_int = write_spec(tmp_path / "int.yaml", "name: ok\nrun: echo\ntrain: {steps: " + "9" * 5000 + "}\n")
    _one_clear_line(sftctl("plan", str(big_int), timeout=60), "train.steps")
    flow = write_spec(tmp_path / "flow.yaml", "name: ok\nrun: echo\nenv: " + "[" * 500 + "]" * 500 + "\n")
    _one_clear_line(sftctl("plan", str(flow), timeout=60), "flow.yaml:3: nested more than 32 levels deep")
    block = write_spec(tmp_path / "block.yaml", "name: ok\nrun: echo\nenv:\n" +
                       "".join("  " * (i + 1) + f"k{i}:\n" for i in range(500)))
    _one_clear_line(sftctl("plan", str(block), timeout=60), "nested more than 32 levels deep")
    _one_clear_line(sftctl("plan", str(ok), "--set", "env={a: " + "[" * 500 + "}", timeout=60), "nested")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    _one_clear_line(sftctl("plan", str(fifo), timeout=60), "is a FIFO")
    for dev in ("/dev/zero", "/dev/urandom"):
        _one_clear_line(sftctl("plan", dev, timeout=60), f"{dev}: is a device")
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as f:
        f.write(b"name: ok\nrun: echo\n")
        f.truncate(100 * 2**20)  # 100 MB without writing them
    _one_clear_line(sftctl("plan", str(huge), timeout=60), "104,857,600 bytes")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(bytes(range(256)) * 10)
    _one_clear_line(sftctl("plan", str(binary), timeout=60), "not UTF-8")


def test_markup_and_emoji_codes_in_user_input_print_as_typed(tmp_path, home):
    """Item 10: rich never renders markup or emoji codes that come from the user."""
    spec = write_spec(tmp_path / "m.yaml", 'name: "[bold]x[/bold]:smile:"\nrun: echo\n')
    line = _one_clear_line(sftctl("plan", str(spec), timeout=60), "name:")
    assert "[bold]x[/bold]:smile:" in line and "\U0001f604" not in line


def test_a_long_held_write_lock_does_not_fail_a_healthy_job(tmp_path, home):
    """Item 12: the controller waits for state.db's write lock instead of failing the job (and
    killing its nodes) when another process holds it past the busy timeout."""
    import sqlite3

    flag = tmp_path / "go"
    spec = write_spec(tmp_path / "w.yaml", f"name: waiter\nrun: |\n  while [ ! -e {flag} ]; do sleep 0.1; done\n  echo done\n")
    env = {**os.environ, "SFTCTL_STATE_BUSY_TIMEOUT_MS": "200"}  # a minute, shortened
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", env=env, check=True).stdout)["job_id"]
    wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
    log = home / "jobs" / job / "controller.log"
    holder = sqlite3.connect(home / "state.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # a writer that holds on
        flag.write_text("")
        wait_for(lambda: "the state database is locked by another process" in log.read_text(),
                 what="the controller to wait for the lock")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    doc = wait_for(lambda: (d := status_json(job))["status"] not in ("RUNNING", "LAUNCHING") and d, what="the end")
    assert doc["status"] == "SUCCEEDED", doc["failure_reason"]
    # the controller records the end, then tears the nodes down: give it the time
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end",
             report=lambda: process_report(job))


def _failure_reason(tmp_path, name: str, run: str, extra: str = "") -> str:
    spec = write_spec(tmp_path / f"{name}.yaml", f"name: {name}\n{extra}run: |\n" +
                      "".join(f"  {line}\n" for line in run.splitlines()))
    proc = sftctl("run", str(spec), "--json")
    assert proc.returncode == 1, proc.stderr
    return json.loads(proc.stdout)["failure_reason"]


def test_failure_reasons_say_what_happened(tmp_path, home):
    """Item 14: the reason names the exception (torchelastic's error file), the rank, the signal,
    not only "exited with code 1"."""
    reason = _failure_reason(tmp_path, "raiser", "\"$SFTCTL_PYTHON\" -c \"import sftctl.train; raise ValueError('bad batch 7')\"")
    assert reason == "node 0 exited with code 1: rank 0: ValueError: bad batch 7"
    reason = _failure_reason(tmp_path, "readonly", "\"$SFTCTL_PYTHON\" -c \"import sftctl.train as t; t.save_checkpoint({'a': 1}, 1)\"",
                             extra="train: {checkpoint_dir: /sys/sftctl-checkpoints}\n")
    assert reason.startswith("node 0 exited with code 1: rank 0: PermissionError: ") and "/sys/sftctl-checkpoints" in reason
    reason = _failure_reason(tmp_path, "killed", "\"$SFTCTL_PYTHON\" -c \"import os, signal; os.kill(os.getpid(), signal.SIGKILL)\"")
    assert reason == "node 0 exited with code 137: killed by SIGKILL (signal 9)"
    (tmp_path / "two.py").write_text("import os, time\nimport sftctl.train\n"
                                     "if os.environ['RANK'] == '1':\n    raise RuntimeError('rank 1 failed on purpose')\n"
                                     "time.sleep(120)\n")
    reason = _failure_reason(tmp_path, "ranks", f"torchrun --standalone --nproc-per-node=2 {tmp_path / 'two.py'}")
    assert reason == "node 0 exited with code 1: rank 1: RuntimeError: rank 1 failed on purpose"


def test_failure_reason_comes_from_the_nodes_record_not_its_log(tmp_path, home):
    """The node writes why it failed as a record (code, line, data) the controller reads; a run
    that prints sftctl's own "failed:" line cannot put words in the job's reason any more."""
    from sftctl import failure
    from sftctl.types import FailureCode

    reason = _failure_reason(tmp_path, "spoof", "echo '[sftctl] node 0: failed: spoofed by the script'\nexit 3")
    assert reason == "node 0 exited with code 3"
    record = tmp_path / "failure-1.json"
    assert failure.main(["137", "", "", str(record)]) == 0
    why = failure.read_record(record.read_bytes())
    assert why.code is FailureCode.SIGNAL and why.data == {"exit_code": 137, "signal": 9}
    assert why.message == "killed by SIGKILL (signal 9)"
    assert failure.read_record(b"{not json") is None and failure.read_record(b"") is None


def test_the_oom_killer_is_named_when_the_kernel_counter_rose(tmp_path):
    """Item 14: a run killed while the kernel's OOM-kill counter rose is reported as out of memory
    (the counter is read the way the node reads it; no test can OOM the machine)."""
    from sftctl import failure

    now = failure.oom_kills()
    if now is None:
        pytest.skip("this kernel reports no oom_kill counter")
    assert failure.describe(137, None, oom_before=now) == "killed by SIGKILL (signal 9)"
    assert failure.describe(137, None, oom_before=now - 1) == \
        "a process was killed by the kernel's OOM killer (out of memory)"
    assert failure.describe(3, None, oom_before=now) is None


def test_rendezvous_ports_are_claimed_outside_the_ephemeral_range(tmp_path, monkeypatch):
    """Item 15: the port was bound at 0 and released (the kernel could give it to anyone before
    torchrun bound it). Now it comes from below the ephemeral range, claimed machine-wide; a
    port something listens on is skipped; a released port can be claimed again."""
    import socket

    from sftctl.controller import ports

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # a claims registry of this test's own
    lo, _ = ports._ephemeral_range()
    a = ports.claim_rendezvous_port("job-a")
    b = ports.claim_rendezvous_port("job-a")  # the same start: the claim makes it move on
    assert a != b and all(lo - ports.RDZV_PORTS <= p < lo for p in (a, b))
    ports.release_rendezvous_port(a)
    with socket.socket() as busy:  # someone else listens on the port job-a would get first
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("0.0.0.0", a))
        busy.listen()
        c = ports.claim_rendezvous_port("job-a")
    assert c not in (a, b)
    for p in (b, c):
        ports.release_rendezvous_port(p)
    assert ports.claim_rendezvous_port("job-a") == a


def test_a_checkpoint_dir_of_another_job_is_refused_unless_resumed_from(tmp_path, home):
    """Item 16: a second job with the same train.checkpoint_dir silently resumed the first
    job's weights. Now it is refused, naming the owner; train.resume_from continues it."""
    ckpt = tmp_path / "ckpt"
    run = ("\"$SFTCTL_PYTHON\" -c \"import sftctl.train as t; r = t.load_latest_checkpoint(); "
           "print('resumed', r and r[0]); t.save_checkpoint({'w': 1}, 5)\"")
    spec = write_spec(tmp_path / "c.yaml", f"name: c\ntrain: {{checkpoint_dir: {ckpt}}}\nrun: |\n  {run}\n")
    first = json.loads(sftctl("run", str(spec), "--json", check=True).stdout)["id"]
    assert "resumed None" in sftctl("logs", first, check=True).stdout
    proc = sftctl("run", str(spec), "--json")
    assert proc.returncode == 2 and no_traceback(proc)
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line == (f"error: train.checkpoint_dir: {ckpt} holds checkpoints of job {first} (up to step 5); "
                    "this job would resume from them")
    assert f"train.resume_from: {first}" in proc.stderr
    assert len(status_json()["jobs"]) == 1  # nothing was created
    wrong = sftctl("run", str(spec), "--set", "train.resume_from=other-123456")
    assert wrong.returncode == 2 and f"holds the checkpoints of job {first}" in wrong.stderr
    second = json.loads(sftctl("run", str(spec), "--set", f"train.resume_from={first}", "--json", check=True).stdout)["id"]
    assert "resumed 5" in sftctl("logs", second, check=True).stdout
    assert (ckpt / ".sftctl-job").read_text().strip() == second  # the dir now holds the second job's


def _loose_files(*roots) -> list[str]:
    out = []
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for f in files:
                p = os.path.join(dirpath, f)
                if not os.path.islink(p) and os.stat(p).st_mode & 0o077:
                    out.append(f"{oct(os.stat(p).st_mode & 0o777)} {p}")
    return out


def test_job_files_are_owner_only_in_an_existing_open_home(tmp_path, home):
    """Item 17: in an existing $SFTCTL_HOME (or storage directory) of mode 0755, logs, scripts and
    checkpoints were created world-readable; now every file is owner-only."""
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    os.chmod(store, 0o755)
    run = "\"$SFTCTL_PYTHON\" -c \"import sftctl.train as t; t.report(1, loss=1.0); t.save_checkpoint({'w': 1}, 1)\""
    (tmp_path / "w").mkdir()
    spec = write_spec(tmp_path / "w" / "modes.yaml", f"name: modes\nrun: |\n  {run}\n")
    sftctl("run", str(spec), "--json", check=True)
    sftctl("run", str(spec), "--json", "--set", f"storage={store}", check=True)
    assert any(p.name == "node.log" for p in home.rglob("node.log"))
    assert list(store.rglob("MANIFEST.json"))
    loose = _loose_files(home, store)
    assert loose == [], "\n".join(loose)


def test_the_agent_serves_metrics_on_loopback_by_default(tmp_path):
    """Item 17: /metrics (no authentication) bound 0.0.0.0; now 127.0.0.1 unless the spec's
    health.metrics_address says otherwise."""
    import socket

    from sftctl import agent
    from sftctl.spec import load_spec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert agent.main(["--port", str(port), "--count", "1", "--interval", "0.05",
                       "--out", str(tmp_path / "health.jsonl")]) == 0
    listening = [line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:]
                 if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"]
    assert listening == [f"0100007F:{port:04X}"]
    spec = write_spec(tmp_path / "h.yaml", "name: h\nrun: echo\nhealth: {metrics_address: 0.0.0.0}\n")
    assert load_spec(spec).health.metrics_address == "0.0.0.0"
    from sftctl.errors import SpecError

    with pytest.raises(SpecError, match="metrics_address: must be an IP address"):
        load_spec(write_spec(tmp_path / "bad.yaml", "name: h\nrun: echo\nhealth: {metrics_address: everywhere}\n"))


def test_help_conventions_completion_and_debug(home):
    """Item 19: completion is offered, help shows no Python types, compile --target is shown as
    required, --debug is documented and keeps a usage error's exit code (2, not 1)."""
    import re

    root = sftctl("--help", check=True).stdout
    assert "--install-completion" in root and "--show-completion" in root and "--debug" in root
    commands = ["run", "plan", "catalog", "compile", "check", "status", "logs", "down", "events"]
    for c in commands:
        text = sftctl(c, "--help", check=True).stdout
        assert not re.search(r"<(str|int|float|path|bool|list\[[^\]]*\])>", text), (c, text)
    compile_help = " ".join(sftctl("compile", "--help", check=True).stdout.split())
    assert "-t, --target ACCELERATOR Accelerator, e.g. h100, a100-80gb, mi300x, cpu. [required]" in compile_help
    # typer finds the shell among the parent processes (shellingham) and takes --show-completion as a
    # flag; a suite started with setsid or nohup has no shell above it ("Shell  not supported."), so
    # the command runs under bash here, as a user's terminal runs it
    shown = subprocess.run(["bash", "-c", '"$0" -m sftctl.cli --show-completion; exit $?', sys.executable],
                           capture_output=True, text=True, cwd=REPO, timeout=deadline(120))
    assert shown.returncode == 0 and "complete -o default -F _sftctl_completion sftctl" in shown.stdout, shown.stderr
    proc = sftctl("status", "no-such-job", "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert "error: no job 'no-such-job'" in proc.stderr


def test_json_errors_are_one_json_object(tmp_path, home):
    """Item 22: with --json a failing command prints one JSON object on stdout too."""
    for args in (("status", "nope", "--json"), ("events", "nope", "--json"), ("status", "--json", "--bogus"),
                 ("run", str(tmp_path / "missing.yaml"), "--json"), ("check", "mars", "--json")):
        proc = sftctl(*args)
        doc = json.loads(proc.stdout)  # the whole of stdout is one document
        assert set(doc) == {"error", "hint", "exit_code"} and doc["exit_code"] == proc.returncode == 2, (args, doc)
        assert proc.stderr.startswith("error: " + doc["error"])
    # a command that printed its own document does not add a second one
    spec = write_spec(tmp_path / "big.yaml", "name: big\nresources: {accelerators: [H100:8], clouds: [local]}\nrun: x\n")
    proc = sftctl("plan", str(spec), "--json")
    assert proc.returncode == 3 and "candidates" in json.loads(proc.stdout)


def test_plan_json_of_an_infeasible_job_has_the_plan_and_the_error_keys(tmp_path, home):
    """plan --json exiting non-zero: the plan's keys (scripts want the candidates and why) and
    the error, hint and exit_code every failing --json command prints."""
    spec = write_spec(tmp_path / "big.yaml", "name: big\nresources: {accelerators: [H100:8], clouds: [local]}\nrun: x\n")
    proc = sftctl("plan", str(spec), "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == doc["exit_code"] == 3
    # no_step_time: the spec has no model, so the plan says why it has no TIME or TOTAL $ (208dc03's line)
    assert {"job", "objective", "steps", "chosen", "reason", "candidates", "catalog", "error", "hint", "exit_code",
            "no_step_time"} == set(doc)
    assert doc["chosen"] is None and doc["candidates"] and all(c["rejected"] for c in doc["candidates"])
    assert doc["error"] == doc["reason"] and proc.stderr.startswith(f"error: {doc['error']}") and doc["hint"]
    ok = write_spec(tmp_path / "ok.yaml", "name: ok\nresources: {clouds: [local]}\nrun: x\n")
    doc = json.loads(sftctl("plan", str(ok), "--json", check=True).stdout)
    assert "error" not in doc and doc["chosen"] is not None  # a plan that succeeded has no error keys


def test_check_exits_0_when_something_works_and_4_when_a_named_cloud_does_not(home, tmp_path):
    """Like `sky check`: a local-only user does not see a failed check; a cloud asked for by name
    that does not work is exit 4. The document shows every cloud asked for either way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "KUBE", "CLOUDSDK", "SLURM"))}
    env.update(HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "none"), SLURM_CONF=str(tmp_path / "no-slurm.conf"))
    for args, code, clouds in ((("check",), 0, ["local", "aws", "gcp", "kubernetes", "slurm"]),
                               (("check", "local"), 0, ["local"]),
                               (("check", "aws"), 4, ["aws"]),
                               (("check", "local", "aws"), 4, ["local", "aws"])):
        proc = sftctl(*args, "--json", env=env)
        assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        doc = json.loads(proc.stdout)
        rows = doc["clouds"]
        assert [r["cloud"] for r in rows] == clouds and [r["ok"] for r in rows] == [c == "local" for c in clouds]
        # a failing --json command says what failed, what to do and its exit code, as every other
        assert (doc.get("exit_code"), "aws: no credentials" in (doc.get("error") or "")) == \
            ((4, True) if code else (None, False)), doc
    table = sftctl("check", env=env)
    assert table.returncode == 0 and "aws" in table.stdout and "no credentials" in table.stdout


def test_dry_run_renders_everything_and_starts_nothing(tmp_path, home):
    """Item 20: run --dry-run shows the plan, what would be provisioned and each node's scripts
    and environment (secrets masked), and creates or starts nothing."""
    spec = write_spec(tmp_path / "dry.yaml", "name: dry\nresources: {nodes: 2}\nsecrets: [SFTCTL_DRY_TOKEN]\n"
                      "run: echo hello from $SFTCTL_NODE_RANK\n")
    env = {**os.environ, "SFTCTL_DRY_TOKEN": "s3cr3t-value"}
    proc = sftctl("run", str(spec), "--dry-run", "--json", env=env, check=True)
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] is True and doc["plan"].startswith("chose local localhost (cpu:1) x 2 node(s)")
    assert [n["rank"] for n in doc["nodes"]] == [0]  # node 0 in full, the others summarised (issue 26)
    for n in doc["nodes"]:
        assert n["env"]["SFTCTL_NODE_RANK"] == str(n["rank"]) and n["env"]["SFTCTL_DRY_TOKEN"] == "<secret>"
        assert n["env"]["SFTCTL_PARALLELISM"] == "ddp"  # from the plan, as the launched node gets it
        assert "echo hello from $SFTCTL_NODE_RANK" in n["script"] and n["bootstrap"] is None
    assert doc["other_nodes"]["count"] == 1 and "SFTCTL_NODE_RANK" in doc["other_nodes"]["env_differs"]
    text = sftctl("run", str(spec), "--dry-run", env=env, check=True).stdout
    assert "dry run: nothing was created or started" in text and "node 0: attempt script (node.sh)" in text
    assert "node 1: as node 0, except" in text
    assert "s3cr3t-value" not in proc.stdout + text
    assert status_json()["jobs"] == [] and not (home / "jobs").exists()


def test_torchrun_needs_no_rendezvous_flags(tmp_path, home):
    """Item 21: `run: torchrun train.py` forms the job's world from the PET_* variables sftctl
    exports on every node."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "hello.py").write_text(
        "import os\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print(f\"rank {dist.get_rank()} of {dist.get_world_size()}\", flush=True)\n"
        "dist.barrier()\ndist.destroy_process_group()\n")
    spec = write_spec(tmp_path / "w" / "tr.yaml", "name: tr\nresources: {nodes: 2}\nhealth: {enabled: false}\n"
                      "run: torchrun hello.py\n")
    proc = sftctl("run", str(spec), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sftctl("logs", json.loads(proc.stdout)["id"], check=True).stdout
    assert "rank 0 of 2" in logs and "rank 1 of 2" in logs


def test_the_attached_run_and_status_show_the_same_loss(home):
    """Item 23: the attached view showed rank 0's loss, status the mean over ranks; both show the
    mean over the ranks' latest reports now."""
    import io

    from rich.console import Console

    from sftctl import api
    from sftctl.state import Store
    from sftctl.ui import RunView

    samples = [{"rank": 0, "step": 1, "loss": 5.0}, {"rank": 1, "step": 1, "loss": 6.0},
               {"rank": 0, "step": 2, "loss": 2.0}, {"rank": 1, "step": 2, "loss": 4.0}]
    with RunView(Console(file=io.StringIO()), 10) as view:
        view.metrics(samples)
    store = Store()
    job = store.create_job("l", {"resources": {"nodes": 2}, "train": {"steps": 10}, "run": "x"})
    store.record_metrics(job, samples)
    doc = api.status(job).to_dict()
    assert view.last_loss == doc["loss"] == 3.0
    assert view.first_loss == 5.5


def test_readme_spec_block_shows_the_real_defaults():
    """Item 23: the annotated spec block (README's, now docs/getting-started.md's) said
    max_restarts: 1; the default is 0."""
    import re

    from sftctl.spec import JobSpec

    readme = (REPO / "docs" / "getting-started.md").read_text()
    block = readme.split("## The job spec", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    defaults = JobSpec.model_validate({"name": "x", "run": "x"})
    assert re.search(rf"max_restarts: {defaults.recovery.max_restarts}\b", block)
    assert re.search(rf"keep_checkpoints: {defaults.train.keep_checkpoints}\b", block)
    for section, fields in (("train", ("steps", "checkpoint_interval", "keep_checkpoints")),
                            ("resources", ("nodes",)), ("health", ("interval_s", "throttle_window_s", "hang_timeout_s",
                                                                   "straggler_window_steps", "straggler_windows"))):
        for field in fields:
            value = getattr(getattr(defaults, section), field)
            value = int(value) if float(value).is_integer() else value
            assert re.search(rf"\b{field}: {value}\b", block), f"{section}.{field}: {value}"


def test_logs_of_a_node_that_does_not_exist_names_the_nodes(tmp_path, home):
    """Item 24: `logs --node 5` on a 2-node job says which nodes exist (with --follow it waited)."""
    spec = write_spec(tmp_path / "two.yaml", "name: two\nresources: {nodes: 2}\nrun: echo hi\n")
    job = json.loads(sftctl("run", str(spec), "--json", check=True).stdout)["id"]
    for extra in ((), ("--follow",)):
        proc = sftctl("logs", job, "--node", "5", *extra, timeout=60)
        assert proc.returncode == 2 and no_traceback(proc)
        assert proc.stderr.splitlines()[0] == f"error: --node 5: job {job} has 2 node(s): nodes 0-1"


def test_logs_of_a_job_no_node_has_started_says_why_it_is_empty(tmp_path, home):
    """`logs` of a submitted job whose nodes have not started printed nothing and exited 0: it
    still exits 0 with nothing on stdout, and one line on stderr says the job's status; and
    `status --watch --json` without one JOB (it would wait for nothing) is a usage error."""
    from sftctl import api

    spec = write_spec(tmp_path / "one.yaml", "name: one\nrun: echo hi\n")
    job = api.submit(str(spec)).job_id  # submitted, never started: PENDING
    proc = sftctl("logs", job)
    assert proc.returncode == 0 and proc.stdout == "" and no_traceback(proc)
    assert proc.stderr.strip() == f"{job} is PENDING: no node has written output yet; sftctl logs -f {job} waits for it"
    proc = sftctl("status", "--watch", "--json")
    assert proc.returncode == 2 and no_traceback(proc)
    assert proc.stderr.splitlines()[0] == ("error: --watch --json waits for one job to end, then prints its document: "
                                           "give one JOB")


def test_secrets_interpolated_into_env_are_stored_as_references(tmp_path, home):
    """Issue 14 item 9: a secret interpolated into env: (or named in secrets:) reaches the node,
    but its value is in no byte of state.db (jobs, events), the logs, node scripts or storage
    that sftctl writes under SFTCTL_HOME; state keeps the `${MY_API_TOKEN}` reference."""
    token, other = "tok-" + os.urandom(12).hex(), "sec-" + os.urandom(12).hex()
    (tmp_path / "spec").mkdir()
    out = tmp_path / "seen"
    out.mkdir()
    spec = write_spec(tmp_path / "spec" / "leak.yaml",
                      'name: leak\nsecrets: [SFTCTL_T_OTHER]\nenv: {X: "${SFTCTL_T_TOKEN}", Y: "a-${SFTCTL_T_TOKEN}-b",'
                      ' Z: "$${SFTCTL_T_TOKEN}", W: "${SFTCTL_T_UNSET:-dflt}"}\n'
                      f'run: printf "%s|%s|%s|%s|%s" "$X" "$Y" "$Z" "$W" "$SFTCTL_T_OTHER" > {out}/node$SFTCTL_NODE_RANK\n')
    env = {**os.environ, "SFTCTL_T_TOKEN": token, "SFTCTL_T_OTHER": other}
    env.pop("SFTCTL_T_UNSET", None)
    dry = sftctl("run", str(spec), "--dry-run", "--json", env=env, check=True).stdout
    assert token not in dry and other not in dry
    assert json.loads(dry)["nodes"][0]["env"]["X"] == "${SFTCTL_T_TOKEN}"
    proc = sftctl("run", str(spec), "--json", env=env, check=True)
    assert (out / "node0").read_text() == f"{token}|a-{token}-b|${{SFTCTL_T_TOKEN}}|dflt|{other}"
    assert token not in proc.stdout + proc.stderr and other not in proc.stdout + proc.stderr
    files = [p for p in home.rglob("*") if p.is_file()]
    assert home / "state.db" in files and len(files) > 3
    for p in files:
        data = p.read_bytes()
        assert token.encode() not in data and other.encode() not in data, p
    job = status_json()["jobs"][0]
    stored = sftctl("status", job["id"], "--json", env=env, check=True).stdout
    assert token not in stored and "${SFTCTL_T_TOKEN}" in (home / "state.db").read_bytes().decode("latin-1")


@pytest.mark.parametrize("width", [80, 120])
def test_status_rows_stay_one_line_and_labels_go_before_loss(home, width):
    """`sftctl status` at 80 columns folded NOTE and LABELS over several lines per job and hid LOSS
    while it kept LABELS. Now each job is one line, LABELS is hidden before LOSS, and a cut note
    says where the whole one is."""
    from sftctl.state import JobStatus, Store

    store = Store()
    reason = "node 1 exited with code 137: killed by the kernel's OOM killer; lower train.batch_size"
    ids = []
    for i, (lr, status) in enumerate([("1e-3", JobStatus.SUCCEEDED), ("1e-2", JobStatus.FAILED),
                                      ("3e-2", JobStatus.CANCELLED)]):
        job = store.create_job(f"sweep-lr-{i}", {"resources": {"nodes": 2}, "train": {"steps": 300}, "run": "x",
                                                 "labels": {"sweep": "lr", "lr": lr, "team": "vision-research"}})
        for step in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING):
            store.transition(job, step)
        store.transition(job, status, reason if status == JobStatus.FAILED else None)
        ids.append(job)
    out = sftctl("status", env={**os.environ, "COLUMNS": str(width)}, check=True).stdout
    lines = out.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    header = lines[0].split()
    assert "LOSS" in header and "NOTE" in header
    for job in ids:  # one line each: the id once, and no line that continues a row
        assert sum(job in line for line in lines) == 1, out
    rows = [line for line in lines if line.split() and line.split()[0] in ids]
    assert lines[1:1 + len(ids)] == rows, out  # the rows follow the header, nothing between them
    failed = next(line for line in rows if "FAILED" in line)
    assert failed.rstrip().endswith("…") and "node 1 exited" in failed
    assert "NOTE cut at" in out and "sftctl status JOB" in out
    if width == 80:
        assert "LABELS" not in header and "LABELS" in out.split("hidden at 80 columns:")[1]
    else:  # room for the labels whole once AGE, DURATION and COST are hidden
        assert "LABELS" in header
        assert all(f"lr={lr} team=vision-research" in out for lr in ("1e-3", "1e-2", "3e-2"))


@pytest.mark.parametrize("final_checkpoint", [True, False])
def test_an_abort_after_the_last_step_and_checkpoint_is_not_a_failed_job(tmp_path, home, final_checkpoint):
    """A rank that trained every step and saved the final checkpoint, then aborted in torch's
    teardown (SIGABRT at interpreter exit, sftctl/train/finish.py), turned the job FAILED. Now
    such a job SUCCEEDED with a `teardown_exit` event; without the final checkpoint it still fails."""
    last = 4 if final_checkpoint else 3
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: teardown
train: {{steps: 4}}
recovery: {{max_restarts: 0}}
run: |
  "$SFTCTL_PYTHON" -c "
  import os, sftctl.train as t
  for s in range(1, 5):
      t.report(s, 1.0 / s)
      if s <= {last}:
          t.save_checkpoint({{'step': s}}, s)
  os.abort()
  "
""")
    proc = sftctl("run", str(spec), "--json")
    doc = json.loads(proc.stdout)
    events = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    teardown = [e for e in events if e["kind"] == "teardown_exit"]
    if final_checkpoint:
        assert (proc.returncode, doc["status"]) == (0, "SUCCEEDED"), proc.stdout + proc.stderr
        assert len(teardown) == 1 and "exited with code 134" in teardown[0]["message"], events
        assert "final checkpoint (step 4)" in teardown[0]["message"]
    else:
        assert (proc.returncode, doc["status"]) == (1, "FAILED"), proc.stdout + proc.stderr
        assert teardown == [] and "134" in doc["failure_reason"]


def test_the_measured_step_time_counts_steps_not_ranks_times_steps(home):
    """The quickstart's summary said "median of 594 steps" for 300 steps on 2 ranks (it counted
    each rank's report); it says steps and ranks apart now, in the event and in `status JOB`."""
    quickstart = str(REPO / "examples" / "quickstart.yaml")
    proc = sftctl("run", quickstart, "--set", "train.steps=10", "--set", "train.checkpoint_interval=5", "--json")
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED", proc.stdout[-2000:] + proc.stderr[-2000:]
    events = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    (measured,) = [e for e in events if e["kind"] == "measured"]
    assert measured["data"]["measured_steps"] == 14  # reports: 2 ranks x (10 - 3 warm-up/checkpoint steps)
    assert "(median of 7 steps x 2 ranks after warm-up)" in measured["message"], measured["message"]
    detail = sftctl("status", doc["id"], check=True).stdout
    assert "(median of 7 steps x 2 ranks after warm-up)" in detail, detail


def test_check_imports_the_providers_in_one_thread(tmp_path, home):
    """`sftctl check` asks every cloud in parallel threads; each importing its provider there could
    deadlock on sftctl.catalog, whose __init__ imports sftctl.catalog.identity, which the providers
    import too (seen under load: "internal error: _DeadlockError: deadlock detected by
    _ModuleLock('sftctl.catalog.identity')"), and two SDKs importing requests at once see it half
    initialised (CI: "cannot import name 'parse_dict_header' from partially initialized module").
    A fresh interpreter records the thread that imports each sftctl module, each SDK and the
    packages they share during api.check: all the main thread."""
    probe = textwrap.dedent("""\
        import json, sys, threading
        SDKS = ("google.cloud.compute_v1", "kubernetes", "boto3")
        seen = {}
        class _Where:
            def find_spec(self, name, path=None, target=None):
                if name.startswith(("sftctl.", "requests", "urllib3")) or name in SDKS:
                    seen.setdefault(name, threading.current_thread() is threading.main_thread())
                return None
        sys.meta_path.insert(0, _Where())
        from sftctl import api
        before = set(seen)
        api.check()
        print(json.dumps({n: main for n, main in seen.items() if n not in before}))
    """)
    env = _credentials_everywhere(tmp_path)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported = json.loads(proc.stdout.splitlines()[-1])
    assert "sftctl.providers.kubernetes" in imported or "sftctl.providers.gcp" in imported, imported
    assert "google.cloud.compute_v1" in imported and "kubernetes" in imported, sorted(imported)
    assert sorted(n for n, main in imported.items() if not main) == []
