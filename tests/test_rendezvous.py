"""The end of a successful multi-node run is clean: node 0's wrapper hosts torchrun's c10d store
(sftctl/train/rendezvous.py, templates/node.sh.j2), so the other nodes' agents no longer print a
rendezvous-shutdown stack trace when node 0's torchrun has gone first (pytorch#69197)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import REPO, deadline, job_processes, sftctl, write_spec

pytest.importorskip("torch")

#: what node 1 printed at the end of every successful 2-node run before the store was the wrapper's
SHUTDOWN_NOISE = ("Traceback", "Exception raised from", "recvVector failed", "failed to shutdown the rendezvous",
                  "RendezvousConnectionError")

DDP = """\
import torch, torch.distributed as dist
from sftctl import train as sft
dist.init_process_group("gloo")
x = torch.ones(4)
dist.all_reduce(x)
print(f"global rank {dist.get_rank()} of {dist.get_world_size()} sum {float(x.sum()):.0f}", flush=True)
for step in (1, 2):
    sft.report(step, 1.0 / step)
sft.finish()
"""

#: node 1's agent, made slow: it holds a connection to the store from before node 0's torchrun
#: ends until after it has (node 0's run touches done-0 once its torchrun exited), then does what
#: a slower torchrun agent's rendezvous shutdown does (compareSet). Node 0's torchrun hosting the
#: store, that compareSet failed every time: this is the race of pytorch#69197 made certain.
LATE_AGENT = """\
import os, time
from datetime import timedelta
import torch.distributed as dist
host, port = os.environ["SFTCTL_RDZV_ENDPOINT"].rsplit(":", 1)
store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
while not os.path.exists("done-0"):
    time.sleep(0.2)
store.compare_set("late-agent", "", "closed")
print("node 1's late agent closed the rendezvous after node 0's torchrun left", flush=True)
"""

EXPLICIT = ('torchrun --nnodes="$SFTCTL_NUM_NODES" --nproc-per-node="$SFTCTL_NPROC_PER_NODE" '
            '--rdzv-backend=c10d --rdzv-endpoint="$SFTCTL_RDZV_ENDPOINT" --rdzv-id="$SFTCTL_JOB_ID" '
            '--rdzv-conf=is_host="$SFTCTL_RDZV_IS_HOST" ddp.py')


@pytest.mark.parametrize("torchrun", [EXPLICIT, "torchrun ddp.py"], ids=["explicit-flags", "pet-environment"])
def test_a_successful_two_node_torchrun_job_ends_without_a_traceback(tmp_path, home, torchrun):
    """Both ways a spec starts torchrun (the quickstart's flags, or the PET_* variables sftctl
    sets): the job SUCCEEDED, no node's log holds a stack trace, the store outlived node 0's
    torchrun for node 1's late agent, global rank 0 is on node 0, and nothing of the job (the
    store's process included) is left running."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "ddp.py").write_text(DDP)
    (work / "late_agent.py").write_text(LATE_AGENT)
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: rdzv
workdir: {work}
train: {{steps: 2}}
resources: {{accelerators: ["cpu:1"], nodes: 2}}
recovery: {{max_restarts: 0}}
env: {{OMP_NUM_THREADS: 1}}
run: |
  late=""
  if [ "$SFTCTL_NODE_RANK" = 1 ]; then "$SFTCTL_PYTHON" late_agent.py & late=$!; fi
  {torchrun}
  rc=$?
  touch "done-$SFTCTL_NODE_RANK"
  if [ -n "$late" ]; then wait "$late" || rc=1; fi
  exit $rc
""")
    proc = sftctl("run", str(spec), "--json")
    doc = json.loads(proc.stdout)
    logs = sftctl("logs", doc["id"], check=True).stdout
    assert (proc.returncode, doc["status"]) == (0, "SUCCEEDED"), logs[-4000:]
    noise = [ln for ln in logs.splitlines() if any(s in ln for s in SHUTDOWN_NOISE)]
    assert noise == [], logs[-4000:]
    assert "(node 1) node 1's late agent closed the rendezvous after node 0's torchrun left" in logs
    assert "(node 0) global rank 0 of 2 sum 8" in logs and "(node 1) global rank 1 of 2 sum 8" in logs, logs
    assert job_processes(doc["id"]) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host(port: int, master_port: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "SFTCTL_RDZV_ENDPOINT": f"127.0.0.1:{port}",
           "MASTER_PORT": str(master_port if master_port is not None else port - 1)}
    return subprocess.Popen([sys.executable, "-m", "sftctl.train.rendezvous"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


CLIENT = """\
import sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
store.set("joined", "1")
print("connected", flush=True)
sys.stdin.readline()  # hold the connection until told
"""


def test_the_store_lingers_after_node_0s_run_until_the_last_agent_left():
    """SIGUSR1 (node 0's run ended 0): the store stays while another node is connected and
    exits 0 once it is gone; it counts its peers from /proc/net/tcp, its own client left out."""
    from sftctl.train import rendezvous

    port = _free_port()
    host = _host(port)
    client = None
    try:
        assert host.stdout.readline().strip() == "ready", host.stderr.read()
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "connected"
        assert rendezvous.peers(port, host.pid) == 1  # the client; the store's own connection is not counted
        host.send_signal(signal.SIGUSR1)
        with pytest.raises(subprocess.TimeoutExpired):  # still serving the connected node
            host.wait(timeout=deadline(3))  # on a busy machine, as long as a quiet one's 3 s
        client.stdin.close()  # the last agent leaves
        client.wait(timeout=deadline(30))
        assert host.wait(timeout=deadline(30)) == 0
        assert host.stderr.read() == ""
    finally:
        for p in (client, host):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_sigterm_ends_the_store_and_its_port_is_free_again():
    port = _free_port()
    host = _host(port)
    try:
        assert host.stdout.readline().strip() == "ready", host.stderr.read()
        host.terminate()
        assert host.wait(timeout=deadline(30)) == 0
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    with socket.socket() as s:  # the next attempt's store can bind it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))


@pytest.mark.parametrize("endpoint, master_port, says", [
    ("127.0.0.1:{port}", "{port}", "is MASTER_PORT too"),
    ("127.0.0.1", "1", "names no port"),
])
def test_where_it_cannot_host_it_says_so_in_one_line_and_exits_1(endpoint, master_port, says):
    """Node 0's wrapper then leaves is_host=1 to node 0's torchrun (the Slurm step's endpoint is
    MASTER_PORT itself, which a plain script's rank 0 binds)."""
    port = _free_port()
    env = {**os.environ, "SFTCTL_RDZV_ENDPOINT": endpoint.format(port=port),
           "MASTER_PORT": master_port.format(port=port)}
    proc = subprocess.run([sys.executable, "-m", "sftctl.train.rendezvous"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=deadline(60))
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and says in proc.stderr and "torchrun on node 0 hosts it" in proc.stderr


def test_rendezvous_ports_are_claimed_in_pairs(tmp_path, monkeypatch):
    """MASTER_PORT and the store's port (the next one) come as one claim: claims start at even
    offsets and never overlap, and a pair whose second port is taken is skipped."""
    from sftctl.controller import ports
    from sftctl.controller.submit import store_port

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # a claims registry of this test's own
    lo, _ = ports._ephemeral_range()
    first = max(1024, lo - ports.RDZV_PORTS)
    a = ports.claim_rendezvous_port("job-a")
    b = ports.claim_rendezvous_port("job-a")  # the same start: the claim makes it move on
    assert (a - first) % 2 == 0 and (b - first) % 2 == 0 and abs(a - b) >= 2
    assert store_port(a) == a + 1 < lo and store_port("<rendezvous port>") == "<rendezvous port>+1"
    ports.release_rendezvous_port(a)
    with socket.socket() as busy:  # someone listens on the store's port of the pair job-a gets first
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("0.0.0.0", a + 1))
        busy.listen()
        c = ports.claim_rendezvous_port("job-a")
    assert c not in (a, b) and (c - first) % 2 == 0
    for p in (b, c):
        ports.release_rendezvous_port(p)
