"""The state store: owner-only WAL file, schema versions, the lifecycle CAS, many writers."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys

import pytest

from conftest import deadline, sftctl
from sftctl.errors import SftctlError
from sftctl.state import SCHEMA_VERSION, IllegalTransition, JobStatus, Store


def test_file_is_owner_only_wal_and_versioned(home):
    store = Store()
    path = home / "state.db"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert store.schema_version == SCHEMA_VERSION
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"jobs", "nodes", "attempts", "events", "metrics"} <= tables


def test_newer_schema_is_refused(home):
    Store().close()
    conn = sqlite3.connect(home / "state.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SftctlError, match="newer than this sftctl"):
        Store()


def test_migrates_an_unversioned_file(tmp_path):
    path = tmp_path / "old.db"
    sqlite3.connect(path).execute("CREATE TABLE unrelated (x)").connection.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION
    assert store.list_jobs() == []


def test_lifecycle_is_enforced(home):
    store = Store()
    job = store.create_job("demo", {"run": "true"})
    assert store.get_job(job).status == "PENDING"
    for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.RECOVERING,
              JobStatus.LAUNCHING, JobStatus.RUNNING):
        assert store.transition(job, s)
    with pytest.raises(IllegalTransition):
        store.transition(job, JobStatus.PENDING)
    assert store.transition(job, JobStatus.CANCELLED, "cancelled by test")
    assert not store.transition(job, JobStatus.SUCCEEDED)  # a terminal job stays where it is
    got = store.get_job(job)
    assert got.status == "CANCELLED" and got.failure_reason == "cancelled by test"
    assert got.ended_at is not None
    messages = [e.message for e in store.events(job)]
    assert messages[0] == "job submitted (PENDING)"
    assert messages[-1] == "RUNNING -> CANCELLED: cancelled by test"


def test_a_schema_2_file_keeps_its_jobs_and_gains_failure_codes(home):
    """Schema 3 adds the code of each failure line (jobs.failure_code, attempts.reason_code):
    a version-2 file migrates in place, its rows read back with no code; new endings get one."""
    from sftctl.state import MIGRATIONS

    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    conn = sqlite3.connect(home / "state.db", isolation_level=None)
    for migration in MIGRATIONS[:2]:
        for statement in migration.split(";"):
            if statement.strip():
                conn.execute(statement)
    conn.execute("INSERT INTO jobs (id, name, status, spec_json, failure_reason, created_at, updated_at)"
                 " VALUES ('old-1', 'old', 'FAILED', '{}', 'node 0 exited with code 3', 1.0, 2.0)")
    conn.execute("INSERT INTO attempts (job_id, number, status, exit_code, reason, started_at)"
                 " VALUES ('old-1', 1, 'FAILED', 3, 'node 0 exited with code 3', 1.0)")
    conn.execute("PRAGMA user_version = 2")
    conn.close()
    store = Store()
    assert store.schema_version == SCHEMA_VERSION == 3
    old = store.get_job("old-1")
    assert (old.failure_reason, old.failure_code) == ("node 0 exited with code 3", None)
    assert [(a.reason, a.reason_code) for a in store.attempts("old-1")] == [("node 0 exited with code 3", None)]
    job = store.create_job("new", {"run": "true"})
    assert store.transition(job, JobStatus.PROVISIONING)
    n = store.start_attempt(job)
    store.end_attempt(job, n, "FAILED", 137, "node 0 exited with code 137: killed by SIGKILL (signal 9)", "signal")
    assert store.transition(job, JobStatus.FAILED, "node 0 exited with code 137: killed by SIGKILL (signal 9)",
                            code="signal", strict=False)
    got = store.get_job(job)
    assert got.failure_code == "signal" and store.attempts(job)[0].reason_code == "signal"
    assert store.events(job)[-1].data == {"code": "signal"}


def test_metrics_keep_first_and_latest(home):
    store = Store()
    job = store.create_job("demo", {})
    store.record_metrics(job, [{"rank": 0, "step": 1, "loss": 5.5, "ts": 1.0}])
    store.record_metrics(job, [{"rank": 0, "step": 9, "loss": 2.0, "tokens_per_s": 10.0, "ts": 2.0}])
    (m,) = store.metrics(job)
    assert (m.first_step, m.first_loss, m.step, m.loss, m.tokens_per_s) == (1, 5.5, 9, 2.0, 10.0)


def test_dead_controller_is_reaped_live_one_is_not(home):
    store = Store()
    dead = store.create_job("dead", {})
    live = store.create_job("live", {})
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    from sftctl import procs

    store.update_job(dead, controller_pid=proc.pid, controller_start_ticks=123)
    store.update_job(live, controller_pid=os.getpid(), controller_start_ticks=procs.start_ticks(os.getpid()))
    assert store.reap_dead_controllers() == [dead]
    assert store.get_job(dead).status == "FAILED_CONTROLLER"
    assert "exited without finishing" in store.get_job(dead).failure_reason
    assert store.get_job(live).status == "PENDING"


WRITER = r"""
import sys
from sftctl.state import JobStatus, Store
store = Store()
for i in range(int(sys.argv[1])):
    job = store.create_job("w", {"i": i})
    store.transition(job, JobStatus.PROVISIONING)
    store.add_node(job, 0, "local")
    store.record_metrics(job, [{"rank": 0, "step": i, "loss": 1.0}])
    store.add_event(job, "test", f"writer event {i}")
    store.transition(job, JobStatus.CANCELLED, "done")
print("ok")
"""


def test_twenty_concurrent_writers(home):
    """20 processes writing at once: no 'database is locked', nothing lost."""
    per_writer = 15
    procs_ = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(per_writer)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(20)
    ]
    results = [p.communicate(timeout=deadline(240)) for p in procs_]
    for p, (out, errout) in zip(procs_, results):
        assert p.returncode == 0, errout
        assert out.strip() == "ok"
    store = Store()
    jobs = store.list_jobs()
    assert len(jobs) == 20 * per_writer
    assert all(j.status == "CANCELLED" for j in jobs)
    assert sum(len(store.events(j.id)) for j in jobs) == 20 * per_writer * 4


def test_newer_schema_is_refused_also_when_not_in_wal_mode(home):
    """Issue 14.11: the future-schema check ran only for WAL files; a newer file in rollback
    mode was converted to WAL and used."""
    Store().close()
    conn = sqlite3.connect(home / "state.db")
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SftctlError, match="newer than this sftctl"):
        Store()
    assert sqlite3.connect(home / "state.db").execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_a_truncated_state_db_is_an_error_not_an_empty_history(home):
    """Issue 14.11: a 0-byte state.db silently became a new, empty one (every job gone)."""
    store = Store()
    store.create_job("a", {"resources": {"nodes": 1}, "run": "true"})
    store.close()
    os.truncate(home / "state.db", 0)
    for suffix in ("-wal", "-shm"):
        (home / f"state.db{suffix}").unlink(missing_ok=True)
    proc = sftctl("status")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0].endswith("the state database is empty (0 bytes): it was truncated, "
                                                 "and the jobs it recorded are lost")
    assert os.path.getsize(home / "state.db") == 0  # left as found, for the user to look at


def test_a_new_state_db_is_never_an_empty_file(home):
    Store().close()
    assert os.path.getsize(home / "state.db") > 0
    assert sorted(p.name for p in home.iterdir() if p.name.startswith("state.db.new")) == []


def test_a_corrupted_state_db_gives_one_line_not_a_traceback(home):
    """Issue 14.11: damaged pages inside the file (the header intact) broke every command with a
    traceback at the first query."""
    store = Store()
    spec = {"resources": {"nodes": 1}, "run": "true", "note": "x" * 2000}
    for _ in range(40):
        store.create_job("a", spec)
    store.close()
    path = home / "state.db"
    data = bytearray(path.read_bytes())
    assert len(data) > 8 * 4096
    data[2 * 4096:len(data) - 4096] = os.urandom(len(data) - 3 * 4096)
    path.write_bytes(bytes(data))
    for args in (("status",), ("status", "--json"), ("events", "a")):
        proc = sftctl(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert "state database" in line and str(path) in line


def test_node_and_attempt_statuses_are_enum_members(home):
    """Every node and attempt status state keeps is a member of NodeState / AttemptStatus (the
    controller's PENDING and REPLACED too), read back as the member."""
    from sftctl.types import AttemptStatus, NodeState

    store = Store()
    job = store.create_job("vocab", {"name": "vocab"})
    node = store.add_node(job, 0, "local")
    assert store.nodes(job)[0].status is NodeState.PROVISIONING
    for status in (NodeState.PENDING, NodeState.RUNNING, NodeState.REPLACED):
        store.update_node(node, status=status)
        assert store.nodes(job)[0].status is status and f"{status}" == status.value
    first = store.start_attempt(job)
    assert store.attempts(job)[0].status is AttemptStatus.RUNNING
    store.end_attempt(job, first, AttemptStatus.FAILED, 3, "node 0 exited with code 3", "exit")
    store.start_attempt(job)
    assert store.end_open_attempts(job, AttemptStatus.ABANDONED, "gone") == 1
    assert [a.status for a in store.attempts(job)] == [AttemptStatus.FAILED, AttemptStatus.ABANDONED]
    with pytest.raises(ValueError):
        store.update_node(node, status="BORED")  # not a node status: refused before it is written
    assert store.nodes(job)[0].status is NodeState.REPLACED
    store.close()
