"""Process facts from ``/proc`` (Linux): start times, liveness, and processes tagged by env var.

A pid can be reused after its process exits, so liveness checks compare the process start time
(``/proc/<pid>/stat`` field 22, in clock ticks since boot) with the one recorded at launch. Nodes
of the local provider are tagged with ``SFTCTL_JOB_ID`` and ``SFTCTL_NODE_ID`` in their
environment, which every child inherits: that is how ``sftctl down`` finds all of a job's
processes even when the state lost track of them (a controller killed mid-launch).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from sftctl import settings

_PROC = Path("/proc")

#: ``python -c`` code that runs sftctl module ``{module}`` as ``python -m`` would, but with no
#: working directory on ``sys.path``: ``-m`` and ``-c`` put the caller's cwd first there, so a
#: directory holding an ``sftctl/`` package (a checkout, a workdir) would run its code as
#: sftctl. ``python -P`` does the same from 3.11 on; this works on every Python sftctl supports.
SAFE_MODULE_CODE = ('import sys, runpy; sys.path[:1] = [] if sys.path[:1] == [""] else sys.path[:1]; '
                    'runpy.run_module("{module}", run_name="__main__", alter_sys=True)')


def module_argv(module: str, *args: str, python: str | None = None, isolated: bool = False) -> list[str]:
    """The argv that runs sftctl's own ``module`` (``sftctl.controller``) with ``args`` under
    ``python`` (default: this interpreter), never importing code from the working directory
    (see :data:`SAFE_MODULE_CODE`). Every place sftctl starts one of its modules uses it (node
    scripts through the templates' ``py_module`` global). ``isolated``: ``python -I``, which
    reads no ``PYTHON*`` variable and no user site-packages (a sandboxed node's guard: its
    environment and ``HOME`` are the job's)."""
    if not module.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"not a module name: {module!r}")
    return [python or sys.executable, *(["-I"] if isolated else []), "-c", SAFE_MODULE_CODE.format(module=module), *args]


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
        # the command name (field 2) may contain spaces and parentheses: split after the last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":  # a zombie has exited; only its parent has not reaped it
            return None
        return int(fields[19])
    except (OSError, ValueError, IndexError):  # gone, or gone mid-read (an empty or cut-off stat)
        return None


def alive(pid: int | None, ticks: int | None = None) -> bool:
    """True if ``pid`` runs and, when ``ticks`` is given, is the same process that started then."""
    if not pid:
        return False
    now = start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


def tagged(key: str, value: str) -> list[int]:
    """Pids of this user's processes whose environment has ``key=value``."""
    return [pid for pid, v in tag_values(key).items() if v == value]


def tag_values(key: str) -> dict[int, str]:
    """Every readable process (but this one) whose environment has ``key``, mapped to its value."""
    prefix = f"{key}=".encode()
    me = os.getpid()
    out = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item.startswith(prefix):
                out[int(entry.name)] = item[len(prefix):].decode("utf-8", "replace")
                break
    return out


def kill_all(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM ``pids``, wait up to ``grace_s`` seconds, then SIGKILL the survivors.

    All of them are stopped (SIGSTOP) before the first SIGTERM and continued after the last:
    none acts on another's death meanwhile. Signalled one by one, a node's script (bash) saw its
    preflight or run child killed before its own SIGTERM came, and went on to its next command
    (node.sh runs the training after a preflight that did not complete) in a child no one
    signalled: a stopped attempt wrote its training's output after all. This process is never
    stopped, if listed.

    Returns the pids that were still alive when SIGKILL was sent.
    """
    ticks = {pid: start_ticks(pid) for pid in pids}
    live = [p for p in pids if ticks[p] is not None]
    me = os.getpid()
    try:
        for pid in live:
            if pid != me:
                _signal(pid, signal.SIGSTOP)
        for pid in live:
            _signal(pid, signal.SIGTERM)
    finally:  # never left stopped, even by a Ctrl-C here
        for pid in live:
            _signal(pid, signal.SIGCONT)  # a stopped process handles SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = [p for p in live if alive(p, ticks[p])]
    for pid in live:
        _signal(pid, signal.SIGKILL)
    for _ in range(100):  # SIGKILL is not instant; wait until the kernel has reaped them
        if not any(alive(p, ticks[p]) for p in live):
            break
        time.sleep(0.02)
    return live


def stop_tagged(key: str, values: set[str], also: Iterable[int] = (), grace_s: float = 10.0,
                rounds: int = 20) -> int:
    """Stop every process whose environment has ``key`` set to one of ``values`` (and the pids
    ``also``) with :func:`kill_all`, then scan ``/proc`` again and stop what is still tagged,
    until a scan finds none (at most ``rounds`` sweeps; later sweeps wait at most 1 s).

    One sweep is not enough: a process forked after the scan and before its parent's SIGSTOP
    is in no list and never signalled (a node's script starting the job's command as its guard
    stopped it: the command ran on with nobody watching). Returns how many pids were signalled.
    """
    pids = {pid for pid, v in tag_values(key).items() if v in values} | set(also)
    done = 0
    for sweep in range(rounds):
        if not pids:
            break
        kill_all(sorted(pids), grace_s=grace_s if sweep == 0 else min(grace_s, 1.0))
        done += len(pids)
        pids = {pid for pid, v in tag_values(key).items() if v in values}
    return done


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


#: How often a node's guard looks at its controller (seconds): a local node outlives a killed
#: controller by about this long plus ``kill_all``'s grace (plus ``SFTCTL_LOCAL_ADOPT_GRACE_S``).
GUARD_POLL_S = 1.0


def guard(controller_pid: int, controller_ticks: int | None, node_id: str, argv: list[str],
          owner: str | None = None, grace_s: float = 0.0, pass_fds: tuple[int, ...] = ()) -> int:
    """Run ``argv`` and stop it, with every process tagged ``SFTCTL_NODE_ID=node_id``, once the
    controller ``controller_pid`` (started at ``controller_ticks``) is gone.

    A local node (:mod:`sftctl.providers.local`) runs under this guard: its processes live in a
    session of their own, so a controller killed with SIGKILL would otherwise leave them training
    with nobody watching. Cloud and Slurm nodes are tagged instead, and ``sftctl down`` finds them.
    ``owner``: the job's controller record (``controller.json``, :data:`sftctl.paths.CONTROLLER_OWNER`);
    a live controller recorded there on this host (one that adopted the job after its first
    died) is watched from then on. ``grace_s``: how long the node outlives its controller
    waiting for such a successor (``SFTCTL_LOCAL_ADOPT_GRACE_S``; 0: stopped within seconds).
    ``pass_fds``: descriptors this process inherited for ``argv`` (bwrap's options,
    :class:`sftctl.providers.sandbox.Command`): passed on, then closed here.
    Returns ``argv``'s exit code (128 + N when signal N ended it).
    """
    import subprocess

    try:
        child = subprocess.Popen(argv, pass_fds=pass_fds)
    finally:
        for fd in pass_fds:
            os.close(fd)
    gone_since: float | None = None
    while True:
        try:
            code = child.wait(timeout=GUARD_POLL_S)
        except subprocess.TimeoutExpired:
            try:
                if alive(controller_pid, controller_ticks):
                    continue
                successor = _successor(owner, controller_pid)
                if successor is not None:  # a new controller adopted the job: watch it instead
                    controller_pid, controller_ticks = successor
                    gone_since = None
                    continue
                gone_since = time.monotonic() if gone_since is None else gone_since
                if time.monotonic() - gone_since < grace_s:
                    continue
                sys.stderr.write(f"sftctl guard: controller {controller_pid} is gone; stopping node {node_id}\n")
                stop_tagged("SFTCTL_NODE_ID", {node_id}, also=[child.pid], grace_s=5.0)
                code = child.wait()
            except Exception as exc:  # noqa: BLE001 - a guard that dies leaves its node unwatched: retry
                sys.stderr.write(f"sftctl guard: {type(exc).__name__}: {exc}; trying again\n")
                continue
        return code if code >= 0 else 128 - code


def _successor(owner: str | None, old_pid: int) -> tuple[int, int | None] | None:
    """``(pid, start ticks)`` of the live controller ``owner`` records on this host, if it is
    not ``old_pid``; else None."""
    import json
    import socket

    if not owner:
        return None
    try:
        rec = json.loads(Path(owner).read_text())
        pid, ticks, host = int(rec["pid"]), rec.get("start_ticks"), rec.get("host")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid == old_pid or host != socket.gethostname() or not alive(pid, ticks):
        return None
    return pid, ticks


def main(argv: list[str] | None = None) -> int:
    """``python -m sftctl.procs guard PID TICKS NODE_ID [--owner FILE] [--grace S] [--pass-fd FD]
    -- COMMAND...`` (see :func:`guard`; without ``--grace`` the grace comes from
    ``SFTCTL_LOCAL_ADOPT_GRACE_S`` in its environment: a sandboxed node's guard has the node's
    scrubbed environment, so the local provider passes it; ``--pass-fd``: an inherited
    descriptor COMMAND needs, repeated for each)."""
    args = list(sys.argv[1:] if argv is None else argv)
    options: dict[str, str] = {}
    fds: list[int] = []  # --pass-fd may repeat: bwrap's options and each bind's descriptor
    while len(args) > 5 and args[4] in ("--owner", "--grace", "--pass-fd"):
        if args[4] == "--pass-fd":
            fds.append(int(args[5]))
        else:
            options[args[4]] = args[5]
        del args[4:6]
    if len(args) < 6 or args[0] != "guard" or args[4] != "--":
        sys.stderr.write("usage: python -m sftctl.procs guard PID TICKS NODE_ID [--owner FILE] [--grace S] "
                         "[--pass-fd FD] -- COMMAND...\n")
        return 2
    ticks = None if args[2] == "-" else int(args[2])
    grace = float(options["--grace"]) if "--grace" in options else settings.get("SFTCTL_LOCAL_ADOPT_GRACE_S") or 0.0
    return guard(int(args[1]), ticks, args[3], args[5:], owner=options.get("--owner"), grace_s=grace,
                 pass_fds=tuple(fds))


if __name__ == "__main__":
    raise SystemExit(main())
