"""A real Slurm cluster on this machine for the tests: munged, slurmctld and one slurmd per node.

Debian's ``slurm-wlm`` (22.05 on bookworm) and ``munge`` packages; ``.ci/run`` installs them.
Everything lives in one temporary directory (configuration, munge key, state, logs, pid files)
but the unix sockets (munge's, and the spool where slurmstepd binds its own), which live in a
short directory of their own that ``stop`` removes (a socket path holds 108 bytes); every port
is chosen free on 127.0.0.1, so the cluster never touches the machine's own Slurm or munge. The nodes are ``node1..nodeN``, each its own ``slurmd -N nodeK``
with its own ``Port=`` (Slurm's "multiple slurmd" mode), all with ``NodeAddr=127.0.0.1``.

GPUs cannot exist here, so each node declares typed GPUs as a counted GRES without device
files (``gres.conf``: ``AutoDetect=off``, ``Name=gpu Type=h100 Count=2``): ``--gpus-per-node``
and ``--gres=gpu:h100:N`` are scheduled for real and ``sinfo`` reports the types.

    with SlurmCluster(tmp_path, nodes=2) as cluster:
        env = cluster.env()      # SLURM_CONF for the client commands (sinfo, sbatch, ...)

The cluster runs as root (``SlurmUser=root``); tests skip when the binaries are missing or
this process is not root (:func:`skip_reason`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "squeue", "scancel", "scontrol", "srun")
GPU_TYPE = "h100"
GPUS_PER_NODE = 2
CPUS_PER_NODE = 2
MEMORY_MB = 2000


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def skip_reason() -> str | None:
    """None when a cluster can start here, else why not (for ``pytest.skip``)."""
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                "apt-get install slurm-wlm munge (.ci/run does)")
    if os.geteuid() != 0:
        return "the test Slurm cluster runs slurmd, which needs root"
    return None


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class _Managed:
    """``with X(...) as x:`` starts it and always stops it, also when starting fails halfway."""

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class SlurmCluster(_Managed):
    """A throwaway Slurm cluster under ``root`` (a directory). See the module docstring.

    Args:
        root: directory for everything the cluster writes (created).
        nodes: slurmd daemons (``node1..nodeN``), one partition ``gpu`` holding them all.
        gpus_per_node: typed GPUs (``h100``) each node declares; 0 for none.
        gpu_type: their GRES type (``mi300``: a node of AMD GPUs, as a lab's gres.conf names them).
    """

    def __init__(self, root: Path, nodes: int = 2, gpus_per_node: int = GPUS_PER_NODE, gpu_type: str = GPU_TYPE):
        self.root = Path(root)
        self.n = nodes
        self.gpus = gpus_per_node
        self.gpu_type = gpu_type
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "etc" / "slurm.conf"
        # Unix sockets (munged's, and each slurmstepd's in the spool) must fit 108 bytes, which a
        # pytest tmp_path under xdist (.../popen-gw2/test_node_failure_without_slur0/slurm/spool/
        # node1/node1_5.4294967291: 110) does not: they live in a short directory of their own
        self.short = Path(tempfile.mkdtemp(prefix="sftctl-slurm-"))
        self.munge_socket = self.short / "munge.socket"
        self.hostname = socket.gethostname().split(".")[0]

    # ---------------------------------------------------------------- set up

    def write_config(self) -> None:
        for d in ("etc", "munge", "state", "log", "run", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        ctld_port, *node_ports = free_ports(1 + self.n)
        self.ctld_port = ctld_port
        self.node_ports = dict(zip(self.names, node_ports))
        gres = f" Gres=gpu:{self.gpu_type}:{self.gpus}" if self.gpus else ""
        node_lines = "\n".join(
            f"NodeName={name} NodeHostname={self.hostname} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB}{gres} State=UNKNOWN"
            for name, port in self.node_ports.items()
        )
        r = self.root
        self.conf.write_text(f"""\
# written by tests/slurm_cluster.py
ClusterName=sftctltest
SlurmctldHost={self.hostname}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={self.short}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
LaunchParameters=use_interactive_step
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
ReturnToService=2
SlurmdTimeout=6
SlurmctldTimeout=10
MessageTimeout=10
KillWait=3
MinJobAge=30
InactiveLimit=0
Waittime=0
{node_lines}
PartitionName=gpu Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")
        if self.gpus:
            # one character device per GPU (copies of /dev/null: Slurm wants a device per GPU
            # and hands it to the job in CUDA_VISIBLE_DEVICES order; nothing ever opens them)
            dev = self.root / "dev"
            dev.mkdir(exist_ok=True)
            for i in range(self.gpus):
                path = dev / f"gpu{i}"
                if not path.exists():
                    try:
                        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
                    except OSError:  # no mknod here: slurmd logs an error but counts the file
                        path.touch()
            files = f"{dev}/gpu[0-{self.gpus - 1}]" if self.gpus > 1 else f"{dev}/gpu0"
            (self.root / "etc" / "gres.conf").write_text(
                f"AutoDetect=off\nNodeName={','.join(self.names)} Name=gpu Type={self.gpu_type} File={files}\n")
        else:
            (self.root / "etc" / "gres.conf").write_text("AutoDetect=off\n")
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

    def env(self) -> dict[str, str]:
        """The environment variables a client (sinfo, sbatch, sftctl) needs for this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.out", "ab")
        # the marker reaches the slurmstepd processes a slurmd forks: kill_node finds them by it
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **self.env(), DAEMON_TAG: f"{self.root}:{name}"},
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        self.write_config()
        m = self.root / "munge"
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        _wait(lambda: self.munge_socket.exists(), 10, "munged's socket", self)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        _wait(lambda: self._run(["scontrol", "ping"]).stdout.find("UP") >= 0, timeout_s, "slurmctld to answer", self)
        for name in self.names:
            self.start_node(name)
        _wait(lambda: self.idle_nodes() == set(self.names), timeout_s, "every node to be idle", self)
        return self

    def start_node(self, name: str) -> None:
        (self.short / "spool" / name).mkdir(parents=True, exist_ok=True)
        self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)])

    def kill_node(self, name: str) -> None:
        """The node dies: SIGKILL its slurmd, its slurmstepd processes and everything they run
        (slurmctld declares the node DOWN after ``SlurmdTimeout``, the job NODE_FAIL)."""
        proc = self.procs.pop(f"slurmd-{name}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        _kill_trees(_tagged(f"{self.root}:slurmd-{name}"))

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        argv = [_which(argv[0]) or argv[0], *argv[1:]]  # absolute: a test may have narrowed PATH
        from conftest import deadline

        return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.env()},
                              timeout=deadline(30))

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *args]).stdout

    def idle_nodes(self) -> set[str]:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split("\n")
        return {line.split()[0] for line in out if line.strip() and line.split()[1] == "idle"}

    def jobs(self) -> list[str]:
        """Every job id Slurm still shows in ``squeue`` (pending, running or completing)."""
        out = self._run(["squeue", "-h", "-o", "%i %T"]).stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    # ---------------------------------------------------------------- tear down

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL) and their job steps."""
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None and self.jobs():
                self._run(["scancel", "--full", "--user=root"])
        except (OSError, subprocess.SubprocessError):
            pass  # the daemons are stopped below whatever happened
        for name in sorted(self.procs, key=lambda n: n == "munged"):  # munge last
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()
        _kill_stepds(self.root)
        shutil.rmtree(self.short, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        out = []
        for p in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)



DAEMON_TAG = "SFTCTL_TEST_SLURM_DAEMON"


def _tagged(value_prefix: str) -> list[int]:
    """Processes whose environment has ``DAEMON_TAG`` starting with ``value_prefix``."""
    want = f"{DAEMON_TAG}={value_prefix}".encode()
    out = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            env = (pid_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(want) for e in env):
            out.append(int(pid_dir.name))
    return out


def _kill_trees(roots: list[int]) -> None:
    """SIGKILL ``roots`` and all their descendants (by parent pid, read from /proc)."""
    children: dict[int, list[int]] = {}
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                ppid = int((pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(pid_dir.name))
    todo, seen = list(roots), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children.get(pid, [])
    for pid in seen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_stepds(root: Path) -> None:
    """slurmstepd processes outlive a killed slurmd; end this cluster's and what they run."""
    _kill_trees(_tagged(f"{root}:"))


def _wait(pred, timeout_s: float, what: str, cluster: SlurmCluster) -> None:
    """Poll ``pred`` until true; ``timeout_s`` is a quiet machine's budget, scaled by the load
    (:func:`conftest.deadline`, read on every poll): the daemons start slower on a busy machine."""
    from conftest import deadline

    start = time.monotonic()
    while time.monotonic() - start < deadline(timeout_s):
        try:
            if pred():
                return
        except (OSError, subprocess.SubprocessError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"test Slurm cluster: timed out waiting for {what}\n{cluster.log_tail()}")


class SSHServer(_Managed):
    """An ``sshd`` on a free loopback port standing in for a cluster's login node.

    Key authentication only, into a temporary ``authorized_keys``; its host key, config, pid
    file and log live under ``root``. ``SetEnv`` gives every session the cluster's
    ``SLURM_CONF``, as a login node's profile would. ``client_config()`` is the ``slurm:``
    section that reaches it (user, port, key, known-hosts file of its own).
    """

    def __init__(self, root: Path, env: dict[str, str]):
        self.root = Path(root)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20) -> "SSHServer":
        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        os.chmod(r, 0o700)
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(r / name)], check=True)
        (r / "authorized_keys").write_text((r / "client_key.pub").read_text())
        os.chmod(r / "authorized_keys", 0o600)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        [self.port] = free_ports(1)
        set_env = " ".join(f"{k}={v}" for k, v in self.env.items())
        (r / "sshd_config").write_text(f"""\
Port {self.port}
ListenAddress 127.0.0.1
HostKey {r / 'host_key'}
PidFile {r / 'sshd.pid'}
AuthorizedKeysFile {r / 'authorized_keys'}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
SetEnv {set_env}
MaxSessions 50
MaxStartups 50
""")
        log = open(r / "sshd.log", "ab")
        self.proc = subprocess.Popen([_which("sshd"), "-D", "-e", "-f", str(r / "sshd_config")], stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, DAEMON_TAG: f"{r}:sshd"})
        log.close()
        _wait(lambda: _port_open(self.port), timeout_s, "sshd to listen", _LogTail(r / "sshd.log"))
        return self

    def client_config(self) -> dict:
        return {"host": "127.0.0.1", "port": self.port, "user": os.environ.get("USER") or "root",
                "key": str(self.root / "client_key"),
                "ssh_options": ["StrictHostKeyChecking=accept-new", f"UserKnownHostsFile={self.root / 'known_hosts'}"]}

    def stop(self) -> None:
        """Stop sshd and every session it forked (ControlPersist masters end with them)."""
        if self.proc is not None:
            _kill_trees([self.proc.pid] + _tagged(f"{self.root}:sshd"))
            self.proc.wait(10)
            self.proc = None



def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class _LogTail:
    def __init__(self, path: Path):
        self.path = path

    def log_tail(self, chars: int = 3000) -> str:
        return self.path.read_text(errors="replace")[-chars:] if self.path.exists() else ""
