"""The Store's users (tokens kept as their SHA-256 only), the admins' audit and the secrets table
(:mod:`sftctl.vault` encrypts; this never sees a value)."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from sftctl.state.connection import _Connection, _retrying
from sftctl.types import AuditEvent, User

_USER_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")


class _Users(_Connection):
    """The Store's users, audit and secrets (a part of :class:`sftctl.state.Store`)."""

    # ---------------------------------------------------------------- users

    @_retrying
    def create_user(self, name: str, admin: bool = False, expires_at: float | None = None,
                    actor: str | None = None) -> str:
        """Create user ``name`` and return their token: ``sft_`` + 43 URL-safe characters (32
        random bytes). Only the token's SHA-256 is stored; the token is shown this once.
        ``expires_at``: when the token stops working (Unix seconds; None: never). ``actor``: the
        admin who asked, recorded in :meth:`audit` with the user (in one transaction).

        Raises:
            SftctlError: the name is empty or not ``[A-Za-z0-9._@-]``, or the user exists (exit 2).
        """
        from sftctl.errors import ExitCode, SftctlError

        if not _USER_NAME.fullmatch(name or ""):
            raise SftctlError(f"user name {name!r} is not valid", hint="use letters, digits and . _ @ - (at most 64)",
                              exit_code=ExitCode.USAGE)
        token = "sft_" + secrets.token_urlsafe(32)
        try:
            with self.write() as db:
                db.execute("INSERT INTO users (name, admin, token_hash, created_at, expires_at) VALUES (?, ?, ?, ?, ?)",
                           (name, int(bool(admin)), _token_hash(token), time.time(), expires_at))
                if actor is not None:
                    self._audit(db, actor, "user.add", name, _expiry_detail(expires_at, admin))
        except self._d.integrity:
            raise SftctlError(f"user {name} already exists", hint="choose another name",
                              exit_code=ExitCode.USAGE) from None
        return token

    @_retrying
    def remove_user(self, name: str, actor: str) -> bool:
        """Remove user ``name`` (their token fails the next request; their jobs stay, owned by
        the name); recorded in :meth:`audit` as ``actor``'s. False when there is no such user."""
        with self.write() as db:
            cur = db.execute("DELETE FROM users WHERE name = ?", (name,))
            if cur.rowcount == 1:
                self._audit(db, actor, "user.remove", name, None)
        return cur.rowcount == 1

    @_retrying
    def rotate_token(self, name: str, expires_at: float | None, actor: str) -> str | None:
        """Give user ``name`` a new token, expiring at ``expires_at`` (Unix seconds; None: never),
        and return it (shown once); the old one fails the next request. Recorded in
        :meth:`audit` as ``actor``'s. None when there is no such user."""
        token = "sft_" + secrets.token_urlsafe(32)
        with self.write() as db:
            cur = db.execute("UPDATE users SET token_hash = ?, expires_at = ? WHERE name = ?",
                             (_token_hash(token), expires_at, name))
            if cur.rowcount == 1:
                self._audit(db, actor, "token.rotate", name, _expiry_detail(expires_at))
        return token if cur.rowcount == 1 else None

    @_retrying
    def get_user(self, name: str) -> User | None:
        """User ``name``, or None."""
        row = self._conn.execute("SELECT * FROM users WHERE name = ?", (name,)).fetchone()
        return _user(row) if row is not None else None

    @staticmethod
    def _audit(db: Any, actor: str, action: str, target: str | None, detail: str | None) -> None:
        db.execute("INSERT INTO audit (ts, actor, action, target, detail) VALUES (?, ?, ?, ?, ?)",
                   (time.time(), actor, action, target, detail))

    @_retrying
    def add_audit(self, actor: str, action: str, target: str | None = None, detail: str | None = None) -> None:
        """Record an admin's action (:class:`~sftctl.types.AuditEvent`): ``actor`` did ``action``
        to ``target`` (a user or a job), ``detail`` one line."""
        with self.write() as db:
            self._audit(db, actor, action, target, detail)

    @_retrying
    def audit(self, limit: int | None = None) -> list[AuditEvent]:
        """The recorded admin actions, oldest first (the newest ``limit`` of them when given)."""
        if limit is None:
            rows = self._conn.execute("SELECT * FROM audit ORDER BY id").fetchall()
        else:
            rows = self._conn.execute("SELECT * FROM audit ORDER BY id DESC LIMIT ?", (max(1, int(limit)),)).fetchall()[::-1]
        return [AuditEvent.from_dict(dict(r)) for r in rows]

    @_retrying
    def user_for_token(self, token: str) -> User | None:
        """The user whose token this is, or None (an unknown, malformed or empty token).
        The lookup is by the token's hash; the hashes are compared in constant time."""
        import hmac

        if not isinstance(token, str) or not token:
            return None
        digest = _token_hash(token)
        row = self._conn.execute("SELECT * FROM users WHERE token_hash = ?", (digest,)).fetchone()
        if row is None or not hmac.compare_digest(row["token_hash"], digest):
            return None
        return _user(row)

    @_retrying
    def list_users(self) -> list[User]:
        """Every user, by name."""
        return [_user(r) for r in self._conn.execute("SELECT * FROM users ORDER BY name").fetchall()]

    # ---------------------------------------------------------------- secrets (sftctl.vault)

    @_retrying
    def put_secret(self, owner: str, name: str, ciphertext: str) -> bool:
        """Store ``owner``'s secret ``name`` as ``ciphertext`` (:mod:`sftctl.vault` encrypts;
        this table never sees a value); True when it is new, False when it replaced one."""
        now = time.time()
        with self.write() as db:
            row = db.execute(
                "INSERT INTO secrets (owner, name, ciphertext, created_at, updated_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (owner, name) DO UPDATE SET ciphertext = excluded.ciphertext,"
                " updated_at = excluded.updated_at RETURNING created_at",
                (owner, name, ciphertext, now, now)).fetchone()
        return row["created_at"] == now

    @_retrying
    def secret_rows(self, owners: list[str]) -> list[dict]:
        """The secrets of ``owners`` as dicts (owner, name, ciphertext, created_at, updated_at:
        Unix seconds), by name then owner."""
        if not owners:
            return []
        rows = self._conn.execute(
            "SELECT owner, name, ciphertext, created_at, updated_at FROM secrets"
            f" WHERE owner IN ({', '.join('?' * len(owners))}) ORDER BY name, owner", tuple(owners)).fetchall()
        return [dict(r) for r in rows]

    @_retrying
    def delete_secret(self, owner: str, name: str) -> bool:
        """Remove ``owner``'s secret ``name``; False when there was none."""
        with self.write() as db:
            return db.execute("DELETE FROM secrets WHERE owner = ? AND name = ?", (owner, name)).rowcount == 1


def _token_hash(token: str) -> str:
    """SHA-256 of a token (hex). Tokens are 32 random bytes: a salt or a slow hash adds nothing."""
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()


def _user(row: Any) -> User:
    return User(name=row["name"], admin=bool(row["admin"]), created_at=row["created_at"],
                expires_at=row["expires_at"])


def _expiry_detail(expires_at: float | None, admin: bool = False) -> str:
    """``admin, expires 2026-03-01`` / ``expires never``: an audit row's detail."""
    when = "never" if expires_at is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires_at))
    return ("admin, " if admin else "") + f"expires {when}"
