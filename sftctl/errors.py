"""Errors a user can act on, and the exit codes they map to (see DESIGN.md, "Conventions").

Every error that reaches the CLI is a :class:`SftctlError`: one clear line, a hint, an exit code.
The CLI prints ``error: <message>`` and ``hint: <hint>`` and exits with ``exit_code``; ``--debug``
shows the traceback as well.
"""

from __future__ import annotations

import enum

from sftctl.types.plans import FailureReason  # the module, not the package: types.layout raises SpecError


class ExitCode(enum.IntEnum):
    """Process exit codes shared by every ``sftctl`` command."""

    OK = 0
    JOB_FAILED = 1
    USAGE = 2
    INFEASIBLE = 3
    PROVIDER = 4
    UNTRACEABLE = 5  # the model's step cannot be traced or lowered (an op, a data-dependent shape)
    SERVER_LOST = 75  # a follower (wait, logs -f, run) lost the server for server.retry_s; the job goes on (EX_TEMPFAIL)
    TIMEOUT = 124  # `sftctl wait --timeout` ran out with a job still going (as timeout(1) exits)
    HANGUP = 129  # 128 + SIGHUP: the terminal closed; the job was cancelled
    INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C
    TERMINATED = 143  # 128 + SIGTERM (sent by `sftctl down`, a service manager, kill)


class SftctlError(Exception):
    """A mistake or condition the user can act on.

    Args:
        message: one line saying what is wrong, naming the field, file and line where known.
        hint: one line saying how to fix it, or ``None``.
        exit_code: the process exit code the CLI uses for this error.
    """

    exit_code: ExitCode = ExitCode.USAGE
    #: ``(job id, who supervises it)`` when Ctrl-C left a job going under another supervisor
    #: (api.run attached to a server's job): the CLI says so plainly instead of as an error
    detached: tuple[str, str] | None = None

    def __init__(self, message: str, hint: str | None = None, exit_code: ExitCode | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code


class SftctlWarning(UserWarning):
    """Something worth a look that did not stop the command (a model that could not be traced:
    the plan ranks by price only). :mod:`sftctl.api` issues it with :func:`warnings.warn`; the
    CLI prints it as a ``warning:`` line."""


class SpecError(SftctlError):
    """The job spec (file or ``--set`` override) is invalid. Exit code 2."""

    exit_code = ExitCode.USAGE


class UntraceableModelError(SftctlError):
    """The tracer cannot take the model's training step (an op without a lowering, a
    data-dependent shape or branch, an error raised inside the model's code while tracing): not a
    mistake in the spec. Exit code 5. The message names the op, the module and the model's
    file:line where known; ``run`` still runs the job, ranked by price, with a warning."""

    exit_code = ExitCode.UNTRACEABLE


class StateUnavailable(SftctlError):
    """The state database (Postgres) cannot be reached: refused, down, a lost connection. Exit
    code 2 here, as before; a server answers it as 503 with one line for the user (the message,
    which names the database, goes to the server's log only)."""


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
    """A provider failed (credentials, API error, a node that would not start). Exit code 4.

    ``reason`` is the failure as a :class:`sftctl.types.FailureReason` (code ``provider_error``;
    ``not_configured`` for :class:`CredentialsError`, ``no_capacity`` for :class:`CapacityError`),
    so callers switch on its code instead of reading the message.
    """

    exit_code = ExitCode.PROVIDER
    failure_code = "provider_error"

    @property
    def reason(self):
        return FailureReason(self.failure_code, self.message, self._reason_data())

    def _reason_data(self) -> dict:
        return {}


class CredentialsError(ProviderError):
    """A cloud's credentials are missing, expired or lack a permission. Exit code 4.

    The message names the cloud and what failed; the hint says what to set (environment
    variables, a credentials file, a kubeconfig context).
    """

    failure_code = "not_configured"


class CapacityError(ProviderError):
    """A cloud had no capacity or quota for an offering; the planner moves to the next one.

    Attributes:
        provider: ``aws``, ``gcp`` or ``kubernetes``.
        scope: what the error blocks for this job: ``"zone"`` (only that zone: try the region's
            other zones), ``"offering"`` (this instance type in this region), ``"region"`` (every
            offering of the provider in ``region``, e.g. a regional GPU quota) or ``"cloud"``
            (every offering of the provider, e.g. GCP's ``GPUS_ALL_REGIONS`` quota).
        region, zone, instance_type: where it happened (None when not known or not relevant).
        code: the cloud's own error code (``InsufficientInstanceCapacity``,
            ``ZONE_RESOURCE_POOL_EXHAUSTED``, ``QUOTA_EXCEEDED`` ...).
    """

    failure_code = "no_capacity"

    def __init__(self, message: str, *, provider: str, scope: str = "offering", region: str | None = None,
                 zone: str | None = None, instance_type: str | None = None, code: str = "",
                 hint: str | None = None):
        if scope not in ("zone", "offering", "region", "cloud"):
            raise ValueError(f"scope {scope!r}")
        super().__init__(message, hint)
        self.provider, self.scope, self.region, self.zone = provider, scope, region, zone
        self.instance_type, self.code = instance_type, code

    def _reason_data(self) -> dict:
        return {"provider": self.provider, "scope": self.scope, "region": self.region, "zone": self.zone,
                "instance_type": self.instance_type, "cloud_code": self.code}

    def blocks(self, provider: str, region: str, instance_type: str, zone: str | None = None) -> bool:
        """Whether this error rules out ``instance_type`` in ``region`` (``zone``) of ``provider``."""
        if provider != self.provider:
            return False
        if self.scope == "cloud":
            return True
        if region != self.region:
            return False
        if self.scope == "region":
            return True
        if instance_type != self.instance_type:
            return False
        return self.scope == "offering" or zone == self.zone
