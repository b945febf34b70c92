"""A job's secret values in its cloud's secret store: how they reach a cloud node.

Job storage holds secret *names* only (protocol rule 7); a cloud node has no shell of the user's to
take the values from. So the controller puts the values of the job's secrets (the spec's
``secrets:`` and the ``env:`` values that refer to one) into the cloud's secret store when it
first boots a node, and the node daemon reads them back before it starts an attempt:

* **AWS Secrets Manager**: one secret ``sftctl/<job id>`` per job in ``SFTCTL_AWS_SECRETS_REGION``
  (default ``us-east-1``: one place whatever region the nodes run in, so ``down`` from any shell
  finds it), its ``SecretString`` a JSON object ``{NAME: value}``, tagged ``sftctl-managed=true``
  and ``sftctl-job=<job>``. Deleted without a recovery window when the job's resources are
  (:meth:`sftctl.providers.aws.AwsProvider.terminate_tagged`: teardown, ``down``, ``down --orphans``).
  The nodes' instance profile needs ``secretsmanager:GetSecretValue`` on
  ``arn:aws:secretsmanager:*:*:secret:sftctl/*``.

A node learns where to look from ``SFTCTL_SECRETS_REF`` in its bootstrap: ``aws-sm://REGION/NAME``,
a reference, never a value (the bootstrap is EC2 user-data, readable to anyone who may describe
the instance). GCP nodes (Secret Manager) do not have this yet: a GCP job with secrets says so at
launch (the node refuses to run without them, naming each).
"""

from __future__ import annotations

import json
import re

AWS_SCHEME = "aws-sm://"


class SecretStoreError(Exception):
    """The secret store could not be read or written; ``str()`` is one line naming the secret."""


def aws_secret_name(job_id: str) -> str:
    """The Secrets Manager name of ``job_id``'s secrets (``sftctl/<job id>``)."""
    return "sftctl/" + re.sub(r"[^A-Za-z0-9/_+=.@-]", "-", job_id)


def aws_ref(region: str, job_id: str) -> str:
    return f"{AWS_SCHEME}{region}/{aws_secret_name(job_id)}"


def parse_ref(ref: str) -> tuple[str, str, str]:
    """``(scheme, region, name)`` of a reference. Raises SecretStoreError for another form."""
    if ref.startswith(AWS_SCHEME):
        region, _, name = ref[len(AWS_SCHEME):].partition("/")
        if region and name:
            return "aws-sm", region, name
    raise SecretStoreError(f"SFTCTL_SECRETS_REF: {ref!r} is not aws-sm://REGION/NAME")


def _code(e: BaseException) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


def put_aws(client, job_id: str, values: dict[str, str], tags: dict[str, str]) -> str:
    """Create (or, for a restarted controller, overwrite) ``job_id``'s secret with ``values``
    through ``client`` (a boto3 ``secretsmanager`` client). Returns the secret's name.

    Raises:
        SecretStoreError: the store refused (the message names the secret and the AWS error code).
    """
    name = aws_secret_name(job_id)
    body = json.dumps(values, sort_keys=True)
    try:
        try:
            client.create_secret(Name=name, SecretString=body, Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
                                 Description="sftctl: the secret environment variables of one job (deleted with it)")
        except Exception as e:
            if _code(e) != "ResourceExistsException":
                raise
            client.put_secret_value(SecretId=name, SecretString=body)
    except Exception as e:
        raise SecretStoreError(f"aws: cannot store the job's secrets as {name}: {_code(e) or type(e).__name__}") from e
    return name


def delete_aws(client, job_id: str) -> bool:
    """Delete ``job_id``'s secret at once (no recovery window). Returns whether there was one.

    Raises:
        SecretStoreError: the store refused for another reason than the secret being gone.
    """
    name = aws_secret_name(job_id)
    try:
        client.delete_secret(SecretId=name, ForceDeleteWithoutRecovery=True)
    except Exception as e:
        if _code(e) == "ResourceNotFoundException":
            return False
        raise SecretStoreError(f"aws: cannot delete the job's secret {name}: {_code(e) or type(e).__name__}") from e
    return True


def fetch(ref: str) -> dict[str, str]:
    """The ``{NAME: value}`` stored under ``ref`` (on the node, with the node's credentials).

    Raises:
        SecretStoreError: a malformed reference, a missing secret, no permission, no network.
    """
    _, region, name = parse_ref(ref)
    import boto3

    try:
        body = boto3.client("secretsmanager", region_name=region).get_secret_value(SecretId=name)["SecretString"]
        values = json.loads(body)
    except Exception as e:
        raise SecretStoreError(f"cannot read the job's secrets {name} in {region}: "
                               f"{_code(e) or type(e).__name__} (the instance profile needs "
                               "secretsmanager:GetSecretValue on secret:sftctl/*)") from e
    if not isinstance(values, dict):
        raise SecretStoreError(f"the job's secrets {name} in {region} are not a JSON object")
    return {str(k): str(v) for k, v in values.items()}
