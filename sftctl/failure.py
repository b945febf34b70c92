"""Why a node's run failed, found out on the node itself.

The node bootstrap (``templates/node.sh.j2``) runs ``python -m sftctl.failure --setup RC RECORD
STDERR_TAIL`` after the spec's ``setup`` failed (:func:`setup_failure`: ``setup failed: <its last
stderr line>``), ``python -m sftctl.failure --oom-kills``
before the spec's ``run`` and ``python -m sftctl.failure RC ERROR_FILE OOM_BEFORE RECORD`` after
a non-zero exit. That writes the answer as a :class:`sftctl.types.FailureReason` record (JSON:
``{"code": "oom" | "exception" | "signal", "message": <one line>, "data": {...}}``) to
``RECORD`` = the node directory's ``failure-<attempt>.json`` (:func:`sftctl.protocol.failure_name`;
before the attempt's exit file, so the record is there when the exit code is), and prints the line for the node's log, where people
read it as ``[sftctl] node N: failed: <reason>``. Providers hand the record to the controller
(``Provider.read_failure``; job storage ships it as ``nodes/<node>/failure-<attempt>.json``);
nothing parses the log line.

Sources, first that answers:

1. torchelastic's error file (``$TORCHELASTIC_ERROR_FILE``, set per node attempt by the
   bootstrap): torchrun copies the first failed worker's file there, and a plain script writes
   it itself; :mod:`sftctl.train` installs an excepthook that writes the uncaught exception in
   torchelastic's format (``{"message": {"message": "...", "extraInfo": {...}}}``, the format
   of ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``).
2. The kernel's OOM-kill counter: ``oom_kill`` in the node's memory cgroup (v2
   ``memory.events``, v1 ``memory.oom_control``), else the machine's ``/proc/vmstat``; a
   counter that rose while the run ran means the kernel killed a process for memory.
3. The exit status: above 128 is a signal (bash reports 128 + signal number).
4. The last line the run wrote to stderr (``node.sh`` keeps its last 20 lines in
   ``stderr-tail-<attempt>``): a plain script's own words (``exit``).

Imports nothing heavy (it runs on every failure, on every node).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from sftctl import settings
from sftctl.protocol import parse_failure
from sftctl.types import FailureCode, FailureReason


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup
    (or, failing that, on this machine); None when the kernel does not say."""
    for path in _cgroup_counter_files():
        value = _read_counter(path, "oom_kill")
        if value is not None:
            return value
    return _read_counter(Path("/proc/vmstat"), "oom_kill")


def _cgroup_counter_files() -> list[Path]:
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2
            out.append(Path("/sys/fs/cgroup") / rel / "memory.events")
        elif "memory" in controllers.split(","):
            out.append(Path("/sys/fs/cgroup/memory") / rel / "memory.oom_control")
    return out


def _read_counter(path: Path, name: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None


def error_file_message(path: str | os.PathLike) -> str | None:
    """The first line of the exception recorded in a torchelastic error file, with the failed
    rank when it is known; None when there is no readable file."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    msg = doc.get("message") if isinstance(doc, dict) else None
    extra = {}
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        msg = msg.get("message")
    if not isinstance(msg, str) or not msg.strip():
        return None
    first = " ".join(msg.strip().splitlines()[0].split())[:300]
    rank = extra.get("rank") if isinstance(extra, dict) else None
    return f"rank {rank}: {first}" if rank is not None else first


def error_file_code(path: str | os.PathLike | None) -> str | None:
    """The :class:`FailureCode` value :func:`write_error_file` recorded for an exception that
    carries one (``failure_code``: :class:`sftctl.train.CheckpointSpaceError`), or None."""
    try:
        doc = json.loads(Path(path).read_text()) if path else None
        code = doc["message"]["extraInfo"].get("failure_code")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return code if isinstance(code, str) else None


def diagnose(rc: int, error_file: str | None = None, oom_before: int | None = None) -> FailureReason | None:
    """Why a run exited with ``rc`` (non-zero): ``oom`` (the OOM-kill counter rose since
    ``oom_before``), ``disk_full`` (a checkpoint found no room: the error file's exception carries
    that code, :class:`sftctl.train.CheckpointSpaceError`), ``exception`` (the error file's first
    line) or ``signal`` (``rc`` above 128);
    ``data`` holds ``exit_code`` and, where known, ``signal``, ``oom_kills`` and ``rank``.
    None when nothing is known beyond the code."""
    recorded = error_file_message(error_file) if error_file else None
    now = oom_kills()
    oom = oom_before is not None and now is not None and now > oom_before
    data: dict = {"exit_code": rc}
    if oom:
        what = "a process was killed by the kernel's OOM killer (out of memory)"
        data["oom_kills"] = now - oom_before
        return FailureReason(FailureCode.OOM, f"{what}; {recorded}" if recorded else what, data)
    if recorded:
        code = FailureCode.EXCEPTION
        if error_file_code(error_file) == FailureCode.DISK_FULL.value or "CheckpointSpaceError:" in recorded:
            code = FailureCode.DISK_FULL
        return FailureReason(code, recorded, data)
    if rc > 128:
        try:
            name = signal.Signals(rc - 128).name
        except ValueError:
            name = f"signal {rc - 128}"
        data["signal"] = rc - 128
        return FailureReason(FailureCode.SIGNAL, f"killed by {name} (signal {rc - 128})", data)
    return None


#: how long the failure diagnosis waits for the run's stderr tail (node.sh writes it when the
#: run's stderr closes, just after the run exits)
STDERR_TAIL_WAIT_S = 2.0


def last_stderr_line(path: str | os.PathLike, wait_s: float = STDERR_TAIL_WAIT_S, limit: int = 300) -> str | None:
    """The last non-empty line of the run's (or setup's) stderr tail file (``node.sh`` writes it
    whole, by rename, once that stderr closes: waited for up to ``wait_s`` seconds), cut to
    ``limit`` characters (the last 3 of them ``...``); None when there is none."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1]
    return last if len(last) <= limit else last[:limit - 3] + "..."


#: the longest stderr line a failed setup's reason quotes, in characters (one status row's worth)
SETUP_LINE_CHARS = 200


def setup_failure(rc: int, stderr_tail: str | os.PathLike | None = None) -> FailureReason:
    """Why the spec's ``setup`` exited with ``rc`` (non-zero): ``setup failed: `` and the signal
    that killed it (``rc`` above 128: code ``signal``), else setup's last non-empty stderr line
    (:func:`last_stderr_line`, at most :data:`SETUP_LINE_CHARS` characters; code ``exit``), else
    ``setup failed`` alone. ``data``: ``exit_code``, ``phase`` = ``"setup"``, and ``signal`` or
    ``stderr`` where known."""
    data: dict = {"exit_code": rc, "phase": "setup"}
    if rc > 128:
        killed = diagnose(rc)
        if killed is not None:
            return FailureReason(killed.code, f"setup failed: {killed.message}", {**killed.data, **data})
    last = last_stderr_line(stderr_tail, limit=SETUP_LINE_CHARS) if stderr_tail else None
    if last is None:
        return FailureReason(FailureCode.EXIT, "setup failed", data)
    return FailureReason(FailureCode.EXIT, f"setup failed: {last}", {**data, "stderr": last})


def describe(rc: int, error_file: str | None = None, oom_before: int | None = None) -> str | None:
    """:func:`diagnose`'s line, or None."""
    why = diagnose(rc, error_file, oom_before)
    return None if why is None else why.message


def write_record(reason: FailureReason, path: str | os.PathLike) -> None:
    """Write ``reason`` as the JSON failure record at ``path`` (renamed into place whole)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(reason.to_dict(), f)
    os.replace(tmp, path)


def read_record(data: bytes | str | None) -> FailureReason | None:
    """:func:`sftctl.protocol.parse_failure`: the record's reason, or None."""
    return parse_failure(data)


def write_error_file(exc: BaseException, path: str | os.PathLike, rank: int | None = None) -> None:
    """Record ``exc`` in torchelastic's error-file format (what ``@record`` writes), plus the rank."""
    doc = {"message": {"message": f"{type(exc).__name__}: {exc}",
                       "extraInfo": {"py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                                     "timestamp": str(int(time.time())), "rank": rank,
                                     "failure_code": getattr(exc, "failure_code", None)}}}
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def install_excepthook() -> None:
    """Write an uncaught exception to ``$TORCHELASTIC_ERROR_FILE`` (if set and not yet written),
    then let the previous hook print it as usual."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path or getattr(sys.excepthook, "_sftctl", False):
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        try:
            if not os.path.exists(path) and not issubclass(kind, KeyboardInterrupt):
                rank = os.environ.get("RANK") or settings.raw("SFTCTL_NODE_RANK")
                write_error_file(exc.with_traceback(tb), path, int(rank) if rank and rank.isdigit() else None)
        except Exception:  # noqa: BLE001 diagnosing must never hide the real error
            pass
        previous(kind, exc, tb)

    hook._sftctl = True  # type: ignore[attr-defined]  # marks our hook: installed once
    sys.excepthook = hook


def main(argv: list[str] | None = None) -> int:
    """``--oom-kills``: print the counter. ``--setup RC RECORD STDERR_TAIL``: the record of a
    failed setup (:func:`setup_failure`), its line printed. ``RC [ERROR_FILE [OOM_BEFORE [RECORD [STDERR_TAIL]]]]``:
    print the reason's line, and write its record to ``RECORD`` when given. A failure nothing
    else explains (a plain script, no torchrun, no :mod:`sftctl.train`) is ``exit`` with the
    last line the run wrote to stderr (``STDERR_TAIL``: ``python: can't open file ...``, the
    exception's last line) as its message."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--oom-kills"]:
        n = oom_kills()
        print("" if n is None else n)
        return 0
    if args[:1] == ["--setup"]:  # --setup RC RECORD STDERR_TAIL: the spec's setup failed
        why = setup_failure(int(args[1]), args[3] if len(args) > 3 and args[3] else None)
        if len(args) > 2 and args[2]:
            write_record(why, args[2])
        print(why.message)
        return 0
    rc = int(args[0])
    error_file = args[1] if len(args) > 1 and args[1] else None
    oom_before = int(args[2]) if len(args) > 2 and args[2].isdigit() else None
    record = args[3] if len(args) > 3 and args[3] else None
    why = diagnose(rc, error_file, oom_before)
    if why is None and len(args) > 4 and args[4]:
        last = last_stderr_line(args[4])
        if last is not None:
            why = FailureReason(FailureCode.EXIT, last, {"exit_code": rc, "stderr": last})
    if why:
        if record:
            write_record(why, record)
        print(why.message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
