"""The local provider: a node is a process group with its own work directory on this machine.

Node directory (``SFTCTL_NODE_DIR``): ``$SFTCTL_HOME/jobs/<job>/nodes/<node id>/``, holding the
files of :mod:`sftctl.protocol` (:class:`~sftctl.protocol.NodeDir`): the attempt's script, the
log of every attempt, the exit code the script writes last, and one metrics file per training
rank (see :mod:`sftctl.train`).

Each node's processes run in a session of their own (so Ctrl-C in the terminal reaches only the
controller), under a guard (:func:`sftctl.procs.guard`) that stops them within seconds once the
controller that launched them is gone, even killed with SIGKILL, and carry ``SFTCTL_JOB_ID`` and ``SFTCTL_NODE_ID`` in their environment: the local equivalent of
cloud tags, which :mod:`sftctl.procs` finds in ``/proc``.

A server's nodes (``SFTCTL_NODE_SANDBOX=bwrap``, which ``sftctl server`` sets) run in a bubblewrap
sandbox inside that guard (:mod:`sftctl.providers.sandbox`): they cannot act as the server. The
controller's every read and write below a node directory follows no symlink a node planted there
and opens regular files only.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

from sftctl import procs, settings
from sftctl.catalog import Offering, local_offering
from sftctl.errors import CapacityError, ProviderError
from sftctl.paths import CONTROLLER_OWNER, job_dir, sftctl_home
from sftctl.protocol import (METRICS_DIR, METRICS_GLOB, NodeDir, complete_json_lines, is_secret_name, parse_exit_code,
                             parse_failure)
from sftctl.providers import sandbox, workdir_roots
from sftctl.providers.base import NodeState, NodeStatus, ProviderEntry
from sftctl.state import Store
from sftctl.storage import open_storage
from sftctl.types import FailureReason, LocalHandle


def machine_size() -> str:
    """This machine's size as a request against it is judged: ``2 CPU cores, 7.6 GiB memory``."""
    cores = os.cpu_count() or 1
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB memory"
    except (ValueError, OSError):
        mem = ""
    return f"{cores} CPU cores{mem}"


class LocalProvider:
    """Nodes as process groups on this machine. Linux only (it reads ``/proc``).

    Args:
        channel: the job's storage channel (:class:`sftctl.storage.stream.NodeChannel`) when
            the job has ``storage``. Then a node works like a cloud node: it runs the node daemon
            (``python -m sftctl.node``), which takes each attempt's script from the storage and
            ships logs, metrics and exit codes back there; the controller reads only the storage.
    """

    name = "local"

    def __init__(self, channel=None, **_: object):
        self.channel = channel
        self._workdirs: dict[str, str | None] = {}  # job id -> its workdir (sandboxed nodes get it back)
        self._owners: dict[str, str | None] = {}  # job id -> its owner when a server's user submitted it

    def check(self) -> None:
        if not sys.platform.startswith("linux") or not Path("/proc/self/environ").exists():
            raise ProviderError("the local provider needs Linux (/proc)")

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """``cpu`` only, up to one worker process per core."""
        if accelerator.lower() != "cpu" or count > (os.cpu_count() or 1):
            return []
        return [local_offering(count)]

    def too_large(self, count: int) -> str | None:
        """Why a node of ``cpu:count`` is more than this machine can be (its size named), else None."""
        cores = os.cpu_count() or 1
        if count <= cores:
            return None
        return f"cpu:{count} is more than this machine has: {machine_size()}; ask for cpu:{cores} at most"

    def never_fits(self, offering: Offering, nodes: int) -> str | None:
        """Why ``nodes`` nodes of ``offering`` can never run on this machine, else None: more
        worker CPUs (nodes x the offering's count) than its cores (``os.cpu_count()``), or more
        nodes than ``$SFTCTL_LOCAL_MAX_NODES`` lends a job. Known at plan time, so a job that
        can never start is refused at submit (exit 3) instead of queueing or starting
        thousands of processes.

        Raises:
            SandboxUnavailable: this machine's nodes must run sandboxed (``SFTCTL_NODE_SANDBOX=bwrap``:
                a server's) and bubblewrap is missing or cannot start (exit 2;
                :func:`sftctl.providers.sandbox.check`).
        """
        sandbox.check()
        cores = os.cpu_count() or 1
        cap = settings.get("SFTCTL_LOCAL_MAX_NODES")
        need = nodes * offering.count
        if need > cores:
            return (f"{nodes} node(s) x {offering.count} CPU need {need} CPUs; this machine has {machine_size()}"
                    + (f" (SFTCTL_LOCAL_MAX_NODES={cap})" if cap is not None else ""))
        if cap is not None and nodes > cap:
            return f"{nodes} node(s) is more than SFTCTL_LOCAL_MAX_NODES={cap} lends a job (this machine has {cores} cores)"
        return None

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering, **_: object) -> LocalHandle:
        """A node directory; ``spot``, ``bootstrap`` and ``image`` mean nothing on this machine.

        ``$SFTCTL_LOCAL_MAX_NODES`` (fault injection for tests and drills, read by the controller's
        process): this machine lends a job at most that many nodes in its lifetime; the next one
        is refused with :class:`CapacityError`, as a cloud out of capacity refuses a replacement.
        """
        cap = settings.get("SFTCTL_LOCAL_MAX_NODES")
        made = job_dir(job_id) / "nodes"
        if cap is not None and made.is_dir() and sum(1 for _ in made.iterdir()) >= cap:
            raise CapacityError(f"local: no capacity for node {node_id} (SFTCTL_LOCAL_MAX_NODES={cap} nodes "
                                f"already made for this job)", provider="local", scope="cloud")
        node_dir = job_dir(job_id) / "nodes" / node_id
        NodeDir(node_dir).metrics.mkdir(parents=True, exist_ok=True)
        return LocalHandle(job_id=job_id, node_id=node_id, rank=rank, dir=str(node_dir), ip="127.0.0.1")

    def launch(self, handle: LocalHandle, script: str, env: dict[str, str], attempt: int) -> LocalHandle:
        """Start ``script`` (attempt ``attempt``) on the node, under its guard, sandboxed when
        ``SFTCTL_NODE_SANDBOX=bwrap`` (:mod:`sftctl.providers.sandbox`: a server's nodes).

        Raises:
            ProviderError: bash or the sandbox cannot start, or a path the sandbox would give
                the node is the server's own (exit 4).
        """
        if self.channel is not None:
            return self._launch_via_storage(handle, script, env, attempt)
        node_dir = Path(handle.dir)
        files = NodeDir(node_dir)
        binds = self._sandbox_binds(handle, env)
        _write_in(node_dir, files.script(attempt).name, script.encode())  # no symlink a node planted is followed
        path = files.script(attempt)
        tags = {"SFTCTL_JOB_ID": handle.job_id, "SFTCTL_NODE_ID": handle.node_id, HOME_TAG: _home_tag()}
        node = {
            **env,
            "SFTCTL_NODE_DIR": str(node_dir),
            "SFTCTL_METRICS_DIR": str(files.metrics),
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            "SFTCTL_PYTHON": sys.executable,
        }
        argv = ["bash", str(path)]
        command = sandbox.Command(argv)
        if binds is None:
            full_env = {**os.environ, **node, **tags}
        else:
            full_env = sandbox.node_environ({**sandbox.loopback_identity(handle.rank), **node},
                                            home=_subdir(node_dir, "home"))
        # local nodes use sftctl's own Python environment: its python and torchrun come first
        full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
        if binds is not None:
            # the guard and bwrap run outside the sandbox, as the server: the job's variables that
            # make the loader or Python run code (LD_PRELOAD, PYTHONPATH...) are set inside only
            full_env, inside = sandbox.outside_environ(full_env)
            command = sandbox.wrap(argv, binds, tags={**inside, **tags}, chdir=node_dir)
        with command, _open_in(node_dir, files.log.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT) as log:
            try:
                proc = subprocess.Popen(
                    _guarded(handle.job_id, handle.node_id, command.argv, isolated=binds is not None,
                             pass_fds=command.pass_fds),
                    pass_fds=command.pass_fds,
                    cwd=node_dir,
                    env=full_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise ProviderError(f"node {handle.rank}: cannot start {argv[0]}: {e}") from None
        return handle.with_(pid=proc.pid, start_ticks=procs.start_ticks(proc.pid), attempt=attempt,
                            exit_file=str(files.exit(attempt)))  # written by templates/node.sh.j2

    def _launch_via_storage(self, handle: LocalHandle, script: str, env: dict[str, str], attempt: int) -> LocalHandle:
        """Write the attempt to the job's storage; start the node daemon if it is not running
        (sandboxed as :meth:`launch` says)."""
        binds = self._sandbox_binds(handle, env)
        if binds is not None:
            env = {**sandbox.loopback_identity(handle.rank), **env}
        self.channel.send_launch(handle.node_id, attempt, script, env)
        if handle.pid and procs.alive(handle.pid, handle.start_ticks):
            return handle.with_(attempt=attempt)
        node_dir = Path(handle.dir)
        daemon_dir = _subdir(node_dir, "daemon")  # the node's own disk: the controller never reads it
        tags = {"SFTCTL_JOB_ID": handle.job_id, "SFTCTL_NODE_ID": handle.node_id, HOME_TAG: _home_tag()}
        node = {
            "SFTCTL_NODE_DIR": str(daemon_dir),
            "SFTCTL_STORAGE_URL": self.channel.storage.url,
            "SFTCTL_PYTHON": sys.executable,
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            # the secrets storage holds by name only (protocol rule 7): this node's daemon has
            # them in its own environment, as a cloud node has them from its instance
            **{k: v for k, v in env.items() if k in self.channel.secret_keys or is_secret_name(k)},
        }
        command = sandbox.Command(procs.module_argv("sftctl.node"))
        if binds is None:
            full_env = {**os.environ, **node, **tags}
        else:
            full_env = sandbox.node_environ(node, home=_subdir(node_dir, "home"))
            full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
            full_env, inside = sandbox.outside_environ(full_env)  # as launch: the guard runs outside
            command = sandbox.wrap(command.argv, binds, tags={**inside, **tags}, chdir=daemon_dir)
        with command, _open_in(node_dir, "daemon.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT) as log:
            proc = subprocess.Popen(_guarded(handle.job_id, handle.node_id, command.argv, isolated=binds is not None,
                                             pass_fds=command.pass_fds),
                                    pass_fds=command.pass_fds, cwd=daemon_dir, env=full_env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return handle.with_(pid=proc.pid, start_ticks=procs.start_ticks(proc.pid), attempt=attempt)

    def _sandbox_binds(self, handle: LocalHandle, env: dict[str, str]) -> sandbox.Binds | None:
        """What the node's sandbox gets back (:class:`sftctl.providers.sandbox.Binds`): its node
        directory, its checkpoint directory when absolute (made), its workdir (the job's record
        in state; a node fed by job storage fetches its own); None when nodes are not sandboxed
        here.

        Raises:
            ProviderError: bwrap cannot start, a path is the server's own, a server's job's
                workdir (resolved now) lies outside its owner's ``server.workdir_roots``
                (:mod:`sftctl.providers.workdir_roots`), or the job's storage is a directory of
                this machine (exit 4).
        """
        if not sandbox.requested():
            return None
        why = sandbox.unavailable()
        if why is not None:
            raise ProviderError(f"local node sandbox: {why}",
                                hint="install bubblewrap (apt-get install bubblewrap), or have an admin set "
                                     "SFTCTL_NODE_SANDBOX=off (unsafe: every user's job then runs as the server)")
        job = handle.job_id
        binds = sandbox.Binds()
        binds.add(handle.dir, job, "node directory")
        checkpoints = settings.raw("SFTCTL_CHECKPOINT_DIR", env)
        if checkpoints and os.path.isabs(checkpoints):
            binds.add(checkpoints, job, "checkpoint directory", create=True)
        replay = settings.raw("SFTCTL_TELEMETRY_REPLAY", env) or settings.raw("SFTCTL_TELEMETRY_REPLAY")
        if replay and os.path.isabs(replay):  # a drill's recorded GPU telemetry (tests)
            binds.add(replay, job, "telemetry replay file", writable=False)
        if self.channel is None:
            workdir = self._workdir(job)
            owner = self._owners.get(job)
            # server.workdir_roots again at launch: a path of the record may have become a link since submit
            problem = workdir_roots.refusal(workdir, owner) if workdir and owner else None
            if problem is not None:
                raise ProviderError(f"local node sandbox: {problem}", hint=workdir_roots.HINT)
            if workdir:
                real = binds.add(workdir, job, "workdir")
                # and on the directory pinned for the bind: a link swapped in since the check above
                problem = workdir_roots.refusal(workdir, owner, resolved=str(real)) if owner else None
                if problem is not None:
                    raise ProviderError(f"local node sandbox: {problem}", hint=workdir_roots.HINT)
            return binds
        # A directory (or pvc://) job storage would be written by the node and read and written by
        # the controller (sftctl.storage.LocalStorage), which follows a symlink a node planted there
        # (its shipped log -> the server's state.db; a launch request's directory -> anywhere):
        # refused until that storage follows no link. A bucket's client follows none; the node
        # reaches it with the job's own credentials (its secrets), never the server's.
        for url in (self.channel.storage.url, settings.raw("SFTCTL_WORKDIR_STORAGE", env)):
            if url and not url.startswith(("s3://", "gs://")) and getattr(open_storage(url), "root", None) is not None:
                raise ProviderError(f"local node sandbox: the job's storage {url} is a directory of this machine, "
                                    f"which a sandboxed node cannot share with the server's controller",
                                    hint="drop storage: from the spec (local nodes share this machine's disk), or "
                                         "use a bucket (s3://, gs://) with your own credentials in secrets:")
        return binds

    def _workdir(self, job_id: str) -> str | None:
        """The job's workdir as its record in state says (absolute; None if no record); its owner
        goes to ``_owners`` when a server's user submitted it (``secrets_from`` ``store``)."""
        if job_id not in self._workdirs:
            store = Store()
            try:
                job = store.get_job(job_id)
            finally:
                store.close()
            self._workdirs[job_id] = (job.spec.get("workdir") if job is not None else None)
            self._owners[job_id] = job.owner if job is not None and job.secrets_from == "store" else None
        return self._workdirs[job_id]

    def status(self, handle: LocalHandle) -> NodeStatus:
        if handle.terminated:
            return NodeStatus(NodeState.TERMINATED)
        if handle.pid is None:
            return NodeStatus(NodeState.READY)
        if self.channel is not None:
            code = self.channel.exit_code(handle.node_id, handle.attempt)
        else:
            code = parse_exit_code(_read_in(Path(handle.dir), Path(handle.exit_file).name, limit=RECORD_MAX_BYTES)) \
                if handle.exit_file else None
        if code is not None:
            state = NodeState.SUCCEEDED if code == 0 else NodeState.FAILED
            return NodeStatus(state, code, f"exit code {code}")
        if procs.alive(handle.pid, handle.start_ticks):
            return NodeStatus(NodeState.RUNNING)
        # The bootstrap wrote no exit code: its process was killed (or the node's dir was removed)
        return NodeStatus(NodeState.LOST, None, f"process {handle.pid} vanished without an exit code")

    def read_log(self, handle: LocalHandle, offset: int) -> tuple[bytes, int]:
        if self.channel is not None:
            return self.channel.read_log(handle.node_id, offset)
        data = _read_in(Path(handle.dir), NodeDir(Path(handle.dir)).log.name, offset, READ_MAX_BYTES)
        if data is None:
            return b"", offset
        return data, offset + len(data)

    def read_metrics(self, handle: LocalHandle, offsets: dict[str, int]) -> list[dict]:
        if self.channel is not None:
            return self.channel.read_metrics(handle.node_id, offsets)
        samples = []
        node_dir = Path(handle.dir)
        for name in _list_in(node_dir, METRICS_DIR, METRICS_GLOB):
            samples += _read_json_lines(node_dir, f"{METRICS_DIR}/{name}", offsets)
        return samples

    def read_health(self, handle: LocalHandle, offsets: dict[str, int]) -> list[dict]:
        if self.channel is not None:
            return self.channel.read_health(handle.node_id, offsets)
        return _read_json_lines(Path(handle.dir), NodeDir(Path(handle.dir)).health.name, offsets)

    def read_failure(self, handle: LocalHandle) -> FailureReason | None:
        if handle.attempt is None:
            return None
        if self.channel is not None:
            return self.channel.read_failure(handle.node_id, handle.attempt)
        raw = _read_in(Path(handle.dir), NodeDir(Path(handle.dir)).failure(handle.attempt).name, limit=RECORD_MAX_BYTES)
        return None if raw is None else parse_failure(raw)

    def stop_attempt(self, handle: LocalHandle) -> None:
        """Stop the node's processes; the node (its directory) stays for the next attempt."""
        self.terminate(handle)

    def terminate(self, handle: LocalHandle) -> None:
        self.terminate_all([handle])

    def terminate_all(self, handles: list[LocalHandle]) -> None:
        """Stop every process of ``handles``' nodes together: one scan of ``/proc`` for the
        nodes' tags and one :func:`sftctl.procs.kill_all` (SIGTERM to all, one grace period,
        SIGKILL to the survivors), so 200 nodes take about as long as one; then a new scan for
        what forked meanwhile (:func:`sftctl.procs.stop_tagged`)."""
        procs.stop_tagged("SFTCTL_NODE_ID", {h.node_id for h in handles},
                          also=[h.pid for h in handles if h.pid and procs.alive(h.pid, h.start_ticks)])

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """One entry per live node process group tagged ``SFTCTL_JOB_ID`` (of ``job_id``) that
        this sftctl home started: another home's jobs (another state, a test) are not ours."""
        homes = procs.tag_values(HOME_TAG)
        jobs = {pid: job for pid, job in procs.tag_values("SFTCTL_JOB_ID").items()
                if homes.get(pid) == _home_tag()}
        nodes = procs.tag_values("SFTCTL_NODE_ID")
        out: dict[tuple, dict] = {}
        for pid, job in jobs.items():
            if job_id is None or job == job_id:
                key = (job, nodes.get(pid))
                out.setdefault(key, {"id": str(pid), "job_id": job, "node_id": nodes.get(pid), "pids": []})
                out[key]["pids"].append(pid)
        return list(out.values())

    def terminate_tagged(self, job_id: str) -> int:
        """Stop every process of ``job_id`` this home started, sweeping until a scan finds none
        (a process forked during a sweep is in no list: see :func:`sftctl.procs.stop_tagged`).
        Returns how many pids were signalled."""
        done = 0
        for sweep in range(20):
            pids = [pid for r in self.list_instances(job_id) for pid in r["pids"]]
            if not pids:
                break
            procs.kill_all(pids, grace_s=10.0 if sweep == 0 else 1.0)
            done += len(pids)
        return done


def _guarded(job_id: str, node_id: str, argv: list[str], isolated: bool = False,
             pass_fds: tuple[int, ...] = ()) -> list[str]:
    """``argv`` under :func:`sftctl.procs.guard`, watching this process: the controller (the
    attached ``sftctl run`` or a detached ``python -m sftctl.controller``) that launches the node,
    then whichever controller adopts the job (its ``controller.json``). A controller killed even
    with SIGKILL thus takes its local nodes with it within seconds, or after
    ``SFTCTL_LOCAL_ADOPT_GRACE_S`` when no new controller took the job over by then.
    ``isolated``: ``python -I`` (a sandboxed node's: its environment and ``HOME`` are the job's).
    ``pass_fds``: the descriptors ``argv`` needs (bwrap's options and its binds'), which the
    guard inherits and passes on."""
    me = os.getpid()
    ticks = procs.start_ticks(me)
    grace = settings.get("SFTCTL_LOCAL_ADOPT_GRACE_S") or 0.0
    return procs.module_argv("sftctl.procs", "guard", str(me), "-" if ticks is None else str(ticks),
                             node_id, "--owner", str(job_dir(job_id) / CONTROLLER_OWNER), "--grace", f"{grace:g}",
                             *(a for fd in pass_fds for a in ("--pass-fd", str(fd))), "--", *argv, isolated=isolated)


#: Every local node process carries the sftctl home that started it, so ``sftctl down
#: --orphans`` under one ``$SFTCTL_HOME`` never sweeps another's jobs.
HOME_TAG = "SFTCTL_NODE_HOME"


def _home_tag() -> str:
    return str(sftctl_home().resolve())


def _read_json_lines(node_dir: Path, name: str, offsets: dict[str, int]) -> list[dict]:
    """Complete JSON lines of ``node_dir/name`` after ``offsets[that path]`` (advanced past them),
    at most :data:`READ_MAX_BYTES` of them per call; a line longer than that is skipped."""
    key = str(node_dir / name)
    data = _read_in(node_dir, name, offsets.get(key, 0), READ_MAX_BYTES)
    if data is not None and len(data) == READ_MAX_BYTES and b"\n" not in data:
        offsets[key] = offsets.get(key, 0) + len(data)  # no record is this long: past it, not read again
        return []
    return [] if data is None else complete_json_lines(key, data, offsets)


# A node's processes write in its directory (a sandboxed node there only), so they could plant
# a symlink (node.log -> the server's state.db, a next attempt's script -> a file the server
# runs) or a FIFO (a reader that never returns) where the controller reads or writes. Every
# access below the node directory goes through these: no symlink followed below it (each
# component opened with O_NOFOLLOW relative to its parent), regular files only.

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _fd_in(node_dir: Path, rel: str, flags: int, mode: int = 0o600) -> int:
    """A file descriptor of ``node_dir/rel``, following no symlink below ``node_dir``; a
    regular file only.

    Raises:
        OSError: missing, a symlink (ELOOP), not a regular file, or unreadable.
    """
    parts = rel.split("/")
    fd = os.open(node_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        out = os.open(parts[-1], flags | _NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(errno.EINVAL, f"{node_dir / rel} is not a regular file")
    os.set_blocking(out, True)
    return out


def _open_in(node_dir: Path, name: str, flags: int):
    """``node_dir/name`` opened with ``flags`` (``O_CREAT`` among them) as a binary file object
    (see :func:`_fd_in`); a symlink or other non-file a node left at that name is removed and
    the file made anew.

    Raises:
        ProviderError: it cannot be opened (exit 4).
    """
    try:
        try:
            fd = _fd_in(node_dir, name, flags)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.EISDIR):
                raise
            os.unlink(node_dir / name)  # the name itself, never what a symlink points at
            fd = _fd_in(node_dir, name, flags)
        return os.fdopen(fd, "ab" if flags & os.O_APPEND else "rb")
    except OSError as e:
        raise ProviderError(f"local: cannot open {node_dir / name}: {e.strerror or e}") from None


#: the most bytes the controller (or the server, reading logs) takes from one node file per read:
#: a node writes these files, and one grown to gigabytes (a sparse ``truncate -s 20G node.log``
#: costs the node no disk) read whole took the controller's and the server's memory (the server
#: was OOM-killed serving the logs of a 1 GiB one); the rest is read by the next reads
READ_MAX_BYTES = 16 << 20
#: the most bytes of a node's exit code or failure record read (both a few hundred bytes)
RECORD_MAX_BYTES = 1 << 20


def _read_in(node_dir: Path, name: str, offset: int = 0, limit: int | None = None) -> bytes | None:
    """The bytes of ``node_dir/name`` from ``offset`` (at most ``limit``); None when it is
    missing, a symlink or not a regular file (see :func:`_fd_in`)."""
    try:
        fd = _fd_in(node_dir, name, os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        return f.read() if limit is None else f.read(limit)


def _list_in(node_dir: Path, sub: str, pattern: str) -> list[str]:
    """Sorted names matching ``pattern`` in the directory ``node_dir/sub`` (not a symlink)."""
    import fnmatch

    try:
        dfd = os.open(node_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError:
        return []
    try:
        return sorted(n for n in os.listdir(fd) if fnmatch.fnmatch(n, pattern))
    finally:
        os.close(fd)


def _write_in(node_dir: Path, name: str, data: bytes) -> None:
    """Write ``node_dir/name`` anew (0700: a script): whatever a node left at that name (a
    symlink) is removed first, never written through.

    Raises:
        ProviderError: it cannot be written (exit 4).
    """
    try:
        dfd = os.open(node_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o700, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        raise ProviderError(f"local: cannot write {node_dir / name}: {e.strerror or e}") from None


def _subdir(node_dir: Path, name: str) -> Path:
    """``node_dir/name``, a directory (made; a symlink or file a node left there is replaced)."""
    path = node_dir / name
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    path.mkdir(exist_ok=True)
    return path


#: This machine: no SDK, always configured (``check`` says whether it can run nodes).
PROVIDER = ProviderEntry("local", "LocalProvider")
