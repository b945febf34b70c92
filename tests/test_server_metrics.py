"""The server's /metrics (issue 36): a real `sftctl server` with priced jobs in its state; the
exposition parsed with prometheus_client's own parser; who may read it: the server's scrape token
or an admin's, from anywhere, the server's own machine (loopback) included: a local job's
sandboxed nodes share that network."""

from __future__ import annotations

import os
import stat
import time

import pytest

from conftest import sftctl
from test_cost import H, OFFERING, T0, _job
from test_server import Server, tokens

httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")


def test_metrics_export_jobs_queue_and_cost_to_the_scrape_token_and_admins(server, home):
    from sftctl import procs
    from sftctl.controller.placements import controller_alive
    from sftctl.state import JobStatus, LeaseKeeper, Store

    t = tokens("alice", admin="admin1")
    store = Store()
    _job(store, "a1", "alice", [(T0, T0 + 2 * H)])                             # $196.64
    _job(store, "a2", "alice", [(T0, T0 + H)], spot=True, status=JobStatus.FAILED,
         offering={**OFFERING, "spot_usd_per_hour": None})                      # unpriced: 1 node-hour
    _job(store, "b1", "bob", [(T0, T0 + 3 * H), (T0, T0 + 0.25 * H)], status=JobStatus.CANCELLED)  # $319.54
    waiting = store.create_job("waits", {"name": "waits", "resources": {"nodes": 1}, "run": "true"}, owner="bob")
    store._conn.execute("UPDATE jobs SET created_at = ? WHERE id = ?", (time.time() - 600, waiting))
    # its "controller" is this test's process, alive by pid and by lease: the running server's
    # reconcile must not adopt it (CI: it started one, and the job was PROVISIONING when read)
    store.update_job(waiting, controller_pid=os.getpid(), controller_start_ticks=procs.start_ticks(os.getpid()))
    assert store.acquire_lease(waiting, LeaseKeeper.holder_of(os.getpid()), 3600.0)
    assert controller_alive(store.get_job(waiting), store).alive is True  # the server's verdict: not an orphan
    store.close()

    scrape = sftctl("server", "metrics-token", check=True)
    token = scrape.stdout.strip()
    assert len(token) == 43 and scrape.stdout == token + "\n"  # 256 bits, URL-safe base64; the note on stderr
    assert "credentials_file" in scrape.stderr and str(home / "metrics.token") in scrape.stderr
    assert (home / "metrics.token").read_text().strip() == token
    assert stat.S_IMODE(os.stat(home / "metrics.token").st_mode) == 0o600
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in parser.text_string_to_metric_families(r.text)}

    def values(name: str, label: str | None = None) -> dict:
        return {s.labels.get(label) if label else None: s.value for s in families[name].samples}

    jobs = values("sftctl_jobs", "status")
    assert {k: v for k, v in jobs.items() if v} == {"SUCCEEDED": 1, "FAILED": 1, "CANCELLED": 1, "PENDING": 1}
    assert jobs["RUNNING"] == 0 and families["sftctl_jobs"].type == "gauge"
    assert values("sftctl_queue_jobs") == {None: 1}
    assert 590 <= values("sftctl_queue_oldest_wait_seconds")[None] < 3600
    assert values("sftctl_cost_usd", "user") == pytest.approx({"alice": 196.64, "bob": 319.54})
    assert values("sftctl_cost_node_hours", "user") == pytest.approx({"alice": 3.0, "bob": 3.25})
    assert values("sftctl_cost_unpriced_jobs", "user") == {"alice": 1, "bob": 0}
    assert values("sftctl_spend_usd_per_hour") == {None: 0}

    # an admin's token reads it too; through a proxy as directly
    proxied = {"x-forwarded-for": "203.0.113.7"}
    r = httpx.get(f"{server.url}/metrics", headers={**proxied, "authorization": f"Bearer {t['admin1']}"}, timeout=30)
    assert r.status_code == 200 and "sftctl_cost_usd{user=\"alice\"} 196.64" in r.text


def test_metrics_needs_a_token_even_from_the_servers_own_machine(server):
    """A loopback GET /metrics without a token is 401 (a sandboxed job's node shares the server's
    network: it must not read every user's names and costs); a bad token 401; a user who is not
    an admin 403; the scrape token 200."""
    t = tokens("alice")
    r = httpx.get(f"{server.url}/metrics", timeout=30)  # 127.0.0.1 -> 127.0.0.1, no proxy header
    assert r.status_code == 401 and "sftctl_" not in r.text
    doc = r.json()
    assert doc["error"] == "/metrics: no token: every request needs Authorization: Bearer <token>"
    assert "credentials_file" in doc["hint"] and "sftctl server metrics-token" in doc["hint"]
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": "Bearer not-the-scrape-token"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"] == "/metrics: the server knows no user with this token"
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {t['alice']}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"] == "/metrics: alice is not an admin of this server"
    token = sftctl("server", "metrics-token", check=True).stdout.strip()
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200 and "sftctl_queue_jobs 0.0" in r.text
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {token}x"}, timeout=30)
    assert r.status_code == 401


def test_the_scrape_token_from_the_environment_replaces_the_file(home, tmp_path):
    """SFTCTL_SERVER_METRICS_TOKEN set for the server: that value, and no file is made."""
    server = Server(home, tmp_path / "server.log", env={"SFTCTL_SERVER_METRICS_TOKEN": "lab-scrape-secret"}).start()
    try:
        ok = httpx.get(f"{server.url}/metrics", headers={"authorization": "Bearer lab-scrape-secret"}, timeout=30)
        assert ok.status_code == 200 and "sftctl_jobs" in ok.text
        assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 401
        assert not (home / "metrics.token").exists()
    finally:
        server.stop()


def test_the_node_agents_metrics_endpoint_serves_prometheus_clients_text():
    """The agent's own /metrics (its HTTP server on a loopback port): dcgm's names, parsed back."""
    import socket
    import threading

    from sftctl.agent import _serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    latest = [{"ts": 1.0, "gpu": 0, "uuid": "GPU-0", "clock_sm_mhz": 1980, "power_usage_mw": 650_500,
               "pcie_replay_counter": 4, "xids": [79]}]
    _serve(port, latest, threading.Lock(), token="agent-token")  # the token: tests/test_agent_metrics_token.py
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer agent-token"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    got = {f.name: (f.type, f.samples[0].value, f.samples[0].labels) for f in parser.text_string_to_metric_families(r.text)}
    assert got["DCGM_FI_DEV_SM_CLOCK"][:2] == ("gauge", 1980)
    assert got["DCGM_FI_DEV_POWER_USAGE"][1] == pytest.approx(650.5)
    assert got["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"][:2] == ("unknown", 4)
    assert got["DCGM_FI_DEV_XID_ERRORS"][1] == 79 and got["DCGM_FI_DEV_XID_ERRORS"][2]["UUID"] == "GPU-0"
    assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=30).status_code == 404
