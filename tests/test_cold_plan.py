"""A cold ``plan`` on a terminal says what it is doing, with elapsed time and counts, on stderr
(issue 37.8); ``--json``'s stdout stays one document."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys

import pytest

from conftest import REPO, deadline


def _run_with_tty_stderr(*args: str) -> tuple[str, str, int]:
    """``sftctl ARGS`` with stderr on a pseudo-terminal (stdout a pipe); its stdout, the bytes the
    terminal got (decoded) and the exit code."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "sftctl.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=slave, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    out = proc.stdout.read().decode()
    proc.wait(timeout=deadline(600))
    os.close(master)
    return out, seen.decode("utf-8", "replace"), proc.returncode


@pytest.mark.cold_cache
def test_a_cold_plan_shows_its_work_with_time_and_counts_on_stderr(home):
    out, terminal, code = _run_with_tty_stderr("plan", "examples/quickstart.yaml", "--json")
    assert code == 0, terminal[-3000:]
    doc = json.loads(out)  # stdout: the document alone
    assert doc["chosen"] and "tracing" not in out and "compiling" not in out
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal)
    assert "tracing examples/gpt/model.py:build" in plain, plain[-2000:]
    assert re.search(r"compiling for \S+ \(accelerator 1 of 1\)", plain), plain[-2000:]
    assert re.search(r"\b0:00:\d\d\b", plain), plain[-2000:]  # elapsed time beside what it does
