"""``sftctl nodes``: the machines a health verdict marked bad, as the state remembers them
(issue 41.3; :mod:`sftctl.state.machines`). Every job's controller keeps them out until the mark
decays (``SFTCTL_BAD_MACHINE_DECAY_H``); a shared (Postgres) state shares them with every
controller and server on it, and a configured server (``SFTCTL_SERVER_URL``) answers for its
state: ``GET /v1/machines``, every mark for an admin, those of the user's own jobs otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sftctl.api._base import _remote, _store

if TYPE_CHECKING:
    from sftctl.state import BadMachine


def machines(provider: str | None = None, include_decayed: bool = False) -> list["BadMachine"]:
    """The machines still marked bad (of ``provider``, or every provider's), newest verdict
    first; ``include_decayed``: the forgotten ones too. Each :class:`~sftctl.state.BadMachine`
    names its provider, machine (Slurm node, Kubernetes host, instance id), zone, verdict kind,
    evidence, count, times and ``until`` (Unix seconds). Through a server: an admin gets every
    mark, a user those whose latest verdict was on one of their jobs.

    Raises:
        TypeError: ``provider`` is not a str or None.
    """
    if provider is not None and not isinstance(provider, str):
        raise TypeError(f"api.machines: provider must be a provider name (str) or None, got {type(provider).__name__}")
    remote = _remote()
    if remote is not None:
        from sftctl.state import BadMachine

        params: dict = {"include_decayed": bool(include_decayed)}
        if provider is not None:
            params["provider"] = provider
        return [BadMachine.from_dict(m) for m in remote.request("GET", "/v1/machines", params=params)["machines"]]
    return _store().bad_machines(provider, include_decayed=bool(include_decayed))
