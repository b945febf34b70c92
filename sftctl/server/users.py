"""Who asks: a server's users, their tokens and which jobs are whose.

The interface the server speaks (:func:`add_user`, :func:`user_for_token`, :func:`set_owner`,
:func:`owner_of`). A token is 32 random bytes (URL-safe base64, :func:`secrets.token_urlsafe`),
shown once when it is made and kept only as its SHA-256 (a random 256-bit token needs no slow
hash: nothing can be guessed from it).

Interim storage, until the state's own ``users`` table and ``jobs.owner`` column land (one
schema for SQLite and Postgres): ``$SFTCTL_HOME/server/users.json`` and ``owners.json``,
owner-only, rewritten whole under a file lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Iterator

from sftctl.errors import SftctlError


@dataclasses.dataclass(frozen=True)
class User:
    """A server user: ``name`` and whether an ``admin`` (sees and stops every user's jobs)."""

    name: str
    admin: bool = False


def _dir() -> Path:
    from sftctl.paths import sftctl_home

    d = sftctl_home() / "server"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


@contextlib.contextmanager
def _doc(name: str, write: bool = False) -> Iterator[dict]:
    from filelock import FileLock

    path = _dir() / name
    with FileLock(str(path) + ".lock"):
        doc = json.loads(path.read_text()) if path.exists() else {}
        yield doc
        if write:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, path)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def add_user(name: str, admin: bool = False) -> str:
    """Create user ``name`` and return its token (shown once; only its hash is kept).

    Raises:
        SftctlError: the name is empty, has characters other than letters, digits, ``.-_@``,
            or is taken (exit 2).
    """
    if not name or not all(c.isalnum() or c in ".-_@" for c in name):
        raise SftctlError(f"user name {name!r}: use letters, digits and . - _ @", hint="sftctl server user add alice")
    token = secrets.token_urlsafe(32)
    with _doc("users.json", write=True) as users:
        if name in users:
            raise SftctlError(f"user {name!r} exists", hint="pick another name")
        users[name] = {"token_sha256": _hash(token), "admin": bool(admin)}
    return token


def user_for_token(token: str) -> User | None:
    """The user whose token this is, or None."""
    if not token:
        return None
    digest = _hash(token)
    with _doc("users.json") as users:
        for name, u in users.items():
            if secrets.compare_digest(u["token_sha256"], digest):
                return User(name, bool(u["admin"]))
    return None


def set_owner(job_id: str, user: User) -> None:
    """Record that ``user`` submitted ``job_id``."""
    with _doc("owners.json", write=True) as owners:
        owners[job_id] = user.name


def owners() -> dict[str, str]:
    """job id -> the name of the user who submitted it."""
    with _doc("owners.json") as doc:
        return dict(doc)
