"""`sftctl catalog refresh` against moto's server (with seeded spot and on-demand prices, see
tests/aws_prices.py) and the GCE emulator (machine and accelerator types per zone, Cloud Billing
SKUs): every region and zone listed with prices and dates, plan's pick checked against the seeds,
a failed refresh keeping the previous catalog, throttled calls retried, 30 regions in < 60 s."""

from __future__ import annotations

import datetime
import time

import pytest

from aws_faults import fault_proxy
from aws_prices import PriceSeed
from conftest import deadline
from gce_emulator import GCEEmulator
from servers import aws_env
from sftctl import api, catalog
from sftctl.errors import CredentialsError, ProviderError
from sftctl.planner import plan
from test_planner import ALL_USABLE, fixed_predictor, spec

#: AWS regions moto offers p5.48xlarge (H100 x8) in, and the on-demand price seeded for each
AWS_H100 = {"ap-northeast-1": 61.0, "ap-south-1": 57.5, "eu-north-1": 52.25, "eu-west-2": 64.0,
            "us-east-1": 55.04, "us-east-2": 53.75}
#: GCP regions seeded (zones a-c, c down in one): per region (A3 core, A3 RAM GiB, H100 GPU) on demand
GCP_REGIONS = {"us-central1": (0.03, 0.004, 9.0), "us-east4": (0.031, 0.004, 8.7), "europe-west4": (0.033, 0.0045, 9.4),
               "asia-southeast1": (0.035, 0.0047, 8.1), "us-west1": (0.03, 0.004, 9.9), "europe-west1": (0.032, 0.0044, 8.95)}
SPOT_FACTOR = 0.35  # GCP spot SKUs: 35% of on-demand in these seeds
A3 = (208, 1872)  # a3-highgpu-8g: vCPUs, GiB


def _money(usd: float) -> dict:
    units = int(usd)
    return {"currencyCode": "USD", "units": str(units), "nanos": int(round((usd - units) * 1e9))}


def _sku(n: int, description: str, group: str, usage: str, regions: list[str], usd: float, unit: str) -> dict:
    sku_id = f"{n:04X}-{n * 7 % 65536:04X}-{n * 13 % 65536:04X}"
    return {"name": f"services/6F81-5844-456A/skus/{sku_id}", "skuId": sku_id, "description": description,
            "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": "Compute",
                         "resourceGroup": group, "usageType": usage},
            "serviceRegions": regions, "serviceProviderName": "Google",
            "geoTaxonomy": {"type": "REGIONAL", "regions": regions},
            "pricingInfo": [{"effectiveTime": "2026-12-01T00:00:00Z", "currencyConversionRate": 1,
                             "pricingExpression": {"usageUnit": unit, "usageUnitDescription": unit, "baseUnit": "s",
                                                   "baseUnitDescription": "second", "baseUnitConversionFactor": 3600,
                                                   "displayQuantity": 1,
                                                   "tieredRates": [{"startUsageAmount": 0, "unitPrice": _money(usd)}]}}]}


def gcp_skus(regions: dict[str, tuple[float, float, float]]) -> list[dict]:
    """Compute Engine SKUs (A3 cores, RAM, H100 GPUs; N1 and T4 for the N1 pairing), on demand
    and spot, in the Billing Catalog's descriptions."""
    out, n = [], 1
    for region, (core, ram, gpu) in regions.items():
        for usage, factor, prefix, gpu_words in (("OnDemand", 1.0, "", "running in"),
                                                  ("Preemptible", SPOT_FACTOR, "Spot Preemptible ",
                                                   "attached to Spot Preemptible VMs running in")):
            for description, group, usd, unit in (
                    (f"{prefix}A3 Instance Core running in {region}", "CPU", core, "h"),
                    (f"{prefix}A3 Instance Ram running in {region}", "RAM", ram, "GiBy.h"),
                    (f"Nvidia H100 80GB GPU {gpu_words} {region}", "GPU", gpu, "h"),
                    (f"{prefix}N1 Predefined Instance Core running in {region}", "N1Standard", 0.0316, "h"),
                    (f"{prefix}N1 Predefined Instance Ram running in {region}", "N1Standard", 0.0042, "GiBy.h"),
                    (f"Nvidia Tesla T4 GPU {gpu_words} {region}", "GPU", 0.35, "h")):
                out.append(_sku(n, description, group, usage, [region], usd * factor, unit))
                n += 1
    return out


def gcp_h100(region: str, spot: bool = False) -> float:
    core, ram, gpu = GCP_REGIONS[region]
    return (A3[0] * core + A3[1] * ram + 8 * gpu) * (SPOT_FACTOR if spot else 1.0)


@pytest.fixture(scope="module")
def gce_catalog():
    zones = {f"{r}-{z}": "UP" for r in GCP_REGIONS for z in "abc"}
    zones["us-west1-c"] = "DOWN"  # a zone that is down is not listed
    with GCEEmulator(zones=zones) as emu:
        yield emu


@pytest.fixture
def gce(gce_catalog, monkeypatch):
    gce_catalog.reset()
    gce_catalog.skus = gcp_skus(GCP_REGIONS)
    gce_catalog.machine_types_by_zone = {z: {"a3-highgpu-8g", "n1-standard-4", "e2-standard-2"} for z in gce_catalog.zones}
    gce_catalog.accelerator_types_by_zone = {z: {"nvidia-h100-80gb", "nvidia-tesla-t4"} for z in gce_catalog.zones}
    monkeypatch.setenv("SFTCTL_GCE_ENDPOINT", gce_catalog.url)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", gce_catalog.project)
    yield gce_catalog
    gce_catalog.reset()


def _moto_zones(moto_endpoint: str, region: str, itype: str) -> list[str]:
    import boto3

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=moto_endpoint, aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    offers = ec2.describe_instance_type_offerings(LocationType="availability-zone",
                                                  Filters=[{"Name": "instance-type", "Values": [itype]}])
    return sorted(o["Location"] for o in offers["InstanceTypeOfferings"])


@pytest.fixture
def aws_seeded(moto_endpoint, monkeypatch):
    """moto behind the proxy that serves seeded spot (per zone moto offers the type in) and
    on-demand prices; yields (seed, {region: {zone: spot}})."""
    spot, zones_of = {}, {}
    for region, od in AWS_H100.items():
        zones = _moto_zones(moto_endpoint, region, "p5.48xlarge")
        assert zones, region
        zones_of[region] = {z: round(od * (0.25 + 0.05 * i), 4) for i, z in enumerate(zones)}
        spot.update({("p5.48xlarge", z): p for z, p in zones_of[region].items()})
    spot[("p5.48xlarge", "us-east-1z")] = 0.01  # a zone moto does not offer the type in: ignored
    seed = PriceSeed({("p5.48xlarge", r): p for r, p in AWS_H100.items()}, spot)
    with fault_proxy(moto_endpoint) as proxy:
        proxy.intercept = seed
        for key, value in aws_env(proxy.url).items():
            monkeypatch.setenv(key, value)
        yield seed, zones_of


def test_refresh_lists_every_region_and_zone_and_plan_picks_the_cheapest(home, gce, aws_seeded, tmp_path, capsys):
    seed, aws_zones = aws_seeded
    result = api.catalog_refresh()  # every region: the refresh is the whole truth of both clouds
    assert result["clouds"]["aws"]["regions"] == len(AWS_H100) and result["clouds"]["gcp"]["regions"] == len(GCP_REGIONS)
    today = datetime.date.today().isoformat()
    h100 = {(o.provider, o.region): o for o in api.catalog("H100") if o.provider in ("aws", "gcp")}
    assert {r for p, r in h100 if p == "aws"} == set(AWS_H100)
    assert {r for p, r in h100 if p == "gcp"} == set(GCP_REGIONS)
    for region, od in AWS_H100.items():
        o = h100[("aws", region)]
        assert (o.instance_type, o.count, o.usd_per_hour, o.as_of) == ("p5.48xlarge", 8, od, today)
        assert dict(o.spot_zones) == aws_zones[region]  # every zone, its own spot price
        assert (o.zone, o.spot_usd_per_hour) == min(aws_zones[region].items(), key=lambda zp: zp[1])
        assert "DescribeSpotPriceHistory" in o.source and o.bandwidth_source
    for region in GCP_REGIONS:
        o = h100[("gcp", region)]
        assert (o.instance_type, o.usd_per_hour) == ("a3-highgpu-8g", pytest.approx(gcp_h100(region)))
        zones = {z for z in gce.zones if z.startswith(region + "-") and gce.zones[z] == "UP"}
        assert {z for z, _ in o.spot_zones} == zones
        assert all(p == pytest.approx(gcp_h100(region, spot=True)) for _, p in o.spot_zones)
    # the snapshot's and offerings.csv's rows are gone: the refresh is the truth of what is sold
    from sftctl.catalog.accelerators import get_accelerator

    # every AWS and GCE offering is the refresh's; Cloud TPU slices are not in the lists it reads
    assert all(o.as_of == today for o in api.catalog() if o.provider in ("aws", "gcp")
               and get_accelerator(o.accelerator).vendor != "google")

    from sftctl import cli

    assert cli.main(["catalog", "--accelerator", "H100"]) == 0
    out = capsys.readouterr().out
    for region, zones in aws_zones.items():
        for zone, price in zones.items():
            assert any(region in line.split() and zone in line.split() and f"{price:.3f}" in line.split()
                       and today in line.split() for line in out.splitlines()), (region, zone)
    for z in (z for z, s in gce.zones.items() if s == "UP"):
        assert any(z in line.split() and today in line.split() for line in out.splitlines()), z

    # plan picks the cheapest region of the seeds, on demand and spot
    expected = min([("aws", r, p) for r, p in AWS_H100.items()] + [("gcp", r, gcp_h100(r)) for r in GCP_REGIONS],
                   key=lambda x: x[2])
    p = plan(spec(tmp_path, "{accelerators: [H100:8], clouds: [aws, gcp]}"), ALL_USABLE, fixed_predictor({"H100": 1.0}))
    assert (p.offering.provider, p.offering.region) == expected[:2]
    assert p.chosen.usd_per_hour == pytest.approx(expected[2])
    spots = [("aws", r, z, s) for r, zs in aws_zones.items() for z, s in zs.items()] + \
        [("gcp", r, "", gcp_h100(r, spot=True)) for r in GCP_REGIONS]
    cheapest = min(spots, key=lambda x: x[3])
    p = plan(spec(tmp_path, "{accelerators: [H100:8], clouds: [aws, gcp], spot: true}"), ALL_USABLE,
             fixed_predictor({"H100": 1.0}))
    assert (p.offering.provider, p.offering.region) == cheapest[:2]
    assert p.chosen.usd_per_hour == pytest.approx(cheapest[3])
    assert catalog.catalog_age()["as_of"] == today and catalog.catalog_age()["file"] == str(catalog.refreshed_path())


def test_a_failed_or_partial_refresh_keeps_the_previous_catalog_whole(home, gce, aws_seeded):
    seed, _ = aws_seeded
    regions = ["us-east-1", "eu-north-1", "us-central1", "europe-west4"]
    api.catalog_refresh(regions=regions)
    path = catalog.refreshed_path()
    before = path.read_bytes()
    # GCP answers one zone's machine types with a 500: the refresh stops, nothing is written
    gce.error(500, "/zones/europe-west4-b/machineTypes")
    with pytest.raises(ProviderError, match="europe-west4-b"):
        api.catalog_refresh(regions=regions)
    assert path.read_bytes() == before
    gce.reset()
    gce.skus = gcp_skus(GCP_REGIONS)
    # AWS refuses the price list: a credentials error, and again the previous catalog stays
    seed.deny_pricing = True
    with pytest.raises(CredentialsError):
        api.catalog_refresh(["aws"], regions)
    assert path.read_bytes() == before
    seed.deny_pricing = False
    # a cloud whose answers hold no GPU offering at all (here: no SKUs) is a failure too
    gce.skus = []
    with pytest.raises(ProviderError, match="gcp: the refresh found no GPU offerings"):
        api.catalog_refresh(["gcp"], regions)
    assert path.read_bytes() == before


def test_throttled_calls_are_retried(home, gce, aws_seeded):
    seed, _ = aws_seeded
    seed.throttle_pricing = 3
    gce.throttle(3, path_contains="/skus")
    result = api.catalog_refresh(regions=["us-east-1", "us-central1"])
    assert result["clouds"] == {"aws": {"offerings": 1, "regions": 1}, "gcp": {"offerings": 2, "regions": 1}}
    assert seed.throttle_pricing == 0 and sum(c == "pricing.GetProducts" for c in seed.calls) >= 4
    assert sum(r["status"] == 429 for r in gce.requests) == 3
    # a narrower refresh keeps the other regions of the catalog (and the coverage says so)
    api.catalog_refresh(["gcp"], ["us-east4"])
    assert {o.region for o in api.catalog("H100") if o.provider == "gcp" and o.as_of == datetime.date.today().isoformat()} \
        == {"us-central1", "us-east4"}
    assert catalog.refreshed_coverage() == {"aws": ["us-east-1"], "gcp": ["us-central1", "us-east4"]}


def test_refresh_of_30_regions_is_under_a_minute(home, moto_endpoint, monkeypatch, capsys):
    """30 AWS regions (moto's) and 30 GCP regions (the emulator's): calls in parallel."""
    from moto.ec2.models.instance_types import INSTANCE_TYPE_OFFERINGS

    aws_regions = sorted(INSTANCE_TYPE_OFFERINGS["availability-zone"])[:30]
    assert len(aws_regions) == 30
    gcp_regions = {f"region{i:02d}-test1": GCP_REGIONS["us-central1"] for i in range(30)}
    zones = {f"{r}-{z}": "UP" for r in gcp_regions for z in "abc"}
    on_demand, spot = {}, {}
    seeded = ("p5.48xlarge", "p4d.24xlarge", "g6.xlarge", "g5.xlarge", "g4dn.xlarge")
    offered = {r for r in aws_regions for o in INSTANCE_TYPE_OFFERINGS["availability-zone"][r] if o["InstanceType"] in seeded}
    for r in aws_regions:
        for itype in seeded:
            on_demand[(itype, r)] = 10.0
            spot.update({(itype, f"{r}{z}"): 3.0 for z in "abcd"})
    with GCEEmulator(zones=zones) as emu, fault_proxy(moto_endpoint) as proxy:
        emu.skus = gcp_skus(gcp_regions)
        emu.machine_types_by_zone = {z: {"a3-highgpu-8g", "n1-standard-4"} for z in zones}
        emu.accelerator_types_by_zone = {z: {"nvidia-h100-80gb", "nvidia-tesla-t4"} for z in zones}
        proxy.intercept = PriceSeed(on_demand, spot)
        for key, value in aws_env(proxy.url).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("SFTCTL_GCE_ENDPOINT", emu.url)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", emu.project)
        start = time.monotonic()
        result = api.catalog_refresh(regions=aws_regions + list(gcp_regions))
        took = time.monotonic() - start
    with capsys.disabled():
        print(f"\ncatalog refresh of {len(aws_regions)} AWS + {len(gcp_regions)} GCP regions: {took:.1f} s "
              f"({result['clouds']})")
    assert result["clouds"]["gcp"] == {"offerings": 60, "regions": 30}
    assert result["clouds"]["aws"]["regions"] == len(offered) >= 25  # where moto offers a seeded type
    assert took < deadline(60), took  # the quiet-machine budget, scaled by the load (slowdown)
