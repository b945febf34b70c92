"""Running a job through the api (see :mod:`sftctl.api`): :func:`submit` (validate, plan, admit:
:func:`sftctl.controller.launch.admit`; record the job), :func:`dry_run` (the launch request,
rendered), :func:`start` and :func:`spawn_controller` (a detached controller), :func:`attach`
(the controller in this process, or a server's job followed) and :func:`run`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from sftctl.api._base import JOB_ARGS, Overrides, Progress, SpecLike, _owner_only, _remote, _resolve, _serving, _store, _typed
from sftctl.api._secrets import secret_list
from sftctl.api._specs import _load, _override_strings, plan
from sftctl.api._views import JobView, _view, events, logs, status, wait
from sftctl.errors import ExitCode, SftctlError, SftctlWarning
from sftctl.types import JobRecord, JobStatus

if TYPE_CHECKING:
    from sftctl.spec import JobSpec
    from sftctl.types import Plan


# ------------------------------------------------------------------------------ run


@dataclasses.dataclass(frozen=True)
class Submitted:
    """A job recorded in state (PENDING) with its plan, no controller started yet."""

    job_id: str
    spec: JobSpec
    plan: Plan


JOB_ARGS[Submitted] = "job_id"  # a job argument may be a Submitted


def _prepare(spec: SpecLike, overrides: Overrides, progress: Progress | None,
             origin: str | None = None, owner: str | None = None,
             ranks: tuple[int, ...] = (), loaded: tuple[JobSpec, str, Path | None] | None = None,
             ) -> tuple[JobSpec, Path | None, Plan, Any]:
    """Validate a spec for running, plan it, and admit it (:func:`sftctl.controller.launch.admit`):
    secrets set, checkpoint dir free, storage present where the nodes need it, a
    ``controller.place`` that works on the planned provider. Returns the spec, its file, the plan
    and the :class:`~sftctl.controller.launch.LaunchRequest` (``ranks``: the nodes it renders in
    full). In the server (``owner``: the requester), ``${VAR}`` and ``secrets:`` resolve from the
    owner's secrets and the lab's only (:mod:`sftctl.vault`), never the server's environment;
    here from this user's stored secrets, then this environment. ``loaded``: :func:`_load`'s
    answer for these arguments, when the caller has it (not loaded again)."""
    from sftctl.controller.launch import Checks, Where, admit, check_spec

    environ = _secret_environ(owner)
    s, label, path = loaded if loaded is not None else _load(spec, overrides, origin, environ)
    checks = Checks(label, server=_serving() or _remote() is not None, serving=_serving(), environ=environ,
                    owner=owner)
    check_spec(s, checks)  # the rules that need no plan: before planning
    chosen = plan(s, strict=False, progress=progress)  # a model it cannot predict: a warning, price only
    # the rules that need the plan, and what the launch would be (ranks: the nodes rendered; none at submit)
    request = admit(s, chosen, Where(ranks=ranks, checks=checks))
    return s, path, chosen, request


def _secret_environ(owner: str | None) -> Mapping[str, str]:
    """What a job's ``${VAR}`` and ``secrets:`` resolve from at submit: in the server, the owner's
    and the lab's stored secrets (:class:`sftctl.vault.SecretEnviron`); with a server configured
    (``run --dry-run`` here), the names of this user's secrets there, each standing for
    ``<secret>`` (as the server's submit would resolve them; no value leaves the server); here,
    this user's stored secrets, then this environment (just the environment when none is stored)."""
    from sftctl import settings, vault
    from sftctl.paths import sftctl_home
    from sftctl.state import Store, os_user

    if not _serving() and _remote() is not None:  # a dry run for a server: its store names them (values stay there)
        return {secret.name: "<secret>" for secret in secret_list()}
    if not _serving() and not settings.get("SFTCTL_STATE_URL") and not (sftctl_home() / "state.db").exists():
        return os.environ  # no state here yet (a first dry run creates none): nothing stored
    store = Store()
    try:
        own = vault.SecretEnviron(store, owner or os_user())
    finally:
        store.close()
    return vault.user_environ(own, only_store=_serving())


def _check_storage(storage) -> None:
    """Before anything is created: the job's storage must exist (or be created, with
    ``create_bucket``) and be writable. A plain directory is created; a ``pvc://`` claim is only
    mounted on the nodes, so it is not checked here."""
    from sftctl.storage import LocalStorage, open_storage

    s = open_storage(storage.url)
    if isinstance(s, LocalStorage) and s.mount is not None:
        return
    s.ensure(create_bucket=storage.create_bucket or isinstance(s, LocalStorage))


@_typed
def dry_run(spec: SpecLike, overrides: Overrides = (), *, progress: Progress | None = None) -> dict:
    """What :func:`run` would do, rendered, with nothing created or started (``run --dry-run``).

    Returns ``run --dry-run --json``'s document: ``{"dry_run": true, "job", "plan" (the reason),
    "offering", "nodes": [{"rank", "env", "script", "bootstrap"}] (node 0 only), "other_nodes",
    "submits": [{"name", "text"}]}`` (the other nodes summarised, so its size does not grow with
    the node count; secret values shown as ``<secret>``; ``submits``: Slurm's sbatch.sh and
    step.sh, Kubernetes manifests, the placed controller's submission, as they would be handed
    over): the :class:`~sftctl.controller.launch.LaunchRequest` the controller would execute, with
    placeholders for the job id, the nodes' addresses and the rendezvous port
    (:meth:`~sftctl.controller.launch.LaunchRequest.preview`).

    Raises:
        SpecError, InfeasibleError: as :func:`submit`.
    """
    s, _, chosen, request = _prepare(spec, overrides, progress, ranks=(0, 1))  # node 0, node 1 for what differs
    return {"dry_run": True, "job": s.name, "plan": chosen.reason, **request.preview()}


@_typed
def submit(spec: SpecLike, overrides: Overrides = (), *, progress: Progress | None = None,
           origin: str | None = None, owner: str | None = None,
           loaded: tuple[JobSpec, str, Path | None] | None = None) -> Submitted:
    """Validate and plan a job, check its storage, and record it in state (PENDING). Starts
    nothing: :func:`start` (detached) or :func:`attach` (in this process) runs it.

    ``origin``: with ``spec`` the YAML text of a file read elsewhere, that file's path (messages
    name it, relative paths are taken from its directory; a server passes its client's).
    ``owner``: the user the job belongs to (a server passes its requester's name; default: this
    machine's user). ``loaded``: the spec as ``_load`` already made it from these arguments (a
    server's submit that checked its workdir), used as it is instead of loading it again.

    Raises:
        SpecError: invalid spec, a secret not set in this environment, or a checkpoint dir
            holding another run's checkpoints (exit 2).
        SftctlError: cloud nodes without ``storage:`` (exit 2).
        InfeasibleError: nothing can run it (exit 3).
        ProviderError: the job's storage is unreachable or not writable (exit 4).
    """
    remote = _remote()
    if remote is not None:
        return _submit_remote(remote, spec, overrides)
    from sftctl.state import Store

    with _owner_only():
        s, path, chosen, _ = _prepare(spec, overrides, progress, origin, owner, loaded=loaded)
        if s.storage is not None:
            _check_storage(s.storage)
        store = Store()
        job_id = store.create_job(s.name, s.model_dump(mode="json"),
                                  spec_path=str(path.resolve()) if path is not None else None, owner=owner)
        store.update_job(job_id, provider=chosen.offering.provider, offering_json=chosen.to_dict(),
                         # the server's job takes its secrets from its owner's store, never the server's environment
                         **({"secrets_from": "store"} if _serving() else {}))
        sets = _override_strings(overrides)
        if sets:  # status JOB shows them: a sweep's jobs differ by these
            store.add_event(job_id, "submit", "submitted with " + " ".join(f"--set {a}" for a in sets),
                            {"overrides": sets})
        store.add_event(job_id, "plan", chosen.reason)
    return Submitted(job_id, s, chosen)


def _submit_remote(remote, spec: SpecLike, overrides: Overrides) -> Submitted:
    """:func:`submit` through the server: the spec's text and where it came from (relative paths
    are taken from its directory, as here) and the overrides go there (a relative ``--set
    storage=`` made absolute here, against this directory); the server validates,
    plans and records the job as its requester's. Secrets travel by name: the server's
    environment holds their values. The server's warnings are issued here."""
    from sftctl.spec import JobSpec, absolute_storage_overrides

    if isinstance(spec, JobSpec):
        import json

        text, label = json.dumps(spec.model_dump(mode="json")), str(Path(spec.workdir).resolve() / "<JobSpec>")
    elif isinstance(spec, str) and ("\n" in spec or not (spec.endswith((".yaml", ".yml")) or Path(spec).exists())):
        text, label = spec, str(Path.cwd() / "<spec>")
    else:
        path = Path(spec).resolve()
        from sftctl.spec import _read_spec_file

        text, label = _read_spec_file(path), str(path)
    doc = remote.request("POST", "/v1/jobs", read_s=None,
                         json={"spec_text": text, "spec_path": label,
                               "overrides": absolute_storage_overrides(_override_strings(overrides))})
    for line in doc.get("warnings", []):
        warnings.warn(SftctlWarning(line), stacklevel=3)
    record = JobRecord.from_dict(doc["job"])
    return Submitted(record.id, JobSpec.model_validate(record.spec), record.plan)


def spawn_controller(job_id: str):
    """Start the detached controller of a recorded job: ``python -m sftctl.queue JOB`` (which
    becomes ``python -m sftctl.controller JOB`` once the job may start; :func:`sftctl.procs.module_argv`),
    in a session of its own, logging to ``$SFTCTL_HOME/jobs/JOB/controller.log``; record its pid.
    On a shared (Postgres) state the job's lease is taken in the child's name first
    (:func:`sftctl.queue.lease_for_child`), so no reaper ever sees the new controller's pid
    without its lease. Returns the :class:`subprocess.Popen` (the server keeps it, to reap it when it ends).

    This is the one spawn path: every controller start (``run --detach``, :func:`start`, the
    server's Supervisor) comes here, and the job's placement decides (:func:`sftctl.state.placed`,
    its ``elsewhere``; no controller import on this path): this machine's (``local``, ``server``) get
    the detached process above; one placed ``elsewhere`` (``slurm``, ``kubernetes``) is submitted
    to its scheduler instead (:func:`sftctl.controller.launch.place_controller`); then None is returned.

    Raises:
        ProviderError: sbatch refused the controller's Slurm job (exit 4).
        ControllerBusy: another live controller holds the job's lease (the child is stopped; exit 2).
    """
    import subprocess

    from sftctl import procs
    from sftctl.paths import job_dir
    from sftctl.state import placed

    store = _store()
    record = store.get_job(job_id)
    if record is not None and placed(record.spec):  # Placement.elsewhere (state.HERE: a test holds them equal)
        from sftctl.controller.launch import place_controller

        with _owner_only():
            place_controller(store, record)
        return None

    with _owner_only():
        jd = job_dir(job_id)
        jd.mkdir(parents=True, exist_ok=True)
        with open(jd / "controller.log", "ab") as log:
            proc = subprocess.Popen(
                # sftctl.queue waits light for a local job's turn, then execs sftctl.controller
                procs.module_argv("sftctl.queue", job_id),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
    # the lease before the pid (a shared state): no reaper ever sees this controller without one
    from sftctl.queue import lease_for_child

    try:
        if record is not None:
            lease_for_child(store, record, proc.pid)
    except BaseException:  # another controller holds the job, or the state is unreachable
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing else of it runs yet
        proc.wait()
        raise
    store.update_job(job_id, controller_pid=proc.pid, controller_start_ticks=procs.start_ticks(proc.pid))
    return proc


@_typed
def start(job: str) -> JobView:
    """Start a detached controller for a submitted job (``python -m sftctl.queue JOB``, which
    becomes ``python -m sftctl.controller JOB`` once the job may start; in a session of its own, logging to ``$SFTCTL_HOME/jobs/JOB/controller.log``); return at once
    with the job's status.

    Raises:
        NotFoundError: no such job (exit 2).
        ControllerBusy: the job already has a live controller, named by pid and host (exit 2).
        SftctlError: the job already ended (exit 2).

    With a server configured, the server starts it, as its own child process.
    """
    remote = _remote()
    if remote is not None:
        return JobView.from_wire(remote.request("POST", remote.job_path(job, "/start")))
    from sftctl.queue import busy
    from sftctl.state import placed

    store = _store()
    record = _resolve(store, job)
    if record.status.terminal:
        raise SftctlError(f"job {record.id} already ended ({record.status.value}): there is nothing to start",
                          hint="sftctl run SPEC starts a new job; sftctl events " + record.id + " shows how it ended")
    if placed(record.spec):  # its scheduler may have dropped it queued: the placement's verdict asks
        from sftctl.controller.placements import controller_alive

        verdict = controller_alive(record, store)
    else:  # this machine's placements' verdict is the state's (Placement.alive): no controller import
        verdict = store.controller_liveness(record)  # between submit and the pid, where reapers wait
    if verdict.alive:
        raise busy(record.id, verdict)
    spawn_controller(record.id)
    return _view(store, store.get_job(record.id), detail=True)


@dataclasses.dataclass(frozen=True)
class Attached:
    """How an attached run ended: the job's final view, the error that ended it when sftctl
    itself did (no capacity anywhere, a provider error), and the wall time in seconds."""

    job: JobView
    error: SftctlError | None
    wall_s: float

    @property
    def exit_code(self) -> int:
        """``sftctl run``'s exit code: 0 succeeded; cancelled 130 (Ctrl-C), 143 (SIGTERM), 129
        (SIGHUP); else the error's code (3 no capacity, 4 provider) or 1 (the job failed)."""
        from sftctl.errors import ExitCode

        status = self.job.status
        if status == JobStatus.SUCCEEDED:
            return int(ExitCode.OK)
        if status == JobStatus.CANCELLED:  # a signal's cancel carries its code (128 + signal)
            return int(self.error.exit_code if self.error is not None else ExitCode.INTERRUPTED)
        return int(self.error.exit_code if self.error is not None else ExitCode.JOB_FAILED)


@_typed
def attach(job: str, reporter=None) -> Attached:
    """Run a submitted job's controller in this process until the job ends (Ctrl-C, SIGTERM and
    SIGHUP cancel it and tear its nodes down).

    Args:
        reporter: receives events, node log text and metrics as they happen
            (:class:`sftctl.controller.lifecycle.Reporter`; the CLI's is :class:`sftctl.ui.RunView`).
            None: events go to the ``sftctl.controller`` logger. Its calls come from the
            controller's loop: one that waits on its output would hold the job's end, its
            recorded duration and its teardown up (RunView only queues; its thread prints).

    Raises:
        ControllerBusy: the job already has a live controller, named by pid and host (exit 2);
            the job is left untouched.

    With a server configured, the controller runs on the server (:func:`start`) and this
    process follows the job's logs (``reporter.log``) until it ends: a client that stops
    (Ctrl-C, a closed laptop) leaves the job running, supervised by the server.
    """
    remote = _remote()
    if remote is not None:
        return _follow(job, reporter, "by the server")
    from sftctl.controller.lifecycle import Controller
    from sftctl.queue import claim_job
    from sftctl.state import placed

    store = _store()
    record = _resolve(store, job)
    if placed(record.spec):  # controller.place: slurm: this process only follows the job
        return _follow(record.id, reporter, f"by its controller on {placed(record.spec)}")
    started = time.monotonic()
    with _owner_only():
        lock = claim_job(store, record.id)
        try:
            controller = Controller(store, record.id, reporter)
            controller.run()
        finally:
            lock.release()
    wall_s = time.monotonic() - started
    return Attached(_view(store, store.get_job(record.id), detail=True), controller.error, wall_s)


#: seconds between a followed job's status/events polls (:func:`_follow`)
FOLLOW_POLL_S = 1.0


class _Watch:
    """What a followed job's reporter hears besides its logs: each new event (a status event
    ``A -> B: why`` as ``B: why``, as the local controller says it) and the ranks' step and loss
    (each rank's first loss once, then its latest), read from :func:`events` and
    :func:`status` (through the server when one is configured)."""

    def __init__(self, job: str, reporter) -> None:
        self.job, self.reporter = job, reporter
        self.seen_event = -1  # the newest event id passed on
        self.first_sent: set[int] = set()  # ranks whose first loss was passed on
        self.steps: dict[int, int] = {}  # rank -> latest step passed on

    def poll(self) -> None:
        """One round: new events, then new steps (errors of a poll are left to the next one)."""
        for e in sorted(events(self.job), key=lambda e: e.id):
            if e.id <= self.seen_event:
                continue
            self.seen_event = e.id
            message = e.message
            if e.kind == "plan" or (e.kind == "status" and " -> " not in message):
                continue  # the submit and its plan: the caller said them already (run's first line)
            if e.kind == "status" and " -> " in message:
                message = message.split(" -> ", 1)[1]
            self.reporter.event(message)
        view = status(self.job)
        samples = []
        for r in view.ranks:
            if r.rank not in self.first_sent and r.first_loss is not None:
                self.first_sent.add(r.rank)
                samples.append({"rank": r.rank, "step": r.first_step or r.step, "loss": r.first_loss})
            if self.steps.get(r.rank) != r.step:
                self.steps[r.rank] = r.step
                samples.append({"rank": r.rank, "step": r.step, "loss": r.loss, "tokens_per_s": r.tokens_per_s})
        if samples:
            self.reporter.metrics(samples)

    def run(self, stop) -> None:
        """Poll every :data:`FOLLOW_POLL_S` until ``stop`` (a threading.Event) is set."""
        while not stop.wait(FOLLOW_POLL_S):
            with contextlib.suppress(Exception):  # a poll that fails (server restarting): the next one tells
                self.poll()


def _follow(job: str, reporter, by: str) -> Attached:
    """:func:`attach` of a job whose controller runs elsewhere (a server, a Slurm job): start it
    there and follow it until it ends: its logs (``reporter.log``), and from a thread its events
    (``reporter.event``) and the ranks' steps and losses (``reporter.metrics``), polled every
    :data:`FOLLOW_POLL_S` seconds (:class:`_Watch`), as a local attached run reports them.
    Ctrl-C leaves it running."""
    import threading

    started = time.monotonic()
    job = start(job).id
    watch = _Watch(job, reporter) if reporter is not None else None
    stop = threading.Event()
    thread = None
    if watch is not None:
        thread = threading.Thread(target=watch.run, args=(stop,), name=f"sftctl-follow-{job}", daemon=True)
        thread.start()
    try:
        for line in logs(job, follow=True):
            if reporter is not None and not line.notice:
                reporter.log(line.rank or 0, line.text + "\n")
        view = wait(job)
        stop.set()
        if thread is not None:
            thread.join()
            with contextlib.suppress(Exception):  # the job ended: a last poll that fails loses nothing
                watch.poll()  # the last events (the ending) and steps
    except KeyboardInterrupt:
        err = SftctlError(f"interrupted: job {job} goes on, supervised {by}",
                          hint=f"sftctl logs {job} --follow watches it again; sftctl down {job} stops it",
                          exit_code=ExitCode.INTERRUPTED)
        err.detached = (job, by)  # the good outcome: the CLI says it plainly, not as an error
        raise err from None
    finally:
        stop.set()
    return Attached(view, None, time.monotonic() - started)


@_typed
def run(spec: SpecLike, overrides: Overrides = (), *, detach: bool = False, reporter=None,
        progress: Progress | None = None) -> JobView:
    """Plan, provision, launch and watch a job: :func:`submit`, then :func:`start` (``detach``:
    returns at once, the job RUNNING or on its way) or :func:`attach` (returns when it ended).

    Raises:
        as :func:`submit`. A job that fails is not an exception: see ``status`` and
        ``failure_reason`` of the returned view.
    """
    job = submit(spec, overrides, progress=progress)
    if detach:
        return start(job.job_id)
    return attach(job.job_id, reporter).job
