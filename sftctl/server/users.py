"""Who asks: a server's users and their tokens, in the state the server uses (SQLite or
Postgres: :class:`sftctl.state.Store`'s ``users`` table; a token is kept only as its SHA-256),
and which jobs are whose (``jobs.owner``)."""

from __future__ import annotations

from sftctl.types import User


def add_user(name: str, admin: bool = False) -> str:
    """Create user ``name`` and return their token (shown once; only its hash is kept).

    Raises:
        SftctlError: the name is not ``[A-Za-z0-9._@-]``, or the user exists (exit 2).
    """
    from sftctl.state import Store

    store = Store()
    try:
        return store.create_user(name, admin)
    finally:
        store.close()


def user_for_token(token: str) -> User | None:
    """The user whose token this is, or None."""
    from sftctl.state import Store

    store = Store()
    try:
        return store.user_for_token(token)
    finally:
        store.close()


def job_ids(user: User) -> set[str]:
    """The ids of ``user``'s jobs."""
    from sftctl.state import Store

    store = Store()
    try:
        return {j.id for j in store.list_jobs(owner=user.name)}
    finally:
        store.close()
