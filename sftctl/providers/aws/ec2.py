"""EC2's terms for the AWS provider: the DLAMI, quota codes per instance family, instance states,
which error codes are retried, and how a credentials failure is said (:func:`credentials_error`)."""

from __future__ import annotations

from sftctl.errors import CredentialsError, ProviderError
from sftctl.providers.cloud import (
    InstanceState,
)

#: What the package re-exports (``from sftctl.providers.aws import quota_for`` works as it did when
#: the provider was one module): the names, private ones too, that :mod:`sftctl.providers.aws` lists.
__all__ = [
    "CREDENTIALS_HINT", "CREDENTIAL_CODES", "DLAMI_NAME_PATTERN", "DLAMI_PARAMETER", "EVENTUAL_CONSISTENCY_S",
    "MAX_USER_DATA_BYTES", "QUOTA_CODES", "RETRY_CODES", "_LIVE_STATES", "_STATES", "_boto3",
    "_credential_failure", "_error_code", "_error_message", "_is_retryable", "credentials_error", "quota_for",
]

#: Public SSM parameter holding the newest x86_64 Deep Learning Base OSS Nvidia Driver GPU AMI
#: (Ubuntu 22.04) of a Region (AWS Deep Learning AMIs developer guide, "Retrieve the DLAMI ID with SSM").
DLAMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
#: The same AMI found with DescribeImages (owner ``amazon``), when the parameter cannot be read.
DLAMI_NAME_PATTERN = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)*"

#: EC2 limits user data to 16 KB in raw form, before base64 (EC2 User Guide, "Run commands when you
#: launch an EC2 instance with user data input").
MAX_USER_DATA_BYTES = 16 * 1024

#: How long after RunInstances a "not found" from DescribeInstances still means "just created":
#: the EC2 API is eventually consistent (EC2 API Reference, "Eventual consistency in the Amazon EC2
#: API": a DescribeInstances right after RunInstances can return InvalidInstanceID.NotFound).
EVENTUAL_CONSISTENCY_S = 120.0

#: Error codes that mean the credentials are missing, wrong, expired or not allowed to act.
CREDENTIAL_CODES = frozenset({
    "AuthFailure", "InvalidClientTokenId", "ExpiredToken", "ExpiredTokenException",
    "UnrecognizedClientException", "SignatureDoesNotMatch", "AccessDenied", "AccessDeniedException",
    "UnauthorizedOperation", "InvalidAccessKeyId",
})
#: Error codes retried with backoff: throttling, and EC2's transient server errors.
RETRY_CODES = frozenset({
    "RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException",
    "InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable",
})

#: EC2 vCPU quotas per instance family (Service Quotas, service code ``ec2``): on-demand and spot.
#: "Running On-Demand P instances" L-417A185B, "Running On-Demand G and VT instances" L-DB2E81BA,
#: "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances" L-1216C47A; "All P Spot
#: Instance Requests" L-7212CCBC, "All G and VT Spot Instance Requests" L-3819A6DF, "All Standard
#: (A, C, D, H, I, M, R, T, Z) Spot Instance Requests" L-34B43A08 (Service Quotas console, EC2).
QUOTA_CODES = {
    "P": ("Running On-Demand P instances", "L-417A185B", "All P Spot Instance Requests", "L-7212CCBC"),
    "G": ("Running On-Demand G and VT instances", "L-DB2E81BA", "All G and VT Spot Instance Requests", "L-3819A6DF"),
    "Standard": ("Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "L-1216C47A",
                 "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", "L-34B43A08"),
}

CREDENTIALS_HINT = ("set AWS_PROFILE (then `aws sso login` for an SSO profile), or AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or run `aws configure`")

_STATES = {
    "pending": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    "shutting-down": InstanceState.STOPPING,
    "stopping": InstanceState.STOPPING,
    "stopped": InstanceState.STOPPING,
    "terminated": InstanceState.GONE,
}
_LIVE_STATES = ["pending", "running", "shutting-down", "stopping", "stopped"]


def quota_for(instance_type: str, spot: bool) -> tuple[str, str] | None:
    """The (name, Service Quotas code) of the vCPU quota ``instance_type`` counts against, or None.

    ``instance_type`` like ``p4d.24xlarge``; the family is its leading letters (``p``, ``g``, ``vt``;
    A, C, D, H, I, M, R, T and Z are "Standard"). Others (F, Inf, Trn, X, DL ...) give None.
    """
    letters = ""
    for ch in instance_type.split(".")[0]:
        if not ch.isalpha():
            break
        letters += ch
    family = "P" if letters == "p" else "G" if letters in ("g", "vt") else (
        "Standard" if len(letters) == 1 and letters in "acdhimrtz" else None)
    if family is None:
        return None
    od_name, od_code, spot_name, spot_code = QUOTA_CODES[family]
    return (spot_name, spot_code) if spot else (od_name, od_code)


def _boto3():
    try:
        import boto3
    except ImportError:  # an optional dependency
        raise ProviderError("aws: its SDK (boto3) is not installed", hint="pip install -e '.[aws]' in sftctl's clone") from None
    return boto3


def _error_code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    return (response or {}).get("Error", {}).get("Code", "") if isinstance(response, dict) else ""


def _error_message(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return " ".join(str(response.get("Error", {}).get("Message", "") or e).split())
    return " ".join(str(e).split())


def _is_retryable(e: BaseException) -> bool:
    if _error_code(e) in RETRY_CODES:
        return True
    try:
        from botocore.exceptions import ConnectionClosedError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, ConnectionClosedError)


def _credential_failure(e: BaseException) -> bool:
    """Whether ``e`` says the credentials are missing or unusable (before or from AWS)."""
    if _error_code(e) in CREDENTIAL_CODES:
        return True
    import botocore.exceptions as be

    names = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
             "UnauthorizedSSOTokenError", "SSOTokenLoadError", "TokenRetrievalError")
    kinds = tuple(getattr(be, n) for n in names if hasattr(be, n))
    return isinstance(e, kinds)


def credentials_error(e: BaseException, what: str) -> CredentialsError:
    """A one-line :class:`CredentialsError` for ``e`` raised while doing ``what``."""
    code = _error_code(e)
    if code in ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException") and what != "check credentials":
        return CredentialsError(
            f"aws: the credentials may not {what} ({code})",
            hint="grant the IAM identity ec2:RunInstances, ec2:DescribeInstances, ec2:TerminateInstances, "
                 "ec2:CreateTags and the ec2:*SecurityGroup* actions in this region, or use another AWS_PROFILE")
    if code in ("ExpiredToken", "ExpiredTokenException"):
        return CredentialsError("aws: the session token has expired",
                                hint="refresh it: `aws sso login`, or assume the role again; " + CREDENTIALS_HINT)
    if code:
        return CredentialsError(f"aws: credentials were rejected ({code}: {_error_message(e)})", hint=CREDENTIALS_HINT)
    return CredentialsError(f"aws: no usable credentials ({_error_message(e)})", hint=CREDENTIALS_HINT)
