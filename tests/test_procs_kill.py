"""``sftctl.procs.kill_all``, the stop of a node's processes (local nodes, ``sftctl down``, a
node's guard): the processes are signalled one by one, and a script among them must not act on
another's death before its own SIGTERM comes.

node.sh runs the job's training after a preflight that did not complete; a preflight killed
before its script (a pid lower than the script's: pids wrap around on a busy machine, or many
processes between them) let the script start the training in a child that no one signalled, so
a stopped attempt still wrote its output (tests/test_preflight*.py counted one "trained on node"
line too many)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from conftest import wait_for

from sftctl import procs


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:  # field 4 of /proc/PID/stat: the parent's pid
            out.append(int(stat.parent.name))
    return out


def test_a_script_whose_child_is_killed_first_never_goes_on(tmp_path):
    went_on = tmp_path / "went-on"
    script = subprocess.Popen(["bash", "-c", f"sleep 300; echo went on > {went_on}; sleep 300"])
    fillers: list[subprocess.Popen] = []
    try:
        [child] = wait_for(lambda: _children(script.pid), timeout_s=30, what="the script's child")
        # 200 processes between the child and its script: a node's workers, say (signalling them
        # takes the old one-by-one loop a few ms, and the script reacted within them every time)
        fillers = [subprocess.Popen(["sleep", "300"]) for _ in range(200)]
        survivors = procs.kill_all([child, *(f.pid for f in fillers), script.pid], grace_s=30)
        assert script.wait(timeout=30) == -signal.SIGTERM
        assert survivors == []
        assert not went_on.exists(), "the script went on to its next command after its child was killed"
        assert all(f.wait(timeout=30) == -signal.SIGTERM for f in fillers)
    finally:
        for p in [script, *fillers]:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_tagged_process_forked_during_the_stop_is_stopped_too(tmp_path):
    """CI (stop 45): a node's guard stopped the node while its script was starting the job's
    command, and the command (forked after the guard's scan of /proc, so never signalled) ran on
    for ever with nobody watching. A process that forks all the time stands in for that race:
    whatever it forked between the scan and its SIGSTOP must be stopped too."""
    import os

    tag = f"forker-{os.getpid()}-{tmp_path.name}"
    forker = subprocess.Popen(["bash", "-c", "while :; do sleep 300 & sleep 0.002; done"],
                              env={**os.environ, "SFTCTL_NODE_ID": tag}, start_new_session=True)
    try:
        wait_for(lambda: len(procs.tagged("SFTCTL_NODE_ID", tag)) > 20, timeout_s=30, what="the forks")
        procs.stop_tagged("SFTCTL_NODE_ID", {tag}, grace_s=2.0)
        assert forker.wait(timeout=30) == -signal.SIGTERM
        assert procs.tagged("SFTCTL_NODE_ID", tag) == []
    finally:
        for pid in procs.tagged("SFTCTL_NODE_ID", tag):
            procs._signal(pid, signal.SIGKILL)
        if forker.poll() is None:
            forker.kill()
            forker.wait()
