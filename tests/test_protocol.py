"""The controller <-> node protocol (sftctl.protocol): each message round-trips, the documented
names are the ones used, and the ordering rules hold with the real node daemon and shipper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sftctl import protocol
from sftctl.protocol import NodeDir
from sftctl.storage.stream import NodeChannel
from sftctl.storage import LocalStorage, StorageError, open_storage
from sftctl.storage.stream import Shipper

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path):
    s = open_storage(tmp_path / "store")
    s.ensure(create_bucket=True)
    return s


def test_every_file_is_in_the_specification():
    """The module docstring is the specification: every per-attempt name it hands out is there."""
    doc = protocol.__doc__
    for name in (protocol.script_name, protocol.env_name, protocol.exit_name, protocol.host_name,
                 protocol.restarts_name, protocol.error_name, protocol.launch_name, protocol.ack_name,
                 protocol.stop_name):
        assert name("<a>") in doc, name.__name__
    for const in (protocol.NODE_LOG, protocol.AGENT_LOG, protocol.HEALTH_LOG, protocol.SETUP_DONE,
                  f"{protocol.METRICS_DIR}/{protocol.metrics_name('<N>')}"):
        assert const in doc, const


def test_names_parse_back():
    for attempt in (1, 7, 12345):
        assert protocol.parse_exit_name(protocol.exit_name(attempt)) == attempt
        assert protocol.parse_launch_name(protocol.launch_name(attempt)) == attempt
    for other in ("exit-3.tmp", "exit-", "exit-x", "xexit-3", "node.log", "launch-3", "ack-3"):
        assert protocol.parse_exit_name(other) is None, other
    assert protocol.parse_launch_name("launch-3.json.tmp") is None
    for code in (0, 1, 137, 255):
        assert protocol.parse_exit_code(protocol.format_exit_code(code)) == code
        assert protocol.parse_exit_code(protocol.format_exit_code(code).encode()) == code
    assert protocol.format_exit_code(3) == "3\n"
    for bad in (None, b"", b"\n", b"3 4", b"three", "1.5"):
        assert protocol.parse_exit_code(bad) is None, bad
    assert protocol.parse_exit_code(b"  42 \n") == 42


def test_node_dir_keeps_the_root_type(tmp_path):
    remote = NodeDir("/cluster/jobs/j/nodes/n1/")
    assert remote.exit(3) == "/cluster/jobs/j/nodes/n1/exit-3"
    assert remote.host("$attempt") == "/cluster/jobs/j/nodes/n1/host-$attempt"
    assert remote.metrics_glob == "/cluster/jobs/j/nodes/n1/metrics/rank-*.jsonl"
    local = NodeDir(tmp_path)
    assert local.log == tmp_path / "node.log" and local.script(2) == tmp_path / "node-2.sh"


def test_exit_files_are_whole_and_listed_by_attempt(tmp_path):
    files = NodeDir(tmp_path)
    assert files.exits() == [] and protocol.read_exit_file(files.exit(1)) is None
    protocol.write_exit_file(files.exit(2), 137)
    protocol.write_exit_file(files.exit(10), 0)
    (tmp_path / "exit-3.tmp").write_text("1\n")  # being written
    (tmp_path / "exit-4").write_text("")  # created, not yet written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit-10", "exit-2", "exit-3.tmp", "exit-4"]
    assert files.exits() == [(2, 137), (10, 0)]
    assert files.exits(skip={2}) == [(10, 0)]
    assert protocol.read_exit_file(files.exit(2)) == 137
    assert NodeDir(tmp_path / "missing").exits() == []


def test_each_message_round_trips_through_storage(store):
    ch = NodeChannel(store, secret_keys={"DB_URL"})
    env = {"OMP_NUM_THREADS": "1", "HF_TOKEN": "hf-0123456789", "DB_URL": "postgres://u:p@h/db"}
    # launch: the documented key and JSON document, secrets by name only
    key = ch.send_launch("n1", 1, "echo one", env)
    assert key == "nodes/n1/launch-1.json" == ch.launch_key("n1", 1)
    doc = json.loads(store.get_bytes(key))
    assert set(doc) == {"attempt", "script", "env", "secret_env", "created_at"}
    assert (doc["attempt"], doc["script"], doc["env"], doc["secret_env"]) == (
        1, "echo one", {"OMP_NUM_THREADS": "1"}, ["DB_URL", "HF_TOKEN"])
    assert ch.poll_launch("n1", 0, environ={"HF_TOKEN": "on-node"}) == (
        1, "echo one", {"OMP_NUM_THREADS": "1", "HF_TOKEN": "on-node"})
    assert ch.poll_launch("n1", 1) is None and ch.poll_launch("n2", 0) is None
    with pytest.raises(StorageError, match="secret HF_TOKEN"):
        ch.send_launch("n1", 2, "echo hf-0123456789", env)
    with pytest.raises(ValueError):
        ch.send_launch("n1", -1, "x", {})
    # ack: "<pid>\n"
    assert not ch.acked("n1", 1)
    ch.ack("n1", 1, 4242)
    assert ch.acked("n1", 1) and store.get_bytes("nodes/n1/ack-1") == b"4242\n"
    assert not ch.acked("n1", 2)
    # stop: empty, and for that attempt only
    ch.request_stop("n1", 1)
    assert store.get_bytes("nodes/n1/stop-1") == b""
    assert ch.stop_requested("n1", 1) and not ch.stop_requested("n1", 2)
    # exit: "<code>\n"; garbage is no exit code
    assert ch.exit_code("n1", 1) is None
    ch.write_exit("n1", 1, 143)
    assert store.get_bytes("nodes/n1/exit-1") == b"143\n" and ch.exit_code("n1", 1) == 143
    store.put_bytes(ch.exit_key("n1", 2), b"garbage")
    assert ch.exit_code("n1", 2) is None
    # the key helpers name the documented layout, and node ids cannot escape it
    assert (ch.ack_key("a", 3), ch.stop_key("a", 3), ch.exit_key("a", 3), ch.stream_key("a", "metrics/rank-0.jsonl")) == (
        "nodes/a/ack-3", "nodes/a/stop-3", "nodes/a/exit-3", "nodes/a/metrics/rank-0.jsonl")
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(ValueError):
            protocol.node_prefix(bad)
    assert ch.delete_node("n1") >= 4 and store.list("nodes/n1/") == []


def test_newest_launch_supersedes(store):
    """Rule 4: the daemon takes the newest launch above its attempt; ones it never saw are skipped."""
    ch = NodeChannel(store)
    for attempt in (1, 2, 3, 10):  # 10 sorts before 2 as text: the order must be numeric
        ch.send_launch("n1", attempt, f"run {attempt}", {})
    assert ch.poll_launch("n1", 0)[:2] == (10, "run 10")
    assert ch.poll_launch("n1", 3)[0] == 10 and ch.poll_launch("n1", 10) is None


class _RecordingStorage(LocalStorage):
    """A directory storage that records the order of its writes."""

    def __init__(self, root):
        super().__init__(root)
        self.writes: list[str] = []

    def put_bytes(self, key, data, **kw):
        self.writes.append(key)
        return super().put_bytes(key, data, **kw)


def test_exit_code_is_shipped_after_every_log_byte(tmp_path):
    """Rule 2: the exit object is written after every stream segment holding bytes written before
    the exit file, even when the log is larger than one tick reads."""
    from sftctl.storage import stream

    store = _RecordingStorage(tmp_path / "store")
    node = tmp_path / "node"
    (node / "metrics").mkdir(parents=True)
    log_bytes = os.urandom(3 * 1024) * 2
    (node / "node.log").write_bytes(log_bytes)
    (node / "metrics" / "rank-0.jsonl").write_text('{"step": 1}\n')
    (node / "health.jsonl").write_text('{"gpu": 0}\n')
    protocol.write_exit_file(NodeDir(node).exit(1), 7)
    shipper = Shipper(store, "n1", node, flush_bytes=1 << 30, flush_interval_s=1e9)  # only the exit flushes
    old = stream.TAIL_MAX_BYTES
    stream.TAIL_MAX_BYTES = 1024  # several reads per file in one tick
    try:
        shipper.ship_once()
    finally:
        stream.TAIL_MAX_BYTES = old
    ch = NodeChannel(store)
    assert ch.exit_code("n1", 1) == 7
    exit_at = store.writes.index("nodes/n1/exit-1")
    segments = [i for i, k in enumerate(store.writes) if k != "nodes/n1/exit-1"]
    assert segments and max(segments) < exit_at, store.writes
    assert ch.read_log("n1", 0) == (log_bytes, len(log_bytes))
    assert ch.read_metrics("n1", {}) == [{"step": 1}] and ch.read_health("n1", {}) == [{"gpu": 0}]
    shipper.ship_once()
    assert store.writes.count("nodes/n1/exit-1") == 1  # shipped once


def _daemon(store, tmp_path, monkeypatch):
    from sftctl.node import NodeDaemon

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return NodeDaemon(store, "n1", tmp_path / "daemon", poll_s=0.1)


def _wait_for_output(files, text: bytes, timeout_s: float = 30.0) -> None:
    """Wait until the node log holds ``text`` (the script ran its echo), so a stop cannot beat it."""
    deadline = time.monotonic() + timeout_s
    while not (files.log.exists() and text in files.log.read_bytes()):
        assert time.monotonic() < deadline, f"{text!r} never reached {files.log}"
        time.sleep(0.05)


def test_daemon_acks_stops_the_named_attempt_and_records_a_killed_exit(store, tmp_path, monkeypatch):
    """Rules 3-5 with the real node daemon: it acks with the script's pid, a stop of an older
    attempt leaves the running one alone, a stop of the running one kills its process group and
    the daemon writes the exit code the killed script could not (128 + SIGTERM)."""
    ch = NodeChannel(store)
    daemon = _daemon(store, tmp_path, monkeypatch)
    files = NodeDir(daemon.node_dir)
    try:
        ch.send_launch("n1", 1, "echo one; exec sleep 60", {})
        daemon.tick()
        assert daemon.attempt == 1 and ch.acked("n1", 1)
        pid = int(store.get_bytes(ch.ack_key("n1", 1)))
        assert pid == daemon.proc.pid and daemon.proc.poll() is None
        assert files.script(1).read_text() == "echo one; exec sleep 60"
        _wait_for_output(files, b"one\n")

        ch.send_launch("n1", 2, "echo two; exec sleep 60", {})
        daemon.tick()  # the newer attempt supersedes: attempt 1 is stopped and gets an exit code
        assert daemon.attempt == 2 and ch.acked("n1", 2)
        assert protocol.read_exit_file(files.exit(1)) == 143
        ch.request_stop("n1", 1)  # late stop of the old attempt
        daemon.tick()
        assert daemon.proc is not None and daemon.proc.poll() is None and not files.exit(2).exists()

        proc = daemon.proc
        _wait_for_output(files, b"two\n")
        ch.request_stop("n1", 2)
        daemon.tick()
        assert proc.poll() == -15 and daemon.proc is None
        assert protocol.read_exit_file(files.exit(2)) == 143
        daemon.shipper.ship_once(final=True)
        assert ch.exit_code("n1", 1) == 143 and ch.exit_code("n1", 2) == 143
        assert b"one\n" in ch.read_log("n1", 0)[0] and b"two\n" in ch.read_log("n1", 0)[0]
    finally:
        daemon._end_attempt()


def test_daemon_writes_the_code_of_a_script_that_wrote_none(store, tmp_path, monkeypatch):
    ch = NodeChannel(store)
    daemon = _daemon(store, tmp_path, monkeypatch)
    ch.send_launch("n1", 1, "while [ ! -e go ]; do sleep 0.05; done; exit 5", {})  # cwd: the node dir
    daemon.tick()
    proc = daemon.proc
    assert proc.poll() is None and not NodeDir(daemon.node_dir).exit(1).exists()
    (daemon.node_dir / "go").touch()
    proc.wait(30)
    daemon.tick()
    assert protocol.read_exit_file(NodeDir(daemon.node_dir).exit(1)) == 5
    daemon.shipper.ship_once(final=True)
    assert ch.exit_code("n1", 1) == 5


def test_daemon_fails_an_attempt_whose_workdir_bundle_never_appears(store, tmp_path, monkeypatch, capfd):
    """A node that could not find the workdir bundle said "(retrying)" once, then idled: its
    attempt counter had moved on, so it never fetched again, never acked and never exited, and a
    local job stayed RUNNING for ever. Now it retries for WORKDIR_WAIT_S, then ends the attempt
    with exit 97 and a failure record naming the bundle (the controller does not restart it)."""
    import sftctl.node
    from sftctl.types import FailureCode

    ch = NodeChannel(store)
    daemon = _daemon(store, tmp_path, monkeypatch)
    files = NodeDir(daemon.node_dir)
    key = "workdir/0123abcd.tar.gz"
    ch.send_launch("n1", 1, "echo ran", {"SFTCTL_WORKDIR_KEY": key})
    for _ in range(3):
        daemon.tick()
    assert not files.exit(1).exists() and daemon.proc is None  # waiting for the bundle
    said = [line for line in capfd.readouterr().err.splitlines() if line.endswith("(retrying)")]
    assert len(said) == 1 and key in said[0], said  # once while it waits, not once per poll
    monkeypatch.setattr(sftctl.node, "WORKDIR_WAIT_S", 0.0)
    daemon.tick()
    assert protocol.read_exit_file(files.exit(1)) == 97
    why = protocol.parse_failure(files.failure(1).read_bytes())
    assert why.code == FailureCode.WORKDIR_MISSING, why
    assert why.message.startswith(f"node n1: the workdir bundle {key} is not in the job's storage {store.url} "), why
    assert b"ran" not in (files.log.read_bytes() if files.log.exists() else b"")
    daemon.shipper.ship_once(final=True)
    assert ch.exit_code("n1", 1) == 97 and protocol.parse_failure(store.get_bytes("nodes/n1/failure-1.json")) == why


def test_node_script_writes_the_protocols_exit_file(tmp_path):
    """templates/node.sh.j2, rendered and run: the exit code lands in NodeDir.exit(attempt)."""
    from sftctl.templates import render

    node = tmp_path / "node"
    node.mkdir()
    script = render("node.sh.j2", job_id="j", node_id="n1", rank=0, attempt=4, workdir=str(tmp_path),
                    setup="", health=False, run="echo ran; exit 3")
    env = {**os.environ, "SFTCTL_NODE_DIR": str(node), "SFTCTL_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "ran" in proc.stdout, proc.stderr
    assert NodeDir(node).exits() == [(4, 3)]
    assert not (node / "exit-4.tmp").exists()


def test_slurm_scripts_name_the_protocols_files():
    """The Slurm step and batch scripts write and clear the files the provider reads."""
    from sftctl.templates import render

    step = render("slurm/step.sh.j2", job_id="j", attempt=2, root="/r", node_ids=["a"], python_dir="")
    for name in (protocol.host_name, protocol.restarts_name, protocol.env_name, protocol.script_name):
        assert f'"$node_dir/{name("$attempt")}"' in step, name.__name__
    assert f'>> "$node_dir/{protocol.NODE_LOG}"' in step
    batch = render("slurm/sbatch.sh.j2", job_id="j", attempt=2, root="/r", options=[], nodes=1, signal_s=60,
                   comment="c", requeue=True)
    assert f'rm -f "$d/{protocol.exit_name("$attempt")}"' in batch


def test_a_cloud_node_powers_off_when_its_controllers_heartbeat_stops(store, tmp_path, monkeypatch):
    """Issue 23 item 3 (cloud nodes): the real node daemon (``python -m sftctl.node``) keeps its
    attempt while the controller's keepalive (``CloudProvider.keepalive``) rewrites the heartbeat
    in job storage; once it stops (a controller killed -9), the daemon stops the attempt, ships its
    exit code and a line saying why, and runs the power-off command (here: touch a file)."""
    from conftest import deadline

    from sftctl.providers.cloud import CloudProvider

    monkeypatch.setenv("SFTCTL_CLOUD_CONTROLLER_GRACE_S", "3")
    controller = CloudProvider(channel=NodeChannel(store))
    controller.keepalive("j")  # the first beat, before the node boots
    off = tmp_path / "powered-off"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SFTCTL_STORAGE_URL": str(tmp_path / "store"),
           "SFTCTL_NODE_ID": "n1", "SFTCTL_NODE_DIR": str(tmp_path / "node"), "SFTCTL_NODE_POLL_S": "0.2",
           "SFTCTL_CONTROLLER_GRACE_S": "3", "SFTCTL_POWEROFF": f"touch {off}"}
    node = subprocess.Popen([sys.executable, "-m", "sftctl.node"], env=env, stderr=subprocess.PIPE, text=True)
    ch = NodeChannel(store)
    try:
        ch.send_launch("n1", 1, "echo started; exec sleep 600", {})
        end = time.monotonic() + deadline(30)
        while not ch.acked("n1", 1):
            assert time.monotonic() < end and node.poll() is None, "the daemon never took attempt 1"
            controller.keepalive("j")
            time.sleep(0.2)
        watched = time.monotonic() + 8  # well past the 3 s grace: a beating controller keeps the node
        while time.monotonic() < watched:
            controller.keepalive("j")
            time.sleep(0.2)
        assert node.poll() is None and not off.exists() and ch.exit_code("n1", 1) is None
        # the controller is killed: no more beats
        _, err = node.communicate(timeout=deadline(60))
    finally:
        if node.poll() is None:
            node.kill()
    assert node.returncode == 3 and off.exists(), err
    assert ch.exit_code("n1", 1) == 143  # the attempt was stopped (SIGTERM) and its exit shipped
    log = ch.read_log("n1", 0)[0].decode()
    assert "started" in log and "heartbeat has not changed" in log and "SFTCTL_CLOUD_CONTROLLER_GRACE_S=3" in log
