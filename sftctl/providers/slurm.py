"""Slurm: a job is one ``sbatch`` allocation per attempt on the lab's own cluster.

Two ways to reach the cluster (:class:`SlurmConfig`):

* **login node** (no ``host``): sftctl runs where ``sinfo`` works; ``SLURM_CONF`` is honoured by
  Slurm's own commands. The job's files live under ``$SFTCTL_HOME/jobs/<job>/slurm/``, which the
  compute nodes must see (a shared filesystem, as ``$HOME`` is on nearly every cluster).
* **SSH** (``host`` set): every Slurm command and file read goes through the system ``ssh`` to the
  login node, with connection reuse (``ControlMaster=auto``, ``ControlPersist``): the first call
  opens the connection, the others ride on it (a few ms each). The job's files live under
  ``remote_dir`` on the cluster (``~/.sftctl/jobs`` by default); the spec's workdir is copied
  there once per job (a tar stream over the same connection).

Layout on the cluster (``<root>`` = the job's directory there)::

    <root>/nodes/<node id>/   the node directory of sftctl.protocol (NodeDir): the attempt's
                              script and environment (0600), its log, exit code, the Slurm node
                              it ran on and Slurm's restart count, metrics and GPU samples
    <root>/attempt-<n>/       sbatch.sh and step.sh (templates/slurm/*.j2), slurm_job_id
    <root>/slurm-<job id>.out the batch script's own output

The controller calls ``provision`` and ``launch`` once per node. ``provision`` creates nothing on
the cluster (rank 0 asks ``sbatch --test-only`` whether the allocation could ever run, so an
impossible request fails at once with exit 3); ``launch`` writes each node's script and
environment, and the launch of the last node submits the attempt's one allocation: ``--nodes``,
one task per node, GPUs (``--gpus-per-node`` or a typed ``--gres=gpu:TYPE:N`` when the partition
types its GPUs), CPUs, memory, partition, account, QOS, ``--time`` from the spec's deadline,
``--requeue``, ``--signal`` before the time limit, output files, ``--exclude`` of nodes that
failed this job, and ``--comment`` carrying sftctl's labels. ``srun`` starts one step task per
node, which runs that node's script with its ``SFTCTL_*`` variables; the rendezvous host is the
allocation's first node (``scontrol show hostnames``, its ``NodeAddr``).

Status: ``squeue``, then ``scontrol show job`` (both forget a job ``MinJobAge`` after it ends),
then ``sacct`` where accounting exists, then the node's exit file, which the node script writes
last. A pending job is RUNNING to the controller with ``detail`` = the pending reason in words.
A node whose allocation ended without an exit code is LOST (replaced: the next allocation
excludes its Slurm node); Slurm's own requeue (``--requeue``, after preemption or NODE_FAIL) is
followed: the job stays RUNNING and resumes from its checkpoint when it starts again.

Teardown: ``scancel``. ``list_instances`` / ``terminate_tagged`` find sftctl's jobs by their
comment (``sftctl-managed=true,sftctl-job=<job>,sftctl-home=<hash>``), only the user's own and
only those of this sftctl home.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sftctl import settings
from sftctl.catalog import Offering
from sftctl.catalog.identity import from_slurm_gres
from sftctl.errors import CapacityError, ProviderError
from sftctl.protocol import CONTROLLER_HEARTBEAT, NodeDir, complete_json_lines, parse_exit_code, parse_failure
from sftctl.providers.base import NodeState, NodeStatus
from sftctl.slurm_config import SlurmConfig
from sftctl.types import FailureReason, SlurmHandle

#: Pending reasons of ``squeue`` (``%r``) in words. Source: Slurm's squeue man page, "JOB REASON
#: CODES" (22.05 and 24.11 list the same codes for these).
REASONS = {
    "Resources": "waiting for resources: the nodes it needs are busy",
    "Priority": "other jobs of higher priority are ahead in the queue",
    "None": "just submitted, not yet looked at by the scheduler",
    "BeginTime": "its earliest start time has not come yet (a requeued job waits a moment)",
    "Dependency": "waiting for a job it depends on",
    "QOSMaxGRESPerUser": "your QOS's limit on GPUs per user is reached",
    "QOSMaxNodePerUserLimit": "your QOS's limit on nodes per user is reached",
    "QOSMaxJobsPerUserLimit": "your QOS's limit on running jobs per user is reached",
    "QOSGrpGRES": "the QOS's GPU limit for the whole group is reached",
    "AssocGrpGRES": "your account's GPU limit is reached",
    "AssocMaxJobsLimit": "your account's limit on running jobs is reached",
    "ReqNodeNotAvail": "a node it needs is unavailable (down, drained or reserved)",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "its time limit is above the partition's",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "its constraints cannot be satisfied",
    "JobHeldUser": "held by its user (scontrol release)",
    "JobHeldAdmin": "held by an administrator",
    "Reservation": "waiting for its reservation",
    "launch failed requeued held": "its launch failed and Slurm held it",
}


def pending_words(reason: str) -> str:
    """A pending job's ``squeue`` reason code in words, keeping the code Slurm's docs use
    (``Resources: waiting for resources ...``); Slurm's ``None`` (not yet scheduled) is words only."""
    words = REASONS.get(reason, reason)
    return words if reason in ("None", words) else f"{reason}: {words}"

#: Slurm job states after which the allocation is gone (squeue's long names).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}

#: Seconds before the time limit at which Slurm signals the batch script (``--signal=B:USR1@``).
SIGNAL_BEFORE_S = 90
#: How long one squeue answer serves every node of an attempt (one poll reads all nodes).
STATE_TTL_S = 0.5

COMMENT_PREFIX = "sftctl-managed=true"
#: the comment label of a job's controller run as a Slurm job (controller.place: slurm); the
#: node allocations' listing (list_instances, terminate_tagged) leaves such jobs out
CONTROLLER_ROLE = "sftctl-role=controller"


def controller_job_name(job_id: str) -> str:
    """The Slurm job name of ``job_id``'s controller (``sftctl-ctl-<job>``)."""
    return f"sftctl-ctl-{job_id}"


def load_config(spec_section: dict | None = None) -> SlurmConfig:
    """The config file's ``slurm:`` section overlaid with the spec's (``spec_section``).

    Raises:
        SettingError: the file's section has a key :class:`SlurmConfig` lacks (its line, a
            did-you-mean; exit 2).
        ProviderError: ``spec_section`` has an unknown field.
    """
    from_file = config_file_section()
    merged = {**from_file, **{k: v for k, v in (spec_section or {}).items() if v is not None}}
    fields = {f.name for f in dataclasses.fields(SlurmConfig)}
    for key in sorted(set(from_file) - fields):  # the file's line and a did-you-mean (exit 2)
        raise settings.unknown_key(f"slurm.{key}", sorted(f"slurm.{f}" for f in fields))
    unknown = sorted(set(merged) - fields)
    if unknown:
        raise ProviderError(f"slurm config: unknown field(s) {', '.join(unknown)}",
                            hint=f"fields: {', '.join(sorted(fields))}")
    if "ssh_options" in merged:
        merged["ssh_options"] = tuple(merged["ssh_options"])
    return SlurmConfig(**merged)


def config_path() -> Path | None:
    """The config file (:func:`sftctl.settings.config_path`: ``$SFTCTL_CONFIG``, else
    ``~/.config/sftctl/config.yaml``, else ``$SFTCTL_HOME/config.yaml``), or None."""
    path = settings.config_path()
    return None if path is None else Path(path)


def config_file_section() -> dict:
    """The ``slurm:`` mapping of the config file, or {} when there is none.

    Raises:
        SettingError: the file is malformed or ``slurm`` is not a mapping (exit 2).
    """
    return settings.section("slurm")[1]


def login_node_reason(environ: dict | None = None) -> str | None:
    """None when Slurm's client commands work in this shell (cheap: no call), else why not."""
    env = os.environ if environ is None else environ
    if shutil.which("sinfo", path=env.get("PATH")) is None:
        return "slurm: sinfo is not on PATH (not a login node; set slurm.host in the config to use SSH)"
    conf = env.get("SLURM_CONF")
    if conf:
        return None if Path(conf).is_file() else f"slurm: SLURM_CONF={conf} does not exist"
    if any(Path(p).is_file() for p in ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf",
                                        "/usr/local/etc/slurm.conf")):
        return None
    if Path("/run/slurm/conf/slurm.conf").is_file():  # configless: slurmd caches it here
        return None
    return "slurm: no slurm.conf (set SLURM_CONF, or slurm.host in the config to use SSH)"


def configured_reason(environ: dict | None = None) -> str | None:
    """None when Slurm looks usable (an SSH host in the config, or a login node), else why not."""
    try:
        if config_file_section().get("host"):
            return None
    except (ProviderError, settings.SettingError) as e:
        return e.message
    return login_node_reason(environ)


def home_tag() -> str:
    """A short hash of this sftctl home: jobs of another home (another state, a test) are not ours."""
    from sftctl.paths import sftctl_home

    return hashlib.sha256(str(sftctl_home().resolve()).encode()).hexdigest()[:10]


def comment(job_id: str) -> str:
    return f"{COMMENT_PREFIX},sftctl-job={job_id},sftctl-home={home_tag()}"


def parse_comment(text: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in text.split(",") if "=" in p)


def accelerator_of(gpu_type: str, overrides: dict | None = None) -> str:
    """The catalog accelerator of a Slurm GPU type (``h100`` -> ``H100``), or ``""`` if unknown:
    ``slurm.gpu_types`` (``overrides``) first, then the catalog (:func:`sftctl.catalog.identity.from_slurm_gres`:
    each entry's ``identity.slurm_gres`` names, else its name with case, ``-`` and ``_`` ignored)."""
    if overrides and gpu_type in overrides:
        return overrides[gpu_type]
    return from_slurm_gres(gpu_type)


def parse_gres(text: str) -> list[tuple[str, int]]:
    """GPU entries of a ``sinfo %G`` field: ``gpu:h100:4(S:0-1),shard:8`` -> ``[("h100", 4)]``;
    an untyped ``gpu:2`` gives ``("", 2)``."""
    out = []
    for part in re.split(r",(?![^()]*\))", text or ""):
        part = re.sub(r"\(.*\)$", "", part.strip())
        bits = part.split(":")
        if bits[0] != "gpu" or len(bits) < 2:
            continue
        if len(bits) == 2:
            typ, count = "", bits[1]
        else:
            typ, count = bits[1], bits[2]
        m = re.match(r"\d+", count)
        if m:
            out.append((typ if typ != "(null)" else "", int(m.group(0))))
    return out


def duration(seconds: float) -> str:
    """``--time`` for sbatch: ``D-HH:MM:SS`` (rounded up to a minute, at least one)."""
    minutes = max(1, int(-(-seconds // 60)))
    d, rem = divmod(minutes, 1440)
    h, m = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:00"


# -------------------------------------------------------------------- where commands run


_READ_FILES = r"""
def read_files(req):
    import glob
    files = dict(req.get("files", {}))
    for pattern in req.get("globs", []):
        for p in glob.glob(pattern):
            files.setdefault(p, 0)
    out = {}
    for p, off in files.items():
        try:
            with open(p, "rb") as f:
                f.seek(off)
                out[p] = f.read(16 << 20)
        except OSError:
            pass
    return out
"""

#: What a remote read does: given {"files": {path: offset}, "globs": [pattern]}, print JSON
#: {path: base64 bytes from its offset (16 MiB at most)} for each file that exists. Runs with
#: the remote python3 (SSH mode); login-node mode runs the same ``read_files`` in this process
#: (:func:`_read_local`): one round trip per node per poll.
_READ_SCRIPT = _READ_FILES + r"""
import base64, json, sys
print(json.dumps({p: base64.b64encode(d).decode() for p, d in read_files(json.loads(sys.argv[1])).items()}))
"""


def _read_local(req: dict) -> dict[str, bytes]:
    """:data:`_READ_SCRIPT`'s read, in this process: ``{path: bytes from its offset}``."""
    namespace: dict = {}
    exec(_READ_FILES, namespace)  # the very code the remote read runs
    return namespace["read_files"](req)


class Runner:
    """Runs commands and moves files where Slurm is: here (login node) or over SSH."""

    remote = False

    def run(self, argv: list[str], *, input: bytes | None = None, timeout: float = 60,
            check: bool = True) -> subprocess.CompletedProcess:
        raise NotImplementedError

    def write_files(self, files: dict[str, tuple[str, int]]) -> None:
        """Write ``{path: (text, mode)}``, creating directories (0700)."""
        raise NotImplementedError

    def read(self, req: dict) -> dict[str, bytes]:
        raise NotImplementedError

    def home(self) -> str:
        raise NotImplementedError


class LocalRunner(Runner):
    """Slurm commands in this shell (a login node); files on this (shared) filesystem."""

    def run(self, argv, *, input=None, timeout=60, check=True):
        try:
            proc = subprocess.run(argv, input=input, capture_output=True, timeout=timeout)
        except FileNotFoundError:
            raise ProviderError(f"slurm: {argv[0]} not found", hint="run sftctl on a login node, or set slurm.host") from None
        except subprocess.TimeoutExpired:
            raise ProviderError(f"slurm: {' '.join(argv[:2])} did not answer within {timeout:.0f} s",
                                hint="is slurmctld up? scontrol ping") from None
        if check and proc.returncode != 0:
            raise _command_error(argv, proc)
        return proc

    def write_files(self, files):
        for path, (text, mode) in files.items():
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = p.with_name(p.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, mode)
            tmp.replace(p)

    def read(self, req):
        return _read_local(req)

    def home(self):
        return str(Path.home())


#: a unix socket's path holds at most 108 bytes (Linux; 104 on macOS), and ssh first binds the
#: control socket at the path plus a 17-character random suffix
_SOCKET_PATH_MAX = 104 - 17


def _control_dir(home: Path) -> Path:
    """The directory of this home's ssh ControlMaster sockets: ``<home>/ssh``, or, when a path in
    it would be too long for a unix socket (a deep ``SFTCTL_HOME``), ``sftctl-ssh-<uid>`` in the
    temporary directory. Created 0700; raises ProviderError when that directory belongs to another
    user or others can enter it (someone else could put a socket there)."""
    d = home / "ssh"
    if len(str(d / "cm-000000000000")) > _SOCKET_PATH_MAX:
        d = Path(tempfile.gettempdir()) / f"sftctl-ssh-{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ProviderError(f"slurm: {d} (ssh control sockets) belongs to uid {st.st_uid} or is open to "
                            f"others (mode {st.st_mode & 0o777:o})", hint="remove it, or set a shorter SFTCTL_HOME")
    return d


class SSHRunner(Runner):
    """Every command through the system ``ssh`` to the login node, over one reused connection.

    ``ControlMaster=auto`` with a control socket per (user, host, port) under ``$SFTCTL_HOME``
    and ``ControlPersist=300``: the first command pays the handshake, later ones reuse it.
    ``BatchMode=yes``: a missing key is an error, never a password prompt.
    """

    remote = True

    def __init__(self, cfg: SlurmConfig):
        from sftctl.paths import sftctl_home

        self.cfg = cfg
        self.target = f"{cfg.user}@{cfg.host}" if cfg.user else cfg.host
        home = sftctl_home()
        digest = hashlib.sha256(f"{home}:{self.target}:{cfg.port}".encode()).hexdigest()[:12]
        self.control_path = str(_control_dir(home) / f"cm-{digest}")
        self._home: str | None = None

    def ssh_argv(self) -> list[str]:
        argv = ["ssh", "-p", str(self.cfg.port), "-o", "BatchMode=yes", "-o", "ControlMaster=auto",
                "-o", f"ControlPath={self.control_path}", "-o", "ControlPersist=300",
                "-o", "ConnectTimeout=15", "-o", "ServerAliveInterval=15"]
        if self.cfg.key:
            argv += ["-i", str(Path(self.cfg.key).expanduser()), "-o", "IdentitiesOnly=yes"]
        for opt in self.cfg.ssh_options:
            argv += ["-o", str(opt)]
        return argv + [self.target]

    def run(self, argv, *, input=None, timeout=60, check=True):
        cmd = self.ssh_argv() + ["--", " ".join(shlex.quote(a) for a in argv)]
        try:
            proc = subprocess.run(cmd, input=input, capture_output=True, timeout=timeout,
                                  stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise ProviderError("slurm: the ssh client is not installed", hint="apt-get install openssh-client") from None
        except subprocess.TimeoutExpired:
            raise ProviderError(f"slurm: ssh {self.target} did not answer within {timeout:.0f} s",
                                hint=f"check ssh -p {self.cfg.port} {self.target} works") from None
        if proc.returncode == 255:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise ProviderError(f"slurm: ssh {self.target}: {err[-1] if err else 'connection failed'}",
                                hint="check slurm.host, slurm.user, slurm.key (ssh -i KEY USER@HOST works?)")
        if check and proc.returncode != 0:
            raise _command_error(argv, proc)
        return proc

    def write_files(self, files):
        # one round trip: a tar stream unpacked under / (paths are absolute)
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            dirs = sorted({str(Path(p).parent) for p in files})
            for path, (text, mode) in files.items():
                data = text.encode()
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        script = f"mkdir -p -m 700 {' '.join(shlex.quote(d) for d in dirs)} && tar -x -C / -f -"
        self.run(["bash", "-c", script], input=buf.getvalue())

    def read(self, req):
        proc = self.run(["python3", "-c", _READ_SCRIPT, json.dumps(req)], check=False)
        if proc.returncode != 0:
            raise ProviderError(f"slurm: reading job files on {self.target} failed: "
                                f"{proc.stderr.decode(errors='replace').strip()[-300:]}",
                                hint="the login node needs python3")
        return {p: base64.b64decode(d) for p, d in json.loads(proc.stdout or b"{}").items()}

    def home(self):
        if self._home is None:
            self._home = self.run(["bash", "-c", "echo $HOME"]).stdout.decode().strip()
        return self._home

    def upload_dir(self, local: str, remote: str) -> None:
        """Copy directory ``local`` to ``remote`` (a tar stream; ``.git``, venvs, caches left out)."""
        tar = subprocess.Popen(["tar", "-C", local, "--exclude=.git", "--exclude=.venv", "--exclude=.ci-venv",
                                "--exclude=__pycache__", "--exclude=*.pyc", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        data = tar.stdout.read()
        tar.wait()
        self.run(["bash", "-c", f"mkdir -p {shlex.quote(remote)} && tar -x -C {shlex.quote(remote)} -f -"],
                 input=data, timeout=600)


def _command_error(argv: list[str], proc: subprocess.CompletedProcess) -> ProviderError:
    err = (proc.stderr or b"").decode(errors="replace").strip()
    line = err.splitlines()[-1] if err else f"exit code {proc.returncode}"
    return ProviderError(f"slurm: {argv[0]} failed: {line}", hint="sftctl check slurm; sinfo shows the cluster")


# -------------------------------------------------------------------- the provider


class SlurmProvider:
    """Nodes of one Slurm allocation per attempt. See the module docstring.

    Args:
        channel: ignored for now: the job's files live on the cluster's filesystem (and are read
            from there), whether or not the spec names a storage.
        config: the ``slurm:`` settings; default :func:`load_config` (the config file).
        num_nodes: nodes per allocation (the spec's ``resources.nodes``); default: as many as
            were provisioned.
        time_limit_s: ``--time`` (the spec's deadline); None: the partition's default.
        runner: where commands run (tests pass one); default from ``config.host``.
    """

    name = "slurm"

    def __init__(self, channel=None, config: SlurmConfig | dict | None = None, num_nodes: int | None = None,
                 time_limit_s: float | None = None, runner: Runner | None = None, **_: object):
        if config is None or isinstance(config, dict):
            config = load_config(config)
        self.cfg = config
        self.channel = channel
        self.num_nodes = num_nodes
        self.time_limit_s = time_limit_s
        self.runner = runner or (SSHRunner(config) if config.host else LocalRunner())
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[int, str]] = {}  # job -> rank -> node id (provisioned)
        self._pending: dict[tuple[str, int], dict[int, dict]] = {}  # (job, attempt) -> rank -> launch
        self._submitted: dict[tuple[str, int], str] = {}  # (job, attempt) -> Slurm job id
        self._states: dict[str, tuple[float, dict | None]] = {}  # Slurm job id -> (when, state)
        self.excluded: set[str] = set()  # Slurm nodes that failed this job
        self.uploaded: dict[str, str] = {}  # job -> remote workdir
        self._cpu_share: dict[tuple[str, str], int | None] = {}
        self._beats: dict[str, float] = {}  # job -> when keepalive last wrote its heartbeat (monotonic)

    # ---------------------------------------------------------------- paths

    def job_root(self, job_id: str) -> str:
        """The job's directory on the cluster (see the module docstring)."""
        if self.runner.remote:
            base = self.cfg.remote_dir
            if base.startswith("~"):
                base = self.runner.home() + base[1:]
            return f"{base.rstrip('/')}/{job_id}"
        from sftctl.paths import job_dir

        return str(job_dir(job_id) / "slurm")

    # ---------------------------------------------------------------- protocol: cluster

    def check(self) -> None:
        """``sinfo`` answers (over SSH when ``host`` is set), else ProviderError (exit 4)."""
        if not self.runner.remote:
            why = login_node_reason()
            if why:
                raise ProviderError(why, hint="run sftctl on a login node, or set slurm.host in ~/.config/sftctl/config.yaml")
        self.runner.run(["sinfo", "-h", "-o", "%P"], timeout=30)

    def cluster(self) -> list[dict]:
        """One dict per (node, partition) from ``sinfo``: ``node``, ``partition``, ``default``,
        ``gpus`` ([(type, count)]), ``cpus``, ``memory_mb``, ``state``, ``avail``."""
        out = self.runner.run(["sinfo", "-h", "-N", "-o", "%N|%P|%G|%c|%m|%t|%a"], timeout=30).stdout.decode()
        rows = []
        for line in out.splitlines():
            bits = line.strip().split("|")
            if len(bits) != 7:
                continue
            node, part, gres, cpus, mem, state, avail = bits
            rows.append({"node": node, "partition": part.rstrip("*"), "default": part.endswith("*"),
                         "gpus": parse_gres(gres), "cpus": _int(cpus), "memory_mb": _int(mem),
                         "state": state, "avail": avail})
        return rows

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """One offering per partition (and GPU type) whose nodes have ``count`` x ``accelerator``.

        ``cpu`` is offered by every partition with nodes of >= ``count`` CPUs. Price: the
        config's ``gpu_hour_usd`` x ``count`` per node (``cpu_hour_usd`` for cpu), 0 = owned.
        ``source`` says how many of the partition's matching nodes are idle now.
        """
        want = accelerator.lower()
        groups: dict[tuple[str, str], dict] = {}
        for r in self.cluster():
            if r["avail"] not in ("up", "UP"):
                continue
            if self.cfg.partition and r["partition"] != self.cfg.partition:
                continue
            if want == "cpu":
                if r["cpus"] < count:
                    continue
                name, gpu_type = "cpu", ""
            else:
                match = [(t, n) for t, n in r["gpus"] if n >= count and accelerator_of(t, self.cfg.gpu_types).lower() == want]
                if not match:
                    continue
                name, gpu_type = accelerator_of(match[0][0], self.cfg.gpu_types), match[0][0]
            g = groups.setdefault((r["partition"], gpu_type), {"name": name, "nodes": set(), "idle": set(),
                                                               "cpus": r["cpus"], "mem": r["memory_mb"]})
            g["nodes"].add(r["node"])
            if r["state"] in ("idle",):
                g["idle"].add(r["node"])
            g["cpus"], g["mem"] = min(g["cpus"], r["cpus"]), min(g["mem"], r["memory_mb"])
        out = []
        for (part, gpu_type), g in sorted(groups.items()):
            rate = self.cfg.cpu_hour_usd if want == "cpu" else self.cfg.gpu_hour_usd
            price = float(rate) * count
            out.append(Offering(
                provider=self.name, instance_type=f"{part}" + (f"/{gpu_type}" if gpu_type else ""),
                accelerator=g["name"], count=count, region=self.region(), usd_per_hour=price,
                spot_usd_per_hour=price, vcpus=g["cpus"] or None,
                memory_gib=round(g["mem"] / 1024, 1) if g["mem"] else None,
                source=(f"slurm partition {part}: {len(g['idle'])}/{len(g['nodes'])} node(s) idle; "
                        + ("owned (slurm.gpu_hour_usd is 0)" if not price else f"lab price {rate}/h per "
                           + ("CPU" if want == 'cpu' else "GPU"))),
                as_of=datetime.date.today().isoformat(),
            ))
        return out

    def region(self) -> str:
        return f"slurm:{self.cfg.host}" if self.cfg.host else "slurm"

    def estimate_start(self, offering: Offering, nodes: int) -> tuple[float, str]:
        """Slurm's own estimate of when an allocation for ``offering`` x ``nodes`` would start:
        ``(seconds from now, the line sbatch --test-only printed)``.

        Raises:
            CapacityError: Slurm says the allocation can never run (more nodes than the
                partition has, a GPU type it lacks, a time limit above the partition's).
        """
        argv = ["sbatch", "--test-only", *self._allocation_args(offering, nodes, exclude=self.excluded),
                "--wrap", "true"]
        proc = self.runner.run(argv, check=False, timeout=30)
        text = (proc.stderr or b"").decode(errors="replace").strip()
        m = re.search(r"to start at (\S+)", text)
        if proc.returncode != 0 or not m:
            line = text.splitlines()[-1] if text else f"exit code {proc.returncode}"
            line = re.sub(r"^sbatch: error: ", "", line)
            raise CapacityError(f"slurm: {offering.instance_type} cannot run {nodes} node(s) of "
                                f"{offering.accelerator}:{offering.count}: {line}", provider=self.name,
                                scope="offering", region=offering.region, instance_type=offering.instance_type)
        try:
            start = datetime.datetime.fromisoformat(m.group(1))
            wait = max(0.0, (start - datetime.datetime.now()).total_seconds())
        except ValueError:
            wait = 0.0
        return wait, text.removeprefix("sbatch: ")

    # ---------------------------------------------------------------- protocol: nodes

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering, **_: object) -> SlurmHandle:
        """Record the node (no Slurm call creates anything); rank 0 checks with ``sbatch
        --test-only`` that the allocation can run at all (CapacityError if not)."""
        with self._lock:
            self._nodes.setdefault(job_id, {})[rank] = node_id
        if rank == 0:
            self.estimate_start(offering, self.num_nodes or 1)
        root = self.job_root(job_id)
        return SlurmHandle(job_id=job_id, node_id=node_id, rank=rank, root=root, dir=f"{root}/nodes/{node_id}",
                           offering=offering.to_dict(), exclude=sorted(self.excluded))

    def launch(self, handle: SlurmHandle, script: str, env: dict[str, str], attempt: int) -> SlurmHandle:
        """Write the node's script and environment; the last node's launch submits the attempt."""
        job_id, rank = handle.job_id, handle.rank
        with self._lock:
            nodes = self._nodes.setdefault(job_id, {})
            nodes[rank] = handle.node_id
            pending = self._pending.setdefault((job_id, attempt), {})
            pending[rank] = {"handle": handle, "script": script, "env": env}
            total = self.num_nodes or len(nodes)
            ready = len(pending) >= total
        handle = handle.with_(attempt=attempt)
        if not ready:
            return handle
        slurm_id = self._submit(job_id, attempt, [pending[r] for r in sorted(pending)])
        with self._lock:
            self._pending.pop((job_id, attempt), None)
        return handle.with_(slurm_job_id=slurm_id)

    def keepalive(self, job_id: str) -> None:
        """The controller watches ``job_id``: rewrite ``<job root>/controller.heartbeat`` (a
        timestamp) at most every ``grace / 5`` seconds (1 to 30 s). sbatch.sh cancels its own
        allocation when the file's content has not changed for ``SFTCTL_SLURM_CONTROLLER_GRACE_S``
        by the compute node's clock (so clock skew between hosts does not matter)."""
        grace = settings.get("SFTCTL_SLURM_CONTROLLER_GRACE_S")
        if not grace:
            return
        now = time.monotonic()
        if now - self._beats.get(job_id, -1e9) < max(1.0, min(30.0, grace / 5)):
            return
        self._beats[job_id] = now
        self.runner.write_files({f"{self.job_root(job_id)}/{CONTROLLER_HEARTBEAT}": (f"{time.time():.3f}\n", 0o600)})

    def _submit(self, job_id: str, attempt: int, launches: list[dict]) -> str:
        root = self.job_root(job_id)
        offering = Offering(**launches[0]["handle"].offering)
        workdir = None
        files: dict[str, tuple[str, int]] = {}
        python = self.cfg.python or (None if self.runner.remote else sys.executable)
        for item in launches:
            h, env = item["handle"], dict(item["env"])
            node_dir = h.dir
            nd = NodeDir(node_dir)
            if self.runner.remote:  # the nodes see the cluster's filesystem, not this machine's
                workdir = workdir or self._upload_workdir(job_id, root)
                env["SFTCTL_WORKDIR"] = workdir
                if (settings.raw("SFTCTL_CHECKPOINT_DIR", env) or "").startswith(_local_jobs_dir()):
                    env["SFTCTL_CHECKPOINT_DIR"] = f"{root}/checkpoints"
            env.update(SFTCTL_JOB_ID=job_id, SFTCTL_NODE_ID=h.node_id, SFTCTL_NODE_DIR=node_dir,
                       SFTCTL_METRICS_DIR=nd.metrics)
            # with job storage the nodes' own checkpoint copies stay in the node's directory,
            # never in the (shared) workdir, as a cloud node keeps them on its own disk
            env.setdefault("SFTCTL_CHECKPOINT_DIR", f"{node_dir}/checkpoints")
            if python:
                env["SFTCTL_PYTHON"] = python
            files[nd.script(attempt)] = (item["script"], 0o700)
            files[nd.env(attempt)] = ("".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items()), 0o600)
            files[f"{nd.metrics}/.keep"] = ("", 0o600)
        node_ids = [item["handle"].node_id for item in launches]
        adir = f"{root}/attempt-{attempt}"
        for name, text in self.batch_scripts(job_id, attempt, node_ids, offering).items():
            files[f"{adir}/{name}"] = (text, 0o700)
        files[f"{root}/{CONTROLLER_HEARTBEAT}"] = (f"{time.time():.3f}\n", 0o600)
        self._beats[job_id] = time.monotonic()
        self.runner.write_files(files)
        proc = self.runner.run(["sbatch", "--parsable", f"{adir}/sbatch.sh"], check=False, timeout=60)
        if proc.returncode != 0:
            err = (proc.stderr or b"").decode(errors="replace").strip()
            line = re.sub(r"^sbatch: error: ", "", err.splitlines()[-1] if err else f"exit code {proc.returncode}")
            raise CapacityError(f"slurm: sbatch refused attempt {attempt}: {line}", provider=self.name,
                                scope="offering", region=offering.region, instance_type=offering.instance_type)
        slurm_id = proc.stdout.decode().strip().split(";")[0]
        self.runner.write_files({f"{adir}/slurm_job_id": (slurm_id + "\n", 0o600)})
        with self._lock:
            self._submitted[(job_id, attempt)] = slurm_id
        return slurm_id

    def batch_scripts(self, job_id: str, attempt: int, node_ids: list[str], offering: Offering) -> dict[str, str]:
        """``{"sbatch.sh", "step.sh"}``: the text of the attempt's allocation script and of the
        step every node runs, as :meth:`launch` submits them (``run --dry-run`` shows them).

        Raises:
            ValueError: a value bound for an ``#SBATCH`` line holds a control character (the
                settings refuse those first: :func:`sftctl.slurm_config.control_problem`).
        """
        from sftctl.templates import render

        root = self.job_root(job_id)
        python = self.cfg.python or (None if self.runner.remote else sys.executable)
        opts = self._allocation_args(offering, len(node_ids), exclude=self.excluded)
        grace = settings.get("SFTCTL_SLURM_CONTROLLER_GRACE_S")
        return {
            "sbatch.sh": render("slurm/sbatch.sh.j2", job_id=job_id, attempt=attempt, root=root, options=opts,
                                nodes=len(node_ids), signal_s=SIGNAL_BEFORE_S, comment=comment(job_id),
                                requeue=self.cfg.requeue, grace_s=int(round(grace)),
                                check_s=max(1, min(30, int(grace // 10) or 1))),
            "step.sh": render("slurm/step.sh.j2", job_id=job_id, attempt=attempt, root=root, node_ids=node_ids,
                              python_dir=str(Path(python).parent) if python else ""),
        }

    # ---------------------------------------------------------------- the job's controller

    def controller_script(self, job_id: str, argv: list[str], *, partition: str | None, log: str, chdir: str,
                          time_limit_s: float | None = None) -> str:
        """The batch script that runs ``job_id``'s controller (``argv``: ``python -m sftctl.queue
        JOB``, :func:`sftctl.procs.module_argv`) as one 1-CPU task in ``partition`` (default: the
        config's partition, else the cluster's default), appending its output to ``log``;
        ``--time`` is ``time_limit_s`` (None: the partition's default time limit).

        Raises:
            ValueError: a value bound for an ``#SBATCH`` line holds a control character.
        """
        from sftctl.templates import render

        options = []
        if partition or self.cfg.partition:
            options.append(f"--partition={partition or self.cfg.partition}")
        if self.cfg.account:
            options.append(f"--account={self.cfg.account}")
        if self.cfg.qos:
            options.append(f"--qos={self.cfg.qos}")
        if time_limit_s:
            options.append(f"--time={duration(time_limit_s)}")
        return render("slurm/controller.sh.j2", job_id=job_id, slurm_name=controller_job_name(job_id), options=options,
                      log=log, chdir=chdir, comment=f"{comment(job_id)},{CONTROLLER_ROLE}", argv=argv)

    def submit_controller(self, job_id: str, argv: list[str], *, partition: str | None, log: str,
                          chdir: str, time_limit_s: float | None = None) -> str:
        """Write :meth:`controller_script` to ``<job root>/controller.sbatch.sh`` and ``sbatch`` it;
        return the Slurm job id. The job is ``--no-requeue`` and inherits the environment of
        the process that submits it (sbatch's default ``--export=ALL``: ``SFTCTL_HOME``, the
        state's URL, ``SLURM_CONF``, the secrets' values).

        Raises:
            ProviderError: sbatch refused it (an unknown partition, an account limit), exit 4.
        """
        path = f"{self.job_root(job_id)}/controller.sbatch.sh"
        self.runner.write_files({path: (self.controller_script(job_id, argv, partition=partition, log=log,
                                                                chdir=chdir, time_limit_s=time_limit_s), 0o700)})
        proc = self.runner.run(["sbatch", "--parsable", path], check=False, timeout=60)
        if proc.returncode != 0:
            err = (proc.stderr or b"").decode(errors="replace").strip()
            line = re.sub(r"^sbatch: error: ", "", err.splitlines()[-1] if err else f"exit code {proc.returncode}")
            raise ProviderError(f"slurm: sbatch refused the controller of job {job_id}: {line}",
                                hint="controller.partition (or slurm.partition) names a partition of the cluster? "
                                     "sinfo lists them")
        return proc.stdout.decode().strip().split(";")[0]

    def controller_jobs(self, job_id: str | None = None) -> list[dict]:
        """The live Slurm jobs running (or waiting to run) a controller of this sftctl home:
        ``[{"id", "job_id", "state", "name"}]``, of ``job_id`` only when given."""
        by_name = ["--name", controller_job_name(job_id)] if job_id is not None else []
        proc = self.runner.run(["squeue", "-h", *by_name, "-o", "%i|%T|%j|%k"], check=False)
        out, mine = [], home_tag()
        for line in proc.stdout.decode().splitlines():
            bits = line.strip().split("|", 3)
            if len(bits) != 4 or CONTROLLER_ROLE not in bits[3]:
                continue
            labels = parse_comment(bits[3])
            if labels.get("sftctl-home") != mine or (job_id is not None and labels.get("sftctl-job") != job_id):
                continue
            out.append({"id": bits[0], "job_id": labels.get("sftctl-job"), "state": bits[1], "name": bits[2]})
        return out

    def cancel_controller(self, job_id: str, grace_s: float = 20.0) -> list[str]:
        """Stop ``job_id``'s controller jobs: a running one gets SIGTERM (``scancel --batch
        --signal=TERM``: the controller cancels the job and stops its nodes itself) and
        ``grace_s`` seconds to end; what is still in the queue then is cancelled outright. Returns
        the Slurm job ids it found."""
        found = self.controller_jobs(job_id)
        running = [f["id"] for f in found if f["state"] in ("RUNNING", "CONFIGURING")]
        waiting = [f["id"] for f in found if f["id"] not in running]
        if waiting:
            self.runner.run(["scancel", *waiting], check=False)
        if running:
            self.runner.run(["scancel", "--batch", "--signal=TERM", *running], check=False)
            end = time.monotonic() + grace_s
            while time.monotonic() < end and any(f["state"] in ("RUNNING", "CONFIGURING")
                                                 for f in self.controller_jobs(job_id)):
                time.sleep(0.5)
            left = [f["id"] for f in self.controller_jobs(job_id) if f["state"] not in ("COMPLETING",)]
            if left:
                self.runner.run(["scancel", *left], check=False)
        return [f["id"] for f in found]

    def _upload_workdir(self, job_id: str, root: str) -> str:
        if job_id not in self.uploaded:
            from sftctl.state import Store

            job = Store().get_job(job_id)
            local = (job.spec.get("workdir") if job is not None else None) or "."
            remote = f"{root}/workdir"
            self.runner.upload_dir(local, remote)
            self.uploaded[job_id] = remote
        return self.uploaded[job_id]

    def _allocation_args(self, offering: Offering, nodes: int, exclude=()) -> list[str]:
        """sbatch options of an allocation: ``nodes`` x ``offering`` (see the module docstring)."""
        part, _, gpu_type = offering.instance_type.partition("/")
        args = [f"--nodes={nodes}", "--ntasks-per-node=1", f"--partition={self.cfg.partition or part}"]
        if offering.accelerator.lower() != "cpu":
            args.append(f"--gres=gpu:{gpu_type}:{offering.count}" if gpu_type else f"--gpus-per-node={offering.count}")
            cpus = self.cfg.cpus_per_node or self._gpu_share_of_cpus(part, gpu_type, offering.count)
            if cpus:
                args.append(f"--cpus-per-task={cpus}")
        else:
            args.append(f"--cpus-per-task={self.cfg.cpus_per_node or offering.count}")
        if self.cfg.mem_per_node:
            args.append(f"--mem={self.cfg.mem_per_node}")
        if self.cfg.account:
            args.append(f"--account={self.cfg.account}")
        if self.cfg.qos:
            args.append(f"--qos={self.cfg.qos}")
        if self.time_limit_s:
            args.append(f"--time={duration(self.time_limit_s)}")
        if exclude:
            args.append(f"--exclude={','.join(sorted(exclude))}")
        return args

    def _gpu_share_of_cpus(self, partition: str, gpu_type: str, gpus: int) -> int | None:
        """CPUs for one task that drives ``gpus`` GPUs: the node's CPUs in proportion to the GPUs
        asked (all of them for a whole node), from ``sinfo``; None when sinfo does not say.
        Without it Slurm gives the task one CPU, and torchrun's workers would share it."""
        key = (partition, gpu_type)
        if key not in self._cpu_share:
            share = None
            for r in self.cluster():
                if r["partition"] != partition:
                    continue
                total = sum(n for t, n in r["gpus"] if not gpu_type or t == gpu_type)
                if total and r["cpus"]:
                    one = r["cpus"] // total
                    share = one if share is None else min(share, one)
            self._cpu_share[key] = share
        share = self._cpu_share[key]
        return max(1, share * gpus) if share else None

    # ---------------------------------------------------------------- status

    def slurm_id(self, handle: SlurmHandle) -> str | None:
        """The Slurm job of the handle's attempt: from the handle, this process, or the cluster."""
        if handle.slurm_job_id:
            return handle.slurm_job_id
        key = (handle.job_id, handle.attempt)
        if key in self._submitted:
            return self._submitted[key]
        if not handle.attempt:
            return None
        path = f"{handle.root}/attempt-{handle.attempt}/slurm_job_id"
        data = self.runner.read({"files": {path: 0}}).get(path)
        if data and data.strip():
            with self._lock:
                self._submitted[key] = data.decode().strip()
            return self._submitted[key]
        return None

    def job_state(self, slurm_id: str, fresh: bool = False) -> dict | None:
        """``{"state", "reason", "nodes", "restarts", "source"}`` of a Slurm job, or None when Slurm
        has forgotten it. squeue first, then ``scontrol show job``, then ``sacct``."""
        now = time.monotonic()
        cached = self._states.get(slurm_id)
        if cached and not fresh and now - cached[0] < STATE_TTL_S:
            return cached[1]
        state = self._query_state(slurm_id)
        self._states[slurm_id] = (now, state)
        return state

    def _query_state(self, slurm_id: str) -> dict | None:
        proc = self.runner.run(["squeue", "-h", "-j", slurm_id, "-o", "%T|%r|%N"], check=False)
        line = proc.stdout.decode().strip()
        if proc.returncode == 0 and line:
            state, reason, nodes = (line.split("|") + ["", ""])[:3]
            out = {"state": state, "reason": reason, "nodes": nodes, "source": "squeue"}
            if state == "PENDING":  # was it requeued? (squeue does not say; scontrol does)
                f = dict(re.findall(r"(\w+)=(\S*)", self.runner.run(["scontrol", "show", "job", "-o", slurm_id],
                                                                     check=False).stdout.decode()))
                out["restarts"] = _int(f.get("Restarts", "0"))
            return out
        proc = self.runner.run(["scontrol", "show", "job", "-o", slurm_id], check=False)
        text = proc.stdout.decode()
        if proc.returncode == 0 and "JobState=" in text:
            f = dict(re.findall(r"(\w+)=(\S*)", text))
            return {"state": f.get("JobState", ""), "reason": f.get("Reason", ""),
                    "nodes": f.get("NodeList", ""), "restarts": _int(f.get("Restarts", "0")), "source": "scontrol"}
        proc = self.runner.run(["sacct", "-n", "-P", "-X", "-j", slurm_id, "-o", "State,Reason,NodeList"], check=False)
        line = proc.stdout.decode().strip().splitlines()
        if proc.returncode == 0 and line and line[0].strip():
            state, reason, nodes = (line[0].split("|") + ["", ""])[:3]
            return {"state": state.split()[0], "reason": reason, "nodes": nodes, "source": "sacct"}
        return None

    def _files(self, handle: SlurmHandle, offsets: dict | None = None, log_offset: int | None = None) -> dict[str, bytes]:
        """The attempt's exit, host and restarts files (and ``node.log`` from ``log_offset``) in one read."""
        d, a = NodeDir(handle.dir), handle.attempt
        files = {d.exit(a): 0, d.host(a): 0, d.restarts(a): 0}
        if log_offset is not None:
            files[d.log] = log_offset
        return self.runner.read({"files": files})

    def _host(self, handle: SlurmHandle, got: dict[str, bytes]) -> str:
        """The Slurm node the attempt ran on, from a :meth:`_files` answer ("" while unknown)."""
        return (got.get(NodeDir(handle.dir).host(handle.attempt)) or b"").decode().strip()

    def exit_code(self, handle: SlurmHandle) -> int | None:
        return parse_exit_code(self._files(handle).get(NodeDir(handle.dir).exit(handle.attempt)))

    def status(self, handle: SlurmHandle) -> NodeStatus:
        if handle.terminated:
            return NodeStatus(NodeState.TERMINATED)
        if not handle.attempt:
            return NodeStatus(NodeState.READY)
        got = self._files(handle)
        nd = NodeDir(handle.dir)
        code = parse_exit_code(got.get(nd.exit(handle.attempt)))
        if code is not None:
            return NodeStatus(NodeState.SUCCEEDED if code == 0 else NodeState.FAILED, code, f"exit code {code}")
        slurm_id = self.slurm_id(handle)
        if slurm_id is None:
            return NodeStatus(NodeState.RUNNING, None, "waiting for the other nodes' launch")
        st = self.job_state(slurm_id)
        host = self._host(handle, got)
        if st is None:
            if self.exit_code(handle) is not None:
                return self.status(handle)
            return NodeStatus(NodeState.LOST, None, f"Slurm no longer knows job {slurm_id} and node "
                                                    f"{handle.rank} wrote no exit code")
        state = st["state"]
        if state == "PENDING":
            reason = st.get("reason") or "None"
            again = (f" (requeued by Slurm, restart {st['restarts']}: it resumes from the last checkpoint)"
                     if st.get("restarts") else "")
            return NodeStatus(NodeState.RUNNING, None, f"pending in Slurm job {slurm_id}: {pending_words(reason)}{again}",
                              pending=True)
        if state not in ENDED:
            restarts = _int((got.get(nd.restarts(handle.attempt)) or b"0").decode())
            if state == "RUNNING" and restarts:
                return NodeStatus(NodeState.RUNNING, None, f"Slurm job {slurm_id} runs again after Slurm requeued it "
                                                           f"(restart {restarts}, on {host or 'a new node'}): "
                                                           "resumed from the last checkpoint")
            return NodeStatus(NodeState.RUNNING, None, "" if state == "RUNNING" else f"Slurm job {slurm_id} {state.lower()}")
        code = self.exit_code(handle)  # the allocation ended: the node may have written it just now
        if code is not None:
            return NodeStatus(NodeState.SUCCEEDED if code == 0 else NodeState.FAILED, code, f"exit code {code}")
        where = f" on {host}" if host else ""
        if state == "NODE_FAIL" and host and not self._node_down(host):
            # another node of the allocation failed: this one waits for the replacement's relaunch
            return NodeStatus(NodeState.RUNNING, None, f"Slurm job {slurm_id} NODE_FAIL (not this node)")
        if state == "TIMEOUT":
            return NodeStatus(NodeState.FAILED, None, f"Slurm job {slurm_id} hit its time limit{where}")
        detail = (f"Slurm job {slurm_id} ended {state}{where} ({st.get('reason') or 'no reason given'}) "
                  "without an exit code")
        if host and self._node_down(host):  # draining needs admin rights: sftctl only leaves it out
            detail += (f"; Slurm node {host} is down: sftctl leaves it out of this job's allocations "
                       f"(--exclude); an admin should look at it (scontrol show node {host})")
        return NodeStatus(NodeState.LOST, None, detail)

    def _node_down(self, host: str) -> bool:
        proc = self.runner.run(["sinfo", "-h", "-N", "-n", host, "-o", "%t"], check=False)
        states = proc.stdout.decode().split()
        return not states or any(s.rstrip("*~#!%$@^-") in ("down", "drain", "drng", "fail", "failg", "unk", "boot")
                                 or s.endswith("*") for s in states)

    def read_log(self, handle: SlurmHandle, offset: int) -> tuple[bytes, int]:
        if not handle.dir:
            return b"", offset
        path = NodeDir(handle.dir).log
        data = self.runner.read({"files": {path: offset}}).get(path, b"")
        return data, offset + len(data)

    def read_metrics(self, handle: SlurmHandle, offsets: dict[str, int]) -> list[dict]:
        if not handle.dir:
            return []
        pattern = NodeDir(handle.dir).metrics_glob
        got = self.runner.read({"globs": [pattern], "files": {p: o for p, o in offsets.items() if p.startswith(handle.dir)}})
        out = []
        for path in sorted(got):
            if not path.endswith(".jsonl"):
                continue
            out += complete_json_lines(path, got[path], offsets)
        return out

    def read_health(self, handle: SlurmHandle, offsets: dict[str, int]) -> list[dict]:
        if not handle.dir:
            return []
        path = NodeDir(handle.dir).health
        got = self.runner.read({"files": {path: offsets.get(path, 0)}})
        return complete_json_lines(path, got[path], offsets) if path in got else []

    def read_failure(self, handle: SlurmHandle) -> FailureReason | None:
        if not handle.dir or not handle.attempt:
            return None
        path = NodeDir(handle.dir).failure(handle.attempt)
        return parse_failure(self.runner.read({"files": {path: 0}}).get(path))

    # ---------------------------------------------------------------- teardown

    def stop_attempt(self, handle: SlurmHandle) -> None:
        """Cancel the attempt's allocation (every node of it); the next attempt submits anew."""
        self._cancel(handle)

    def quarantine(self, handle: SlurmHandle, reason: str) -> dict | None:
        """Put the Slurm node the attempt ran on (the protocol's host file) on this job's
        ``--exclude`` list, whatever the allocation's state (draining it needs admin rights:
        sftctl only leaves it out). None when the node never wrote its host name."""
        if not (handle.attempt and handle.dir):
            return None
        host = self._host(handle, self._files(handle))
        if not host:
            return None
        self.excluded.add(host)
        return {"machine": host, "actions": ["exclude"],
                "message": f"slurm: node {host} is left out of this job's next allocations (--exclude): {reason}"}

    def terminate(self, handle: SlurmHandle) -> None:
        """Cancel the allocation of the node's attempt. The Slurm node it ran on goes on this
        job's ``--exclude`` list unless the allocation ended for a reason that is not the node's
        (cancelled, preempted, out of time): a node replaced for a health verdict or a lost
        heartbeat, or one Slurm reports down, is never given to this job again."""
        if handle.attempt and handle.dir:
            host = self._host(handle, self._files(handle))
            slurm_id = self.slurm_id(handle)
            st = self.job_state(slurm_id, fresh=True) if slurm_id else None
            innocent = st is not None and st["state"] in ("CANCELLED", "PREEMPTED", "TIMEOUT", "COMPLETED", "DEADLINE")
            if host and (not innocent or self._node_down(host)):
                self.excluded.add(host)
        self._cancel(handle)

    def _cancel(self, handle: SlurmHandle) -> None:
        with self._lock:
            self._pending.pop((handle.job_id, handle.attempt), None)
        slurm_id = self.slurm_id(handle) if handle.attempt and handle.root else None
        if slurm_id:
            self.runner.run(["scancel", slurm_id], check=False)
            self._states.pop(slurm_id, None)
        if handle.attempt and handle.dir:  # the attempt is over: its secret values go with it
            self.runner.run(["rm", "-f", NodeDir(handle.dir).env(handle.attempt)], check=False)

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """The user's live Slurm jobs whose comment carries sftctl's labels and this home (node
        allocations only: a controller's Slurm job is :meth:`controller_jobs`')."""
        user = ["--me"] if not self.runner.remote and os.geteuid() != 0 else ["-u", self.cfg.user] if self.cfg.user else ["--me"]
        proc = self.runner.run(["squeue", "-h", *user, "-o", "%i|%T|%k"], check=False)
        if proc.returncode != 0:
            proc = self.runner.run(["squeue", "-h", "-o", "%i|%T|%k"], check=False)
        out = []
        mine = home_tag()
        for line in proc.stdout.decode().splitlines():
            bits = line.strip().split("|", 2)
            if len(bits) != 3 or COMMENT_PREFIX not in bits[2] or CONTROLLER_ROLE in bits[2]:
                continue  # a controller's own Slurm job is not a node (its teardown calls this)
            labels = parse_comment(bits[2])
            if labels.get("sftctl-home") != mine:
                continue
            if job_id is None or labels.get("sftctl-job") == job_id:
                out.append({"id": bits[0], "job_id": labels.get("sftctl-job"), "node_id": None, "state": bits[1]})
        return out

    def terminate_tagged(self, job_id: str) -> int:
        found = self.list_instances(job_id)
        if found:
            self.runner.run(["scancel", *[f["id"] for f in found]], check=False)
        return len(found)


def _int(text: str) -> int:
    m = re.match(r"\d+", str(text).strip())
    return int(m.group(0)) if m else 0


def _local_jobs_dir() -> str:
    from sftctl.paths import sftctl_home

    return str(sftctl_home() / "jobs")
