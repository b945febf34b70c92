"""An attached ``sftctl run`` prints a job's output without the job waiting on it: every line
arrives, in order and as the node wrote it, and a job whose nodes have ended is recorded as it
ended however far behind its printing is (a SIGTERM then only stops the printing)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, deadline, status_json, wait_for, write_spec

LINES = 50_000
LONG = {7: "L" * 5000, 49_999: "M" * 70_000}  # lines longer than any terminal, one past RunView.LONG_LINE

MANY = f"""\
name: many
run: |
  python3 -c "
  long = {LONG!r}
  for i in range({LINES}):
      print(long.get(i, 'line %d ' % i + 'x' * 40 + '  '))
  "
"""


def _expected(i: int) -> str:
    return LONG.get(i, f"line {i} " + "x" * 40 + "  ")


def test_attached_run_prints_every_line_whole_and_in_order(tmp_path, home):
    """50k lines, two of them longer than a terminal and one longer than the line RunView holds
    back (it goes out in parts): each arrives once, whole (no re-wrapping into 240-character
    pieces, trailing spaces kept), in order, after its node's prefix; the job SUCCEEDED."""
    spec = write_spec(tmp_path / "many.yaml", MANY)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sftctl.cli", "run", str(spec)], cwd=REPO,
                          capture_output=True, text=True, timeout=deadline(600))
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [line.removeprefix("(node 0) ") for line in proc.stdout.splitlines() if line.startswith("(node 0) ")]
    job = [j for j in status_json()["jobs"]][0]
    assert job["status"] == "SUCCEEDED"
    ours = [line for line in shown if not line.startswith("[sftctl]")]  # the node wrapper's own lines
    assert len(ours) == LINES
    assert ours == [_expected(i) for i in range(LINES)]
    print(f"benchmark: {LINES} lines attached, piped: {wall:.1f} s wall (the CLI's start included)")


def _in_write(pid: int) -> bool:
    """Whether ``pid``'s main thread sits in write(2) (a printer blocked on a full pipe)."""
    number = {"x86_64": "1", "aarch64": "64"}.get(platform.machine())
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == number
    except (OSError, IndexError):
        return False


def _node_exited(home: Path) -> bool:
    return any("run exited with code 0" in p.read_text(errors="replace") for p in home.glob("jobs/*/nodes/*/node.log"))


def _reap(proc: subprocess.Popen, err) -> str:
    """Kill the client ``proc`` if it is still there, close its stdout pipe and ``err`` (the file
    its stderr went to), and return what it wrote there."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()
    err.close()
    return Path(err.name).read_text()


def test_sigterm_while_printing_an_ended_job_keeps_its_outcome(tmp_path, home):
    """The job prints 4 MB to a client whose stdout is a pipe nobody reads: the printing cannot
    go on past the pipe's 64 KiB, the node ends long before. The job is recorded SUCCEEDED and
    its node torn down without the printer; SIGTERM to the client then stops the printing only:
    the job stays SUCCEEDED, the client says the output was cut short and exits 0 (the job's
    code). Before, the controller printed in its own loop: it sat in write(2) with the node
    ended, and the SIGTERM cancelled the finished job."""
    spec = write_spec(tmp_path / "big.yaml", 'name: big\nrun: |\n  python3 -c "print((\'y\' * 99 + \'\\\\n\') * 40000)"\n')
    err = open(tmp_path / "stderr", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(spec)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=err)
    home_dir = Path(os.environ["SFTCTL_HOME"])
    try:
        def ended() -> bool:
            jobs = status_json()["jobs"]
            if jobs and jobs[0]["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return True
            return _node_exited(home_dir) and _in_write(proc.pid)  # stuck printing: no end can come

        wait_for(lambda: proc.poll() is not None or ended(), timeout_s=300, what="the job's end")
        assert proc.poll() is None, "sftctl run ended though nobody read its output"
        # the controller ignores signals while it tears the nodes down (a SIGTERM then is lost):
        # signal until the client is gone
        give_up = time.monotonic() + deadline(120)
        while proc.poll() is None and time.monotonic() < give_up and status_json()["jobs"][0]["status"] != "CANCELLED":
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        rc = proc.poll()  # None: still there (the status says why)
    finally:
        said = _reap(proc, err)
    job = status_json()["jobs"][0]
    assert job["status"] == "SUCCEEDED", said[-2000:]
    assert rc == 0, said[-2000:]
    assert "output was cut short: sftctl logs" in said, said[-2000:]
    assert "Traceback" not in said


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_a_signal_right_after_the_controller_returns_stops_the_printing_only(tmp_path, home, sig):
    """The window between the controller giving its signal handlers back (its teardown done) and
    ``sftctl run`` printing the rest of the output, hit every time: tests/_signal_at_end.py sends
    the signal there, while 4 MB of output wait on a pipe nobody reads. The client says the
    output was cut short and exits with the job's code, 0; the job stays SUCCEEDED. Before, the
    controller put back SIG_DFL and Python's Ctrl-C handler: SIGTERM killed the client (exit
    -15); Ctrl-C raised KeyboardInterrupt inside ``api.attach``, whose handler then waited for
    the printing to finish on the pipe nobody reads, for ever."""
    spec = write_spec(tmp_path / "big.yaml", 'name: big\nrun: |\n  python3 -c "print((\'y\' * 99 + \'\\\\n\') * 40000)"\n')
    err = open(tmp_path / "stderr", "w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_signal_at_end.py"), sig, "run", str(spec)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=err)
    try:
        rc = proc.wait(timeout=deadline(300))
    finally:
        said = _reap(proc, err)
    assert f"sent SIG{sig} after the controller returned" in said, said[-2000:]
    assert status_json()["jobs"][0]["status"] == "SUCCEEDED", said[-2000:]
    assert rc == 0, f"exit {rc}: " + said[-2000:]
    assert "output was cut short: sftctl logs" in said, said[-2000:]
    assert "Traceback" not in said


def test_attached_view_on_a_terminal_sanitises_node_output_with_log_line():
    """On a terminal the printer passes node output through ui.log_line: an OSC title sequence
    is shown as text, a colour is kept and closed; every line keeps its prefix; a line longer
    than RunView.LONG_LINE goes out whole, in parts, without being wrapped."""
    import io

    from rich.console import Console

    from sftctl.ui import RunView

    buf = io.StringIO()
    long = "w" * (RunView.LONG_LINE + 10)
    with RunView(Console(file=buf, width=80, force_terminal=True, color_system=None), None) as view:
        view.log(0, "a\x1b]0;TITLE\x07b \x1b[31mred\x1b[0m\n")
        view.log(0, long[:100])
        view.log(1, "other node\n")  # comes while node 0's line is open: it is not held back
        view.log(0, long[100:] + "\n")
    out = buf.getvalue()
    assert "(node 0) a\\x1b]0;TITLE\\x07b \x1b[31mred\x1b[0m\x1b[0m\n" in out
    assert "\x1b]0;" not in out
    assert "(node 1) other node\n" in out
    assert f"(node 0) {long}\n" in out


def test_node_output_past_the_backlog_is_skipped_and_said_once(monkeypatch):
    """The printer's queue holds at most RunView.BACKLOG characters of node output: what comes
    while it is full is skipped (not kept in memory), until the printer takes the queue; then one
    line says how much was skipped, and output goes on."""
    import io

    from rich.console import Console

    from sftctl.ui import RunView

    monkeypatch.setattr(RunView, "BACKLOG", 100)
    buf = io.StringIO()
    view = RunView(Console(file=buf, width=200, color_system=None), None)  # not started: nothing printed yet
    view.log(0, "a" * 59 + "\n")
    view.log(0, "b" * 39 + "\n")  # 100 queued: the limit
    view.log(0, "c" * 9 + "\n")  # past it: skipped
    view.log(0, "d" * 9 + "\n")  # skipped too, though it would fit: output resumes only after the note
    view.event("RUNNING: an event is always kept")
    view.start().finish()
    lines = buf.getvalue().splitlines()[:-1]  # the last: the bar
    assert lines == ["(node 0) " + "a" * 59, "(node 0) " + "b" * 39, "▸ RUNNING: an event is always kept",
                     "▸ 20 characters of node output skipped here: the output fell behind the job "
                     "(sftctl logs has all of it)"], lines
    assert view._queued == 0 and view._skipped == 0
