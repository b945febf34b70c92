"""Provisioning 64 AWS nodes vs 1, against moto's server over HTTP (started here).

Each run uses a fresh :class:`~sftctl.providers.aws.AWSProvider` (so the per-job fixed costs: zones,
instance type offerings, the job's security group, are in both) and a fresh job: ``provision_all``
(at most ``MAX_PARALLEL_PROVISION`` RunInstances in flight, ``poll_s`` 0.05) until every node runs,
then ``terminate_tagged`` (one TerminateInstances per region, wait for terminated, delete the
security group). Runs of 1 and 64 nodes alternate, ``REPEATS`` times each; the medians are
compared. Aim: 64 nodes take under 3x the wall time of 1 node.

moto answers in milliseconds where EC2 takes seconds to boot an instance, so this measures
sftctl's own overhead and concurrency (threads, API calls per node), not EC2's boot time. moto
spends ~20-30 ms of CPU per RunInstances in one Python process, so 64 nodes have a floor that
no client can beat on a small machine: the same run also times the bare calls (RunInstances and
DescribeInstances with boto3 from 16 threads, no tags or security group) and reports sftctl at
64 nodes against that floor (``sftctl_vs_bare_64``).

    python benchmarks/provision_scale.py   # prints a table, writes results/provision_scale.json
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "provision_scale.json"
sys.path.insert(0, str(REPO / "tests"))

SIZES = (1, 64)
REPEATS = 3
AIM_RATIO = 3.0


def one_run(nodes: int, image: str) -> dict:
    from sftctl.catalog import cloud_offerings
    from sftctl.providers.aws import AWSProvider
    from sftctl.providers.base import MAX_PARALLEL_PROVISION, provision_all

    offering = next(o for o in cloud_offerings()
                    if o.provider == "aws" and o.instance_type == "p4d.24xlarge" and o.region == "us-east-1")
    job = f"bench-{nodes}-{uuid.uuid4().hex[:8]}"
    provider = AWSProvider(poll_s=0.05, teardown_timeout_s=120)
    t0 = time.perf_counter()
    handles = provision_all(provider, job, [(f"n{i}", i) for i in range(nodes)], offering, image=image)
    t1 = time.perf_counter()
    terminated = provider.terminate_tagged(job)
    t2 = time.perf_counter()
    assert len(handles) == nodes == terminated, (len(handles), terminated)
    assert provider.list_instances(job) == []
    return {"nodes": nodes, "provision_s": t1 - t0, "terminate_s": t2 - t1, "total_s": t2 - t0,
            "max_parallel": MAX_PARALLEL_PROVISION}


def bare_run(nodes: int, image: str) -> dict:
    """The floor: the same RunInstances and DescribeInstances calls made with boto3 directly (16
    threads, no tags, no security group, no retries), then one TerminateInstances."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    ec2 = boto3.client("ec2", region_name="us-east-1",
                       config=Config(retries={"total_max_attempts": 1}, max_pool_connections=32))

    def one(_: int) -> str:
        iid = ec2.run_instances(ImageId=image, InstanceType="p4d.24xlarge", MinCount=1, MaxCount=1,
                                Placement={"AvailabilityZone": "us-east-1a"})["Instances"][0]["InstanceId"]
        while ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"] != "running":
            time.sleep(0.05)
        return iid

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(one, range(nodes)))
    t1 = time.perf_counter()
    ec2.terminate_instances(InstanceIds=ids)
    t2 = time.perf_counter()
    return {"nodes": nodes, "provision_s": t1 - t0, "terminate_s": t2 - t1, "total_s": t2 - t0}


def main() -> dict:
    import boto3

    from servers import aws_env, moto_server

    with moto_server() as url:
        os.environ.update(aws_env(url))
        image = boto3.client("ec2", region_name="us-east-1").describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        one_run(1, image)  # warm-up: moto loads its instance type and AMI data on first use
        bare_run(1, image)
        runs: dict[int, list[dict]] = {n: [] for n in SIZES}
        bare: dict[int, list[dict]] = {n: [] for n in SIZES}
        for _ in range(REPEATS):
            for n in SIZES:
                runs[n].append(one_run(n, image))
                bare[n].append(bare_run(n, image))

    keys = ("provision_s", "terminate_s", "total_s")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in runs.items()}
    bare_med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in bare.items()}
    big, small = max(SIZES), min(SIZES)
    ratio = {k: med[big][k] / med[small][k] for k in ("provision_s", "terminate_s", "total_s")}
    doc = {
        "date": datetime.date.today().isoformat(),
        "cores": os.cpu_count(),
        "backend": "moto server over HTTP (loopback)",
        "repeats": REPEATS,
        "median_s": {str(n): v for n, v in med.items()},
        "ratio_64_vs_1": ratio,
        "bare_boto3_median_s": {str(n): v for n, v in bare_med.items()},
        "bare_ratio_64_vs_1": {k: bare_med[big][k] / bare_med[small][k] for k in keys},
        "sftctl_vs_bare_64": {k: med[big][k] / bare_med[big][k] for k in keys},
        "load_average_1min": os.getloadavg()[0],
        "aim_ratio": AIM_RATIO,
        "runs": {str(n): rs for n, rs in runs.items()},
    }
    print(f"{'nodes':>5}  {'provision s':>11}  {'terminate s':>11}  {'total s':>8}")
    for n in SIZES:
        print(f"{n:>5}  {med[n]['provision_s']:>11.3f}  {med[n]['terminate_s']:>11.3f}  {med[n]['total_s']:>8.3f}")
    for n in SIZES:
        print(f"{n:>5}  {bare_med[n]['provision_s']:>11.3f}  {bare_med[n]['terminate_s']:>11.3f}  "
              f"{bare_med[n]['total_s']:>8.3f}  (bare boto3, same calls, no tags/security group)")
    print(f"bare boto3 ratio {big} vs {small}: provision {doc['bare_ratio_64_vs_1']['provision_s']:.2f}x; "
          f"sftctl vs bare at {big} nodes: provision {doc['sftctl_vs_bare_64']['provision_s']:.2f}x")
    print(f"ratio {big} vs {small}: provision {ratio['provision_s']:.2f}x, terminate {ratio['terminate_s']:.2f}x, "
          f"total {ratio['total_s']:.2f}x (aim < {AIM_RATIO:.0f}x)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
