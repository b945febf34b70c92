"""Where sftctl keeps its files.

``$SFTCTL_HOME`` wins; otherwise the per-user data directory that platformdirs gives
(``~/.local/share/sftctl`` on Linux). The directory is created owner-only (0700). A relative
``$SFTCTL_HOME`` is taken from the directory of the process that reads it first, once: that
process writes the absolute path back to its environment, so the controller and the nodes it
starts (in other directories) use the same home.
"""

from __future__ import annotations

import os
from pathlib import Path

from sftctl import settings
from sftctl.errors import SftctlError


def create_private_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` once, mode 0600, whole: to a temporary file beside it, synced,
    then linked into place (atomic), so two processes starting at once agree on the first one's
    text; an existing ``path`` is kept as it is. For secrets (the secrets key, the metrics
    scrape token).

    Raises:
        OSError: the directory is not writable (the caller names what it was making).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


def sftctl_home() -> Path:
    """Return the sftctl home directory (absolute), creating it with mode 0700 if it is missing.
    A relative ``$SFTCTL_HOME`` is made absolute against the current directory and written back
    to ``os.environ`` (every child process inherits the absolute one).

    Raises:
        SftctlError: the directory cannot be created (exit 1).
    """
    env = settings.get("SFTCTL_HOME")
    if env:
        home = Path(env).expanduser()
        if not home.is_absolute():
            home = home.absolute()
            os.environ["SFTCTL_HOME"] = str(home)
    else:
        import platformdirs

        home = Path(platformdirs.user_data_dir("sftctl", appauthor=False))
    if not home.is_dir():
        try:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise SftctlError(f"cannot use {home} as the sftctl home: {e.strerror or e}",
                              hint="point SFTCTL_HOME at a directory you can write") from None
    return home


#: In a job's directory, the job's one live controller as it recorded itself (:func:`sftctl.queue.claim_job`):
#: ``{"job_id", "provider", "pid", "host", "start_ticks", "since"}``. ``down --orphans`` reads it when
#: the state is lost; a local node's guard (:func:`sftctl.procs.guard`) finds a new controller there.
CONTROLLER_OWNER = "controller.json"


def controller_lock(job_id: str) -> Path:
    """The job's controller lock (an flock that its one live controller holds,
    :func:`sftctl.queue.claim_job`); beside it, ``<job>.json``, that controller's record as in
    :data:`CONTROLLER_OWNER`. Both are in ``$SFTCTL_HOME/locks/``, outside the job's directory:
    removing ``jobs/JOB`` never takes the lock away from a live controller."""
    return sftctl_home() / "locks" / f"{job_id}.lock"


def job_dir(job_id: str) -> Path:
    """Directory holding one job's local files (node dirs, logs, metrics, controller log)."""
    return sftctl_home() / "jobs" / job_id
