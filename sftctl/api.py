"""sftctl as a Python library: everything the ``sftctl`` command does, as functions.

The CLI (:mod:`sftctl.cli`) is parsing and rendering over this module; a sweep script or a
notebook calls it directly::

    from sftctl import api

    job = api.run("examples/quickstart.yaml", overrides={"train.steps": 40}, detach=True)
    job = api.wait(job.id)                     # polls api.status until the job ends, nodes down
    print(job.status.value, job.loss)          # SUCCEEDED 2.31 (mean over the ranks' last reports)
    for line in api.logs(job.id):
        print(line)

Functions return the vocabulary of :mod:`sftctl.types` (:class:`~sftctl.types.JobRecord`,
:class:`~sftctl.types.Event`, :class:`~sftctl.types.Plan`, :class:`~sftctl.types.Offering` ...)
or the small views defined here (:class:`JobView`, :class:`LogLine`, :class:`DownResult`,
:class:`CloudCheck`, :class:`CompileResult`), and raise :class:`~sftctl.errors.SftctlError`
subclasses (:class:`~sftctl.errors.SpecError`, :class:`~sftctl.errors.NotFoundError`,
:class:`~sftctl.errors.InfeasibleError`, :class:`~sftctl.errors.ProviderError`), each with a
``hint`` and the ``exit_code`` the CLI exits with. Nothing here prints: a long step reports
through a ``progress`` callback, a condition worth a look through :mod:`warnings`
(:class:`~sftctl.errors.SftctlWarning`), node output as :class:`LogLine` values.

A ``spec`` argument is a path to a YAML file, the YAML text itself (a string with a newline, or
one that names no file), or a :class:`~sftctl.spec.JobSpec`. ``overrides`` are ``--set``'s
``key.path=value`` strings, or a mapping ``{"train.steps": 40}``. A ``job`` argument is a job id
or a unique prefix of one (or a :class:`JobView`/:class:`~sftctl.types.JobRecord`). An argument
of the wrong type raises :class:`TypeError` naming the function, the argument and what it accepts
(checked at the boundary, :func:`_typed`). Whatever takes a spec first checks every user setting
(:func:`sftctl.settings.validate_all`; exit 2).

**JSON.** Every ``--json`` document of the CLI is built here, in :meth:`JobView.to_dict`,
:func:`plan_doc`, :func:`events_doc`, :meth:`DownResult.to_dict` and :meth:`CloudCheck.to_dict`,
from the records' own ``to_dict()``; where a document differs from a record (``status``
summarizes the ranks' metrics; ``events`` leaves out each event's ``job_id``) the method says so.

Importing this module is as light as ``sftctl status``: no torch, numpy, pydantic spec model
or cloud SDK; those are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from sftctl.errors import ExitCode, NotFoundError, ProviderError, SftctlError, SftctlWarning, SpecError
from sftctl.types import (Attempt, Cost, CostTotal, Event, JobRecord, JobStatus, MetricsRecord, NodeRecord, NodeState,
                          Offering, Record)

if TYPE_CHECKING:
    from sftctl.spec import JobSpec
    from sftctl.state import Store
    from sftctl.types import Plan

SpecLike = "str | os.PathLike | JobSpec"
Overrides = "Sequence[str] | Mapping[str, Any]"
Progress = Callable[[str], None]

__all__ = [
    "job", "load", "plan", "submit", "dry_run", "start", "attach", "run", "status", "wait", "logs", "events",
    "down", "down_orphans", "check", "catalog", "compile", "validate_config", "costs", "JobView", "LogLine", "Submitted",
    "Attached", "DownResult", "CloudCheck", "CompileResult", "plan_doc", "events_doc",
]


# ------------------------------------------------------------------------------ argument types


def _type_name(value: Any) -> str:
    if isinstance(value, (list, tuple)) and value:
        return f"{type(value).__name__}[{' | '.join(sorted({type(v).__name__ for v in value}))}]"
    return "None" if value is None else type(value).__name__


def _arg_job(value: Any, optional: bool) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, (JobView, JobRecord)):
        return value.id
    if isinstance(value, Submitted):
        return value.job_id
    if value is None and optional:
        return None
    return TypeError


def _arg_spec(value: Any, optional: bool) -> Any:
    spec_module = sys.modules.get("sftctl.spec")  # a JobSpec exists only once sftctl.spec is imported
    ok = isinstance(value, (str, os.PathLike)) or (spec_module is not None and isinstance(value, spec_module.JobSpec))
    return value if ok else TypeError


def _arg_overrides(value: Any, optional: bool) -> Any:
    if isinstance(value, str) or value is None:
        return () if value is None else value
    if isinstance(value, Mapping):
        return value if all(isinstance(k, str) for k in value) else TypeError
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return value
    return TypeError


def _arg_names(value: Any, optional: bool) -> Any:
    if value is None or isinstance(value, str):
        return value if value is None else [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return TypeError


def _arg_text(value: Any, optional: bool) -> Any:
    return value if isinstance(value, str) or (value is None and optional) else TypeError


def _arg_rank(value: Any, optional: bool) -> Any:
    ok = isinstance(value, int) and not isinstance(value, bool) or (value is None and optional)
    return value if ok else TypeError


def _arg_path(value: Any, optional: bool) -> Any:
    return value if isinstance(value, (str, os.PathLike)) or (value is None and optional) else TypeError


#: argument name -> (its converter, what it accepts): the same name means the same thing in
#: every function of this module
_ARGS: dict[str, tuple[Callable[[Any, bool], Any], str]] = {
    "job": (_arg_job, "a job id (str) or a JobView/JobRecord"),
    "spec": (_arg_spec, "a path (str or os.PathLike), YAML text or a JobSpec"),
    "overrides": (_arg_overrides, "a list of 'key.path=value' strings or a mapping {'key.path': value}"),
    "clouds": (_arg_names, "a cloud name (str) or a list of them"),
    "regions": (_arg_names, "a region name (str) or a list of them"),
    "accelerator": (_arg_text, "an accelerator name (str)"),
    "target": (_arg_text, "an accelerator name (str)"),
    "node": (_arg_rank, "a node rank (int)"),
    "rank": (_arg_rank, "a training rank (int)"),
    "out": (_arg_path, "a directory path (str or os.PathLike)"),
}


def _typed(fn: Callable) -> Callable:
    """Check (and normalize) the arguments of a public function at the boundary, by name (see
    :data:`_ARGS`): a wrong type is a :class:`TypeError` naming the function, the argument and
    what it accepts (``api.status: job must be a job id (str) or a JobView/JobRecord, got int``),
    never an internal error further in. An argument whose default is None may be None."""
    import functools
    import inspect

    sig = inspect.signature(fn)
    checked = {n: p.default is None for n, p in sig.parameters.items() if n in _ARGS}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        for name, optional in checked.items():
            if name in bound.arguments:
                convert, accepts = _ARGS[name]
                value = convert(bound.arguments[name], optional)
                if value is TypeError:
                    raise TypeError(f"api.{fn.__name__}: {name} must be {accepts}"
                                    f"{', or None' if optional else ''}, got {_type_name(bound.arguments[name])}")
                bound.arguments[name] = value
        return fn(*bound.args, **bound.kwargs)

    return wrapper


# ------------------------------------------------------------------------------ a server

#: True in the ``sftctl server`` process: its calls are this machine's, whatever the config names,
#: and its reads leave a job whose controller died to its Supervisor (:func:`_reap`)
#: (:mod:`sftctl.server` sets it; the controllers it starts never call this module)
SERVING = False


def _reap(store: Store) -> None:
    """Mark live jobs whose controller process is gone FAILED_CONTROLLER (every read does,
    :func:`_resolve`), except in the server: its :class:`sftctl.server.Supervisor` gives such a
    job a new controller, which adopts it where it stands."""
    if not SERVING:
        store.reap_dead_controllers()


def _remote():
    """The configured server's :class:`sftctl.remote.Client`, or None (no server configured, or
    this process is the server). Job commands go there instead of this machine's state.

    Raises:
        SettingError: a malformed setting or config file (exit 2).
    """
    if SERVING:
        return None
    from sftctl import remote

    return remote.configured()


# ------------------------------------------------------------------------------ settings


def validate_config() -> str | None:
    """Check the config file as a whole (every ``sftctl`` command does this first: its keys,
    value types and ``slurm:`` section; :func:`sftctl.settings.config_document`); return its
    path, or None when there is none.

    Raises:
        SettingError: ``$SFTCTL_CONFIG`` names no file, or the file has a mistake (the message
            names the file, line and key; exit 2).
    """
    from sftctl import settings

    return settings.config_document()[0]


# ------------------------------------------------------------------------------ specs


@_typed
def load(spec: SpecLike, overrides: Overrides = ()) -> JobSpec:
    """The validated :class:`~sftctl.spec.JobSpec` of ``spec`` with ``overrides`` applied.

    Raises:
        SpecError: a missing file or any problem with the spec or an override, naming the field
            and its line (exit code 2).
    """
    return _load(spec, overrides)[0]


def _load(spec: SpecLike, overrides: Overrides = (), origin: str | None = None) -> tuple[JobSpec, str, Path | None]:
    """(spec, its label for messages, the file it came from or None). Every user setting is
    checked first (:func:`sftctl.settings.validate_all`): whatever uses a spec (plan, dry run,
    submit, compile) fails on a malformed variable or config file before anything is created.
    ``origin``: the file YAML text ``spec`` was read from elsewhere (a server's client), which
    messages name and relative paths are taken from."""
    import json

    from sftctl import settings
    from sftctl.spec import JobSpec, load_spec

    settings.validate_all()

    sets = _override_strings(overrides)
    if isinstance(spec, JobSpec):
        if not sets:
            workdir = str(Path(spec.workdir).resolve())
            return spec.model_copy(update={"workdir": workdir}), f"spec {spec.name}", None
        label = Path(spec.workdir).resolve() / "<JobSpec>"
        return load_spec(label, sets, text=json.dumps(spec.model_dump(mode="json"))), f"spec {spec.name}", None
    if origin is not None:
        return load_spec(Path(origin), sets, text=spec), origin, Path(origin)
    if isinstance(spec, str) and ("\n" in spec or not (spec.endswith((".yaml", ".yml")) or Path(spec).exists())):
        return load_spec(Path("<spec>"), sets, text=spec), "<spec>", None
    path = Path(spec)
    return load_spec(path, sets), str(path), path


def _override_strings(overrides: Overrides) -> list[str]:
    if isinstance(overrides, Mapping):
        import json

        return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return list(overrides)


# ------------------------------------------------------------------------------ plan


@_typed
def plan(spec: SpecLike, overrides: Overrides = (), *, strict: bool = True,
         progress: Progress | None = None) -> Plan:
    """Rank the offerings for a job by predicted cost and choose one (offline: nothing starts).

    Args:
        strict: a model that cannot be traced or compiled is an error; with False the offerings
            are ranked by price only and a :class:`~sftctl.errors.SftctlWarning` says why.
        progress: called with a one-line message before each slow stage (trace, compile).

    Returns:
        The :class:`~sftctl.types.Plan`: the chosen :class:`~sftctl.types.PlanChoice`, the
        reason in one line, and every choice, best first (rejected ones say why).

    Raises:
        SpecError: the spec is invalid (exit 2).
        InfeasibleError: nothing can run the job; ``candidates`` holds every choice with why
            it was rejected (exit 3).
    """
    from sftctl.planner import Predictor, plan as plan_

    s = load(spec, overrides)
    if s.model is None:
        chosen = plan_(s)
    else:
        predictor = Predictor(s, progress=progress, strict=strict)
        chosen = plan_(s, predict=predictor)
        if predictor.error:
            warnings.warn(SftctlWarning(f"{predictor.error}; ranking by price only"), stacklevel=2)
    _warn_unset_references(s, chosen)
    return chosen


def catalog_info() -> dict:
    """The catalog's age: ``{"as_of": ISO date of the snapshot's prices, "age_days", "stale"
    (older than 7 days), "file": the price file it is from (the refreshed catalog or the shipped
    snapshot), "overrides": the price override file in force, or None}``.

    Its age is a property of the catalog, not of a job: ``plan``, ``run --dry-run`` and
    ``catalog`` print it once (``catalog: prices as of ...``, with ``sftctl catalog refresh`` as
    the fix when stale) and ``--json`` carries it under ``catalog``; :func:`plan`,
    :func:`dry_run` and :func:`submit` raise no per-job warning for it (SkyPilot shows its
    catalog's prices without one)."""
    from sftctl.catalog import catalog_age

    return catalog_age()


def _warn_unset_references(spec: JobSpec, chosen: Plan) -> None:
    """Warn (:class:`SftctlWarning`, so ``plan``, ``run --dry-run`` and ``run`` say it) for each
    ``$VAR``/``${VAR}`` of ``setup:``/``run:`` that nothing sets on the chosen offering's nodes:
    the node's shell would expand it to nothing. Local and Slurm nodes inherit this shell's
    environment; cloud nodes get only ``env:``, ``secrets:`` and sftctl's variables."""
    from sftctl.controller.submit import node_env_names
    from sftctl.spec import unset_shell_references

    provider = chosen.offering.provider
    known = node_env_names(spec, chosen)
    script = "\n".join(t for t in (spec.setup, spec.run) if t)
    inherits = provider in ("local", "slurm")
    unset = unset_shell_references(script, known, os.environ if inherits else {})
    if not unset:
        return
    here = [n for n in unset if n in os.environ]  # set in this shell, but a cloud node does not get it
    gone = [n for n in unset if n not in os.environ]
    refs = lambda names: ", ".join(f"${{{n}}}" for n in names)  # noqa: E731
    if gone:
        warnings.warn(SftctlWarning(
            f"run: {refs(gone)} {'is' if len(gone) == 1 else 'are'} not set here nor in env: or secrets:; "
            f"the node's shell will expand {'it' if len(gone) == 1 else 'them'} to nothing "
            f"(export it, add it to env:, or write ${{{gone[0]}:-default}})"), stacklevel=3)
    if here:
        warnings.warn(SftctlWarning(
            f"run: {refs(here)} {'is' if len(here) == 1 else 'are'} set in this shell, but {provider} nodes do not "
            f"get this shell's environment; add env: {{{here[0]}: \"${{{here[0]}}}\"}} to pass it"), stacklevel=3)


def plan_doc(spec: JobSpec, chosen: Plan | None, reason: str, candidates: list) -> dict:
    """``sftctl plan --json``: ``{"job", "objective", "steps", "chosen", "reason", "candidates"}``,
    the same shape whether or not an offering was chosen. ``chosen`` is the plan as state keeps
    it (:meth:`~sftctl.types.Plan.to_dict`) less its ``reason`` and ``candidates``, which sit at
    the top; each candidate is :meth:`~sftctl.types.PlanChoice.to_dict`."""
    doc = chosen.to_dict() if chosen is not None else None
    if doc is not None:
        doc.pop("candidates")
        doc.pop("reason")
    return {"job": spec.name, "objective": spec.resources.objective, "steps": spec.train.steps,
            "chosen": doc, "reason": reason, "candidates": [c.to_dict() for c in candidates],
            "catalog": catalog_info()}


# ------------------------------------------------------------------------------ run


@dataclasses.dataclass(frozen=True)
class Submitted:
    """A job recorded in state (PENDING) with its plan, no controller started yet."""

    job_id: str
    spec: JobSpec
    plan: Plan


@contextlib.contextmanager
def _owner_only() -> Iterator[None]:
    """Everything a job writes (state, logs, node scripts, checkpoints, local storage) is
    owner-only, whatever the mode of an existing ``$SFTCTL_HOME`` or storage directory."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _prepare(spec: SpecLike, overrides: Overrides, progress: Progress | None,
             origin: str | None = None) -> tuple[JobSpec, Path | None, Plan]:
    """Validate a spec for running, then plan it: secrets set, checkpoint dir free, storage
    present where the nodes need it."""
    from sftctl.controller.submit import check_checkpoint_dir, check_controller_place

    s, label, path = _load(spec, overrides, origin)
    server = SERVING or _remote() is not None
    check_controller_place(s, label, server=server)
    missing = [k for k in s.secrets if k not in os.environ]
    if missing:
        raise SpecError(f"{label}: secrets: {', '.join(missing)} not set in {_WHERE_SECRETS[SERVING]}",
                        hint="the server's admin sets it in the server's environment (its Kubernetes Secret, its "
                             "systemd server.env), or drop it from secrets" if SERVING else
                             "export it before sftctl run (secrets come from your environment), or drop it from secrets")
    _refuse_empty_secrets(s, label)
    check_checkpoint_dir(s)  # another run's checkpoints would be resumed silently
    if s.storage is not None:  # the nodes get the workdir as a pack: too big is said now, not at LAUNCHING
        from sftctl.storage.workdir import check_workdir_size

        check_workdir_size(s.workdir, max_bytes=int(s.storage.max_workdir_mb * 2**20))
    clouds = s.resources.clouds
    if clouds is not None and "local" not in clouds:  # known before planning: say it now
        _need_storage(s, label, "/".join(clouds))
    chosen = plan(s, strict=False, progress=progress)  # a model it cannot predict: a warning, price only
    _need_storage(s, label, chosen.offering.provider)
    check_controller_place(s, label, server=server, provider=chosen.offering.provider)
    return s, path, chosen


#: where a job's secret values come from: this shell, or the server's environment (by name only)
_WHERE_SECRETS = {False: "this shell", True: "the server's environment"}


def _refuse_empty_secrets(spec: JobSpec, label: str) -> None:
    """A secret the nodes would get empty (``secrets: [X]`` with X empty, ``env: {TOKEN: ${X}}``
    resolving to nothing) is refused now: a node never runs with an empty secret (issue 28).

    Raises:
        SpecError: naming the variable (exit 2).
    """
    from sftctl.controller.submit import required_secrets
    from sftctl.spec import resolve_env

    for name in required_secrets(spec):
        if name in spec.env:
            if not resolve_env({name: spec.env[name]})[name]:
                raise SpecError(f"{label}: env.{name}: {spec.env[name]} is empty in {_WHERE_SECRETS[SERVING]}; a node would "
                                "get an empty secret", hint="export the variable it refers to with its value")
        elif not os.environ.get(name):
            raise SpecError(f"{label}: secrets: {name} is empty in {_WHERE_SECRETS[SERVING]}; a node would get an empty secret",
                            hint=f"export {name}=... with its value, or drop it from secrets")


def _need_storage(spec: JobSpec, label: str, where: str) -> None:
    """Cloud nodes keep code, checkpoints and logs in the job's storage: refuse a spec without.
    Local and Slurm nodes keep them on a filesystem sftctl reads (Slurm: the cluster's own)."""
    if not set(where.split("/")) & {"local", "slurm"} and spec.storage is None:
        origin = spec.defaults_from.get("resources.clouds")
        raise SftctlError(
            f"{label}: storage: required for {where} nodes (they keep code, checkpoints and logs in the "
            "job's storage)" + (f"; the spec leaves resources.clouds out, and {origin} sets it to [{where.replace('/', ', ')}]"
                                if origin else ""),
            hint="add storage: s3://BUCKET/PREFIX (aws), gs://BUCKET/PREFIX (gcp) or pvc://CLAIM/PREFIX (kubernetes)",
        )


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
    step.sh, Kubernetes manifests, as they would be handed over; see
    :func:`sftctl.controller.preview.preview`).

    Raises:
        SpecError, InfeasibleError: as :func:`submit`.
    """
    from sftctl.controller.preview import preview

    s, _, chosen = _prepare(spec, overrides, progress)
    return {"dry_run": True, "job": s.name, "plan": chosen.reason, **preview(s, chosen)}


@_typed
def submit(spec: SpecLike, overrides: Overrides = (), *, progress: Progress | None = None,
           origin: str | None = None, owner: str | None = None) -> Submitted:
    """Validate and plan a job, check its storage, and record it in state (PENDING). Starts
    nothing: :func:`start` (detached) or :func:`attach` (in this process) runs it.

    ``origin``: with ``spec`` the YAML text of a file read elsewhere, that file's path (messages
    name it, relative paths are taken from its directory; a server passes its client's).
    ``owner``: the user the job belongs to (a server passes its requester's name; default: this
    machine's user).

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
        s, path, chosen = _prepare(spec, overrides, progress, origin)
        if s.storage is not None:
            _check_storage(s.storage)
        store = Store()
        job_id = store.create_job(s.name, s.model_dump(mode="json"),
                                  spec_path=str(path.resolve()) if path is not None else None, owner=owner)
        store.update_job(job_id, provider=chosen.offering.provider, offering_json=chosen.to_dict())
        store.add_event(job_id, "plan", chosen.reason)
    return Submitted(job_id, s, chosen)


def _submit_remote(remote, spec: SpecLike, overrides: Overrides) -> Submitted:
    """:func:`submit` through the server: the spec's text and where it came from (relative paths
    are taken from its directory, as here) and the overrides go there; the server validates,
    plans and records the job as its requester's. Secrets travel by name: the server's
    environment holds their values. The server's warnings are issued here."""
    from sftctl.spec import JobSpec

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
                         json={"spec_text": text, "spec_path": label, "overrides": _override_strings(overrides)})
    for line in doc.get("warnings", []):
        warnings.warn(SftctlWarning(line), stacklevel=3)
    record = JobRecord.from_dict(doc["job"])
    return Submitted(record.id, JobSpec.model_validate(record.spec), record.plan)


def spawn_controller(job_id: str):
    """Start the detached controller of a recorded job: ``python -m sftctl.queue JOB`` (which
    becomes ``python -m sftctl.controller JOB`` once the job may start; :func:`sftctl.procs.module_argv`),
    in a session of its own, logging to ``$SFTCTL_HOME/jobs/JOB/controller.log``; record its pid.
    Returns the :class:`subprocess.Popen` (the server keeps it, to reap it when it ends).

    A job whose spec says ``controller.place: slurm`` gets its controller as a Slurm job instead
    (:func:`sftctl.controller.submit.place_controller`); then None is returned.

    Raises:
        ProviderError: sbatch refused the controller's Slurm job (exit 4).
    """
    import subprocess

    from sftctl import procs
    from sftctl.paths import job_dir
    from sftctl.state import placed

    store = _store()
    record = store.get_job(job_id)
    if record is not None and placed(record.spec):
        from sftctl.controller.submit import place_controller

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
    from sftctl.queue import check_no_live_controller

    remote = _remote()
    if remote is not None:
        return JobView.from_wire(remote.request("POST", remote.job_path(job, "/start")))
    from sftctl.state import placed

    store = _store()
    record = _resolve(store, job)
    if record.status.terminal:
        raise SftctlError(f"job {record.id} already ended ({record.status.value}): there is nothing to start",
                          hint="sftctl run SPEC starts a new job; sftctl events " + record.id + " shows how it ended")
    if placed(record.spec):
        from sftctl.controller.submit import forget_lost_queued_controller

        forget_lost_queued_controller(store, record)  # its Slurm job was cancelled before it ran
    check_no_live_controller(record.id, store)
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
            None: events go to the ``sftctl.controller`` logger.

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


def _follow(job: str, reporter, by: str) -> Attached:
    """:func:`attach` of a job whose controller runs elsewhere (a server, a Slurm job): start it
    there and follow its logs (``reporter.log``) until it ends; Ctrl-C leaves it running."""
    started = time.monotonic()
    job = start(job).id
    try:
        for line in logs(job, follow=True):
            if reporter is not None and not line.notice:
                reporter.log(line.rank or 0, line.text + "\n")
        view = wait(job)
    except KeyboardInterrupt:
        raise SftctlError(f"interrupted: job {job} goes on, supervised {by}",
                          hint=f"sftctl logs {job} --follow watches it again; sftctl down {job} stops it",
                          exit_code=ExitCode.INTERRUPTED) from None
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


# ------------------------------------------------------------------------------ status


@dataclasses.dataclass(frozen=True)
class JobView:
    """A job as ``sftctl status`` shows it: its record, the latest metrics of each rank and, for
    one job (``detail``), its nodes (with what the provider sees when the controller is gone),
    attempts and health events.

    ``step`` is the slowest rank's step, ``loss`` the mean over the ranks' latest reports,
    ``tokens_per_s`` their sum.
    """

    record: JobRecord
    ranks: list[MetricsRecord]
    detail: bool = False
    nodes: list[NodeRecord] = dataclasses.field(default_factory=list)
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    health: list[Event] = dataclasses.field(default_factory=list)
    rank_nodes: dict[int, int] = dataclasses.field(default_factory=dict)  # training rank -> node rank
    cost: Cost | None = None  # accumulated so far (None before it is planned)

    id = property(lambda self: self.record.id)
    name = property(lambda self: self.record.name)
    status = property(lambda self: self.record.status)
    failure_reason = property(lambda self: self.record.failure_reason)

    @property
    def step(self) -> int | None:
        return min(r.step for r in self.ranks) if self.ranks else None

    @property
    def loss(self) -> float | None:
        losses = [r.loss for r in self.ranks if r.loss is not None]
        return sum(losses) / len(losses) if losses else None

    @property
    def tokens_per_s(self) -> float | None:
        tps = [r.tokens_per_s for r in self.ranks if r.tokens_per_s is not None]
        return sum(tps) if tps else None

    def to_dict(self) -> dict[str, Any]:
        """``status --json``'s document for this job (``run --json`` adds ``wall_s``).

        Unlike :meth:`JobRecord.to_dict` it summarizes: ``resources`` ("local cpu:1 x2"),
        ``nodes`` (the count; with detail, the node rows ``{"id", "rank", "status", "where"}``),
        ``step``/``steps``/``loss``/``tokens_per_s`` over the ranks, ``plan`` (the plan's reason,
        not the plan), ``pending_reason`` while PENDING (local admission) or RUNNING with its nodes
        queued by the scheduler (Slurm's reason), and leaves out the spec. With
        detail: ``ranks`` (:class:`MetricsRecord` each, with ``node``: the node rank it runs on), ``attempts`` (:class:`Attempt` each) and
        ``health`` (each health event's ``ts`` and ``message`` with its data's keys).
        """
        job = self.record
        res = job.spec["resources"]
        o = job.offering
        doc = {
            "id": job.id,
            "name": job.name,
            "status": job.status.value,
            "terminal": job.status.terminal,  # SUCCEEDED, FAILED, CANCELLED, FAILED_CONTROLLER
            "resources": f"{o.provider} {o.accelerator}:{o.count} x{res['nodes']}" if o else f"x{res['nodes']}",
            "provider": job.provider,
            "nodes": res["nodes"],
            "step": self.step,
            # a plain shell job that reports no metrics has no step count to show
            "steps": job.spec["train"]["steps"] if job.spec.get("model") or self.ranks else None,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "restarts": job.restarts,
            "failure_reason": job.failure_reason,
            "failure_code": job.failure_code,
            # local admission (PENDING) or the scheduler's queue (RUNNING, nodes queued in Slurm)
            "pending_reason": job.pending_reason if job.status in (JobStatus.PENDING, JobStatus.RUNNING) else None,
            "created_at": job.created_at,
            "ended_at": job.ended_at,
            "controller_pid": job.controller_pid,
            "cost": self.cost.to_dict() if self.cost else None,  # {usd, price_per_hour, source, node_hours}
        }
        if self.detail:
            doc["plan"] = job.plan_reason
            doc["ranks"] = [{**r.to_dict(), "node": self.rank_nodes.get(r.rank)} for r in self.ranks]
            doc["nodes"] = [{"id": n.id, "rank": n.rank, "status": n.status, "where": getattr(n.node_handle, "ip", None) or n.provider}
                            for n in self.nodes]
            doc["attempts"] = [a.to_dict() for a in self.attempts]
            doc["health"] = [{"ts": e.ts, "message": e.message, **(e.data or {})} for e in self.health]
        return doc

    def to_wire(self) -> dict[str, Any]:
        """The view as the server sends it: its records whole (:meth:`from_wire` reads it back),
        so a client's :meth:`to_dict` is the same document as the server's; a view without
        ``detail`` (a row of the jobs list) leaves out its plan's ``candidates``, which can be
        hundreds per job (``status(job)`` has them)."""
        record = self.record.to_dict()
        if not self.detail and record.get("plan"):
            record["plan"] = {k: v for k, v in record["plan"].items() if k != "candidates"}
        return {"record": record, "ranks": [r.to_dict() for r in self.ranks], "detail": self.detail,
                "nodes": [n.to_dict() for n in self.nodes], "attempts": [a.to_dict() for a in self.attempts],
                "health": [e.to_dict() for e in self.health],
                "rank_nodes": {str(k): v for k, v in self.rank_nodes.items()},
                "cost": self.cost.to_dict() if self.cost else None}

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> "JobView":
        """Read :meth:`to_wire`'s document back."""
        return cls(JobRecord.from_dict(doc["record"]), [MetricsRecord.from_dict(r) for r in doc["ranks"]],
                   doc["detail"], [NodeRecord.from_dict(n) for n in doc["nodes"]],
                   [Attempt.from_dict(a) for a in doc["attempts"]], [Event.from_dict(e) for e in doc["health"]],
                   {int(k): v for k, v in doc["rank_nodes"].items()},
                   Cost.from_dict(doc["cost"]) if doc.get("cost") else None)


@_typed
def job(job: str) -> JobRecord:
    """The job's record, by id or unique id prefix (a dead controller's job reads FAILED_CONTROLLER).

    Raises:
        NotFoundError: empty, unknown or ambiguous id (exit 2).
    """
    if _remote() is not None:
        return status(job).record
    return _resolve(_store(), job)


def _store() -> Store:
    from sftctl.state import Store

    return Store()


def _resolve(store: Store, job: str) -> JobRecord:
    """A job by id or unique id prefix. Every read goes through here, so every one sees a dead
    controller: live jobs whose controller process is gone are marked FAILED_CONTROLLER first.

    Raises:
        NotFoundError: empty, unknown or ambiguous id (exit 2).
    """
    if not job.strip():
        raise NotFoundError("the job id is empty", hint="sftctl status lists the jobs")
    _reap(store)
    record = store.get_job(job)
    if record is not None:
        return record
    matches = [j.id for j in store.list_jobs() if j.id.startswith(job)]
    if len(matches) == 1:
        return store.get_job(matches[0])
    if matches:
        raise NotFoundError(f"{job!r} matches {len(matches)} jobs", hint=f"give more of the id: {', '.join(matches[:5])}")
    raise NotFoundError(f"no job {job!r}", hint="sftctl status lists the jobs")


def _view(store: Store, job: JobRecord, detail: bool = False, ranks: list[MetricsRecord] | None = None,
          spans: list[tuple[float, float | None]] | None = None) -> JobView:
    if ranks is None:
        ranks = store.metrics(job.id)
    if spans is None:
        spans = store.node_spans(job.id).get(job.id, [])
    cost = _cost(job, spans)
    if not detail:
        return JobView(job, ranks, cost=cost)
    nodes = [dataclasses.replace(n, status=_node_status(job, n)) for n in store.nodes(job.id)]
    events = store.events(job.id)
    health = [e for e in events if e.kind == "health"]
    return JobView(job, ranks, True, nodes, store.attempts(job.id), health, _rank_nodes(events), cost)


def _node_hours(job: JobRecord, spans: list[tuple[float, float | None]], since: float | None = None,
                until: float | None = None, now: float | None = None) -> float:
    """Hours the job's nodes billed inside [since, until]. A node bills from when it was recorded
    until it was TERMINATED or REPLACED; one with no end bills until the job ended (its
    controller tore it down), or until now when the job is live or its controller died (then
    nothing may have stopped it: ``sftctl down`` does)."""
    now = time.time() if now is None else now
    open_end = job.ended_at if job.status.terminal and job.status != JobStatus.FAILED_CONTROLLER else None
    total = 0.0
    for start, end in spans:
        end = end if end is not None else (open_end if open_end is not None else now)
        lo, hi = max(start, since if since is not None else start), min(end, until if until is not None else end)
        total += max(0.0, hi - lo)
    return total / 3600.0


def _cost(job: JobRecord, spans: list[tuple[float, float | None]], since: float | None = None,
          until: float | None = None) -> Cost | None:
    """The job's :class:`~sftctl.types.Cost` (None before it has an offering)."""
    o = job.offering
    if o is None:
        return None
    spot = bool((job.spec.get("resources") or {}).get("spot"))
    price = o.price(spot)
    hours = _node_hours(job, spans, since, until)
    where = f"{o.provider} {o.instance_type}" + (f" in {o.region}" if o.region else "")
    if price is None:
        source = f"no spot price for {where} in the catalog"
    else:
        source = (f"{'spot' if spot else 'on-demand'} price of {where}: {o.source or 'the catalog'}"
                  + (f" ({o.as_of})" if o.as_of else ""))
    usd = None if price is None else round(price * hours, 6)
    return Cost(usd=usd, price_per_hour=price, source=source, node_hours=round(hours, 6))


def _rank_nodes(events: list[Event]) -> dict[int, int]:
    """Training (global) rank -> node rank, from the controller's latest ``ranks`` event (the
    rendezvous, not sftctl, assigns ranks: c10d may give rank 0 to node 1)."""
    placed = [e for e in events if e.kind == "ranks"]
    return {int(r): n for r, n in ((placed[-1].data or {}).get("ranks") or {}).items()} if placed else {}


def _node_status(job: JobRecord, node: NodeRecord) -> str:
    """The node's recorded status, or, when its controller is gone, what the provider sees now."""
    handle = node.node_handle
    if job.status != JobStatus.FAILED_CONTROLLER or node.status == NodeState.TERMINATED or handle is None:
        return node.status
    from sftctl.controller.submit import job_provider

    return job_provider(job, node.provider).status(handle).state.value


@_typed
def status(job: str | None = None, *, all_users: bool = False) -> JobView | list[JobView]:
    """One job in detail, or every job (newest first) without. Marks jobs whose controller died
    FAILED_CONTROLLER first.

    Raises:
        NotFoundError: ``job`` matches no job or several (exit 2).

    With a server configured: the jobs of this token's user there (``all_users``: every user's,
    for an admin; else a :class:`SftctlError`, exit 2); the list's records carry their plan
    without its ``candidates`` (one job's view has them).
    """
    remote = _remote()
    if remote is not None:
        if job is not None:
            return JobView.from_wire(remote.request("GET", remote.job_path(job)))
        return [JobView.from_wire(d) for d in remote.request("GET", "/v1/jobs", params={"all_users": all_users})["jobs"]]
    if all_users:
        raise SftctlError("--all-users is for a server's admins; without a server every job here is shown",
                          hint="sftctl status")
    store = _store()
    if job is not None:
        return _view(store, _resolve(store, job), detail=True)
    _reap(store)
    by_job: dict[str, list[MetricsRecord]] = {}
    for r in store.metrics():
        by_job.setdefault(r.job_id, []).append(r)
    spans = store.node_spans()
    return [_view(store, j, ranks=by_job.get(j.id, []), spans=spans.get(j.id, [])) for j in store.list_jobs()]


def costs(by: str = "user", since: float | None = None, until: float | None = None) -> list[CostTotal]:
    """What the jobs cost over a period, per user (``by="user"``: one row per job owner, by
    name) or for the whole lab (``by="lab"``: one row, group ``lab``). ``since``/``until``: Unix
    seconds (None: open); each node counts only its hours inside the period, at its job's price
    (see :class:`~sftctl.types.Cost`).

    With a server configured, the server sums them: a user gets their own row (``by="user"``),
    an admin every user's and the lab's (else a :class:`SftctlError`, exit 2).

    Raises:
        SftctlError: ``by`` is neither user nor lab, or since > until (exit 2).
    """
    if by not in ("user", "lab"):
        raise SftctlError(f"costs: by must be 'user' or 'lab', not {by!r}", exit_code=ExitCode.USAGE)
    for name, value in (("since", since), ("until", until)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"api.costs: {name} must be Unix seconds (int or float), or None, got {_type_name(value)}")
    if since is not None and until is not None and since > until:
        raise SftctlError(f"costs: since ({since}) is after until ({until})", exit_code=ExitCode.USAGE)
    remote = _remote()
    if remote is not None:
        params = {"by": by, **{k: v for k, v in (("since", since), ("until", until)) if v is not None}}
        return [CostTotal.from_dict(r) for r in remote.request("GET", "/v1/costs", params=params)["costs"]]
    store = _store()
    spans = store.node_spans()
    totals: dict[str, dict[str, Any]] = {}
    for job in store.list_jobs():
        cost = _cost(job, spans.get(job.id, []), since, until)
        if cost is None or cost.node_hours == 0:
            continue
        group = (job.owner or "unknown") if by == "user" else "lab"
        t = totals.setdefault(group, {"usd": 0.0, "node_hours": 0.0, "jobs": 0, "unpriced_jobs": 0})
        t["jobs"] += 1
        t["node_hours"] += cost.node_hours
        if cost.usd is None:
            t["unpriced_jobs"] += 1
        else:
            t["usd"] += cost.usd
    return [CostTotal(group=g, usd=round(t["usd"], 6), node_hours=round(t["node_hours"], 6), jobs=t["jobs"],
                      unpriced_jobs=t["unpriced_jobs"], since=since, until=until) for g, t in sorted(totals.items())]


#: Seconds (at most) :func:`wait` waits, once a job has ended, for its controller to bring the
#: job's nodes down: the controller records the end first, then terminates them.
WAIT_TEARDOWN_S = 120.0


def _nodes_released(view: JobView) -> bool:
    """Whether an ended job's nodes are down (every record TERMINATED or REPLACED), or nobody is
    left to bring them down (FAILED_CONTROLLER: ``sftctl down`` does that)."""
    if view.status == JobStatus.FAILED_CONTROLLER:
        return True
    return all(n.status in (NodeState.TERMINATED, NodeState.REPLACED) for n in view.nodes)


@_typed
def wait(job: str, *, timeout_s: float | None = None, poll_s: float = 1.0) -> JobView:
    """Poll :func:`status` until the job ends and its controller has brought its nodes down
    (at most :data:`WAIT_TEARDOWN_S` more, and not past ``timeout_s``); return its final view.
    A script that starts the next job after ``wait`` thus never runs beside this one's nodes.

    Raises:
        NotFoundError: no such job (exit 2).
        TimeoutError: still running after ``timeout_s`` seconds (an ended job never raises).
    """
    now = time.monotonic()
    end = None if timeout_s is None else now + timeout_s
    teardown_end = None
    while True:
        view = status(job)
        now = time.monotonic()
        if view.status.terminal:
            teardown_end = teardown_end or now + WAIT_TEARDOWN_S
            if _nodes_released(view) or now >= teardown_end or (end is not None and now >= end):
                return view
        elif end is not None and now >= end:
            raise TimeoutError(f"job {view.id} is still {view.status.value} after {timeout_s:.3g} s")
        time.sleep(poll_s)


# ------------------------------------------------------------------------------ logs and events


@dataclasses.dataclass(frozen=True)
class LogLine(Record):
    """One line a node's script wrote (``rank`` its node), without its newline; or, with
    ``notice``, sftctl's own line about the logs (``rank`` None), e.g. that the controller died
    while following. ``str()`` is the line as ``sftctl logs`` prints it: ``(node N) `` in front
    when the job has several nodes and no one node was asked for."""

    text: str
    rank: int | None = None
    prefix: str = ""
    notice: bool = False

    def __str__(self) -> str:
        return self.prefix + self.text


@_typed
def logs(job: str, *, follow: bool = False, node: int | None = None, rank: int | None = None,
         poll_s: float = 0.5) -> Iterator[LogLine]:
    """A job's node logs, line by line, from the start (every attempt appends to the same log).

    Args:
        follow: keep yielding until the job ended and no node process writes any more (or its
            controller died: a notice line says so and the iteration ends).
        node: only this node rank.
        rank: only the node that runs this training (global) rank, as the nodes reported it.

    Raises:
        NotFoundError: no such job (exit 2); the job's logs were purged (``down(purge=True)``;
            exit 1, as ``kubectl logs`` of a deleted pod).
        SftctlError: ``node`` is not a rank of the job, or no node reported ``rank`` (exit 2).
        TypeError: ``job`` or ``node`` of the wrong type (as every function here).

    With a server configured, the server reads the nodes and streams the lines (``follow``: as
    they come).
    """
    remote = _remote()
    if remote is not None:
        params = {"follow": follow, **({"node": node} if node is not None else {}),
                  **({"rank": rank} if rank is not None else {})}
        return (LogLine(d["text"], d.get("rank"), d.get("prefix", ""), d.get("notice", False))
                for d in remote.stream_lines(remote.job_path(job, "/logs"), params))
    from sftctl.controller.submit import job_provider

    store = _store()
    record = _resolve(store, job)
    purged = [e for e in store.events(record.id) if e.kind == "purge"]
    if purged:  # as `kubectl logs` of a deleted pod: an error, not an empty log
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(purged[-1].ts))
        raise NotFoundError(f"logs of {record.id} were purged (sftctl down --purge at {when})",
                            hint=f"sftctl events {record.id} shows its history; sftctl status {record.id} its record",
                            exit_code=ExitCode.JOB_FAILED)
    if rank is not None:
        placed = _rank_nodes(store.events(record.id))
        if rank not in placed:
            known = f"ranks reported so far: {', '.join(map(str, sorted(placed)))}" if placed else "no rank reported yet"
            raise SftctlError(f"--rank {rank}: no node of job {record.id} reported training rank {rank} ({known}; "
                              "ranks are known once the script calls sftctl.train.report)",
                              hint=f"sftctl status {record.id} shows rank -> node; sftctl logs {record.id} --node N")
        node = placed[rank]
    ranks = record.spec["resources"]["nodes"]
    if node is not None and not 0 <= node < ranks:
        which = "node 0" if ranks == 1 else f"nodes 0-{ranks - 1}"
        raise SftctlError(f"--node {node}: job {record.id} has {ranks} node(s): {which}",
                          hint=f"sftctl logs {record.id} --node 0 (or no --node: every node)")
    return _log_lines(store, record, job_provider(record), follow, node, poll_s, NodeState)


def _log_lines(store, record, provider, follow, node, poll_s, NodeState) -> Iterator[LogLine]:
    offsets: dict[str, int] = {}
    partial: dict[str, tuple[str, int, str]] = {}  # node id -> (text after the last newline, rank, prefix)
    while True:
        nodes = [n for n in store.nodes(record.id) if node is None or n.rank == node]
        handles = {n.id: n.node_handle for n in nodes}
        got = False
        for n in nodes:
            h = handles[n.id]
            data, offsets[n.id] = provider.read_log(h, offsets.get(n.id, 0)) if h is not None else (b"", 0)
            if not data:
                continue
            got = True
            prefix = f"(node {n.rank}) " if node is None and len(nodes) > 1 else ""
            lines = (partial.get(n.id, ("",))[0] + data.decode("utf-8", "replace")).split("\n")
            partial[n.id] = (lines.pop(), n.rank, prefix)
            for line in lines:
                yield LogLine(line, n.rank, prefix)
        if not follow:
            break
        _reap(store)
        now = store.get_job(record.id)
        if now.status == JobStatus.FAILED_CONTROLLER:
            # nobody supervises the nodes any more: following them could last forever
            yield LogLine(now.failure_reason or "the controller died", notice=True)
            break
        if now.status.terminal and not got and not any(
            provider.status(handles[n.id]).state == NodeState.RUNNING for n in nodes
            if handles[n.id] is not None and handles[n.id].attempt
        ):
            break  # the job ended and no node process writes any more (a dead controller's may)
        time.sleep(poll_s)
    for rest, rank, _prefix in partial.values():
        if rest:
            yield LogLine(rest, rank)  # the unterminated last line, unprefixed as sftctl logs prints it


@_typed
def events(job: str) -> list[Event]:
    """A job's history, oldest first: plan, transitions, nodes, restarts, health, teardown.

    Raises:
        NotFoundError: no such job (exit 2).
    """
    remote = _remote()
    if remote is not None:
        return [Event.from_dict(e) for e in remote.request("GET", remote.job_path(job, "/events"))["events"]]
    store = _store()
    return store.events(_resolve(store, job).id)


def events_doc(job_id: str, evs: list[Event]) -> dict:
    """``sftctl events --json``: ``{"job_id", "events": [{"id", "ts", "kind", "message", "data"}]}``
    (each :meth:`Event.to_dict` less its ``job_id``, which is said once at the top). Once the job
    ended, the last event's ``data`` carries ``final``: ``step`` (the slowest rank's),
    ``loss_mean_over_ranks`` (the mean of each rank's latest loss: ``status``'s ``loss``),
    ``loss_by_rank`` (``{"0": ..., ...}``: each rank's latest, e.g. what rank 0 logs as its last
    loss) and ``tokens_per_s`` (summed over ranks); None each when no rank reported."""
    doc = {"job_id": job_id, "events": [{k: v for k, v in e.to_dict().items() if k != "job_id"} for e in evs]}
    if doc["events"]:
        view = status(job_id)
        if view.status.terminal:
            last = doc["events"][-1]
            last["data"] = {**(last.get("data") or {}), "final": {
                "step": view.step, "loss_mean_over_ranks": view.loss, "tokens_per_s": view.tokens_per_s,
                "loss_by_rank": {str(r.rank): r.loss for r in view.ranks}}}
    return doc


# ------------------------------------------------------------------------------ down


@dataclasses.dataclass(frozen=True)
class DownResult(Record):
    """What ``down`` did to one job: its status after, a one-line summary and, with ``purge``,
    what was removed (:func:`sftctl.controller.teardown.purge`'s ``{"job_id", "objects", "bytes",
    "removed", "kept"}``). ``to_dict()`` is a row of ``down --json``'s ``down``; ``purged`` is
    there only when a purge was asked."""

    job_id: str
    status: str
    summary: str
    purged: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        doc = super().to_dict()
        if self.purged is None:
            del doc["purged"]
        return doc


@_typed
def down(job: str | None = None, *, all: bool = False, purge: bool = False,  # noqa: A002 (the CLI's --all)
         progress: Progress | None = None) -> list[DownResult]:
    """Cancel a job (or, with ``all``, every job not finished or with nodes left) and remove its
    nodes and processes, also after its controller died; with ``purge``, then remove what sftctl
    wrote for it (its storage prefix, the workdir pack it uploaded, its local directory; never
    the bucket, other objects or a spec's ``train.checkpoint_dir``). Idempotent. Every node of
    a job is taken down at once; ``progress`` hears one line per stage of a long teardown.

    Raises:
        NotFoundError: no such job (exit 2).
        SftctlError: neither or both of ``job`` and ``all`` (exit 2).
        StorageError: the job's storage failed while purging (exit 4).
    """
    from sftctl.controller.teardown import down as down_job
    from sftctl.controller.teardown import purge as purge_job
    from sftctl.types import TERMINAL

    if bool(job) == all:
        raise SftctlError("give one JOB or --all", hint="sftctl down JOB, or sftctl down --all, or sftctl down --orphans")
    remote = _remote()
    if remote is not None:  # --all: this user's jobs on the server
        doc = remote.request("POST", "/v1/down", read_s=None, json={"job": job, "all": all, "purge": purge})
        return [DownResult(**d) for d in doc["down"]]
    store = _store()
    if all:
        _reap(store)
        ids = [j.id for j in store.list_jobs()
               if j.status not in TERMINAL or any(n.status != NodeState.TERMINATED for n in store.nodes(j.id))]
    else:
        ids = [_resolve(store, job).id]
    summaries = [down_job(store, i, progress) for i in ids]
    purged = [purge_job(store, i) for i in ids] if purge else [None] * len(ids)  # down first, in this call
    return [DownResult(i, store.get_job(i).status.value, s, p) for i, s, p in zip(ids, summaries, purged)]


def down_orphans(checked: list[str] | None = None) -> list[str]:
    """Delete every labelled resource, on every configured cloud, whose job is gone or ended;
    one summary line per job swept (see :func:`sftctl.controller.teardown.down_orphans`). ``checked``, a
    list, receives the providers that were asked (``local`` always; a cloud once configured).

    With a server configured, the server sweeps its own state with its own credentials.

    Raises:
        SftctlError: through a server, the user is not one of its admins (exit 2).
    """
    from sftctl.controller.teardown import down_orphans as sweep

    remote = _remote()
    if remote is not None:  # the server sweeps with its state and its credentials (admins only)
        doc = remote.request("POST", "/v1/orphans", read_s=None)
        if checked is not None:
            checked.extend(doc["checked"])
        return list(doc["swept"])
    try:
        store = _store()
    except SftctlError as e:  # a lost or damaged state: the job dirs and provider tags still know
        return [f"state: {e.message}; every job counts as unknown"] + sweep(None, checked)
    return sweep(store, checked)


# ------------------------------------------------------------------------------ clouds and catalog


@dataclasses.dataclass(frozen=True)
class CloudCheck(Record):
    """Whether a cloud's credentials work here; if not, why (``reason``) and what to set
    (``hint``). ``to_dict()`` is a row of ``sftctl check --json``'s ``clouds``."""

    cloud: str
    ok: bool
    reason: str | None = None
    hint: str | None = None


@_typed
def check(clouds: str | Sequence[str] | None = None) -> list[CloudCheck]:
    """Ask each cloud (``clouds``: one name or a list; default: every provider) whether it works
    from here, in parallel.

    Raises:
        SftctlError: an unknown cloud name (exit 2).
    """
    from concurrent.futures import ThreadPoolExecutor

    from sftctl.providers import PROVIDERS, configured, get_provider

    names = list(clouds or PROVIDERS)
    for n in names:
        if n not in PROVIDERS:
            raise SftctlError(f"unknown cloud {n!r}", hint=f"clouds: {', '.join(PROVIDERS)}")

    def one(name: str) -> CloudCheck:
        why = configured(name)
        if why is not None:
            return CloudCheck(name, False, why)
        try:
            get_provider(name).check()
            return CloudCheck(name, True)
        except SftctlError as e:
            return CloudCheck(name, False, e.message, e.hint)

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return list(pool.map(one, names))


@_typed
def catalog(accelerator: str | None = None) -> list[Offering]:
    """The offerings sftctl knows (this machine first), optionally of one accelerator
    (case-insensitive).

    Raises:
        SftctlError: an accelerator the catalog does not know, with a did-you-mean (exit 2).
    """
    from sftctl.catalog import cloud_offerings, local_offering

    offerings = [local_offering(1)] + cloud_offerings()
    if accelerator:
        name = accelerator_name(accelerator)
        offerings = [o for o in offerings if o.accelerator.lower() == name.lower()]
    return offerings


@_typed
def catalog_refresh(clouds: list[str] | None = None, regions: list[str] | None = None, *,
                    progress: Callable[[str], None] | None = None, workers: int = 16) -> dict:
    """Rebuild the catalog of ``clouds`` (default aws and gcp) from their APIs with the user's
    credentials (:mod:`sftctl.providers.prices`), narrowed to ``regions`` when given, and store it
    in the user's data dir (``$SFTCTL_HOME/catalog.csv``), which ``catalog`` and ``plan`` then use.
    All or nothing: any cloud that fails (credentials, a call still throttled after the retries, no
    offerings at all) raises and the previous catalog stays whole.

    Returns:
        ``{"file": path, "seconds": wall time, "clouds": {cloud: {"offerings": n, "regions": n}}}``.
    Raises:
        SftctlError: an unknown cloud (exit 2); CredentialsError (exit 4); ProviderError.
    """
    from concurrent.futures import ThreadPoolExecutor

    from sftctl.catalog import write_refreshed
    from sftctl.providers import prices

    clouds = list(dict.fromkeys(clouds or ["aws", "gcp"]))
    fns = {"aws": prices.aws_rows, "gcp": prices.gcp_rows}
    bad = [c for c in clouds if c not in fns]
    if bad:
        raise SftctlError(f"catalog refresh: no price list for cloud {bad[0]!r}",
                          hint="clouds with price APIs: aws, gcp (Kubernetes and Slurm report what they have)")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(clouds)) as pool:
        futures = {c: pool.submit(fns[c], regions, workers=workers, progress=progress) for c in clouds}
        done = {c: f.result() for c, f in futures.items()}
    rows = {c: got for c, (got, _) in done.items()}
    for c, got in rows.items():
        if not got:
            raise ProviderError(f"{c}: the refresh found no GPU offerings"
                                + (f" in {', '.join(regions)}" if regions else ""),
                                hint="the previous catalog is kept; check --regions and the account's access")
    path = write_refreshed([r for got in rows.values() for r in got],
                           {c: (None if regions is None else read) for c, (_, read) in done.items()})
    return {"file": str(path), "seconds": round(time.monotonic() - start, 1),
            "clouds": {c: {"offerings": len(got), "regions": len({r["region"] for r in got})}
                       for c, got in rows.items()}}


def accelerator_names() -> list[str]:
    """Every accelerator name sftctl knows (offered, or in the hardware table), sorted."""
    from sftctl.catalog import accelerator_names as names

    return names()


def accelerator_name(name: str) -> str:
    """The catalog's spelling of an accelerator name (``h100`` -> ``H100``).

    Raises:
        SftctlError: unknown, with a did-you-mean (exit 2).
    """
    from sftctl.catalog import accelerator_names
    from sftctl.catalog.accelerators import suggest_accelerators

    names = {n.lower(): n for n in accelerator_names()}
    if name.lower() not in names:
        close = suggest_accelerators(name, list(names.values()))
        raise SftctlError(f"--accelerator: unknown accelerator {name!r}"
                          + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""),
                          hint=f"known: {', '.join(names.values())}")
    return names[name.lower()]


# ------------------------------------------------------------------------------ compile


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """A job's whole training step compiled for one accelerator.

    ``doc`` is ``compile --json``'s document (also written to ``out/plan.json``, with
    ``out/report.md`` and ``out/roofline.svg``); ``compiled`` the
    :class:`sftctl.compiler.step.CompiledStep` (kernels, schedules, search statistics);
    ``ops`` the traced graph's node count; ``mode`` the execution mode the spec runs in.
    """

    doc: dict
    out: Path
    compiled: Any
    ops: int
    accelerator: str
    mode: str
    spec: Any = None  # the JobSpec compiled

    def to_dict(self) -> dict:
        return self.doc


@_typed
def compile(spec: SpecLike, target: str, overrides: Overrides = (), *, out: str | os.PathLike | None = None,  # noqa: A001
            progress: Progress | None = None) -> CompileResult:
    """Compile a job's whole training step for ``target`` (an accelerator name: h100,
    a100-80gb, mi300x, cpu): kernels, schedules, predicted step time per execution mode, peak
    memory; write ``plan.json``, ``report.md`` and ``roofline.svg`` under ``out`` (default
    ``./sftctl-compile/<job>-<accelerator>``).

    Raises:
        SpecError: invalid spec (exit 2).
        SftctlError: no ``target``, no ``model`` in the spec, or an unknown accelerator (exit 2).
    """
    import json

    if not target:
        raise SftctlError("compile needs --target", hint="e.g. sftctl compile job.yaml --target h100 (sftctl catalog lists accelerators)")
    s, label, _ = _load(spec, overrides)
    if s.model is None:
        raise SftctlError(f"{label}: the spec has no model to compile", hint="add model: {framework, entrypoint, batch_size, dtype}")
    from sftctl.compiler.report import compile_doc, write_report
    from sftctl.compiler.target import load_target
    from sftctl.planner import Predictor

    try:
        target = load_target(target)
    except KeyError as e:
        raise SftctlError(f"--target: {e.args[0]}", hint="sftctl catalog lists the accelerators") from None
    hw = target.hw
    say = progress or (lambda msg: None)
    predictor = Predictor(s, progress=say)
    graph = predictor.graph()
    compiled = predictor.compile(hw.name)
    doc = compile_doc(compiled, graph, s, hw, predictor.mode)
    doc["notes"] = [predictor.notes[hw.name]] if hw.name in predictor.notes else []
    # data-dependent sizes (boolean-mask selects, MoE dispatch) were priced at a bound: say which
    doc["notes"] += ["assumed " + n.attrs["assumption"] + " (set model.mask_fraction / model.expert_capacity)"
                     for n in graph.nodes if "assumption" in n.attrs]
    doc["notes"] += [n.attrs["note"] for n in graph.nodes if "note" in n.attrs]  # what the trace leaves out
    where = Path(out) if out is not None else Path("sftctl-compile") / f"{s.name}-{hw.name.lower()}"
    where.mkdir(parents=True, exist_ok=True)
    (where / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_report(doc, hw, where)
    return CompileResult(doc, where, compiled, len(graph.nodes), hw.name, predictor.mode, s)

