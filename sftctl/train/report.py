"""Ranks and metrics: :func:`global_rank`, :func:`report` (one JSON line per step per rank) and
the heartbeat thread it starts."""

from __future__ import annotations

import json
import math
import operator
import os
import threading
import time
from pathlib import Path
from typing import SupportsIndex

from sftctl import settings
from sftctl.protocol import metrics_name
from sftctl.train.config import _parse_int


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
    lr: float | None = None,
    checkpoint: bool | None = None,
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
        step: the training step just finished: an integer (``int``, a numpy or 0-d tensor integer)
            in ``[0, 2**63)``, the state's 64-bit INTEGER.
        loss: this rank's loss at that step, a real number (None: none this step). NaN/inf (a
            diverged run, worth seeing) are written as ``null``: JSON and the state have no NaN.
        step_time_s: wall time of the step in seconds, if measured; finite and >= 0.
        tokens_per_s: this rank's throughput in tokens per second, if measured; finite and >= 0.
        compute_time_s: seconds of the step's work that waits on no other rank (e.g. the
            forward pass), if measured: under synchronous data parallelism every rank's whole
            step takes as long as the slowest's, so only this shows which rank is the straggler.
        lr: the learning rate at that step, if wanted in the job's step history.
        checkpoint: True when this step's time includes writing a checkpoint: the measured
            step time (``sftctl status``'s ACTUAL, the run history) leaves it out.

    Raises:
        ValueError: an argument is out of its range above (the message names it and its value;
            nothing is written), or ``RANK``/``SFTCTL_NODE_RANK`` is malformed.
        OSError: the metrics directory or file cannot be created or written.
    """
    # checked with or without a metrics directory: a script is right or wrong the same outside sftctl
    record: dict = {
        "step": _step(step),
        "loss": None if loss is None else _finite_or_none(_number("loss", loss)),
        "step_time_s": _measure("step_time_s", step_time_s),
        "tokens_per_s": _measure("tokens_per_s", tokens_per_s),
    }
    if compute_time_s is not None:
        record["compute_time_s"] = _measure("compute_time_s", compute_time_s)
    if lr is not None:
        lr = _number("lr", lr)
        if not math.isfinite(lr):
            raise ValueError(f"lr: {lr!r} is not a finite number")
        record["lr"] = lr
    metrics_dir = settings.get("SFTCTL_METRICS_DIR")
    if not metrics_dir:
        return
    rank = global_rank()
    record = {"ts": time.time(), "rank": rank, **record}
    if checkpoint is not None:
        record["checkpoint"] = bool(checkpoint)
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


#: one past the largest step: the state keeps steps as 64-bit signed integers (SQLite, Postgres BIGINT)
STEP_LIMIT = 2**63


def _step(step: object) -> int:
    """``step`` as an int in ``[0, STEP_LIMIT)``; ValueError naming it otherwise (a float or a
    bool is no step: ``int(1.5)`` would quietly report step 1)."""
    value = None
    if isinstance(step, SupportsIndex) and not isinstance(step, bool):
        try:
            value = operator.index(step)
        except TypeError:  # a tensor with more than one element
            pass
    if value is None or not 0 <= value < STEP_LIMIT:
        raise ValueError(f"step: {step!r} is not an integer in [0, 2**63)")
    return value


def _number(name: str, value: object) -> float:
    """``value`` as a float (a Python, numpy or 0-d tensor number); ValueError naming ``name``
    for a string, None or anything else ``float()`` refuses or overflows on."""
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(f"{name}: {value!r} is not a number")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name}: {value!r} is not a number") from None


def _measure(name: str, value: object) -> float | None:
    """A time or rate: None, or a finite float >= 0; ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    number = _number(name, value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name}: {value!r} is not a finite number >= 0")
    return number


def _finite_or_none(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
