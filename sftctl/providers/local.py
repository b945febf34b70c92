"""The local provider: a node is a process group with its own work directory on this machine.

Node directory (``SFTCTL_NODE_DIR``): ``$SFTCTL_HOME/jobs/<job>/nodes/<node id>/``, holding the
files of :mod:`sftctl.protocol` (:class:`~sftctl.protocol.NodeDir`): the attempt's script, the
log of every attempt, the exit code the script writes last, and one metrics file per training
rank (see :mod:`sftctl.train`).

Each node's processes run in a session of their own (so Ctrl-C in the terminal reaches only the
controller), under a guard (:func:`sftctl.procs.guard`) that stops them within seconds once the
controller that launched them is gone, even killed with SIGKILL, and carry ``SFTCTL_JOB_ID`` and ``SFTCTL_NODE_ID`` in their environment: the local equivalent of
cloud tags, which :mod:`sftctl.procs` finds in ``/proc``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sftctl import procs, settings
from sftctl.catalog import Offering, local_offering
from sftctl.errors import CapacityError, ProviderError
from sftctl.paths import CONTROLLER_OWNER, job_dir, sftctl_home
from sftctl.protocol import METRICS_GLOB, NodeDir, complete_json_lines, is_secret_name, parse_failure, read_exit_file
from sftctl.providers.base import NodeState, NodeStatus
from sftctl.types import FailureReason, LocalHandle


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

    def check(self) -> None:
        if not sys.platform.startswith("linux") or not Path("/proc/self/environ").exists():
            raise ProviderError("the local provider needs Linux (/proc)")

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """``cpu`` only, up to one worker process per core."""
        if accelerator.lower() != "cpu" or count > (os.cpu_count() or 1):
            return []
        return [local_offering(count)]

    def never_fits(self, offering: Offering, nodes: int) -> str | None:
        """Why ``nodes`` nodes of ``offering`` can never run on this machine, else None: more
        worker CPUs (nodes x the offering's count) than its cores (``os.cpu_count()``), or more
        nodes than ``$SFTCTL_LOCAL_MAX_NODES`` lends a job. Known at plan time, so a job that
        can never start is refused at submit (exit 3) instead of queueing or starting
        thousands of processes."""
        cores = os.cpu_count() or 1
        cap = settings.get("SFTCTL_LOCAL_MAX_NODES")
        need = nodes * offering.count
        if need > cores:
            return (f"{nodes} node(s) x {offering.count} CPU need {need} CPUs; this machine has {cores} cores"
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
        if self.channel is not None:
            return self._launch_via_storage(handle, script, env, attempt)
        node_dir = Path(handle.dir)
        files = NodeDir(node_dir)
        path = files.script(attempt)
        path.write_text(script)
        full_env = {
            **os.environ,
            **env,
            "SFTCTL_JOB_ID": handle.job_id,
            "SFTCTL_NODE_ID": handle.node_id,
            HOME_TAG: _home_tag(),
            "SFTCTL_NODE_DIR": str(node_dir),
            "SFTCTL_METRICS_DIR": str(files.metrics),
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
        }
        # local nodes use sftctl's own Python environment: its python and torchrun come first
        full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
        full_env["SFTCTL_PYTHON"] = sys.executable
        with open(files.log, "ab") as log:
            try:
                proc = subprocess.Popen(
                    _guarded(handle.job_id, handle.node_id, ["bash", str(path)]),
                    cwd=node_dir,
                    env=full_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise ProviderError(f"node {handle.rank}: cannot start bash: {e}") from None
        return handle.with_(pid=proc.pid, start_ticks=procs.start_ticks(proc.pid), attempt=attempt,
                            exit_file=str(files.exit(attempt)))  # written by templates/node.sh.j2

    def _launch_via_storage(self, handle: LocalHandle, script: str, env: dict[str, str], attempt: int) -> LocalHandle:
        """Write the attempt to the job's storage; start the node daemon if it is not running."""
        self.channel.send_launch(handle.node_id, attempt, script, env)
        if handle.pid and procs.alive(handle.pid, handle.start_ticks):
            return handle.with_(attempt=attempt)
        daemon_dir = Path(handle.dir) / "daemon"  # the node's own disk: the controller never reads it
        daemon_dir.mkdir(parents=True, exist_ok=True)
        full_env = {
            **os.environ,
            "SFTCTL_JOB_ID": handle.job_id,
            "SFTCTL_NODE_ID": handle.node_id,
            HOME_TAG: _home_tag(),
            "SFTCTL_NODE_DIR": str(daemon_dir),
            "SFTCTL_STORAGE_URL": self.channel.storage.url,
            "SFTCTL_PYTHON": sys.executable,
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            # the secrets storage holds by name only (protocol rule 7): this node's daemon has
            # them in its own environment, as a cloud node has them from its instance
            **{k: v for k, v in env.items() if k in self.channel.secret_keys or is_secret_name(k)},
        }
        with open(Path(handle.dir) / "daemon.log", "ab") as log:
            proc = subprocess.Popen(_guarded(handle.job_id, handle.node_id, procs.module_argv("sftctl.node")), cwd=daemon_dir, env=full_env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return handle.with_(pid=proc.pid, start_ticks=procs.start_ticks(proc.pid), attempt=attempt)

    def status(self, handle: LocalHandle) -> NodeStatus:
        if handle.terminated:
            return NodeStatus(NodeState.TERMINATED)
        if handle.pid is None:
            return NodeStatus(NodeState.READY)
        if self.channel is not None:
            code = self.channel.exit_code(handle.node_id, handle.attempt)
        else:
            code = read_exit_file(handle.exit_file) if handle.exit_file else None
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
        try:
            with open(NodeDir(Path(handle.dir)).log, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return b"", offset
        return data, offset + len(data)

    def read_metrics(self, handle: LocalHandle, offsets: dict[str, int]) -> list[dict]:
        if self.channel is not None:
            return self.channel.read_metrics(handle.node_id, offsets)
        samples = []
        for path in sorted(NodeDir(Path(handle.dir)).metrics.glob(METRICS_GLOB)):
            samples += _read_json_lines(path, offsets)
        return samples

    def read_health(self, handle: LocalHandle, offsets: dict[str, int]) -> list[dict]:
        if self.channel is not None:
            return self.channel.read_health(handle.node_id, offsets)
        return _read_json_lines(NodeDir(Path(handle.dir)).health, offsets)

    def read_failure(self, handle: LocalHandle) -> FailureReason | None:
        if handle.attempt is None:
            return None
        if self.channel is not None:
            return self.channel.read_failure(handle.node_id, handle.attempt)
        try:
            return parse_failure(Path(NodeDir(Path(handle.dir)).failure(handle.attempt)).read_bytes())
        except OSError:
            return None

    def stop_attempt(self, handle: LocalHandle) -> None:
        """Stop the node's processes; the node (its directory) stays for the next attempt."""
        self.terminate(handle)

    def quarantine(self, handle: LocalHandle, reason: str) -> dict | None:
        """Nothing to do: every local node is this machine."""
        return None

    def terminate(self, handle: LocalHandle) -> None:
        self.terminate_all([handle])

    def terminate_all(self, handles: list[LocalHandle]) -> None:
        """Stop every process of ``handles``' nodes in one sweep: one scan of ``/proc`` for the
        nodes' tags and one :func:`sftctl.procs.kill_all` (SIGTERM to all, one grace period,
        SIGKILL to the survivors), so 200 nodes take about as long as one."""
        ids = {h.node_id for h in handles}
        pids = {pid for pid, node in procs.tag_values("SFTCTL_NODE_ID").items() if node in ids}
        pids |= {h.pid for h in handles if h.pid and procs.alive(h.pid, h.start_ticks)}
        procs.kill_all(sorted(pids))

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
        pids = [pid for r in self.list_instances(job_id) for pid in r["pids"]]
        procs.kill_all(pids)
        return len(pids)


def _guarded(job_id: str, node_id: str, argv: list[str]) -> list[str]:
    """``argv`` under :func:`sftctl.procs.guard`, watching this process: the controller (the
    attached ``sftctl run`` or a detached ``python -m sftctl.controller``) that launches the node,
    then whichever controller adopts the job (its ``controller.json``). A controller killed even
    with SIGKILL thus takes its local nodes with it within seconds, or after
    ``SFTCTL_LOCAL_ADOPT_GRACE_S`` when no new controller took the job over by then."""
    me = os.getpid()
    ticks = procs.start_ticks(me)
    return procs.module_argv("sftctl.procs", "guard", str(me), "-" if ticks is None else str(ticks),
                             node_id, "--owner", str(job_dir(job_id) / CONTROLLER_OWNER), "--", *argv)


#: Every local node process carries the sftctl home that started it, so ``sftctl down
#: --orphans`` under one ``$SFTCTL_HOME`` never sweeps another's jobs.
HOME_TAG = "SFTCTL_NODE_HOME"


def _home_tag() -> str:
    return str(sftctl_home().resolve())


def _read_json_lines(path: Path, offsets: dict[str, int]) -> list[dict]:
    """Complete JSON lines of ``path`` after ``offsets[path]`` (advanced past them)."""
    key = str(path)
    try:
        with open(path, "rb") as f:
            f.seek(offsets.get(key, 0))
            data = f.read()
    except FileNotFoundError:
        return []
    return complete_json_lines(key, data, offsets)
