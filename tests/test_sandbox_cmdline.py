"""A sandboxed node's environment never shows on a command line (``ps aux``, ``/proc/PID/cmdline``).

Any user of the machine reads every process's command line. bwrap used to get the node's tags and
the job's ``LD_*``/``PYTHON*`` variables as ``--setenv NAME VALUE`` on its own command line and on
its guard's; now bwrap reads all its options from a file descriptor (``--args FD``). A real
sandboxed local node (``SFTCTL_NODE_SANDBOX=bwrap``, real bubblewrap) with secret-looking values in
``env:`` and ``secrets:``: no process of the machine has one of them on its command line, the
node's bwrap and guard included, and the node still sees each of them.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import job_processes, wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed (.ci/run installs it)")

#: values only the job's nodes may see: under LD_*/PYTHON* names (those went on bwrap's command
#: line) and an ordinary name and a secret (those went in its environment)
VALUES = {"PYTHON_LAB_TOKEN": "py-tok-7c1e9d04b2", "LD_LAB_TOKEN": "ld-tok-5a8f3e61d9",
          "LAB_PLAIN_TOKEN": "plain-tok-2b6d0c93e7"}
SECRET = ("LAB_API_TOKEN", "secret-tok-4e2a71f8c5")


def _cmdlines() -> dict[int, bytes]:
    """``{pid: its command line (NUL-separated)}`` of every process of the machine."""
    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                out[int(p.name)] = (p / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
    return out


def test_no_value_of_a_sandboxed_nodes_environment_is_on_a_command_line(home, tmp_path, monkeypatch):
    from sftctl import api

    monkeypatch.setenv("SFTCTL_NODE_SANDBOX", "bwrap")
    monkeypatch.setenv(*SECRET)  # a job run without a server takes a secret from its shell
    work = tmp_path / "work"
    work.mkdir()
    done = work / "done"
    env = "".join(f"  {k}: {v}\n" for k, v in VALUES.items())
    seen = "".join(f'echo "seen {k}=${k}"\n' for k in [*VALUES, SECRET[0]])
    run = f"{seen}echo all-seen\nwhile [ ! -e {done} ]; do sleep 0.2; done\n"
    spec = tmp_path / "leak.yaml"
    spec.write_text(f"name: leak\nworkdir: {work}\nresources: {{nodes: 1}}\nsecrets: [{SECRET[0]}]\nenv:\n{env}"
                    f"run: |\n{textwrap.indent(run, '  ')}")
    job = api.run(str(spec), detach=True).id
    try:
        log = wait_for(lambda: "all-seen" in (t := "\n".join(ln.text for ln in api.logs(job))) and t,
                       timeout_s=180, what="the node to print what it sees")
        for k, v in [*VALUES.items(), SECRET]:
            assert f"seen {k}={v}" in log, (k, log)  # the node still has each variable
        cmdlines = _cmdlines()
        # bwrap and the child it forks (pid 1 of the sandbox), each with the node's command
        bwraps = [pid for pid, c in cmdlines.items()
                  if c.split(b"\0")[0].endswith(b"bwrap") and job.encode() in c]
        assert bwraps, {p: c for p, c in cmdlines.items() if job.encode() in c}
        nodes = job_processes(job)
        assert set(nodes) & set(cmdlines), (nodes, sorted(cmdlines))  # the node's own processes were read
        for pid, c in cmdlines.items():  # bwrap, its guard, the node's processes: every process here
            for v in [*VALUES.values(), SECRET[1]]:
                assert v.encode() not in c, (pid, c.replace(b"\0", b" ").decode(errors="replace"))
    finally:
        done.touch()
    view = wait_for(lambda: (v := api.status(job)).status.terminal and v, timeout_s=120, what="the job to end")
    assert view.status.value == "SUCCEEDED", view.failure_reason
    wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end")


def test_a_value_with_a_nul_byte_is_refused_in_one_line(home, tmp_path):
    """bwrap's options are NUL-separated: a NUL inside a value would smuggle in options of its own
    (``--bind / /``), so it is refused naming the variable."""
    from sftctl.errors import ProviderError
    from sftctl.providers import sandbox

    with pytest.raises(ProviderError) as e:
        sandbox.wrap(["true"], sandbox.Binds(), tags={"PYTHONX": "a\0--bind\0/\0/"}, chdir=tmp_path)
    assert str(e.value).startswith("local node sandbox: the variable 'PYTHONX' holds a NUL byte"), str(e.value)
    with sandbox.wrap(["sh", "-c", 'printf %s "$PYTHONX"'], sandbox.Binds(), tags={"PYTHONX": "a b"},
                      chdir=tmp_path) as cmd:
        assert cmd.argv[1:3] == ["--args", str(cmd.pass_fds[0])] and "a b" not in cmd.argv
        assert subprocess.run(cmd.argv, capture_output=True, text=True, pass_fds=cmd.pass_fds).stdout == "a b"
    assert cmd.pass_fds == ()  # closed
