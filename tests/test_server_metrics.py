"""The server's /metrics (issue 36): a real `sftctl server` with priced jobs in its state; the
exposition parsed with prometheus_client's own parser; who may read it (loopback, an admin's
token; a proxied request is never loopback)."""

from __future__ import annotations

import time

import pytest

from test_cost import H, OFFERING, T0, _job
from test_server import Server, tokens

httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")


@pytest.fixture
def server(home, tmp_path):
    s = Server(home, tmp_path / "server.log").start()
    yield s
    s.stop()


def test_metrics_export_jobs_queue_and_cost_to_loopback_and_admins(server):
    from sftctl.state import JobStatus, Store

    t = tokens("alice", admin="admin1")
    store = Store()
    _job(store, "a1", "alice", [(T0, T0 + 2 * H)])                             # $196.64
    _job(store, "a2", "alice", [(T0, T0 + H)], spot=True, status=JobStatus.FAILED,
         offering={**OFFERING, "spot_usd_per_hour": None})                      # unpriced: 1 node-hour
    _job(store, "b1", "bob", [(T0, T0 + 3 * H), (T0, T0 + 0.25 * H)], status=JobStatus.CANCELLED)  # $319.54
    waiting = store.create_job("waits", {"name": "waits", "resources": {"nodes": 1}, "run": "true"}, owner="bob")
    store._conn.execute("UPDATE jobs SET created_at = ? WHERE id = ?", (time.time() - 600, waiting))
    store.close()

    r = httpx.get(f"{server.url}/metrics", timeout=30)  # from this machine: no token needed
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

    # through a proxy the peer is never loopback: an admin's token, else 401 / 403
    proxied = {"x-forwarded-for": "203.0.113.7"}
    r = httpx.get(f"{server.url}/metrics", headers=proxied, timeout=30)
    assert r.status_code == 401 and "no token" in r.json()["error"]
    r = httpx.get(f"{server.url}/metrics", headers={**proxied, "authorization": f"Bearer {t['alice']}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"] == "/metrics: alice is not an admin of this server"
    r = httpx.get(f"{server.url}/metrics", headers={**proxied, "authorization": f"Bearer {t['admin1']}"}, timeout=30)
    assert r.status_code == 200 and "sftctl_cost_usd{user=\"alice\"} 196.64" in r.text


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
    _serve(port, latest, threading.Lock())
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    got = {f.name: (f.type, f.samples[0].value, f.samples[0].labels) for f in parser.text_string_to_metric_families(r.text)}
    assert got["DCGM_FI_DEV_SM_CLOCK"][:2] == ("gauge", 1980)
    assert got["DCGM_FI_DEV_POWER_USAGE"][1] == pytest.approx(650.5)
    assert got["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"][:2] == ("unknown", 4)
    assert got["DCGM_FI_DEV_XID_ERRORS"][1] == 79 and got["DCGM_FI_DEV_XID_ERRORS"][2]["UUID"] == "GPU-0"
    assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=30).status_code == 404
