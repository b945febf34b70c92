"""The Store, put together from its parts, and the LeaseKeeper that holds a controller's lease
on a connection of its own."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from sftctl import settings
from sftctl.state.connection import _quietly
from sftctl.state.jobs import _Jobs, queued_holder
from sftctl.state.leases import _Leases
from sftctl.state.liveness import dead_here as _dead_here
from sftctl.state.machines import _Machines
from sftctl.state.series import _Series
from sftctl.state.users import _Users

if TYPE_CHECKING:
    import threading


class Store(_Jobs, _Series, _Users, _Leases, _Machines):
    """The state database. One instance per process; cheap to open (a few ms).

    Args:
        path: a SQLite file, or a ``postgresql://`` URL; default: the setting
            ``SFTCTL_STATE_URL`` (config ``state.url``) when set, else ``$SFTCTL_HOME/state.db``.

    Raises:
        SftctlError: the database cannot be opened (a damaged SQLite file, Postgres unreachable
            or refusing, psycopg not installed: ``pip install 'sftctl[server]'``) or its schema is
            newer than this sftctl's.
    """


class LeaseKeeper:
    """Holds a job's lease (:meth:`Store.acquire_lease`) for a controller and renews it from a
    daemon thread every ``ttl_s / 6`` seconds, on a connection of its own.

    ``holder`` is ``host:pid:start_ticks``: the same after ``exec`` (``python -m sftctl.queue``
    becomes the controller, same pid), so the controller takes its waiting stage's lease over;
    and a lease of a dead process of this host (a controller killed -9) is taken over at once,
    without waiting for it to expire.
    A renewal that finds the lease gone (this process was frozen or cut off for longer than
    ``ttl_s``, and another controller took the job) calls ``on_lost``: by default it says so in
    the ``sftctl.controller`` log and ends this process at once with exit code 3, without touching the job, whose
    nodes are the new holder's now.
    """

    def __init__(self, store: Store, job_id: str, ttl_s: float | None = None, on_lost=None):
        self.store, self.job_id = store, job_id
        self.ttl_s = float(ttl_s if ttl_s is not None else settings.get("SFTCTL_STATE_LEASE_S"))
        self.holder = self.holder_of(os.getpid())
        self.on_lost = on_lost or self._exit
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        """Take the lease and start renewing it; False (nothing started) when another holds it."""
        import threading

        if not self.store.acquire_lease(self.job_id, self.holder, self.ttl_s):
            held = self.store.lease(self.job_id)
            dead = held[0] if held and (self.dead_here(held[0]) or held[0] == self.queued_as()) else None
            if dead is None or not self.store.acquire_lease(self.job_id, self.holder, self.ttl_s, replacing=dead):
                return False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.job_id}", daemon=True)
        self._thread.start()
        return True

    @staticmethod
    def holder_of(pid: int) -> str:
        """The holder name of process ``pid`` of this host (``host:pid:start_ticks``): what its
        LeaseKeeper holds the lease as. A spawner takes the lease in its child's name before it
        publishes the child's pid (:func:`sftctl.api.spawn_controller`); the child's keeper then
        extends it as its own."""
        import socket

        from sftctl import procs

        return f"{socket.gethostname()}:{pid}:{procs.start_ticks(pid)}"

    @staticmethod
    def queued_as() -> str | None:
        """The holder that stood for this process while its scheduler queued it (a controller
        placed in Slurm job N, ``SFTCTL_CONTROLLER_SLURM_JOB_ID``: ``slurm:N``,
        :func:`queued_holder`; one placed in Kubernetes Job N, ``SFTCTL_CONTROLLER_K8S_JOB``:
        ``kubernetes:N``), or None outside such a job."""
        slurm_job = settings.get("SFTCTL_CONTROLLER_SLURM_JOB_ID")
        if slurm_job:
            return queued_holder("slurm", slurm_job)
        k8s_job = settings.get("SFTCTL_CONTROLLER_K8S_JOB")
        return queued_holder("kubernetes", k8s_job) if k8s_job else None

    @staticmethod
    def dead_here(holder: str) -> bool:
        """``holder`` names a process of this host that is gone (killed -9: its lease has not
        expired yet, but nobody renews it); :func:`sftctl.state.liveness.dead_here`."""
        return _dead_here(holder)

    def _renew(self) -> None:
        """The renewing thread's loop: a connection of its own, opened at the first beat that
        reaches the state (a database down when the thread starts must not end the renewals)."""
        store: Store | None = None
        try:
            while not self._stop.wait(self.ttl_s / 6):
                try:
                    if store is None:
                        store = Store(self.store.url or self.store.path)
                        store.retry_window_s = self.store.retry_window_s or settings.get("SFTCTL_STATE_RETRY_S")
                    kept = store.renew_lease(self.job_id, self.holder, self.ttl_s)
                except Exception:  # noqa: BLE001 unreachable past the retry window: try again next beat
                    continue
                finally:
                    if store is not None:
                        _quietly(store.rest, swallow=(Exception,))  # no connection held between beats
                if not kept:
                    self.on_lost(self)
                    return
        finally:
            if store is not None:
                _quietly(store.close)

    def release(self, keep: bool = False) -> None:
        """Stop renewing; give the lease up unless ``keep`` (this process execs its successor)."""
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=30)
        if not keep:
            self.store.release_lease(self.job_id, self.holder)

    @staticmethod
    def _exit(keeper: "LeaseKeeper") -> None:
        import logging

        logging.getLogger("sftctl.controller").error(
            "error: job %s: this controller lost its lease (%s) to another controller; it stops without "
            "touching the job", keeper.job_id, keeper.holder)
        logging.shutdown()
        os._exit(3)
