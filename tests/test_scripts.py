"""Scripts and labs (issue 23 items 5-8, 12-15; issue 28 item 8): each test here failed before its fix."""

from __future__ import annotations

import json

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
