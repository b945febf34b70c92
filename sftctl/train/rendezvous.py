"""The job's rendezvous store on node 0, hosted by the node wrapper (``templates/node.sh.j2``)
rather than by node 0's ``torchrun``: ``python -m sftctl.train.rendezvous``.

Why: with ``--rdzv-backend=c10d`` and ``is_host=1`` on node 0, node 0's torchrun agent hosts the
c10d store and takes it down when it exits; the other nodes' agents still talk to it in their
rendezvous shutdown (``DynamicRendezvousHandler.shutdown`` -> ``compareSet``), so at the end of
every successful multi-node run they printed ``recvVector failed``, a C++ stack trace and "has
failed to shutdown the rendezvous" (pytorch/pytorch#69197, #107021). Hosting the store in a
process of node 0's wrapper that outlives its torchrun, with ``is_host=0`` on every node (the
fix torchrun users apply: an external store), ends such a run without a traceback. Every attempt
gets a fresh store (the wrapper starts one per attempt), so node replacement and resume are
unchanged.

The wrapper's protocol (node 0 of a job of more than one node):

1. This module binds a ``torch.distributed.TCPStore`` server on the port of
   ``SFTCTL_RDZV_ENDPOINT`` (all interfaces; retried for :data:`BIND_RETRY_S` while a stopped
   attempt's store lets the port go) and prints ``ready`` on stdout. The wrapper then exports
   ``SFTCTL_RDZV_IS_HOST=0`` and ``PET_RDZV_CONF=is_host=0`` for node 0's run.
   When it cannot (no torch in ``$SFTCTL_PYTHON``, an endpoint without a port, the endpoint's
   port is ``MASTER_PORT``, which plain scripts and the preflight bind, or the port stays taken)
   it prints one line on stderr and exits 1: torchrun on node 0 then hosts the store as before.
2. ``SIGUSR1`` (node 0's run exited 0: every agent passed torchrun's exit barrier): it lingers
   until no connection to the port is left ESTABLISHED but its own (read from ``/proc/net/tcp``
   and ``tcp6``: every node's agent has shut the rendezvous down and exited), at most
   :data:`LINGER_S`, then exits 0.
3. ``SIGTERM``/``SIGINT`` (node 0's run failed, or the node is stopped), or its parent (the
   wrapper) gone: it exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

#: seconds to retry binding the port while a stopped attempt's store still holds it
BIND_RETRY_S = 30.0
#: at most this many seconds after node 0's run ended 0 for the other nodes' agents to leave;
#: they leave within a second or two of node 0 (they passed the same exit barrier)
LINGER_S = 60.0
#: seconds between two looks at the port's connections
POLL_S = 0.25
_ESTABLISHED = "01"  # /proc/net/tcp's st column (include/net/tcp_states.h: TCP_ESTABLISHED = 1)


def endpoint_port(endpoint: str) -> int | None:
    """The port of ``host:port`` (``[v6]:port`` too); None without a valid one (1..65535)."""
    _, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return int(port)


def _sockets(paths: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> list[tuple[str, int, str, int, str, str]]:
    """Every TCP socket of this network namespace: (local address, local port, remote address,
    remote port, state, inode), addresses as the kernel's hex."""
    out = []
    for path in paths:
        try:
            with open(path) as f:
                next(f, None)  # the header
                for line in f:
                    parts = line.split()
                    if len(parts) < 10:
                        continue
                    local, remote, state, inode = parts[1], parts[2], parts[3], parts[9]
                    la, _, lp = local.rpartition(":")
                    ra, _, rp = remote.rpartition(":")
                    out.append((la, int(lp, 16), ra, int(rp, 16), state, inode))
        except OSError:
            continue
    return out


def _socket_inodes(pid: int | str = "self") -> set[str]:
    """The socket inodes process ``pid`` (default: this one) holds open."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def peers(port: int, pid: int | str = "self") -> int:
    """How many connections to the store on ``port`` (served by process ``pid``, default this
    one) are ESTABLISHED, leaving out the store's own client (a TCPStore server also connects to
    itself): the nodes' torchrun agents and workers still connected."""
    sockets = _sockets()
    mine = _socket_inodes(pid)
    own_clients = {(la, lp) for la, lp, _ra, rp, st, inode in sockets
                   if rp == port and lp != port and inode in mine}
    return sum(1 for _la, lp, ra, rp, st, _inode in sockets
               if lp == port and st == _ESTABLISHED and (ra, rp) not in own_clients)


def _say(line: str) -> None:
    print(f"[sftctl] node 0: rendezvous store: {line}", file=sys.stderr, flush=True)


def _bind(port: int):
    """A TCPStore server on ``port``, retried for :data:`BIND_RETRY_S`; None when it stays taken."""
    from datetime import timedelta

    import torch.distributed as dist

    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=60))
        except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
            if time.monotonic() > deadline:
                _say(f"cannot listen on port {port} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                     f"torchrun on node 0 hosts it")
                return None
            time.sleep(1.0)


def main() -> int:
    """Host the store (see the module docstring); the exit status: 0 served, 1 not hosted."""
    from sftctl import settings

    endpoint = settings.raw("SFTCTL_RDZV_ENDPOINT") or ""
    port = endpoint_port(endpoint)
    if port is None:
        _say(f"SFTCTL_RDZV_ENDPOINT={endpoint!r} names no port; torchrun on node 0 hosts it")
        return 1
    if os.environ.get("MASTER_PORT", "").strip() == str(port):
        _say(f"port {port} is MASTER_PORT too (scripts and the preflight bind it); torchrun on node 0 hosts it")
        return 1
    try:
        import torch.distributed  # noqa: F401
    except ImportError as e:
        _say(f"no torch.distributed in {sys.executable} ({e}); torchrun on node 0 hosts it")
        return 1
    linger, stop = threading.Event(), threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: linger.set())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()
    store = _bind(port)
    if store is None:
        return 1
    print("ready", flush=True)
    while not (linger.is_set() or stop.is_set()) and os.getppid() == parent:
        linger.wait(POLL_S)
    if linger.is_set() and not stop.is_set():
        deadline = time.monotonic() + LINGER_S
        quiet = 0  # consecutive looks with no peer
        while quiet < 2 and time.monotonic() < deadline and not stop.is_set() and os.getppid() == parent:
            quiet = quiet + 1 if peers(port) == 0 else 0
            stop.wait(POLL_S)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter finalization racing the store's server thread
