"""The job lifecycle as an explicit state machine, and ``sftctl down``.

One controller drives one job (see :mod:`sftctl.state` for the statuses and allowed moves)::

    PENDING -> PROVISIONING -> LAUNCHING -> RUNNING -> SUCCEEDED
                                   ^           | a node failed, restarts left
                                   +- RECOVERING
    any live status -> FAILED | CANCELLED (Ctrl-C, SIGTERM, sftctl down) | FAILED_CONTROLLER

Every transition is written to state *before* the controller acts on it, and every node is
recorded before its provider creates it, so a controller that dies (even by SIGKILL) leaves a
state from which ``sftctl status`` tells the truth and ``sftctl down`` removes everything.

Attached, the controller runs inside ``sftctl run`` with a :class:`Reporter` that draws progress;
detached, it runs as ``python -m sftctl.controller JOB_ID`` in a session of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Protocol

from sftctl import procs, settings
from sftctl.catalog import Offering
from sftctl.errors import CapacityError, ExitCode, InfeasibleError, SftctlError
from sftctl.health.telemetry import REPLACE, RESTART
from sftctl.paths import job_dir
from sftctl.providers import get_provider
from sftctl.providers.base import NodeState, provision_all, terminate_all
from sftctl.queue import CANCEL_SIGNALS, CONTROLLER_OWNER, DOWN_REASON, ControllerBusy, claim_job  # shared with the waiting stage
from sftctl.spec import JobSpec, env_references, resolve_env
from sftctl.storage import StorageError
from sftctl.state import JobRecord, JobStatus, Store, controller_died_reason
from sftctl.types import AttemptStatus, FailureCode, FailureReason, NodeHandle, capabilities

POLL_S = 0.5
#: With job storage every poll lists each node's streams (about 5 requests per node): poll less
#: often there; S3 charges per request and a node ships its files every second anyway.
STORAGE_POLL_S = 2.0
REPLACED = NodeState.REPLACED  # the node status of a node a health verdict replaced (terminated too)
DOWN_GRACE_S = 20.0  # how long `sftctl down` lets a live controller clean up before killing it
STORAGE_OUTAGE_S = 300.0  # how long the job's storage may be unreachable before the job fails


# wait before a relaunch: 1 s, 2 s, 4 s, ... up to 30 s (restarts that fail fast do not spin)
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 30.0


def _error_code(e: SftctlError) -> str:
    """The :class:`FailureCode` value of an error that ended a job: a provider error's own
    (``no_capacity``, ``not_configured``, ``provider_error``); ``no_capacity`` when no offering
    of the plan had capacity (:class:`InfeasibleError`); else ``unknown``."""
    reason = getattr(e, "reason", None)
    if isinstance(reason, FailureReason):
        return reason.code.value
    if isinstance(e, InfeasibleError):
        return FailureCode.NO_CAPACITY.value
    return FailureCode.UNKNOWN.value


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an attempt ended: the reason (its ``message`` is the line state keeps), what to do
    (``restart``, ``replace`` or None: give up), the node it concerns, and the exit code when a
    script exited."""

    reason: FailureReason
    action: str | None
    node_rank: int | None
    exit_code: int | None = None
    verdict: str | None = None  # a health verdict's kind and evidence: the replaced machine is quarantined


class Cancelled(Exception):
    """The job was cancelled (Ctrl-C, SIGTERM, SIGHUP, or ``sftctl down`` won a race).

    ``exit_code``: the signal's exit code (128 + its number) when a signal cancelled the job.
    """

    def __init__(self, why: str = "", exit_code: "ExitCode | None" = None):
        super().__init__(why)
        self.exit_code = exit_code


class Reporter(Protocol):
    """Where the controller tells what happens. The CLI's attached view implements it."""

    def event(self, message: str) -> None: ...

    def log(self, rank: int, text: str) -> None: ...

    def metrics(self, samples: list[dict]) -> None: ...


class LogReporter:
    """Events as records of the ``sftctl.controller`` logger (the detached controller's
    ``main`` sends them to its log, ``controller.log``, one ``HH:MM:SS message`` line each)."""

    def event(self, message: str) -> None:
        logging.getLogger("sftctl.controller").info(message)

    def log(self, rank: int, text: str) -> None:
        pass

    def metrics(self, samples: list[dict]) -> None:
        pass


class _Guarded:
    """A reporter whose failures never reach the job: output that cannot be written (a closed
    pipe, a terminal that hung up) is dropped; the events are in state anyway."""

    def __init__(self, inner: Reporter):
        self.inner = inner
        self.broken = False

    def __getattr__(self, name: str):
        fn = getattr(self.inner, name)

        def call(*args, **kwargs):
            if self.broken:
                return None
            try:
                return fn(*args, **kwargs)
            except (OSError, ValueError):  # EIO, EPIPE, "I/O operation on closed file"
                self.broken = True
                return None

        return call


class Controller:
    """Runs one job from PENDING to a terminal status.

    Args:
        store: the state store.
        job_id: a job created by ``Store.create_job`` with ``provider`` and ``offering_json`` set
            (``offering_json`` holds the planner's :meth:`Plan.to_dict`).
        reporter: receives events, node log text and training metrics.
    """

    def __init__(self, store: Store, job_id: str, reporter: Reporter | None = None):
        self.store = store
        self.job_id = job_id
        self.reporter = _Guarded(reporter or LogReporter())
        # a reader or another sftctl holding state.db must not fail a healthy job: wait it out
        store.on_locked = lambda e: self.reporter.event(
            f"warning: the state database is locked by another process ({e}); waiting for it")
        job = store.get_job(job_id)
        if job is None:
            raise KeyError(job_id)
        self.created_at = job.created_at
        self.spec = JobSpec.model_validate(job.spec)
        self.plan_doc = job.plan
        self.offering = Offering(**self.plan_doc["offering"])
        self.provider = job_provider(job, self.offering.provider)
        self.blocked: list[CapacityError] = []  # capacity errors seen by this job: failover skips them
        # {"id", "rank", "handle" (a NodeHandle, None until provisioned), "generation" (replacements of this rank)}
        self.nodes: list[dict] = []
        # read offsets survive restarts: every attempt appends to the same node log and metrics
        self.log_offsets: dict[str, int] = {}
        self.metric_offsets: dict[str, dict[str, int]] = {}
        self.health_offsets: dict[str, dict[str, int]] = {}
        self.monitor = None
        self._queued_reason: str | None = None  # the scheduler's pending reason, as last recorded
        if self.spec.health.enabled:
            from sftctl.health.monitor import HealthMonitor

            self.monitor = HealthMonitor(self.spec.health.thresholds(), self.spec.train.steps)
        self.attempt = 0
        self._reported_attempt = 0  # the attempt whose first step report has been seen
        self.rank_nodes: dict[int, int] = {}  # training (global) rank -> node rank, as the nodes report
        self.restarts = job.restarts
        self.error: SftctlError | None = None  # what ended the job, when sftctl itself did (exit code)
        self.storage = getattr(getattr(self.provider, "channel", None), "storage", None)
        self.workdir_key: str | None = None
        self.rdzv_port: int | None = None  # claimed at the first launch, released at teardown

    # ---------------------------------------------------------------- lifecycle

    def run(self) -> JobStatus:
        """Drive the job to a terminal status and return it. Nodes are always torn down."""
        previous = _install_cancel_signals()
        try:
            self._admit()
            self._provision()
            while True:
                attempt = self.store.start_attempt(self.job_id)
                self._move(JobStatus.LAUNCHING, f"attempt {attempt}")
                self._launch(attempt)
                self._move(JobStatus.RUNNING)
                failure = self._monitor()
                if failure is None:
                    self.store.end_attempt(self.job_id, attempt, AttemptStatus.SUCCEEDED, 0, None)
                    self._move(JobStatus.SUCCEEDED)
                    break
                code = failure.reason.code.value
                self.store.end_attempt(self.job_id, attempt, AttemptStatus.FAILED, failure.exit_code, failure.reason.message, code)
                self._stop_nodes()
                if failure.action is None or self.restarts >= self.spec.recovery.max_restarts:
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
                if e.exit_code == ExitCode.TERMINATED and self._down_sent_sigterm():
                    why = DOWN_REASON
                self.error = SftctlError(why, exit_code=e.exit_code)  # `sftctl run` exits 128 + signal
            self.store.transition(self.job_id, JobStatus.CANCELLED, why, code=FailureCode.CANCELLED.value)
            self.store.end_open_attempts(self.job_id, AttemptStatus.CANCELLED, why, FailureCode.CANCELLED.value)
            self.reporter.event(f"cancelled: {why}")
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
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut teardown
            for signum in previous:  # nor a SIGHUP or SIGTERM that follows the first one
                signal.signal(signum, signal.SIG_IGN)
            try:
                self._teardown()
            finally:
                signal.signal(signal.SIGINT, signal.default_int_handler)
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
        if not capabilities(self.provider.name).local_admission:
            self._move(JobStatus.PROVISIONING)
            return
        if self.store.get_job(self.job_id).status == JobStatus.PROVISIONING:  # admitted by sftctl.queue
            self.reporter.event(JobStatus.PROVISIONING.value)
            return
        from sftctl.queue import wait_turn

        if not wait_turn(self.store, self.job_id, self.reporter.event):
            raise Cancelled("the job was ended by another process (sftctl down)")
        self.reporter.event(JobStatus.PROVISIONING.value)

    def _move(self, status: JobStatus, reason: str | None = None, code: str | None = None) -> None:
        if not self.store.transition(self.job_id, status, reason, code=code):
            raise Cancelled("the job was ended by another process (sftctl down)")
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
                self.provider = job_provider(self.store.get_job(self.job_id), nxt.provider)
                self.plan_doc = {**self.plan_doc, "offering": nxt.to_dict()}
                self.store.update_job(self.job_id, provider=nxt.provider, offering_json=self.plan_doc)
        self.store.add_event(self.job_id, "provision", f"{len(self.nodes)} node(s) ready on {self.provider.name}")
        self.reporter.event(f"{len(self.nodes)} node(s) ready on {self.provider.name}")

    def _provision_on(self, offering: Offering) -> None:
        """Record the nodes, then create them all in parallel; all or nothing."""
        self.nodes = []
        for rank in range(self.spec.resources.nodes):
            node_id = self.store.add_node(self.job_id, rank, self.provider.name)
            self.nodes.append({"id": node_id, "rank": rank, "handle": None, "generation": 0})
            self.log_offsets[node_id], self.metric_offsets[node_id], self.health_offsets[node_id] = 0, {}, {}
        try:
            handles = provision_all(self.provider, self.job_id, [(n["id"], n["rank"]) for n in self.nodes],
                                    offering, bootstrap_for=self._bootstrap, **self._provision_options())
        except BaseException:
            for n in self.nodes:  # provision_all removed what came up; the records say so
                self.store.update_node(n["id"], status=NodeState.TERMINATED.value, handle={"terminated": True})
            self.nodes = []
            raise
        for node, handle in zip(self.nodes, handles):
            node["handle"] = handle
            self.store.update_node(node["id"], status=NodeState.READY.value, handle=handle.to_dict())

    def _provision_options(self) -> dict:
        return {"spot": self.spec.resources.spot, "image": self.spec.resources.image}

    def _bootstrap(self, node_id: str, rank: int) -> str:
        """The first-boot script of a cloud node: install sftctl, run the node daemon."""
        if not capabilities(self.provider.name).boots_script:
            return ""
        from sftctl.templates import render

        return render("bootstrap.sh.j2", job_id=self.job_id, node_id=node_id, rank=rank,
                      storage_url=job_storage_url(self.spec, self.job_id) or "",
                      install=settings.get("SFTCTL_NODE_INSTALL") or _default_install())

    def _next_offering(self) -> Offering | None:
        """The best feasible candidate of the plan after the current one that no block rules out."""
        for c in self.plan_doc.get("candidates", []):
            if c.get("rejected") or "offering" not in c:
                continue
            o = Offering(**c["offering"])
            if o == self.offering or any(b.blocks(o.provider, o.region, o.instance_type) for b in self.blocked):
                continue
            return o
        return None

    def node_env(self, rank: int, attempt: int, master_port: int) -> dict[str, str]:
        """The environment every node gets: the spec's ``env`` and sftctl's own variables.

        ``SFTCTL_NODE_IPS`` is comma-separated in node-rank order; ``MASTER_ADDR``/``MASTER_PORT``
        and ``SFTCTL_RDZV_ENDPOINT`` point at node 0 for torchrun's c10d rendezvous.
        """
        spec = self.spec
        ips = [(n["handle"].ip if n["handle"] is not None else None) or "127.0.0.1" for n in self.nodes]
        env = resolve_env(spec.env)  # the spec holds ${VAR} references; values only reach the node
        env.update({k: os.environ[k] for k in spec.secrets if k in os.environ})  # values never stored
        url = job_storage_url(spec, self.job_id)
        if url is not None:  # nodes keep checkpoints on their disk and in the job's storage
            env.update(settings.node_env(storage_url=url))
            if self.workdir_key:
                env.update(settings.node_env(workdir_key=self.workdir_key, workdir_storage=spec.storage.url))
            if spec.train.checkpoint_dir:
                env.update(settings.node_env(checkpoint_dir=spec.train.checkpoint_dir))
        else:
            env.update(settings.node_env(
                checkpoint_dir=spec.train.checkpoint_dir or str(job_dir(self.job_id) / "checkpoints")))
        # the node's SFTCTL_* variables: names and formats from sftctl.settings
        env.update(settings.node_env(
            keep_checkpoints=spec.train.keep_checkpoints,
            compile=spec.train.compile,
            # the strategy the plan chose for this offering (sftctl.train.prepare runs it)
            parallelism=self._planned("parallelism") or (
                spec.train.parallelism if spec.train.parallelism != "auto" else "ddp"),
            activation_checkpointing=bool(self._planned("activation_checkpointing")
                                          or spec.train.activation_checkpointing),
            grad_accum=max(1, spec.resources.nodes // len(self.nodes)),
            job_id=self.job_id,
            node_rank=rank,
            num_nodes=len(self.nodes),
            node_ips=",".join(ips),
            nproc_per_node=self.offering.count,
            attempt=attempt,
            node_generation=next(n.get("generation", 0) for n in self.nodes if n["rank"] == rank),
            health_interval_s=spec.health.interval_s,
            agent_address=spec.health.metrics_address,
            checkpoint_interval=spec.train.checkpoint_interval,
            train_steps=spec.train.steps,
        ))
        env.update(
            MASTER_ADDR=ips[0],
            MASTER_PORT=str(master_port),
            **settings.node_env(rdzv_endpoint=f"{ips[0]}:{master_port}", rdzv_is_host=rank == 0),
            # torchrun reads PET_<OPTION> for each option it is not given, so `run: torchrun
            # train.py` joins the job's rendezvous without spelling out --nnodes --rdzv-*
            PET_NNODES=str(len(self.nodes)),
            PET_NPROC_PER_NODE=str(self.offering.count),
            PET_NODE_RANK=str(rank),
            PET_RDZV_BACKEND="c10d",
            PET_RDZV_ENDPOINT=f"{ips[0]}:{master_port}",
            PET_RDZV_ID=self.job_id,
            PET_RDZV_CONF=f"is_host={1 if rank == 0 else 0}",
            PET_MAX_RESTARTS="0",  # sftctl restarts the job itself, from its last checkpoint
        )
        if spec.model is not None:
            env.update(settings.node_env(
                model_entrypoint=spec.model.entrypoint,
                # the planned per-rank share; fewer nodes than planned (elastic) accumulate more of them
                batch_size=max(1, spec.model.batch_size // (spec.resources.nodes * self.offering.count)),
                dtype=spec.model.dtype,
                matmul_precision=spec.model.matmul_precision,
            ))
        return env

    def _planned(self, key: str):
        """The plan's choice for the offering the job runs on (``parallelism``,
        ``activation_checkpointing``), or None (no model, or a plan made before strategies)."""
        for c in self.plan_doc.get("candidates", []):  # after a failover: that offering's own choice
            if not c.get("rejected") and "offering" in c and Offering(**c["offering"]) == self.offering:
                return c.get(key)
        return self.plan_doc.get(key)

    def _launch(self, attempt: int) -> None:
        from sftctl.templates import render

        if self.storage is not None and self.workdir_key is None:
            from sftctl.storage import open_storage
            from sftctl.storage.workdir import upload_workdir

            # under the storage's root, not the job's prefix: an unchanged workdir is uploaded once
            packed = upload_workdir(open_storage(self.spec.storage.url), self.spec.workdir,
                                    max_bytes=int(self.spec.storage.max_workdir_mb * 2**20))
            self.workdir_key = packed.key
            self.store.add_event(self.job_id, "storage", f"workdir {packed.key} ({packed.size_bytes / 2**20:.1f} MiB"
                                 f"{', already there' if not packed.uploaded else ''}) in {self.spec.storage.url}",
                                 {"workdir_key": packed.key, "uploaded": packed.uploaded})  # for `down --purge`
        if attempt == 1:
            claim_checkpoint_dir(self.spec, self.job_id)
        if self.rdzv_port is None:  # one port for the whole job: relaunches reuse it
            self.rdzv_port = claim_rendezvous_port(self.job_id)
        port = self.rdzv_port
        for node in self.nodes:
            script = render(
                "node.sh.j2",
                job_id=self.job_id,
                node_id=node["id"],
                rank=node["rank"],
                attempt=attempt,
                workdir=self.spec.workdir,
                setup=self.spec.setup,
                run=self.spec.run,
                health=self.spec.health.enabled,
                secrets=required_secrets(self.spec),
            )
            env = self.node_env(node["rank"], attempt, port)
            node["handle"] = self.provider.launch(node["handle"], script, env, attempt)
            self.store.update_node(node["id"], status=NodeState.RUNNING.value, handle=node["handle"].to_dict())
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
        keepalive = getattr(self.provider, "keepalive", None)
        while True:
            try:
                if keepalive is not None:
                    keepalive(self.job_id)
                self._drain()
                statuses = [(n, self.provider.status(n["handle"])) for n in self.nodes]
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
            for node, st in statuses:
                if st.state == NodeState.FAILED:
                    self._drain()
                    why = self._exit_reason(node, st.exit_code)
                    # a full disk stays full, a missing secret stays missing: restarting hits them again
                    action = None if why.code in (FailureCode.DISK_FULL, FailureCode.SECRET_MISSING) else RESTART
                    return Failure(why, action, node["rank"], st.exit_code)
                if st.state == NodeState.LOST:
                    return Failure(FailureReason(FailureCode.NODE_LOST, f"node {node['rank']}: {st.detail}",
                                                 {"node_rank": node["rank"]}), REPLACE, node["rank"])
            if all(st.state == NodeState.SUCCEEDED for _, st in statuses):
                self._drain()
                return None
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

    def _record_details(self, statuses: list) -> None:
        """What the provider says of running nodes (a Slurm job's pending reason): one event per
        new detail, naming every node that reports it; such nodes are recorded as PENDING, and
        the job's ``pending_reason`` is the first such detail until none is pending."""
        changed: dict[str, list[int]] = {}
        for node, st in statuses:
            if st.state == NodeState.RUNNING and st.detail != node.get("detail", ""):
                node["detail"] = st.detail
                if st.detail:
                    changed.setdefault(st.detail, []).append(node["rank"])
                self.store.update_node(node["id"], status=NodeState.PENDING if st.pending else NodeState.RUNNING)
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

    def _resume_point(self) -> str:
        """Where a relaunch resumes: the newest complete checkpoint, if this machine sees it."""
        from sftctl.storage.checkpoints import complete_checkpoint_steps

        url = self.storage.url if self.storage is not None else None  # canonical: file:// for a directory
        root = url or self.spec.train.checkpoint_dir or str(job_dir(self.job_id) / "checkpoints")
        # Slurm on a login node shares its filesystem with the nodes; over SSH it does not
        here = capabilities(self.provider.name).shares_filesystem and not getattr(
            getattr(self.provider, "runner", None), "remote", False)
        steps = complete_checkpoint_steps(root) if url or here else None
        if steps is None:
            return "from the last checkpoint"
        return f"from checkpoint step {steps[-1]}" if steps else "from step 0 (no checkpoint yet)"

    def _replace(self, rank: int, quarantine: str | None = None) -> None:
        """Terminate node ``rank`` and provision a new node in its place (a new node id). With
        ``quarantine`` (a health verdict) the machine it ran on is kept out first
        (:meth:`Provider.quarantine`: anti-affinity and cordon on Kubernetes, ``--exclude`` on Slurm)."""
        i = next(i for i, n in enumerate(self.nodes) if n["rank"] == rank)
        old = self.nodes[i]
        if quarantine and old["handle"]:
            self._quarantine(old, quarantine)
        self.provider.terminate(old["handle"])
        self.store.update_node(old["id"], status=REPLACED, handle=old["handle"].with_(terminated=True).to_dict())
        node_id = self.store.add_node(self.job_id, rank, self.provider.name)
        new = {"id": node_id, "rank": rank, "handle": None, "generation": old.get("generation", 0) + 1}
        self.nodes[i] = new
        self.log_offsets[node_id], self.metric_offsets[node_id], self.health_offsets[node_id] = 0, {}, {}
        try:
            new["handle"] = self.provider.provision(self.job_id, node_id, rank, self.offering,
                                                    bootstrap=self._bootstrap(node_id, rank), **self._provision_options())
        except CapacityError as e:
            self.store.update_node(node_id, status=NodeState.FAILED.value)
            if not self._shrink(i, rank, e):
                raise
            return
        self.store.update_node(node_id, status=NodeState.READY.value, handle=new["handle"].to_dict())
        if self.monitor is not None:
            self.monitor.reset_node(rank)
        message = f"node {rank} replaced: {old['id']} -> {node_id}"
        self.store.add_event(self.job_id, "replace", message)
        self.reporter.event(message)

    def _quarantine(self, node: dict, verdict: str) -> None:
        """Ask the provider to keep ``node``'s machine out (best effort) and record what it did."""
        quarantine = getattr(self.provider, "quarantine", None)
        if quarantine is None:  # a provider outside this package that predates the method
            return
        try:
            done = quarantine(node["handle"], verdict)
        except SftctlError as e:
            done = {"machine": None, "actions": [], "message": f"could not keep its machine out: {e.message}"}
        if not done:
            return
        message = f"node {node['rank']}: {done['message']}"
        self.store.add_event(self.job_id, "quarantine", message,
                             {k: v for k, v in done.items() if k != "message"} | {"node_id": node["id"]})
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
        for new_rank, node in enumerate(sorted(self.nodes, key=lambda n: n["rank"])):
            if node["rank"] != new_rank:
                node["rank"] = new_rank
                if node["handle"] is not None:
                    node["handle"] = node["handle"].with_(rank=new_rank)
                self.store.update_node(node["id"], rank=new_rank,
                                       handle=node["handle"].to_dict() if node["handle"] is not None else {})
        self.nodes.sort(key=lambda n: n["rank"])
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

    def _drain(self) -> None:
        """Pass new log text and metrics of every node to the reporter; record metrics."""
        batch: list[dict] = []
        placed: dict[int, int] = {}
        for node in self.nodes:
            data, self.log_offsets[node["id"]] = self.provider.read_log(
                node["handle"], self.log_offsets[node["id"]]
            )
            if data:
                text = data.decode("utf-8", "replace")
                self.reporter.log(node["rank"], text)
            records = self.provider.read_metrics(node["handle"], self.metric_offsets[node["id"]])
            samples = [s for s in records if "step" in s]  # the rest are heartbeats
            for r in {int(s["rank"]) for s in records if s.get("rank") is not None}:
                placed[r] = node["rank"]
            if samples:
                self.reporter.metrics(samples)
                batch += [{**s, "rank": s.get("rank", node["rank"])} for s in samples]
            if self.monitor is not None:
                self.monitor.add_metrics(node["rank"], records, time.time())
                gpu = self.provider.read_health(node["handle"], self.health_offsets[node["id"]])
                for problem in {s["agent_error"] for s in gpu if "agent_error" in s}:
                    # the agent keeps going without that part, so the job does too, but says so
                    message = f"node {node['rank']}: health agent: {problem}"
                    self.store.add_event(self.job_id, "health", message)
                    self.reporter.event(f"warning: {message}")
                self.monitor.add_gpu(node["rank"], gpu)
        if any(self.rank_nodes.get(r) != n for r, n in placed.items()):  # c10d decides: say which node got which rank
            self.rank_nodes.update(placed)
            pairs = sorted(self.rank_nodes.items())
            self.store.add_event(self.job_id, "ranks", "rank -> node: " + ", ".join(f"{r} -> {n}" for r, n in pairs),
                                 {"ranks": {str(r): n for r, n in pairs}})
        if batch:
            self.store.record_metrics(self.job_id, batch)
            if self._reported_attempt != self.attempt:
                self._reported_attempt = self.attempt
                first = min(int(s["step"]) for s in batch)
                self.store.add_event(self.job_id, "progress", f"attempt {self.attempt}: first step reported is {first}")

    def _exit_reason(self, node: dict, code: int | None) -> FailureReason:
        """Node ``node`` exited with ``code``: the node's own failure record says why (OOM, an
        exception, a signal; see :mod:`sftctl.failure`), else the code alone (``exit``)."""
        line = f"node {node['rank']} exited with code {code}"
        data = {"node_rank": node["rank"], "exit_code": code}
        why = self.provider.read_failure(node["handle"])
        if why is None:
            return FailureReason(FailureCode.EXIT, line, data)
        return FailureReason(why.code, f"{line}: {why.message}", {**why.data, **data})

    def _down_sent_sigterm(self) -> bool:
        """True when ``sftctl down`` recorded, before signalling, that it sends this controller SIGTERM."""
        return any(e.kind == "down" and (e.data or {}).get("signal") == "SIGTERM" and
                   (e.data or {}).get("controller_pid") == os.getpid() for e in self.store.events(self.job_id))

    def _stop_nodes(self) -> None:
        for node in self.nodes:
            self.provider.stop_attempt(node["handle"])

    def _teardown(self) -> None:
        terminate_all(self.provider, [n["handle"] for n in self.nodes if n["handle"] is not None],
                      progress=self.reporter.event)  # all at once: a wide job comes down as fast as one node
        for node in self.nodes:
            if node["handle"] is not None:
                node["handle"] = node["handle"].with_(terminated=True)
            self.store.update_node(node["id"], status=NodeState.TERMINATED.value,
                                   handle=node["handle"].to_dict() if node["handle"] is not None else {"terminated": True})
        leftover = self.provider.terminate_tagged(self.job_id)
        message = f"terminated {len(self.nodes)} node(s)" + (
            f" and {leftover} stray process(es)" if leftover else ""
        )
        self.store.add_event(self.job_id, "teardown", message)
        self.reporter.event(message)
        release_rendezvous_port(self.rdzv_port)  # its nodes are gone: the port is free again


# -------------------------------------------------------------------- down and reconciliation


def down(store: Store, job_id: str, progress: Callable[[str], None] | None = None) -> str:
    """Cancel a job if it is live and remove every node and process it has. Idempotent: safe to
    run again, also while another ``down`` of it runs or after one was interrupted.

    A live controller gets SIGTERM and ``DOWN_GRACE_S`` seconds to tear down by itself; then this
    function terminates whatever the state and the provider's tags still show, every node at
    once (:func:`sftctl.providers.base.terminate_all`: 200 local nodes in about a second), and
    SIGKILLs a controller that did not exit. ``progress(line)``, when given, hears what it waits
    on (the controller; the nodes, with a count every few seconds of a long teardown). Returns
    a one-line summary.
    """
    from concurrent.futures import ThreadPoolExecutor

    say = progress or (lambda line: None)
    job = store.get_job(job_id)
    if job is None:
        raise KeyError(job_id)
    pid, ticks = job.controller_pid, job.controller_start_ticks
    controller_was_alive = bool(pid and pid != os.getpid() and procs.alive(pid, ticks))
    if controller_was_alive:
        # said first, so the controller's reason names sftctl down, not an anonymous SIGTERM
        store.add_event(job_id, "down", f"sftctl down: SIGTERM to the controller (pid {pid})",
                        {"signal": "SIGTERM", "controller_pid": pid})
        say(f"{job_id}: waiting up to {DOWN_GRACE_S:.0f} s for its controller (pid {pid}) to stop its nodes")
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + DOWN_GRACE_S
        while procs.alive(pid, ticks) and time.monotonic() < end:
            time.sleep(0.1)
        if procs.alive(pid, ticks):
            procs.kill_all([pid], grace_s=0)
    cancelled = store.transition(job_id, JobStatus.CANCELLED, DOWN_REASON, strict=False,
                                 code=FailureCode.CANCELLED.value)
    provider = job_provider(job)
    up = [n for n in store.nodes(job_id) if n.status not in (NodeState.TERMINATED.value, REPLACED)]
    handles = [n.node_handle for n in up if n.node_handle is not None]
    if up:
        say(f"{job_id}: taking down {len(up)} node(s)")
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(handles)))) as pool:  # a cloud's status is a call
        running = sum(st.state == NodeState.RUNNING for st in pool.map(provider.status, handles))
    terminate_all(provider, handles, progress=lambda line: say(f"{job_id}: {line}"))
    for node in up:
        store.update_node(node.id, status=NodeState.TERMINATED.value, handle={**node.handle, "terminated": True})
    released = len(up)
    strays = provider.terminate_tagged(job_id)
    store.end_open_attempts(job_id, AttemptStatus.ABANDONED, "the controller was gone; ended by sftctl down",
                            FailureCode.CONTROLLER_DIED.value)
    after = store.get_job(job_id)
    if not (cancelled or controller_was_alive or released or strays):
        return f"{job_id}: {after.status.value.lower()}, nothing left to take down"
    if after.status == JobStatus.FAILED_CONTROLLER:  # only a reaped controller ends a job so
        store.update_job(job_id, failure_reason=controller_died_reason(job_id, after.controller_pid, nodes_removed=True))
    parts = [f"{job_id}: " + ("cancelled" if cancelled else after.status.value.lower())]
    if running:
        parts.append(f"stopped {running} running node(s)")
    elif controller_was_alive:
        parts.append("its controller stopped the nodes")
    else:
        parts.append("no node was running")
    if released:
        parts.append(f"released {released} node(s)")
    if strays:
        parts.append(f"killed {strays} stray process(es)")
    summary = ", ".join(parts)
    store.add_event(job_id, "down", summary)
    return summary


def purge(store: Store, job_id: str) -> dict:
    """Remove what sftctl wrote for a job that is down (``sftctl down JOB --purge``). Idempotent.

    Removed: under the job's storage prefix (``<storage>/<job id>/``) the objects of
    :data:`sftctl.storage.SFTCTL_PREFIXES` (checkpoints, node logs, metrics and health streams,
    launch requests, exit codes); the workdir pack under the storage root when this job uploaded
    it and no live job of this state uses it; the job's local directory
    (``$SFTCTL_HOME/jobs/<job id>``: local nodes, logs, default checkpoints, controller log).
    Never removed: the bucket or directory itself and its marker, anything else under the job's
    prefix, a spec's own ``train.checkpoint_dir``, a Slurm job's directory on a remote cluster;
    those that exist are listed under ``kept``. The job's record and events stay in the state.

    Returns:
        ``{"job_id", "objects", "bytes", "removed": [{"where", "objects", "bytes"}],
        "kept": [{"where", "why"}]}`` (bytes: the sizes the storage listed before deleting).

    Raises:
        KeyError: no such job.
        SftctlError: (exit 2) the job is not down: it is live, or nodes of it may still run.
        StorageError: the job's storage failed (exit 4).
    """
    import shutil

    from sftctl.state import TERMINAL

    job = store.get_job(job_id)
    if job is None:
        raise KeyError(job_id)
    alive = bool(job.controller_pid and procs.alive(job.controller_pid, job.controller_start_ticks))
    up = [n for n in store.nodes(job_id) if n.status not in (NodeState.TERMINATED, REPLACED, NodeState.FAILED)]
    if job.status not in TERMINAL or alive or up:
        why = f"{len(up)} node(s) may still run" if up and job.status in TERMINAL else job.status.value
        raise SftctlError(f"job {job_id} is {why}: --purge removes its storage only when the job is down",
                          hint=f"sftctl down {job_id} --purge (takes it down first)")
    spec = JobSpec.model_validate(job.spec)
    removed: list[dict] = []
    kept: list[dict] = []
    url = job_storage_url(spec, job_id)
    if url is not None:
        from sftctl.storage import LocalStorage, open_storage

        storage = open_storage(url)
        if isinstance(storage, LocalStorage) and storage.mount is not None and not storage.mount.is_dir():
            kept.append({"where": storage.url, "why": f"the claim is not mounted here ({storage.mount})"})
        else:
            n, size = storage.delete_prefixes()
            removed.append({"where": storage.url, "objects": n, "bytes": size})
            rest = storage.list("")
            if rest:
                kept.append({"where": storage.url, "why": f"{len(rest)} object(s) sftctl did not write"})
            elif isinstance(storage, LocalStorage):
                with contextlib.suppress(OSError):
                    storage.root.rmdir()
            removed += _purge_workdir_pack(store, job_id, spec, kept)
    local = job_dir(job_id)
    if local.exists():
        files = [p for p in local.rglob("*") if p.is_file() and not p.is_symlink()]
        size = sum(p.stat().st_size for p in files)
        shutil.rmtree(local, ignore_errors=True)
        if local.exists():
            kept.append({"where": str(local), "why": "some files could not be removed"})
        removed.append({"where": str(local), "objects": len(files), "bytes": size})
    own = checkpoint_dir_path(spec)
    if own is not None and own.exists():
        kept.append({"where": str(own), "why": "train.checkpoint_dir is yours: sftctl never deletes it"})
    remote = {(n.handle or {}).get("root") for n in store.nodes(job_id) if job.provider == "slurm"}
    for root in sorted(r for r in remote if r and not Path(r).is_relative_to(local)):  # over ssh
        kept.append({"where": root, "why": "the job's directory on the Slurm cluster: remove it there"})
    doc = {"job_id": job_id, "objects": sum(r["objects"] for r in removed),
           "bytes": sum(r["bytes"] for r in removed), "removed": removed, "kept": kept}
    store.add_event(job_id, "purge", f"purged {doc['objects']} object(s), {doc['bytes']} bytes", doc)
    return doc


def _purge_workdir_pack(store: Store, job_id: str, spec: JobSpec, kept: list[dict]) -> list[dict]:
    """Delete the workdir pack this job uploaded to its storage root (packs are shared by content
    hash), unless a live job of this state uses the same one."""
    from sftctl.state import TERMINAL
    from sftctl.storage import open_storage

    def packs(jid: str) -> list[dict]:
        return [e.data for e in store.events(jid) if e.kind == "storage" and (e.data or {}).get("workdir_key")]

    mine = [d for d in packs(job_id) if d.get("uploaded")]
    if not mine:
        return []
    key = mine[0]["workdir_key"]
    for other in store.list_jobs():
        if other.id == job_id or other.status in TERMINAL:
            continue
        other_spec = other.spec or {}
        if (other_spec.get("storage") or {}).get("url") == spec.storage.url and any(
                d["workdir_key"] == key for d in packs(other.id)):
            kept.append({"where": f"{spec.storage.url.rstrip('/')}/{key}", "why": f"live job {other.id} uses it"})
            return []
    root = open_storage(spec.storage.url)
    size = root.size(key)
    if size is None:
        return []
    root.delete(key)
    return [{"where": f"{root.url.rstrip('/')}/{key}", "objects": 1, "bytes": size}]


def preview(spec: JobSpec, plan_doc: dict, job_id: str = "<job-id>") -> dict:
    """What ``sftctl run`` would provision and start, rendered but not done (``run --dry-run``).

    Returns ``{"offering", "nodes": [{"rank", "env", "script", "bootstrap"}], "other_nodes",
    "submits": [{"name", "text"}]}``: node 0 in full (its environment with secret values shown as
    ``<secret>``, its attempt script ``node.sh`` and, on a cloud, its first-boot script), the rest
    summarised, so the output stays the same size for 2 nodes or 10,000: ``other_nodes`` is None
    for one node, else ``{"count", "ranks": [first, last], "env_differs": [names],
    "script_lines_differ": n, "bootstrap_lines_differ": n}`` (what rank 1 has that node 0 has not:
    its rank, node id, address...); ``submits``: what the scheduler would be handed (Slurm's sbatch
    and step scripts, node 0's Kubernetes manifests). Nothing is recorded, created or started.
    """
    import difflib

    c = Controller.__new__(Controller)  # rendering only: no store, no provider
    c.spec, c.job_id, c.plan_doc = spec, job_id, plan_doc
    c.offering = Offering(**plan_doc["offering"])
    cloud = not capabilities(c.offering.provider).local_admission
    count = spec.resources.nodes
    c.nodes = [{"id": f"{job_id}-n{r}", "rank": r, "generation": 0,
                "handle": NodeHandle(job_id=job_id, node_id=f"{job_id}-n{r}", rank=r,
                                     ip=f"<node {r} ip>" if cloud else "127.0.0.1")}
               for r in range(count)]
    c.workdir_key = "<workdir pack>" if spec.storage is not None else None
    nodes = [_preview_node(c, spec, n, cloud) for n in c.nodes[:2]]  # node 0 in full, node 1 for what differs
    if count == 1:
        return {"offering": c.offering.to_dict(), "nodes": nodes, "other_nodes": None,
                "submits": _preview_submits(spec, c, nodes)}

    def changed(a: str | None, b: str | None) -> int:
        lines = difflib.ndiff((a or "").splitlines(), (b or "").splitlines())
        return sum(line.startswith("+ ") for line in lines)

    first, second = nodes
    others = {"count": count - 1, "ranks": [1, count - 1],
              "env_differs": sorted(k for k in first["env"].keys() | second["env"].keys()
                                    if first["env"].get(k) != second["env"].get(k)),
              "script_lines_differ": changed(first["script"], second["script"]),
              "bootstrap_lines_differ": changed(first["bootstrap"], second["bootstrap"])}
    return {"offering": c.offering.to_dict(), "nodes": [first], "other_nodes": others,
            "submits": _preview_submits(spec, c, [first])}


def node_env_names(spec: JobSpec, plan_doc: dict) -> set[str]:
    """The names of the environment every node of ``spec`` gets on the plan's offering (the
    spec's ``env`` and ``secrets``, sftctl's own variables): what ``run:`` may expand."""
    c = Controller.__new__(Controller)  # no store, no provider: the names only
    c.spec, c.job_id, c.plan_doc = spec, "<job-id>", plan_doc
    c.offering = Offering(**plan_doc["offering"])
    c.nodes = [{"id": "<node>", "rank": 0, "generation": 0,
                "handle": NodeHandle(job_id="<job-id>", node_id="<node>", rank=0, ip="127.0.0.1")}]
    c.workdir_key = "<workdir pack>" if spec.storage is not None else None
    return set(c.node_env(0, 1, 0)) | set(spec.env) | set(spec.secrets)


def _preview_node(c: Controller, spec: JobSpec, n: dict, cloud: bool) -> dict:
    """One node of :func:`preview`: ``{"rank", "env", "script", "bootstrap"}``."""
    from sftctl.templates import render

    job_id = c.job_id
    env = c.node_env(n["rank"], 1, "<rendezvous port>")
    env.update({k: "<secret>" for k in spec.secrets if k in env})
    env.update({k: v for k, v in spec.env.items() if env_references(v)})  # ${MY_API_TOKEN}, not its value
    script = render("node.sh.j2", job_id=job_id, node_id=n["id"], rank=n["rank"], attempt=1,
                    workdir=spec.workdir, setup=spec.setup, run=spec.run, health=spec.health.enabled,
                    secrets=required_secrets(spec))
    bootstrap = None
    if cloud:
        bootstrap = render("bootstrap.sh.j2", job_id=job_id, node_id=n["id"], rank=n["rank"],
                           storage_url=job_storage_url(spec, job_id) or "",
                           install=settings.get("SFTCTL_NODE_INSTALL") or _default_install())
    return {"rank": n["rank"], "env": env, "script": script, "bootstrap": bootstrap}


def _preview_submits(spec: JobSpec, c: "Controller", nodes: list[dict]) -> list[dict]:
    """What ``preview`` adds per provider: ``[{"name", "text"}]``, the documents sftctl would hand
    the scheduler: Slurm's ``sbatch.sh`` and ``step.sh``, the shown nodes' Kubernetes manifests
    (Secret values shown as ``<secret>``). Empty for the others (their nodes get ``bootstrap``)."""
    provider = c.offering.provider
    if provider == "slurm":
        from sftctl.providers import get_provider

        slurm = get_provider("slurm", config=spec.slurm.model_dump() if spec.slurm else None,
                             num_nodes=spec.resources.nodes, time_limit_s=spec.resources.deadline_s)
        scripts = slurm.batch_scripts(c.job_id, 1, [n["id"] for n in c.nodes], c.offering)
        return [{"name": f"attempt-1/{name}", "text": text} for name, text in scripts.items()]
    if provider == "kubernetes":
        import yaml

        from sftctl.providers.cloud import InstanceRequest
        from sftctl.providers.kubernetes import node_manifests

        out = []
        secrets = {k: "<secret>" for k in required_secrets(spec)}
        for n, shown_node in zip(c.nodes, nodes):
            request = InstanceRequest(job_id=c.job_id, node_id=n["id"], rank=n["rank"], offering=c.offering,
                                      zone=None, spot=spec.resources.spot, bootstrap=shown_node["bootstrap"] or "",
                                      image=spec.resources.image)
            objs = node_manifests(request, namespace=settings.get("SFTCTL_K8S_NAMESPACE") or "default",
                                  secrets=secrets or None, num_nodes=spec.resources.nodes)
            out.append({"name": f"node {n['rank']}: Kubernetes objects",
                        "text": yaml.safe_dump_all([o for o in objs.values() if o is not None], sort_keys=False)})
        return out
    return []


OWNER_FILE = ".sftctl-job"  # in a spec's train.checkpoint_dir: the job whose checkpoints it holds


def checkpoint_dir_path(spec: JobSpec) -> Path | None:
    """The spec's own ``train.checkpoint_dir`` on this machine (relative to the workdir, where
    the nodes run), or None when the job keeps checkpoints in its job dir or its storage."""
    if spec.train.checkpoint_dir is None or spec.storage is not None:
        return None
    return (Path(spec.workdir) / os.path.expanduser(spec.train.checkpoint_dir)).resolve()


def check_checkpoint_dir(spec: JobSpec) -> None:
    """Refuse a ``train.checkpoint_dir`` that holds another run's checkpoints (a new job would
    silently resume its weights) unless ``train.resume_from`` names that job (or is ``any``).

    Raises:
        SpecError: the directory holds complete checkpoints of another job or of an unknown run.
    """
    from sftctl.errors import SpecError
    from sftctl.storage.checkpoints import complete_checkpoint_steps

    root = checkpoint_dir_path(spec)
    if root is None or not root.is_dir():
        return
    steps = complete_checkpoint_steps(root)
    if not steps:
        return
    try:
        owner = (root / OWNER_FILE).read_text().strip() or None
    except OSError:
        owner = None
    wanted = spec.train.resume_from
    if wanted == "any" or (wanted is not None and wanted == owner):
        return
    whose = f"job {owner}" if owner else "a run sftctl did not start"
    if wanted is not None:
        raise SpecError(f"train.resume_from: {wanted} but {root} holds the checkpoints of {whose}",
                        hint=f"set train.resume_from: {owner or 'any'}, or give an empty train.checkpoint_dir")
    raise SpecError(
        f"train.checkpoint_dir: {root} holds checkpoints of {whose} (up to step {steps[-1]}); "
        "this job would resume from them",
        hint=f"to continue that run set train.resume_from: {owner or 'any'}; for a fresh start use another "
             "checkpoint_dir (or none: each job gets its own)",
    )


def claim_checkpoint_dir(spec: JobSpec, job_id: str) -> None:
    """Mark the spec's ``train.checkpoint_dir`` as holding this job's checkpoints."""
    root = checkpoint_dir_path(spec)
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / OWNER_FILE).write_text(job_id + "\n")
    except OSError:  # a read-only dir: the training script's own save says so, with its error
        pass


def job_storage_url(spec: JobSpec, job_id: str) -> str | None:
    """Where this job keeps its code, checkpoints, logs and telemetry: ``<storage.url>/<job id>``."""
    if spec.storage is None:
        return None
    return f"{spec.storage.url.rstrip('/')}/{job_id}"


def job_provider(job: JobRecord, name: str | None = None):
    """The provider of ``job`` (``name`` overrides the recorded one), wired to the job's storage."""
    name = name or job.provider or "local"
    spec = JobSpec.model_validate(job.spec)
    url = job_storage_url(spec, job.id)
    if name == "slurm":  # one allocation of resources.nodes, --time from the deadline
        return get_provider(name, config=spec.slurm.model_dump() if spec.slurm else None,
                            num_nodes=spec.resources.nodes, time_limit_s=spec.resources.deadline_s)
    options = _provider_options(spec, name)
    if url is None:
        return get_provider(name, **options)
    from sftctl.storage import open_storage
    from sftctl.storage.stream import NodeChannel

    kwargs = {}
    secret_env = secret_env_keys(spec)
    if name == "kubernetes":  # a Kubernetes Secret carries the secrets; pods learn the world size
        refs = {k: v for k, v in spec.env.items() if k in secret_env
                and all(name in os.environ for name in env_references(v))}  # `down` from another shell
        kwargs = {"secrets": {**{k: os.environ[k] for k in spec.secrets if k in os.environ}, **resolve_env(refs)},
                  "num_nodes": spec.resources.nodes}
    return get_provider(name, channel=NodeChannel(open_storage(url), secret_keys=set(spec.secrets) | secret_env),
                        **kwargs, **options)


def secret_env_keys(spec: JobSpec) -> set[str]:
    """The ``env:`` variables that carry a secret: their value refers to a variable named in
    ``secrets:`` or one whose name says it is secret (``${MY_API_TOKEN}``, see
    :func:`sftctl.protocol.is_secret_name`). Job storage holds their names, not values;
    on Kubernetes the job's Secret carries them."""
    from sftctl.protocol import is_secret_name

    return {k for k, v in spec.env.items()
            if any(name in spec.secrets or is_secret_name(name) for name in env_references(v))}


def required_secrets(spec: JobSpec) -> list[str]:
    """The variables a node refuses to run without (``templates/node.sh.j2``): every name in
    ``secrets:`` and every ``env:`` variable that carries a secret (:func:`secret_env_keys`), so
    a secret that did not arrive stops the attempt with a line naming it, never runs empty."""
    names = set(spec.secrets) | secret_env_keys(spec)
    return sorted(n for n in names if n.isascii() and n.isidentifier())


def _provider_options(spec: JobSpec, name: str) -> dict:
    """Per-cloud settings from the spec, else from this shell's configuration: the IAM instance
    profile of AWS nodes (``resources.instance_profile``, else ``$SFTCTL_AWS_INSTANCE_PROFILE``)."""
    if name == "aws":
        profile = spec.resources.instance_profile or settings.get("SFTCTL_AWS_INSTANCE_PROFILE")
        if profile:
            return {"instance_profile": profile}
    return {}


def _default_install() -> str:
    from sftctl import __version__

    return f"sftctl[aws,gcp]=={__version__}"


def down_orphans(store: Store | None, checked: list[str] | None = None) -> list[str]:
    """Stop every live controller, and delete every labelled resource on every configured
    provider, whose job is gone or ended.

    A job is gone when this machine's state does not know it (``store`` None: the state is
    unreadable, every job is gone); ended when its status is terminal. Controllers are found by
    their job directories' ``controller.json`` (see :func:`sftctl.queue.claim_job`), outside the state.
    Returns one summary line per job swept; ``checked`` (when given) receives the providers asked.
    """
    from sftctl.providers import PROVIDERS, configured

    out = _stop_unknown_controllers(store)
    for name in PROVIDERS:
        if configured(name) is not None:
            continue
        if checked is not None:
            checked.append(name)
        try:
            provider = get_provider(name)
            found = provider.list_instances(None)
        except SftctlError as e:
            out.append(f"{name}: skipped ({e.message})")
            continue
        for job_id in sorted({r.get("job_id") or "?" for r in found}):
            job = store.get_job(job_id) if store is not None else None
            if job is not None and not job.status.terminal:
                continue
            n = provider.terminate_tagged(job_id)
            why = "unknown job" if job is None else job.status.value.lower()
            out.append(f"{name}: {job_id} ({why}): removed {n} resource(s)")
    return out


def _stop_unknown_controllers(store: Store | None) -> list[str]:
    """SIGTERM (then SIGKILL after ``DOWN_GRACE_S``) each live controller on this host whose job
    the state does not know; its teardown removes the job's nodes. One line per controller."""
    import json

    from sftctl.paths import sftctl_home

    root = sftctl_home() / "jobs"
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            owner = json.loads((d / CONTROLLER_OWNER).read_text())
            pid, ticks, host = int(owner["pid"]), owner.get("start_ticks"), owner.get("host")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host != socket.gethostname() or not procs.alive(pid, ticks):
            continue
        if store is not None and store.get_job(d.name) is not None:
            continue  # a job the state knows: sftctl down JOB stops it
        procs.kill_all([pid], grace_s=DOWN_GRACE_S)
        out.append(f"{owner.get('provider') or 'local'}: {d.name} (unknown job): stopped its controller (pid {pid}), "
                   "which removed its nodes")
    return out


#: Each signal that cancels a job: its reason and the exit code of ``sftctl run`` (128 + signal).
#: When ``sftctl down`` sent the SIGTERM (it says so in an event first) the reason is DOWN_REASON.


def _install_cancel_signals() -> dict:
    """SIGTERM and SIGHUP raise :class:`Cancelled` (SIGINT raises KeyboardInterrupt already).
    Returns the previous handlers by signal number, to restore."""
    if sys.platform == "win32" or not _in_main_thread():
        return {}
    previous = {}
    for name, (why, code) in CANCEL_SIGNALS.items():
        def handler(signum, frame, why=why, code=code):
            raise Cancelled(why, code)

        signum = getattr(signal, name)
        previous[signum] = signal.signal(signum, handler)
    return previous


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


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
    """A TCP port for the job's rendezvous (torchrun's c10d store on node 0), held until
    :func:`release_rendezvous_port`.

    Binding port 0 and releasing it raced: the kernel may hand the same ephemeral port to any
    other process before torchrun binds it (a run failed with EADDRINUSE). Instead the port
    comes from the ``RDZV_PORTS`` ports just below the kernel's ephemeral range, which the
    kernel never hands out by itself, and is claimed machine-wide (every sftctl home of this
    user) by a file ``<tmp>/sftctl-rdzv-ports-<uid>/<port>`` naming the claiming controller; a
    claim whose controller is gone is taken over. A port something already listens on is skipped.

    Raises:
        SftctlError: every port of the range is claimed or in use.
    """
    from filelock import FileLock

    lo, _ = _ephemeral_range()
    first = max(1024, lo - RDZV_PORTS)
    span = lo - first
    d = _ports_dir()
    os.makedirs(d, mode=0o700, exist_ok=True)
    me = f"{os.getpid()} {procs.start_ticks(os.getpid())} {job_id}"
    start = int.from_bytes(job_id.encode()[-4:].rjust(4, b"\0"), "big") % span
    with FileLock(os.path.join(d, ".lock")):
        for i in range(span):
            port = first + (start + i) % span
            path = os.path.join(d, str(port))
            try:
                pid, ticks, _job = open(path).read().split(" ", 2)
                if procs.alive(int(pid), int(ticks) if ticks.isdigit() else None):
                    continue  # held by a live controller
            except (OSError, ValueError):
                pass
            if not _bindable(port):
                continue
            with open(path, "w") as f:
                f.write(me)
            return port
    raise SftctlError(f"no free rendezvous port in {first}-{lo - 1}", hint="end finished jobs' controllers, or retry")


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached controller: ``python -m sftctl.controller JOB_ID``.

    Exits 0 when the job succeeded, 1 when it ended otherwise, 2 (one ``error:`` line on stderr,
    the job untouched) when the job already has a live controller."""
    job_id = (argv or sys.argv[1:])[0]
    os.umask(0o077)  # logs, scripts and checkpoints of the job: owner-only whatever the dir's mode
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    store = Store()
    try:
        lock = claim_job(store, job_id)
    except ControllerBusy as e:
        print(f"error: {e.message}\nhint: {e.hint}", file=sys.stderr)
        return int(e.exit_code)
    try:
        status = Controller(store, job_id).run()
    finally:
        lock.release()
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
