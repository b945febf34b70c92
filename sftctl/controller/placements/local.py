"""``controller.place: local`` (the default, a spec without ``controller.place``): the job's
controller is a process of this machine (``python -m sftctl.queue JOB``, spawned detached by
``api.spawn_controller``, or the attached ``run`` itself), judged by its pid and the job's lock
file (and its lease on a shared state)."""

from __future__ import annotations

from sftctl.controller.placements.base import Placement


class LocalPlacement(Placement):
    """A process of this machine: nothing to check, submit, cancel or forget."""

    name = "local"


PLACEMENT = LocalPlacement()
