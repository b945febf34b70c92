"""The node agent's own /metrics asks for a bearer token (sftctl.agent: metrics_token, _serve).

A local job's sandboxed nodes share the machine's network, so without a token any job could
read another job's agent. A real agent process (``python -m sftctl.agent --port``) replaying a
recorded GPU stream: no header is 401, another token 403, the token 200 with dcgm's names. The
token is ``$SFTCTL_AGENT_METRICS_TOKEN``, else the node directory's ``agent-metrics.token``,
made 0600 and kept across restarts.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import REPO, wait_for

REPLAY = REPO / "tests" / "fixtures" / "xid79.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent(tmp_path, home):
    """Start ``python -m sftctl.agent`` for a node directory (``agent(env) -> (url, node_dir)``);
    every agent started is stopped after the test."""
    started: list[subprocess.Popen] = []

    def start(extra: dict[str, str] | None = None) -> tuple[str, Path]:
        node_dir = tmp_path / "node"
        node_dir.mkdir(exist_ok=True)
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "SFTCTL_AGENT_METRICS_TOKEN"}
        env.update({"SFTCTL_NODE_DIR": str(node_dir), "SFTCTL_AGENT_PORT": str(port),
                    "SFTCTL_TELEMETRY_REPLAY": str(REPLAY), "SFTCTL_HEALTH_INTERVAL_S": "0.2", **(extra or {})})
        with open(node_dir / "agent.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "sftctl.agent"], env=env, stdout=subprocess.DEVNULL,
                                    stderr=log)
        started.append(proc)
        url = f"http://127.0.0.1:{port}/metrics"

        def up() -> bool:
            try:
                return httpx.get(url, timeout=10).status_code > 0  # it answers
            except httpx.TransportError:
                assert proc.poll() is None, (node_dir / "agent.log").read_text()
                return False

        wait_for(up, timeout_s=120, what="the agent's /metrics", report=lambda: (node_dir / "agent.log").read_text())
        return url, node_dir

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=60)


def _get(url: str, token: str | None = None, scheme: str = "Bearer") -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"{scheme} {token}"}
    return httpx.get(url, headers=headers, timeout=30)


def test_the_agents_metrics_ask_for_the_token_kept_in_the_node_directory(agent):
    url, node_dir = agent()
    bare = _get(url)
    assert (bare.status_code, bare.headers.get("www-authenticate")) == (401, "Bearer")
    assert "SFTCTL_AGENT_METRICS_TOKEN" in bare.text and "DCGM" not in bare.text

    token_file = node_dir / "agent-metrics.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 43  # 32 random bytes, URL-safe base64
    assert _get(url, token, scheme="Basic").status_code == 401
    wrong = _get(url, token[:-1] + ("A" if token[-1] != "A" else "B"))
    assert wrong.status_code == 403 and "DCGM" not in wrong.text

    def xid_served() -> httpx.Response | None:  # the replay reaches its XID 79 after a few samples
        r = _get(url, token)
        assert r.status_code == 200, r.text
        xid = [line for line in r.text.splitlines() if line.startswith("DCGM_FI_DEV_XID_ERRORS{")]
        return r if any(line.endswith(" 79.0") for line in xid) else None

    ok = wait_for(xid_served, timeout_s=120, what="the replayed XID 79 on /metrics")
    assert ok.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert httpx.get(url.replace("/metrics", "/other"), timeout=30).status_code == 404


def test_a_restarted_agent_keeps_the_token_and_the_environments_token_wins(agent):
    url, node_dir = agent()
    token = (node_dir / "agent-metrics.token").read_text().strip()
    again, _ = agent()
    assert _get(again, token).status_code == 200

    chosen = "job-chosen-secret-5c1d"
    url, _ = agent({"SFTCTL_AGENT_METRICS_TOKEN": chosen})
    assert _get(url, chosen).status_code == 200
    assert _get(url, token).status_code == 403
