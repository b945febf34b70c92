"""What the job lifecycle and its recovery share (see :mod:`sftctl.controller.lifecycle`): why
an attempt ended (:class:`Failure`), :class:`Cancelled`, where a controller tells what happens
(:class:`Reporter`, :class:`LogReporter`; :class:`_Guarded` keeps a broken one from the job),
the :class:`~sftctl.types.FailureCode` of an error that ended a job (:func:`_error_code`), the
signal and stdout helpers of a controller's process, and the one bound on a measured step the
run history keeps (:func:`off_prediction`), which a job's own measurement at its end
(``Controller._record_run``), ``calibrate import`` and the server's POST /v1/calibrate/runs
(:mod:`sftctl.api._tools`) all meet."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
from typing import Protocol

from sftctl.errors import ExitCode, InfeasibleError, SftctlError
from sftctl.queue import CANCEL_SIGNALS
from sftctl.types import FailureCode, FailureReason


#: How far (a factor either way) a measured step may lie from the model's prediction of the same
#: step and still enter the run history. Further is a unit slip (milliseconds given as seconds),
#: the wrong spec or a clock glitch, not a measurement: its log ratio enters every later
#: correction on the accelerator unbounded (1e308 s made every H100 plan NaN, 1e-300 s made it
#: 0 us). Published steps lie within 0.67-1.5x (docs/predictions.md); a small model on a loaded
#: CPU measured 119.5 ms against 0.7 ms predicted (170x); 1000x leaves the uncalibrated
#: accelerators' error (up to 1.84x) far inside.
MEASURED_MAX_FACTOR = 1000.0


def off_prediction(measured_s: float, predicted_s: float) -> float | None:
    """``measured_s / predicted_s`` (both seconds per step) when it lies beyond
    :data:`MEASURED_MAX_FACTOR` either way, else None (the run history may keep it). The ratio
    is ``inf`` when the division overflows (1e308 s over 0.7 ms) or ``predicted_s`` is not
    positive, ``nan`` when either is NaN: both beyond. Never raises."""
    ratio = measured_s / predicted_s if predicted_s > 0 else math.inf
    if 1 / MEASURED_MAX_FACTOR <= ratio <= MEASURED_MAX_FACTOR:
        return None
    return ratio


def ratio_words(ratio: float) -> str:
    """``ratio`` (from :func:`off_prediction`) before "the model's ...": ``"1.43e+05 x"``, or
    ``"beyond a float's range of"`` when it is not finite."""
    return f"{ratio:.3g} x" if math.isfinite(ratio) else "beyond a float's range of"


def _error_code(e: SftctlError) -> str:
    """The :class:`FailureCode` value of an error that ended a job: a provider error's own
    (``no_capacity``, ``not_configured``, ``provider_error``); ``no_capacity`` when no offering
    of the plan had capacity (:class:`InfeasibleError`); else ``unknown``."""
    reason = getattr(e, "reason", None)
    if isinstance(reason, FailureReason):
        return reason.code.value
    if isinstance(e, InfeasibleError):
        return FailureCode.NO_CAPACITY.value
    return FailureCode.UNKNOWN.value


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an attempt ended: the reason (its ``message`` is the line state keeps), what to do
    (``restart``, ``replace`` or None: give up), the node it concerns, and the exit code when a
    script exited."""

    reason: FailureReason
    action: str | None
    node_rank: int | None
    exit_code: int | None = None
    verdict: str | None = None  # a health verdict's kind and evidence: the replaced machine is quarantined


class Cancelled(Exception):
    """The job was cancelled (Ctrl-C, SIGTERM, SIGHUP, or ``sftctl down`` won a race).

    ``exit_code``: the signal's exit code (128 + its number) when a signal cancelled the job.
    """

    def __init__(self, why: str = "", exit_code: "ExitCode | None" = None):
        super().__init__(why)
        self.exit_code = exit_code


class Reporter(Protocol):
    """Where the controller tells what happens. The CLI's attached view implements it.

    A reporter may also have ``ended()`` (no arguments): :meth:`Controller.run
    <sftctl.controller.lifecycle.Controller.run>` calls it once the job's outcome is recorded
    and its nodes are torn down, just before it gives the caller's signal handlers back (the
    SIGINT, SIGTERM and SIGHUP handlers in force when ``run`` began, which it replaced for the
    job): a caller's handler then tells a signal after the job's end from one before it
    (``sftctl run`` stops printing and exits with the job's code, :mod:`sftctl.cli.launch`)."""

    def event(self, message: str) -> None: ...

    def log(self, rank: int, text: str) -> None: ...

    def metrics(self, samples: list[dict]) -> None: ...


class LogReporter:
    """Events as records of the ``sftctl.controller`` logger (the detached controller's
    ``main`` sends them to its log, ``controller.log``, one ``HH:MM:SS message`` line each)."""

    def event(self, message: str) -> None:
        logging.getLogger("sftctl.controller").info(message)

    def log(self, rank: int, text: str) -> None:
        pass

    def metrics(self, samples: list[dict]) -> None:
        pass


class _Guarded:
    """A reporter whose failures never reach the job: output that cannot be written (a closed
    pipe, a terminal that hung up) is dropped; the events are in state anyway."""

    def __init__(self, inner: Reporter):
        self.inner = inner
        self.broken = False

    def __getattr__(self, name: str):
        fn = getattr(self.inner, name)

        def call(*args, **kwargs):
            if self.broken:
                return None
            try:
                return fn(*args, **kwargs)
            except (OSError, ValueError):  # EIO, EPIPE, "I/O operation on closed file"
                self.broken = True
                return None

        return call


def _install_cancel_signals() -> dict:
    """SIGTERM and SIGHUP raise :class:`Cancelled` (SIGINT raises KeyboardInterrupt already).
    Returns the previous handlers by signal number, to restore."""
    if sys.platform == "win32" or not _in_main_thread():
        return {}
    previous = {}
    for name, (why, code) in CANCEL_SIGNALS.items():
        def handler(signum, frame, why=why, code=code):
            raise Cancelled(why, code)

        signum = getattr(signal, name)
        previous[signum] = signal.signal(signum, handler)
    return previous


def _same_file(fd: int, path) -> bool:
    """``fd`` is open on ``path`` (the detached controller's stdout on its controller.log)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _stdout_unlinked() -> bool:
    """This process's stdout is a file that was removed (its last name is gone)."""
    try:
        return os.fstat(1).st_nlink == 0
    except OSError:
        return False


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
