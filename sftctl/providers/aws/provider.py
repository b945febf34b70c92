"""The AWS provider: :class:`AWSProvider` (see :mod:`sftctl.providers.aws`)."""

from __future__ import annotations

import logging
import threading
import time
import uuid

from sftctl import settings
from sftctl.catalog import Offering, cloud_offerings
from sftctl.errors import CapacityError, ProviderError
from sftctl.providers.aws.ec2 import (
    _LIVE_STATES,
    _STATES,
    DLAMI_NAME_PATTERN,
    DLAMI_PARAMETER,
    EVENTUAL_CONSISTENCY_S,
    MAX_USER_DATA_BYTES,
    _boto3,
    _credential_failure,
    _error_code,
    _error_message,
    _is_retryable,
    credentials_error,
    quota_for,
)
from sftctl.providers.cloud import (
    JOB_LABEL,
    MANAGED_LABEL,
    NODE_LABEL,
    READY_TIMEOUT_S,
    CloudProvider,
    InstanceRequest,
    InstanceState,
    label_value,
    retry_throttled,
)
from sftctl.storage import secrets as store
from sftctl.types import AWSHandle

log = logging.getLogger("sftctl.providers.aws")  # the name it had as one module


class AWSProvider(CloudProvider[AWSHandle]):
    """EC2 instances as nodes. See the module docstring for what a node gets and how errors map.

    Args:
        channel, poll_s, ready_timeout_s: see :class:`~sftctl.providers.cloud.CloudProvider`.
        key_name: an EC2 key pair to put on the nodes (none by default: nodes need no SSH).
        instance_profile: an IAM instance profile name for the nodes (how they reach the job's S3
            storage without keys in user data); None launches them without one.
        ami_parameter: the SSM parameter naming the default image (the DLAMI's public parameter).
        ami_name_pattern, ami_owners: the DescribeImages fallback when the parameter is unreadable.
        regions: the regions ``list_instances`` searches (default: the regions of the catalog's aws
            offerings).
        secrets: the job's secret values ``{NAME: value}``, put into Secrets Manager for its
            nodes (:meth:`secrets_ref`, :mod:`sftctl.storage.secrets`); never in user data or storage.
        teardown_timeout_s: how long ``terminate_tagged`` waits for instances to be terminated before
            it deletes the job's security groups.
        throttle_attempts: tries of one API call while AWS throttles it.
    """

    name = "aws"
    handle_type = AWSHandle

    def __init__(self, channel=None, poll_s: float = 2.0, ready_timeout_s: float = READY_TIMEOUT_S, *,
                 key_name: str | None = None, instance_profile: str | None = None, ami_parameter: str = DLAMI_PARAMETER,
                 ami_name_pattern: str = DLAMI_NAME_PATTERN, ami_owners: tuple[str, ...] = ("amazon",),
                 regions: list[str] | None = None, teardown_timeout_s: float = 600.0,
                 throttle_attempts: int = 8, secrets: dict[str, str] | None = None, **_: object):
        super().__init__(channel=channel, poll_s=poll_s, ready_timeout_s=ready_timeout_s)
        self.secrets = dict(secrets or {})  # values: only ever sent to Secrets Manager
        self._secret_refs: dict[str, str] = {}  # job -> its stored secret's reference
        self.key_name = key_name
        self.instance_profile = instance_profile
        self.ami_parameter = ami_parameter
        self.ami_name_pattern = ami_name_pattern
        self.ami_owners = tuple(ami_owners)
        self.regions = list(regions) if regions else sorted(
            {o.region for o in cloud_offerings() if o.provider == "aws"})
        self.teardown_timeout_s = teardown_timeout_s
        self._retry = retry_throttled(_is_retryable, attempts=throttle_attempts)
        self._session = _boto3().session.Session()
        self._lock = threading.Lock()
        self._client_lock = threading.Lock()  # creating a client loads its model: ~0.1 s
        self._clients: dict[tuple[str, str], object] = {}
        self._zones: dict[str, list[str]] = {}
        self._type_zones: dict[tuple[str, str], set[str] | None] = {}  # (region, type) -> zones
        self._region_types_cache: dict[tuple, set[str] | None] = {}  # (region, types) -> offered
        self._images: dict[str, str] = {}
        self._groups: dict[tuple[str, str], str] = {}
        self._key_locks: dict[tuple, threading.Lock] = {}
        self._created: dict[str, float] = {}  # instance id -> time.monotonic() of RunInstances
        self._watch: dict[str, dict[str, float]] = {}  # region -> {instance id: when last asked}
        self._seen: dict[str, tuple[str | None, float]] = {}  # instance id -> (EC2 state or None, when)
        self._inflight: dict[str, dict] = {}  # region -> {instance id: Future of a DescribeInstances}
        self._offline = False  # offerings() found AWS unreachable or the credentials unusable

    # ------------------------------------------------------------ plumbing

    def client(self, service: str, region: str):
        """A boto3 client of ``service`` in ``region`` (cached; clients are thread-safe, creating them
        from one session is not, hence the lock). botocore's retries are off, see the module doc."""
        key = (service, region)
        with self._client_lock:
            if key not in self._clients:
                from botocore.config import Config

                config = Config(retries={"mode": "standard", "total_max_attempts": 1},
                                max_pool_connections=32, connect_timeout=10, read_timeout=60)
                self._clients[key] = self._session.client(service, region_name=region, config=config)
            return self._clients[key]

    def _call(self, service: str, region: str, operation: str, **kwargs) -> dict:
        """``operation`` of ``service`` in ``region``, retried while throttled."""
        fn = getattr(self.client(service, region), operation)
        return self._retry(fn)(**kwargs)

    def _pages(self, service: str, region: str, operation: str, **kwargs) -> list[dict]:
        """Every page of a paginated ``operation``, the whole walk retried while throttled."""
        paginator = self.client(service, region).get_paginator(operation)
        return self._retry(lambda: list(paginator.paginate(**kwargs)))()

    def _key_lock(self, key: tuple) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def _fail(self, e: Exception, what: str) -> ProviderError:
        """``e`` (raised while doing ``what``) as the SftctlError the user sees."""
        if isinstance(e, ProviderError):
            return e
        if _credential_failure(e):
            return credentials_error(e, what)
        code = _error_code(e)
        detail = f"{code}: {_error_message(e)}" if code else _error_message(e)
        hint = None
        if code in ("VPCIdNotSpecified", "MissingInput", "InvalidSubnet"):
            hint = "sftctl launches into the region's default VPC; create one with `aws ec2 create-default-vpc`"
        return ProviderError(f"aws: cannot {what}: {detail}", hint=hint)

    def _default_region(self) -> str:
        return self._session.region_name or (self.regions[0] if self.regions else "us-east-1")

    # ------------------------------------------------------------ CloudProvider: infrastructure

    def check(self) -> None:
        """Ask STS who we are (``GetCallerIdentity`` needs no permission, so it tests credentials only).

        Raises:
            CredentialsError: credentials are missing, invalid or expired (exit code 4).
            ProviderError: AWS could not be reached.
        """
        try:
            self._call("sts", self._default_region(), "get_caller_identity")
        except Exception as e:
            raise self._fail(e, "check credentials") from e

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """The catalog's aws rows for ``count`` x ``accelerator`` per node, less the instance types that
        ``DescribeInstanceTypeOfferings`` says a region does not sell (only when credentials work;
        without them, every catalog row is returned)."""
        rows = [o for o in cloud_offerings() if o.provider == "aws" and o.count == count
                and o.accelerator.lower() == accelerator.lower()]
        out = []
        for o in rows:
            offered = self._region_types(o.region, sorted({r.instance_type for r in rows if r.region == o.region}))
            if offered is None or o.instance_type in offered:
                out.append(o)
        return out

    def _region_types(self, region: str, types: list[str]) -> set[str] | None:
        key = (region, tuple(types))
        if key in self._region_types_cache:
            return self._region_types_cache[key]
        if self._offline:
            return None
        try:
            pages = self._pages("ec2", region, "describe_instance_type_offerings",
                                LocationType="region", Filters=[{"Name": "instance-type", "Values": types}])
            offered = {o["InstanceType"] for page in pages for o in page["InstanceTypeOfferings"]}
        except Exception as e:  # noqa: BLE001 no credentials, no network: the catalog alone decides
            log.debug("aws: not filtering offerings in %s: %s", region, e)
            self._offline = True
            offered = None
        self._region_types_cache[key] = offered
        return offered

    def zones(self, region: str) -> list[str]:
        """The region's Availability Zones in state ``available`` (not Local or Wavelength Zones), sorted."""
        with self._key_lock(("zones", region)):
            return self._zones_locked(region)

    def _zones_locked(self, region: str) -> list[str]:
        if region not in self._zones:
            try:
                resp = self._call("ec2", region, "describe_availability_zones",
                                  Filters=[{"Name": "state", "Values": ["available"]}])
            except Exception as e:
                raise self._fail(e, f"list the availability zones of {region}") from e
            self._zones[region] = sorted(
                z["ZoneName"] for z in resp["AvailabilityZones"]
                if z.get("ZoneType", "availability-zone") == "availability-zone")
        return list(self._zones[region])

    def zones_offering(self, region: str, instance_type: str) -> set[str] | None:
        """The zones of ``region`` that sell ``instance_type`` (``DescribeInstanceTypeOfferings``), or
        None when AWS would not say (the zone walk then asks RunInstances itself)."""
        key = (region, instance_type)
        with self._key_lock(("type-zones",) + key):
            return self._zones_offering_locked(key)

    def _zones_offering_locked(self, key: tuple[str, str]) -> set[str] | None:
        region, instance_type = key
        if key not in self._type_zones:
            try:
                pages = self._pages("ec2", region, "describe_instance_type_offerings", LocationType="availability-zone",
                                    Filters=[{"Name": "instance-type", "Values": [instance_type]}])
                self._type_zones[key] = {o["Location"] for page in pages for o in page["InstanceTypeOfferings"]}
            except Exception as e:
                if _credential_failure(e):
                    raise self._fail(e, "describe instance type offerings") from e
                self._type_zones[key] = None
        return self._type_zones[key]

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering, **kwargs) -> AWSHandle:
        """:meth:`CloudProvider.provision`, first blocking the zones of the region that do not sell the
        instance type at all (``DescribeInstanceTypeOfferings``), so the zone walk asks RunInstances
        only where capacity is possible and a final error names the capacity failures."""
        offered = self.zones_offering(offering.region, offering.instance_type)
        if offered is not None:
            for zone in self.zones(offering.region):
                if zone not in offered:
                    self.blocked_zones.add((offering.instance_type, zone))
        return super().provision(job_id, node_id, rank, offering, **kwargs)

    def create_instance(self, request: InstanceRequest) -> AWSHandle:
        """RunInstances for one node in ``request.zone``; returns its :class:`AWSHandle` (``id``,
        ``region``, ``zone``, ``instance_type``, ``spot``, ``sg``, ``ip`` when AWS assigned it) as
        soon as AWS accepted it (the base class waits for ``running``).

        Raises:
            CapacityError: no capacity or quota (scope per the module docstring).
            CredentialsError: the credentials are missing or may not launch instances.
            ProviderError: any other refusal, with AWS's code and message.
        """
        offering, zone = request.offering, request.zone
        region, itype = offering.region, offering.instance_type
        offered = self.zones_offering(region, itype)
        if offered is not None and zone not in offered:
            raise CapacityError(f"aws: {itype} is not offered in {zone}", provider=self.name, scope="zone",
                                region=region, zone=zone, instance_type=itype, code="Unsupported")
        user_data = request.bootstrap or ""
        if len(user_data.encode()) > MAX_USER_DATA_BYTES:
            raise ProviderError(f"aws: the bootstrap script is {len(user_data.encode())} bytes; EC2 user data "
                                f"holds at most {MAX_USER_DATA_BYTES}", hint="move large files to the job's storage")
        image = request.image or self.default_image(region)
        sg = self.security_group(request.job_id, region)
        tags = [{"Key": k, "Value": v} for k, v in request.labels.items()]
        tags.append({"Key": "Name", "Value": f"sftctl-{label_value(request.job_id)}-{label_value(request.node_id)}"})
        kwargs = dict(
            ImageId=image, InstanceType=itype, MinCount=1, MaxCount=1,
            Placement={"AvailabilityZone": zone}, SecurityGroupIds=[sg],
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags},
                               {"ResourceType": "volume", "Tags": tags}],
            MetadataOptions={"HttpTokens": "required", "HttpEndpoint": "enabled"},
            InstanceInitiatedShutdownBehavior="terminate",
            ClientToken=uuid.uuid4().hex,  # one per call, kept across the throttling retries
        )
        if user_data:
            kwargs["UserData"] = user_data  # boto3 base64-encodes it
        if self.key_name:
            kwargs["KeyName"] = self.key_name
        if self.instance_profile:
            kwargs["IamInstanceProfile"] = {"Name": self.instance_profile}
        if request.spot:
            kwargs["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        try:
            resp = self._call("ec2", region, "run_instances", **kwargs)
        except Exception as e:
            raise self._run_error(e, request) from e
        instance_id = resp["Instances"][0]["InstanceId"]
        with self._lock:
            self._created[instance_id] = time.monotonic()
        ip = resp["Instances"][0].get("PrivateIpAddress")  # assigned at launch: no extra call
        return AWSHandle(job_id=request.job_id, node_id=request.node_id, rank=request.rank, id=instance_id,
                         region=region, zone=zone, instance_type=itype, spot=bool(request.spot), sg=sg, ip=ip)

    def _run_error(self, e: Exception, request: InstanceRequest) -> ProviderError:
        """A RunInstances failure as CapacityError / CredentialsError / ProviderError."""
        code, message = _error_code(e), _error_message(e)
        region, zone, itype = request.offering.region, request.zone, request.offering.instance_type
        market = "spot" if request.spot else "on-demand"

        def capacity(scope: str, what: str, hint: str | None = None) -> CapacityError:
            return CapacityError(f"aws: {what} ({code}: {message})", provider=self.name, scope=scope,
                                 region=region, zone=zone, instance_type=itype, code=code, hint=hint)

        if code in ("InsufficientInstanceCapacity", "InsufficientCapacity", "UnfulfillableCapacity"):
            low = message.lower()
            regional = "availability zone" not in low and (zone or "") not in message and "region" in low
            return capacity("offering" if regional else "zone",
                            f"no {market} {itype} capacity in {region if regional else zone}")
        if code == "Unsupported":
            return capacity("zone", f"{itype} ({market}) is not supported in {zone}")
        if code == "SpotMaxPriceTooLow":
            return capacity("offering", f"the spot price of {itype} in {region} is above the maximum price",
                            hint="use on-demand capacity, or another offering")
        if code in ("MaxSpotInstanceCountExceeded", "VcpuLimitExceeded", "InstanceLimitExceeded"):
            quota = quota_for(itype, request.spot)
            where = (f"the '{quota[0]}' quota (code {quota[1]})" if quota else f"the {market} vCPU quota of {itype}")
            return capacity("region", f"{market} {itype} in {region} would exceed {where}",
                            hint=f"request an increase: aws service-quotas request-service-quota-increase "
                                 f"--service-code ec2 --quota-code {quota[1] if quota else 'CODE'} "
                                 f"--region {region} --desired-value VCPUS")
        return self._fail(e, f"launch {itype} in {zone}")

    def default_image(self, region: str) -> str:
        """The default AMI of ``region``: the SSM parameter's value, else the newest image matching
        ``ami_name_pattern`` owned by ``ami_owners`` (cached per region).

        Raises:
            ProviderError: neither gives an image (set ``image:`` in the job spec).
        """
        with self._key_lock(("image", region)):
            if region in self._images:
                return self._images[region]
            image = None
            try:
                image = self._call("ssm", region, "get_parameter", Name=self.ami_parameter)["Parameter"]["Value"]
            except Exception as e:
                if _credential_failure(e) and _error_code(e) not in ("AccessDenied", "AccessDeniedException"):
                    raise self._fail(e, "read the default image parameter") from e
                log.debug("aws: SSM parameter %s unreadable in %s: %s", self.ami_parameter, region, e)
            if not image:
                try:
                    images = self._call("ec2", region, "describe_images", Owners=list(self.ami_owners), Filters=[
                        {"Name": "name", "Values": [self.ami_name_pattern]},
                        {"Name": "state", "Values": ["available"]}])["Images"]
                except Exception as e:
                    raise self._fail(e, f"find the default image in {region}") from e
                if images:
                    image = max(images, key=lambda i: i.get("CreationDate", ""))["ImageId"]
            if not image:
                raise ProviderError(f"aws: no default image in {region}: neither SSM parameter {self.ami_parameter} "
                                    f"nor an image named {self.ami_name_pattern!r} was found",
                                    hint="set image: ami-... in the job spec")
            self._images[region] = image
            return image

    def security_group(self, job_id: str, region: str) -> str:
        """The id of the job's security group in ``region``, created on first use.

        Idempotent across threads (a lock per job and region) and processes (``InvalidGroup.Duplicate``
        means another process created it: it is looked up). Inbound: all protocols from the group
        itself only. Outbound: EC2's default (everything), which nodes need for storage and packages.
        """
        job = label_value(job_id)
        key = (region, job)
        with self._key_lock(("sg", region, job)):
            if key in self._groups:
                return self._groups[key]
            name = f"sftctl-{job}"
            try:
                found = self._find_groups(region, job, name)
                if found:
                    group_id = found[0]
                else:
                    tags = [{"Key": MANAGED_LABEL, "Value": "true"}, {"Key": JOB_LABEL, "Value": job},
                            {"Key": "Name", "Value": name}]
                    try:
                        group_id = self._call("ec2", region, "create_security_group", GroupName=name,
                                              Description=f"sftctl job {job}: nodes reach each other only",
                                              TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}]
                                              )["GroupId"]
                    except Exception as e:
                        if _error_code(e) != "InvalidGroup.Duplicate":
                            raise
                        found = self._find_groups(region, job, name)
                        if not found:
                            raise
                        group_id = found[0]
                try:
                    self._call("ec2", region, "authorize_security_group_ingress", GroupId=group_id, IpPermissions=[
                        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id,
                                                                    "Description": "nodes of the same job"}]}])
                except Exception as e:
                    if _error_code(e) != "InvalidPermission.Duplicate":
                        raise
            except Exception as e:
                raise self._fail(e, f"create security group {name} in {region}") from e
            self._groups[key] = group_id
            return group_id

    def _find_groups(self, region: str, job: str, name: str | None = None) -> list[str]:
        filters = [{"Name": f"tag:{JOB_LABEL}", "Values": [job]}, {"Name": f"tag:{MANAGED_LABEL}", "Values": ["true"]}]
        if name:
            filters.append({"Name": "group-name", "Values": [name]})
        groups = self._call("ec2", region, "describe_security_groups", Filters=filters)["SecurityGroups"]
        return [g["GroupId"] for g in groups]

    def private_ip(self, handle: AWSHandle) -> str | None:
        """The instance's private IPv4 address (from RunInstances, else DescribeInstances)."""
        if handle.ip:
            return handle.ip
        try:
            out = self._call("ec2", handle.region, "describe_instances", InstanceIds=[handle.id])
        except Exception as e:  # noqa: BLE001 an address we cannot read is not worth a failed node: None
            log.debug("aws: no private address for %s: %s", handle.id, e)
            return None
        for res in out.get("Reservations", []):
            for inst in res.get("Instances", []):
                return inst.get("PrivateIpAddress")
        return None

    def describe(self, handle: AWSHandle) -> InstanceState:
        """The instance's state: pending -> PENDING, running -> RUNNING, shutting-down / stopping /
        stopped -> STOPPING, terminated or not found -> GONE (not found within
        ``EVENTUAL_CONSISTENCY_S`` of its creation by this object -> PENDING).

        Calls are coalesced per region (see :meth:`_state_of`): 64 nodes waiting to boot cost about
        one DescribeInstances per ``poll_s`` instead of 64. EC2 throttles Describe* calls per
        account and region with a token bucket (EC2 User Guide, "Request throttling"), which 64
        nodes polled one by one every 2 s would drain.
        """
        instance_id, region = handle.id, handle.region
        seen = self._state_of(region, instance_id)
        with self._lock:  # the next poll is due poll_s after the answer, however long it took
            self._watch.setdefault(region, {})[instance_id] = time.monotonic()
        if seen is None:
            created = self._created.get(instance_id)
            if created is not None and time.monotonic() - created < EVENTUAL_CONSISTENCY_S:
                return InstanceState.PENDING
            return InstanceState.GONE
        return _STATES.get(seen, InstanceState.PENDING)

    def _state_of(self, region: str, instance_id: str) -> str | None:
        """EC2's state name of ``instance_id`` (None: not found), coalescing concurrent askers.

        An answer asked for at most ``poll_s / 2`` before this call is reused; a DescribeInstances
        already in flight for this id is waited for; else this thread fetches the id together with
        every instance of the region asked about within the last ``1.5 poll_s`` that no fetch in
        flight covers. Fetches for different ids run in parallel.
        """
        from concurrent.futures import Future

        now = time.monotonic()
        keep_s = 1.5 * self.poll_s + 0.05  # a waiter asks every poll_s
        with self._lock:
            watch = self._watch.setdefault(region, {})
            watch[instance_id] = now
            seen = self._seen.get(instance_id)
            if seen is not None and seen[1] >= now - self.poll_s / 2:
                return seen[0]
            inflight = self._inflight.setdefault(region, {})
            future = inflight.get(instance_id)
            owner = future is None
            if owner:
                for stale in [i for i, t in watch.items() if now - t > keep_s]:
                    del watch[stale]
                    self._seen.pop(stale, None)
                ids = sorted(i for i in watch if i not in inflight)
                future = Future()
                for i in ids:
                    inflight[i] = future
        if not owner:
            return future.result().get(instance_id)
        asked = time.monotonic()  # the answer is at least this fresh
        try:
            states: dict[str, str] = {}
            for start in range(0, len(ids), 1000):
                states.update(self._instance_states(region, ids[start:start + 1000]))
        except BaseException as e:
            with self._lock:
                for i in ids:
                    inflight.pop(i, None)
            future.set_exception(e)
            raise
        with self._lock:
            for i in ids:
                self._seen[i] = (states.get(i), asked)
                inflight.pop(i, None)
        future.set_result(states)
        return states.get(instance_id)

    def _instance_states(self, region: str, ids: list[str]) -> dict[str, str]:
        """EC2 state names of ``ids`` (at most 1000) that exist. One DescribeInstances by id; when
        EC2 says some id does not exist (the whole call then fails), the ids are asked one by one."""
        try:
            try:
                resp = self._call("ec2", region, "describe_instances", InstanceIds=ids)
            except Exception as e:
                if _error_code(e) != "InvalidInstanceID.NotFound":
                    raise
                if len(ids) == 1:
                    return {}
                out: dict[str, str] = {}
                for instance_id in ids:
                    out.update(self._instance_states(region, [instance_id]))
                return out
        except Exception as e:
            raise self._fail(e, f"describe {len(ids)} instances in {region}") from e
        return {i["InstanceId"]: i["State"]["Name"] for r in resp["Reservations"] for i in r["Instances"]}

    def _forget(self, instance_ids) -> None:
        """Drop cached states (after asking to terminate), so the next describe asks EC2."""
        with self._lock:
            for instance_id in instance_ids:
                self._seen.pop(instance_id, None)

    def delete_instance(self, handle: AWSHandle) -> None:
        """TerminateInstances; an instance that does not exist (any more) is not an error."""
        self._forget([handle.id])
        try:
            self._call("ec2", handle.region, "terminate_instances", InstanceIds=[handle.id])
        except Exception as e:
            if _error_code(e) != "InvalidInstanceID.NotFound":
                raise self._fail(e, f"terminate instance {handle.id}") from e

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """Instances tagged ``sftctl-managed=true`` (and ``sftctl-job=<job>``) in ``self.regions``,
        not terminated, each ``{id, region, zone, instance_type, job_id, node_id, state, spot}`` (the
        job and node ids are the tag values, i.e. :func:`label_value` of the real ids)."""
        filters = [{"Name": f"tag:{MANAGED_LABEL}", "Values": ["true"]},
                   {"Name": "instance-state-name", "Values": _LIVE_STATES}]
        if job_id is not None:
            filters.append({"Name": f"tag:{JOB_LABEL}", "Values": [label_value(job_id)]})
        out = []
        for region in self.regions:
            try:
                pages = self._pages("ec2", region, "describe_instances", Filters=filters)
                instances = [i for page in pages for r in page["Reservations"] for i in r["Instances"]]
            except Exception as e:
                raise self._fail(e, f"list instances in {region}") from e
            for i in instances:
                tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
                out.append({"id": i["InstanceId"], "region": region,
                            "zone": i.get("Placement", {}).get("AvailabilityZone"),
                            "instance_type": i["InstanceType"], "job_id": tags.get(JOB_LABEL),
                            "node_id": tags.get(NODE_LABEL), "state": i["State"]["Name"],
                            "spot": i.get("InstanceLifecycle") == "spot"})
        return out

    @classmethod
    def for_job(cls, spec, channel, secrets) -> "AWSProvider":
        """The job's provider (:class:`~sftctl.providers.base.BuiltForJob`): the IAM instance
        profile of its nodes (``resources.instance_profile``, else ``$SFTCTL_AWS_INSTANCE_PROFILE``)
        and, with job storage, its channel and the secret values it stores in Secrets Manager."""
        profile = spec.resources.instance_profile or settings.get("SFTCTL_AWS_INSTANCE_PROFILE")
        options = {"instance_profile": profile} if profile else {}
        ch = channel()
        if ch is None:
            return cls(**options)
        return cls(channel=ch, secrets=secrets(), **options)

    @classmethod
    def secrets_ref_for(cls, job_id: str) -> str:
        """Where :meth:`secrets_ref` stores ``job_id``'s secret values (the Secrets Manager
        secret in ``SFTCTL_AWS_SECRETS_REGION``), stored nowhere: what ``run --dry-run`` shows."""
        return store.aws_ref(settings.get("SFTCTL_AWS_SECRETS_REGION"), job_id)

    def secrets_ref(self, job_id: str) -> str:
        """Store the job's secret values in Secrets Manager (once per job; a restarted
        controller overwrites them) and return the reference its nodes' bootstrap carries.

        Raises:
            ProviderError: Secrets Manager refused (the message names the secret and the error code).
        """
        if not self.secrets:
            return ""
        with self._lock:
            if job_id in self._secret_refs:
                return self._secret_refs[job_id]
        region = settings.get("SFTCTL_AWS_SECRETS_REGION")
        try:
            store.put_aws(self.client("secretsmanager", region), job_id, self.secrets,
                          {MANAGED_LABEL: "true", JOB_LABEL: label_value(job_id)})
        except store.SecretStoreError as e:
            raise ProviderError(str(e), hint="the credentials need secretsmanager:CreateSecret, PutSecretValue "
                                             "and DeleteSecret on secret:sftctl/*") from e
        with self._lock:
            self._secret_refs[job_id] = ref = store.aws_ref(region, job_id)
        return ref

    def terminate_tagged(self, job_id: str) -> int:
        """Terminate every live instance of ``job_id`` (one call per region), wait (at most
        ``teardown_timeout_s``) until the job's security groups hold no live instance, and delete
        them, and the job's secret in Secrets Manager. Returns how many instances there were;
        security groups and the secret are not counted. A group still in use after the wait is
        left (logged) for the next ``sftctl down``."""
        try:
            store.delete_aws(self.client("secretsmanager", settings.get("SFTCTL_AWS_SECRETS_REGION")), job_id)
        except store.SecretStoreError as e:
            raise ProviderError(str(e), hint="sftctl down JOB deletes it once the credentials allow "
                                             "secretsmanager:DeleteSecret") from e
        with self._lock:
            self._secret_refs.pop(job_id, None)
        found = self.list_instances(job_id)
        by_region: dict[str, list[str]] = {}
        for listed in found:
            by_region.setdefault(listed["region"], []).append(listed["id"])
        for region, ids in by_region.items():
            self._terminate_ids(region, ids)
        terminated = {listed["id"] for listed in found}
        job = label_value(job_id)
        end = time.monotonic() + self.teardown_timeout_s
        for region in self.regions:
            try:
                groups = self._find_groups(region, job)
            except Exception as e:
                raise self._fail(e, f"list the security groups of job {job} in {region}") from e
            for group_id in groups:
                terminated |= self._delete_group(region, group_id, end, terminated)
            with self._lock:
                self._groups.pop((region, job), None)
        return len(terminated)

    def _terminate_ids(self, region: str, ids: list[str]) -> None:
        for start in range(0, len(ids), 1000):  # TerminateInstances takes up to 1000 ids
            chunk = ids[start:start + 1000]
            self._forget(chunk)
            try:
                self._call("ec2", region, "terminate_instances", InstanceIds=chunk)
            except Exception as e:
                if _error_code(e) != "InvalidInstanceID.NotFound":
                    raise self._fail(e, f"terminate {len(chunk)} instances in {region}") from e
                for instance_id in chunk:  # one of them is gone already: the others one by one
                    self.delete_instance(self.listed_handle({"id": instance_id, "region": region}))

    def _delete_group(self, region: str, group_id: str, end: float, terminated: set[str]) -> set[str]:
        """Wait until no live instance uses ``group_id`` (terminating any not yet asked to, e.g. one
        whose RunInstances was in flight when the instances were listed), then delete the group.
        Returns the ids of the instances it terminated."""
        extra: set[str] = set()
        while True:
            try:
                resp = self._call("ec2", region, "describe_instances", Filters=[
                    {"Name": "instance.group-id", "Values": [group_id]},
                    {"Name": "instance-state-name", "Values": _LIVE_STATES}])
                live = {i["InstanceId"]: i["State"]["Name"] for r in resp["Reservations"] for i in r["Instances"]}
                late = [i for i, s in live.items() if s != "shutting-down" and i not in terminated | extra]
                if late:
                    self._terminate_ids(region, late)
                    extra |= set(late)
                if not live:
                    self._call("ec2", region, "delete_security_group", GroupId=group_id)
                    return extra
            except Exception as e:
                code = _error_code(e)
                if code == "InvalidGroup.NotFound":
                    return extra
                if code != "DependencyViolation":
                    raise self._fail(e, f"delete security group {group_id} in {region}") from e
            if time.monotonic() > end:
                log.warning("aws: security group %s in %s still in use after %.0f s; `sftctl down` again "
                            "deletes it", group_id, region, self.teardown_timeout_s)
                return extra
            time.sleep(max(0.05, min(self.poll_s, 5.0)))
