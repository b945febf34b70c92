"""The job lifecycle as an explicit state machine: :class:`Controller` and the detached
controller's entry point :func:`main`.

One controller drives one job (see :mod:`sftctl.state` for the statuses and allowed moves)::

    PENDING -> PROVISIONING -> LAUNCHING -> RUNNING -> SUCCEEDED
                                   ^           | a node failed, restarts left; or resources.replan:
                                   +- RECOVERING   migrate moves the job at a checkpoint (_migrate)
    any live status -> FAILED | CANCELLED (Ctrl-C, SIGTERM, sftctl down) | FAILED_CONTROLLER

Every transition is written to state *before* the controller acts on it, and every node is
recorded before its provider creates it, so a controller that dies (even by SIGKILL) leaves a
state from which ``sftctl status`` tells the truth and ``sftctl down`` removes everything.

Attached, the controller runs inside ``sftctl run`` with a :class:`Reporter` that draws progress;
detached, it runs as ``python -m sftctl.controller JOB_ID`` in a session of its own.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from sftctl import vault
from sftctl.catalog import Offering
from sftctl.controller.common import (
    Cancelled,
    Failure,
    LogReporter,
    Reporter,
    _error_code,
    _Guarded,
    _in_main_thread,
    _install_cancel_signals,
    _same_file,
    _stdout_unlinked,
)
from sftctl.controller.launch import LaunchRequest, Where, admit
from sftctl.controller.preflight import keep_out, remember_machine
from sftctl.controller.slots import NodeSlot
from sftctl.controller.ports import claim_rendezvous_port, release_rendezvous_port
from sftctl.controller.drain import Draining
from sftctl.controller.recovery import Recovery
from sftctl.controller.run_record import RunRecording
from sftctl.controller.replan import Replanner, Verdict
from sftctl.controller.spot import SpotGuard
from sftctl.controller.submit import claim_checkpoint_dir, job_provider
from sftctl.errors import CapacityError, ExitCode, InfeasibleError, ProviderError, SftctlError, StateUnavailable
from sftctl.health.telemetry import REPLACE, RESTART
from sftctl.paths import CONTROLLER_OWNER, controller_lock, job_dir
from sftctl.providers import workdir_roots
from sftctl.providers.base import (
    KeepsAlive, NodeState, Quarantines, SecretStore, UsesChannel, provision_all, terminate_all,
)
from sftctl.health.monitor import HealthMonitor
from sftctl.queue import ControllerBusy, StateOutage, claim_job, down_reason, record_owner, wait_turn  # shared with the waiting stage
from sftctl.protocol import NodeDir
from sftctl.spec import JobSpec
from sftctl.state import JobStatus, Store
from sftctl.storage import StorageError, open_storage
from sftctl.storage.workdir import upload_workdir
from sftctl.types import AttemptStatus, FailureCode, FailureReason, LocalHandle, Plan, capabilities

POLL_S = 0.5
#: True in the detached controller (:func:`main`): its stdout and stderr are the job's controller.log
_LOGS_TO_JOB_DIR = False
#: With job storage every poll lists each node's streams (about 5 requests per node): poll less
#: often there; S3 charges per request and a node ships its files every second anyway.
STORAGE_POLL_S = 2.0
STORAGE_OUTAGE_S = 300.0  # how long the job's storage may be unreachable before the job fails
#: a node's exit after every rank's last step and the final checkpoint is torch's teardown (an
#: abort at exit, or a gloo/NCCL destroy error raised: `exception`), not a failure (_monitor)
TEARDOWN_CODES = (FailureCode.EXIT, FailureCode.SIGNAL, FailureCode.EXCEPTION)


# wait before a relaunch: 1 s, 2 s, 4 s, ... up to 30 s (restarts that fail fast do not spin)
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 30.0

#: a :class:`Failure` action: stop the attempt at a checkpoint and move to another offering (resources.replan)
MIGRATE = "migrate"


class Controller(Recovery, Draining, RunRecording):
    """Runs one job from PENDING to a terminal status.

    Args:
        store: the state store.
        job_id: a job created by ``Store.create_job`` with ``provider`` and ``offering_json`` set
            (``offering_json`` holds the planner's :meth:`Plan.to_dict`; ``JobRecord.plan`` reads it back).
        reporter: receives events, node log text and training metrics.
    """

    def __init__(self, store: Store, job_id: str, reporter: Reporter | None = None):
        self.store = store
        self.job_id = job_id
        self.reporter = _Guarded(reporter or LogReporter())
        # a reader or another sftctl holding state.db must not fail a healthy job: wait it out
        store.on_locked = lambda e: self.reporter.event(
            f"warning: the state database is locked by another process ({e}); waiting for it")
        # Postgres unreachable: the job goes on, events and metrics are held, every other call
        # waits for it (up to STATE_OUTAGE_S); one line when an outage begins, one when it ends
        self.state_outage = StateOutage(store, self.reporter.event)
        job = store.get_job(job_id)
        if job is None:
            raise KeyError(job_id)
        self.created_at = job.created_at
        self.spec = JobSpec.model_validate(job.spec)
        self.plan: Plan = job.plan
        self.offering = self.plan.offering
        # secret values from the job's owner's store (a server's job: never the server's environment)
        self.provider = job_provider(job, self.offering.provider, vault.job_environ(store, job))
        self.blocked: list[CapacityError] = []  # capacity errors seen by this job: failover skips them
        self.spot = SpotGuard(store, job_id, self.spec)  # resources.spot: preempted zones, on-demand fallback
        self.replanner = Replanner(store, job_id, self.spec)  # resources.replan: a cheaper offering, once per job
        self._migrating: tuple[Verdict, int] | None = None  # (the verdict, newest checkpoint step when it came)
        self._moved_at: float | None = None  # when a migration's new nodes came up: the run history measures after it
        self.nodes: list[NodeSlot] = []  # in node-rank order; each keeps its streams' read offsets
        self.monitor = None
        self._queued_reason: str | None = None  # the scheduler's pending reason, as last recorded
        if self.spec.health.enabled:
            self.monitor = HealthMonitor(self.spec.health.thresholds(), self.spec.train.steps)
        self.attempt = 0
        self._reported_attempt = 0  # the attempt whose first step report has been seen
        self._dropped_records = 0  # invalid metrics records of the job's nodes (health.records)
        self._agent_errors = 0  # health agent errors the nodes reported (drain.py: bounded events)
        self.rank_nodes: dict[int, int] = {}  # training (global) rank -> node rank, as the nodes report
        self.restarts = job.restarts
        self.error: SftctlError | None = None  # what ended the job, when sftctl itself did (exit code)
        channel = self.provider.channel if isinstance(self.provider, UsesChannel) else None
        self.storage = channel.storage if channel is not None else None
        self.workdir_key: str | None = None
        self.rdzv_port: int | None = None  # claimed at the first launch, released at teardown
        self.adopted = False  # True once run() took the job over from a controller that died
        self._owner_seen, self._run_recorded = False, False  # controller.json seen (_keep_job_dir); _record_run ran

    # ---------------------------------------------------------------- lifecycle

    def run(self) -> JobStatus:
        """Drive the job to a terminal status and return it. Nodes are always torn down.

        A job some earlier controller left under way (it died, even by SIGKILL: LAUNCHING,
        RUNNING or RECOVERING) is adopted, not started over: see :meth:`_adopt`. The caller
        holds the job (:func:`sftctl.queue.claim_job`), so no other controller is alive.

        In the main thread, SIGTERM and SIGHUP (and Ctrl-C, through the caller's handler) cancel
        the job while it runs; all three are ignored while its nodes are torn down; then the
        reporter's ``ended()`` (when it has one) and the caller's handlers are back, as they were."""
        main = _in_main_thread()  # signals are the main thread's (a thread of a server has none)
        ctrl_c = signal.getsignal(signal.SIGINT) if main else None  # the caller's, given back at the end
        previous = _install_cancel_signals()
        try:
            resume = self._adopt()
            if not self.adopted:
                self._admit()
                self._provision()
            while True:
                if resume is not None:  # the dead controller's attempt, its nodes still running: watch it on
                    attempt, resume = resume, None
                else:
                    attempt = self.store.start_attempt(self.job_id)
                    self._move(JobStatus.LAUNCHING, f"attempt {attempt}")
                    self._launch(attempt)
                    self._move(JobStatus.RUNNING)
                failure = self._monitor()
                if failure is None:
                    self.store.end_attempt(self.job_id, attempt, AttemptStatus.SUCCEEDED, 0, None)
                    self._record_run()
                    self._move(JobStatus.SUCCEEDED)
                    break
                code = failure.reason.code.value
                if failure.action == MIGRATE:  # resources.replan: migrate, at a checkpoint; no restart counted
                    self.store.end_attempt(self.job_id, attempt, AttemptStatus.CANCELLED, None, failure.reason.message, code)
                    self._stop_nodes()
                    self._migrate(failure)
                    continue
                self.store.end_attempt(self.job_id, attempt, AttemptStatus.FAILED, failure.exit_code, failure.reason.message, code)
                self._stop_nodes()
                if failure.action is None or self.restarts >= self.spec.recovery.max_restarts:
                    self._record_run()
                    self._move(JobStatus.FAILED, failure.reason.message, code)
                    break
                self.restarts += 1
                self.store.update_job(self.job_id, restarts=self.restarts)
                what = "replaces node %d and resumes" % failure.node_rank if failure.action == REPLACE else "resumes"
                self._move(
                    JobStatus.RECOVERING,
                    f"{failure.reason.message}; restart {self.restarts}/{self.spec.recovery.max_restarts} "
                    f"{what} {self._resume_point()}",
                )
                if failure.action == REPLACE:
                    self._replace(failure.node_rank, quarantine=failure.verdict)
                time.sleep(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (self.restarts - 1)))
        except (Cancelled, KeyboardInterrupt) as e:
            why = str(e) if isinstance(e, Cancelled) and str(e) else "cancelled by the user (Ctrl-C)"
            if isinstance(e, Cancelled) and e.exit_code is not None:
                down = self._down_sent_sigterm() if e.exit_code == ExitCode.TERMINATED else None
                if down is not None:
                    why = down_reason(down)
                self.error = SftctlError(why, exit_code=e.exit_code)  # `sftctl run` exits 128 + signal
            self.store.transition(self.job_id, JobStatus.CANCELLED, why, code=FailureCode.CANCELLED.value)
            self.store.end_open_attempts(self.job_id, AttemptStatus.CANCELLED, why, FailureCode.CANCELLED.value)
            self.reporter.event(f"cancelled: {why}")
        except StateUnavailable as e:  # past its window (queue.STATE_OUTAGE_S): nothing can be recorded;
            self.error = e  # the nodes go (teardown), main says so, and a read once it is back reaps the job
            raise
        except SftctlError as e:
            self.error = e
            self.store.transition(self.job_id, JobStatus.FAILED, e.message, code=_error_code(e))
            self.store.end_open_attempts(self.job_id, AttemptStatus.FAILED, e.message, _error_code(e))
            self.reporter.event(f"failed: {e.message}")
        except BaseException as e:
            self.store.transition(self.job_id, JobStatus.FAILED, f"controller error: {e!r}", code=FailureCode.UNKNOWN.value)
            self.store.end_open_attempts(self.job_id, AttemptStatus.FAILED, f"controller error: {e!r}", FailureCode.UNKNOWN.value)
            raise
        finally:
            if main:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut teardown
            for signum in previous:  # nor a SIGHUP or SIGTERM that follows the first one
                signal.signal(signum, signal.SIG_IGN)
            if not isinstance(self.error, StateUnavailable):
                self._record_run()
            try:
                self._teardown()
            finally:
                try:  # before the handlers go back: a caller's handler then knows the job is over
                    if callable(getattr(self.reporter.inner, "ended", None)):
                        self.reporter.ended()
                finally:  # the caller's own handlers, as they were (never SIG_DFL in their place)
                    if main:
                        signal.signal(signal.SIGINT, signal.default_int_handler if ctrl_c is None else ctrl_c)
                    for signum, handler in previous.items():
                        signal.signal(signum, handler)
        return self.store.get_job(self.job_id).status

    def _admit(self) -> None:
        """PENDING -> PROVISIONING once this machine has room for the job's local nodes.

        Cloud jobs go on at once. A local job waits its turn in this home's local queue
        (:mod:`sftctl.queue`: first come, first served, backfill that never delays the head;
        PENDING with ``pending_reason`` saying why). A detached controller has waited already,
        as ``python -m sftctl.queue``, and finds its job PROVISIONING.
        """
        if self.store.get_job(self.job_id).status == JobStatus.PROVISIONING:  # admitted by sftctl.queue
            self.reporter.event(JobStatus.PROVISIONING.value)  # (or a dead controller's, see _adopt)
            return
        if not capabilities(self.provider.name).local_admission:
            self._move(JobStatus.PROVISIONING)
            return

        if not wait_turn(self.store, self.job_id, self.reporter.event):
            raise Cancelled("the job was ended by another process (sftctl down)")
        self.reporter.event(JobStatus.PROVISIONING.value)

    def _move(self, status: JobStatus, reason: str | None = None, code: str | None = None) -> None:
        if not self.store.transition(self.job_id, status, reason, code=code):
            raise Cancelled("the job was ended by another process (sftctl down)")
        self.state_outage.back()  # that write went through: an outage (if any) is over
        self.reporter.event(f"{status.value}" + (f": {reason}" if reason else ""))

    # ---------------------------------------------------------------- steps

    def _provision(self) -> None:
        """Provision every node on the chosen offering; fail over down the plan on no capacity.

        A :class:`CapacityError` blocks its zone, offering, region or cloud for this job (see
        ``CapacityError.scope``); the next feasible candidate of the plan that no block rules out
        is tried, until one has capacity or none is left (the job fails with every reason).
        """
        while True:
            try:
                self._provision_on(self.offering)
                break
            except CapacityError as e:
                self.blocked.append(e)
                nxt = self._next_offering()
                where = {"zone": f"zone {e.zone}", "offering": f"{e.instance_type} in {e.region}",
                         "region": f"{e.provider} region {e.region}", "cloud": f"all of {e.provider}"}[e.scope]
                message = f"{e.message}; {where} blocked for this job"
                if nxt is None:
                    self.store.add_event(self.job_id, "capacity", message)
                    reasons = "; ".join(b.message for b in self.blocked)
                    raise InfeasibleError(f"no offering of the plan had capacity: {reasons}",
                                      hint="widen resources (accelerators, clouds, regions) or retry later") from None
                message += f"; trying {nxt.provider} {nxt.instance_type} in {nxt.region}"
                self.store.add_event(self.job_id, "capacity", message)
                self.reporter.event(message)
                self.offering = nxt
                self.provider = self._job_provider(nxt.provider)
                self.plan = self.plan.with_offering(nxt)
                self.store.update_job(self.job_id, provider=nxt.provider, offering_json=self.plan.to_dict())
        self.store.add_event(self.job_id, "provision", f"{len(self.nodes)} node(s) ready on {self.provider.name}")
        self.reporter.event(f"{len(self.nodes)} node(s) ready on {self.provider.name}")

    def _provision_on(self, offering: Offering) -> None:
        """Record the nodes, then create them all in parallel; all or nothing."""
        self.spot.seed(self.provider)  # zones that took spot nodes back are avoided for a while
        keep_out(self.store, self.provider, self.job_id, self.reporter)  # machines a verdict marked bad (41.3)
        self.nodes = []
        for rank in range(self.spec.resources.nodes):
            node_id = self.store.add_node(self.job_id, rank, self.provider.name)
            self.nodes.append(NodeSlot(node_id, rank))
        request = self._request()  # every node's bootstrap, as run --dry-run shows it
        try:
            handles = provision_all(self.provider, self.job_id, [(n.id, n.rank) for n in self.nodes], offering,
                                    bootstrap_for=lambda node_id, rank: self._bootstrap(node_id, rank, request),
                                    **self._provision_options())
        except BaseException:
            for n in self.nodes:  # provision_all removed what came up; the records say so
                self.store.update_node(n.id, status=NodeState.TERMINATED.value, handle={"terminated": True})
            self.nodes = []
            raise
        for node, handle in zip(self.nodes, handles):
            node.handle = handle
            self.store.update_node(node.id, status=NodeState.READY.value, handle=handle.to_dict())

    def _provision_options(self) -> dict:
        return {"spot": self.spot.spot, "image": self.spec.resources.image}

    def _request(self, ranks: tuple[int, ...] | None = None, attempt: int = 1, port: int | str = 0) -> LaunchRequest:
        """The launch request of the job's nodes as they stand (:func:`sftctl.controller.launch.admit`),
        rendered with this controller's provider: what it provisions and launches."""
        ref = ""
        if isinstance(self.provider, SecretStore):  # AWS stores the job's secret values here, once
            ref = self.provider.secrets_ref(self.job_id)
        return admit(self.spec, self.plan, Where.of(self.job_id, self.nodes, attempt=attempt, port=port,
                                                    workdir_key=self.workdir_key, ranks=ranks,
                                                    provider=self.provider, secrets_ref=ref, documents=False))

    def _bootstrap(self, node_id: str, rank: int, request: LaunchRequest | None = None) -> str:
        """The first-boot script of node ``rank`` (install sftctl, run the node daemon; "" where
        the provider boots none): its launch request's (``request``, else one for that rank)."""
        request = request or self._request((rank,))
        return request.node(rank).bootstrap or ""

    def _next_offering(self) -> Offering | None:
        """The best feasible candidate of the plan after the current one that no block rules out."""
        for c in self.plan.candidates:
            if c.rejected is not None:
                continue
            o = c.offering
            if o == self.offering or any(b.blocks(o.provider, o.region, o.instance_type) for b in self.blocked):
                continue
            return o
        return None

    def _job_provider(self, name: str):
        """The job's provider ``name`` (:func:`sftctl.controller.submit.job_provider`), its secret
        values from :func:`sftctl.vault.job_environ`, read now."""
        job = self.store.get_job(self.job_id)
        return job_provider(job, name, vault.job_environ(self.store, job))

    def _check_workdir_roots(self) -> None:
        """A server's job whose workdir (resolved now: it may have become a link since submit) lies
        outside its owner's ``server.workdir_roots`` is not packed or sent anywhere
        (:mod:`sftctl.providers.workdir_roots`). The local provider checks again where it binds it.

        Raises:
            ProviderError: the one line naming the workdir and the owner's roots (exit 4).
        """
        job = self.store.get_job(self.job_id)
        if job is None or job.secrets_from != "store" or not job.owner or not self.spec.workdir:
            return
        problem = workdir_roots.refusal(self.spec.workdir, job.owner)
        if problem is not None:
            raise ProviderError(problem, hint=workdir_roots.HINT)

    def _launch(self, attempt: int) -> None:
        self._check_workdir_roots()
        if self.storage is not None and self.workdir_key is None:
            # under the storage's root, not the job's prefix: an unchanged workdir is uploaded once
            packed = upload_workdir(open_storage(self.spec.storage.url), self.spec.workdir,
                                    max_bytes=int(self.spec.storage.max_workdir_mb * 2**20))
            self.workdir_key = packed.key
            self.store.add_event(self.job_id, "storage", f"workdir {packed.key} ({packed.size_bytes / 2**20:.1f} MiB"
                                 f"{', already there' if not packed.uploaded else ''}) in {self.spec.storage.url}",
                                 {"workdir_key": packed.key, "uploaded": packed.uploaded})  # for `down --purge`
        if self.rdzv_port is None:  # one port for the whole job: relaunches reuse it
            self.rdzv_port = claim_rendezvous_port(self.job_id)
        request = self._request(attempt=attempt, port=self.rdzv_port)  # what run --dry-run shows, executed
        if attempt == 1:
            claim_checkpoint_dir(request.checkpoint_claim, self.job_id)
        environ = vault.job_environ(self.store, self.store.get_job(self.job_id))  # read once per launch
        for node in self.nodes:
            env = request.environment(node.rank, environ)  # the secret values, filled only now
            node.handle = self.provider.launch(node.handle, request.node(node.rank).script, env, attempt)
            self.store.update_node(node.id, status=NodeState.RUNNING.value, handle=node.handle.to_dict())
        self.attempt = attempt
        if self.monitor is not None:
            self.monitor.reset_training()
        self.reporter.event(f"launched attempt {attempt} on {len(self.nodes)} node(s)")

    def _monitor(self) -> "Failure | None":
        """Poll until every node succeeded (None) or something failed (a :class:`Failure`).

        Policy: a node whose script exited non-zero is restarted in place; a node that vanished
        (no exit code) is replaced; a health verdict brings its own action; a passed deadline
        is not retried.
        """
        deadline_s = self.spec.resources.deadline_s
        outage_since: float | None = None  # when the job's storage stopped answering
        # a provider whose nodes outlive a dead controller (Slurm) is told that this one watches
        keepalive = self.provider.keepalive if isinstance(self.provider, KeepsAlive) else None
        finished: set[int] = set()  # ranks of nodes that failed in teardown only (_trained_to_the_end)
        while True:
            self._keep_job_dir()
            try:
                if keepalive is not None:
                    keepalive(self.job_id)
                self._drain()
                statuses = [(n, self.provider.status(n.handle)) for n in self.nodes]
            except StorageError as e:  # nodes keep training and buffering: wait for the storage
                now = time.monotonic()
                if outage_since is None:
                    outage_since = now
                    message = f"job storage unreachable, retrying for {STORAGE_OUTAGE_S:.0f} s: {e.message}"
                    self.store.add_event(self.job_id, "storage", message)
                    self.reporter.event(f"warning: {message}")
                if now - outage_since > STORAGE_OUTAGE_S:
                    raise
                time.sleep(STORAGE_POLL_S)
                continue
            if outage_since is not None:
                outage_since = None
                self.store.add_event(self.job_id, "storage", "job storage answers again")
            self._record_details(statuses)
            if self.state_outage.since is not None and self.store.held == 0:  # held writes went through
                self.state_outage.back()
            for node, st in statuses:
                if st.state == NodeState.FAILED and node.rank not in finished:
                    self._drain()
                    why = self._exit_reason(node, st.exit_code)
                    end = self._trained_to_the_end() if why.code in TEARDOWN_CODES else None
                    if end is not None:  # torch's teardown after the last step and checkpoint: not a failure
                        finished.add(self._teardown_exit(node.rank, why, end))
                        continue
                    # a full disk stays full, a missing secret or workdir stays missing: restarting hits them again
                    action = None if why.code in (FailureCode.DISK_FULL, FailureCode.SECRET_MISSING,
                                                  FailureCode.WORKDIR_MISSING) else RESTART
                    if why.code in (FailureCode.PREFLIGHT_SLOW, FailureCode.PREFLIGHT_FAILED):  # issue 41: another machine
                        self.store.add_event(self.job_id, "health", why.message,  # as a verdict's event says it
                                             {**why.data, "kind": why.data.get("verdict"), "action": REPLACE.value})
                        return Failure(why, REPLACE, node.rank, st.exit_code, verdict=why.message)
                    return Failure(why, action, node.rank, st.exit_code)
                if st.state == NodeState.LOST and self.spot.is_preemption(node.handle):
                    why = self.spot.preempted(self.provider, self.offering, node.rank, node.handle, st.detail)
                    self.reporter.event(why.message)
                    return Failure(why, REPLACE, node.rank)
                if st.state == NodeState.LOST:
                    return Failure(FailureReason(FailureCode.NODE_LOST, f"node {node.rank}: {st.detail}",
                                                 {"node_rank": node.rank}), REPLACE, node.rank)
            if all(st.state == NodeState.SUCCEEDED or n.rank in finished for n, st in statuses):
                self._drain()
                return None
            move = self._replan()
            if move is not None:
                return move
            if self.monitor is not None:
                verdicts = self.monitor.verdicts(time.time())
                if verdicts:
                    v = min(verdicts, key=lambda v: (v.action != REPLACE, v.node_rank))  # replace first
                    self.store.add_event(self.job_id, "health", f"node {v.node_rank}: {v.kind}: {v.evidence}", v.to_dict())
                    self.reporter.event(f"health: node {v.node_rank} {v.kind} -> {v.action}: {v.evidence}")
                    why = FailureReason(v.kind.code,  # each verdict kind owns its code
                                        f"node {v.node_rank} {v.kind}: {v.evidence}",
                                        {"node_rank": v.node_rank, "verdict": v.kind.value})
                    return Failure(why, v.action, v.node_rank, verdict=f"{v.kind}: {v.evidence}")
            if deadline_s is not None and time.time() - self.created_at > deadline_s:
                return Failure(FailureReason(FailureCode.TOO_SLOW, f"deadline of {self.spec.resources.deadline} passed",
                                             {"deadline_s": deadline_s}), None, None)
            time.sleep(POLL_S if self.storage is None else STORAGE_POLL_S)

    def _keep_job_dir(self) -> None:
        """Recreate what this controller keeps in the job's directory when it was removed under
        it (``rm -rf $SFTCTL_HOME/jobs/JOB``): its own record (``controller.json``, which the
        local nodes' guard reads), a detached controller's ``controller.log`` (its stdout and
        stderr, reopened there), and its local nodes' directories (their streams read again from
        the start), and say so in an event. The job's controller lock is not in that directory
        (:func:`sftctl.paths.controller_lock`): no second controller takes the job meanwhile.
        One ``stat`` per poll while nothing was removed."""
        jd = job_dir(self.job_id)
        log_gone = _LOGS_TO_JOB_DIR and _stdout_unlinked()
        if not log_gone:
            if (jd / CONTROLLER_OWNER).exists():
                self._owner_seen = True
                return
            if not self._owner_seen:  # a Controller run without sftctl.queue.claim_job (a test's): none to keep
                return
        record_owner(self.job_id, self.provider.name)  # the job dir too
        if log_gone:
            sys.stdout.flush()
            sys.stderr.flush()
            fd = os.open(jd / "controller.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        for node in self.nodes:
            if isinstance(node.handle, LocalHandle) and not os.path.isdir(node.handle.dir):
                NodeDir(Path(node.handle.dir)).metrics.mkdir(parents=True, exist_ok=True)  # as provision made it
                node.log_offset = 0
                node.metric_offsets.clear()
                node.health_offsets.clear()
        message = (f"the job's directory {jd} was removed while its controller ran: recreated (this controller "
                   f"keeps the job: its lock is {controller_lock(self.job_id)})")
        self.store.add_event(self.job_id, "controller", message)
        self.reporter.event(f"warning: {message}")

    def _record_details(self, statuses: list) -> None:
        """What the provider says of running nodes (a Slurm job's pending reason): one event per
        new detail, naming every node that reports it; such nodes are recorded as PENDING, and
        the job's ``pending_reason`` is the first such detail until none is pending."""
        changed: dict[str, list[int]] = {}
        for node, st in statuses:
            if st.state == NodeState.RUNNING and st.detail != node.detail:
                node.detail = st.detail
                if st.detail:
                    changed.setdefault(st.detail, []).append(node.rank)
                self.store.update_node(node.id, status=NodeState.PENDING if st.pending else NodeState.RUNNING)
        for detail, ranks in changed.items():
            who = f"node {ranks[0]}" if len(ranks) == 1 else f"nodes {', '.join(map(str, ranks))}"
            self.store.add_event(self.job_id, "node", f"{who}: {detail}")
            self.reporter.event(f"{who}: {detail}")
        # while the scheduler queues the nodes, the job says why, as local admission does
        # (status's note, `status --json`'s pending_reason); cleared once they run
        waiting = next((st.detail for _, st in statuses if st.state == NodeState.RUNNING and st.pending), None)
        if waiting != self._queued_reason:
            self._queued_reason = waiting
            self.store.update_job(self.job_id, pending_reason=waiting)

    def _replan(self) -> "Failure | None":
        """``resources.replan`` (:mod:`sftctl.controller.replan`): once per job, after warm-up,
        a ``replan`` event when another offering of the plan is cheaper by more than moving costs.
        With ``migrate``, the attempt is stopped (a :data:`MIGRATE` failure) once a checkpoint
        newer than the verdict's time is complete: the steps since it are all that is lost. A
        job whose checkpoints this machine cannot see moves at the next step reported as a
        checkpoint (``sft.report(..., checkpoint=True)``)."""
        v = self.replanner.check(self.plan)
        if v is not None:
            self.reporter.event(v.message(self.replanner.mode))
            if self.replanner.mode == "migrate":
                self._migrating = (v, self._newest_checkpoint())
        if self._migrating is None:
            return None
        v, since = self._migrating
        newest = self._newest_checkpoint()
        if newest <= since:
            return None
        to = v.alternative
        return Failure(FailureReason(FailureCode.REPLANNED, f"checkpoint step {newest} complete: moving to {to.provider} "
                                     f"{to.instance_type} in {to.region} (resources.replan: migrate)",
                                     {"checkpoint_step": newest} | v.to_dict()), MIGRATE, None)

    def _migrate(self, failure: "Failure") -> None:
        """Move the job to the replan verdict's offering: every node of the current one is
        terminated (and recorded so) before anything is provisioned there, so two copies of the
        job never run; then the new nodes are provisioned (capacity errors fail over down the
        plan as at the start) and the caller's next attempt resumes from the checkpoint."""
        v, _ = self._migrating
        self._migrating = None
        to = v.alternative
        self._move(JobStatus.RECOVERING, f"replan: moving from {self.offering.provider} {self.offering.instance_type} "
                                         f"to {to.provider} {to.instance_type} in {to.region}, resuming {self._resume_point()}")
        old = [n.id for n in self.nodes]
        terminate_all(self.provider, [n.handle for n in self.nodes if n.handle is not None], progress=self.reporter.event)
        for node in self.nodes:
            self.store.update_node(node.id, status=NodeState.TERMINATED.value,
                                   handle=node.handle.with_(terminated=True).to_dict() if node.handle is not None
                                   else {"terminated": True})
        self.provider.terminate_tagged(self.job_id)  # nothing of the job is left on the old offering
        self.nodes = []
        frm = self.offering
        self.offering = to
        self.provider = self._job_provider(to.provider)
        self.plan = self.plan.with_offering(to)
        self.store.update_job(self.job_id, provider=to.provider, offering_json=self.plan.to_dict())
        self._provision()
        self._moved_at = time.time()
        if self.monitor is not None:
            for n in self.nodes:
                self.monitor.reset_node(n.rank)
        message = (f"migrated from {frm.provider} {frm.instance_type} in {frm.region} to {to.provider} "
                   f"{to.instance_type} in {to.region}: {len(old)} old node(s) terminated, {len(self.nodes)} new")
        self.store.add_event(self.job_id, "migrate", message, {
            "from": v.to_dict()["current"], "to": v.to_dict()["alternative"], "terminated": old,
            "nodes": [n.id for n in self.nodes], "checkpoint_step": failure.reason.data.get("checkpoint_step")})
        self.reporter.event(message)

    def _replace(self, rank: int, quarantine: str | None = None) -> None:
        """Terminate node ``rank`` and provision a new node in its place (a new node id). With
        ``quarantine`` (a health verdict) the machine it ran on is kept out first
        (:meth:`Provider.quarantine`: anti-affinity and cordon on Kubernetes, ``--exclude`` on Slurm)."""
        i = next(i for i, n in enumerate(self.nodes) if n.rank == rank)
        old = self.nodes[i]
        if quarantine and old.handle:
            self._quarantine(old, quarantine)
        if old.handle is not None:
            self.provider.terminate(old.handle)
        self.store.update_node(old.id, status=NodeState.REPLACED, handle=old.handle.with_(terminated=True).to_dict()
                               if old.handle is not None else {"terminated": True})
        node_id = self.store.add_node(self.job_id, rank, self.provider.name)
        new = NodeSlot(node_id, rank, generation=old.generation + 1)
        self.nodes[i] = new
        while True:
            self.spot.seed(self.provider)
            keep_out(self.store, self.provider, self.job_id, self.reporter)
            try:
                new.handle = self.provider.provision(self.job_id, node_id, rank, self.offering,
                                                        bootstrap=self._bootstrap(node_id, rank), **self._provision_options())
                break
            except CapacityError as e:
                if len(self.nodes) == 1 and self._fail_over(e):  # a lone node may move: next offering of the plan
                    continue
                self.store.update_node(node_id, status=NodeState.FAILED.value)
                if not self._shrink(i, rank, e):
                    raise
                return
        self.store.update_node(node_id, status=NodeState.READY.value, handle=new.handle.to_dict())
        if self.monitor is not None:
            self.monitor.reset_node(rank)
        zone, spot = getattr(new.handle, "zone", None), getattr(new.handle, "spot", None)
        message = f"node {rank} replaced: {old.id} -> {node_id}" + (
            f" in {zone}" + ("" if spot is None else (", spot" if spot else ", on demand")) if zone else "")
        self.store.add_event(self.job_id, "replace", message, {"zone": zone, "spot": spot} if zone else None)
        self.reporter.event(message)

    def _fail_over(self, e: CapacityError) -> bool:
        """Block what ``e`` names for this job and move the job to the plan's next feasible
        offering (another zone's worth of capacity having run out: another region, instance type
        or cloud). False when the plan has none left. Only for a job of one node: the others of a
        multi-node job stay where they run."""
        self.blocked.append(e)
        nxt = self._next_offering()
        if nxt is None:
            return False
        message = f"{e.message}; trying {nxt.provider} {nxt.instance_type} in {nxt.region}"
        self.store.add_event(self.job_id, "capacity", message)
        self.reporter.event(message)
        self.offering = nxt
        self.provider = self._job_provider(nxt.provider)
        self.plan = self.plan.with_offering(nxt)
        self.store.update_job(self.job_id, provider=nxt.provider, offering_json=self.plan.to_dict())
        return True

    def _quarantine(self, node: NodeSlot, verdict: str) -> None:
        """Ask the provider to keep ``node``'s machine out (best effort) and record what it did."""
        name, provider = self.provider.name, self.provider
        if not isinstance(provider, Quarantines):  # a cloud instance or this machine: nothing to keep out
            return
        try:
            done = provider.quarantine(node.handle, verdict)
        except SftctlError as e:
            done = {"machine": None, "actions": [], "message": f"could not keep its machine out: {e.message}"}
        if not done:
            return
        remember_machine(self.store, self.job_id, name, node.handle, done, verdict)  # issue 41.3
        message = f"node {node.rank}: {done['message']}"
        self.store.add_event(self.job_id, "quarantine", message,
                             {k: v for k, v in done.items() if k != "message"} | {"node_id": node.id})
        self.reporter.event(message)

    def _shrink(self, i: int, rank: int, e: CapacityError) -> bool:
        """Elastic resume (``recovery.min_nodes``): drop node ``rank``, which could not be
        replaced, and renumber the others 0..n-1; the next attempt runs on them, each rank
        accumulating ``resources.nodes / n`` micro-batches (``SFTCTL_GRAD_ACCUM``) so the global
        batch stays the same, and resumes from the (resharded) last checkpoint. False when the
        spec does not allow it (the caller fails the job as before)."""
        planned = self.spec.resources.nodes
        floor = self.spec.recovery.min_nodes or planned
        left = len(self.nodes) - 1
        if left < floor or planned % left:
            why = (f"recovery.min_nodes is {floor}" if left < floor else
                   f"{planned} planned nodes do not split evenly over {left}: the global batch would change")
            message = f"node {rank} could not be replaced ({e.message}); not resuming on {left} node(s): {why}"
            self.store.add_event(self.job_id, "elastic", message)
            self.reporter.event(message)
            return False
        del self.nodes[i]
        for new_rank, node in enumerate(sorted(self.nodes, key=lambda n: n.rank)):
            if node.rank != new_rank:
                node.rank = new_rank
                if node.handle is not None:
                    node.handle = node.handle.with_(rank=new_rank)
                self.store.update_node(node.id, rank=new_rank,
                                       handle=node.handle.to_dict() if node.handle is not None else {})
        self.nodes.sort(key=lambda n: n.rank)
        if self.monitor is not None:
            for r in range(planned):
                self.monitor.reset_node(r)
        message = (f"elastic: node {rank} could not be replaced ({e.message}); resuming on {left} of {planned} "
                   f"node(s) from the resharded checkpoint, global batch kept: {planned // left} micro-batches "
                   f"per rank per step (gradient accumulation)")
        self.store.add_event(self.job_id, "elastic", message, {"nodes": left, "planned_nodes": planned,
                                                              "grad_accum": planned // left})
        self.reporter.event(message)
        return True

    def _exit_reason(self, node: NodeSlot, code: int | None) -> FailureReason:
        """Node ``node`` exited with ``code``: the node's own failure record says why (OOM, an
        exception, a signal; see :mod:`sftctl.failure`), else the code alone (``exit``)."""
        line = f"node {node.rank} exited with code {code}"
        data = {"node_rank": node.rank, "exit_code": code}
        why = self.provider.read_failure(node.handle)
        if why is None:
            return FailureReason(FailureCode.EXIT, line, data)
        return FailureReason(why.code, f"{line}: {why.message}", {**why.data, **data})

    def _down_sent_sigterm(self) -> dict | None:
        """The data of the "down" event in which ``sftctl down`` recorded, before signalling, that it
        sends this controller SIGTERM (``admin``: the admin who took down another user's job), or
        None when it did not."""
        return next((e.data for e in self.store.events(self.job_id) if e.kind == "down" and e.data
                     and e.data.get("signal") == "SIGTERM" and e.data.get("controller_pid") == os.getpid()), None)

    def _stop_nodes(self) -> None:
        for node in self.nodes:
            self.provider.stop_attempt(node.handle)

    def _teardown(self) -> None:
        """Remove every node and stray process of the job, then record it (a state database
        that is unreachable past its window records nothing: the nodes go all the same)."""
        terminate_all(self.provider, [n.handle for n in self.nodes if n.handle is not None],
                      progress=self.reporter.event)  # all at once: a wide job comes down as fast as one node
        leftover = self.provider.terminate_tagged(self.job_id)
        release_rendezvous_port(self.rdzv_port)  # its nodes are gone: the port is free again
        message = f"terminated {len(self.nodes)} node(s)" + (
            f" and {leftover} stray process(es)" if leftover else ""
        )
        self.reporter.event(message)
        if isinstance(self.error, StateUnavailable):
            return
        for node in self.nodes:
            if node.handle is not None:
                node.handle = node.handle.with_(terminated=True)
            self.store.update_node(node.id, status=NodeState.TERMINATED.value,
                                   handle=node.handle.to_dict() if node.handle is not None else {"terminated": True})
        self.store.add_event(self.job_id, "teardown", message)


#: Each signal that cancels a job: its reason and the exit code of ``sftctl run`` (128 + signal).
#: When ``sftctl down`` sent the SIGTERM (it says so in an event first) the reason is queue.down_reason()'s.


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached controller: ``python -m sftctl.controller JOB_ID`` (:func:`adopt`:
    a job whose controller died under way is taken over, not failed).

    Exits 0 when the job succeeded, 1 when it ended otherwise, 2 (one ``error:`` line on stderr,
    the job untouched) when the job already has a live controller, 1 with one ``error:`` line
    when the state database stayed unreachable past its window (:data:`sftctl.queue.STATE_OUTAGE_S`):
    the job's nodes are removed, its record is left to the next read's reaper (FAILED_CONTROLLER)."""
    global _LOGS_TO_JOB_DIR
    job_id = (argv or sys.argv[1:])[0]
    os.umask(0o077)  # logs, scripts and checkpoints of the job: owner-only whatever the dir's mode
    _LOGS_TO_JOB_DIR = _same_file(1, job_dir(job_id) / "controller.log")
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        status = adopt(Store(), job_id)
    except ControllerBusy as e:
        print(f"error: {e.message}\nhint: {e.hint}", file=sys.stderr)
        return int(e.exit_code)
    except StateUnavailable as e:  # one line, never a traceback
        print(time.strftime("%H:%M:%S"), f"error: {e.message}; this controller removed the job's nodes and exits: "
              f"once Postgres is back, sftctl status {job_id} marks the job FAILED_CONTROLLER (sftctl run starts it "
              "again)", file=sys.stderr, flush=True)
        return 1
    return 0 if status == JobStatus.SUCCEEDED else 1


def adopt(store: Store, job_id: str, reporter: Reporter | None = None) -> JobStatus:
    """Become the controller of ``job_id`` and drive it to a terminal status: a job whose
    controller died under way is adopted (:meth:`Controller._adopt`: its live nodes kept, the
    dead ones replaced per ``recovery:``), a PENDING one is run from the start. What
    ``python -m sftctl.controller JOB`` does, for a caller in Python (a server after its restart).

    Raises:
        ControllerBusy: a live controller holds the job (exit 2); nothing was changed.
        KeyError: no such job.
    """
    lock = claim_job(store, job_id)
    try:
        return Controller(store, job_id, reporter).run()
    finally:
        lock.release()

