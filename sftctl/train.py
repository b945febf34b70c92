"""Helpers for training scripts run by sftctl: metrics, atomic checkpoints, job configuration.

A training script imports this module on every rank::

    from sftctl import train as sft

    cfg = sft.config(steps=300)
    resumed = sft.load_latest_checkpoint()
    ...
    sft.report(step, loss, step_time_s=dt_s, tokens_per_s=tokens / dt_s)
    if step % cfg.checkpoint_interval == 0 and rank == 0:
        sft.save_checkpoint({"model": model.state_dict()}, step)

Sharded training: ``model = sft.prepare(model)`` wraps the model as the plan says
(``SFTCTL_PARALLELISM``: DDP, or FSDP2 ``fully_shard`` per block + root;
``SFTCTL_ACTIVATION_CHECKPOINTING``); build the optimizer after it. Under FSDP every rank saves
and loads together: ``sft.save_sharded_checkpoint(model, optimizer, step)`` /
``sft.load_sharded_checkpoint(model, optimizer)`` (torch.distributed.checkpoint; a checkpoint
directory then holds ``__<rank>_0.distcp`` shards, DCP's ``.metadata``, ``extra.pt`` and
``COMPLETE`` last; it resumes on any world size).

The module is deliberately light: it imports only the standard library at import time. torch is
imported lazily by the functions that serialize tensors (``save_checkpoint`` and
``load_latest_checkpoint``), so the script also runs, and this module can be imported, without it.

Environment variables read (all optional):

``SFTCTL_METRICS_DIR``
    Directory for per-rank metrics files ``rank-<global rank>.jsonl``. Unset: ``report`` is a no-op.
``SFTCTL_CHECKPOINT_DIR``
    Directory holding ``step-%08d`` checkpoint directories. Default ``./checkpoints``.
``SFTCTL_KEEP_CHECKPOINTS``
    How many complete checkpoints ``save_checkpoint`` keeps when not given ``keep`` (the spec's
    ``train.keep_checkpoints``); default 3.
``SFTCTL_STORAGE_URL``
    The job's durable storage (``s3://bucket/prefix``, ``gs://bucket/prefix``, a directory; see
    :mod:`sftctl.storage`). When set, ``save_checkpoint`` also uploads every checkpoint there
    (``checkpoints/step-%08d/`` with its ``MANIFEST.json`` written last, see
    :mod:`sftctl.storage.checkpoints`) and prunes it to the same ``keep``; ``latest_checkpoint``
    and ``load_latest_checkpoint`` resume from the newest complete checkpoint of the storage or
    of the local directory, downloading it into the local directory when only the storage has
    it (a replacement node starts with an empty disk). The local directory is then a cache.
    Unset: everything stays on the local disk.
``RANK`` / ``SFTCTL_NODE_RANK``
    Global rank of this process (``RANK`` is set by torchrun); the first one set wins, else 0.
``SFTCTL_TRAIN_STEPS``, ``SFTCTL_BATCH_SIZE``, ``SFTCTL_CHECKPOINT_INTERVAL``, ``SFTCTL_DTYPE``,
``SFTCTL_JOB_ID``, ``SFTCTL_NODE_RANK``, ``SFTCTL_NUM_NODES``
    Read by ``config()``.

Checkpoint layout on disk (inside ``checkpoint_dir()``)::

    step-00000050/            a complete checkpoint: always has both files below
        state.pt              torch.save() of the state dict
        COMPLETE              {"step": 50}, written and fsynced after state.pt
    step-00000100.tmp-4242/   being written by pid 4242 (or abandoned if that pid is dead)

A checkpoint directory only ever appears under its final ``step-%08d`` name through an atomic
``os.rename`` of a fully written and fsynced temporary directory, so a crash at any point leaves
either the previous checkpoints or the new complete one, never a torn one that is picked up.
A checkpoint downloaded from job storage goes through the same temporary directory and rename.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sftctl import failure as _failure
from sftctl import settings
from sftctl.protocol import metrics_name
from sftctl.storage import open_storage

# the local checkpoint layout (state.pt / .metadata, COMPLETE last) is defined in storage, which
# the controller counts checkpoints through without importing this module
from sftctl.storage.checkpoints import COMPLETE_FILE, DCP_METADATA, STATE_FILE, complete_checkpoint_steps
from sftctl.storage.checkpoints import complete_local_checkpoints as _complete_checkpoints
from sftctl.storage.checkpoints import read_complete_marker as _read_complete
from sftctl.storage.checkpoints import (begin_checkpoint, download_checkpoint, latest_complete, upload_files,
                                       write_checkpoint, write_manifest)

# an uncaught exception in the training script lands in torchelastic's error file, so the job's
# failure reason names it (see sftctl/failure.py); no-op outside an sftctl node
_failure.install_excepthook()

__all__ = [
    "TrainConfig",
    "checkpoint_dir",
    "config",
    "global_rank",
    "latest_checkpoint",
    "load_latest_checkpoint",
    "report",
    "save_checkpoint",
    "prepare",
    "strategy",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "CheckpointSpaceError",
]


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


# --------------------------------------------------------------------------------------------
# ranks and metrics
# --------------------------------------------------------------------------------------------


def global_rank() -> int:
    """Return this process's global rank: ``$RANK``, else ``$SFTCTL_NODE_RANK``, else 0.

    Raises:
        ValueError: the variable that is used is set but is not a non-negative integer.
    """
    raw = os.environ.get("RANK", "").strip()
    if raw:
        return _parse_int("RANK", raw, minimum=0)
    return settings.get("SFTCTL_NODE_RANK")


def report(
    step: int,
    loss: float,
    *,
    step_time_s: float | None = None,
    tokens_per_s: float | None = None,
    compute_time_s: float | None = None,
) -> None:
    """Append one metrics record for ``step`` to ``$SFTCTL_METRICS_DIR/rank-<global rank>.jsonl``.

    The record is one JSON object on one line::

        {"ts": <unix time, s>, "rank": <global rank>, "step": ..., "loss": ...,
         "step_time_s": ..., "tokens_per_s": ...}

    The line is written with a single ``write`` on a file opened in append mode, so a reader
    tailing the file sees whole lines (the last one may be missing if the process is killed), and
    each call is visible to readers when it returns. The directory is created if missing.

    Does nothing when ``SFTCTL_METRICS_DIR`` is unset or empty, so a script also runs outside
    sftctl.

    Args:
        step: the training step just finished.
        loss: this rank's loss at that step. NaN/inf are written as ``null`` (JSON has no NaN).
        step_time_s: wall time of the step in seconds, if measured.
        tokens_per_s: this rank's throughput in tokens per second, if measured.
        compute_time_s: seconds of the step's work that waits on no other rank (e.g. the
            forward pass), if measured: under synchronous data parallelism every rank's whole
            step takes as long as the slowest's, so only this shows which rank is the straggler.

    Raises:
        ValueError: ``RANK``/``SFTCTL_NODE_RANK`` is malformed.
        OSError: the metrics directory or file cannot be created or written.
    """
    metrics_dir = settings.get("SFTCTL_METRICS_DIR")
    if not metrics_dir:
        return
    rank = global_rank()
    record = {
        "ts": time.time(),
        "rank": rank,
        "step": int(step),
        "loss": _finite_or_none(loss),
        "step_time_s": _finite_or_none(step_time_s),
        "tokens_per_s": _finite_or_none(tokens_per_s),
    }
    if compute_time_s is not None:
        record["compute_time_s"] = _finite_or_none(compute_time_s)
    _append_line(Path(metrics_dir), rank, record)
    _start_heartbeat(Path(metrics_dir), rank)


def _append_line(path: Path, rank: int, record: dict) -> None:
    line = (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")
    path.mkdir(parents=True, exist_ok=True)

    fd = os.open(path / metrics_name(rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        while written < len(line):  # only on odd filesystems; regular files write it all at once
            written += os.write(fd, line[written:])
    finally:
        os.close(fd)


_heartbeat_started = False


def _start_heartbeat(path: Path, rank: int) -> None:
    """From the first report on, a daemon thread appends ``{"ts", "rank", "heartbeat": true}``
    every ``$SFTCTL_HEARTBEAT_S`` seconds (default 2) to the same file.

    The heartbeat says the process lives even while a step waits on a slow peer (collectives
    release the GIL); a frozen or killed process stops beating, which is how the controller
    tells the hung rank from the ranks waiting for it (:mod:`sftctl.health.detectors`).
    """
    global _heartbeat_started
    if _heartbeat_started:
        return
    _heartbeat_started = True
    interval_s = settings.get("SFTCTL_HEARTBEAT_S")

    def beat() -> None:
        while True:
            time.sleep(interval_s)
            try:
                _append_line(path, rank, {"ts": time.time(), "rank": rank, "heartbeat": True})
            except OSError:
                return

    threading.Thread(target=beat, name="sftctl-heartbeat", daemon=True).start()


def _finite_or_none(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if value == value and value not in (float("inf"), float("-inf")) else None


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# job configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training job settings, as given to the training script by sftctl through the environment.

    Attributes:
        steps: total optimizer steps of the job (a resumed run continues up to this number).
        batch_size: sequences per step per rank.
        checkpoint_interval: save a checkpoint every this many steps (and at the last step).
        dtype: canonical torch dtype name: "float32", "bfloat16" or "float16".
        job_id: sftctl job id, or None outside sftctl.
        node_rank: index of this node, 0-based.
        num_nodes: number of nodes in the job.
        matmul_precision: ``torch.set_float32_matmul_precision``'s setting for float32 matmuls
            (``highest``: IEEE FP32, torch's default; ``high``: TF32; ``medium``: bfloat16), from
            the job spec's ``model.matmul_precision``. :func:`config` applies it when torch is
            already imported, so the step runs at the precision the planner priced.
        grad_accum: micro-batches of ``batch_size`` each rank accumulates per optimizer step
            (``SFTCTL_GRAD_ACCUM``, default 1): more than 1 after an elastic resume on fewer
            nodes than planned, so the global batch stays the same.
    """

    steps: int
    batch_size: int
    checkpoint_interval: int
    dtype: str
    job_id: str | None
    node_rank: int
    num_nodes: int
    matmul_precision: str = "highest"
    grad_accum: int = 1


def config(
    *,
    steps: int = 200,
    batch_size: int = 16,
    checkpoint_interval: int = 50,
    dtype: str = "float32",
) -> TrainConfig:
    """Read the job's ``TrainConfig`` from the environment.

    Each ``SFTCTL_*`` variable that is set (and non-empty) overrides the matching keyword default:
    ``SFTCTL_TRAIN_STEPS``, ``SFTCTL_BATCH_SIZE``, ``SFTCTL_CHECKPOINT_INTERVAL``,
    ``SFTCTL_DTYPE``, ``SFTCTL_JOB_ID``, ``SFTCTL_NODE_RANK`` (default 0),
    ``SFTCTL_NUM_NODES`` (default 1) and ``SFTCTL_MATMUL_PRECISION`` (default ``highest``; applied
    with ``torch.set_float32_matmul_precision`` when torch is imported).

    ``dtype`` accepts "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16"/"half" and is
    returned in its canonical torch spelling.

    Raises:
        ValueError: a value (from the environment or a keyword) is malformed: a count that is not
            an integer >= 1 (``SFTCTL_NODE_RANK``: >= 0 and < num_nodes), or an unknown dtype. The
            message names the variable.
    """
    def get_int(name: str, default: int, minimum: int) -> int:
        if settings.raw(name) is None:
            if not isinstance(default, int) or isinstance(default, bool) or default < minimum:
                raise ValueError(f"{name}: default must be an integer >= {minimum}, got {default!r}")
            return default
        return settings.get(name)

    steps_v = get_int("SFTCTL_TRAIN_STEPS", steps, 1)
    batch_v = get_int("SFTCTL_BATCH_SIZE", batch_size, 1)
    interval_v = get_int("SFTCTL_CHECKPOINT_INTERVAL", checkpoint_interval, 1)
    num_nodes_v = get_int("SFTCTL_NUM_NODES", 1, 1)
    accum_v = get_int("SFTCTL_GRAD_ACCUM", 1, 1)
    node_rank_v = get_int("SFTCTL_NODE_RANK", 0, 0)
    if node_rank_v >= num_nodes_v:
        raise ValueError(
            f"SFTCTL_NODE_RANK={node_rank_v} must be < SFTCTL_NUM_NODES={num_nodes_v}"
        )
    raw_dtype = (settings.raw("SFTCTL_DTYPE") or dtype).lower()
    if raw_dtype not in _DTYPES:
        raise ValueError(
            f"SFTCTL_DTYPE: unknown dtype {raw_dtype!r}; expected one of {sorted(set(_DTYPES))}"
        )
    job_id = settings.raw("SFTCTL_JOB_ID")
    precision = settings.get("SFTCTL_MATMUL_PRECISION")
    torch = sys.modules.get("torch")
    if torch is not None:  # the script imported torch: run float32 matmuls as the plan priced them
        torch.set_float32_matmul_precision(precision)
    return TrainConfig(
        steps=steps_v,
        batch_size=batch_v,
        checkpoint_interval=interval_v,
        dtype=_DTYPES[raw_dtype],
        job_id=job_id,
        node_rank=node_rank_v,
        num_nodes=num_nodes_v,
        matmul_precision=precision,
        grad_accum=accum_v,
    )


def _parse_int(name: str, raw: str, *, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


# --------------------------------------------------------------------------------------------
# the planned data-parallel strategy, and sharded (DCP) checkpoints
# --------------------------------------------------------------------------------------------

PARALLELISMS = ("ddp", "fsdp")


def strategy() -> tuple[str, bool]:
    """The planned strategy from the environment: ``(parallelism, activation_checkpointing)``.

    ``SFTCTL_PARALLELISM``: ``ddp`` (default) or ``fsdp``; ``SFTCTL_ACTIVATION_CHECKPOINTING``:
    ``1``/``0`` (default ``0``). The controller sets both from the plan.

    Raises:
        ValueError: another value; the message names the variable.
    """
    return settings.get("SFTCTL_PARALLELISM"), settings.get("SFTCTL_ACTIVATION_CHECKPOINTING")


def blocks(model: Any) -> list:
    """The model's repeated blocks: the entries of its largest ``nn.ModuleList`` (by parameters),
    e.g. a GPT's ``blocks`` or a Llama's ``model.layers``; [] when it has none. These are the FSDP
    units and the activation-checkpointing units (see :mod:`sftctl.compiler.sharding`)."""
    import torch.nn as nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best)


def _log(msg: str) -> None:
    if global_rank() == 0:
        print(f"sftctl.train: {msg}", file=sys.stderr, flush=True)


def prepare(model: Any, *, parallelism: str | None = None, activation_checkpointing: bool | None = None,
            dtype: str | None = None) -> Any:
    """Wrap ``model`` (on its device already) the way the plan says; call it once, before
    building the optimizer, and train the module it returns.

    * ``ddp``: ``DistributedDataParallel`` when the process group is initialized with more than
      one rank; the model as it is otherwise. Mixed precision stays the script's autocast.
    * ``fsdp``: FSDP2, ``fully_shard`` on each block (:func:`blocks`) and then on the root, with
      ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`` when ``dtype`` is
      bfloat16/float16 (parameters gathered and computed in that dtype, float32 master weights,
      gradients reduce-scattered in float32). Parameters become sharded DTensors: save them with
      :func:`save_sharded_checkpoint`. If sharding fails (a model FSDP2 cannot wrap, a backend
      without the collectives it needs), it logs one line saying why and falls back to DDP.
    * activation checkpointing: each block is wrapped with ``checkpoint_wrapper`` (non-reentrant
      ``torch.utils.checkpoint``; its state-dict keys stay the block's own).

    Args:
        parallelism / activation_checkpointing: default :func:`strategy` (the environment).
        dtype: default ``config().dtype`` (``SFTCTL_DTYPE``).
    Returns:
        the module to call in the training loop (the same object, sharded in place, for FSDP).
    Raises:
        ValueError: an unknown parallelism (or a bad environment variable).
    """
    import torch
    import torch.distributed as dist

    env_par, env_ckpt = strategy()
    par = parallelism or env_par
    if par not in PARALLELISMS:
        raise ValueError(f"parallelism: expected ddp or fsdp, got {par!r}")
    ckpt = env_ckpt if activation_checkpointing is None else activation_checkpointing
    dtype = dtype or config().dtype
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    units = blocks(model)
    if ckpt and units:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        ids = {id(b) for b in units}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in ids)
        units = blocks(model)
        _log(f"activation checkpointing on {len(units)} blocks")
    if par == "fsdp":
        if world == 1 and not (dist.is_available() and dist.is_initialized()):
            _log("fsdp asked but torch.distributed is not initialized: training unsharded")
            return model
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            low = dtype in ("bfloat16", "float16")
            mp = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32) if low \
                else MixedPrecisionPolicy()
            for b in units:
                fully_shard(b, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            _log(f"fsdp: {len(units)} blocks + root sharded over {world} ranks"
                 + (f", parameters in {dtype}, gradients reduced in float32" if low else ""))
            return model
        except Exception as e:  # noqa: BLE001 - say why, then run what surely works
            _log(f"fsdp failed ({type(e).__name__}: {e}); falling back to ddp")
            par = "ddp"
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        _log(f"ddp over {world} ranks")
        # gradients are views into DDP's all-reduce buckets: no second copy of them, as the
        # planner's memory for ddp assumes (sftctl.compiler.sharding)
        return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                       gradient_as_bucket_view=True)
    return model


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _broadcast(value: Any) -> Any:
    dist = _dist()
    if dist is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value: Any) -> list:
    dist = _dist()
    if dist is None:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save_sharded_checkpoint(model: Any, optimizer: Any, step: int, *, extra: dict | None = None,
                            keep: int | None = None) -> Path:
    """Every rank writes its own shards of ``model`` and ``optimizer`` with
    ``torch.distributed.checkpoint`` (DCP); call it on every rank at once (it is collective).

    Works for a plain module, DDP and FSDP2 alike (``get_state_dict`` gives each rank its local
    shards under the model's own parameter names). Order, so a torn checkpoint is never resumed:

    1. rank 0 makes ``<checkpoint_dir>/step-%08d.tmp-<pid>`` and tells the others its name; a rank
       that does not see it (another node's disk) makes its own.
    2. ``dcp.save`` into it: each rank its ``__<rank>_0.distcp``, then rank 0 the ``.metadata``.
    3. With ``$SFTCTL_STORAGE_URL``: rank 0 deletes the step's manifest, every rank uploads the
       files it wrote, rank 0 writes ``MANIFEST.json`` listing all of them last and prunes the
       storage to ``keep`` (:func:`sftctl.storage.checkpoints.write_manifest`).
    4. rank 0 writes ``COMPLETE`` (``{"step", "format": "dcp", "world_size"}``), fsyncs and
       renames the directory to ``step-%08d``, and prunes to ``keep``. A rank on another disk
       removes its partial directory once its files are in job storage.

    Args:
        extra: small picklable values saved with the checkpoint (an RNG state, a data offset).
        keep: as :func:`save_checkpoint`.
    Returns:
        the final local directory (rank 0's view; other ranks get the same path).
    Raises:
        ValueError: a negative step or bad keep. OSError / StorageError: a write failed (no
            rank finalizes: the step stays incomplete everywhere).
    """
    keep = _checkpoint_args(step, keep)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist = _dist()
    rank = dist.get_rank() if dist else 0
    world = dist.get_world_size() if dist else 1
    root = checkpoint_dir()
    name = _step_name(step)
    final = root / name
    tmp_name = f"{name}.tmp-{os.getpid()}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if (root / tmp_name).exists():
            shutil.rmtree(root / tmp_name)
        (root / tmp_name).mkdir()
    tmp_name = _broadcast(tmp_name)
    tmp = root / tmp_name
    own_disk = rank != 0 and not tmp.exists()
    if own_disk:  # another node's disk: our files go to our own copy of the directory
        tmp.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        if rank == 0:
            import torch

            with open(tmp / EXTRA_FILE, "wb") as fh:
                torch.save({"step": int(step), **dict(extra or {})}, fh)
                fh.flush()
                os.fsync(fh.fileno())
    except (OSError, RuntimeError) as exc:
        full = _space_error(exc, step, tmp, final)
        if full is not None:
            raise full from exc
        raise
    storage = _job_storage()
    if storage is not None:
        if rank == 0:
            begin_checkpoint(storage, step)
        if dist:
            dist.barrier()
        mine = {f.name: f for f in tmp.iterdir() if f.is_file() and (
            f.name.startswith(f"__{rank}_") or (rank == 0 and f.name in (DCP_METADATA, EXTRA_FILE)))}
        files = upload_files(storage, step, mine) if mine else []
        parts = _all_gather(files)
        if rank == 0:
            write_manifest(storage, step, [f for part in parts for f in part], keep=keep)
    if dist:
        dist.barrier()
    if rank == 0:
        with open(tmp / COMPLETE_FILE, "w", encoding="utf-8") as fh:
            json.dump({"step": int(step), "format": "dcp", "world_size": world}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    if own_disk and storage is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist:
        dist.barrier()
    return final


def load_sharded_checkpoint(model: Any, optimizer: Any) -> tuple[int, dict] | None:
    """Load the newest complete checkpoint (a DCP one, or a single-file ``state.pt`` one
    written by :func:`save_checkpoint` with ``{"model", "optimizer"}``) into ``model`` and
    ``optimizer`` as they are wrapped now, on every rank at once (collective). DCP reshards: the
    checkpoint may come from another number of ranks or another strategy.

    Rank 0 finds the checkpoint (:func:`latest_checkpoint`: local, or downloaded from job
    storage); a rank that cannot see that directory (another node's disk) downloads it from
    job storage too.

    Returns:
        ``(step, extra)`` (``extra`` as given to :func:`save_sharded_checkpoint`), or None when
        there is no complete checkpoint.
    Raises:
        FileNotFoundError: a rank cannot see the checkpoint and there is no job storage.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist = _dist()
    rank = dist.get_rank() if dist else 0
    found = latest_checkpoint() if rank == 0 else None
    found = _broadcast(None if found is None else (str(found), _read_complete(found)))
    if found is None:
        return None
    path, step = Path(found[0]), int(found[1])
    if not path.is_dir():
        storage = _job_storage()
        if storage is None:
            raise FileNotFoundError(f"rank {rank}: checkpoint {path} is not on this node's disk and there is no job storage")
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            _download_checkpoint(storage, step, checkpoint_dir())
    if dist:
        dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if (path / DCP_METADATA).is_file():
        import torch

        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=True)
        extra.pop("step", None)
    else:  # a single-file checkpoint: full state dicts, every rank takes its part
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        full = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        extra = {k: v for k, v in full.items() if k not in ("model", "optimizer")}
    if dist:
        dist.barrier()
    return step, extra
