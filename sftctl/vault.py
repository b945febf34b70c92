"""Secrets that belong to a user: stored in the state, encrypted, resolved for that user's jobs.

``sftctl secret set NAME`` stores a value under its owner's name (a server's user, or this
machine's OS user without a server); ``--lab`` stores one an admin grants to every user's jobs
(owner :data:`LAB`). A job's ``secrets:`` names and the ``${VAR}`` references of its ``env:``
resolve from its owner's secrets, then the lab's: the user's own of a name wins.

- **At rest**: the ``secrets`` table (:meth:`sftctl.state.Store.put_secret`) holds
  ``v1:`` + base64(12-byte nonce + AES-256-GCM ciphertext), the owner and name bound in as
  associated data (a row copied under another owner or name does not decrypt). Never the value.
- **The key**: ``SFTCTL_SECRETS_KEY`` (32 bytes, URL-safe base64: what :func:`new_key` makes),
  else ``$SFTCTL_HOME/secrets.key``, created 0600 on first use (a key file readable by others
  is refused). Several servers on one Postgres state must share one key: set the same
  ``SFTCTL_SECRETS_KEY`` on each (a value stored under another key is an error naming the
  secret, never a value).
- **Where a job's values come from** (:func:`job_environ`): a job submitted through a server
  (``jobs.secrets_from = 'store'``) gets its owner's and the lab's secrets only, never the
  server's environment; a name its owner has not set reaches the node empty, so the node refuses
  to run (exit 78, ``secret_missing``). A job recorded on this machine without a server gets the
  same store first, then this environment (the job is the user's own, as before). A controller
  placed on Kubernetes reads them from its pod's Secret, which the server filled from the store.

Nothing here logs, prints or puts a value in an error message or an event.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from sftctl import settings
from sftctl.errors import NotFoundError, SftctlError
from sftctl.paths import create_private_file, sftctl_home
from sftctl.state import Store, os_user
from sftctl.types import JobRecord, Secret

#: the owner of lab secrets: ``*`` is no user's name (names are ``[A-Za-z0-9._@-]``)
LAB = "*"
#: the key file in ``$SFTCTL_HOME`` (mode 0600) when ``SFTCTL_SECRETS_KEY`` is unset
KEY_FILE = "secrets.key"
#: the most bytes a secret's value may hold (a token, a key, a small credentials file)
MAX_VALUE_BYTES = 64 * 1024
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_VERSION = "v1:"


def new_key() -> str:
    """A new key for ``SFTCTL_SECRETS_KEY``: 32 random bytes, URL-safe base64 (44 characters)."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


def check_name(name: str) -> str:
    """``name`` when it is an environment variable's name (``[A-Za-z_][A-Za-z0-9_]*``, at most 128).

    Raises:
        SftctlError: not such a name (exit 2); one with ``=`` is taken for ``NAME=VALUE``,
            which is refused without echoing the value.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        if isinstance(name, str) and "=" in name:
            raise SftctlError("secret set: the value is never taken from the command line (ps shows it to "
                              "every user of this machine)",
                              hint="sftctl secret set NAME, then type the value at the prompt or pipe it in")
        shown = name if isinstance(name, str) and len(name) <= 64 and name.isprintable() else "(not shown)"
        raise SftctlError(f"secret name {shown!r} is not an environment variable's name",
                          hint="use letters, digits and _ (not starting with a digit), as in HF_TOKEN")
    return name


def check_value(name: str, value: str) -> str:
    """``value`` when a node's environment can carry it: text, not empty, no NUL, at most
    :data:`MAX_VALUE_BYTES`.

    Raises:
        SftctlError: naming the secret and what is wrong, never the value (exit 2).
    """
    if not isinstance(value, str):
        raise SftctlError(f"secret {name}: the value must be text", hint="pipe it in: printf %s VALUE | sftctl secret set NAME")
    if not value:
        raise SftctlError(f"secret {name}: the value is empty; a node never runs with an empty secret",
                          hint=f"give the value on stdin or at the prompt, or sftctl secret rm {name}")
    if "\0" in value:
        raise SftctlError(f"secret {name}: the value holds a NUL byte, which no environment variable can carry",
                          hint="base64-encode binary values")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise SftctlError(f"secret {name}: the value is longer than {MAX_VALUE_BYTES:,} bytes",
                          hint="keep large credentials in the job's storage and name their path in env:")
    return value


# ------------------------------------------------------------------------------ the key


def _key() -> bytes:
    """The 32-byte key: ``SFTCTL_SECRETS_KEY``, else ``$SFTCTL_HOME/secrets.key`` (made now,
    0600, when missing: written whole to a temporary file and linked into place, so two
    processes starting at once agree on one key).

    Raises:
        SettingError: ``SFTCTL_SECRETS_KEY`` is not 32 bytes of URL-safe base64 (exit 2).
        SftctlError: the key file is readable by others, damaged or cannot be written (exit 2).
    """
    text = settings.get("SFTCTL_SECRETS_KEY")
    if text:
        key = _decode_key(text)
        if key is None:
            raise settings.SettingError("SFTCTL_SECRETS_KEY: not a key (32 bytes, URL-safe base64; the value is "
                                        "not shown)", hint="make one: python -m sftctl.vault --new-key")
        return key
    path = sftctl_home() / KEY_FILE
    if not path.exists():
        _create_key_file(path)
    try:
        mode = path.stat().st_mode & 0o777
        text = path.read_text().strip()
    except OSError as e:
        raise SftctlError(f"{path}: cannot read the secrets key: {e.strerror}",
                          hint="it belongs to the user the server runs as (mode 0600)") from None
    if mode & 0o077:
        raise SftctlError(f"{path}: the secrets key is readable by others (mode {mode:o})",
                          hint=f"chmod 600 {path}")
    key = _decode_key(text)
    if key is None:
        raise SftctlError(f"{path}: not a secrets key (32 bytes, URL-safe base64)",
                          hint="restore it from a backup; without it the stored secrets cannot be read "
                               "(set them again after replacing it)")
    return key


def _decode_key(text: str) -> bytes | None:
    try:
        key = base64.urlsafe_b64decode(text.strip().encode())
    except (ValueError, TypeError):
        return None
    return key if len(key) == 32 else None


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        create_private_file(path, new_key() + "\n")  # the first process's key wins
    except OSError as e:
        raise SftctlError(f"{path}: cannot create the secrets key: {e.strerror}",
                          hint="SFTCTL_HOME must be writable by the user sftctl runs as, or set SFTCTL_SECRETS_KEY") from None


def _aesgcm():
    """``cryptography``'s AES-GCM with this machine's key (:func:`_key`).

    Raises:
        SftctlError: ``cryptography`` is not installed (the ``server`` extra; exit 2).
    """
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise SftctlError("stored secrets need the cryptography package, which is not installed",
                          hint="pip install cryptography (a dependency of sftctl since secrets are stored: reinstall sftctl)") from None
    return AESGCM(_key())


def _aad(owner: str, name: str) -> bytes:
    return f"sftctl-secret\0{owner}\0{name}".encode()


def encrypt(owner: str, name: str, value: str) -> str:
    """``value`` as the ``secrets`` table keeps it: ``v1:`` + base64(nonce + AES-GCM ciphertext),
    bound to ``owner`` and ``name``."""
    nonce = os.urandom(12)
    sealed = _aesgcm().encrypt(nonce, value.encode(), _aad(owner, name))
    return _VERSION + base64.urlsafe_b64encode(nonce + sealed).decode()


def decrypt(owner: str, name: str, ciphertext: str) -> str:
    """The value :func:`encrypt` sealed.

    Raises:
        SftctlError: it does not decrypt with this key (another server's key, or a row altered
            or moved): names the secret, never a value (exit 2).
    """
    aesgcm = _aesgcm()
    from cryptography.exceptions import InvalidTag

    whose = "the lab's" if owner == LAB else f"{owner}'s"
    try:
        if not ciphertext.startswith(_VERSION):
            raise ValueError
        raw = base64.urlsafe_b64decode(ciphertext[len(_VERSION):].encode())
        return aesgcm.decrypt(raw[:12], raw[12:], _aad(owner, name)).decode()
    except (InvalidTag, ValueError, UnicodeDecodeError):
        raise SftctlError(f"secret {name} ({whose}) does not decrypt with this machine's secrets key",
                          hint="every server on one state needs the same SFTCTL_SECRETS_KEY; or set the secret "
                               "again (sftctl secret set " + name + ")") from None


# ------------------------------------------------------------------------------ the store


def set_secret(store: Store, owner: str, name: str, value: str, *, lab: bool = False) -> Secret:
    """Store ``value`` as ``owner``'s secret ``name`` (the lab's with ``lab``), encrypted;
    return its record (no value).

    Raises:
        SftctlError: a bad name or value (exit 2), or the key cannot be had (see :func:`_key`).
    """
    check_name(name)
    check_value(name, value)
    who = LAB if lab else owner
    store.put_secret(who, name, encrypt(who, name, value))
    row = next(r for r in store.secret_rows([who]) if r["name"] == name)
    return _record(row)


def list_secrets(store: Store, owner: str) -> list[Secret]:
    """``owner``'s secrets and the lab's, by name (the user's own first), never a value; a lab
    secret that ``owner`` has one of the same name of is ``shadowed``."""
    rows = store.secret_rows([owner, LAB])
    own = {r["name"] for r in rows if r["owner"] == owner}
    out = [_record(r, shadowed=r["owner"] == LAB and r["name"] in own) for r in rows]
    return sorted(out, key=lambda s: (s.name, s.scope != "user"))


def remove_secret(store: Store, owner: str, name: str, *, lab: bool = False) -> None:
    """Remove ``owner``'s secret ``name`` (the lab's with ``lab``).

    Raises:
        NotFoundError: there is no such secret (exit 2).
    """
    check_name(name)
    if not store.delete_secret(LAB if lab else owner, name):
        where = "the lab's secrets" if lab else f"your secrets ({owner})"
        raise NotFoundError(f"no secret {name} in {where}", hint="sftctl secret list shows them")


def _record(row: dict, shadowed: bool = False) -> Secret:
    lab = row["owner"] == LAB
    return Secret(name=row["name"], scope="lab" if lab else "user", owner=None if lab else row["owner"],
                  created_at=row["created_at"], updated_at=row["updated_at"], shadowed=shadowed)


class SecretEnviron(Mapping):
    """``owner``'s secrets and the lab's as a read-only environment (name -> value; the user's
    own wins), read from the store once, each value decrypted only when it is read. What a
    server-submitted job's ``${VAR}`` and ``secrets:`` resolve from. ``where`` and
    :meth:`hint_for` word a missing name for :mod:`sftctl.spec`'s messages."""

    def __init__(self, store: Store, owner: str):
        self.owner = owner
        self._rows: dict[str, dict] = {}
        for r in store.secret_rows([LAB, owner]):  # the owner's rows last: they win
            if r["owner"] == owner or r["name"] not in self._rows:
                self._rows[r["name"]] = r
        self.where = f"the secrets of {owner} on this server (and the lab's)"

    def hint_for(self, name: str) -> str:
        return f"sftctl secret set {name} (the value from stdin or a prompt), or drop it from the spec"

    def __getitem__(self, name: str) -> str:
        r = self._rows[name]
        return decrypt(r["owner"], name, r["ciphertext"])

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:  # names only: never a value in a traceback or a log
        return f"SecretEnviron({self.owner!r}: {sorted(self._rows)})"


class _Chain(Mapping):
    """The store's secrets, then this environment (a job recorded without a server)."""

    def __init__(self, first: Mapping, then: Mapping):
        self.first, self.then = first, then

    def __getitem__(self, name: str) -> str:
        return self.first[name] if name in self.first else self.then[name]

    def __contains__(self, name: object) -> bool:
        return name in self.first or name in self.then

    def __iter__(self) -> Iterator[str]:
        return iter(set(self.first) | set(self.then))

    def __len__(self) -> int:
        return len(set(self.first) | set(self.then))

    def __repr__(self) -> str:
        return "SecretEnviron(store, then the environment)"


def user_environ(own: SecretEnviron, *, only_store: bool) -> Mapping[str, str]:
    """``own`` (a user's and the lab's secrets) with ``only_store``; else ``own``, then this
    process's environment (just the environment when ``own`` is empty: nothing changes for a
    user who stores no secret)."""
    if only_store:
        return own
    return _Chain(own, os.environ) if own else os.environ


def job_environ(store: Store, job: JobRecord) -> Mapping[str, str]:
    """Where ``job``'s ``${VAR}`` and ``secrets:`` take their values from (see the module's
    docstring): its owner's and the lab's secrets (``secrets_from == 'store'``; in a controller
    pod placed on Kubernetes, that pod's environment, which the server filled from them), else
    those secrets, then this process's environment."""
    if job.secrets_from == "store":
        if settings.get("SFTCTL_CONTROLLER_K8S_JOB"):
            return os.environ
        return SecretEnviron(store, job.owner or "")
    return user_environ(SecretEnviron(store, job.owner or os_user()), only_store=False)


def main(argv: list[str]) -> int:
    """``python -m sftctl.vault --new-key``: print a new key for ``SFTCTL_SECRETS_KEY``."""
    if argv == ["--new-key"]:
        print(new_key())  # a tool's own main: the one place a key is printed, for the admin to keep
        return 0
    print("usage: python -m sftctl.vault --new-key   (a key for SFTCTL_SECRETS_KEY)")
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
