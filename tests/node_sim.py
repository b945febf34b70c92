"""Plays EC2's part for instances on moto's server: runs each instance's user-data on this machine.

moto records instances but boots nothing. :class:`Ec2NodeSimulator` watches moto for sftctl's
instances and, for each one that is running, decodes its user-data (the real bootstrap rendered
from ``sftctl/templates/bootstrap.sh.j2``) and runs it with bash in a directory of its own, with
``SFTCTL_VENV`` pointing at this Python environment (so the bootstrap skips ``pip install``).
When the instance is terminated, its processes are killed, as the cloud would. Everything the
node does reaches the controller through the job's storage, exactly as on a real cloud node.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import boto3


class Ec2NodeSimulator(threading.Thread):
    def __init__(self, root: Path, regions: tuple[str, ...] = ("us-east-1", "us-west-2"), env: dict | None = None):
        super().__init__(daemon=True)
        self.root, self.regions, self.env = root, regions, env or {}
        self.nodes: dict[str, subprocess.Popen] = {}
        self.booted: list[tuple[str, str]] = []  # (region, instance id), in boot order
        self.stop = threading.Event()

    def run(self) -> None:
        clients = {r: boto3.client("ec2", region_name=r) for r in self.regions}
        while not self.stop.wait(0.3):
            live = set()
            for region, ec2 in clients.items():
                pages = ec2.describe_instances(Filters=[
                    {"Name": "tag:sftctl-managed", "Values": ["true"]},
                    {"Name": "instance-state-name", "Values": ["running"]}])
                for res in pages["Reservations"]:
                    for inst in res["Instances"]:
                        iid = inst["InstanceId"]
                        live.add(iid)
                        if iid not in self.nodes:
                            self._boot(ec2, region, iid)
            for iid, proc in list(self.nodes.items()):
                if iid not in live and proc.poll() is None:
                    _killpg(proc)

    def _boot(self, ec2, region: str, iid: str) -> None:
        raw = ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")["UserData"].get("Value", "")
        script = base64.b64decode(raw).decode() if raw else "exit 0"
        node_dir = self.root / iid
        node_dir.mkdir(parents=True)
        (node_dir / "user-data.sh").write_text(script)
        env = {**os.environ, **self.env, "SFTCTL_VENV": sys.prefix, "SFTCTL_NODE_DIR": str(node_dir / "node"),
               "GLOO_SOCKET_IFNAME": "lo", "SFTCTL_NODE_POLL_S": "0.5"}
        with open(node_dir / "console.log", "ab") as log:
            self.nodes[iid] = subprocess.Popen(["bash", str(node_dir / "user-data.sh")], cwd=node_dir, env=env,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.booted.append((region, iid))

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        for proc in self.nodes.values():
            _killpg(proc)


def _killpg(proc: subprocess.Popen) -> None:
    """Kill the node's whole session: the daemon and the attempt it runs (in a session of its own)."""
    from sftctl import procs

    node_ids = set()
    try:
        env = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        node_ids = {e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SFTCTL_NODE_ID=")}
    except OSError:
        pass
    pids = [proc.pid] + [p for nid in node_ids for p in procs.tagged("SFTCTL_NODE_ID", nid)]
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
