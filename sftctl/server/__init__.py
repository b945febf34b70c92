"""``sftctl server``: one place that runs a team's jobs, so they stay supervised when a laptop closes.

A REST API over :mod:`sftctl.api` (FastAPI on uvicorn; :mod:`sftctl.server.app`), the same
functions the CLI calls here, for clients whose config names the server (``server: {url,
token}``; :mod:`sftctl.remote`). Every request carries a user's token (``Authorization: Bearer``;
:mod:`sftctl.server.users`); a user sees and stops only their own jobs, an admin every one.

The server runs the controller of each job submitted to it as its own child process (the same
``python -m sftctl.queue JOB`` -> ``python -m sftctl.controller JOB`` path as ``sftctl run
--detach``; :func:`sftctl.api.spawn_controller`), in a session of its own: a server stopped or
killed leaves them running. On its start, and every :data:`RECONCILE_S` after, it reconciles from
state: every job that is not finished and has no live controller gets one
(:class:`Supervisor`), which takes the job over where it stands.

Its state is this machine's (``$SFTCTL_HOME``): the same state.db a local ``sftctl`` uses. A
user's job on this machine's local nodes never acts as the server: each node runs in a
bubblewrap sandbox (:meth:`Supervisor.sandbox_nodes` sets ``SFTCTL_NODE_SANDBOX=bwrap`` for the
controllers; :mod:`sftctl.providers.sandbox`).
``fastapi`` and ``uvicorn`` are the ``server`` extra (``pip install -e '.[server]'`` in sftctl's clone);
nothing below :mod:`sftctl.cli` imports this package.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time

from sftctl.errors import SftctlError

#: seconds between two reconciliations of the state with the live controllers
RECONCILE_S = 10.0
#: seconds an unfinished job on a shared (Postgres) state is seen without a controller's lease
#: before a reconcile gives it one (another server or `sftctl start` may be starting one right
#: now; its lease comes before its pid): in effect two reconciliations in a row, RECONCILE_S apart
CLAIM_GRACE_S = 5.0
#: a job whose controller this server restarted this many times and that died again fails
#: (FAILED_CONTROLLER) instead of a fourth restart: a controller that crashes at once would loop
MAX_RESTARTS = 3

log = logging.getLogger("sftctl.server")


class Supervisor:
    """The server's controllers: starts them (:meth:`start`), reaps them when they end, and
    gives every unfinished job without a live controller a new one (:meth:`reconcile`), which
    adopts the job where it stands (:meth:`sftctl.controller.Controller.run`); after
    :data:`MAX_RESTARTS` such restarts of one job, the next death fails it (FAILED_CONTROLLER).
    The server's reads never mark a job FAILED_CONTROLLER themselves (:func:`sftctl.api._reap`)."""

    def __init__(self):
        self._procs: dict[str, subprocess.Popen] = {}  # job id -> its controller
        self._restarts: dict[str, int] = {}  # job id -> controllers reconcile started for it
        self.rounds = 0  # reconciliations done (GET /v1/health says it)
        self._leaseless: dict[str, float] = {}  # shared state: job id -> when first seen without a lease
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @staticmethod
    def sandbox_nodes() -> str:
        """Set ``SFTCTL_NODE_SANDBOX`` in this process's environment, which the controllers it
        starts inherit: ``bwrap`` unless an admin set ``off`` (its environment or the config's
        ``server.node_sandbox``), so a user's job on this machine's local nodes runs in a
        sandbox that cannot act as the server (:mod:`sftctl.providers.sandbox`). Logs a warning
        when it is off, or when bubblewrap cannot start (local-node jobs are then refused at
        submit). Returns the mode.

        Raises:
            SettingError: ``SFTCTL_NODE_SANDBOX`` is neither bwrap nor off (exit 2).
        """
        import os

        from sftctl import settings
        from sftctl.providers import sandbox

        mode = settings.get("SFTCTL_NODE_SANDBOX") or "bwrap"
        os.environ["SFTCTL_NODE_SANDBOX"] = mode
        if mode == "off":
            log.warning("SFTCTL_NODE_SANDBOX=off: every user's job on this machine's local nodes runs as this "
                        "server (its home, state, credentials and admin rights in reach)")
        elif (why := sandbox.unavailable()) is not None:
            log.warning("local nodes run sandboxed, but %s: local-node jobs are refused (install bubblewrap)", why)
        return mode

    def start(self, job_id: str) -> None:
        """Start the controller of a recorded job as this process's child.

        Raises:
            ControllerBusy: the job already has a live controller (exit 2).
        """
        from sftctl import api
        from sftctl.controller.placements import controller_alive
        from sftctl.queue import busy
        from sftctl.state import Store

        with self._lock:
            store = Store()
            try:
                job = store.get_job(job_id)
                verdict = controller_alive(job, store, scheduler=False) if job is not None else None
            finally:
                store.close()
            if verdict is not None and verdict.alive:
                raise busy(job_id, verdict)
            proc = api.spawn_controller(job_id)
            if proc is None:  # controller.place: slurm: a Slurm job, not a child of this process
                log.info("controller of %s submitted to Slurm", job_id)
                return
            self._procs[job_id] = proc
        log.info("controller of %s started (pid %d)", job_id, proc.pid)

    def reap(self) -> None:
        """Collect the exit status of controllers that ended (no zombies)."""
        with self._lock:
            for job_id, proc in list(self._procs.items()):
                if proc.poll() is not None:
                    log.info("controller of %s exited %s", job_id, proc.returncode)
                    del self._procs[job_id]

    def orphans(self) -> list[str]:
        """Unfinished jobs in state whose controller is not alive by the one verdict
        (:func:`sftctl.controller.placements.controller_alive`): none recorded past
        ``CONTROLLER_START_GRACE_S`` after submission (a client that died between submit and
        start), or it is gone: on this machine's state, its process (pid and start time) and its
        file lock; on a shared (Postgres) state, whose controllers may run on other servers'
        machines, its lease in the database (a controller started by a server or ``sftctl start``
        holds it before its pid is recorded, :func:`sftctl.api.spawn_controller`); a controller
        queued at its scheduler whose Slurm job / Kubernetes Job is gone (its lease given up; a
        scheduler that cannot be asked leaves the lease to decide). On a shared state a job counts
        once it was seen without a lease for :data:`CLAIM_GRACE_S` seconds, which spares a restart
        another server is just making a start that the lease would refuse."""
        from sftctl.controller.placements import controller_alive
        from sftctl.state import Store
        from sftctl.types import JobStatus

        store = Store()
        try:
            shared = store.dialect.shared
            out = []
            live = store.list_jobs({s for s in JobStatus if not s.terminal})
            self._leaseless = {k: v for k, v in self._leaseless.items() if k in {j.id for j in live}}
            for j in live:
                now = time.time()
                try:  # a placed controller's Slurm job / Kubernetes Job cancelled while queued is dead
                    verdict = controller_alive(j, store)
                except SftctlError as e:  # its scheduler unreachable: the lease decides, as it stands
                    log.info("%s: %s", j.id, e.message)
                    verdict = controller_alive(j, store, scheduler=False)
                if verdict.alive is None:
                    continue  # just submitted: its client starts it
                if verdict.alive:
                    self._leaseless.pop(j.id, None)
                    continue
                if shared and now - self._leaseless.setdefault(j.id, now) < CLAIM_GRACE_S:
                    continue  # just started somewhere? its lease may come
                self._leaseless.pop(j.id, None)
                out.append(j.id)
            return out
        finally:
            store.close()

    def reconcile(self) -> list[str]:
        """Give every unfinished job without a live controller a new one; return their ids."""
        started = []
        for job_id in self.orphans():
            if self._restarts.get(job_id, 0) >= MAX_RESTARTS:
                self._give_up(job_id)
                continue
            self._restarts[job_id] = self._restarts.get(job_id, 0) + 1
            try:
                self.start(job_id)
            except SftctlError as e:  # another controller took it meanwhile
                log.info("%s: %s", job_id, e.message)
                continue
            started.append(job_id)
        self.rounds += 1
        return started

    def _give_up(self, job_id: str) -> None:
        from sftctl.state import Store
        from sftctl.types import JobStatus

        store = Store()
        try:
            store.transition(job_id, JobStatus.FAILED_CONTROLLER,
                             f"its controller died {MAX_RESTARTS + 1} times; the server gave up on it "
                             f"(jobs/{job_id}/controller.log says why; sftctl down {job_id} removes its nodes)",
                             strict=False, code="controller_died")
        finally:
            store.close()
        log.warning("%s: its controller died %d times: FAILED_CONTROLLER", job_id, MAX_RESTARTS + 1)

    def run_in_background(self) -> threading.Thread:
        """Reap and reconcile every :data:`RECONCILE_S` seconds until :meth:`stop`."""

        def loop():
            outage = None  # the state database's error while it lasts: said once, not every round
            while not self._stop.wait(RECONCILE_S):
                try:
                    self.reap()
                    self.reconcile()
                except SftctlError as e:  # the state unreachable: one line per outage
                    if outage is None:
                        log.warning("reconcile paused: %s (retrying every %g s)", e.message, RECONCILE_S)
                    outage = e.message
                    continue
                except Exception:  # a busy state: the next round retries (logged)
                    log.exception("reconcile failed")
                    continue
                if outage is not None:
                    log.warning("reconcile resumed: the state database answers again")
                    outage = None

        t = threading.Thread(target=loop, name="sftctl-reconcile", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()


def _next_steps(host: str, port: int) -> str:
    """What ``sftctl server start`` says once it listens: its URL (this machine's name when it
    listens on every interface) and the next steps, as ``jupyter`` and ``mlflow ui`` say theirs."""
    import socket

    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    url = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}"
    return (f"listening on {url} (Ctrl-C stops it). Next: sftctl server user add NAME [--admin] --local (here) prints "
            f"a user's token; a client then sets server: {{url: {url}, token: TOKEN}} in its config file "
            f"(or SFTCTL_SERVER_URL={url} SFTCTL_SERVER_TOKEN=TOKEN) and runs sftctl as usual")


def serve(host: str = "127.0.0.1", port: int = 8470) -> None:
    """Run the server in this process until it is stopped (SIGINT/SIGTERM): reconcile first,
    then answer requests on ``host:port``.

    Raises:
        SftctlError: fastapi or uvicorn is not installed, or ``host:port`` cannot be bound (in
            use, or not an address of this machine) (exit 2).
    """
    import socket

    try:
        import uvicorn
    except ImportError:
        raise SftctlError("sftctl server needs fastapi and uvicorn", hint="pip install -e '.[server]' in sftctl's clone") from None
    try:  # said in one line now, not in uvicorn's log after the reconcile
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        import errno

        # a name that resolves to nothing (create_server re-raises getaddrinfo's error as an OSError
        # with its EAI_* errno), or an address of another machine
        not_ours = {errno.EADDRNOTAVAIL, socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME),
                    getattr(socket, "EAI_ADDRFAMILY", socket.EAI_NONAME)}
        if isinstance(e, socket.gaierror) or e.errno in not_ours:
            raise SftctlError(f"sftctl server: cannot listen on {host}:{port}: {host} is not an address of this machine",
                              hint="give --host an address of this machine (127.0.0.1: only here; 0.0.0.0: every "
                                   "interface)") from None
        hint = ("another server runs there? pick another --port (or --host)" if e.errno == errno.EADDRINUSE
                else "pick another --port (ports below 1024 need root) or --host")
        raise SftctlError(f"sftctl server: cannot listen on {host}:{port}: {e.strerror or e}", hint=hint) from None
    from sftctl import api
    from sftctl.server.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    api.SERVING = True
    Supervisor.sandbox_nodes()
    supervisor = Supervisor()
    adopted = supervisor.reconcile()
    log.info("reconciled: %d job(s) given a controller%s", len(adopted), f" ({', '.join(adopted)})" if adopted else "")
    log.info("%s", _next_steps(host, port))
    supervisor.run_in_background()
    try:
        uvicorn.run(create_app(supervisor), host=host, port=port, log_level="warning")
    finally:
        supervisor.stop()
