"""The README's team set-up (issue 37), run as written: its block (after ``<!-- team-setup -->``)
on fresh homes for the server's machine and for alice's laptop, the server's state in a real
Postgres (the block's ``export SFTCTL_STATE_URL=...``, here the test's database).

Only what a test cannot do on this machine is stood in for: ``python3 -m venv``/``pip`` (this
interpreter already has sftctl and the server extra: a stub ``.venv`` in the "clone" whose
``activate`` puts a ``sftctl`` of this interpreter first on PATH, and whose ``pip`` records its
arguments), the server's address (``lab-server:8470`` -> a free loopback port) and
``--host 0.0.0.0`` (loopback).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, deadline, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def team_setup_block() -> str:
    """The bash block right after README's ``<!-- team-setup -->`` marker."""
    m = re.search(r"<!-- team-setup -->\n```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert m, "README.md lost its <!-- team-setup --> block"
    return m.group(1)


def steps(block: str) -> dict[int, str]:
    """The block's steps, by the number of their ``# N.`` comment."""
    out: dict[int, list[str]] = {}
    n = 0
    for line in block.splitlines():
        m = re.match(r"# (\d)\. ", line)
        if m:
            n = int(m.group(1))
        out.setdefault(n, []).append(line)
    return {k: "\n".join(v) + "\n" for k, v in out.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment less sftctl's and XDG's, with a fresh $HOME."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SFTCTL_", "XDG_CONFIG", "XDG_DATA", "XDG_STATE", "VIRTUAL_ENV"))}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), **extra}


def _clone_with_stub_venv(path: Path) -> Path:
    """A directory standing for a clone, with the ``.venv`` that step 1 makes already there."""
    bin_ = path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "activate").write_text(f'PATH="{bin_}:$PATH"; export PATH\n')
    (bin_ / "sftctl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m sftctl.cli "$@"\n')
    (bin_ / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> "{path}/pip-calls"\n')
    for f in ("sftctl", "pip"):
        (bin_ / f).chmod(0o755)
    return path


def test_readme_team_setup_runs_as_written(postgres, tmp_path):
    block = team_setup_block()
    s = steps(block)
    assert sorted(k for k in s if k) == [1, 2, 3], block
    # the install is the clone's (sftctl is not on the package index)
    assert "pip install -e '.[server]'" in s[1] and "sftctl[server]" not in block
    port = _free_port()

    def local(text: str) -> str:
        return text.replace("lab-server:8470", f"127.0.0.1:{port}").replace("--port 8470", f"--port {port}") \
                   .replace("--host 0.0.0.0", "--host 127.0.0.1")

    clone = _clone_with_stub_venv(tmp_path / "clone")
    url = postgres.create_database()
    server_env = _fresh_env(tmp_path / "server-home", SFTCTL_STATE_URL=url)  # the comment's export
    # python3 -m venv: the stub is there already (a real one would replace its activate)
    shim = 'python3() { if [ "$1" = -m ] && [ "$2" = venv ]; then return 0; fi; command python3 "$@"; }\nset -e\n'
    server_part = shim + local(s[1]) + 'echo $! > server.pid\n' + local(s[2]) + 'printf %s "$TOKEN" > token\n'
    with open(tmp_path / "server.out", "w") as out:  # files: the server started with & keeps them open
        proc = subprocess.run(["bash", "-c", server_part], cwd=clone, env=server_env, stdout=out,
                              stderr=subprocess.STDOUT, text=True, timeout=deadline(120))
    proc.stderr = (tmp_path / "server.out").read_text()
    pid = int((clone / "server.pid").read_text()) if (clone / "server.pid").exists() else None
    try:
        assert proc.returncode == 0, proc.stderr
        assert (clone / "pip-calls").read_text() == "pip install -e .[server] --config-settings editable_mode=compat\n"
        token = (clone / "token").read_text()
        assert re.fullmatch(r"[A-Za-z0-9_-]{20,}", token), token  # stdout is the token alone
        import httpx

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout_s=60, what="the team's server to answer",
                 report=lambda: (tmp_path / "server.out").read_text()[-2000:])

        laptop = tmp_path / "alice-home"  # a fresh home: no ~/.config yet
        alice_env = _fresh_env(laptop, TOKEN=token, PATH=f"{clone / '.venv' / 'bin'}:{os.environ['PATH']}")
        proc = subprocess.run(["bash", "-c", "set -e\n" + local(s[3])], cwd=tmp_path, env=alice_env,
                              capture_output=True, text=True, timeout=deadline(120))
        assert proc.returncode == 0, proc.stderr
        config = (laptop / ".config" / "sftctl" / "config.yaml").read_text()
        assert config == f'server: {{url: "http://127.0.0.1:{port}", token: "{token}"}}\n'
        # her commands go to the server: as alice, and a wrong token is refused there
        status = subprocess.run([sys.executable, "-m", "sftctl.cli", "status", "--json"], cwd=tmp_path, env=alice_env,
                                capture_output=True, text=True, timeout=deadline(60))
        assert status.returncode == 0 and json.loads(status.stdout) == {"jobs": []}, status.stderr
        wrong = subprocess.run([sys.executable, "-m", "sftctl.cli", "status"], cwd=tmp_path,
                               env={**alice_env, "SFTCTL_SERVER_TOKEN": "not-a-token"},
                               capture_output=True, text=True, timeout=deadline(60))
        assert wrong.returncode == 4 and "knows no user with this token" in wrong.stderr, wrong.stderr
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
