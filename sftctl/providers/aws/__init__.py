"""The AWS provider: a node is one EC2 instance, created with RunInstances in one Availability Zone.

What a node gets:
  * the offering's instance type, on-demand or spot (``InstanceMarketOptions``: one-time, terminate
    on interruption), in the zone :class:`~sftctl.providers.cloud.CloudProvider` picked;
  * the image of the spec, else the AWS Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04),
    resolved from its public SSM parameter, else found by name with ``DescribeImages``;
  * ``UserData`` = the node's bootstrap script (cloud-init runs it at first boot; it holds no secret:
    nodes reach the job's storage through an instance role, never through keys in user data);
  * tags: the labels of :func:`sftctl.providers.cloud.labels` and ``Name``, on the instance AND its
    EBS volumes (one ``TagSpecifications`` per resource type, applied atomically by RunInstances);
  * the job's security group ``sftctl-<job>`` (one per job and region, tagged like the nodes):
    inbound only from itself, so the nodes of a job reach each other (NCCL, torchrun's rendezvous)
    and nothing on the internet reaches them; the controller talks to nodes through storage.
  * IMDSv2 only (``HttpTokens=required``), and ``InstanceInitiatedShutdownBehavior=terminate``, so a
    node that powers itself off stops billing instead of lingering as a stopped instance.

Errors (EC2 API Reference, "Error codes for the Amazon EC2 API",
https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html):
  * ``InsufficientInstanceCapacity`` / ``InsufficientCapacity`` (server errors, HTTP 500): no
    capacity for the type in the requested AZ -> :class:`CapacityError` scope ``zone`` (scope
    ``offering`` when the message speaks of the Region rather than an Availability Zone).
  * ``Unsupported`` (HTTP 400): e.g. "Your requested instance type (...) is not supported in your
    requested Availability Zone (...)" -> scope ``zone``.
  * ``SpotMaxPriceTooLow`` -> scope ``offering`` (the spot price of this type in this Region).
  * ``MaxSpotInstanceCountExceeded`` and ``VcpuLimitExceeded`` / ``InstanceLimitExceeded``: the
    account's vCPU quotas, per Region and instance family (EC2 User Guide, "Amazon EC2 service
    quotas" and "Spot Instance quotas") -> scope ``region``, with the Service Quotas code to raise.
  * ``RequestLimitExceeded`` (HTTP 503; EC2 User Guide, "Request throttling": token buckets per
    account and Region, RunInstances refills at 2/s) and ``Throttling`` -> retried with random
    exponential backoff (:func:`sftctl.providers.cloud.retry_throttled`), as are the transient
    server errors ``InternalError`` / ``Unavailable`` / ``ServiceUnavailable``. RunInstances carries
    a ``ClientToken`` so a retried call never creates a second instance (EC2 API Reference,
    "Ensuring idempotency").
  * ``AuthFailure``, ``InvalidClientTokenId``, ``ExpiredToken``, ``UnrecognizedClientException``,
    ``SignatureDoesNotMatch``, ``AccessDenied``, ``UnauthorizedOperation`` and botocore's
    ``NoCredentialsError`` -> :class:`CredentialsError` (exit code 4) with what to set.
  * anything else -> :class:`ProviderError` with AWS's own code and message.

botocore's own retries are turned off (``total_max_attempts=1``): botocore retries every HTTP 500,
which would repeat an ``InsufficientInstanceCapacity`` RunInstances 4 times before the next zone is
tried, and spend RunInstances tokens doing it. sftctl retries what is worth retrying, itself.

boto3 is imported here only (and only when an :class:`AWSProvider` is built), so ``import sftctl``
and ``sftctl status`` never pay for it. Credentials and endpoint come from boto3's usual chain
(``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``..., ``~/.aws``, SSO, instance roles, ``AWS_ENDPOINT_URL``).

The package, split by job (ARCHITECTURE.md, "Layout"); every name is importable from
``sftctl.providers.aws``: :mod:`~sftctl.providers.aws.ec2` (the DLAMI, quotas, states, error
codes and credentials errors) and :mod:`~sftctl.providers.aws.provider` (:class:`AWSProvider`;
it logs as ``sftctl.providers.aws``).
"""

import os
from collections.abc import Mapping
from pathlib import Path

from sftctl.providers.base import ProviderEntry
from sftctl.providers.aws import ec2
from sftctl.providers.aws.ec2 import *  # noqa: F403 - ec2.__all__: every name importable from the package
from sftctl.providers.aws.provider import AWSProvider, log

__all__ = ["AWSProvider", "log"]
__all__ += ec2.__all__


def configured_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """None when boto3's credential chain has something to find here (environment, shared
    files, web identity, container credentials), else why not. No network call, no SDK import."""
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME", str(Path.home())))
    if (env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_PROFILE") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
            or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
            or Path(env.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials")).is_file()
            or Path(env.get("AWS_CONFIG_FILE", home / ".aws" / "config")).is_file()):
        return None
    return "aws: no credentials (set AWS_PROFILE or AWS_ACCESS_KEY_ID, or run aws configure)"


PROVIDER = ProviderEntry("aws", "AWSProvider", sdk="boto3", extra="aws", configured=configured_reason)
