"""TPU slice prices per region, on-demand and spot, from the same SkyPilot-format GCP catalog as
the GPU prices (anycloud-sh/catalog@62ff0a987e0c gcp/vms.csv, its TPU rows copied into
tests/fixtures/catalog/gcp_gpu_excerpt.csv), and the plan's TPU rows priced with them."""

from __future__ import annotations

import csv
from pathlib import Path

from sftctl import catalog
from sftctl.catalog import build
from sftctl.catalog.accelerators import load_accelerators
from sftctl.planner import plan
from test_planner import ALL_USABLE, fixed_predictor, spec

ROOT = Path(__file__).resolve().parents[1]
HEADER = "InstanceType,vCPUs,MemoryGiB,AcceleratorName,AcceleratorCount,GpuInfo,Region,AvailabilityZone,Price,SpotPrice"


def _build(lines: list[str]) -> dict[tuple[str, str], dict]:
    rows = list(csv.DictReader([HEADER, *lines]))
    out = build.build_gcp(rows, set(load_accelerators()), "src", "2026-05-20", build.bandwidth_table())
    return {(r["instance_type"], r["region"]): r for r in out}


def test_tpu_rows_are_slices_priced_per_region_with_spot_and_placeholders_left_out():
    got = _build([
        ",,,tpu-v5litepod-8,1,tpu-v5litepod-8,us-central1,us-central1-a,9.6,2.05738",
        ",,,tpu-v5litepod-8,1,tpu-v5litepod-8,us-east5,us-east5-a,9.6,4.8",
        ",,,tpu-v5p-8,1,tpu-v5p-8,us-central1,us-central1-a,16.8,3.31027",
        ",,,tpu-v6e-8,1,tpu-v6e-8,asia-east1,asia-east1-c,700.0,700.0",            # placeholder: not sold
        ",,,tpu-v6e-8,1,tpu-v6e-8,southamerica-west1,southamerica-west1-a,21.6,700.0",  # no spot there
        ",,,tpu-v4-8,1,tpu-v4-8,us-central2,us-central2-b,12.88,3.86",            # no sftctl accelerator
        ",,,tpu-v6e-1,1,tpu-v6e-1,us-central1,us-central1-a,2.7,0.51442",          # no hand row: no host specs
    ])
    assert set(got) == {("v5litepod-8", "us-central1"), ("v5litepod-8", "us-east5"), ("v5p-8", "us-central1"),
                        ("v6e-8", "southamerica-west1")}
    v5e = got[("v5litepod-8", "us-central1")]
    assert (v5e["accelerator"], v5e["count"], v5e["usd_per_hour"], v5e["spot_usd_per_hour"], v5e["zone"]) == (
        "TPU-v5e", "8", "9.6", "2.05738", "us-central1-a")
    assert (v5e["vcpus"], v5e["memory_gib"]) == ("224", "384")  # offerings.csv's host specs
    assert got[("v5p-8", "us-central1")]["count"] == "4"  # v5p-8 counts TensorCores: 4 chips
    assert got[("v6e-8", "southamerica-west1")]["spot_usd_per_hour"] == ""
    assert build.gcp_tpu_slice("tpu-v5litepod-16") == ("v5litepod-16", "TPU-v5e", 16)
    assert build.gcp_tpu_slice("tpu-v3-8") is None and build.gcp_tpu_slice("a2-highgpu-1g") is None


def test_the_shipped_catalog_prices_tpus_in_every_region_from_the_source():
    with catalog.SNAPSHOT.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["accelerator"].startswith("TPU-")]
    per_chip = {}
    for r in rows:
        assert r["as_of"] == "2026-05-20" and "anycloud-sh/catalog@62ff0a987e0c" in r["source"]
        per_chip.setdefault(r["accelerator"], []).append(float(r["usd_per_hour"]) / int(r["count"]))
        if r["spot_usd_per_hour"]:
            assert float(r["spot_usd_per_hour"]) < float(r["usd_per_hour"]) and r["zone"].startswith(r["region"])
    # the cheapest region's on-demand price per chip-hour: Google's list prices
    assert {a: round(min(v), 4) for a, v in per_chip.items()} == {"TPU-v5e": 1.2, "TPU-v5p": 4.2, "TPU-v6e": 2.7}
    assert len({r["region"] for r in rows if r["instance_type"] == "v5litepod-8"}) == 15
    offered = {(o.instance_type, o.region): o for o in catalog.cloud_offerings() if o.accelerator.startswith("TPU")}
    o = offered[("v6e-8", "us-east4")]  # a region the hand-typed catalog did not have, with spot
    assert (o.usd_per_hour, o.spot_usd_per_hour, o.zone) == (21.6, 3.38768, "us-east4-a")


def test_the_plans_tpu_rows_take_the_catalogs_prices(tmp_path):
    with catalog.SNAPSHOT.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["instance_type"] == "v5litepod-8" and r["spot_usd_per_hour"]]
    cheapest = min(rows, key=lambda r: float(r["spot_usd_per_hour"]))
    p = plan(spec(tmp_path, "{accelerators: ['TPU-v5e:8'], clouds: [gcp], spot: true}"), ALL_USABLE,
             fixed_predictor({"TPU-v5e": 1.0}))
    assert (p.offering.instance_type, p.offering.region, p.offering.zone) == (
        "v5litepod-8", cheapest["region"], cheapest["zone"])
    assert p.chosen.usd_per_hour == float(cheapest["spot_usd_per_hour"]) == 2.05738
    p = plan(spec(tmp_path, "{accelerators: ['TPU-v6e:8'], clouds: [gcp]}"), ALL_USABLE,
             fixed_predictor({"TPU-v6e": 1.0}))
    assert p.offering.instance_type == "v6e-8" and p.chosen.usd_per_hour == 21.6
