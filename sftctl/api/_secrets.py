"""A user's secrets through the api (see :mod:`sftctl.api` and :mod:`sftctl.vault`):
:func:`secret_set`, :func:`secret_list`, :func:`secret_remove`."""

from __future__ import annotations

from typing import Callable

from sftctl.api._base import _remote, _store


# ------------------------------------------------------------------------------ secrets


def secret_set(name: str, value: str | Callable[[], str], *, lab: bool = False, owner: str | None = None):
    """Store ``value`` as your secret ``name``: what a job's ``secrets: [NAME]`` and ``${NAME}`` in
    its ``env:`` get (:mod:`sftctl.vault`: encrypted in the state, never shown again). ``lab``:
    the lab's, which every user's jobs may name (a user's own of the same name wins). With a
    server configured it is stored there, as your user's (``--lab``: admins only); without one,
    in this machine's state as this OS user's (``owner``: the user a server stores it for).
    ``value`` may be a callable, called once the name is checked (the CLI's prompt). Returns its
    :class:`~sftctl.types.Secret` record (no value).

    Raises:
        SftctlError: a name that is not an environment variable's, an empty value, one with a
            NUL byte or over 64 KiB (exit 2); not an admin, for ``lab`` on a server (exit 2).
    """
    from sftctl import vault
    from sftctl.types import Secret

    vault.check_name(name)
    if callable(value):
        value = value()
    vault.check_value(name, value)
    remote = _remote()
    if remote is not None:
        return Secret.from_dict(remote.request("PUT", f"/v1/secrets/{name}", json={"value": value, "lab": bool(lab)})["secret"])
    from sftctl.state import os_user

    store = _store()
    try:
        return vault.set_secret(store, owner or os_user(), name, value, lab=lab)
    finally:
        store.close()


def secret_list(*, owner: str | None = None) -> list:
    """Your secrets and the lab's, by name: :class:`~sftctl.types.Secret` records (name, scope
    ``user``/``lab``, dates, ``shadowed``), never a value. Through the configured server, your
    user's there; else this OS user's in this machine's state (``owner``: a server's user)."""
    from sftctl import vault
    from sftctl.types import Secret

    remote = _remote()
    if remote is not None:
        return [Secret.from_dict(d) for d in remote.request("GET", "/v1/secrets")["secrets"]]
    from sftctl.state import os_user

    store = _store()
    try:
        return vault.list_secrets(store, owner or os_user())
    finally:
        store.close()


def secret_remove(name: str, *, lab: bool = False, owner: str | None = None) -> None:
    """Remove your secret ``name`` (``lab``: the lab's; admins only on a server). A job already
    submitted that names it gets it empty at its next launch, so its node refuses to run.

    Raises:
        NotFoundError: no such secret (exit 2).
    """
    from sftctl import vault

    vault.check_name(name)
    remote = _remote()
    if remote is not None:
        remote.request("DELETE", f"/v1/secrets/{name}", params={"lab": bool(lab)})
        return
    from sftctl.state import os_user

    store = _store()
    try:
        vault.remove_secret(store, owner or os_user(), name, lab=lab)
    finally:
        store.close()
