"""Issue 40 item 2: secrets belong to a user (sftctl.vault).

- a real ``sftctl server`` with users alice, bob and an admin: bob's secret reaches bob's node
  (its hash seen in the log, never the value); alice's spec naming it is refused at submit in one
  line (exit 2), and with her own of that name her node gets hers, never bob's nor the server's
  environment's; a lab secret reaches both; ``rm`` works; no value in state, logs, events or the
  server's log; the CLI never takes a value from argv;
- the store on SQLite and Postgres: encrypted rows (the value never in clear), bound to owner and
  name, a foreign key refused in one line; the migration on both dialects;
- the controller's environment of a server's job: the owner's secrets only (a name the owner
  lacks reaches the node empty, so it refuses to run, even when the server's environment has it).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import stat

import pytest

from conftest import no_traceback, sftctl

BOB_VALUE = "bob-s3cret-Kq81x"
ALICE_VALUE = "alice-own-Zr55w"
LAB_VALUE = "lab-shared-Pj02m"
SERVER_VALUE = "the-servers-env-Yt77"  # in the server's environment: a job must never get it


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the store


def test_secrets_are_encrypted_per_owner_and_the_lab_on_both_dialects(state_backend, home):
    from sftctl import vault
    from sftctl.errors import NotFoundError, SftctlError
    from sftctl.state import Store

    store = Store()
    vault.set_secret(store, "alice", "HF_TOKEN", ALICE_VALUE)
    vault.set_secret(store, "bob", "HF_TOKEN", BOB_VALUE)
    vault.set_secret(store, "bob", "LAB_SHARED", "bob's own")
    lab = vault.set_secret(store, "root1", "LAB_SHARED", LAB_VALUE, lab=True)
    assert (lab.scope, lab.owner, lab.name) == ("lab", None, "LAB_SHARED")

    alice = vault.SecretEnviron(store, "alice")
    assert dict(alice) == {"HF_TOKEN": ALICE_VALUE, "LAB_SHARED": LAB_VALUE}
    bob = vault.SecretEnviron(store, "bob")
    assert dict(bob) == {"HF_TOKEN": BOB_VALUE, "LAB_SHARED": "bob's own"}  # a user's own wins over the lab's
    assert "HF_TOKEN" not in vault.SecretEnviron(store, "carol") and BOB_VALUE not in repr(bob)

    listed = [(s.name, s.scope, s.owner, s.shadowed) for s in vault.list_secrets(store, "bob")]
    assert listed == [("HF_TOKEN", "user", "bob", False), ("LAB_SHARED", "user", "bob", False),
                      ("LAB_SHARED", "lab", None, True)]
    assert [(s.name, s.scope) for s in vault.list_secrets(store, "alice")] == [("HF_TOKEN", "user"), ("LAB_SHARED", "lab")]

    # set again: replaced, created_at kept
    first = next(s for s in vault.list_secrets(store, "alice") if s.name == "HF_TOKEN")
    vault.set_secret(store, "alice", "HF_TOKEN", ALICE_VALUE + "-2")
    again = next(s for s in vault.list_secrets(store, "alice") if s.name == "HF_TOKEN")
    assert again.created_at == first.created_at and again.updated_at >= first.updated_at
    assert vault.SecretEnviron(store, "alice")["HF_TOKEN"] == ALICE_VALUE + "-2"

    # the rows hold ciphertext only
    rows = store.secret_rows(["alice", "bob", vault.LAB])
    assert len(rows) == 4 and all(r["ciphertext"].startswith("v1:") for r in rows)
    text = json.dumps(rows)
    for value in (ALICE_VALUE, BOB_VALUE, LAB_VALUE, "bob's own"):
        assert value not in text
    if state_backend == "sqlite":
        store.close()
        raw = b"".join(p.read_bytes() for p in home.glob("state.db*"))
        for value in (ALICE_VALUE, BOB_VALUE, LAB_VALUE):
            assert value.encode() not in raw
        store = Store()
    else:  # every row of every table of the database, as text
        tables = [r["table_name"] for r in store._conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'").fetchall()]
        assert "secrets" in tables
        dump = json.dumps([dict(r) for t in tables for r in store._conn.execute(f"SELECT * FROM {t}").fetchall()],
                          default=str)
        assert "HF_TOKEN" in dump and not [v for v in (ALICE_VALUE, BOB_VALUE, LAB_VALUE) if v in dump]

    # a row moved under another owner does not decrypt (owner and name are bound in)
    bobs = next(r for r in store.secret_rows(["bob"]) if r["name"] == "HF_TOKEN")
    store.put_secret("alice", "HF_TOKEN", bobs["ciphertext"])
    with pytest.raises(SftctlError, match=r"^secret HF_TOKEN \(alice's\) does not decrypt") as e:
        vault.SecretEnviron(store, "alice")["HF_TOKEN"]
    assert BOB_VALUE not in str(e.value) + str(e.value.hint)

    vault.remove_secret(store, "bob", "HF_TOKEN")
    vault.remove_secret(store, "root1", "LAB_SHARED", lab=True)
    assert dict(vault.SecretEnviron(store, "bob")) == {"LAB_SHARED": "bob's own"}
    with pytest.raises(NotFoundError, match="no secret HF_TOKEN in your secrets \\(bob\\)"):
        vault.remove_secret(store, "bob", "HF_TOKEN")
    store.close()


def test_the_key_file_is_made_0600_and_a_wrong_or_open_key_is_one_line(home, monkeypatch):
    from sftctl import vault
    from sftctl.errors import SftctlError
    from sftctl.settings import SettingError

    sealed = vault.encrypt("alice", "X", ALICE_VALUE)
    key = home / "secrets.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert vault.decrypt("alice", "X", sealed) == ALICE_VALUE

    monkeypatch.setenv("SFTCTL_SECRETS_KEY", vault.new_key())  # another server's key
    with pytest.raises(SftctlError, match=r"^secret X \(alice's\) does not decrypt with this machine's secrets key$") as e:
        vault.decrypt("alice", "X", sealed)
    assert "SFTCTL_SECRETS_KEY" in e.value.hint and ALICE_VALUE not in e.value.hint
    monkeypatch.setenv("SFTCTL_SECRETS_KEY", key.read_text().strip())  # the shared key: reads it
    assert vault.decrypt("alice", "X", sealed) == ALICE_VALUE

    monkeypatch.setenv("SFTCTL_SECRETS_KEY", "not-a-key-Qw9")
    with pytest.raises(SettingError) as e:
        vault.encrypt("alice", "X", "v")
    assert "not-a-key-Qw9" not in e.value.message and e.value.message.startswith("SFTCTL_SECRETS_KEY: not a key")
    monkeypatch.delenv("SFTCTL_SECRETS_KEY")

    key.chmod(0o644)
    with pytest.raises(SftctlError, match=r"secrets key is readable by others \(mode 644\)"):
        vault.decrypt("alice", "X", sealed)


def test_the_migration_adds_secrets_on_both_dialects(state_backend, home):
    """A state at the schema before this migration, with a job in it, migrates forward: the job
    reads back with no ``secrets_from``, and secrets can be stored."""
    from sftctl import settings, vault
    from sftctl.state import MIGRATIONS, SCHEMA_VERSION, SQLITE, Store, _postgres

    before = next(i for i, m in enumerate(MIGRATIONS) if "CREATE TABLE secrets" in m)
    if state_backend == "sqlite":
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        conn = sqlite3.connect(home / "state.db", isolation_level=None)
        execute, dialect = conn.execute, SQLITE
    else:
        import psycopg

        conn = psycopg.connect(settings.get("SFTCTL_STATE_URL"), autocommit=True)
        execute, dialect = (lambda q, p=(): conn.execute(q.replace("?", "%s"), p)), _postgres()
    for migration in MIGRATIONS[:before]:
        for statement in dialect.statements(migration):
            execute(statement)
    execute("UPDATE schema_version SET version = ?", (before,))
    if state_backend == "sqlite":
        execute(f"PRAGMA user_version = {before}")
    execute("INSERT INTO jobs (id, name, status, spec_json, created_at, updated_at, owner)"
            " VALUES ('old-1', 'old', 'PENDING', '{}', 1.0, 2.0, 'alice')")
    conn.close()

    store = Store()
    assert store.schema_version == SCHEMA_VERSION
    old = store.get_job("old-1")
    assert (old.owner, old.secrets_from) == ("alice", None)
    vault.set_secret(store, "alice", "HF_TOKEN", ALICE_VALUE)
    assert vault.job_environ(store, old)["HF_TOKEN"] == ALICE_VALUE  # its own store first
    store.update_job("old-1", secrets_from="store")
    assert store.get_job("old-1").secrets_from == "store"
    store.close()


# --------------------------------------------------------------------------- the controller's side


def test_a_servers_job_gets_its_owners_secrets_never_the_servers_environment(home, monkeypatch, tmp_path):
    """``node_env`` of a job submitted through a server: the owner's value, or empty when the
    owner has none (the node then refuses to run), even when the server's (this process's)
    environment holds a variable of that name; a local job keeps its shell's value."""
    from sftctl import vault
    from sftctl.controller.submit import node_env
    from sftctl.controller.slots import NodeSlot
    from sftctl.spec import load_spec
    from sftctl.state import Store
    from sftctl.types import NodeHandle

    monkeypatch.setenv("LAB_SECRET_BOB", SERVER_VALUE)
    monkeypatch.setenv("OTHER_TOKEN", SERVER_VALUE)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text('name: s\nsecrets: [LAB_SECRET_BOB]\nenv: {REF: "${OTHER_TOKEN:-none}"}\nrun: "true"\n')
    spec = load_spec(spec_file)
    store = Store()
    vault.set_secret(store, "bob", "LAB_SECRET_BOB", BOB_VALUE)
    job = store.create_job("s", spec.model_dump(mode="json"), owner="alice")
    store.update_job(job, secrets_from="store")
    from sftctl import api

    plan = api.plan(spec)
    nodes = [NodeSlot("n0", 0, NodeHandle(job_id=job, node_id="n0", rank=0, ip="127.0.0.1"))]

    def env_of(owner: str, source: str | None) -> dict:
        store.update_job(job, owner=owner, secrets_from=source)
        environ = vault.job_environ(store, store.get_job(job))
        return node_env(spec, job, plan, nodes, 0, 1, 29500, environ=environ)

    alice = env_of("alice", "store")
    assert (alice["LAB_SECRET_BOB"], alice["REF"]) == ("", "none")  # neither bob's nor the server's
    bob = env_of("bob", "store")
    assert (bob["LAB_SECRET_BOB"], bob["REF"]) == (BOB_VALUE, "none")
    local = env_of("alice", None)  # this machine's job: the shell's values, as before
    assert (local["LAB_SECRET_BOB"], local["REF"]) == (SERVER_VALUE, SERVER_VALUE)
    store.close()


def test_a_kubernetes_placed_controller_of_a_servers_job_gets_the_owners_values(home, monkeypatch, tmp_path):
    """controller.place: kubernetes: the controller's Secret carries the owner's values of the
    spec's secrets and env: references (the pod resolves from it), never the server's environment."""
    from sftctl import vault
    from sftctl.controller.placements.kubernetes import controller_pod_env
    from sftctl.spec import load_spec
    from sftctl.state import Store

    monkeypatch.setenv("HF_TOKEN", SERVER_VALUE)
    monkeypatch.setenv("WANDB_API_KEY", SERVER_VALUE)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text('name: s\nsecrets: [HF_TOKEN]\nenv: {W: "${WANDB_API_KEY}"}\nrun: "true"\n')
    spec = load_spec(spec_file)
    store = Store()
    vault.set_secret(store, "alice", "HF_TOKEN", ALICE_VALUE)
    vault.set_secret(store, "alice", "WANDB_API_KEY", ALICE_VALUE + "-w")
    _, secret_env = controller_pod_env(spec, "sftctl-ctl-x", "ns", vault.SecretEnviron(store, "alice"))
    assert {k: v for k, v in secret_env.items() if k != "SFTCTL_STATE_URL"} == {
        "HF_TOKEN": ALICE_VALUE, "WANDB_API_KEY": ALICE_VALUE + "-w"}
    _, bobs = controller_pod_env(spec, "sftctl-ctl-x", "ns", vault.SecretEnviron(store, "bob"))
    assert set(bobs) == {"SFTCTL_STATE_URL"}  # bob has none: nothing of the server's
    store.close()


# --------------------------------------------------------------------------- a real server


SPEC = """name: {name}
secrets: [{names}]
resources: {{nodes: 1}}
run: |
{lines}
"""


def _spec(tmp_path, name: str, *names: str, extra: str = ""):
    lines = "\n".join(f'  echo "sha {n}=$(printf %s "${n}" | sha256sum | cut -c1-16)"' for n in names) + extra
    (tmp_path / "work").mkdir(exist_ok=True)  # a workdir apart from the server's home
    path = tmp_path / "work" / f"{name}.yaml"
    path.write_text(SPEC.format(name=name, names=", ".join(names), lines=lines))
    return path


def _shas(job: str) -> dict[str, str]:
    from sftctl import api

    out = {}
    for line in api.logs(job):
        if line.text.startswith("sha "):
            k, _, v = line.text[4:].partition("=")
            out[k] = v
    return out


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and no_traceback(proc), proc.stderr
    return lines[0]


def test_secrets_belong_to_their_user_through_a_server(home, tmp_path, monkeypatch):
    from test_server import Server, as_user, tokens

    server = Server(home, tmp_path / "server.log",
                    env={"LAB_SECRET_BOB": SERVER_VALUE, "SERVER_ONLY_TOKEN": SERVER_VALUE}).start()
    try:
        from sftctl import api

        t = tokens("alice", "bob", admin="root1")
        monkeypatch.setenv("LAB_SECRET_BOB", "the-clients-env")  # never sent: names travel, not values

        # bob stores his secret, the value on stdin; argv never carries one
        as_user(monkeypatch, server, t["bob"])
        proc = sftctl("secret", "set", "LAB_SECRET_BOB", input=BOB_VALUE + "\n")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("secret LAB_SECRET_BOB set (yours)") and BOB_VALUE not in proc.stdout
        for argv in (("LAB_SECRET_BOB", "argv-value-Hh3"), ("LAB_SECRET_BOB=argv-value-Hh3",)):
            proc = sftctl("secret", "set", *argv, input="")
            assert proc.returncode == 2 and "argv-value-Hh3" not in proc.stdout + proc.stderr
            assert "never taken from the command line" in _one_error_line(proc)

        bobs = _spec(tmp_path, "bobs", "LAB_SECRET_BOB")
        # a dry run checks the names against his secrets on the server, not this shell's variables
        monkeypatch.delenv("LAB_SECRET_BOB")
        proc = sftctl("run", str(bobs), "--dry-run", "--json")
        assert proc.returncode == 0, proc.stderr
        assert BOB_VALUE not in proc.stdout and SERVER_VALUE not in proc.stdout
        monkeypatch.setenv("LAB_SECRET_BOB", "the-clients-env")
        proc = sftctl("run", str(bobs), "--json")
        assert proc.returncode == 0, proc.stderr
        bob_job = json.loads(proc.stdout)["id"]
        assert _shas(bob_job) == {"LAB_SECRET_BOB": _sha(BOB_VALUE)}  # his value, not the server's env

        # alice names bob's secret: refused at submit, one line naming it and the fix
        as_user(monkeypatch, server, t["alice"])
        proc = sftctl("run", str(bobs), "--detach")
        assert proc.returncode == 2
        line = _one_error_line(proc)
        assert line == (f"error: {bobs}: secrets: LAB_SECRET_BOB is not one of alice's secrets on this server "
                        "(nor the lab's)"), line
        assert "hint: sftctl secret set LAB_SECRET_BOB" in proc.stderr
        proc = sftctl("run", str(bobs), "--dry-run")  # her shell has the variable: not hers on the server
        assert proc.returncode == 2
        assert _one_error_line(proc) == (f"error: {bobs}: secrets: LAB_SECRET_BOB is not one of your secrets on "
                                         "the server (nor the lab's)")
        ref = tmp_path / "work" / "ref.yaml"
        ref.write_text('name: ref\nenv: {X: "${LAB_SECRET_BOB}"}\nresources: {nodes: 1}\nrun: "true"\n')
        proc = sftctl("run", str(ref), "--detach")
        assert proc.returncode == 2 and "${LAB_SECRET_BOB} is not set in the secrets of alice" in _one_error_line(proc)
        assert [v.id for v in api.status()] == []  # nothing was recorded for her

        # a lab secret: admins only
        proc = sftctl("secret", "set", "LAB_SHARED", "--lab", input=LAB_VALUE)
        assert proc.returncode == 2 and "alice is not an admin" in _one_error_line(proc)
        as_user(monkeypatch, server, t["root1"])
        proc = sftctl("secret", "set", "LAB_SHARED", "--lab", input=LAB_VALUE)
        assert proc.returncode == 0 and "the lab's" in proc.stdout, proc.stderr

        # alice's own of the same name: her node gets hers, never bob's nor the server's
        as_user(monkeypatch, server, t["alice"])
        assert sftctl("secret", "set", "LAB_SECRET_BOB", input=ALICE_VALUE).returncode == 0
        alices = _spec(tmp_path, "alices", "LAB_SECRET_BOB", "LAB_SHARED",
                       extra='\n  echo "inherited=${SERVER_ONLY_TOKEN:-unset}"')  # named nowhere: never inherited
        proc = sftctl("run", str(alices), "--json")
        assert proc.returncode == 0, proc.stderr
        alice_job = json.loads(proc.stdout)["id"]
        assert _shas(alice_job) == {"LAB_SECRET_BOB": _sha(ALICE_VALUE), "LAB_SHARED": _sha(LAB_VALUE)}
        inherited = [x.text for x in api.logs(alice_job) if x.text.startswith("inherited=")]

        # list: names, scopes, dates; never a value
        proc = sftctl("secret", "list", "--json")
        assert proc.returncode == 0
        doc = json.loads(proc.stdout)
        assert [(s["name"], s["scope"], s["owner"]) for s in doc["secrets"]] == [
            ("LAB_SECRET_BOB", "user", "alice"), ("LAB_SHARED", "lab", None)]
        as_user(monkeypatch, server, t["bob"])
        table = sftctl("secret", "list")
        assert table.returncode == 0 and "LAB_SHARED" in table.stdout and "LAB_SECRET_BOB" in table.stdout
        assert [s.name for s in api.secret_list() if s.scope == "lab"] == ["LAB_SHARED"]

        # rm: gone from the list, and a job naming it is refused again
        assert sftctl("secret", "rm", "LAB_SECRET_BOB").returncode == 0
        assert [s.name for s in api.secret_list()] == ["LAB_SHARED"]
        proc = sftctl("secret", "rm", "LAB_SECRET_BOB")
        assert proc.returncode == 2 and "no secret LAB_SECRET_BOB in your secrets (bob)" in _one_error_line(proc)
        proc = sftctl("run", str(bobs), "--detach")
        assert proc.returncode == 2 and "not one of bob's secrets" in _one_error_line(proc)

        # no value in clear: state, the jobs' files (logs, controller.log), events, the server's log
        server.stop()
        values = (BOB_VALUE, ALICE_VALUE, LAB_VALUE)
        files = [p for p in home.rglob("*") if p.is_file()] + [server.log]
        assert any(p.name == "state.db" for p in files)
        for p in files:
            data = p.read_bytes()
            assert not [v for v in values if v.encode() in data], p
        events = json.dumps([e.to_dict() for j in (bob_job, alice_job) for e in _events(j)])
        assert not [v for v in values if v in events]
        # a variable of the server's environment that no spec names never reaches a user's node
        # (a server's local nodes run sandboxed, their environment the job's: issue 40 item 1)
        assert inherited == ["inherited=unset"]
    finally:
        server.stop()


def _events(job: str):
    from sftctl.state import Store

    store = Store()
    try:
        return store.events(job)
    finally:
        store.close()
