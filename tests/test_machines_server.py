"""Issue 41.5: the memory of bad machines through a server (``GET /v1/machines``,
``sftctl nodes`` with ``server.url`` set): an admin sees every mark, a user those whose latest
verdict was on one of their own jobs, another user none of them. A real server process on a
loopback port and its state; the marks are written as a controller writes them."""

from __future__ import annotations

import json

import pytest

from conftest import sftctl, wait_for
from test_server import as_user, tokens

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def test_nodes_through_the_server_shows_an_admin_every_mark_and_a_user_their_jobs(server, tmp_path, monkeypatch):
    from sftctl import api
    from sftctl.state import Store

    t = tokens("alice", "bob", admin="admin1")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: quick\nresources: {nodes: 1}\nrun: echo done\n")
    as_user(monkeypatch, server, t["alice"])
    job = api.run(str(spec), detach=True).id
    wait_for(lambda: api.status(job).status.terminal, timeout_s=120, what="alice's job to end")

    store = Store()  # the server's state (same home): what a controller's verdict writes
    try:
        store.mark_bad_machine("slurm", "node3", "preflight_slow", "all-reduce over 2 nodes at 0.04 GB/s bus, 5% of "
                               "predicted 0.8 GB/s", job_id=job)
        store.mark_bad_machine("kubernetes", "gke-b-7", "xid", "XID 79: fell off the bus", zone="us-central1-a",
                               job_id="someone-elses-job")
        store.mark_bad_machine("slurm", "node9", "preflight_failed", "dcgmi diag -r 1 failed", job_id=job,
                               now=1000.0, decay_s=60.0)  # decayed long ago
    finally:
        store.close()

    assert [(m.provider, m.machine, m.kind) for m in api.machines()] == [("slurm", "node3", "preflight_slow")]
    assert [m.machine for m in api.machines(include_decayed=True)] == ["node3", "node9"]
    assert api.machines("kubernetes") == []
    proc = sftctl("nodes", "--json", check=True)
    [row] = json.loads(proc.stdout)["machines"]
    assert row["machine"] == "node3" and row["job_id"] == job and "0.04 GB/s" in row["evidence"]
    assert "node3" in sftctl("nodes", check=True).stdout

    as_user(monkeypatch, server, t["bob"])
    assert api.machines() == [] and api.machines(include_decayed=True) == []
    assert json.loads(sftctl("nodes", "--json", check=True).stdout) == {"machines": []}

    as_user(monkeypatch, server, t["admin1"])
    assert sorted(m.machine for m in api.machines()) == ["gke-b-7", "node3"]
    [k8s] = api.machines("kubernetes")
    assert (k8s.zone, k8s.kind, k8s.count) == ("us-central1-a", "xid", 1)
    assert len(api.machines(include_decayed=True)) == 3
