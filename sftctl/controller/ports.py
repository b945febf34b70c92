"""The rendezvous-port allocator: two adjacent TCP ports per job, claimed machine-wide (every
sftctl home of this user) below the kernel's ephemeral range and released when the job's nodes
are gone: ``MASTER_PORT`` (the claimed port: plain scripts' ``env://`` rendezvous, the preflight)
and the next one (``SFTCTL_RDZV_ENDPOINT``, submit.store_port: torchrun's c10d store, hosted by
node 0's wrapper, sftctl/train/rendezvous.py). Two ports, because node 0's wrapper holds the
store for the whole run while a plain script's rank 0 binds ``MASTER_PORT``."""

from __future__ import annotations

import os
import socket

from sftctl import procs
from sftctl.errors import SftctlError


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (where port-0 binds and outgoing connections land)."""
    try:
        lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


RDZV_PORTS = 2000  # how many ports below the ephemeral range rendezvous ports come from


def _ports_dir() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"sftctl-rdzv-ports-{os.getuid()}")


def claim_rendezvous_port(job_id: str) -> int:
    """A pair of TCP ports for the job's rendezvous, held until :func:`release_rendezvous_port`:
    the returned port (``MASTER_PORT``) and the next one (torchrun's c10d store).

    Binding port 0 and releasing it raced: the kernel may hand the same ephemeral port to any
    other process before torchrun binds it (a run failed with EADDRINUSE). Instead the port
    comes from the ``RDZV_PORTS`` ports just below the kernel's ephemeral range, which the
    kernel never hands out by itself, and is claimed machine-wide (every sftctl home of this
    user) by a file ``<tmp>/sftctl-rdzv-ports-<uid>/<port>`` naming the claiming controller; a
    claim whose controller is gone is taken over. Pairs start at an even offset from the range's
    first port, so two claims never overlap; a pair of which something already listens on
    either port is skipped.

    Raises:
        SftctlError: every port of the range is claimed or in use.
    """
    from filelock import FileLock

    lo, _ = _ephemeral_range()
    first = max(1024, lo - RDZV_PORTS)
    pairs = (lo - first) // 2
    d = _ports_dir()
    os.makedirs(d, mode=0o700, exist_ok=True)
    me = f"{os.getpid()} {procs.start_ticks(os.getpid())} {job_id}"
    start = int.from_bytes(job_id.encode()[-4:].rjust(4, b"\0"), "big") % pairs
    with FileLock(os.path.join(d, ".lock")):
        for i in range(pairs):
            port = first + 2 * ((start + i) % pairs)
            path = os.path.join(d, str(port))
            try:
                pid, ticks, _job = open(path).read().split(" ", 2)
                if procs.alive(int(pid), int(ticks) if ticks.isdigit() else None):
                    continue  # held by a live controller
            except (OSError, ValueError):
                pass
            if not (_bindable(port) and _bindable(port + 1)):
                continue
            with open(path, "w") as f:
                f.write(me)
            return port
    raise SftctlError(f"no free pair of rendezvous ports in {first}-{lo - 1}", hint="end finished jobs' controllers, or retry")


def reclaim_rendezvous_port(job_id: str) -> int | None:
    """Take over the port a dead controller of ``job_id`` claimed (its nodes may still use it):
    the claim is rewritten to name this process. None when no claim of the job is left, or its
    claimant still lives (the caller then claims a new port at its next launch)."""
    from filelock import FileLock

    d = _ports_dir()
    if not os.path.isdir(d):
        return None
    me = f"{os.getpid()} {procs.start_ticks(os.getpid())} {job_id}"
    with FileLock(os.path.join(d, ".lock")):
        for name in sorted(os.listdir(d)):
            if not name.isdigit():
                continue
            path = os.path.join(d, name)
            try:
                pid, ticks, job = open(path).read().split(" ", 2)
            except (OSError, ValueError):
                continue
            if job != job_id or procs.alive(int(pid), int(ticks) if ticks.isdigit() else None):
                continue
            with open(path, "w") as f:
                f.write(me)
            return int(name)
    return None


def release_rendezvous_port(port: int | None) -> None:
    """Give up a port claimed by this process (a no-op for a port it does not hold)."""
    if port is None:
        return
    path = os.path.join(_ports_dir(), str(port))
    try:
        if open(path).read().split(" ", 1)[0] == str(os.getpid()):
            os.unlink(path)
    except OSError:
        pass


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the TCPStore binds it
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False
