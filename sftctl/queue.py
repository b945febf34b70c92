"""Local admission: the queue of a ``$SFTCTL_HOME``'s local jobs for this machine's CPUs.

Policy (first come, first served, with backfill that never delays the head, as Slurm's backfill):

- A local job needs one CPU per worker process (nodes x the offering's count) and about
  ``LOCAL_WORKER_MEMORY_GIB`` per worker. CPUs are held by the admitted local jobs of this home
  (PROVISIONING .. RECOVERING) and by ended jobs whose node processes still run (a dead
  controller's); memory is what the kernel reports available (``MemAvailable``).
- Waiting jobs start in the order they were submitted. The oldest waiting job that does not fit
  is the *head*; a later job may start before it (backfill) only when it fits now and does not
  delay the head: it ends (by its ``resources.deadline``, which the controller enforces) before
  the head's reserved start, or it uses CPUs the head will not need at that start. The head's
  reserved start is when enough held CPUs are free by their jobs' deadlines; a job without a
  deadline may run for ever, so behind it nothing is backfilled: the queue is then strictly FIFO.
- A job that needs more CPUs than the machine has is refused when planned (exit 3,
  :meth:`sftctl.providers.local.LocalProvider.never_fits`), never queued.

Waiting costs next to nothing: the detached controller starts as ``python -m sftctl.queue JOB``
(the state store and a file lock, no pydantic; of the providers only local.py's
process tags: about 20 MiB), looks at the state
with a backoff from 1 s to ``POLL_MAX_S`` while nothing changes, scans processes for a dead
controller's nodes only every ``ORPHAN_SCAN_S`` (or when about to start), and once admitted
replaces itself (``exec``) with ``python -m sftctl.controller JOB``. An attached run waits in its
own process with :func:`wait_turn`. One ``admission`` event is written per wait (the first
reason); ``pending_reason`` follows the current one.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from sftctl import settings
from sftctl.errors import ExitCode, SftctlError
from sftctl.paths import CONTROLLER_OWNER, controller_lock, job_dir
from sftctl.state import JobRecord, JobStatus, Liveness, Store, placed
from sftctl.types import FailureCode, capabilities

#: the memory one worker process is expected to take. 0.8 GiB: the quickstart's two torch nodes
#: took about 1.6 GB (measured on this project's 2-core test machine, issue 14); a plain shell
#: job takes next to nothing.
LOCAL_WORKER_MEMORY_GIB = {"model": 0.8, "shell": 0.05}
POLL_S = 1.0  # a waiting job looks again after this long when something changed ...
POLL_MAX_S = 5.0  # ... backing off to this while nothing does
ORPHAN_SCAN_S = 15.0  # how often a waiter scans /proc for a dead controller's node processes
#: a job with a deadline is failed once it passes; its teardown takes seconds more
TEARDOWN_S = 60.0
LIVE_ADMITTED = frozenset({JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.RECOVERING})
#: how long a controller (and a waiting job's first stage) rides out an unreachable state database
#: (Postgres) at the least: every state call reconnects and retries meanwhile, the job goes on,
#: its events and metrics are held in memory. 30 min: a database restart, a failover or a
#: maintenance window fits; past it (one window per outage) the controller's next write fails: it
#: removes the job's nodes, says so in one line and exits, and the next read reaps the job
#: (FAILED_CONTROLLER). ``state.retry_s`` (SFTCTL_STATE_RETRY_S) may only lengthen it.
STATE_OUTAGE_S = 1800.0

#: how a signal cancels a job (the controller's handlers and the waiter's share these lines)
CANCEL_SIGNALS = {
    "SIGTERM": ("cancelled by SIGTERM", ExitCode.TERMINATED),
    # a closed terminal or a dropped ssh session: the nodes must not keep running (and billing)
    # unsupervised, so the job is cancelled and torn down exactly as on Ctrl-C
    "SIGHUP": ("cancelled: the terminal closed (SIGHUP)", ExitCode.HANGUP),
}
DOWN_REASON = "cancelled by sftctl down"


def down_reason(down: dict | None = None) -> str:
    """The end reason of a job ``sftctl down`` cancelled, from its "down" event's data (``down``):
    :data:`DOWN_REASON`, or ``taken down by admin NAME`` when ``down["admin"]`` names the
    server's admin who took down another user's job (the owner sees who)."""
    admin = (down or {}).get("admin")
    return f"taken down by admin {admin}" if admin else DOWN_REASON


def _local(job: JobRecord) -> bool:
    return capabilities(job.provider).local_admission


def demand(job: JobRecord) -> tuple[int, float]:
    """The CPUs (worker processes: nodes x the offering's count) and GiB a local job needs."""
    count = job.offering.count if job.offering is not None else 1
    cpus = job.spec["resources"]["nodes"] * count
    return cpus, cpus * LOCAL_WORKER_MEMORY_GIB["model" if job.spec.get("model") else "shell"]


def ends_by(job: JobRecord) -> float | None:
    """Unix time by which the job is over (its deadline, enforced by the controller, plus
    teardown), or None when it has no deadline."""
    from sftctl.yaml12 import parse_duration_s

    deadline = (job.spec.get("resources") or {}).get("deadline")
    return None if deadline is None else job.created_at + parse_duration_s(deadline) + TEARDOWN_S


def orphaned_local_jobs(store: Store, job_id: str) -> list[JobRecord]:
    """Jobs of this store that are not admitted (ended: a dead controller's, or one still
    tearing down) but whose local node processes, tagged with this home, still run."""
    from sftctl import procs
    from sftctl.providers.local import HOME_TAG, _home_tag

    homes = procs.tag_values(HOME_TAG)
    running = {j for pid, j in procs.tag_values("SFTCTL_JOB_ID").items() if homes.get(pid) == _home_tag()} - {job_id}
    jobs = [store.get_job(j) for j in sorted(running)]
    return [j for j in jobs if j is not None and j.status not in LIVE_ADMITTED and j.status != JobStatus.PENDING]


def _mem_available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def _reserved_start(held: list[tuple[float | None, int]], free: int, need: int) -> tuple[float | None, int]:
    """When ``need`` CPUs are free at the latest, given the ``(ends_by, cpus)`` of what holds
    them and ``free`` CPUs free now, and how many CPUs are free beyond ``need`` then;
    ``(None, 0)`` when that waits on a job without a deadline."""
    for end, cpus in sorted(held, key=lambda h: (h[0] is None, h[0] or 0.0)):
        if end is None:
            return None, 0
        free += cpus
        if free >= need:
            return end, free - need
    return None, 0


def admission(store: Store, job: JobRecord, orphans: list[JobRecord] | None = None,
              now: float | None = None) -> str | None:
    """None when the local job can start now, else why it waits (one line). See the module's
    docstring for the policy; ``orphans`` (:func:`orphaned_local_jobs`) is scanned when None."""
    now = time.time() if now is None else now
    cpus = os.cpu_count() or 1
    need, need_gib = demand(job)
    others = [j for j in store.list_jobs(set(LIVE_ADMITTED)) if j.id != job.id and _local(j)]
    orphans = orphaned_local_jobs(store, job.id) if orphans is None else orphans
    held = [(ends_by(j), demand(j)[0]) for j in others + orphans]
    free = cpus - sum(c for _, c in held)
    # waiting jobs submitted before this one, whose controller runs (a job submitted but never
    # started, or whose controller died, is reaped, not waited for)
    earlier = sorted((j for j in store.list_jobs({JobStatus.PENDING})
                      if j.id != job.id and _local(j) and j.controller_pid is not None
                      and (j.created_at, j.id) < (job.created_at, job.id)), key=lambda j: (j.created_at, j.id))
    starting = 0  # earlier jobs that fit too: they start first
    for e in earlier:
        e_need = demand(e)[0]
        if e_need <= free or not held:  # it starts first (first come, first served)
            free -= e_need
            held.append((ends_by(e), e_need))
            starting += 1
            continue
        # e is the head of the queue: this job may start only without delaying it
        if need > free:
            break
        start, spare = _reserved_start(held, free, min(e_need, cpus))
        mine = ends_by(job)
        if need <= spare or (start is not None and mine is not None and mine <= start):
            break  # backfill
        return (f"queued behind {e.id} (submitted first, needs {e_need} of this machine's {cpus} CPUs): "
                "first come, first served; a later job goes first only when its deadline ends it in time")
    if need > free and held:
        left = (f" ({len(orphans)} of them left running by a dead controller: sftctl down "
                f"{' '.join(j.id for j in orphans)})" if orphans else "")
        first = f" ({starting} of them submitted before this one)" if starting else ""
        return (f"waiting for CPUs: {cpus - free} of this machine's {cpus} are taken by "
                f"{len(others) + len(orphans) + starting} local job(s){left}{first}, this job needs {need}")
    avail = _mem_available_gib()
    if held and avail is not None and avail < need_gib:
        return f"waiting for memory: {avail:.1f} GiB available, this job needs about {need_gib:.1f} GiB"
    return None


def _held_fingerprint(store: Store) -> tuple:
    """What admission depends on in the state: the live jobs and their statuses."""
    return tuple(sorted((j.id, j.status.value) for j in store.list_jobs(set(LIVE_ADMITTED) | {JobStatus.PENDING})))


class StateOutage:
    """Makes ``store`` ride out an unreachable state database (:data:`STATE_OUTAGE_S`, or
    ``state.retry_s`` when longer) and says so through ``say``: one line when an outage begins
    (however many calls retry through it) and one when the database answers again
    (:meth:`back`, which the caller calls after a call went through)."""

    def __init__(self, store: Store, say) -> None:
        self.window_s = max(STATE_OUTAGE_S, settings.get("SFTCTL_STATE_RETRY_S"))
        self.say = say
        self.since: float | None = None  # time.monotonic() when the current outage was first seen
        store.retry_window_s = self.window_s
        store.on_unreachable = self._unreachable

    def _unreachable(self, error: BaseException) -> None:
        if self.since is not None:  # the same outage, another call: said already
            return
        self.since = time.monotonic()
        self.say(f"warning: the state database is unreachable ({' '.join(str(error).split())}); the job goes on, "
                 f"retrying for up to {self.window_s / 60:g} min")

    def back(self) -> None:
        """Say that the database answers again, once per outage (nothing when there was none)."""
        if self.since is not None:
            self.say(f"the state database answers again after {time.monotonic() - self.since:.0f} s")
            self.since = None


def wait_turn(store: Store, job_id: str, say=lambda line: None, answered=lambda: None) -> bool:
    """Wait until the local job may start, then move it PENDING -> PROVISIONING (under the
    admission lock, so two waiters never take the same CPUs) and return True; return False when
    the job ended meanwhile (``sftctl down``). ``say`` gets ``PENDING: <why>`` once per wait.
    A state database outage is ridden out when the caller made ``store`` do so
    (:class:`StateOutage`), each of its polls then waiting for the database.

    Raises:
        SftctlError: the state database is unreachable, past the store's retry window."""
    from filelock import FileLock

    from sftctl.paths import sftctl_home

    lock = FileLock(str(sftctl_home() / "admission.lock"))
    said = None
    delay = POLL_S
    seen = None
    orphans: list[JobRecord] | None = None
    scanned = 0.0
    while True:
        store.reap_dead_controllers()
        job = store.get_job(job_id)
        answered()  # the state answered this poll (StateOutage.back: says so after an outage)
        if job is None or job.status.terminal:
            return False
        if orphans is None or orphans or time.monotonic() - scanned >= ORPHAN_SCAN_S:
            orphans, scanned = orphaned_local_jobs(store, job_id), time.monotonic()
        if admission(store, job, orphans) is None:
            with lock:  # decide again where no other waiter can, with a fresh process scan
                job = store.get_job(job_id)
                if job is None or job.status.terminal:
                    return False
                why = admission(store, job)
                if why is None:
                    if said is not None:
                        store.update_job(job_id, pending_reason=None)
                    return store.transition(job_id, JobStatus.PROVISIONING)
        else:
            why = admission(store, job, orphans)
        if why != said:
            store.update_job(job_id, pending_reason=why)
            if said is None:  # one event per wait: the first reason (status shows the current one)
                store.add_event(job_id, "admission", why)
                say(f"PENDING: {why}")
            said = why
        now_seen = _held_fingerprint(store)
        delay = POLL_S if now_seen != seen else min(POLL_MAX_S, delay * 1.5)
        seen = now_seen
        store.rest()  # a waiting job holds no Postgres connection while it sleeps
        time.sleep(delay)


# The one live controller holds the flock sftctl.paths.controller_lock(JOB) ($SFTCTL_HOME/locks/,
# outside the job dir: `rm -rf jobs/JOB` cannot take it away); its own record, CONTROLLER_OWNER
# (sftctl.paths), is written beside that lock (JOB.json) and in the job dir (for the local nodes'
# guard and `down --orphans`)


class ControllerBusy(SftctlError):
    """The job already has a live controller: a second one must not act on it (exit 2)."""


def owner_record(job_id: str) -> dict | None:
    """The job's controller as it recorded itself (:data:`sftctl.paths.CONTROLLER_OWNER`'s
    fields), from beside its lock, else from the job dir; None when neither is readable."""
    import json

    for path in (controller_lock(job_id).with_suffix(".json"), job_dir(job_id) / CONTROLLER_OWNER):
        try:
            owner = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and owner.get("job_id") == job_id:
            return owner
    return None


def _busy(job_id: str, pid: int | None = None) -> ControllerBusy:
    owner = owner_record(job_id)
    if owner is not None and "host" in owner and (pid is None or owner.get("pid") == pid):
        who = f"pid {owner.get('pid')} on {owner['host']}"
    elif pid is not None:  # a process that has not recorded itself beside its lock yet
        who = f"pid {pid} on {socket.gethostname()}"
    else:
        who = "a process that has not recorded itself yet"
    return ControllerBusy(
        f"job {job_id} already has a live controller ({who}); this one leaves the job alone",
        hint=f"sftctl status {job_id} shows it; sftctl down {job_id} stops the job",
    )


def _lease_decides(store: Store, job: JobRecord | None) -> bool:
    """The job's lease in the state tells whether it has a live controller: on a shared
    (Postgres) state, whose controllers may run on other machines, and for a controller placed
    in a scheduler's job (``controller.place``), whose pid is another machine's."""
    return store.dialect.shared or job is not None and placed(job.spec) is not None


def claim_job(store: Store, job_id: str):
    """Become the job's one controller: where the lease decides (a shared state, a placed
    controller), take the job's lease in the database first (:class:`sftctl.state.LeaseKeeper`:
    two machines never both run the job); then take the job's controller lock
    (:func:`sftctl.paths.controller_lock`: an flock in ``$SFTCTL_HOME/locks/``, which the kernel
    releases when its holder dies, even by SIGKILL, so a dead controller never blocks a restart,
    and which removing the job's directory cannot take away) without waiting; record this
    process beside the lock, in the job dir's ``controller.json`` and in state.

    Returns the held claim; the caller calls its ``release()`` when the job is done (a process
    that exits releases the file lock anyway; an unrenewed lease expires).

    Raises:
        ControllerBusy: another live controller holds the lease or the lock; nothing was changed.
    """
    from filelock import FileLock, Timeout

    job = store.get_job(job_id)
    claim = _Claim(None, None)
    # the lease first: of two would-be controllers the one the lease refuses never touches the
    # lock, so it cannot make the lease's holder (published by its spawner) refuse in turn
    if _lease_decides(store, job):
        from sftctl.state import LeaseKeeper

        keeper = LeaseKeeper(store, job_id)
        if not keeper.acquire():
            held = store.lease(job_id)
            raise _leased(job_id, held[0] if held else "elsewhere")
        claim.lease = keeper
    try:
        path = controller_lock(job_id)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        claim.lock = FileLock(str(path))
        try:
            claim.lock.acquire(timeout=0)
        except Timeout:
            raise _busy(job_id) from None
        pid = os.getpid()
        record_owner(job_id, job.provider if job is not None else None)  # the job dir too
        from sftctl import procs

        store.update_job(job_id, controller_pid=pid, controller_start_ticks=procs.start_ticks(pid))
    except BaseException:  # busy, or the state unreachable: give back what was taken
        claim.release()
        raise
    return claim


def record_owner(job_id: str, provider: str | None) -> dict:
    """Record this process as the job's controller (:data:`sftctl.paths.CONTROLLER_OWNER`'s
    fields), beside its lock and in the job dir (recreated if it was removed); returns the record."""
    import json

    from sftctl import procs

    pid = os.getpid()
    owner = {"job_id": job_id, "provider": provider, "pid": pid, "host": socket.gethostname(),
             "start_ticks": procs.start_ticks(pid), "since": time.time()}
    slurm_job = settings.get("SFTCTL_CONTROLLER_SLURM_JOB_ID")
    if slurm_job:  # controller.place: slurm
        owner["slurm_job_id"] = slurm_job
    k8s_job = settings.get("SFTCTL_CONTROLLER_K8S_JOB")
    if k8s_job:  # controller.place: kubernetes
        owner["kubernetes_job"] = k8s_job
    jd = job_dir(job_id)
    jd.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path in (controller_lock(job_id).with_suffix(".json"), jd / CONTROLLER_OWNER):
        tmp = path.with_name(f"{path.name}.{pid}")
        tmp.write_text(json.dumps(owner))
        os.replace(tmp, path)
    return owner


def lease_for_child(store: Store, job: JobRecord, pid: int) -> None:
    """Where the lease decides (see :func:`claim_job`), take the job's lease in the name of
    ``pid``, a controller just spawned on this host (:meth:`sftctl.state.LeaseKeeper.holder_of`),
    before its pid is published: a reaper that judges by the lease (every waiting job's, every
    read's, another server's) must never see the job's new controller without one. The child's
    own keeper then extends it as its own; a child that dies first leaves a lease that this
    host's next controller takes over at once and that expires for the others.

    Raises:
        ControllerBusy: another live controller holds the lease (the caller stops the child,
            which would refuse anyway).
    """
    if not _lease_decides(store, job):
        return
    from sftctl.state import LeaseKeeper

    holder = LeaseKeeper.holder_of(pid)
    ttl_s = settings.get("SFTCTL_STATE_LEASE_S")
    if store.acquire_lease(job.id, holder, ttl_s):
        return
    held = store.lease(job.id)  # a dead holder of this host is taken over at once, as a keeper does
    if held is not None and LeaseKeeper.dead_here(held[0]) and store.acquire_lease(job.id, holder, ttl_s, replacing=held[0]):
        return
    raise _leased(job.id, held[0] if held else "elsewhere")


class _Claim:
    """A controller's hold on its job: the file lock, and the database lease when shared."""

    def __init__(self, lock, lease):
        self.lock, self.lease = lock, lease

    @property
    def is_locked(self) -> bool:
        return self.lock is not None and self.lock.is_locked

    def release(self, keep_lease: bool = False) -> None:
        try:
            if self.lease is not None:
                self.lease.release(keep=keep_lease)
        finally:
            if self.lock is not None:
                self.lock.release()


def check_no_live_controller(job_id: str, store: Store | None = None) -> None:
    """Raise :class:`ControllerBusy` if the state's verdict on the job's controller
    (:meth:`sftctl.state.Store.controller_liveness`: its lease where the lease decides, its pid
    here, this home's controller lock) is alive; this light stage never asks a scheduler
    (:func:`sftctl.controller.placements.controller_alive` does). ``store``: the state to ask
    (default: the configured one)."""
    asked = store or Store()
    try:
        job = asked.get_job(job_id)
        verdict = asked.controller_liveness(job) if job is not None else None
    finally:
        if store is None:
            asked.close()
    if verdict is not None and verdict.alive:
        raise busy(job_id, verdict)


def busy(job_id: str, verdict: Liveness) -> ControllerBusy:
    """The refusal for a job whose controller ``verdict`` says is alive (exit 2): named by its
    lease holder when the lease told, else by its pid and host (the record beside its lock)."""
    if verdict.holder is not None:
        return _leased(job_id, verdict.holder)
    return _busy(job_id, verdict.pid)


def _leased(job_id: str, holder: str) -> ControllerBusy:
    return ControllerBusy(f"job {job_id} already has a live controller ({holder}, by its lease in the state "
                          "database); this one leaves the job alone",
                          hint=f"sftctl status {job_id} shows it; sftctl down {job_id} stops the job")


class _Signalled(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str] | None = None) -> int:
    """``python -m sftctl.queue JOB``: the detached controller's first, light stage. A local job
    waits here for its turn (see the module's docstring), then, as every other job at once, this
    process becomes ``python -m sftctl.controller JOB`` (same pid; :func:`sftctl.procs.module_argv`)."""
    job_id = (argv or sys.argv[1:])[0]

    def say(line: str) -> None:  # the controller log's lines: time-stamped, flushed at once
        print(time.strftime("%H:%M:%S"), line, flush=True)

    try:
        store = Store()
        outage = StateOutage(store, say)
        lock = claim_job(store, job_id)  # held while waiting too: a second controller refuses
    except SftctlError as e:  # busy, or the state database unreachable past the window: one line
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return int(e.exit_code)
    try:
        return _wait_then_exec(store, outage, lock, job_id, say)
    except SftctlError as e:  # the state database unreachable for longer than the window: one line
        say(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""))
        return int(e.exit_code)


def _wait_then_exec(store: Store, outage: StateOutage, lock, job_id: str, say) -> int:
    """:func:`main`'s wait for a local job's turn, then the exec of the controller; ``say``
    writes a line of the controller log."""
    job = store.get_job(job_id)
    if job is not None and job.status == JobStatus.PENDING and _local(job):

        def cancel(signum, frame):
            raise _Signalled(signum)

        for name in CANCEL_SIGNALS:
            signal.signal(getattr(signal, name), cancel)
        try:
            admitted = wait_turn(store, job_id, say, outage.back)
        except _Signalled as s:
            for name in CANCEL_SIGNALS:
                signal.signal(getattr(signal, name), signal.SIG_IGN)
            why = next(w for name, (w, _) in CANCEL_SIGNALS.items() if getattr(signal, name) == s.signum)
            down = next((e.data for e in store.events(job_id)
                         if e.kind == "down" and (e.data or {}).get("controller_pid") == os.getpid()), None)
            if down is not None:
                why = down_reason(down)
            store.transition(job_id, JobStatus.CANCELLED, why, strict=False, code=FailureCode.CANCELLED.value)
            say(f"cancelled: {why}")
            return 128 + s.signum
        if not admitted:
            return 1
        for name in CANCEL_SIGNALS:  # the controller installs its own
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    store.close()
    from sftctl.procs import module_argv

    argv = module_argv("sftctl.controller", job_id)  # never from the working directory either
    # the controller takes both again at once (exec closes the lock's descriptor anyway; the lease is this pid's)
    lock.release(keep_lease=True)
    os.execv(argv[0], argv)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
