"""Errors a user can act on, and the exit codes they map to (see DESIGN.md, "Conventions").

Every error that reaches the CLI is a :class:`SftctlError`: one clear line, a hint, an exit code.
The CLI prints ``error: <message>`` and ``hint: <hint>`` and exits with ``exit_code``; ``--debug``
shows the traceback as well.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes shared by every ``sftctl`` command."""

    OK = 0
    JOB_FAILED = 1
    USAGE = 2
    INFEASIBLE = 3
    PROVIDER = 4
    INTERRUPTED = 130


class SftctlError(Exception):
    """A mistake or condition the user can act on.

    Args:
        message: one line saying what is wrong, naming the field, file and line where known.
        hint: one line saying how to fix it, or ``None``.
        exit_code: the process exit code the CLI uses for this error.
    """

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, message: str, hint: str | None = None, exit_code: ExitCode | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code


class SpecError(SftctlError):
    """The job spec (file or ``--set`` override) is invalid. Exit code 2."""

    exit_code = ExitCode.USAGE


class NotFoundError(SftctlError):
    """A job id that the state does not know. Exit code 2."""

    exit_code = ExitCode.USAGE


class InfeasibleError(SftctlError):
    """No offering satisfies the spec, or none has capacity. Exit code 3.

    ``candidates`` holds what the planner considered (each with why it was rejected).
    """

    exit_code = ExitCode.INFEASIBLE

    def __init__(self, message: str, hint: str | None = None, candidates: list | None = None):
        super().__init__(message, hint)
        self.candidates = candidates or []


class ProviderError(SftctlError):
    """A provider failed (credentials, API error, a node that would not start). Exit code 4."""

    exit_code = ExitCode.PROVIDER
