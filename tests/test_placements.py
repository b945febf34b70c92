"""Controller placements (issue 39.3): one module per ``controller.place`` under
``sftctl/controller/placements/``, found by listing the package; the spec takes exactly their
names, and the state judges by pid exactly the placements of this machine (``state.HERE``), every
other one (a placement added as one file included) by the job's lease."""

from __future__ import annotations

import pytest

from conftest import REPO

from sftctl.controller import placements
from sftctl.controller.placements.base import ControllerPlacement, Placement
from sftctl.errors import SftctlError, SpecError
from sftctl.providers import provider_class
from sftctl.providers.base import PlacesController
from sftctl.spec import JobSpec
from sftctl.spec.model import PLACEMENTS
from sftctl.state import HERE, placed


def test_the_placements_are_the_modules_of_the_package():
    on_disk = sorted(p.stem for p in (REPO / "sftctl" / "controller" / "placements").glob("*.py")
                     if p.stem not in ("__init__", "base"))
    assert sorted(placements.names()) == on_disk == ["kubernetes", "local", "server", "slurm"]
    assert placements.names() == PLACEMENTS and PLACEMENTS[0] == "local"
    for name in on_disk:
        p = placements.placement(name)
        assert isinstance(p, Placement) and p.name == name


def test_the_state_judges_by_pid_exactly_this_machines_placements():
    elsewhere = {n for n in placements.names() if placements.placement(n).elsewhere}
    assert set(placements.names()) - elsewhere == set(HERE) == {"local", "server"}
    assert elsewhere == {"slurm", "kubernetes"}
    for name in elsewhere:  # each runs as its provider's job, which declares it can
        assert issubclass(provider_class(name), PlacesController)
        assert placed({"controller": {"place": name}}) == name
    assert placed({"controller": {"place": "server"}}) is None and placed({}) is None


def test_a_spec_names_a_placement_or_none():
    spec = JobSpec.model_validate({"name": "p", "run": "true"})
    assert placements.placement_of(spec).name == "local" and placements.placement_of(None).name == "local"
    assert placements.placement_of({"controller": {"place": "slurm"}}).what == "Slurm job"
    with pytest.raises(ValueError, match="controller.place"):
        JobSpec.model_validate({"name": "p", "run": "true", "controller": {"place": "moon"}})


def test_this_machines_placements_render_nothing_and_refuse_what_they_cannot_run():
    spec = JobSpec.model_validate({"name": "p", "run": "true", "controller": {"place": "server"}})
    assert placements.placement("server").render(spec, "j", None) == ControllerPlacement("server")
    with pytest.raises(SpecError, match="controller.place: server, but the config names no sftctl server"):
        placements.placement("server").check(spec, "job.yaml", server=False, provider=None)
    placements.placement("server").check(spec, "job.yaml", server=True, provider=None)
    local = placements.placement("local")
    assert not local.elsewhere and local.cancel(None, 0) == [] and local.orphans(None, None) is None
    with pytest.raises(NotImplementedError):
        local.place(None, None, spec, lambda **kw: ControllerPlacement(None))
    for name in ("slurm", "kubernetes"):  # neither supervises nodes of this machine
        with pytest.raises(SftctlError, match=f"controller.place: {name} cannot supervise local nodes"):
            placements.placement(name).check(spec, "job.yaml", server=False, provider="local")
