"""Issue 28: only the user's code runs, secrets arrive, node output cannot drive the terminal.

Real local jobs (the local provider, directory job storage), real bash and real Python children.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from conftest import write_spec

#: a module that, imported or run, leaves a marker file: the planted code ran
PLANT = "import pathlib\npathlib.Path({marker!r}).write_text(__name__ + ' ' + __file__)\n"


def _plant_sftctl(where: Path, marker: Path) -> None:
    """A fake ``sftctl`` package in ``where`` whose every module writes ``marker``."""
    pkg = where / "sftctl"
    pkg.mkdir()
    for name in ("__init__", "__main__", "controller", "agent", "node", "failure", "procs", "cli"):
        (pkg / f"{name}.py").write_text(PLANT.format(marker=str(marker)))


@pytest.mark.parametrize("storage", [False, True], ids=["plain", "directory-storage"])
def test_a_planted_sftctl_in_the_cwd_and_workdir_never_runs(home, tmp_path, monkeypatch, storage):
    """Issue 28 item 2: the detached controller, the guard, the node daemon, the agent and the
    failure helper are sftctl's own modules even when the caller's cwd and the job's workdir hold
    an ``sftctl/`` package (python -m would import that one first)."""
    from sftctl import api
    from sftctl.types import JobStatus

    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "planted-code-ran"
    _plant_sftctl(work, marker)
    monkeypatch.chdir(work)
    store = f"storage: {{url: {tmp_path / 'store'}}}\n" if storage else ""
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: planted
workdir: {work}
resources: {{nodes: 1}}
health: {{enabled: true}}
recovery: {{max_restarts: 0}}
{store}run: |
  echo "ran in $PWD"
  exit 3
""")
    job = api.run(spec, detach=True)
    done = api.wait(job.id, timeout_s=300, poll_s=0.5)
    text = "\n".join(map(str, api.logs(job.id)))
    assert done.status is JobStatus.FAILED, (done.failure_reason, text)
    assert "ran in" in text and "run exited with code 3" in text, text
    assert not marker.exists(), f"planted code ran: {marker.read_text()}"


def test_a_secret_reference_reaches_a_node_fed_by_storage(home, tmp_path, monkeypatch):
    """Issue 28 item 3: ``env: {TOKEN: ${MY_SECRET}}`` with ``storage:`` delivers the value to
    the node (it arrived empty), and the job's storage never holds it."""
    from sftctl import api
    from sftctl.types import JobStatus

    value = "s3cr3t-value-4242"
    monkeypatch.setenv("MY_SECRET", value)
    work = tmp_path / "work"
    work.mkdir()
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: secret-ref
workdir: {work}
resources: {{nodes: 1}}
health: {{enabled: false}}
storage: {{url: {tmp_path / 'store'}}}
env: {{TOKEN: "${{MY_SECRET}}"}}
run: |
  echo "token-length=${{#TOKEN}}"
  echo "token-sha=$(printf %s "$TOKEN" | sha256sum | cut -c1-16)"
""")
    job = api.run(spec, detach=True)
    done = api.wait(job.id, timeout_s=300, poll_s=0.5)
    text = "\n".join(map(str, api.logs(job.id)))
    assert done.status is JobStatus.SUCCEEDED, (done.failure_reason, text)
    sha = hashlib.sha256(value.encode()).hexdigest()[:16]
    assert f"token-length={len(value)}" in text and f"token-sha={sha}" in text, text
    stored = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and value.encode() in p.read_bytes()]
    assert stored == []


def test_a_node_without_its_secret_refuses_to_run(tmp_path):
    """Issue 28 item 3: a node whose environment lacks a secret the job needs stops before the
    spec's run with a line naming it (exit 78), never runs with it empty."""
    import subprocess
    import sys

    from sftctl.protocol import NodeDir, failure_name, parse_failure
    from sftctl.templates import render

    node = tmp_path / "node"
    node.mkdir()
    script = render("node.sh.j2", job_id="j", node_id="n1", rank=0, attempt=1, workdir=str(tmp_path),
                    setup="", health=False, run="echo user-run-started", secrets=["TOKEN"])
    env = {k: v for k, v in os.environ.items() if k != "TOKEN"}
    env.update(SFTCTL_NODE_DIR=str(node), SFTCTL_PYTHON=sys.executable, TOKEN="")
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 78 and "user-run-started" not in proc.stdout, proc.stdout
    assert "secret TOKEN is empty or not set on this node" in proc.stdout
    assert NodeDir(node).exits() == [(1, 78)]
    why = parse_failure((node / failure_name(1)).read_bytes())
    assert why.code.value == "secret_missing" and why.message == "secret TOKEN is empty or not set on node 0"
    env["TOKEN"] = "x"
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "user-run-started" in proc.stdout, proc.stdout


def _on_a_pty(argv: list[str], timeout_s: float = 120) -> bytes:
    """Run ``argv`` with its stdout on a pseudo-terminal; return what reached the terminal."""
    import pty
    import select
    import subprocess
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=slave, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    os.close(slave)
    out, end = b"", time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    return out


def test_node_output_cannot_drive_the_users_terminal(home, tmp_path):
    """Issue 28 item 5: a node printing escapes (window title, clear screen) reaches a terminal
    through ``sftctl logs`` as visible text; a pipe and ``--json`` keep the bytes."""
    import subprocess
    import sys

    from sftctl import api
    from sftctl.types import JobStatus

    spec = write_spec(tmp_path / "job.yaml", f"""\
name: escapes
workdir: {tmp_path}
health: {{enabled: false}}
run: printf 'before\\033]0;pwned-title\\007\\033[2Jafter\\n\\033[31mred\\033[0m\\nbar\\r 10%%\\r100%%\\n'
""")
    job = api.run(spec, detach=True)
    assert api.wait(job.id, timeout_s=300, poll_s=0.5).status is JobStatus.SUCCEEDED
    shown = _on_a_pty([sys.executable, "-m", "sftctl.cli", "logs", job.id])
    assert b"before" in shown and b"after" in shown, shown
    assert b"\x1b]" not in shown and b"\x1b[2J" not in shown and b"\x07" not in shown, shown
    assert b"\\x1b]0;pwned-title\\x07\\x1b[2J" in shown
    # colour (SGR) stays, closed by a reset; of a progress bar's \r redraws only the last shows
    assert b"\x1b[31mred\x1b[0m\x1b[0m\r\n100%\r\n" in shown, shown
    assert b"bar" not in shown and b"10%" not in shown, shown
    piped = subprocess.run([sys.executable, "-m", "sftctl.cli", "logs", job.id], capture_output=True, check=True,
                           timeout=300).stdout  # bytes: text mode would read \r as a newline
    assert b"before\x1b]0;pwned-title\x07\x1b[2Jafter\n\x1b[31mred\x1b[0m\nbar\r 10%\r100%\n" in piped


def test_an_attached_run_on_a_terminal_shows_node_escapes_as_text(home, tmp_path):
    """``sftctl run`` (attached) prints node lines through the same :func:`sftctl.ui.log_line` as
    ``logs``: the window title and clear-screen escapes arrive as visible text, colour stays."""
    import sys

    spec = write_spec(tmp_path / "job.yaml", f"""\
name: escapes-run
workdir: {tmp_path}
health: {{enabled: false}}
run: printf 'before\\033]0;pwned-title\\007\\033[2Jafter\\n\\033[31mred\\033[0m\\nbar\\r 10%%\\r100%%\\n'
""")
    shown = _on_a_pty([sys.executable, "-m", "sftctl.cli", "run", str(spec)], timeout_s=300)
    assert b"SUCCEEDED" in shown, shown
    assert b"\\x1b]0;pwned-title\\x07\\x1b[2Jafter" in shown, shown
    assert b"\x1b]0;pwned" not in shown and b"\x07" not in shown and b"\x1b[2J" not in shown, shown
    assert b"\x1b[31mred\x1b[0m" in shown and b"100%" in shown, shown
    assert b"bar" not in shown and b" 10%" not in shown, shown


def test_a_checkpoint_past_the_file_size_limit_names_the_cause_and_does_not_restart(home, tmp_path):
    """Issue 28 item 7: a checkpoint that hits the file-size limit (``ulimit -f``: RLIMIT_FSIZE,
    as a full disk would) ends the job once, with the cause, step and path; no futile restart.
    The reason is plain text ([brackets] survive ``run``'s rendering)."""
    import json

    from conftest import sftctl
    from sftctl.types import JobStatus

    (tmp_path / "save.py").write_text(
        "import torch\nfrom sftctl import train\n"
        "train.save_checkpoint({'w': torch.zeros(1_000_000)}, 20)\n")  # 4 MB into a 1 MiB limit
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: disk-full
workdir: {tmp_path}
health: {{enabled: false}}
recovery: {{max_restarts: 3}}
run: ulimit -f 1024 && python save.py
""")
    proc = sftctl("run", str(spec), timeout=300)
    assert proc.returncode != 0
    from sftctl import api

    [listed] = api.status()
    job = api.status(listed.id)
    assert job.status is JobStatus.FAILED
    assert len(job.attempts) == 1, [a.reason for a in job.attempts]  # no restart into the same wall
    doc = json.loads(sftctl("status", job.id, "--json", check=True).stdout)
    assert doc["failure_code"] == "disk_full", doc
    assert "the file-size limit (ulimit -f) was reached writing checkpoint step 20 to " in job.failure_reason
    assert "inline_container" not in job.failure_reason
    assert f"reason: {job.failure_reason}" in " ".join(proc.stdout.split()) + " ".join(proc.stderr.split())


def test_tables_show_control_characters_of_node_output():
    """Issue 28 item 5: a failure reason or event quoting node output renders its escapes as text."""
    import io

    from rich.console import Console

    from sftctl.ui import events_table, job_detail

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    console.print(events_table([{"ts": 0, "kind": "node", "message": "node 0: \x1b]0;pwned\x07 failed"}]))
    job = {"id": "j", "status": "FAILED", "resources": "local cpu:1 x1", "steps": None, "step": None,
           "created_at": 0, "ended_at": 1, "failure_reason": "rank 0: Error: \x1b[2J", "plan": None,
           "nodes": [], "ranks": [], "attempts": [{"number": 1, "status": "FAILED", "exit_code": 1,
                                                    "reason": "Error: \x1b[2J"}]}
    for r in job_detail(job):
        console.print(r)
    text = out.getvalue()
    assert "\\x1b]0;pwned\\x07" in text and "\\x1b[2J" in text and "\x1b]0;" not in text and "\x07" not in text


def test_an_empty_secret_is_refused_at_submit(home, tmp_path, monkeypatch):
    """Issue 28 item 3: a secret that would reach the nodes empty is refused before anything runs."""
    from sftctl import api
    from sftctl.errors import SpecError

    monkeypatch.setenv("MY_SECRET", "")
    monkeypatch.setenv("HF_TOKEN", "")
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: secret-empty
workdir: {tmp_path}
env: {{TOKEN: "${{MY_SECRET}}"}}
run: echo user-run-started
""")
    with pytest.raises(SpecError, match=r"env.TOKEN: \$\{MY_SECRET\} is empty in this shell"):
        api.run(spec, detach=True)
    spec.write_text(spec.read_text().replace('env: {TOKEN: "${MY_SECRET}"}', "secrets: [HF_TOKEN]"))
    with pytest.raises(SpecError, match="secrets: HF_TOKEN is empty in this shell"):
        api.run(spec, detach=True)
    assert api.status() == []


def test_a_job_whose_secret_does_not_arrive_fails_once_naming_it(home, tmp_path, monkeypatch):
    """Issue 28 item 3: a node without the job's secret does not run it, and the job fails with
    that line instead of restarting into the same wall (the controller here starts in a shell
    that lacks the secret the submitting shell had)."""
    from sftctl import api
    from sftctl.types import JobStatus

    monkeypatch.setenv("MY_SECRET", "present-at-submit")
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: secret-gone
workdir: {tmp_path}
health: {{enabled: false}}
recovery: {{max_restarts: 3}}
secrets: [MY_SECRET]
run: echo user-run-started
""")
    submitted = api.submit(spec)
    monkeypatch.delenv("MY_SECRET")
    api.start(submitted.job_id)
    done = api.wait(submitted.job_id, timeout_s=300, poll_s=0.5)
    text = "\n".join(map(str, api.logs(done.id)))
    assert done.status is JobStatus.FAILED and "user-run-started" not in text, text
    assert len(done.attempts) == 1 and done.record.failure_code == "secret_missing"
    assert done.failure_reason == "node 0 exited with code 78: secret MY_SECRET is empty or not set on node 0"


def test_a_checkpoint_on_a_full_disk_names_the_cause(tmp_path, monkeypatch):
    """Issue 28 item 7: a 1 MiB tmpfs (a real full disk) under a 4 MB checkpoint: torch's
    'unexpected pos' becomes the cause, step and path; earlier checkpoints stay, no temp dir."""
    import subprocess

    torch = pytest.importorskip("torch")
    from sftctl import train

    disk = tmp_path / "tiny"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        monkeypatch.setenv("SFTCTL_CHECKPOINT_DIR", str(disk / "ck"))
        first = train.save_checkpoint({"w": torch.zeros(1000)}, 10)
        with pytest.raises(train.CheckpointSpaceError) as info:
            train.save_checkpoint({"w": torch.zeros(1_000_000)}, 20)
        assert str(info.value) == f"no space left on device writing checkpoint step 20 to {disk / 'ck' / 'step-00000020'}"
        assert info.value.errno == 28 and info.value.failure_code == "disk_full"
        assert sorted(p.name for p in (disk / "ck").iterdir()) == [first.name]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_log_line_on_a_terminal_keeps_colour_and_the_last_redraw_only():
    """The one function ``logs`` and an attached ``run`` print node lines through: on a terminal,
    SGR colours stay (closed by a reset), a tqdm line shows its last redraw, every other control
    is visible text; off a terminal the line is unchanged."""
    from sftctl.ui import log_line

    raw = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mred\x1b[0m ok\tx\x08\x7f\x9b2J"
    assert log_line(raw, terminal=False) == raw
    assert log_line(raw, terminal=True) == (
        "\\x1b]0;PWNED\\x07\\x1b[2J\x1b[31mred\x1b[0m ok\tx\\x08\\x7f\\x9b2J\x1b[0m")
    # tqdm: every redraw on one line, \r before each; the terminal would show the last one
    assert log_line("\r 10%|#   |\r 50%|##  |\r100%|####|", terminal=True) == "100%|####|"
    assert log_line("crlf ending\r", terminal=True) == "crlf ending"
    # no SGR, no reset added; an escape that only looks like SGR (a private mode) is shown
    assert log_line("plain", terminal=True) == "plain"
    assert log_line("\x1b[?25l hidden cursor", terminal=True) == "\\x1b[?25l hidden cursor"
    assert log_line("a\x1b[1mb\nc", terminal=True) == "a\x1b[1mb\x1b[0m\nc"
