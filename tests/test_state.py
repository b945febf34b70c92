"""The state store: owner-only WAL file, schema versions, the lifecycle CAS, many writers."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import time

import pytest

from conftest import deadline, sftctl, wait_for
from sftctl.errors import SftctlError
from sftctl.state import SCHEMA_VERSION, IllegalTransition, JobStatus, Store

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


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


def test_lifecycle_is_enforced(state_backend):
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


def test_an_ended_job_keeps_no_waiting_note(state_backend):
    """A job that ended while it waited (its waiter killed: reaped FAILED_CONTROLLER; cancelled)
    or while a scheduler still queued a node keeps no ``pending_reason``: its record said
    "waiting for CPUs: ..." after it had ended."""
    store = Store()
    note = "waiting for CPUs: 2 of this machine's 2 are taken by 1 local job(s), this job needs 1"
    ended = {}
    for end, path in ((JobStatus.CANCELLED, ()), (JobStatus.FAILED_CONTROLLER, ()),
                      (JobStatus.SUCCEEDED, (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING))):
        job = store.create_job("demo", {"run": "true"})
        for s in path:
            assert store.transition(job, s)
        store.update_job(job, pending_reason=note)
        assert store.get_job(job).pending_reason == note
        assert store.transition(job, end, "ended by test" if end != JobStatus.SUCCEEDED else None)
        ended[end] = store.get_job(job).pending_reason
    assert ended == dict.fromkeys((JobStatus.CANCELLED, JobStatus.FAILED_CONTROLLER, JobStatus.SUCCEEDED))
    job = store.create_job("demo", {"run": "true"})  # a live move keeps the note its owner writes
    store.update_job(job, pending_reason=note)
    assert store.transition(job, JobStatus.PROVISIONING) and store.get_job(job).pending_reason == note


def test_a_schema_2_file_keeps_its_jobs_and_gains_failure_codes(home):
    """Schema 3 adds the code of each failure line (jobs.failure_code, attempts.reason_code):
    a version-2 file migrates in place, its rows read back with no code; new endings get one."""
    from sftctl.state import MIGRATIONS, SQLITE

    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    conn = sqlite3.connect(home / "state.db", isolation_level=None)
    for migration in MIGRATIONS[:2]:
        for statement in SQLITE.statements(migration):
            conn.execute(statement)
    conn.execute("INSERT INTO jobs (id, name, status, spec_json, failure_reason, created_at, updated_at)"
                 " VALUES ('old-1', 'old', 'FAILED', '{}', 'node 0 exited with code 3', 1.0, 2.0)")
    conn.execute("INSERT INTO attempts (job_id, number, status, exit_code, reason, started_at)"
                 " VALUES ('old-1', 1, 'FAILED', 3, 'node 0 exited with code 3', 1.0)")
    conn.execute("PRAGMA user_version = 2")
    conn.close()
    store = Store()
    assert store.schema_version == SCHEMA_VERSION
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


def test_metrics_keep_first_and_latest(state_backend):
    store = Store()
    job = store.create_job("demo", {})
    store.record_metrics(job, [{"rank": 0, "step": 1, "loss": 5.5, "ts": 1.0}])
    store.record_metrics(job, [{"rank": 0, "step": 9, "loss": 2.0, "tokens_per_s": 10.0, "ts": 2.0}])
    (m,) = store.metrics(job)
    assert (m.first_step, m.first_loss, m.step, m.loss, m.tokens_per_s) == (1, 5.5, 9, 2.0, 10.0)


def test_dead_controller_is_reaped_live_one_is_not(state_backend):
    store = Store()
    dead = store.create_job("dead", {})
    live = store.create_job("live", {})
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    from sftctl import procs

    store.update_job(dead, controller_pid=proc.pid, controller_start_ticks=123)
    store.update_job(live, controller_pid=os.getpid(), controller_start_ticks=procs.start_ticks(os.getpid()))
    if state_backend == "postgres":  # a shared state: liveness is the lease (the controller may run elsewhere)
        elsewhere = store.create_job("elsewhere", {})
        store.update_job(elsewhere, controller_pid=proc.pid, controller_start_ticks=123)  # no such pid here
        assert store.acquire_lease(elsewhere, "other-machine:1:1", 60.0)
        assert store.acquire_lease(live, "this-machine:1:1", 60.0)
    assert store.reap_dead_controllers() == [dead]
    assert store.get_job(dead).status == "FAILED_CONTROLLER"
    assert "exited without finishing" in store.get_job(dead).failure_reason
    assert store.get_job(live).status == "PENDING"
    if state_backend == "postgres":
        assert store.get_job(elsewhere).status == "PENDING"


WRITER = r"""
import sys
import time
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


def test_twenty_concurrent_writers(state_backend):
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


def test_node_and_attempt_statuses_are_enum_members(state_backend):
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


# ---------------------------------------------------------------- schema 4-7, both dialects


def test_a_state_db_of_the_previous_sftctl_migrates_forward(home):
    """tests/fixtures/state-v3.db was written by sftctl's own Store at schema 3: it migrates to
    the current schema in place, its job keeps everything and gains an owner (this machine's
    user), its terminated node an end time, and the version is in schema_version too."""
    import shutil

    from sftctl.state import os_user

    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copy(os.path.join(FIXTURES, "state-v3.db"), home / "state.db")
    assert sqlite3.connect(home / "state.db").execute("PRAGMA user_version").fetchone()[0] == 3
    store = Store()
    assert store.schema_version == SCHEMA_VERSION  # every migration appended since, whatever their number
    assert sqlite3.connect(home / "state.db").execute("SELECT version FROM schema_version").fetchall() == [
        (SCHEMA_VERSION,)]
    (job,) = store.list_jobs()
    assert (job.id, job.status, job.failure_code, job.owner) == ("old-0e0435", "FAILED", "exit", os_user())
    assert job.offering.instance_type == "p5.48xlarge"
    assert store.list_jobs(owner=os_user()) == [job] and store.list_jobs(owner="nobody-else") == []
    n0, n1 = store.nodes(job.id)
    assert (n0.status, n0.ended_at) == ("TERMINATED", n0.updated_at) and n1.ended_at is None
    assert [m.step for m in store.metrics(job.id)] == [5]
    assert [e.message for e in store.events(job.id)][-1] == "PROVISIONING -> FAILED: node 0 exited with code 3"
    assert store.list_users() == []
    store.close()
    Store().close()  # a second open finds it current: nothing to do


def test_postgres_gets_the_same_schema(pg_url):
    """One list of migrations: a new Postgres database has every table and column a SQLite
    file has (by name), and the version in schema_version."""
    import psycopg

    Store().close()
    Store(os.path.join(os.environ["SFTCTL_HOME"], "state.db")).close()
    lite = sqlite3.connect(os.path.join(os.environ["SFTCTL_HOME"], "state.db"))
    want = {(t, c) for (t,) in lite.execute("SELECT name FROM sqlite_master WHERE type='table'"
                                             " AND name NOT LIKE 'sqlite_%'")
            for c in [r[1] for r in lite.execute(f"PRAGMA table_info({t})")]}
    with psycopg.connect(pg_url) as conn:
        got = set(conn.execute("SELECT table_name, column_name FROM information_schema.columns"
                               " WHERE table_schema = 'public'").fetchall())
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    assert got == want and len(want) > 50


def test_a_newer_postgres_schema_is_refused(pg_url):
    import psycopg

    Store().close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(SftctlError, match="newer than this sftctl"):
        Store()


def test_the_postgres_path_is_chosen_by_state_url_and_said_with_no_password(postgres, pg_url, monkeypatch, tmp_path):
    from sftctl.state import redact

    store = Store()
    assert store.dialect.name == "postgres" and store.path is None
    job = store.create_job("pg", {"run": "true"})
    assert Store().get_job(job).name == "pg"  # a second store sees it: no state.db involved
    assert not (tmp_path / "home" / "state.db").exists()
    assert redact("postgresql://lab:s3cr3t@db.example:5432/sftctl") == "postgresql://lab:***@db.example:5432/sftctl"
    assert redact("postgresql://db.example/sftctl?user=lab&password=s3cr3t&sslmode=require") == \
        "postgresql://db.example/sftctl?user=lab&password=***&sslmode=require"
    blocked = subprocess.run([sys.executable, "-c", "import sys; sys.modules['psycopg'] = None\n"
                              "from sftctl.state import Store\nStore()"], capture_output=True, text=True)
    assert blocked.returncode == 1 and blocked.stderr.strip().splitlines()[-1] == (
        f"sftctl.errors.SftctlError: state.url is {redact(pg_url)}, but psycopg is not installed")
    monkeypatch.setenv("SFTCTL_STATE_URL", "postgresql://lab:s3cr3t@/nosuchdb?host=" + str(tmp_path))
    with pytest.raises(SftctlError) as e:
        Store()
    assert "cannot connect to the state database" in e.value.message and "s3cr3t" not in e.value.message
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as admin:  # a role that may not create the tables
        admin.execute("CREATE ROLE reader LOGIN")
        admin.execute("CREATE DATABASE empty_for_reader")
    monkeypatch.setenv("SFTCTL_STATE_URL", postgres.url("empty_for_reader").replace("postgres@", "reader@"))
    with pytest.raises(SftctlError, match="cannot connect to the state database: permission denied"):
        Store()


def test_users_tokens_are_stored_hashed(state_backend):
    """create_user returns a token once; only its SHA-256 is stored; user_for_token finds the
    user by it, and nobody by a wrong, altered or empty one."""
    import hashlib

    store = Store()
    alice = store.create_user("alice")
    root = store.create_user("root", admin=True)
    assert alice.startswith("sft_") and len(alice) == 4 + 43 and alice != root
    got = store.user_for_token(alice)
    assert (got.name, got.admin) == ("alice", False)
    assert store.user_for_token(root).admin is True
    for wrong in ("", alice[:-1], alice + "x", root.upper(), "sft_" + "A" * 43, None):
        assert store.user_for_token(wrong) is None
    assert [(u.name, u.admin) for u in store.list_users()] == [("alice", False), ("root", True)]
    with pytest.raises(SftctlError, match="user alice already exists"):
        store.create_user("alice")
    with pytest.raises(SftctlError, match="not valid"):
        store.create_user("bob; DROP TABLE users")
    rows = store._conn.execute("SELECT * FROM users ORDER BY name").fetchall()
    assert [r["token_hash"] for r in rows] == [hashlib.sha256(t.encode()).hexdigest() for t in (alice, root)]
    assert all(alice not in str(v) and root not in str(v) for r in rows for v in dict(r).values())


def test_tokens_expire_rotate_and_users_are_removed_with_an_audit(state_backend):
    """A token's expiry is kept and read back; rotation replaces the hash (the old token finds
    nobody); removal forgets the user; each admin action is an audit row, in order."""
    store = Store()
    soon = time.time() + 3600
    alice = store.create_user("alice", expires_at=soon, actor="root")
    forever = store.create_user("root", admin=True)  # no actor: the first admin, not audited
    got = store.user_for_token(alice)
    assert got.expires_at == pytest.approx(soon) and not got.expired() and got.expired(now=soon + 1)
    assert store.user_for_token(forever).expires_at is None and not store.user_for_token(forever).expired()
    new = store.rotate_token("alice", None, actor="root")
    assert new.startswith("sft_") and new != alice
    assert store.user_for_token(alice) is None and store.user_for_token(new).expires_at is None
    assert store.rotate_token("nobody", None, actor="root") is None
    assert store.remove_user("alice", actor="root") is True
    assert store.user_for_token(new) is None and store.get_user("alice") is None
    assert store.remove_user("alice", actor="root") is False
    store.add_audit("root", "orphans", None, "2 swept")
    events = store.audit()
    assert [(e.actor, e.action, e.target) for e in events] == [
        ("root", "user.add", "alice"), ("root", "token.rotate", "alice"), ("root", "user.remove", "alice"),
        ("root", "orphans", None)]
    assert events[0].detail.startswith("expires 20") and events[1].detail == "expires never"
    assert events[3].detail == "2 swept" and events[0].ts <= events[3].ts
    assert [e.action for e in store.audit(limit=2)] == ["user.remove", "orphans"]
    store.close()


def test_users_of_the_schema_before_expiry_never_expire(state_backend, monkeypatch):
    """The migration that adds expiry and the audit, on both dialects: a user recorded before it
    keeps their token, which never expires; the audit starts empty."""
    import sftctl.state as state

    mine = next(i for i, m in enumerate(state.MIGRATIONS) if "CREATE TABLE audit" in m)
    with monkeypatch.context() as m:
        m.setattr(state.connection, "SCHEMA_VERSION", mine)  # a state written by the sftctl before it
        old = Store()
        assert old.schema_version == mine
        with old.write() as db:
            db.execute("INSERT INTO users (name, admin, token_hash, created_at) VALUES (?, ?, ?, ?)",
                       ("olduser", 1, state._token_hash("sft_old"), 1.0))
        old.close()
    store = Store()
    assert store.schema_version == SCHEMA_VERSION
    user = store.user_for_token("sft_old")
    assert (user.name, user.admin, user.expires_at, user.expired()) == ("olduser", True, None, False)
    assert store.audit() == []
    store.close()


def test_jobs_have_owners(state_backend):
    from sftctl.state import os_user

    store = Store()
    mine = store.create_job("a", {})
    hers = store.create_job("b", {}, owner="alice")
    assert store.get_job(mine).owner == os_user() and store.get_job(hers).owner == "alice"
    assert [j.id for j in store.list_jobs(owner="alice")] == [hers]
    assert [j.id for j in store.list_jobs({JobStatus.PENDING}, owner=os_user())] == [mine]
    assert {j.id for j in store.list_jobs()} == {mine, hers}


def test_a_node_records_when_it_stopped_billing(state_backend):
    from sftctl.types import NodeState

    store = Store()
    job = store.create_job("bill", {})
    node = store.add_node(job, 0, "aws")
    store.update_node(node, status=NodeState.RUNNING)
    assert store.nodes(job)[0].ended_at is None
    store.update_node(node, status=NodeState.TERMINATED)
    ended = store.nodes(job)[0].ended_at
    assert ended is not None and ended >= store.nodes(job)[0].created_at
    store.update_node(node, status=NodeState.TERMINATED, handle={"terminated": True})
    assert store.nodes(job)[0].ended_at == ended  # kept from the first time


# ---------------------------------------------------------------- leases


def test_a_held_lease_is_never_taken_until_it_expires(state_backend):
    """Two Stores (on Postgres: two connections, as two servers have): the second never
    acquires a held, unexpired lease; it takes it once expired, and the first then cannot renew."""
    first, second = Store(), Store()
    job = first.create_job("leased", {})
    assert first.acquire_lease(job, "server-a", ttl_s=3.0)
    assert first.acquire_lease(job, "server-a", ttl_s=3.0)  # its own: extended
    started = time.monotonic()
    while time.monotonic() - started < 1.0:
        assert not second.acquire_lease(job, "server-b", ttl_s=3.0)
    assert first.renew_lease(job, "server-a", ttl_s=2.0)
    assert second.lease(job)[0] == "server-a"
    assert not second.renew_lease(job, "server-b", ttl_s=3.0) and not second.release_lease(job, "server-b")
    wait_for(lambda: second.lease(job) is None, timeout_s=deadline(30), what="the lease to expire")
    assert second.acquire_lease(job, "server-b", ttl_s=60.0)
    assert not first.renew_lease(job, "server-a", ttl_s=60.0)
    assert not first.acquire_lease(job, "server-a", ttl_s=60.0)
    assert first.lease(job)[0] == "server-b"
    assert second.release_lease(job, "server-b") and first.acquire_lease(job, "server-a", ttl_s=60.0)


RACER = r"""
import sys
import time
from sftctl.state import Store
store = Store()
print("won" if store.acquire_lease(sys.argv[1], sys.argv[2], 60.0) else "lost")
"""


def test_racing_controllers_one_wins_the_lease(state_backend):
    """Eight processes ask for the same free lease at once: exactly one gets it."""
    store = Store()
    job = store.create_job("race", {})
    procs_ = [subprocess.Popen([sys.executable, "-c", RACER, job, f"racer-{i}"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(8)]
    results = [p.communicate(timeout=deadline(120)) for p in procs_]
    assert all(p.returncode == 0 for p in procs_), [e for _, e in results]
    winners = [f"racer-{i}" for i, (out, _) in enumerate(results) if out.strip() == "won"]
    assert len(winners) == 1 and [o.strip() for o, _ in results].count("lost") == 7
    assert store.lease(job)[0] == winners[0]


def test_a_waiting_store_and_a_lease_keeper_hold_no_postgres_connection(pg_url):
    """Postgres allows 100 connections by default: a queued job (its store and its lease's
    renewals) must not hold any while it sleeps, or fifty waiting jobs refuse every other
    client ("sorry, too many clients already"). The lease is still renewed, on a connection
    opened per beat."""
    import psycopg

    from sftctl.state import LeaseKeeper

    def connections() -> int:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            return admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                 " AND pid <> pg_backend_pid()").fetchone()[0]

    store = Store()
    job = store.create_job("waits", {})
    keeper = LeaseKeeper(store, job, ttl_s=3.0)  # renewed every 0.5 s
    assert keeper.acquire()
    try:
        assert connections() >= 1
        store.rest()
        wait_for(lambda: connections() == 0, timeout_s=deadline(30), interval_s=0.05,
                 what="the store and the keeper to hold no connection between beats")
        time.sleep(2.0)  # four beats: each connected, renewed and let go
        holder, left_s = store.lease(job)  # the store connects again by itself
        assert holder == keeper.holder and left_s > 1.5, left_s
        assert store.get_job(job).status == JobStatus.PENDING
    finally:
        keeper.release()
    assert store.lease(job) is None
    store.close()


def test_a_lease_keeper_whose_first_connection_fails_still_renews(state_backend, monkeypatch):
    """The keeper's thread opens its own connection; Postgres unreachable at that moment (a
    StateUnavailable from Store()) must not end the renewals: the next beat connects and renews,
    so the lease outlives its first ttl."""
    from sftctl.errors import StateUnavailable
    from sftctl.state import LeaseKeeper, store as store_module

    store = Store()
    job = store.create_job("renews", {})
    opened = []
    real = store_module.Store

    def flaky(*a, **kw):
        opened.append(len(opened))
        if len(opened) == 1:
            raise StateUnavailable("postgresql://x: cannot connect to the state database: refused")
        return real(*a, **kw)

    monkeypatch.setattr(store_module, "Store", flaky)
    keeper = LeaseKeeper(store, job, ttl_s=1.2)  # a beat every 0.2 s
    assert keeper.acquire()
    try:
        wait_for(lambda: len(opened) >= 2, timeout_s=deadline(30), interval_s=0.05,
                 what="the keeper to connect again after its first connection failed")
        first_expiry = time.monotonic() + 1.2
        wait_for(lambda: time.monotonic() > first_expiry + 0.5, timeout_s=deadline(30), interval_s=0.05,
                 what="the first ttl to pass")
        holder, left_s = store.lease(job)
        assert holder == keeper.holder and left_s > 0, (holder, left_s)  # renewed after the failed open
    finally:
        keeper.release()
    assert store.lease(job) is None
    store.close()


# ---------------------------------------------------------------- Postgres unreachable


def test_postgres_down_for_seconds_mid_write_loses_nothing(postgres, pg_url):
    """A controller's Store (retry window 60 s) keeps writing while pg_ctl stops the server for a
    few seconds: events and metrics are held back and the job goes on, a transition waits for
    the database; once it is back everything is written, in order, with its own times."""
    import threading

    store = Store()
    store.retry_window_s = 60.0
    outages = []
    store.on_unreachable = outages.append
    job = store.create_job("outage", {})
    store.transition(job, JobStatus.PROVISIONING)
    written = []

    def write(i):
        store.add_event(job, "test", f"event {i}")
        store.record_metrics(job, [{"rank": 0, "step": i, "loss": 1.0 / (i + 1), "ts": time.time()}])
        written.append(time.time())

    for i in range(20):
        write(i)
    postgres.stop()  # every connection cut, as an outage does
    down_at = time.time()
    for i in range(20, 40):  # the job goes on: nothing blocks
        write(i)
    assert store.held >= 2 and time.time() - down_at < 10
    restarter = threading.Timer(3.0, postgres.start)
    restarter.start()
    try:
        assert store.transition(job, JobStatus.LAUNCHING)  # waits for the database, then goes through
    finally:
        restarter.join()
    assert outages and store.held == 0
    for i in range(40, 45):
        write(i)
    other = Store()  # a fresh connection sees all of it
    events = [e for e in other.events(job) if e.kind == "test"]
    assert [e.message for e in events] == [f"event {i}" for i in range(45)]
    assert [e.ts for e in events] == sorted(e.ts for e in events)
    assert all(down_at <= e.ts <= down_at + 10 for e in events[20:40])  # when they happened, not when written
    assert other.get_job(job).status == "LAUNCHING" and other.metrics(job)[0].step == 44
    statuses = [e.message for e in other.events(job) if e.kind == "status"]
    assert statuses[-1] == "PROVISIONING -> LAUNCHING"
    assert other.events(job).index(next(e for e in other.events(job) if e.message == statuses[-1])) > \
        other.events(job).index(events[39])  # the held events went first


def test_a_transition_retried_after_its_commit_went_through_is_not_an_error(pg_url):
    """The connection drops after a COMMIT was sent: the retry finds the job already moved. It
    must not be an IllegalTransition (that would fail a healthy job)."""
    import psycopg

    store = Store()
    store.retry_window_s = 30.0
    job = store.create_job("ambiguous", {})
    assert store.transition(job, JobStatus.PROVISIONING)
    pid = store._conn.raw.info.backend_pid
    with psycopg.connect(pg_url, autocommit=True) as admin:  # the answer to that COMMIT is lost
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert store.transition(job, JobStatus.PROVISIONING)  # reconnects, finds it done
    assert [e.message for e in store.events(job)] == ["job submitted (PENDING)", "PENDING -> PROVISIONING"]
    with pytest.raises(IllegalTransition):  # outside a retry the lifecycle is as strict as ever
        store.transition(job, JobStatus.PROVISIONING)


def test_without_a_retry_window_an_outage_is_one_clear_error(postgres, pg_url):
    store = Store()
    job = store.create_job("cli", {})
    postgres.stop()
    try:
        with pytest.raises(SftctlError, match="the state database is unreachable") as e:
            store.get_job(job)
        assert "Traceback" not in e.value.message
    finally:
        postgres.start()
    assert Store().get_job(job).name == "cli"


HOLDER = r"""
import sys, time
from sftctl.queue import claim_job
from sftctl.state import Store
claim = claim_job(Store(), sys.argv[1])
print("claimed", getattr(claim.lease, "holder", None), flush=True)
time.sleep(600)
"""


def test_two_servers_sharing_postgres_never_both_run_a_job(pg_url, tmp_path):
    """A controller claims a job with the state in Postgres (its own SFTCTL_HOME, as a server
    on another machine has): a second controller elsewhere refuses the job (exit 2, by the
    lease), leaving it untouched; once the first is gone its lease expires and a new one may
    take the job."""
    from sftctl.queue import ControllerBusy, claim_job

    job = Store().create_job("shared", {"run": "true"})
    env_a = {**os.environ, "SFTCTL_HOME": str(tmp_path / "server-a"), "SFTCTL_STATE_LEASE_S": "4"}
    first = subprocess.Popen([sys.executable, "-c", HOLDER, job], env=env_a, stdout=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line.startswith("claimed "), line
        env_b = {**os.environ, "SFTCTL_HOME": str(tmp_path / "server-b")}
        started = time.monotonic()
        while time.monotonic() - started < 6:  # longer than the lease: renewed by its heartbeat
            second = subprocess.run([sys.executable, "-m", "sftctl.controller", job], env=env_b,
                                    capture_output=True, text=True, timeout=deadline(120))
            assert second.returncode == 2, second.stderr
            assert "already has a live controller" in second.stderr and "by its lease" in second.stderr
        from sftctl import api
        from sftctl.queue import check_no_live_controller

        with pytest.raises(ControllerBusy, match="by its lease"):  # what a server asks before it starts one
            check_no_live_controller(job)
        with pytest.raises(ControllerBusy, match="by its lease"):
            api.start(job)
        got = Store().get_job(job)
        assert got.status == "PENDING" and got.controller_pid == first.pid  # nobody wrote over it
        assert Store().lease(job)[0] == line.split()[1]
    finally:
        first.kill()
        first.wait()
    wait_for(lambda: Store().lease(job) is None, timeout_s=deadline(30), what="the dead controller's lease to expire")
    claim = claim_job(Store(), job)
    try:
        assert Store().lease(job)[0] == claim.lease.holder
        with pytest.raises(ControllerBusy):  # this process's own file lock, as before
            claim_job(Store(), job)
    finally:
        claim.release()
    assert Store().lease(job) is None


def test_the_lease_of_a_controller_killed_here_is_taken_over_at_once(pg_url):
    """A controller killed -9 leaves its lease unexpired (90 s): a new controller on the same
    host sees that holder's process is gone and takes the job over at once; one whose holder
    is alive, or of another host, still waits."""
    from sftctl.queue import ControllerBusy, claim_job

    store = Store()
    job = store.create_job("adopted", {"run": "true"})
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, job], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("claimed ")
        with pytest.raises(ControllerBusy):
            claim_job(Store(), job)  # alive: refused
    finally:
        holder.kill()
        holder.wait()
    dead = store.lease(job)
    assert dead is not None and dead[1] > 60  # not expired
    from sftctl.queue import check_no_live_controller

    check_no_live_controller(job)  # what a server's reconcile asks: nobody acts on it
    claim = claim_job(Store(), job)
    try:
        assert store.lease(job)[0] == claim.lease.holder != dead[0]
    finally:
        claim.release()
    assert store.acquire_lease(job, "elsewhere:1:1", 90.0)  # another host's pid 1: never judged from here
    with pytest.raises(ControllerBusy):
        claim_job(Store(), job)


def test_a_controller_that_lost_its_lease_stops_at_once(pg_url):
    """A controller frozen longer than its lease (a laptop asleep) finds, when it runs again,
    that another took the job: it exits 3 without touching it."""
    import signal

    job = Store().create_job("frozen", {"run": "true"})
    env = {**os.environ, "SFTCTL_STATE_LEASE_S": "2"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, job], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("claimed ")
        holder.send_signal(signal.SIGSTOP)
        store = Store()
        wait_for(lambda: store.acquire_lease(job, "server-b", 60.0), timeout_s=deadline(30), what="the lease")
        holder.send_signal(signal.SIGCONT)
        _, err = holder.communicate(timeout=deadline(30))
        assert holder.returncode == 3, err
        assert "lost its lease" in err and "stops without touching the job" in err
        assert store.lease(job)[0] == "server-b" and store.get_job(job).status == "PENDING"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_job_on_postgres_rides_out_an_outage_and_succeeds(postgres, pg_url, tmp_path):
    """The whole path on Postgres: a detached local job's controller claims it (file lock +
    lease), Postgres is stopped for 5 s while the job runs, and the job still SUCCEEDS with
    every status change recorded; its lease is given back at the end."""
    from sftctl import api

    spec = tmp_path / "ticker.yaml"
    spec.write_text("name: ticker\nresources: {nodes: 1}\nrun: |\n  for i in $(seq 12); do echo tick $i; sleep 1; done\n")
    job = api.run(str(spec), detach=True).id
    wait_for(lambda: Store().get_job(job).status == "RUNNING", timeout_s=deadline(120), what="RUNNING")
    assert Store().lease(job) is not None
    log = tmp_path / "home" / "jobs" / job / "controller.log"
    postgres.stop()
    try:  # down 5 s at least, and until the controller ran into it (a busy machine's may take longer)
        time.sleep(5)
        wait_for(lambda: log.exists() and "the state database is unreachable" in log.read_text(),
                 timeout_s=60, what="the controller to notice the outage")
    finally:
        postgres.start()
    view = api.wait(job, timeout_s=deadline(180))
    assert view.status == "SUCCEEDED", view.failure_reason
    messages = [e.message for e in api.events(job) if e.kind == "status"]
    assert [m.split(" -> ")[-1].split(":")[0] for m in messages[1:]] == ["PROVISIONING", "LAUNCHING", "RUNNING", "SUCCEEDED"]
    assert "the state database is unreachable" in log.read_text()  # it noticed, and waited
    wait_for(lambda: Store().lease(job) is None, timeout_s=deadline(30), what="the lease given back")
    assert view.cost.node_hours > 0 and view.cost.price_per_hour is not None
