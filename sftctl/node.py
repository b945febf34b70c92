"""The node daemon: ``python -m sftctl.node``, what a cloud node runs after its bootstrap.

A cloud node has no inbound port the controller could reach, so everything goes through the
job's storage; the files, their formats and ordering rules are :mod:`sftctl.protocol`'s. The daemon:

1. ships the node directory (its log, metrics, GPU samples and exit codes) to the node's objects
   in storage every second (:class:`sftctl.storage.stream.Shipper`);
2. polls for a launch request of a newer attempt (:meth:`NodeChannel.poll_launch`); on one, it
   stops the previous attempt's processes, fetches the job's workdir (``SFTCTL_WORKDIR_KEY``, once
   per content hash) and runs the attempt's script (``templates/node.sh.j2``) in a session of its
   own, and acknowledges it (:meth:`NodeChannel.ack`);
3. stops the running attempt when the controller asks (:meth:`NodeChannel.stop_requested`);
4. writes the attempt's exit file itself when the script's process ended without writing one
   (killed), so the controller always learns how an attempt ended while the node lives.

On SIGTERM it stops the attempt, ships what is left and exits 0.

Environment: ``SFTCTL_STORAGE_URL`` (the job's storage), ``SFTCTL_NODE_ID``, ``SFTCTL_NODE_DIR``
(created), optional ``SFTCTL_NODE_POLL_S`` (seconds between polls, default 1) and
``SFTCTL_SECRETS_REF`` (where the job's secret values are: they join the environment the launch
requests' secret names are taken from; :mod:`sftctl.storage.secrets`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sftctl import settings
from sftctl.protocol import NodeDir, write_exit_file
from sftctl.storage import StorageError, StorageNotFound, open_storage
from sftctl.storage.secrets import SecretStoreError
from sftctl.storage.secrets import fetch as fetch_secrets
from sftctl.storage.stream import NodeChannel, Shipper
from sftctl.storage.workdir import fetch_workdir
from sftctl.types import FailureCode, FailureReason


#: how long the daemon retries reading the job's secrets before attempts start without them (s)
SECRETS_WAIT_S = 120.0
#: how long the daemon looks for an attempt's workdir bundle in job storage before it fails the
#: attempt (exit 97, a ``workdir_missing`` failure record): the controller uploads it before the
#: first launch, so one still missing after this is not coming (s)
WORKDIR_WAIT_S = 120.0
#: the exit code of an attempt whose workdir never came (node.sh's when it cannot enter its workdir)
WORKDIR_MISSING_EXIT = 97


class NodeDaemon:
    """One node's loop. See the module docstring.

    Args:
        storage: the job's storage (:func:`sftctl.storage.open_storage`).
        node_id: this node's id, as the controller named it.
        node_dir: local directory for the node's scripts, logs and workdirs.
        poll_s: seconds between polls of the channel.
        secrets_ref: where the job's secret values are (``SFTCTL_SECRETS_REF``,
            :mod:`sftctl.storage.secrets`); read before the first attempt starts, retried for
            ``SECRETS_WAIT_S``, then attempts start without them (the node script then refuses to
            run, naming each missing secret).
        controller_grace_s: when the controller's heartbeat in job storage has not changed for
            this many seconds (by this node's monotonic clock: clock skew does not matter), the
            daemon stops the attempt, ships what is left and ends with ``controller_gone`` set,
            so :func:`main` powers the node off (``SFTCTL_POWEROFF``). 0: never.
    """

    def __init__(self, storage, node_id: str, node_dir: str | os.PathLike, poll_s: float = 1.0,
                 secrets_ref: str | None = None, controller_grace_s: float = 0.0):
        self.storage, self.node_id, self.poll_s = storage, node_id, poll_s
        self.secrets_ref = secrets_ref
        self.secrets: dict[str, str] | None = None if secrets_ref else {}
        self._secrets_deadline = time.monotonic() + SECRETS_WAIT_S
        self._said: str | None = None  # the storage error last said (said once until it changes)
        self.controller_grace_s = controller_grace_s
        self._beat: bytes | None = None
        self._beat_changed = self._beat_checked = time.monotonic()
        self.controller_gone = False
        self.node_dir = Path(node_dir)
        self.files = NodeDir(self.node_dir)
        self.files.metrics.mkdir(parents=True, exist_ok=True)
        self.channel = NodeChannel(storage)
        self.shipper = Shipper(storage, node_id, self.node_dir)
        self.attempt = 0
        self._workdir_missing: tuple[int, float] | None = None  # (attempt, monotonic s of its first miss)
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def run(self) -> int:
        """Poll and run attempts until :meth:`stop` (SIGTERM). Returns the process exit code."""
        self.shipper.start()
        try:
            while not self.stopping.is_set():
                self.tick()
                self.stopping.wait(self.poll_s)
        finally:
            self._end_attempt()
            self.shipper.stop()
        return 0

    def tick(self) -> None:
        """One poll: start a newer attempt, honour a stop request, record an exit nobody wrote;
        end when the controller is gone."""
        if self.controller_grace_s and self._controller_is_gone():
            return
        if self.secrets is None and not self._read_secrets():
            return
        try:
            request = self.channel.poll_launch(self.node_id, self.attempt, {**os.environ, **self.secrets})
            if request is not None:
                self._start(*request)
            elif self.proc is not None and self.channel.stop_requested(self.node_id, self.attempt):
                self._end_attempt()
            self._said = None
        except StorageError as e:  # the storage is unreachable for now: try again next tick
            if e.message != self._said:  # once, not once per poll (a missing bundle: 120 s of them)
                print(f"[sftctl node] {e.message} (retrying)", file=sys.stderr, flush=True)
                self._said = e.message
        self._record_exit()

    def _controller_is_gone(self) -> bool:
        """Read the heartbeat (at most every grace / 20 s); once it has not changed for the
        grace period, stop the attempt and the loop (and say why in the node's log)."""
        now = time.monotonic()
        if now - self._beat_checked < max(1.0, self.controller_grace_s / 20):
            return False
        self._beat_checked = now
        try:
            beat = self.channel.heartbeat()
        except StorageError:  # storage unreachable: not evidence that the controller is gone
            return False
        if beat != self._beat:
            self._beat, self._beat_changed = beat, now
            return False
        if now - self._beat_changed < self.controller_grace_s:
            return False
        line = (f"[sftctl node] the controller's heartbeat has not changed for {now - self._beat_changed:.0f} s "
                f"(SFTCTL_CLOUD_CONTROLLER_GRACE_S={self.controller_grace_s:g}): stopping attempt {self.attempt} "
                "and powering this node off so it stops billing")
        print(line, file=sys.stderr, flush=True)
        with open(self.files.log, "a") as log:
            log.write(line + "\n")
        self.controller_gone = True
        self._end_attempt()
        self.stopping.set()
        return True

    def _read_secrets(self) -> bool:
        """Read the job's secret values once; False while a failed read may still be retried."""
        try:
            self.secrets = fetch_secrets(self.secrets_ref)
        except SecretStoreError as e:
            if time.monotonic() < self._secrets_deadline:
                print(f"[sftctl node] {e} (retrying)", file=sys.stderr, flush=True)
                return False
            print(f"[sftctl node] {e}: attempts start without the job's secrets", file=sys.stderr, flush=True)
            self.secrets = {}
        return True

    def stop(self) -> None:
        self.stopping.set()

    def _start(self, attempt: int, script: str, env: dict[str, str]) -> None:
        """Stop the running attempt, fetch the new one's workdir, start its script and ack it.

        The attempt is taken (``self.attempt``) only once its workdir is here, so a storage error
        (raised: :meth:`tick` says it and polls again) is retried; a bundle still missing after
        :data:`WORKDIR_WAIT_S` fails the attempt (:meth:`_fail_without_workdir`)."""
        self._end_attempt()
        env = dict(env)
        key = settings.raw("SFTCTL_WORKDIR_KEY", env)
        if key:
            dest = self.node_dir / "workdir" / Path(key).name.split(".")[0]
            if not dest.is_dir():
                root = settings.raw("SFTCTL_WORKDIR_STORAGE", env)
                source = open_storage(root) if root else self.storage
                try:
                    fetch_workdir(source, key, dest)
                except StorageNotFound:
                    if self._workdir_missing is None or self._workdir_missing[0] != attempt:
                        self._workdir_missing = (attempt, time.monotonic())
                    if time.monotonic() - self._workdir_missing[1] < WORKDIR_WAIT_S:
                        raise
                    self._fail_without_workdir(attempt, key, source.url)
                    return
            env.update(settings.node_env(workdir=str(dest)))
        self.attempt = attempt
        path = self.files.script(attempt)
        path.write_text(script)
        full_env = {**os.environ, **env, **settings.node_env(node_id=self.node_id, node_dir=self.node_dir,
                                                             metrics_dir=self.files.metrics)}
        full_env.setdefault("SFTCTL_PYTHON", sys.executable)
        full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env.get("PATH", "")])
        with open(self.files.log, "ab") as log:
            self.proc = subprocess.Popen(["bash", str(path)], cwd=self.node_dir, env=full_env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        # the controller gives a node launch_timeout_s to take an attempt; this says it did
        self.channel.ack(self.node_id, attempt, self.proc.pid)

    def _fail_without_workdir(self, attempt: int, key: str, url: str) -> None:
        """End ``attempt`` without running it: its workdir bundle ``key`` never appeared in the
        storage at ``url``. Writes the reason to the node log and as the attempt's failure record
        (``workdir_missing``), then exit code :data:`WORKDIR_MISSING_EXIT` (protocol rules 1, 2a)."""
        self.attempt = attempt
        message = (f"node {self.node_id}: the workdir bundle {key} is not in the job's storage {url} "
                   f"after {WORKDIR_WAIT_S:g} s (SFTCTL_WORKDIR_STORAGE, else SFTCTL_STORAGE_URL: does this node "
                   "see the storage the controller wrote?)")
        print(f"[sftctl node] {message}", file=sys.stderr, flush=True)
        with open(self.files.log, "a") as log:
            log.write(f"[sftctl node] {message}\n")
        record = FailureReason(FailureCode.WORKDIR_MISSING, message, {"key": key, "storage": url})
        failure = self.files.failure(attempt)
        tmp = failure.with_name(failure.name + ".tmp")
        tmp.write_text(json.dumps(record.to_dict()) + "\n")
        tmp.rename(failure)
        write_exit_file(self.files.exit(attempt), WORKDIR_MISSING_EXIT)

    def _end_attempt(self) -> None:
        """Stop the running attempt's whole process group (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._record_exit()

    def _record_exit(self) -> None:
        """When the attempt's shell ended without an exit file (it was killed), write one
        (the protocol's rule 3)."""
        if self.proc is None or self.proc.poll() is None:
            return
        exit_file = self.files.exit(self.attempt)
        if not exit_file.exists():
            code = self.proc.returncode
            write_exit_file(exit_file, 128 - code if code < 0 else code)  # -9 -> 137, as a shell reports it
        self.proc = None


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m sftctl.node`` with the environment of the module docstring."""
    os.umask(0o077)  # the job's files on this node (logs, checkpoints): owner-only

    missing = [k for k in ("SFTCTL_STORAGE_URL", "SFTCTL_NODE_ID", "SFTCTL_NODE_DIR") if not settings.raw(k)]
    if missing:
        print(f"sftctl node: {', '.join(missing)} not set (the bootstrap sets them)", file=sys.stderr)
        return 2
    daemon = NodeDaemon(open_storage(settings.raw("SFTCTL_STORAGE_URL")), settings.raw("SFTCTL_NODE_ID"),
                        settings.get("SFTCTL_NODE_DIR"), settings.get("SFTCTL_NODE_POLL_S"),
                        secrets_ref=settings.raw("SFTCTL_SECRETS_REF"),
                        controller_grace_s=settings.get("SFTCTL_CONTROLLER_GRACE_S"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    code = daemon.run()
    if daemon.controller_gone:  # everything is shipped: power off (EC2 terminates the instance)
        cmd = settings.get("SFTCTL_POWEROFF")
        print(f"[sftctl node] running {cmd!r}", file=sys.stderr, flush=True)
        subprocess.run(cmd, shell=True, check=False)
        return 3
    return code


if __name__ == "__main__":
    sys.exit(main())
