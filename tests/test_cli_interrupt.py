"""Ctrl-C at any point of ``sftctl run``: one line, exit 130, never a traceback nor death by SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, deadline, status_json, wait_for

QUICKSTART = REPO / "examples" / "quickstart.yaml"


def _as_from_a_terminal() -> None:
    """SIGINT back to its default in the child, as a terminal's foreground job has it (a suite
    started in the background runs with SIGINT ignored, which every child would inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def _interrupt_run(when) -> subprocess.CompletedProcess:
    """Start ``sftctl run examples/quickstart.yaml``, wait until ``when(pid)`` holds, send it SIGINT
    (to its whole process group, as a terminal's Ctrl-C does) and collect how it ended."""
    proc = subprocess.Popen([sys.executable, "-m", "sftctl.cli", "run", str(QUICKSTART)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        wait_for(lambda: proc.poll() is not None or when(proc.pid),
                 timeout_s=300, interval_s=0.02, what="the point to interrupt at")
        assert proc.poll() is None, f"sftctl run ended before it was interrupted:\n{proc.stderr.read()}"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=deadline(300))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_while_the_cli_is_still_importing(home):
    """sftctl.cli imports typer, rich, pydantic: typer's ``import shutil`` maps _lzma. (Earlier,
    while Python imports its site module, a SIGINT kills the interpreter: no program answers that.)"""
    ended = _interrupt_run(lambda pid: "_lzma" in _maps(pid))
    assert ended.returncode == 130, ended.stderr
    assert "Traceback" not in ended.stderr and "internal error" not in ended.stderr, ended.stderr
    assert ended.stderr.strip().splitlines()[-1].startswith("interrupted"), ended.stderr


@pytest.mark.cold_cache  # with the session's warm trace cache the CLI never loads torch: it plans and runs
def test_ctrl_c_while_planning_says_nothing_was_started(home):
    """torch is loaded only to trace the model, i.e. while planning: nothing is recorded yet."""
    ended = _interrupt_run(lambda pid: "libtorch_cpu" in _maps(pid))
    assert ended.returncode == 130, ended.stderr
    assert "Traceback" not in ended.stderr, ended.stderr
    assert ended.stderr.strip() == "interrupted while planning: nothing was started"
    assert status_json()["jobs"] == []


def test_an_interrupt_wrapped_by_pydantic_is_still_an_interrupt():
    """pydantic-core reports a KeyboardInterrupt that lands while it builds a model's schema as a
    SchemaError naming it, with no exception chain (seen on Ctrl-C during `sftctl run`)."""
    from pydantic_core import SchemaError

    from sftctl.cli._interrupt import caused_by_interrupt

    wrapped = SchemaError('Error building "model" serializer:\n  SchemaError: Field "objective":\n  KeyboardInterrupt:')
    assert caused_by_interrupt(wrapped)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("while loading") from e
    except RuntimeError as chained:
        assert caused_by_interrupt(chained)
    assert not caused_by_interrupt(SchemaError('Error building "model" validator: invalid literal'))
    assert not caused_by_interrupt(ValueError("KeyboardInterrupt in a message is not one"))

