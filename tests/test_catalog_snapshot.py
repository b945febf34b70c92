"""The shipped price snapshot: plan picks the cheapest region at its prices, its age, overrides."""

from __future__ import annotations

import csv
import datetime
import io
import warnings

import pytest

from sftctl import api, catalog
from sftctl.catalog import build
from sftctl.errors import SftctlError, SftctlWarning
from sftctl.planner import plan
from test_planner import ALL_USABLE, fixed_predictor, spec


def _snapshot_rows(itype: str) -> list[dict]:
    with catalog.SNAPSHOT.open(newline="") as f:
        return [r for r in csv.DictReader(f) if r["instance_type"] == itype]


def test_snapshot_covers_regions_with_sources_and_dates():
    rows = list(csv.DictReader(catalog.SNAPSHOT.open(newline="")))
    for cloud in ("aws", "gcp"):
        assert len({r["region"] for r in rows if r["provider"] == cloud}) >= 20, cloud
    assert all(r["source"].startswith(("SkyPilot catalog skypilot-org/skypilot-catalog@",
                                       "SkyPilot-format catalog anycloud-sh/catalog@")) for r in rows)
    assert all(catalog._parse_date(r["as_of"]) for r in rows)
    # every GPU family the compiler knows, in the sizes the clouds sell it (with offerings.csv's
    # hand-sourced rows: AWS's single-H100 p5.4xlarge and B200 p6-b200 are not in the SkyPilot copy)
    families = {(o.provider, o.accelerator, o.count > 1) for o in catalog.cloud_offerings()}
    sizes = {"aws": {"H100": "18", "L4": "18", "A10G": "18", "V100": "18", "T4": "1", "H200": "8",
                     "A100-40GB": "8", "A100-80GB": "8", "B200": "8"},
             # GCP's B200 (a4-highgpu-8g) is left out: its host is priced 0 in the source (no A4 SKUs)
             "gcp": {"H100": "18", "A100-40GB": "18", "A100-80GB": "18", "L4": "18", "T4": "18", "V100": "18",
                     "H200": "8"}}
    for cloud, names in sizes.items():
        for name, kinds in names.items():
            want = {(cloud, name, False)} if "1" in kinds else set()
            want |= {(cloud, name, True)} if "8" in kinds else set()
            assert want <= families, (cloud, name)
    hosts = {r["instance_type"] for r in rows}
    assert {"p3.2xlarge", "p3.16xlarge", "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5en.48xlarge",
            "g5.2xlarge", "g6.48xlarge", "a2-highgpu-1g", "a2-ultragpu-8g", "a3-highgpu-8g", "a3-megagpu-8g",
            "a3-edgegpu-8g", "a3-ultragpu-8g", "g2-standard-96"} <= hosts
    assert all(float(r["usd_per_hour"]) > 0 for r in rows) and "a4-highgpu-8g" not in hosts
    assert all(not r["spot_usd_per_hour"] or float(r["spot_usd_per_hour"]) < float(r["usd_per_hour"])
               for r in rows)


def test_shipped_snapshot_is_what_build_makes_of_its_inputs(tmp_path):
    out = tmp_path / "snapshot.csv"
    assert build.main(["--shipped", "--out", str(out)]) == 0
    assert out.read_text() == catalog.SNAPSHOT.read_text()


def _gcp(rows: str) -> list[dict]:
    head = "InstanceType,vCPUs,MemoryGiB,AcceleratorName,AcceleratorCount,GpuInfo,Region,AvailabilityZone,Price,SpotPrice\n"
    return list(csv.DictReader(io.StringIO(head + rows)))


def test_gcp_prices_are_host_plus_gpus_in_the_same_zone():
    rows = _gcp("a3-highgpu-8g,208.0,1872.0,,,,us-central1,us-central1-a,9.46,3.86\n"
                "a3-highgpu-8g,208.0,1872.0,,,,us-central1,us-central1-b,9.46,2.00\n"
                ",,,H100,8,,us-central1,us-central1-a,78.8,20.0\n"
                ",,,H100,8,,us-central1,us-central1-b,78.8,\n"   # no spot GPU in b: no spot there
                "a3-highgpu-8g,208.0,1872.0,,,,europe-west4,europe-west4-b,9.93,1.79\n"  # no GPU row: not sold
                "n1-standard-4,4.0,15.0,,,,us-east1,us-east1-c,0.19,0.04\n"
                ",,,T4,1,,us-east1,us-east1-c,0.35,0.14\n"
                ",,,T4,2,,us-east1,us-east1-c,0.70,0.28\n")  # no n1-standard-8 host row: no T4 x2
    out = build.build_gcp(rows, {"H100", "T4"}, "test source", "2026-05-20", build.bandwidth_table())
    got = {(r["instance_type"], r["region"]): r for r in out}
    assert set(got) == {("a3-highgpu-8g", "us-central1"), ("n1-standard-4+T4", "us-east1")}
    a3 = got[("a3-highgpu-8g", "us-central1")]
    assert (float(a3["usd_per_hour"]), float(a3["spot_usd_per_hour"]), a3["zone"]) == (88.26, 23.86, "us-central1-a")
    assert (a3["accelerator"], a3["count"], a3["as_of"]) == ("H100", "8", "2026-05-20")
    assert a3["source"].startswith("test source")
    t4 = got[("n1-standard-4+T4", "us-east1")]
    assert (float(t4["usd_per_hour"]), float(t4["spot_usd_per_hour"]), t4["count"]) == (0.54, 0.18, "1")


def test_gcp_rows_priced_zero_or_with_another_skus_price_are_left_out():
    """A host priced 0 (GCP's A4: no SKUs in the source) would make its B200s the cheapest; a GPU
    row at less than half the dearest region's price (SkyPilot's fetch_gcp matched another SKU:
    H100 4.20076 per GPU in us-central1, where a3-highgpu-8g lists at 88.49) or not above its own
    spot price is another SKU's price. Both are left out."""
    rows = _gcp("a4-highgpu-8g,224.0,3968.0,,,,us-central1,us-central1-b,0.0,0.0\n"
                ",,,B200,8,,us-central1,us-central1-b,90.216,34.2368\n"
                "a3-highgpu-8g,208.0,1872.0,,,,us-central1,us-central1-a,9.46006,3.86318\n"
                ",,,H100,8,,us-central1,us-central1-a,33.60609,32.0104\n"
                "a3-highgpu-8g,208.0,1872.0,,,,us-east4,us-east4-a,9.46006,3.0\n"
                ",,,H100,8,,us-east4,us-east4-a,78.37241,23.9136\n"
                "a3-highgpu-8g,208.0,1872.0,,,,europe-west4,europe-west4-b,9.93306,1.7888\n"
                ",,,H100,8,,europe-west4,europe-west4-b,101.88413,29.724\n"
                "a3-ultragpu-8g,224.0,2952.0,,,,us-central1,us-central1-b,12.266,5.0093\n"
                ",,,H200,8,,us-central1,us-central1-b,74.49392,80.0\n")  # spot above on-demand
    out = build.build_gcp(rows, {"H100", "H200", "B200"}, "test source", "2026-05-20", build.bandwidth_table())
    got = {(r["instance_type"], r["region"]): float(r["usd_per_hour"]) for r in out}
    assert got == {("a3-highgpu-8g", "us-east4"): 87.83247, ("a3-highgpu-8g", "europe-west4"): 111.81719}
    # the shipped snapshot: GCP's H100 x8 starts at us-east4's 87.83 (was us-central1's 43.07)
    h100 = [r for r in _snapshot_rows("a3-highgpu-8g")]
    assert min(float(r["usd_per_hour"]) for r in h100) == 87.83247
    assert {"us-central1", "us-west1", "asia-southeast1"}.isdisjoint(r["region"] for r in h100)


def test_a_newer_hand_sourced_price_beats_an_older_snapshot_figure():
    """offerings.csv's p5.48xlarge us-east-1 price is after AWS's June 2025 cut (2025-06); the
    snapshot's SkyPilot figure predates it (2025-05): the newer one stays."""
    p5 = next(o for o in catalog.cloud_offerings() if (o.instance_type, o.region) == ("p5.48xlarge", "us-east-1"))
    assert (p5.usd_per_hour, p5.as_of) == (55.04, "2025-06")
    snap = next(r for r in _snapshot_rows("p5.48xlarge") if r["region"] == "us-east-1")
    assert float(snap["usd_per_hour"]) == 98.32
    # where the snapshot is newer (g5.xlarge's hand row is from 2024) the snapshot's row wins
    p5_tokyo = next(o for o in catalog.cloud_offerings() if (o.instance_type, o.region) == ("p5.48xlarge", "ap-northeast-1"))
    assert p5_tokyo.source.startswith("SkyPilot catalog") and p5_tokyo.zone == "apne1-az4"


def test_plan_picks_the_cheapest_spot_region_of_the_snapshot(tmp_path):
    rows = [r for r in _snapshot_rows("g6.48xlarge") if r["spot_usd_per_hour"]]
    cheapest = min(rows, key=lambda r: float(r["spot_usd_per_hour"]))
    p = plan(spec(tmp_path, "{accelerators: [L4:8], clouds: [aws], spot: true}"), ALL_USABLE,
             fixed_predictor({"L4": 1.0}))
    assert (p.offering.instance_type, p.offering.region) == ("g6.48xlarge", cheapest["region"])
    assert p.chosen.usd_per_hour == float(cheapest["spot_usd_per_hour"])
    assert p.offering.zone == cheapest["zone"]  # the zone the spot price is from
    # the pick is not the hand-typed catalog's region: the snapshot moved it
    assert cheapest["region"] not in ("us-east-1", "us-west-2")


def test_catalog_age_is_one_line_in_plan_and_catalog_not_a_job_warning(tmp_path, monkeypatch):
    """Older than 7 days: `catalog` and `plan` say so once, on their catalog line, with the fix;
    api.plan/api.catalog raise no SftctlWarning for it (it would sit in every job's warnings)."""
    from typer.testing import CliRunner

    from sftctl.cli import app

    as_of = datetime.date.fromisoformat(catalog.catalog_age()["as_of"])
    assert catalog.catalog_age(as_of + datetime.timedelta(days=7))["stale"] is False
    old = catalog.catalog_age(as_of + datetime.timedelta(days=8))
    assert old["stale"] is True and old["age_days"] == 8
    real = catalog.catalog_age
    job = tmp_path / "j.yaml"
    job.write_text("name: j\nrun: echo hi\n")
    for days, stale in ((30, True), (0, False)):
        monkeypatch.setattr(catalog, "catalog_age", lambda days=days: real(as_of + datetime.timedelta(days=days)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", SftctlWarning)
            api.catalog("L4")
            api.plan(str(job))
        for args in (["catalog", "-a", "L4"], ["plan", str(job)], ["run", "--dry-run", str(job)]):
            out = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
            assert out.exit_code == 0, out.output
            lines = [ln for ln in out.output.splitlines() if ln.startswith("catalog: prices as of")]
            assert len(lines) == 1, out.output
            assert f"({days} days old" in lines[0]
            assert ("older than 7 days" in lines[0] and "`sftctl catalog refresh`" in lines[0]) is stale, lines[0]
            assert "warning:" not in out.output


def test_override_price_wins_and_is_named(tmp_path, monkeypatch):
    prices = tmp_path / "prices.csv"
    prices.write_text("provider,instance_type,region,usd_per_hour,spot_usd_per_hour,note\n"
                      "aws,g6.48xlarge,eu-north-1,4.5,,lab contract 2026\n")
    monkeypatch.setenv("SFTCTL_CATALOG_OVERRIDES", str(prices))
    p = plan(spec(tmp_path, "{accelerators: [L4:8], clouds: [aws]}"), ALL_USABLE, fixed_predictor({"L4": 1.0}))
    assert (p.offering.region, p.chosen.usd_per_hour) == ("eu-north-1", 4.5)
    assert p.offering.source == f"override {prices}:2 (lab contract 2026)"
    assert p.offering.spot_usd_per_hour == float(  # an empty spot column keeps the catalog's spot price
        next(r for r in _snapshot_rows("g6.48xlarge") if r["region"] == "eu-north-1")["spot_usd_per_hour"])
    assert catalog.catalog_age()["overrides"] == str(prices)
    # `sftctl plan` names the file and line of the price it used, and the file on its catalog line
    from typer.testing import CliRunner

    from sftctl.cli import app

    job = tmp_path / "l4.yaml"
    job.write_text("name: j\nresources: {accelerators: [L4:8], clouds: [aws]}\nrun: echo hi\n")
    out = CliRunner().invoke(app, ["plan", str(job)], env={"COLUMNS": "400", "AWS_ACCESS_KEY_ID": "testing",
                                                           "AWS_SECRET_ACCESS_KEY": "testing"})
    assert out.exit_code == 0, out.output
    assert f"price: negotiated, override {prices}:2 (lab contract 2026)" in out.output
    assert "at $4.50/h" in out.output and out.output.rstrip().endswith(f"overrides from {prices}")
    monkeypatch.delenv("SFTCTL_CATALOG_OVERRIDES")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "none"))
    p = plan(spec(tmp_path, "{accelerators: [L4:8], clouds: [aws]}"), ALL_USABLE, fixed_predictor({"L4": 1.0}))
    assert p.chosen.usd_per_hour == 13.3504  # without it: the list price (us-east-1/2, us-west-2)


@pytest.mark.parametrize("line, message", [
    ("aws,g6.48xlarge,eu-north-1,cheap,,", ":2: usd_per_hour 'cheap' is not a price"),
    ("aws,g6.48xlarge,mars-1,4.5,,", ":2: no offering aws g6.48xlarge in region mars-1"),
])
def test_bad_override_names_file_and_line(tmp_path, monkeypatch, line, message):
    prices = tmp_path / "prices.csv"
    prices.write_text(f"provider,instance_type,region,usd_per_hour,spot_usd_per_hour,note\n{line}\n")
    monkeypatch.setenv("SFTCTL_CATALOG_OVERRIDES", str(prices))
    with pytest.raises(SftctlError) as e:
        catalog.cloud_offerings()
    assert e.value.message == f"{prices}{message}"


def test_a_region_whose_zones_do_not_offer_the_type_is_named_with_the_signal(home, tmp_path):
    """A refresh that read eu-west-3 and found no zone offering p5.48xlarge: a job pinned there is
    rejected with that signal (DescribeInstanceTypeOfferings), not as a bare exclusion; a region
    no refresh read says the catalog lists none there. A spot job on an offering without spot
    names where the spot prices come from."""
    from sftctl.errors import InfeasibleError

    row = dict(next(r for r in _snapshot_rows("p5.48xlarge") if r["region"] == "us-east-1"))
    today = datetime.date.today().isoformat()
    row.update(as_of=today, source="AWS APIs: EC2 DescribeInstanceTypes, DescribeInstanceTypeOfferings, "
               "DescribeSpotPriceHistory; Price List", spot_usd_per_hour="", zone="", spot_zones="")
    catalog.write_refreshed([row], {"aws": ["us-east-1", "eu-west-3"]})
    with pytest.raises(InfeasibleError) as e:
        plan(spec(tmp_path, "{accelerators: [H100:8], clouds: [aws], regions: [eu-west-3, mars-1]}"), ALL_USABLE,
             fixed_predictor({"H100": 1.0}))
    why = {c.offering.region: str(c.rejected) for c in e.value.candidates if c.rejected.code.name == "NOT_SOLD"}
    assert "no zone of eu-west-3 offers H100:8" in why["eu-west-3"] and "DescribeInstanceTypeOfferings" in why["eu-west-3"]
    assert "the catalog lists no H100:8 in mars-1" in why["mars-1"]
    with pytest.raises(InfeasibleError) as e:
        plan(spec(tmp_path, "{accelerators: [H100:8], clouds: [aws], regions: [us-east-1], spot: true}"), ALL_USABLE,
             fixed_predictor({"H100": 1.0}))
    (c,) = [c for c in e.value.candidates if (c.offering.instance_type, c.offering.region) == ("p5.48xlarge", "us-east-1")]
    assert f"no zone of us-east-1 reported one (EC2 DescribeSpotPriceHistory per zone, as of {today})" in str(c.rejected)


def test_the_small_one_gpu_sizes_are_in_every_region_that_sells_the_family():
    """Issue 37: outside us-east-1 the only T4:1 was a g4dn.16xlarge (~$4.35-6.70/h) and G5/G6 had
    no xlarge. Every region with a bigger 1-GPU size of the family has its xlarge (4 vCPUs,
    16 GiB), cheaper there, from the same source and date as its neighbours."""
    offers = catalog.cloud_offerings()
    for small, big, gpu, regions in (("g4dn.xlarge", "g4dn.16xlarge", "T4", 20),
                                     ("g5.xlarge", "g5.2xlarge", "A10G", 14),
                                     ("g6.xlarge", "g6.2xlarge", "L4", 12)):
        smalls = {o.region: o for o in offers if o.instance_type == small}
        bigs = {o.region: o for o in offers if o.instance_type == big}
        assert set(smalls) == set(bigs) and len(smalls) == regions, small
        for region, o in smalls.items():
            assert (o.accelerator, o.count, o.vcpus, o.memory_gib) == (gpu, 1, 4, 16.0), (small, region)
            assert o.usd_per_hour < bigs[region].usd_per_hour, (small, region)
            assert o.as_of == "2025-05" and o.source.startswith("SkyPilot catalog skypilot-org/skypilot-catalog@001367d22a00")
    tokyo = next(o for o in offers if (o.instance_type, o.region) == ("g4dn.xlarge", "ap-northeast-1"))
    assert (tokyo.usd_per_hour, tokyo.spot_usd_per_hour, tokyo.zone) == (0.71, 0.2264, "apne1-az4")
