"""``controller.place: slurm`` (issue 24): the job's controller runs as a Slurm job of its own
(``sftctl-ctl-<job>``, 1 CPU), submitted through the same :class:`SlurmProvider` and ``Runner``
as the nodes (``templates/slurm/controller.sh.j2``); see ARCHITECTURE.md, "Slurm"."""

from __future__ import annotations

import os
import re
import types
from collections.abc import Mapping

from sftctl import settings
from sftctl.controller.placements.base import (
    ControllerPlacement, Document, Placement, Render, controller_argv, forget_queued,
)
from sftctl.errors import SftctlError, SpecError
from sftctl.paths import job_dir, sftctl_home
from sftctl.providers import get_provider
from sftctl.providers import slurm as slurm_provider
from sftctl.state import QUEUED_CONTROLLER_LEASE_S, JobRecord, JobStatus, Store, is_url
from sftctl.spec import JobSpec
from sftctl.types import FailureCode, capabilities

#: seconds a placed controller's Slurm job runs past the spec's deadline (``--time``): the
#: controller fails the job at its deadline and then tears its nodes down
CONTROLLER_TEARDOWN_S = 600.0

#: variables of the submitting shell a placed controller's Slurm job does not take: the shell's
#: own, and those Slurm sets per job (``SLURM_*`` but ``SLURM_CONF``, see controller.sh.j2)
_NOT_FOR_THE_CONTROLLER = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "SFTCTL_CONTROLLER_SLURM_JOB_ID"})


def controller_provider(spec):
    """The Slurm provider that runs the controller: the config's ``slurm:`` section overlaid by
    the spec's, as for Slurm nodes."""
    return get_provider("slurm", config=spec.slurm.model_dump() if spec.slurm else None)


def slurm_controller_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a ``controller.place: slurm`` controller: what a controller started
    on this machine inherits (``environ``, default this process's: sftctl's settings, the
    state's URL with its password, ``SLURM_CONF``, ``PATH``, cloud credentials, the values of
    the spec's secrets), with ``SFTCTL_HOME`` and ``SFTCTL_STATE_URL`` as this process resolves
    them, less Slurm's per-job ``SLURM_*``, the shell's ``PWD``/``SHLVL`` and names a shell
    cannot export (``BASH_FUNC_x%%``). It travels in the 0600 file
    ``SlurmProvider.submit_controller`` writes, never in sbatch's environment (``--export=NONE``:
    slurmctld saves a batch job's environment)."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and k not in _NOT_FOR_THE_CONTROLLER
           and (not k.startswith("SLURM_") or k == "SLURM_CONF")}
    env["SFTCTL_HOME"] = str(sftctl_home())
    url = settings.get("SFTCTL_STATE_URL")
    if url:
        env["SFTCTL_STATE_URL"] = url
    return env


def controller_job_args(spec, job_id: str, provider) -> dict:
    """The keyword arguments of ``provider.submit_controller``/``controller_script`` for the
    controller of ``job_id`` (``argv``, ``partition``, ``log``, ``chdir``, ``time_limit_s``):
    what :meth:`SlurmPlacement.place` submits and ``run --dry-run`` shows."""
    jd = job_dir(job_id)
    deadline_s = spec.resources.deadline_s
    return {"argv": controller_argv(job_id, provider.cfg.python),
            "partition": spec.controller.partition or provider.cfg.partition,
            "log": str(jd / "controller.log"), "chdir": str(jd),
            "time_limit_s": None if deadline_s is None else deadline_s + CONTROLLER_TEARDOWN_S}


class SlurmPlacement(Placement):
    """The controller as a Slurm job; its lease is ``slurm:<id>`` while Slurm queues it, taken
    over through ``SFTCTL_CONTROLLER_SLURM_JOB_ID`` when it starts."""

    name = "slurm"
    elsewhere = True
    what = "Slurm job"

    def check(self, spec, label: str, *, server: bool, provider: str | None) -> None:
        """Slurm's commands here (a login node: ``slurm.host`` unset) and a state the cluster's
        nodes reach: Postgres (``state.url``), or this SQLite file on the shared filesystem a
        login node and its compute nodes see; it cannot supervise nodes of this machine."""
        if provider is not None and capabilities(provider).local_admission:
            raise SpecError(f"{label}: controller.place: slurm cannot supervise local nodes (they run on this machine)",
                            hint="set resources.clouds to where the nodes should run (slurm, aws, gcp, kubernetes), "
                                 "or drop controller.place")
        cfg = slurm_provider.load_config(spec.slurm.model_dump() if spec.slurm else None)
        state_url = settings.get("SFTCTL_STATE_URL")
        if cfg.host and not is_url(state_url):
            raise SpecError(
                f"{label}: controller.place: slurm: the job's state is this machine's SQLite file "
                f"({state_url or sftctl_home() / 'state.db'}), which the cluster's nodes cannot reach over SSH "
                f"(slurm.host: {cfg.host})",
                hint="set state.url (SFTCTL_STATE_URL) to a Postgres database the cluster reaches, or run sftctl on "
                     "the cluster's login node, or drop controller.place")
        if cfg.host:
            raise SpecError(f"{label}: controller.place: slurm is not supported over SSH yet (slurm.host: {cfg.host})",
                            hint="run sftctl on the cluster's login node (slurm.host unset), or drop controller.place")
        why = slurm_provider.login_node_reason()
        if why:
            raise SftctlError(f"{label}: controller.place: slurm: {why}", hint="run sftctl on the cluster's login node")

    def render(self, spec, job_id: str, where) -> ControllerPlacement:
        """``controller.sbatch.sh`` as submitted, and ``submit_controller``'s arguments."""
        ctl = controller_provider(spec)
        args = controller_job_args(spec, job_id, ctl)
        return ControllerPlacement(self.name, types.MappingProxyType(args),
                                   (Document("controller.sbatch.sh", ctl.controller_script(job_id, **args)),))

    def place(self, store: Store, job: JobRecord, spec, render: Render) -> str:
        """A Slurm job (``sftctl-ctl-<job>``, 1 CPU, ``controller.partition`` or
        ``slurm.partition``, ``--time`` the spec's deadline + :data:`CONTROLLER_TEARDOWN_S`, else
        the partition's default) running ``python -m sftctl.queue JOB`` with the config's
        ``slurm.python`` (default: this interpreter, on the shared filesystem); its output goes to
        the job dir's ``controller.log``; its environment (:func:`slurm_controller_env`) travels in
        a 0600 file. Raises ProviderError: sbatch refused it (exit 4; the job is FAILED)."""
        provider = controller_provider(spec)
        job_dir(job.id).mkdir(parents=True, exist_ok=True, mode=0o700)
        args = dict(render().args)
        partition = args["partition"]
        try:
            slurm_id = provider.submit_controller(job.id, **args, env=slurm_controller_env())
        except SftctlError as e:  # no controller will come: the job fails now, with Slurm's reason
            store.transition(job.id, JobStatus.FAILED, f"its controller could not be placed on Slurm: {e.message}",
                             strict=False, code=FailureCode.PROVIDER_ERROR.value)
            raise
        store.acquire_lease(job.id, self.holder(slurm_id), QUEUED_CONTROLLER_LEASE_S)
        store.add_event(job.id, "controller",
                        f"controller: Slurm job {slurm_id} ({slurm_provider.controller_job_name(job.id)}) in "
                        f"{'partition ' + partition if partition else 'the default partition'}",
                        {"place": "slurm", "slurm_job_id": slurm_id, "partition": partition})
        return slurm_id

    def cancel(self, job: JobRecord, grace_s: float) -> list[str]:
        """SIGTERM to a running controller job (which cancels the job and stops its nodes), then
        ``scancel`` after ``grace_s`` seconds."""
        return controller_provider(JobSpec.model_validate(job.spec)).cancel_controller(job.id, grace_s)

    def orphans(self, store: Store, job: JobRecord) -> str | None:
        """A controller's Slurm job that left the queue without starting (an admin's ``scancel``,
        a purge) still holds the lease as ``slurm:<id>``: when Slurm no longer shows it, give the
        lease up (asks ``squeue``)."""
        return forget_queued(store, job, self, controller_provider(JobSpec.model_validate(job.spec)),
                       "controller: Slurm job {id} left the queue without starting", "slurm_job_id")


PLACEMENT = SlurmPlacement()
