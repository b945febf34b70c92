"""Ctrl-C anywhere in a CLI invocation: one line on stderr and exit 130, never a traceback.

Standard library only: :mod:`sftctl.cli` imports this before anything heavy, so a Ctrl-C that
lands while typer, rich or pydantic are still being imported is reported the same way.

Three shapes reach the CLI:

- a bare :class:`KeyboardInterrupt`;
- an exception with a KeyboardInterrupt in its ``__cause__``/``__context__`` chain;
- a ``pydantic_core.SchemaError`` built while the signal landed: pydantic-core formats the
  KeyboardInterrupt into the message (``Error building "model" validator: ... KeyboardInterrupt:``)
  and keeps no chain.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
from typing import Any, Callable, NoReturn

#: 128 + SIGINT, as :class:`sftctl.errors.ExitCode.INTERRUPTED` (not imported here: this module stays light)
INTERRUPTED_EXIT = 130


class Interrupted(Exception):
    """A KeyboardInterrupt inside a command, carried past typer (which turns a bare
    KeyboardInterrupt into a silent exit 130) to :func:`sftctl.cli.main`. ``message``: the one line
    to print (``"interrupted"``, or what was interrupted)."""

    def __init__(self, message: str = "interrupted"):
        super().__init__(message)
        self.message = message


def caused_by_interrupt(exc: BaseException | None) -> bool:
    """True when ``exc`` is, or was caused by, a Ctrl-C: a KeyboardInterrupt anywhere in its
    ``__cause__``/``__context__`` chain, or pydantic-core's SchemaError naming one (see the module)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (KeyboardInterrupt, Interrupted)):
            return True
        if type(exc).__name__ == "SchemaError" and "KeyboardInterrupt" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def exit_interrupted() -> NoReturn:
    """End this process with status 130 now: run its ``atexit`` handlers (``weakref.finalize``
    and tempfile clean-ups among them), flush stdout and stderr, then ``os._exit(130)``.

    A plain ``sys.exit(130)`` can end in death by SIGINT (status -2) after the one line is
    printed: CPython marks a KeyboardInterrupt "unhandled" whenever one leaves a nested
    ``PyRun_*`` evaluation (a C extension's ``exec`` while it loads, as torch's does), keeps that
    mark after Python code catches the interrupt, and at exit re-raises SIGINT on itself. Blocking
    SIGINT does not help: torch's threads have it unblocked and take the re-raise. Call this only
    where the process, not a caller of :func:`sftctl.cli.main`, is what ends."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(INTERRUPTED_EXIT)


def say_interrupted(message: str = "interrupted") -> int:
    """Print ``message`` as one line on stderr (a closed stderr is ignored); returns 130."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    return INTERRUPTED_EXIT


def interruptible(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a typer command's callback) with a Ctrl-C raised as :class:`Interrupted`: typer
    itself answers a bare KeyboardInterrupt with a silent ``Exit(130)``. Signature kept
    (``functools.wraps``), which is what typer reads the options from."""
    if getattr(fn, "_sftctl_interruptible", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            raise Interrupted() from e

    wrapper._sftctl_interruptible = True  # type: ignore[attr-defined]
    return wrapper


def guard_commands(typer_app: Any) -> None:
    """Wrap every command callback of ``typer_app`` and of its sub-apps with :func:`interruptible`
    (idempotent)."""
    for info in typer_app.registered_commands:
        if info.callback is not None:
            info.callback = interruptible(info.callback)
    if typer_app.registered_callback is not None and typer_app.registered_callback.callback is not None:
        typer_app.registered_callback.callback = interruptible(typer_app.registered_callback.callback)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            guard_commands(group.typer_instance)
