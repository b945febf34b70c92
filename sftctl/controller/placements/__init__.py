"""Where a job's controller runs (``controller.place``): one module per placement in this
package, each declaring ``PLACEMENT`` (a :class:`~sftctl.controller.placements.base.Placement`),
found by listing the package: local.py (a process here, the default), server.py (a child of the
sftctl server), slurm.py (a Slurm job), kubernetes.py (a Kubernetes Job). Whether a job's
controller is alive is :func:`controller_alive`, the one verdict (its placement's
:meth:`~sftctl.controller.placements.base.Placement.alive`). A new placement is a
new module here; the spec's ``controller.place`` takes its name (:data:`sftctl.spec.model.PLACEMENTS`
lists this directory, importing nothing; this package imports what it lists)."""

from __future__ import annotations

import functools
import importlib

from sftctl.controller.placements.base import (
    SECRET, ControllerPlacement, Document, Placement, Render, controller_argv, forget_queued,
)
from sftctl.spec.model import PLACEMENTS
from sftctl.state import JobRecord, Liveness, Store

__all__ = ["SECRET", "ControllerPlacement", "Document", "Liveness", "Placement", "Render", "controller_alive",
           "controller_argv", "forget_queued", "names", "placement", "placement_of"]


@functools.cache
def _placements() -> dict[str, Placement]:
    """Each placement's declaration, by name: the modules :data:`sftctl.spec.model.PLACEMENTS`
    found in this package's directory (the one listing), each imported for its ``PLACEMENT``."""
    out: dict[str, Placement] = {}
    for name in PLACEMENTS:
        declared = importlib.import_module(f"{__name__}.{name}").PLACEMENT
        if declared.name != name:
            raise ValueError(f"{__name__}.{name} declares PLACEMENT {declared.name!r}, not {name!r}")
        out[name] = declared
    return out


def names() -> tuple[str, ...]:
    """Every placement's name (``local`` first, then by name)."""
    return PLACEMENTS


def placement(name: str | None) -> Placement:
    """The placement called ``name`` (None: ``local``). Raises KeyError for an unknown one
    (the spec refuses it first)."""
    return _placements()[name or "local"]


def placement_of(spec: dict | object | None) -> Placement:
    """The placement of a job's spec (a ``JobSpec``, or the dict the state keeps; None: ``local``)."""
    if spec is None:
        return placement(None)
    if isinstance(spec, dict):
        return placement((spec.get("controller") or {}).get("place"))
    return placement(spec.controller.place)  # type: ignore[attr-defined]


def controller_alive(job: JobRecord, store: Store | None = None, *, scheduler: bool = True) -> Liveness:
    """Whether ``job``'s controller is alive: the one verdict (``alive`` True, False, or None
    while a just-submitted job's client starts it; ``why`` one line), from its placement's
    :meth:`~sftctl.controller.placements.base.Placement.alive`. ``store``: the state to ask
    (default: the configured one, opened and closed here); ``scheduler`` false: never ask a
    scheduler (``squeue``, the Kubernetes API) about a queued controller, the state alone.

    Raises:
        ProviderError, CredentialsError: a placed controller's scheduler could not be asked (exit 4).
    """
    asked = store or Store()
    try:
        return placement_of(job.spec).alive(asked, job, scheduler=scheduler)
    finally:
        if store is None:
            asked.close()
