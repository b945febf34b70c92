"""The controller <-> node protocol: every file name, key and message format, in one place.

This docstring is the protocol's specification. The controller (through a provider) and a node
(its script, its daemon, the training helper and the GPU agent) talk only through files: a
*node directory* on the node's disk, and, when the job has storage, *job storage* objects under
``nodes/<node id>/``. Nothing else names these files: providers, :mod:`sftctl.node`,
:mod:`sftctl.storage.stream` and the templates (which get this module as the Jinja global
``protocol``) all take the names from here.

Attempts
    An attempt is a positive integer, one per (re)launch of the job, the same on every node of
    that launch; it only grows. Every per-attempt file carries it in its name, so a file of an
    older attempt never speaks for a newer one.

Exit code format
    Decimal integer, one line: ``"0\\n"``, ``"137\\n"`` (:func:`format_exit_code`). A shell's
    convention: 128 + N for a process killed by signal N. A file that does not parse as one
    integer is no exit code (:func:`parse_exit_code` returns None) and the attempt counts as
    still running.

The node directory (``$SFTCTL_NODE_DIR``)
    Where it lives is the provider's business: ``$SFTCTL_HOME/jobs/<job>/nodes/<node id>/`` for
    the local provider, ``<job root>/nodes/<node id>/`` on the cluster's shared filesystem for
    Slurm, ``/var/lib/sftctl/<node id>/`` (the daemon's) on a cloud node. :class:`NodeDir`
    names its files::

        file                    written by                  when / format
        node-<a>.sh             provider or node daemon     before the attempt starts; templates/node.sh.j2
        env-<a>                 Slurm provider              before sbatch; ``export K=V`` lines, mode 0600
        host-<a>                Slurm step (step.sh.j2)     first thing on the node; the Slurm node's name
        restarts-<a>            Slurm step (step.sh.j2)     first thing; ``$SLURM_RESTART_COUNT`` (> 0: requeued)
        node.log                node.sh's shell             appended by every attempt: stdout + stderr
        agent.log               the GPU agent               appended
        health.jsonl            sftctl.agent                JSON lines, one GPU sample each
        metrics/rank-<N>.jsonl  sftctl.train.report         JSON lines, one record per step, per global rank N
        error-<a>.json          torchelastic                its error file (sftctl.failure reads it)
        failure-<a>.json        sftctl.failure (node.sh),   after a non-zero exit, before exit-<a>, when the node
                                else the daemon             knows why: a FailureReason as JSON {"code": "oom" |
                                                            "exception" | "signal" | "workdir_missing" (the daemon's:
                                                            no workdir bundle, exit 97), "message": one line, "data": {...}}
        setup-done              node.sh                     the spec's setup ran on this node (once)
        exit-<a>                node.sh, else the daemon    LAST; see the ordering rules

Job storage (``nodes/<node id>/`` under the job's storage prefix; :class:`sftctl.storage.stream.NodeChannel`),
and at the prefix's root ``controller.heartbeat``: the controller (``CloudProvider.keepalive``)
rewrites it (unix time) at most every grace / 5 s while it watches; a node's daemon that sees it
unchanged for ``SFTCTL_CONTROLLER_GRACE_S`` (by its own clock) stops its attempt and powers off::

        key                     written by                  when / format
        launch-<a>.json         controller (send_launch)    to start attempt a on the node; JSON
                                                            {"attempt": a, "script": str, "env": {name: value},
                                                             "secret_env": [names], "created_at": unix s}
        ack-<a>                 node daemon (ack)           after it started attempt a's script; "<pid>\\n"
        stop-<a>                controller (request_stop)   to stop attempt a (the node stays); empty
        failure-<a>.json        shipper (write_failure)     the node directory's failure-<a>.json, copied, before exit-<a>
        exit-<a>                shipper (write_exit)        the node directory's exit-<a>, copied; exit code format
        node.log/<seq>, agent.log/<seq>, health.jsonl/<seq>, metrics/rank-<N>.jsonl/<seq>
                                shipper                     the node directory's files as append-only streams of
                                                            numbered segments (sftctl.storage.stream)

Ordering rules (what a reader may rely on)
    1. ``exit-<a>`` is the last file an attempt writes in its node directory, and it appears
       whole: node.sh writes ``exit-<a>.tmp`` and renames it (so does the daemon,
       :func:`write_exit_file`). A node that vanished mid-run has none, and the provider calls it
       LOST rather than finished.
    2. The exit code follows the logs: the shipper lists the exit files *before* it reads the
       streams, drains and flushes every stream, and only then writes ``exit-<a>`` to storage. A
       controller that sees an exit code in storage has every log and metrics byte the attempt
       wrote before it.
    2a. Why it failed comes with the code, never from the log: node.sh writes ``failure-<a>.json``
       (renamed into place whole) before ``exit-<a>``, and the shipper copies it to storage before
       the exit object, so a reader that sees a non-zero exit code finds the record if the node
       wrote one (:func:`parse_failure`); none means nothing is known beyond the code.
    3. When the attempt's script was killed and wrote no ``exit-<a>``, the node daemon writes one
       (128 + signal) while it lives, so the controller learns how every attempt ended.
    4. A launch supersedes: the daemon takes the newest ``launch-<a>.json`` with ``a`` above the
       attempt it runs (older ones it never saw are skipped), stops the running attempt's process
       group first (SIGTERM, SIGKILL after 10 s), starts the new script, then writes ``ack-<a>``.
       No ``ack-<a>`` within the provider's ``launch_timeout_s`` makes the node LOST.
    5. ``stop-<a>`` stops attempt ``a`` only: a late stop of an old attempt never stops a newer one.
    6. Slurm requeues an allocation itself (preemption, NODE_FAIL): the batch script then removes
       every node's ``exit-<a>`` before the steps run again, since those codes are the killed run's.
    7. Secrets never reach storage: ``launch-<a>.json`` holds the *names* of secret variables
       (``secret_env``); the node fills their values from its own environment. A launch whose
       script or plain env contains a secret's value is refused.

Importing this module is cheap (no cloud SDK, no torch); stream reading is imported when used.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Union

from sftctl.types import FailureReason


__all__ = [
    "CONTROLLER_HEARTBEAT",
    "AGENT_LOG",
    "HEALTH_LOG",
    "METRICS_DIR",
    "METRICS_GLOB",
    "NODE_LOG",
    "SETUP_DONE",
    "NodeDir",
    "ack_name",
    "env_name",
    "error_name",
    "failure_name",
    "stderr_tail_name",
    "exit_name",
    "format_exit_code",
    "host_name",
    "is_secret_name",
    "launch_name",
    "metrics_name",
    "node_prefix",
    "parse_exit_code",
    "parse_exit_name",
    "parse_failure",
    "parse_launch_name",
    "read_exit_file",
    "restarts_name",
    "script_name",
    "stop_name",
    "write_exit_file",
]

# --------------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------------

#: Every attempt's stdout and stderr, appended (node directory; a stream in storage).
NODE_LOG = "node.log"
#: The GPU agent's own output.
AGENT_LOG = "agent.log"
#: GPU samples, JSON lines (:mod:`sftctl.agent`).
HEALTH_LOG = "health.jsonl"
#: The training ranks' metrics directory (``$SFTCTL_METRICS_DIR``).
METRICS_DIR = "metrics"
#: The metrics files in :data:`METRICS_DIR`.
METRICS_GLOB = "rank-*.jsonl"
#: Marks that the spec's setup ran on this node.
SETUP_DONE = "setup-done"
#: The file (Slurm: in the job directory) / object (job storage: at its root) the controller
#: rewrites (a timestamp) while it watches the job; a Slurm allocation ends itself, a cloud node
#: powers off, when it stops changing for the grace period.
CONTROLLER_HEARTBEAT = "controller.heartbeat"
#: The node directory files shipped as streams (``metrics/*.jsonl`` come by glob).
STREAMED_FILES = (NODE_LOG, AGENT_LOG, HEALTH_LOG)

# An ``attempt`` below is an int, or a shell reference such as ``"$attempt"`` when a template
# names the file of an attempt it knows only at run time.
Attempt = Union[int, str]

_EXIT_RE = re.compile(r"^exit-(\d+)$")
_LAUNCH_RE = re.compile(r"^launch-(\d+)\.json$")


def script_name(attempt: Attempt) -> str:
    """``node-<attempt>.sh``: the attempt's script in the node directory."""
    return f"node-{attempt}.sh"


def env_name(attempt: Attempt) -> str:
    """``env-<attempt>``: the attempt's environment (Slurm), ``export`` lines, mode 0600."""
    return f"env-{attempt}"


def exit_name(attempt: Attempt) -> str:
    """``exit-<attempt>``: the attempt's exit code, in the node directory and in storage."""
    return f"exit-{attempt}"


def host_name(attempt: Attempt) -> str:
    """``host-<attempt>``: the Slurm node the attempt ran on."""
    return f"host-{attempt}"


def restarts_name(attempt: Attempt) -> str:
    """``restarts-<attempt>``: ``$SLURM_RESTART_COUNT`` when the attempt's step started."""
    return f"restarts-{attempt}"


def error_name(attempt: Attempt) -> str:
    """``error-<attempt>.json``: torchelastic's error file of the attempt."""
    return f"error-{attempt}.json"


def failure_name(attempt: Attempt) -> str:
    """``failure-<attempt>.json``: why the attempt failed, as the node found out (rule 2a)."""
    return f"failure-{attempt}.json"


def stderr_tail_name(attempt: Attempt) -> str:
    """``stderr-tail-<attempt>``: the last 20 lines the attempt's run (or its failed setup) wrote to stderr (written
    whole, by rename, when its stderr closes; the node's own, read only by ``sftctl.failure``
    for the reason of a plain script's failure)."""
    return f"stderr-tail-{attempt}"


def complete_json_lines(key: str, data: bytes, offsets: dict[str, int]) -> list[dict]:
    """The JSON objects of the complete lines of ``data`` (bytes of file ``key`` read from
    ``offsets[key]``), advancing ``offsets[key]`` past them; a line still being written (no
    newline yet) waits for the next read, and lines that are not JSON are skipped."""
    complete = data[: data.rfind(b"\n") + 1]
    offsets[key] = offsets.get(key, 0) + len(complete)
    out = []
    for line in complete.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def parse_failure(raw: bytes | str | None):
    """A failure record's :class:`sftctl.types.FailureReason`; None for no record, or one that
    does not parse (a truncated or foreign file is not worth failing the controller)."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
        return FailureReason.from_dict(doc) if isinstance(doc, dict) else None
    except (ValueError, TypeError):
        return None


def metrics_name(rank: int | str) -> str:
    """``rank-<global rank>.jsonl``: one training rank's metrics file in :data:`METRICS_DIR`."""
    return f"rank-{rank}.jsonl"


def launch_name(attempt: Attempt) -> str:
    """``launch-<attempt>.json``: the launch request in storage."""
    return f"launch-{attempt}.json"


def ack_name(attempt: Attempt) -> str:
    """``ack-<attempt>``: the daemon took the attempt."""
    return f"ack-{attempt}"


def stop_name(attempt: Attempt) -> str:
    """``stop-<attempt>``: the controller asks to stop the attempt."""
    return f"stop-{attempt}"


def parse_exit_name(name: str) -> int | None:
    """The attempt of an exit file's name (``"exit-3"`` -> 3); None for any other name
    (``exit-3.tmp`` being written, ``node.log``)."""
    m = _EXIT_RE.match(name)
    return int(m.group(1)) if m else None


def parse_launch_name(name: str) -> int | None:
    """The attempt of a launch request's name (``"launch-3.json"`` -> 3), else None."""
    m = _LAUNCH_RE.match(name)
    return int(m.group(1)) if m else None


def format_exit_code(code: int) -> str:
    """An exit file's content: ``"<code>\\n"``."""
    return f"{int(code)}\n"


def parse_exit_code(raw: bytes | str | None) -> int | None:
    """An exit file's code, or None when ``raw`` is None, empty or not one integer."""
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        return int(text.strip())
    except ValueError:
        return None


def write_exit_file(path: str | os.PathLike, code: int) -> None:
    """Write an exit file on this machine as node.sh does: ``<path>.tmp``, then rename (rule 1)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(format_exit_code(code))
    tmp.rename(path)


def read_exit_file(path: str | os.PathLike) -> int | None:
    """The exit code in an exit file on this machine; None when it is missing or unparsable."""
    try:
        return parse_exit_code(Path(path).read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return None


class NodeDir:
    """The files of one node directory (see the module docstring).

    ``root`` is a local path (a :class:`~pathlib.Path` comes back as ``Path``s) or a path on
    another machine, e.g. a Slurm cluster's filesystem (a ``str`` comes back as ``/``-joined
    ``str``s). ``exits`` only works on a local directory.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = root

    def path(self, name: str):
        """``root/name`` in ``root``'s type."""
        if isinstance(self.root, str):
            return f"{self.root.rstrip('/')}/{name}"
        return Path(self.root) / name

    @property
    def log(self):
        return self.path(NODE_LOG)

    @property
    def agent_log(self):
        return self.path(AGENT_LOG)

    @property
    def health(self):
        return self.path(HEALTH_LOG)

    @property
    def metrics(self):
        return self.path(METRICS_DIR)

    @property
    def metrics_glob(self):
        return self.path(f"{METRICS_DIR}/{METRICS_GLOB}")

    def script(self, attempt: Attempt):
        return self.path(script_name(attempt))

    def env(self, attempt: Attempt):
        return self.path(env_name(attempt))

    def exit(self, attempt: Attempt):
        return self.path(exit_name(attempt))

    def host(self, attempt: Attempt):
        return self.path(host_name(attempt))

    def failure(self, attempt: Attempt):
        return self.path(failure_name(attempt))

    def restarts(self, attempt: Attempt):
        return self.path(restarts_name(attempt))

    def exits(self, skip: set[int] | frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """``[(attempt, exit code)]`` of the complete exit files in this local directory, by
        attempt, leaving out the attempts in ``skip``; a file being written is left out too."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            attempt = parse_exit_name(name)
            if attempt is None or attempt in skip:
                continue
            try:
                code = parse_exit_code((Path(self.root) / name).read_bytes())
            except OSError:
                continue
            if code is not None:
                out.append((attempt, code))
        return sorted(out)


# --------------------------------------------------------------------------------------------
# job storage
# --------------------------------------------------------------------------------------------

_SECRET_NAME_RE = re.compile(r"SECRET|TOKEN|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (``AWS_SECRET_ACCESS_KEY``,
    ``HF_TOKEN``, ``WANDB_API_KEY``, ``DB_PASSWORD`` ...)."""
    return bool(_SECRET_NAME_RE.search(name))


def node_prefix(node_id: str) -> str:
    """The key prefix of a node's objects: ``nodes/<node id>/``.

    Raises:
        ValueError: ``node_id`` is empty, ``.``/``..`` or holds a ``/``.
    """
    if not node_id or "/" in node_id or node_id in (".", ".."):
        raise ValueError(f"bad node id {node_id!r}")
    return f"nodes/{node_id}/"


