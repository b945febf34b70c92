"""``controller.place: server``: the job's controller is a child of the configured sftctl
server's Supervisor (``sftctl server``), on the server's machine."""

from __future__ import annotations

from sftctl.controller.placements.base import Placement
from sftctl.errors import SpecError


class ServerPlacement(Placement):
    """A child of the server's Supervisor: the config must name a server."""

    name = "server"

    def check(self, spec, label: str, *, server: bool, provider: str | None) -> None:
        """Refused unless a server runs the job's commands (this process is it, or the config names one)."""
        if not server:
            raise SpecError(f"{label}: controller.place: server, but the config names no sftctl server",
                            hint="add server: {url, token} to the config (sftctl server start makes one), "
                                 "or set controller.place: local")


PLACEMENT = ServerPlacement()
