"""Scripts and labs (issue 23 items 5-8, 12-15; issue 28 item 8): each test here failed before its fix."""

from __future__ import annotations

import json

import pytest

from conftest import sftctl, wait_for, write_spec


def _detach(tmp_path, name: str, run: str, nodes: int = 1) -> str:
    from sftctl import api

    spec = write_spec(tmp_path / f"{name}.yaml", f"name: {name}\nresources: {{nodes: {nodes}}}\nrun: |\n  {run}\n")
    return api.run(str(spec), detach=True).id


def test_wait_exits_by_how_the_jobs_ended_and_logs_exit_code(tmp_path, home):
    """Item 6: `sftctl wait` exits 0 when every job SUCCEEDED, 1 when one did not, 124 on
    --timeout; `logs --exit-code` follows and exits 1 for a FAILED job (plain --follow exits 0)."""
    ok = _detach(tmp_path, "ok", "echo fine")
    bad = _detach(tmp_path, "bad", "echo oops; exit 3")
    proc = sftctl("wait", ok, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{ok} SUCCEEDED"]
    proc = sftctl("wait", ok, bad, "--json", timeout=600)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert [(j["id"], j["status"], j["terminal"]) for j in doc["jobs"]] == [(ok, "SUCCEEDED", True), (bad, "FAILED", True)]
    assert sftctl("logs", bad, "--follow").returncode == 0  # as before: scripts need --exit-code
    proc = sftctl("logs", bad, "--exit-code")
    assert proc.returncode == 1 and "oops" in proc.stdout
    assert sftctl("logs", ok, "--exit-code").returncode == 0

    slow = _detach(tmp_path, "slow", "sleep 300")
    try:
        proc = sftctl("wait", ok, slow, "--timeout", "1")
        assert proc.returncode == 124, proc.stderr
        assert f"job {slow} is still" in proc.stderr and "the job goes on" in proc.stderr
        assert json.loads(sftctl("status", slow, "--json").stdout)["terminal"] is False
    finally:
        sftctl("down", slow)
    assert sftctl("wait", "no-such-job").returncode == 2


def _readme_shell_sweep() -> str:
    import re

    from conftest import REPO

    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (code,) = [b for b in blocks if "sftctl wait $ids" in b]
    return code


def test_readme_shell_sweep_runs_and_waits(home):
    """Item 6: the README's shell sweep, exactly as written (each `run` shortened to 3 steps on
    one node by a shell function in front of it), ends with `sftctl wait` exit 0."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    code = _readme_shell_sweep()
    assert "sftctl wait $ids" in code
    shorten = ('sftctl() { if [ "$1" = run ]; then "$PY" -m sftctl.cli "$@" --set train.steps=3 --set resources.nodes=1; '
               'else "$PY" -m sftctl.cli "$@"; fi; }\nset -e\n')
    proc = subprocess.run(["bash", "-c", shorten + code + "\necho \"waited: $?\""], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PY": sys.executable}, timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["SUCCEEDED", "SUCCEEDED"], proc.stdout
    assert lines[-1] == "waited: 0" and "a run did not succeed" not in proc.stdout


def _job(store, name: str, nodes: int, status: str = "PENDING", deadline: str | None = None):
    import os

    from sftctl.state import JobStatus

    res = {"nodes": nodes, **({"deadline": deadline} if deadline else {})}
    job = store.create_job(name, {"name": name, "run": "true", "resources": res})
    store.update_job(job, provider="local", controller_pid=os.getpid())
    if status != "PENDING":
        store.transition(job, JobStatus.PROVISIONING)
    return store.get_job(job)


def test_the_local_queue_is_fifo_and_backfills_only_what_ends_in_time(home):
    """Item 5: a later job that fits does not pass an earlier one that does not (no starvation
    of a big job by a stream of small ones), unless its deadline ends it before the head's
    reserved start (Slurm's backfill)."""
    import os

    import pytest

    from sftctl.queue import admission
    from sftctl.state import JobStatus, Store

    cpus = os.cpu_count() or 1
    if cpus < 2:
        pytest.skip("needs 2 CPUs: one held, one free")
    store = Store()
    forever = _job(store, "forever", cpus - 1, status="PROVISIONING")  # no deadline: may run for ever
    big = _job(store, "big", cpus)  # submitted first, needs every CPU
    small = _job(store, "small", 1)
    quick = _job(store, "quick", 1, deadline="2m")
    assert admission(store, big, []).startswith("waiting for CPUs")
    why = admission(store, small, [])
    assert why == (f"queued behind {big.id} (submitted first, needs {cpus} of this machine's {cpus} CPUs): first "
                   "come, first served; a later job goes first only when its deadline ends it in time")
    # behind a job without a deadline the head's start is unknown: nothing is backfilled
    assert admission(store, quick, []) == why
    store.transition(forever.id, JobStatus.CANCELLED, "test")
    _job(store, "running", cpus - 1, status="PROVISIONING", deadline="10m")  # over within 11 min
    assert admission(store, quick, []) is None  # over in 3 min: before the head's reserved start
    slow = _job(store, "slow", 1, deadline="2h")  # would hold a CPU past the head's reserved start
    assert admission(store, slow, []).startswith(f"queued behind {big.id}")
    assert admission(store, small, []).startswith(f"queued behind {big.id}")


def test_a_later_small_job_waits_for_an_earlier_big_one_and_one_admission_event(tmp_path, home):
    """Item 5 end to end (the sweep that ran 1, 3, a later job, 4, 2), and issue 27 item 3: a
    job writes one `admission` event per wait, whatever reasons follow (status shows the current
    one). The machine need not be this test's own: admission counts this home's jobs only."""
    import os

    import pytest

    from conftest import status_json

    cpus = os.cpu_count() or 1
    if cpus < 2:
        pytest.skip("needs 2 CPUs: one held, one free")
    hog = _detach(tmp_path, "hog", "sleep 300", nodes=cpus - 1)
    wait_for(lambda: status_json(hog)["status"] == "RUNNING", what="the first job RUNNING")
    big = _detach(tmp_path, "big", "echo big ran", nodes=cpus)
    wait_for(lambda: status_json(big)["pending_reason"], what="the big job to queue")
    small = _detach(tmp_path, "small", "echo small ran")
    try:
        doc = wait_for(lambda: (d := status_json(small))["pending_reason"] and d, what="the small job to queue")
        assert doc["pending_reason"].startswith(f"queued behind {big}"), doc
        assert status_json(big)["status"] == "PENDING"
        # a waiting job's light controller (sftctl.queue) is cancelled by down as the full one is
        pid = status_json(small)["controller_pid"]
        assert b"sftctl.queue" in open(f"/proc/{pid}/cmdline", "rb").read()
        extra = _detach(tmp_path, "extra", "echo extra ran")
        wait_for(lambda: status_json(extra)["pending_reason"], what="the extra job to queue")
        assert sftctl("down", extra).returncode == 0
        doc = status_json(extra)
        assert (doc["status"], doc["failure_reason"]) == ("CANCELLED", "cancelled by sftctl down")
        sftctl("down", hog)
        assert sftctl("wait", big, small, timeout=600).returncode == 0
    finally:
        for j in (hog, big, small):
            sftctl("down", j)

    def started(job):
        events = json.loads(sftctl("events", job, "--json").stdout)["events"]
        return next(e["ts"] for e in events if "PROVISIONING" in e["message"]), [e["kind"] for e in events]

    (big_at, _), (small_at, kinds) = started(big), started(small)
    assert big_at <= small_at  # first come, first served
    assert kinds.count("admission") == 1, kinds  # queued behind big, then waiting for CPUs: one event


def test_final_losses_named_events_carry_them_and_logs_by_rank(home):
    """Item 8: rank 0's log names its loss as its own; `events --json`'s last event carries the
    final metrics: the mean over ranks (status's loss) and each rank's. Item 12: `logs --rank`."""
    import os

    from conftest import REPO
    from sftctl import api

    view = api.run(str(REPO / "examples" / "quickstart.yaml"), ["train.steps=3"])
    assert view.status.value == "SUCCEEDED" and len(view.ranks) == 2
    doc = json.loads(sftctl("events", view.id, "--json", check=True).stdout)
    final = doc["events"][-1]["data"]["final"]
    by_rank = {int(r): loss for r, loss in final["loss_by_rank"].items()}
    assert by_rank == {r.rank: r.loss for r in view.ranks}
    assert final["loss_mean_over_ranks"] == sum(by_rank.values()) / 2 == view.loss
    assert final["step"] == 3 and final["tokens_per_s"] > 0
    # item 12: the rendezvous assigns training ranks to nodes; status says which, logs --rank follows it
    ranks = json.loads(sftctl("status", view.id, "--json", check=True).stdout)["ranks"]
    placed = {r["rank"]: r["node"] for r in ranks}
    assert sorted(placed) == [0, 1] and sorted(placed.values()) == [0, 1]
    log = sftctl("logs", view.id, "--rank", "0", check=True).stdout
    assert log == sftctl("logs", view.id, "--node", str(placed[0]), check=True).stdout
    assert "rank 0: first loss " in log and f"last loss {by_rank[0]:.4f} (this rank's batches" in log
    proc = sftctl("logs", view.id, "--rank", "7")
    assert proc.returncode == 2 and f"--rank 7: no node of job {view.id} reported training rank 7" in proc.stderr
    table = sftctl("status", view.id, env={**os.environ, "COLUMNS": "120"}, check=True).stdout
    assert "ON NODE" in table


def test_status_skips_typers_adapters_and_pydantic(home):
    """Item 15: `sftctl status` (what scripts and prompts poll) imports neither pydantic nor
    typer's parameter adapters (0.1-0.4 s); benchmarks/cli_latency.py times it."""
    import subprocess
    import sys

    code = ("import sys; from sftctl.cli import main; rc = main(['status', '--json']); "
            "print(rc, sorted(m for m in ('pydantic', 'typer._adapters') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "0 []"
    doc = json.loads("\n".join(out.splitlines()[:-1]))
    assert doc == {"jobs": []}
    # the same command through typer still parses what the fast path does not take
    assert sftctl("status", "--watch", "--json", "nope").returncode == 2
    assert sftctl("status", "--bogus").returncode == 2


def test_output_catalog_footnotes_no_padding_no_tok_s_and_orphans_scope(home, tmp_path):
    """Item 13: catalog rows stay one line at 80 and 120 columns (sources are footnotes); piped
    tables end lines without padding; no "- tok/s" for a model without tokens; `down --orphans`
    with no cloud configured says that no cloud was checked."""
    import io
    import os
    import re

    from rich.console import Console

    from sftctl.ui import RunView

    n = len(json.loads(sftctl("catalog", "--json", check=True).stdout)["offerings"])
    for width in ("80", "120"):
        lines = sftctl("catalog", env={**os.environ, "COLUMNS": width}, check=True).stdout.splitlines()
        table = lines[:n + 1]  # header + one line per offering, then the footnotes
        assert all(len(line) <= int(width) for line in lines)
        if width == "80":  # the longest GCP region names leave no room for SRC: REGION and price stay
            assert table[0].split()[-2:] == ["REGION", "$/H"], lines
            # a price much older than its instance type's newest carries the catalog's "!" mark
            assert all(re.search(r" \d+\.\d{3}( !)?$", line) for line in table[1:]), lines
            continue
        assert table[0].split()[-1] == "SRC" and all(re.search(r" \[\d+\]$", line) for line in table[1:]), lines
        assert any(line.startswith("[1] ") for line in lines[n + 1:]) and table[1].endswith("[1]")
    for args in (("catalog",), ("status",), ("check",)):
        out = sftctl(*args, check=True).stdout
        assert [line for line in out.splitlines() if line.endswith(" ")] == [], args

    buf = io.StringIO()
    with RunView(Console(file=buf, width=100, force_terminal=False), 10, show_logs=False) as view:
        view.metrics([{"rank": 0, "step": 3, "loss": 1.5}])
    assert "tok/s" not in buf.getvalue() and "loss 1.5000" in buf.getvalue()
    buf = io.StringIO()
    with RunView(Console(file=buf, width=100, force_terminal=False), 10, show_logs=False) as view:
        view.metrics([{"rank": 0, "step": 3, "loss": 1.5, "tokens_per_s": 1234.0}])
    assert "1,234 tok/s" in buf.getvalue()

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "KUBECONFIG", "CLOUDSDK"))}
    env["HOME"] = str(tmp_path / "nobody")
    proc = sftctl("down", "--orphans", env=env, check=True)
    assert "no cloud was checked" in proc.stdout and "no orphaned resources" not in proc.stdout
    assert json.loads(sftctl("down", "--orphans", "--json", env=env, check=True).stdout)["checked"] == ["local"]


def test_completion_of_job_ids_accelerators_and_spec_paths(home):
    """Item 14: <TAB> completes job ids (status, logs, events, down, wait), --target accelerators
    and spec paths, not only subcommands."""
    import os

    from sftctl.state import Store

    job = Store().create_job("demo", {"name": "demo", "run": "true", "resources": {"nodes": 1}})

    def complete(line: str) -> list[str]:
        words = line.split()
        env = {**os.environ, "_SFTCTL_COMPLETE": "complete_bash", "COMP_WORDS": line,
               "COMP_CWORD": str(len(words) if line.endswith(" ") else len(words) - 1)}
        return sftctl(env=env, check=True).stdout.split()

    for cmd in ("status", "logs", "events", "down", "wait"):
        assert complete(f"sftctl {cmd} ") == [job], cmd
    assert complete("sftctl logs dem") == [job] and complete("sftctl logs zz") == []
    assert "h100" in complete("sftctl compile x.yaml --target h") and "H100" in complete("sftctl catalog -a H")
    assert complete("sftctl run examples/quick") == ["examples/quickstart.yaml"]
    assert "examples/" in complete("sftctl plan exam")


TORCHRUN_NOISE = """\
W1203 07:30:00.123000 4242 torch/distributed/run.py:866] node_rank is only used for static rdzv_backend. It will be ignored for rdzv_backend=c10d.
step 10/20 loss 2.1000
E1203 07:31:00.000000 4242 torch/distributed/elastic/agent/server/api.py:1009] Error waiting on exit barrier. Elapsed: 300.1 seconds
Traceback (most recent call last):
  File "/x/torch/distributed/elastic/agent/server/api.py", line 995, in _exit_barrier
    store_util.barrier(
torch.distributed.DistStoreError: Socket Timeout

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/x/torch/distributed/elastic/utils/store.py", line 60, in barrier
    raise RuntimeError("exit barrier")
RuntimeError: exit barrier
first loss 2.5 last loss 2.0
"""


def test_attached_view_leaves_out_known_torch_noise(home):
    """Item 13: torchrun's node_rank warning and its exit-barrier frames (pytorch#69520) do not
    reach the attached view; every other line does, and `sftctl logs` keeps everything."""
    import io

    from rich.console import Console

    from sftctl.ui import RunView

    buf = io.StringIO()
    with RunView(Console(file=buf, width=300, force_terminal=False), 20) as view:
        for chunk in (TORCHRUN_NOISE[:100], TORCHRUN_NOISE[100:333], TORCHRUN_NOISE[333:]):  # split mid-line
            view.log(1, chunk)
    shown = [line for line in buf.getvalue().splitlines() if line.startswith("(node 1)")]
    assert shown == ["(node 1) step 10/20 loss 2.1000", "(node 1) first loss 2.5 last loss 2.0"]


def test_plans_error_line_stays_short(tmp_path, home):
    """Item 13: an infeasible plan's error line was about 330 characters; it groups the
    rejections by cause when their lines do not fit, and lists them when they do."""
    import re

    spec = write_spec(tmp_path / "dear.yaml", 'name: dear\nresources: {accelerators: ["H100:8", "A100-80GB:8", '
                      '"L4:1"], max_price_per_hour: 0.1}\nrun: "true"\n')
    proc = sftctl("plan", str(spec))
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3 and len(line) <= 200, line
    assert re.search(r"\(\d+ over budget \(e\.g\. \$[\d.]+/h is above max_price_per_hour \$0\.10\)\)$", line), line
    spec = write_spec(tmp_path / "local.yaml", 'name: l\nresources: {accelerators: ["H100:8"], clouds: [local]}\nrun: "true"\n')
    (line,) = [line for line in sftctl("plan", str(spec)).stderr.splitlines() if line.startswith("error:")]
    # grouped by cause with counts (the counts follow the catalog snapshot)
    assert re.search(r"\(\d+ x (aws|gcp) is not in resources\.clouds; \d+ x (gcp|aws) is not in resources\.clouds\)$", line), line


C10D_END = """\
W1206 17:36:49.021000 11577 torch/distributed/run.py:865] node_rank is only used for static rdzv_backend.
step 30/30 loss 2.0
[W1206 17:37:18.598372821 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=4): Failed to recv, got 0 bytes.
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f5e1ff79b8d in libc10.so)
frame #7: <unknown function> + 0x3d2825 (0x7f5e203d2825 in libtorch_python.so)
<omitting python frames>
frame #27: _start + 0x21 (0x558f8c2d4081 in python3)

W1206 17:37:18.040000 11577 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] The node failed to shutdown the rendezvous due to an error of type RendezvousConnectionError.
[c10d] The client socket has failed to connect
E1206 17:37:19.000000 11577 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1)
done
"""


def test_attached_view_leaves_out_c10d_stack_traces_at_the_end(home):
    """Issue 37.5: c10d's C++ warning and stack trace and torch.distributed's warning lines at a
    multi-node run's clean end stay in the node log; error lines and the script's own are shown;
    ``raw`` (sftctl --debug run) shows every line."""
    import io

    from rich.console import Console

    from sftctl.ui import RunView

    def shown(raw: bool) -> list[str]:
        buf = io.StringIO()
        with RunView(Console(file=buf, width=400, force_terminal=False), 30, raw=raw) as view:
            view.log(1, C10D_END[:333])
            view.log(1, C10D_END[333:])
        return [ln.removeprefix("(node 1) ") for ln in buf.getvalue().splitlines() if ln.startswith("(node 1)")]

    assert shown(False) == ["step 30/30 loss 2.0", "E1206 17:37:19.000000 11577 torch/distributed/elastic/"
                            "multiprocessing/api.py:869] failed (exitcode: 1)", "done"]
    assert shown(True) == C10D_END.splitlines()


@pytest.mark.parametrize("timeout", ["-1", "nan", "-inf"])
def test_wait_timeout_must_be_a_number_of_seconds(home, timeout):
    """`wait J --timeout -1` (or nan) timed out at once (exit 124): a usage error instead."""
    proc = sftctl("wait", "no-such-job", "--timeout", timeout)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "--timeout" in proc.stderr and "Traceback" not in proc.stderr
