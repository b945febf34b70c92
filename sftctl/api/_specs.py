"""Specs and plans of the api (see :mod:`sftctl.api`): :func:`load`, :func:`plan` (and the
run history it calibrates with, :func:`calibration_runs`), ``plan --json``'s :func:`plan_doc`."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from sftctl.api._base import Overrides, Progress, SpecLike, _remote, _serving, _store, _typed
from sftctl.errors import SftctlError, SftctlWarning, SpecError
from sftctl.plan_wording import no_step_time as _no_step_time
from sftctl.types import RunRecord

if TYPE_CHECKING:
    from sftctl.spec import JobSpec
    from sftctl.types import Plan


# ------------------------------------------------------------------------------ specs


@_typed
def load(spec: SpecLike, overrides: Overrides = ()) -> JobSpec:
    """The validated :class:`~sftctl.spec.JobSpec` of ``spec`` with ``overrides`` applied.

    Raises:
        SpecError: a missing file or any problem with the spec or an override, naming the field
            and its line (exit code 2).
    """
    return _load(spec, overrides)[0]


def _load(spec: SpecLike, overrides: Overrides = (), origin: str | None = None,
          environ: Mapping[str, str] | None = None) -> tuple[JobSpec, str, Path | None]:
    """(spec, its label for messages, the file it came from or None). Every user setting is
    checked first (:func:`sftctl.settings.validate_all`): whatever uses a spec (plan, dry run,
    submit, compile) fails on a malformed variable or config file before anything is created.
    ``origin``: the file YAML text ``spec`` was read from elsewhere (a server's client), which
    messages name and relative paths are taken from. ``environ``: what ``${VAR}`` resolves
    from (default this environment; a server's submit: the owner's secrets, :mod:`sftctl.vault`)."""
    import json

    from sftctl import settings
    from sftctl.spec import JobSpec, load_spec

    settings.validate_all()

    sets = _override_strings(overrides)
    if isinstance(overrides, Mapping) and sets:
        try:
            return _load(spec, sets, origin, environ)
        except SpecError as e:  # the caller wrote overrides={"train.steps": ...}, not --set train.steps=...
            e.message = _api_override_names(e.message, list(overrides), sets)
            e.args = (e.message, *e.args[1:])
            raise
    if isinstance(spec, JobSpec):
        if not sets:
            workdir = str(Path(spec.workdir).resolve())
            return spec.model_copy(update={"workdir": workdir}), f"spec {spec.name}", None
        label = Path(spec.workdir).resolve() / "<JobSpec>"
        return load_spec(label, sets, environ, text=json.dumps(spec.model_dump(mode="json"))), f"spec {spec.name}", None
    if origin is not None:
        return load_spec(Path(origin), sets, environ, text=str(spec)), origin, Path(origin)  # spec: the text
    if isinstance(spec, str) and ("\n" in spec or not (spec.endswith((".yaml", ".yml")) or Path(spec).exists())):
        return load_spec(Path("<spec>"), sets, environ, text=spec), "<spec>", None
    path = Path(spec)
    return load_spec(path, sets, environ), str(path), path


def _api_override_names(message: str, keys: list, sets: list[str]) -> str:
    """``message`` (a :class:`SpecError`'s, in ``--set KEY=VALUE`` words) with each override named
    as the api's caller wrote it: ``overrides["train.steps"]``."""
    import json

    from sftctl.yaml12 import shown

    for key, assignment in sorted(zip(keys, sets), key=lambda ks: -len(shown(ks[1]))):  # longest first
        message = message.replace(f"--set {shown(assignment)}", f"overrides[{json.dumps(str(key))}]")
    return message


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
    avoid = _bad_machines()  # a Slurm estimate leaves out the nodes a verdict marked bad (issue 41.3)
    # importing model.entrypoint runs the user's module: in the server's process it would run with
    # its state (every user's token hash, the secrets key) and environment, so a server traces in a
    # sandboxed child (sftctl.sandboxed_trace), or, where the sandbox cannot start, not at all
    why_not = _no_sandbox() if s.model is not None and _serving() else None
    if why_not is not None:
        chosen = plan_(s, predict=lambda offering, nodes: None, avoid=avoid)  # as a model it cannot trace
        warnings.warn(SftctlWarning(
            f"model.entrypoint: the server traces a user's model only in a sandbox, and {why_not}: it ranks "
            "offerings by price only (sftctl plan SPEC without a server configured predicts step times on "
            "your machine)"), stacklevel=2)
    elif s.model is None:
        chosen = plan_(s, avoid=avoid)
    else:
        predictor = Predictor(s, progress=progress, strict=strict, isolated=_serving())
        chosen = plan_(s, predict=predictor, history=calibration_runs(), avoid=avoid)
        if predictor.error:
            warnings.warn(SftctlWarning(f"{predictor.error}; ranking by price only"), stacklevel=2)
    _warn_unset_references(s, chosen)
    return chosen


def _no_sandbox() -> str | None:
    """Why this server cannot trace a user's model in the local nodes' sandbox, else None
    (``SFTCTL_NODE_SANDBOX=off``: an admin's choice, the trace runs in a plain child process)."""
    from sftctl.providers import sandbox

    return sandbox.unavailable() if sandbox.requested() else None


def _bad_machines() -> dict[str, set[str]]:
    """provider -> the machines this state still marks bad ({} when it cannot be read: a plan
    never fails for want of the list; none when this machine has no state yet: ``plan`` creates
    none)."""
    from sftctl import settings
    from sftctl.paths import sftctl_home

    if not settings.get("SFTCTL_STATE_URL") and not (sftctl_home() / "state.db").exists():
        return {}
    try:
        marks = _store().bad_machines()
    except (SftctlError, OSError):
        return {}
    out: dict[str, set[str]] = {}
    for m in marks:
        out.setdefault(m.provider, set()).add(m.machine)
    return out


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
    shell = {} if _serving() else os.environ  # the server's environment is not its users' (nor its names)
    unset = unset_shell_references(script, known, shell if inherits else {})
    if not unset:
        return
    here = [n for n in unset if n in shell]  # set in this shell, but a cloud node does not get it
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
    the top; each candidate is :meth:`~sftctl.types.PlanChoice.to_dict`. A spec without a
    model (no row has a step time) adds ``no_step_time``: why, and the field to add
    (:func:`sftctl.plan_wording.no_step_time`)."""
    doc = chosen.to_dict() if chosen is not None else None
    if doc is not None:
        doc.pop("candidates")
        doc.pop("reason")
    why = no_step_time(spec, candidates)
    return {"job": spec.name, "objective": spec.resources.objective, "steps": spec.train.steps,
            "chosen": doc, "reason": reason, "candidates": [c.to_dict() for c in candidates],
            "catalog": catalog_info(), **({"no_step_time": why} if why else {})}


def no_step_time(spec: JobSpec, candidates: list) -> str | None:
    """Why no candidate (:class:`~sftctl.types.PlanChoice`) of a plan of ``spec`` has a step
    time, in one line naming the field to add, or None (:func:`sftctl.plan_wording.no_step_time`):
    ``plan``'s line under its table and ``plan --json``'s ``no_step_time``."""
    return _no_step_time(spec, candidates)


# ------------------------------------------------------------------------------ calibration: the run history


def calibration_runs() -> list[RunRecord]:
    """The run history predictions learn from (:class:`~sftctl.types.RunRecord` each, oldest
    first): the configured server's, else this machine's state; none when this machine has no
    state yet (``plan`` creates none)."""
    remote = _remote()
    if remote is not None:
        return [RunRecord.from_dict(r) for r in remote.request("GET", "/v1/calibrate")["runs"]]
    from sftctl import settings
    from sftctl.paths import sftctl_home

    if not settings.get("SFTCTL_STATE_URL") and not (sftctl_home() / "state.db").exists():
        return []
    return _store().runs()
