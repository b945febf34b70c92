"""Issue 26: what can never run is refused before anything starts, `--dry-run` stays small for
any node count, `down` returns within seconds for any job, and messages blame the right thing."""

from __future__ import annotations

import os
import time

import pytest

from conftest import deadline, job_processes, write_spec


def test_a_job_larger_than_this_machine_is_refused_at_submit(tmp_path, home):
    """10,000 local nodes used to be admitted (10,000 node dirs, a load of 53); now submit refuses
    it at once (exit 3), naming the cores, and nothing is recorded or started."""
    from sftctl import api
    from sftctl.errors import InfeasibleError

    spec = write_spec(tmp_path / "big.yaml", "name: big\nresources: {nodes: 10000, clouds: [local]}\nrun: echo hi\n")
    started = time.monotonic()
    with pytest.raises(InfeasibleError) as e:
        api.submit(str(spec))
    took = time.monotonic() - started
    assert took < 2 * deadline(1.0), took
    cores = os.cpu_count() or 1
    assert e.value.exit_code == 3
    assert f"local: 10000 node(s) x 1 CPU need 10000 CPUs; this machine has {cores} cores" in e.value.message
    assert "lower resources.nodes" in e.value.hint
    assert api.status() == [] and not (home / "jobs").exists()


def test_the_local_node_cap_refuses_at_submit(tmp_path, home, monkeypatch):
    """SFTCTL_LOCAL_MAX_NODES below resources.nodes can never provision the job: said at submit."""
    from sftctl import api
    from sftctl.errors import InfeasibleError

    monkeypatch.setenv("SFTCTL_LOCAL_MAX_NODES", "0")
    spec = write_spec(tmp_path / "one.yaml", "name: one\nresources: {clouds: [local]}\nrun: echo hi\n")
    with pytest.raises(InfeasibleError, match=r"1 node\(s\) is more than SFTCTL_LOCAL_MAX_NODES=0 lends a job"):
        api.submit(str(spec))
    assert api.status() == []


def test_a_thousand_node_dry_run_is_small_and_quick(tmp_path, home, monkeypatch):
    """`run --dry-run` of 1,000 nodes used to render every node (20 MB for 1,000 cloud nodes, 1 GB
    for 10,000): node 0 is shown in full, the other 999 in one summary."""
    import json

    from conftest import sftctl

    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)  # credentials present: aws is usable for planning; nothing is called
    spec = write_spec(tmp_path / "k.yaml", 'name: k\nresources: {nodes: 1000, accelerators: ["L4:1"], clouds: [aws]}\n'
                      "storage: s3://bucket/prefix\nrun: echo hi\n")
    from sftctl import api

    started = time.monotonic()
    doc = api.dry_run(str(spec))
    took = time.monotonic() - started
    assert took < deadline(5.0), took
    assert [n["rank"] for n in doc["nodes"]] == [0]
    assert doc["other_nodes"]["count"] == 999 and doc["other_nodes"]["ranks"] == [1, 999]
    assert "SFTCTL_NODE_RANK" in doc["other_nodes"]["env_differs"]
    assert len(json.dumps(doc)) < 100_000
    text = sftctl("run", str(spec), "--dry-run", check=True).stdout
    assert "would provision: 1000 node(s)" in text and "nodes 1-999: as node 0, except" in text
    assert len(text) < 100_000 and text.count("attempt script (node.sh)") == 1


def _two_hundred_node_job(store, tmp_path, nodes: int = 200) -> tuple[str, list]:
    """A RUNNING local job of ``nodes`` nodes, each a real process (a `sleep`) tagged as the local
    provider tags its nodes, with its handle in state. (Submit refuses so many local nodes on
    this machine now, so the job is written into state as a controller would have.)"""
    import subprocess

    from sftctl import procs
    from sftctl.providers.local import HOME_TAG, _home_tag
    from sftctl.state import JobStatus, NodeState
    from sftctl.types import LocalHandle

    job = store.create_job("wide", {"name": "wide", "run": "sleep 300", "resources": {"nodes": nodes}})
    store.update_job(job, provider="local")
    for status in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING):
        assert store.transition(job, status)
    children = []
    for rank in range(nodes):
        node = store.add_node(job, rank, "local")
        env = {**os.environ, "SFTCTL_JOB_ID": job, "SFTCTL_NODE_ID": node, HOME_TAG: _home_tag()}
        p = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        children.append(p)
        d = tmp_path / "nodes" / node
        d.mkdir(parents=True)
        handle = LocalHandle(job_id=job, node_id=node, rank=rank, dir=str(d), ip="127.0.0.1", pid=p.pid,
                             start_ticks=procs.start_ticks(p.pid), attempt=1, exit_file=str(d / "exit-1"))
        store.update_node(node, status=NodeState.RUNNING, handle=handle.to_dict())
    return job, children


def test_down_of_a_200_node_local_job_returns_quickly_and_leaves_nothing(tmp_path, home):
    """`down` of a wide job used to scan /proc once per node and wait for each node in turn
    (10,000 nodes: no return within 120 s). Now every node is stopped in one sweep: 200 nodes
    come down well within 30 s even on a busy machine, nothing is left, and a second `down`
    is a no-op."""
    from sftctl import api
    from sftctl.state import Store

    store = Store()
    job, children = _two_hundred_node_job(store, tmp_path)
    try:
        assert len(job_processes(job)) == 200
        seen: list[str] = []
        started = time.monotonic()
        [result] = api.down(job, progress=seen.append)
        took = time.monotonic() - started
        assert job_processes(job) == []
        assert all(p.wait(timeout=10) is not None for p in children)  # reaped: they really ended
        assert took < min(30.0, deadline(4.0)), took  # 17.8 s before (2 cores, busy), 1.7 s after
        assert result.status == "CANCELLED" and "stopped 200 running node(s)" in result.summary
        assert seen and "200 node(s)" in seen[0]
        [again] = api.down(job)
        assert "nothing left to take down" in again.summary
    finally:
        for p in children:
            p.kill()
