"""The controller <-> cloud node channel over job storage: what :class:`~sftctl.providers.cloud.CloudProvider`
calls as ``self.channel``, and what a node's daemon polls.

Objects (under the storage's prefix)::

    nodes/<node id>/launch-<attempt>.json   {"attempt", "script", "env", "secret_env", "created_at"}
    nodes/<node id>/exit-<attempt>          the attempt's exit code ("1\\n"), shipped after its logs
    nodes/<node id>/node.log/<seq>          streams shipped by sftctl.storage.stream.Shipper
    nodes/<node id>/health.jsonl/<seq>
    nodes/<node id>/metrics/rank-<N>.jsonl/<seq>

Secrets never go to storage: ``send_launch`` stores the *names* of secret variables
(``secret_env``) and not their values; the node fills them from its own environment (an instance
role, a Kubernetes Secret, the provider's secret manager). A variable is secret when its name is
in ``secret_keys`` or looks like one (``*SECRET*``, ``*TOKEN*``, ``*PASSWORD*``, ``*API_KEY*``,
``*ACCESS_KEY*``, ``*PRIVATE_KEY*``, ``*CREDENTIAL*``); a script that contains a secret's value
is refused.
"""

from __future__ import annotations

import json
import os
import re
import time

from sftctl.storage import Storage, StorageError, StorageNotFound
from sftctl.storage.stream import StreamReader, node_prefix, read_json_lines

__all__ = ["LaunchRequest", "StorageChannel", "is_secret_name"]

_SECRET_NAME_RE = re.compile(r"SECRET|TOKEN|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE)
_LAUNCH_RE = re.compile(r"^launch-(\d+)\.json$")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (``AWS_SECRET_ACCESS_KEY``,
    ``HF_TOKEN``, ``WANDB_API_KEY``, ``DB_PASSWORD`` ...)."""
    return bool(_SECRET_NAME_RE.search(name))


#: What ``poll_launch`` returns: ``(attempt, script, env)``.
LaunchRequest = tuple[int, str, dict[str, str]]


class StorageChannel:
    """Launch requests, exit codes, logs, metrics and health samples through job storage.

    One object serves a whole job (every node); it keeps a :class:`StreamReader` per stream so
    each poll lists only new segments.

    Args:
        storage: the job's storage.
        secret_keys: names of environment variables whose values must never be stored (in
            addition to the names :func:`is_secret_name` recognizes).
    """

    def __init__(self, storage: Storage, secret_keys: set[str] | frozenset[str] = frozenset()):
        self.storage = storage
        self.secret_keys = frozenset(secret_keys)
        self._readers: dict[str, StreamReader] = {}

    # ------------------------------------------------------------ controller side
    def send_launch(self, node_id: str, attempt: int, script: str, env: dict[str, str],
                    secret_keys: set[str] | frozenset[str] | None = None) -> str:
        """Write ``nodes/<node id>/launch-<attempt>.json`` holding the script and the env, with
        secret variables by name only. Returns the key written.

        Raises:
            StorageError: the script contains the value of a secret variable (the message names
                the variable, never the value), or the write failed.
        """
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        secret = self.secret_keys | frozenset(secret_keys or ())
        plain, names = {}, []
        for name, value in sorted(env.items()):
            if name in secret or is_secret_name(name):
                names.append(name)
            else:
                plain[name] = str(value)
        for name in names:  # a secret's value may not hide in the script or another variable
            value = str(env[name])
            if len(value) >= 8 and (value in script or any(value in v for v in plain.values())):
                raise StorageError(
                    f"launch of node {node_id}: the script or env contains the value of secret {name}; not storing it",
                    hint=f"refer to ${name} instead of its value", url=self.storage.url)
        doc = {"attempt": int(attempt), "script": script, "env": plain, "secret_env": names,
               "created_at": time.time()}
        key = f"{node_prefix(node_id)}launch-{attempt}.json"
        self.storage.put_bytes(key, json.dumps(doc, sort_keys=True).encode())
        return key

    def exit_code(self, node_id: str, attempt: int) -> int | None:
        """The exit code of ``attempt`` on the node, or None while it has none."""
        try:
            raw = self.storage.get_bytes(f"{node_prefix(node_id)}exit-{attempt}")
        except StorageNotFound:
            return None
        try:
            return int(raw.decode().strip())
        except ValueError:
            return None

    def _reader(self, key: str) -> StreamReader:
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = StreamReader(self.storage, key)
        return reader

    def read_log(self, node_id: str, offset: int) -> tuple[bytes, int]:
        """``node.log`` bytes from ``offset``: ``(data, next offset)`` (offsets are the file's)."""
        return self._reader(f"{node_prefix(node_id)}node.log").read(offset)

    def read_agent_log(self, node_id: str, offset: int) -> tuple[bytes, int]:
        """``agent.log`` bytes from ``offset``, like :meth:`read_log`."""
        return self._reader(f"{node_prefix(node_id)}agent.log").read(offset)

    def read_metrics(self, node_id: str, offsets: dict[str, int]) -> list[dict]:
        """New complete JSON lines of every ``metrics/rank-*.jsonl`` stream of the node, rank
        files in name order; ``offsets`` (stream key -> offset) is advanced past them."""
        base = f"{node_prefix(node_id)}metrics/"
        out: list[dict] = []
        for name in self.storage.children(base):
            if name.endswith(".jsonl"):
                key = base + name
                out += read_json_lines(self._reader(key), offsets, key)
        return out

    def read_health(self, node_id: str, offsets: dict[str, int]) -> list[dict]:
        """New complete JSON lines of the node's ``health.jsonl`` stream (see :meth:`read_metrics`)."""
        key = f"{node_prefix(node_id)}health.jsonl"
        return read_json_lines(self._reader(key), offsets, key)

    def delete_node(self, node_id: str) -> int:
        """Delete everything of a node (after the job ends). Returns the objects deleted."""
        self._readers = {k: r for k, r in self._readers.items() if not k.startswith(node_prefix(node_id))}
        return self.storage.delete_prefix(node_prefix(node_id))

    # ------------------------------------------------------------ node side
    def poll_launch(self, node_id: str, after_attempt: int = 0,
                    environ: dict[str, str] | None = None) -> LaunchRequest | None:
        """The newest launch request of the node with an attempt above ``after_attempt``:
        ``(attempt, script, env)``, or None when there is none yet.

        ``env`` is the stored env plus each secret variable the request names, taken from
        ``environ`` (default ``os.environ``) where it is set there.
        """
        base = node_prefix(node_id)
        newest = None
        for key, _ in self.storage.list(f"{base}launch-"):
            m = _LAUNCH_RE.match(key[len(base):])
            if m and int(m.group(1)) > after_attempt and (newest is None or int(m.group(1)) > newest):
                newest = int(m.group(1))
        if newest is None:
            return None
        try:
            doc = json.loads(self.storage.get_bytes(f"{base}launch-{newest}.json"))
        except StorageNotFound:
            return None
        environ = os.environ if environ is None else environ
        env = dict(doc.get("env", {}))
        for name in doc.get("secret_env", []):
            if name in environ:
                env[name] = environ[name]
        return int(doc["attempt"]), str(doc["script"]), env
