"""Who asks: a server's users and their tokens, in the state the server uses (SQLite or
Postgres: :class:`sftctl.state.Store`'s ``users`` table; a token is kept only as its SHA-256,
with its expiry), which jobs are whose (``jobs.owner``), and the audit of admin actions.

Two layers: the functions on this machine's state (:func:`add_user`, :func:`remove_user`,
:func:`rotate_token`, :func:`list_users`, :func:`audit_events`, :func:`down_job`; the server's routes call them),
and :class:`Users`, what ``sftctl server user ...`` and ``sftctl server audit`` act on: the server
the config names (its admin routes, with this user's token), or this machine's state when none
is configured (or ``--local``: the server's own machine).
"""

from __future__ import annotations

import builtins
import time

from sftctl.errors import ExitCode, NotFoundError, SftctlError
from sftctl.types import AuditEvent, User

#: what ``--expires`` takes besides a number of days
NEVER = "never"


def expiry(expires: str | int | None, now: float | None = None) -> float | None:
    """When a token made now with ``--expires expires`` stops working (Unix seconds), or None
    (``never``). ``expires``: days (a positive integer, as text or int), ``never``, or None
    (``SFTCTL_SERVER_TOKEN_DAYS``, read here).

    Raises:
        SftctlError: anything else (exit 2).
    """
    from sftctl import settings

    now = time.time() if now is None else now
    if expires is None:
        return now + settings.get("SFTCTL_SERVER_TOKEN_DAYS") * 86400.0
    text = str(expires).strip().lower()
    if text == NEVER:
        return None
    if not text.isdigit() or int(text) < 1 or int(text) > 36500:
        raise SftctlError(f"--expires {str(expires)[:40]!r}: expected a number of days (1 to 36500) or 'never'",
                          hint="e.g. --expires 30, or --expires never for a token that never expires",
                          exit_code=ExitCode.USAGE)
    return now + int(text) * 86400.0


def _store():
    from sftctl.state import Store

    return Store()


def add_user(name: str, admin: bool = False, expires: str | int | None = None, actor: str | None = None) -> str:
    """Create user ``name`` in this machine's state and return their token (shown once; only its
    hash is kept). ``expires``: see :func:`expiry`. ``actor``: who asked (recorded in the audit).

    Raises:
        SftctlError: the name is not ``[A-Za-z0-9._@-]``, the user exists, or a bad ``expires`` (exit 2).
    """
    when = expiry(expires)
    store = _store()
    try:
        return store.create_user(name, admin, expires_at=when, actor=actor)
    finally:
        store.close()


def remove_user(name: str, actor: str) -> None:
    """Remove user ``name`` from this machine's state: their token fails the next request.

    Raises:
        NotFoundError: no such user (exit 2).
    """
    store = _store()
    try:
        if not store.remove_user(name, actor):
            raise NotFoundError(f"no user {name!r}", hint="sftctl server user list shows them")
    finally:
        store.close()


def rotate_token(name: str, expires: str | int | None = None, actor: str = "") -> str:
    """Give user ``name`` a new token (returned, shown once); the old one fails the next request.

    Raises:
        NotFoundError: no such user (exit 2). SftctlError: a bad ``expires`` (exit 2).
    """
    when = expiry(expires)
    store = _store()
    try:
        token = store.rotate_token(name, when, actor)
    finally:
        store.close()
    if token is None:
        raise NotFoundError(f"no user {name!r}", hint="sftctl server user list shows them")
    return token


def list_users() -> list[User]:
    """Every user of this machine's state, by name."""
    store = _store()
    try:
        return store.list_users()
    finally:
        store.close()


def get_user(name: str) -> User | None:
    """User ``name`` of this machine's state, or None."""
    store = _store()
    try:
        return store.get_user(name)
    finally:
        store.close()


def record(actor: str, action: str, target: str | None = None, detail: str | None = None) -> None:
    """Record an admin's action in this machine's state's audit."""
    store = _store()
    try:
        store.add_audit(actor, action, target, detail)
    finally:
        store.close()


def audit_events(limit: int | None = None) -> list[AuditEvent]:
    """The recorded admin actions, oldest first (the newest ``limit`` when given)."""
    store = _store()
    try:
        return store.audit(limit)
    finally:
        store.close()


class Users:
    """What ``sftctl server user ...`` / ``server audit`` act on: the configured server (its admin
    routes; ``where`` is its URL) or, with none configured or ``local``, this machine's state
    (``where`` names it; actions are recorded as ``<os user> (local)``'s).

    Raises (on construction):
        SettingError, SftctlError: a malformed config, or a server URL without a token (exit 2).
    """

    def __init__(self, local: bool = False):
        from sftctl import remote, settings

        if not local and settings.get("SFTCTL_SERVER_URL") and not settings.get("SFTCTL_SERVER_TOKEN"):
            raise SftctlError(f"the config names the server {settings.get('SFTCTL_SERVER_URL')}, but no token to "
                              "manage its users with", hint="set server.token (or SFTCTL_SERVER_TOKEN) to an admin's "
                              "token; on the server's own machine, --local acts on its state (the first admin)")
        self.client = None if local else remote.configured()
        if self.client is not None:
            self.where = f"the server at {self.client.url}"
        else:
            from sftctl.state import Store, os_user

            store = Store()
            try:
                self.where = f"this machine's state ({store.where})"
            finally:
                store.close()
            self.actor = f"{os_user()} (local)"

    def add(self, name: str, admin: bool = False, expires: str | None = None) -> tuple[User, str]:
        """Create user ``name``; (the user, their token)."""
        if self.client is not None:
            doc = self.client.request("POST", "/v1/users", json={"name": name, "admin": admin, "expires": expires})
            return User.from_dict(doc["user"]), doc["token"]
        token = add_user(name, admin, expires, actor=self.actor)
        return get_user(name), token

    def remove(self, name: str) -> None:
        """Remove user ``name`` (their token fails the next request)."""
        if self.client is not None:
            self.client.request("DELETE", self._path(name))
        else:
            remove_user(name, self.actor)

    def rotate(self, name: str, expires: str | None = None) -> tuple[User, str]:
        """A new token for ``name``; (the user, the token). The old token fails the next request."""
        if self.client is not None:
            doc = self.client.request("POST", self._path(name, "/token"), json={"expires": expires})
            return User.from_dict(doc["user"]), doc["token"]
        token = rotate_token(name, expires, self.actor)
        return get_user(name), token

    def list(self) -> list[User]:
        """Every user, by name (never a token)."""
        if self.client is not None:
            return [User.from_dict(u) for u in self.client.request("GET", "/v1/users")["users"]]
        return list_users()

    def audit(self, limit: int | None = None) -> builtins.list[AuditEvent]:
        """The admin actions recorded, oldest first."""
        if self.client is not None:
            doc = self.client.request("GET", "/v1/audit", params={} if limit is None else {"limit": limit})
            return [AuditEvent.from_dict(e) for e in doc["audit"]]
        return audit_events(limit)

    @staticmethod
    def _path(name: str, tail: str = "") -> str:
        from urllib.parse import quote

        return f"/v1/users/{quote(name, safe='')}{tail}"



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


def owned_job(user: User, job: str, hint: str = "sftctl status lists your jobs") -> str:
    """The full id of ``job`` (an id or a unique prefix) among the jobs ``user`` may act on: their
    own, or any job for an admin. The one rule the JSON API and the dashboard share: another
    user's job is "no job of yours", never a hint that it exists.

    Raises:
        NotFoundError: no such job of the user's, or a prefix of several (exit 2; HTTP 404).
    """
    from sftctl import api

    if user.admin:
        return api.job(job).id
    ids = job_ids(user)
    if job in ids:
        return job
    matches = sorted(i for i in ids if job.strip() and i.startswith(job))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise NotFoundError(f"{job!r} matches {len(matches)} of your jobs", hint=f"give more of the id: {', '.join(matches[:5])}")
    raise NotFoundError(f"no job {job!r} of yours ({user.name}) on this server", hint=hint)


def down_job(user: User, job: str, purge: bool = False, via: str = "") -> list:
    """``sftctl down`` of ``job`` (a full id :func:`owned_job` gave ``user``) asked by ``user``, the
    one place the JSON API and the dashboard take a job down: an admin's down of another user's
    job is recorded in the audit (``down``, the job, ``owner NAME[, purge]`` and ``via``) and names
    the admin in the job's events and end reason (``taken down by admin NAME``), so its owner
    sees who took it down. Returns :func:`sftctl.api.down`'s results.

    Raises:
        what :func:`sftctl.api.down` raises.
    """
    from sftctl import api

    owner = api.job(job).owner if user.admin else user.name
    admin = user.name if owner != user.name else None  # an admin took down another user's job
    results = api.down(job, purge=purge, admin=admin)
    if admin:
        record(admin, "down", job, f"owner {owner}" + (", purge" if purge else "") + via)
    return results
