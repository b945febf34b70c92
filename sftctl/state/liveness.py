"""Whether a job's controller is alive, judged from what the state and this machine show: the
verdict record (:class:`Liveness`) and the evidence it is built from (a recorded pid and its
start time, the job's lease, its controller lock, a holder of this host that is gone).

The one judgement is :meth:`sftctl.state.Store.controller_liveness`; a controller placement
(:meth:`sftctl.controller.placements.base.Placement.alive`) adds what only its scheduler knows,
and :func:`sftctl.controller.placements.controller_alive` is what callers above the controller
ask. The state's own reaper (every read, every waiting job) and the queue's light stage ask the
Store's judgement directly: they sit below the controller and never ask a scheduler.
"""

from __future__ import annotations

import dataclasses
import socket

from sftctl import procs
from sftctl.paths import controller_lock


@dataclasses.dataclass(frozen=True)
class Liveness:
    """A verdict on one job's controller.

    Attributes:
        alive: True (it runs, or its scheduler holds it queued), False (it is gone or never
            started), None (unknown yet: no pid recorded within ``CONTROLLER_START_GRACE_S`` of
            the job's submission, its client is starting it).
        why: one line saying what was seen (``pid 4242 runs on this machine``, ``holds the job's
            lease as slurm:17``, ``Slurm job 17 left the queue without starting``).
        by: the evidence: ``"pid"``, ``"lock"``, ``"lease"``, ``"scheduler"`` or ``"grace"``
            (``"none"``: nothing shows a controller).
        holder: the lease holder (``host:pid:start_ticks``, ``slurm:<id>``) when the lease was
            the evidence, else None.
        pid, ticks: the controller's process on this machine and its start time (clock ticks
            since boot, :func:`sftctl.procs.start_ticks`) when one is known to run here (a
            signal may be sent to it), else None.
    """

    alive: bool | None
    why: str
    by: str = "none"
    holder: str | None = None
    pid: int | None = None
    ticks: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def dead_here(holder: str) -> bool:
    """``holder`` (``host:pid:start_ticks``) names a process of this host that is gone (killed
    -9: its lease has not expired yet, but nobody renews it). A holder of another host, or a
    scheduler's (``slurm:17``), is never judged from here."""
    host, pid, ticks = _process_of(holder)
    return host == socket.gethostname() and pid is not None and not procs.alive(pid, ticks)


def process_here(holder: str) -> tuple[int, int] | None:
    """``(pid, start_ticks)`` of a lease holder that is a live process of this host, else None."""
    host, pid, ticks = _process_of(holder)
    if host == socket.gethostname() and pid is not None and ticks is not None and procs.alive(pid, ticks):
        return pid, ticks
    return None


def _process_of(holder: str) -> tuple[str, int | None, int | None]:
    host, pid_text, ticks_text = (holder.rsplit(":", 2) + ["", ""])[:3]
    try:
        return host, int(pid_text), int(ticks_text)
    except ValueError:
        return host, None, None


def lock_held(job_id: str) -> bool:
    """Whether a process holds the job's controller lock (:func:`sftctl.paths.controller_lock`,
    an flock in this ``$SFTCTL_HOME``): tried without waiting and let go at once; False when no
    controller ever took it (the file does not exist)."""
    from filelock import FileLock, Timeout

    path = controller_lock(job_id)
    if not path.exists():
        return False
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False
