"""What a controller placement is (``controller.place``): where the job's controller process
runs, declared once per kind as a :class:`Placement` in a module of this package
(``placements/<kind>.py`` sets ``PLACEMENT``); :mod:`sftctl.controller.placements` finds them by
listing the package, and the spec's ``controller.place`` takes their names.

A placement answers, for one job: whether its controller runs elsewhere (another machine's
process, judged by the job's lease in the state), what ``run --dry-run`` shows of it
(:meth:`Placement.render`), whether a spec may use it (:meth:`Placement.check`), how it is submitted
(:meth:`Placement.place`), the lease holder while it waits in a scheduler's queue
(:meth:`Placement.holder`), how it is stopped (:meth:`Placement.cancel`), how a queued one that
vanished is given up (:meth:`Placement.orphans`), and whether it is alive (:meth:`Placement.alive`,
which :func:`sftctl.controller.placements.controller_alive` dispatches to).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

from sftctl.procs import module_argv
from sftctl.state import JobRecord, Liveness, Store, queued_holder


#: what stands for a secret's value in what ``run --dry-run`` shows (and the launch fills)
SECRET = "<secret>"


@dataclasses.dataclass(frozen=True)
class Document:
    """One text sftctl hands a scheduler or a node: ``name`` (``attempt-1/sbatch.sh``,
    ``node 0: Kubernetes objects``, ``controller.sbatch.sh``) and its ``text``."""

    name: str
    text: str

    def to_dict(self) -> dict:
        return {"name": self.name, "text": self.text}


@dataclasses.dataclass(frozen=True)
class ControllerPlacement:
    """Where the job's controller runs (``controller.place``: None for this machine, ``server``,
    ``slurm``, ``kubernetes``), the arguments of its provider's ``submit_controller`` (a
    Kubernetes Secret's values as ``<secret>``: :meth:`Placement.place` fills them) and the
    documents that submit it (``controller.sbatch.sh``, the Job and Secret)."""

    place: str | None
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    documents: tuple[Document, ...] = ()


#: ``render(**changes)``: the job's :class:`ControllerPlacement` as ``admit`` renders it with
#: ``Where`` fields changed (``environ``, ``namespace``): what :meth:`Placement.place` submits
Render = Callable[..., ControllerPlacement]


class Placement:
    """One kind of ``controller.place``. The defaults are this machine's: a process here, judged
    by its pid and lock, nothing to submit, cancel or forget.

    Attributes:
        name: the spec's ``controller.place`` value (``local`` is also a spec without one).
        elsewhere: its controller is another machine's process (a scheduler's job): judged by
            the job's lease, submitted by :meth:`place`, stopped by :meth:`cancel`.
        what: the scheduler's word for the controller's job ("Slurm job"), for messages.
    """

    name: str = ""
    elsewhere: bool = False
    what: str = "process"

    def check(self, spec, label: str, *, server: bool, provider: str | None) -> None:
        """Refuse a spec this placement cannot run, before anything is recorded (``server``: a
        server runs the job's commands; ``provider``: the planned offering's, None before
        planning). Raises SpecError / SftctlError (exit 2)."""

    def render(self, spec, job_id: str, where) -> ControllerPlacement:
        """What ``run --dry-run`` shows and :meth:`place` submits (``where``: admit's ``Where``)."""
        return ControllerPlacement(spec.controller.place)

    def place(self, store: Store, job: JobRecord, spec, render: Render) -> str:
        """Submit ``job``'s controller as ``render()`` says and hold its lease for it (``holder``);
        return the scheduler's id of it. Only for placements ``elsewhere``: this machine's
        (``local``, ``server``) are started by :func:`sftctl.api.spawn_controller`, the one spawn
        path (a detached ``python -m sftctl.queue JOB``), which calls this for the others."""
        raise NotImplementedError(f"controller.place: {self.name} is started on this machine, not submitted")

    def holder(self, controller_id: str) -> str:
        """The lease holder of a controller still waiting in the scheduler's queue."""
        return queued_holder(self.name, controller_id)

    def cancel(self, job: JobRecord, grace_s: float) -> list[str]:
        """Stop ``job``'s placed controller (SIGTERM first, then after ``grace_s``); the ids stopped."""
        return []

    def orphans(self, store: Store, job: JobRecord) -> str | None:
        """Give up the lease of ``job``'s queued controller that left the scheduler's queue
        without starting; return the holder given up, else None."""
        return None

    def alive(self, store: Store, job: JobRecord, *, scheduler: bool = True) -> Liveness:
        """The verdict on ``job``'s controller: the state's (:meth:`Store.controller_liveness`:
        by the job's lease for a placement ``elsewhere`` or on a shared state, else by its pid;
        then this home's controller lock; a job just submitted is unknown) and, for a controller
        still queued at its scheduler (its lease ``<name>:<id>``) when ``scheduler`` is true, the
        scheduler's (:meth:`orphans`: one that left the queue without starting is dead, its lease
        given up). ``scheduler`` false: the state alone (no ``squeue``, no API call).

        Raises:
            ProviderError, CredentialsError: the scheduler could not be asked (exit 4).
        """
        verdict = store.controller_liveness(job, elsewhere=self.elsewhere)
        if not (scheduler and self.elsewhere and verdict.alive and verdict.by == "lease"
                and (verdict.holder or "").startswith(f"{self.name}:")):
            return verdict
        gone = self.orphans(store, job)
        if gone is None:
            return Liveness(True, f"queued as {self.what} {_scheduler_id(verdict.holder)}, which its scheduler still shows",
                            "scheduler", verdict.holder)
        return Liveness(False, f"its {self.what} {_scheduler_id(gone)} left the queue without starting", "scheduler", gone)


def _scheduler_id(holder: str | None) -> str:
    """The scheduler's id in a queued holder (``slurm:17`` -> ``17``)."""
    return (holder or "").split(":", 1)[-1]


def forget_queued(store: Store, job: JobRecord, placement: Placement, provider, line: str, key: str) -> str | None:
    """:meth:`Placement.orphans` of a scheduler's queue: the lease ``<place>:<id>`` given up when
    ``provider.controller_jobs`` no longer shows that controller (and it did not start meanwhile)."""
    held = store.lease(job.id)
    if held is None or not held[0].startswith(f"{placement.name}:"):
        return None
    ctl_id = held[0].split(":", 1)[1]  # the Slurm job id / the Kubernetes Job's name
    if any(f["id"] == ctl_id for f in provider.controller_jobs(job.id)):
        return None
    if not store.release_lease(job.id, held[0]):  # it started meanwhile and took the lease over
        return None
    store.add_event(job.id, "controller", line.format(id=ctl_id), {"place": placement.name, key: ctl_id})
    return held[0]


def controller_argv(job_id: str, python: str | None = None) -> list[str]:
    """The argv of a placed controller: ``python -m sftctl.queue JOB`` (which becomes the
    controller once the job may start), the same for a Slurm job and a Kubernetes Job."""
    return module_argv("sftctl.queue", job_id, python=python or sys.executable)
