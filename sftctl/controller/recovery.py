"""How a job resumes (see :mod:`sftctl.controller.lifecycle`): :class:`Recovery`, the methods of
:class:`~sftctl.controller.lifecycle.Controller` that adopt a job whose controller died
(:meth:`Recovery._adopt`) and find the checkpoint a relaunch resumes from."""

from __future__ import annotations

import os
from typing import Any

from sftctl.controller.ports import reclaim_rendezvous_port
from sftctl.controller.slots import NodeSlot
from sftctl.paths import job_dir
from sftctl.providers.base import NodeState, ReachesFilesystem, terminate_all
from sftctl.spec import JobSpec
from sftctl.state import JobStatus, Store
from sftctl.storage.checkpoints import complete_checkpoint_steps
from sftctl.types import AttemptStatus, FailureCode, NodeRecord, capabilities

#: The statuses in which a controller that died (even by SIGKILL) left its job under way: a new
#: controller for the job adopts it (:meth:`Controller.run`, :func:`adopt`) instead of starting over.
UNDER_WAY = frozenset({JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.RECOVERING})
#: recorded node statuses of nodes that are no longer part of the job
GONE = frozenset({NodeState.TERMINATED, NodeState.REPLACED, NodeState.FAILED})


class Recovery:
    """The :class:`~sftctl.controller.lifecycle.Controller`'s adoption and resume point (a mixin:
    its methods use the controller's ``store``, ``job_id``, ``provider``, ``nodes``, ``spec`` ...,
    declared here for the type checker; the Controller sets them)."""

    store: Store
    job_id: str
    spec: JobSpec
    provider: Any
    storage: Any
    reporter: Any
    monitor: Any
    nodes: list[NodeSlot]
    attempt: int
    adopted: bool
    rdzv_port: int | None
    workdir_key: str | None

    def _move(self, status: JobStatus, reason: str | None = None, code: str | None = None) -> None:
        raise NotImplementedError  # the Controller's

    def _replace(self, rank: int, quarantine: str | None = None) -> None:
        raise NotImplementedError  # the Controller's

    def _adopt(self) -> int | None:
        """Reconcile a job that an earlier controller left under way, from state and the provider.

        - PENDING (or ended): nothing to adopt; returns None and :attr:`adopted` stays False.
        - PROVISIONING: the nodes the dead controller recorded are removed (terminated at the
          provider, recorded TERMINATED) and provisioning starts over; None, not adopted.
        - RUNNING with an open attempt and every node still running (or done) at the provider:
          the nodes are kept as they are and watched on; returns that attempt.
        - Otherwise (LAUNCHING, RECOVERING, or RUNNING with a node that ended while no
          controller watched: a local node's guard stops it with its controller; a crash then
          cannot be told from that): the open attempt is ended ABANDONED (``controller_died``),
          the live nodes' scripts are stopped, the nodes gone at the provider (LOST, TERMINATED,
          never provisioned) are replaced per ``recovery:`` (``min_nodes``: elastic), and the
          job relaunches from its last checkpoint (-> RECOVERING -> LAUNCHING). No restart is
          counted: the job did not fail under a controller; what fails after is counted as ever.

        One slot per rank is kept: the newest recorded node not TERMINATED/REPLACED/FAILED; an
        older live record of the same rank is terminated, so the provider never runs two nodes
        for one rank. The job's rendezvous port is taken over from the dead controller's claim.
        """
        job = self.store.get_job(self.job_id)
        if job.status not in UNDER_WAY:
            return None
        records = [r for r in self.store.nodes(self.job_id) if r.status not in GONE]
        if job.status == JobStatus.PROVISIONING:
            if records:
                self._remove_records(records, "left by a controller that died while provisioning")
            self.store.end_open_attempts(self.job_id, AttemptStatus.ABANDONED, "its controller died",
                                         FailureCode.CONTROLLER_DIED.value)  # one a recovery left open
            return None
        self.adopted = True
        newest: dict[int, NodeRecord] = {}
        for r in records:  # by rank, then creation: the newest of a rank wins
            if r.rank in newest:
                self._remove_records([newest[r.rank]], f"a second node of rank {r.rank}")
            newest[r.rank] = r
        replaced = [r for r in self.store.nodes(self.job_id) if r.status == NodeState.REPLACED]
        self.nodes = [NodeSlot(r.id, r.rank, r.node_handle, generation=sum(x.rank == r.rank for x in replaced))
                      for r in (newest[k] for k in sorted(newest))]
        self.rdzv_port = reclaim_rendezvous_port(self.job_id)
        self.workdir_key = next((e.data["workdir_key"] for e in reversed(self.store.events(self.job_id))
                                 if e.kind == "storage" and (e.data or {}).get("workdir_key")), None)
        open_ = [a.number for a in self.store.attempts(self.job_id) if a.status == AttemptStatus.RUNNING]
        message = (f"adopted by a new controller (pid {os.getpid()}): the job was {job.status.value} with "
                   f"{len(self.nodes)} node(s) recorded, its controller gone")
        self.store.add_event(self.job_id, "adopt", message, {"status": job.status.value, "nodes": [n.id for n in self.nodes],
                                                             "attempt": open_[-1] if open_ else None})
        self.reporter.event(message)
        states = {n.rank: self.provider.status(n.handle).state if n.handle is not None else None for n in self.nodes}
        if (job.status == JobStatus.RUNNING and open_ and self.nodes
                and all(st in (NodeState.RUNNING, NodeState.SUCCEEDED) for st in states.values())):
            self.attempt = open_[-1]
            if self.monitor is not None:
                self.monitor.reset_training()
            return self.attempt
        dead = [rank for rank, st in states.items() if st in (None, NodeState.LOST, NodeState.TERMINATED)]
        why = f"its controller died while the job was {job.status.value}"
        ended = [f"node {rank} {st.value.lower()}" for rank, st in states.items()
                 if st not in (NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.READY)]
        if ended:  # ended unwatched: a crash cannot be told from the local guard's stop, so no restart is counted
            why += f" ({', '.join(str(e) for e in ended)} meanwhile)"
        self.store.end_open_attempts(self.job_id, AttemptStatus.ABANDONED, why, FailureCode.CONTROLLER_DIED.value)
        for n in self.nodes:
            if n.handle is not None and n.rank not in dead:
                self.provider.stop_attempt(n.handle)
        if job.status != JobStatus.RECOVERING:
            self._move(JobStatus.RECOVERING, f"{why}; relaunching {self._resume_point()}")
        for rank in dead:
            self._replace(rank)
        return None

    def _remove_records(self, records: list, why: str) -> None:
        """Terminate recorded nodes that are no part of the adopted job and record them TERMINATED."""
        handles = [r.node_handle for r in records if r.node_handle is not None]
        if handles:
            terminate_all(self.provider, handles)
        for r in records:
            self.store.update_node(r.id, status=NodeState.TERMINATED, handle={**(r.handle or {}), "terminated": True})
        message = f"removed {len(records)} node(s) {why}: {', '.join(r.id for r in records)}"
        self.store.add_event(self.job_id, "adopt", message)
        self.reporter.event(message)

    def _checkpoint_steps(self) -> list[int] | None:
        """The steps of the job's complete checkpoints, oldest first; None when this machine
        cannot see them (a cloud job without job storage)."""
        url = self.storage.url if self.storage is not None else None  # canonical: file:// for a directory
        root = url or self.spec.train.checkpoint_dir or str(job_dir(self.job_id) / "checkpoints")
        # Slurm on a login node shares its filesystem with the nodes; over SSH it does not
        here = capabilities(self.provider.name).shares_filesystem and not (
            isinstance(self.provider, ReachesFilesystem) and self.provider.remote)
        return complete_checkpoint_steps(root) if url or here else None

    def _newest_checkpoint(self) -> int:
        """The newest complete checkpoint's step (0: none): as this machine sees the checkpoints,
        else the newest step the nodes reported as a checkpoint."""
        steps = self._checkpoint_steps()
        if steps is not None:
            return steps[-1] if steps else 0
        return max((p.step for p in self.store.step_series(self.job_id, last=100) if p.checkpoint), default=0)

    def _trained_to_the_end(self) -> int | None:
        """``train.steps`` when every rank reported it as its last step and the newest complete
        checkpoint is of that step (a node that exits non-zero after that, torch's teardown aborting
        at interpreter exit, did not lose anything: :meth:`Controller._monitor`); else None."""
        steps = self.spec.train.steps
        offering = getattr(self, "offering", None)
        world = len(self.nodes) * max(1, int(getattr(offering, "count", 1) or 1))
        for rank in range(world):
            last = self.store.step_series(self.job_id, rank=rank, last=1)
            if not last or last[-1].step < steps:
                return None
        return steps if self._newest_checkpoint() >= steps else None

    def _teardown_exit(self, rank: int, why: Any, step: int) -> int:
        """Record (a ``teardown_exit`` event, the reporter's warning) that node ``rank`` exited
        non-zero (``why``, a FailureReason) only after the job trained to ``step``, its end, and
        saved it; returns ``rank`` (the node counts as finished)."""
        message = f"{why.message}, after every rank's last step and the final checkpoint (step {step}): the node counts as finished"
        self.store.add_event(self.job_id, "teardown_exit", message, {**why.data, "step": step})
        self.reporter.event(f"warning: {message}")
        return rank

    def _resume_point(self) -> str:
        """Where a relaunch resumes: the newest complete checkpoint, if this machine sees it."""
        steps = self._checkpoint_steps()
        if steps is None:
            return "from the last checkpoint"
        return f"from checkpoint step {steps[-1]}" if steps else "from step 0 (no checkpoint yet)"
