"""Checkpoints a training script writes and reads: whole (:func:`save_checkpoint`,
:func:`load_latest_checkpoint`: atomic, pruned, uploaded to job storage) and the directory they
live in (:func:`checkpoint_dir`); a full disk is a :class:`CheckpointSpaceError`."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from sftctl import preflight as _preflight
from sftctl import settings
from sftctl.storage import open_storage
from sftctl.storage.checkpoints import (
    COMPLETE_FILE,
    DCP_METADATA,
    STATE_FILE,
    download_checkpoint,
    latest_complete,
    write_checkpoint,
)
from sftctl.storage.checkpoints import complete_local_checkpoints as _complete_checkpoints
from sftctl.storage.checkpoints import read_complete_marker as _read_complete


class CheckpointSpaceError(OSError):
    """A checkpoint could not be written for lack of room: no space left on the device
    (``ENOSPC``, ``EDQUOT``) or the process's file-size limit (``RLIMIT_FSIZE``, ``EFBIG``).
    torch reports either as ``[enforce fail at inline_container.cc] unexpected pos``; this names
    the cause, the step and the path. ``failure_code`` ``disk_full``: the controller does not
    restart into the same wall (sftctl/failure.py records it)."""

    failure_code = "disk_full"

    def __str__(self) -> str:  # the line itself, without OSError's "[Errno 28]"
        return self.strerror or super().__str__()


def _space_error(exc: BaseException, step: int, path: Path, final: Path) -> CheckpointSpaceError | None:
    """``exc`` (raised while writing checkpoint ``step`` into the temporary directory ``path``
    on its way to ``final``) as a :class:`CheckpointSpaceError` when lack of room caused it
    (the file-size limit: the biggest file written reached it; a full disk: under 1 MiB free),
    else None."""
    import resource

    code = getattr(exc, "errno", None)
    if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        code = None
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        biggest = max((f.stat().st_size for f in path.rglob("*") if f.is_file()), default=0) if path.is_dir() else 0
        if soft != resource.RLIM_INFINITY and biggest >= soft - 64 * 1024:
            code = errno.EFBIG
        else:
            try:
                free = shutil.disk_usage(path if path.exists() else path.parent).free
            except OSError:
                free = None
            if free is not None and free < 1 << 20:
                code = errno.ENOSPC
    if code is None:
        return None
    what = {errno.EFBIG: "the file-size limit (ulimit -f) was reached", errno.EDQUOT: "the disk quota is used up"}.get(
        code, "no space left on device")
    return CheckpointSpaceError(code, f"{what} writing checkpoint step {step} to {final}")

EXTRA_FILE = "extra.pt"  # a sharded checkpoint's small values (step, RNG state), written by rank 0
DEFAULT_CHECKPOINT_DIR = "checkpoints"
# Temporary dirs: "step-%08d.tmp-<pid>", optionally followed by a suffix (".old" is used while
# replacing an existing final dir).
_TMP_RE = re.compile(r"^step-\d{8,}\.tmp-(\d+)(?:\..*)?$")

# dtype spellings accepted by config(), mapped to the torch attribute name.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


def checkpoint_dir() -> Path:
    """Return the checkpoint directory: ``$SFTCTL_CHECKPOINT_DIR``, default ``./checkpoints``.

    The directory is not created here; ``save_checkpoint`` creates it.
    """
    return Path(settings.raw("SFTCTL_CHECKPOINT_DIR") or DEFAULT_CHECKPOINT_DIR)


DEFAULT_KEEP_CHECKPOINTS = 3  # the spec's train.keep_checkpoints default


def _checkpoint_args(step: int, keep: int | None) -> int:
    """Check a checkpoint call's ``step`` and ``keep``; returns ``keep``, from
    ``$SFTCTL_KEEP_CHECKPOINTS`` (else :data:`DEFAULT_KEEP_CHECKPOINTS`) when None.

    Raises:
        ValueError: ``step`` < 0, or ``keep`` below 1 or not an integer.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep is None:
        keep = settings.get("SFTCTL_KEEP_CHECKPOINTS")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    return keep


def save_checkpoint(state: dict[str, Any], step: int, *, keep: int | None = None) -> Path:
    """Atomically write ``state`` as the checkpoint for ``step`` and prune old checkpoints.

    Steps:

    1. ``torch.save(state)`` into ``<checkpoint_dir>/step-%08d.tmp-<pid>/state.pt``; fsync it.
    2. Write ``COMPLETE`` (``{"step": step}``) last; fsync it and the temporary directory.
    3. ``os.rename`` the temporary directory to ``step-%08d``; fsync ``checkpoint_dir``. If a
       checkpoint for this step exists already, it is first renamed aside and deleted only after
       the new one is in place.
    4. Delete complete checkpoints older than the newest ``keep``, and temporary directories left
       by processes that are no longer alive.

    Call it from one process per checkpoint directory (typically global rank 0), and not from two
    threads of one process at once.

    Args:
        state: anything ``torch.save`` accepts; typically model/optimizer state dicts and the step.
        step: the training step this state is after; non-negative.
        keep: how many complete checkpoints to keep, counting this one; at least 1. Default:
            ``$SFTCTL_KEEP_CHECKPOINTS`` (the controller sets it from the spec's
            ``train.keep_checkpoints``), else 3.

    5. With ``$SFTCTL_STORAGE_URL`` set: upload the new checkpoint directory to the job's storage
       (data first, ``MANIFEST.json`` last) and prune the storage to the newest ``keep`` too.

    Returns:
        The final checkpoint directory, ``<checkpoint_dir>/step-%08d``.

    Raises:
        ValueError: ``step`` is negative, ``keep`` (or ``$SFTCTL_KEEP_CHECKPOINTS``) is below 1
            or not an integer.
        ImportError: torch is not installed (or, with job storage, its SDK: boto3,
            google-cloud-storage).
        OSError: the checkpoint could not be written (the temporary directory is removed; earlier
            checkpoints are untouched); :class:`CheckpointSpaceError` when the disk is full or
            the file-size limit was reached (the message names the cause, step and path).
        sftctl.storage.StorageError: the upload to job storage failed. The local checkpoint is
            in place; the storage keeps its earlier complete checkpoints.
    """
    keep = _checkpoint_args(step, keep)
    import torch  # lazy: keep this module importable without torch

    root = checkpoint_dir()
    root.mkdir(parents=True, exist_ok=True)
    name = _step_name(step)
    final = root / name
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():  # left over by an earlier failed call of this very process
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        with open(tmp / STATE_FILE, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        with open(tmp / COMPLETE_FILE, "w", encoding="utf-8") as fh:
            json.dump({"step": int(step)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():
            # rename() cannot replace a non-empty directory. Move the old one aside under a
            # temporary name (ignored by latest_checkpoint, cleaned as stale if we die here).
            aside = root / f"{name}.tmp-{os.getpid()}.old"
            if aside.exists():
                shutil.rmtree(aside)
            os.rename(final, aside)
            os.rename(tmp, final)
            _fsync_dir(root)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
            _fsync_dir(root)
    except BaseException as exc:
        aside = root / f"{name}.tmp-{os.getpid()}.old"
        if aside.exists() and not final.exists():  # failed between the two renames: put it back
            os.rename(aside, final)
        full = _space_error(exc, step, tmp, final) if isinstance(exc, (OSError, RuntimeError)) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from exc
        raise
    _prune(root, keep)
    _preflight.at_checkpoint(step)  # a long job's periodic check of this rank's device (issue 41)
    storage = _job_storage()
    if storage is not None:
        write_checkpoint(storage, step, final, keep=keep)
    return final


def latest_checkpoint() -> Path | None:
    """Return the newest complete checkpoint directory in ``checkpoint_dir()``, or None.

    A directory counts only if it is named ``step-%08d`` and holds both ``state.pt`` and a readable
    ``COMPLETE`` marker; temporary (``*.tmp-*``) and half-written directories are never returned.

    With ``$SFTCTL_STORAGE_URL`` set, the newest complete checkpoint of the job's storage counts
    too: when it is newer than every local one, it is downloaded (sha256-checked) into
    ``checkpoint_dir()`` first, atomically like a save, and that directory is returned.

    Raises:
        sftctl.storage.StorageError: job storage is set and cannot be read.
    """
    root = checkpoint_dir()
    complete = _complete_checkpoints(root)
    local = complete[-1] if complete else None
    storage = _job_storage()
    if storage is not None:
        remote = latest_complete(storage)
        if remote is not None and (local is None or remote > local[0]):
            return _download_checkpoint(storage, remote, root)
    return local[1] if local else None


def _job_storage():
    """The job's storage from ``$SFTCTL_STORAGE_URL``, or None when it is unset."""
    url = settings.raw("SFTCTL_STORAGE_URL")
    if not url:
        return None

    cached = _storage_cache.get(url)
    if cached is None:
        cached = _storage_cache[url] = open_storage(url)
    return cached


_storage_cache: dict[str, Any] = {}


def _download_checkpoint(storage: Any, step: int, root: Path) -> Path:
    """Download the storage's checkpoint of ``step`` into ``root/step-%08d`` (tmp dir + rename)."""
    root.mkdir(parents=True, exist_ok=True)
    name = _step_name(step)
    final = root / name
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        download_checkpoint(storage, step, tmp)
        with open(tmp / COMPLETE_FILE, "w", encoding="utf-8") as fh:  # the manifest's step decides
            json.dump({"step": int(step)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if not (tmp / STATE_FILE).is_file() and not (tmp / DCP_METADATA).is_file():
            raise FileNotFoundError(f"checkpoint {step} in {storage.url} has no {STATE_FILE} (nor DCP {DCP_METADATA})")
        _fsync_dir(tmp)
        if final.exists():  # an incomplete local dir of the same step: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_latest_checkpoint(map_location: Any = "cpu") -> tuple[int, dict[str, Any]] | None:
    """Load the newest complete checkpoint (of the local directory or, with
    ``$SFTCTL_STORAGE_URL`` set, of the job's storage too: see :func:`latest_checkpoint`).

    Args:
        map_location: passed to ``torch.load`` (default: load every tensor onto the CPU).

    Returns:
        ``(step, state)`` where ``step`` comes from the checkpoint's ``COMPLETE`` marker and
        ``state`` is what was given to ``save_checkpoint``; None if there is no complete
        checkpoint.

    Raises:
        ImportError: torch is not installed.
        OSError, RuntimeError, pickle.UnpicklingError: the newest complete checkpoint cannot be
            read. It is loaded with ``torch.load(weights_only=True)``, so ``state`` may hold only
            tensors, containers, and plain Python values.
    """
    latest = latest_checkpoint()
    if latest is None:
        return None
    import torch  # lazy

    step = _read_complete(latest)
    assert step is not None  # latest_checkpoint checked it
    state = torch.load(latest / STATE_FILE, map_location=map_location, weights_only=True)
    return step, state


def _step_name(step: int) -> str:
    return "step-%08d" % step


def _prune(root: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep`` and tmp dirs of dead processes."""
    for _, path in _complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for entry in os.scandir(root):
        match = _TMP_RE.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (a zombie counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError as exc:  # pragma: no cover - e.g. pid out of range
        return exc.errno != errno.ESRCH
    return True


def _fsync_dir(path: Path) -> None:
    """fsync a directory so renames/creations in it are durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)
