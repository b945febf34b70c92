"""The shipped price snapshot: plan picks the cheapest region at its prices, its age, overrides."""

from __future__ import annotations

import csv
import datetime
import warnings

import pytest

from sftctl import api, catalog
from sftctl.errors import SftctlError, SftctlWarning
from sftctl.planner import plan
from test_planner import ALL_USABLE, fixed_predictor, spec


def _snapshot_rows(itype: str) -> list[dict]:
    with catalog.SNAPSHOT.open(newline="") as f:
        return [r for r in csv.DictReader(f) if r["instance_type"] == itype]


def test_snapshot_covers_regions_with_sources_and_dates():
    rows = list(csv.DictReader(catalog.SNAPSHOT.open(newline="")))
    assert len({r["region"] for r in rows if r["provider"] == "aws"}) >= 20
    assert all(r["source"].startswith("SkyPilot catalog skypilot-org/skypilot-catalog@") for r in rows)
    assert all(datetime.date.fromisoformat(r["as_of"]) for r in rows)
    assert {int(r["count"]) for r in rows} >= {1, 8}


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


def test_catalog_warns_when_older_than_seven_days(monkeypatch):
    as_of = datetime.date.fromisoformat(catalog.catalog_age()["as_of"])
    assert catalog.catalog_age(as_of + datetime.timedelta(days=7))["stale"] is False
    old = catalog.catalog_age(as_of + datetime.timedelta(days=8))
    assert old["stale"] is True and old["age_days"] == 8
    real = catalog.catalog_age
    monkeypatch.setattr(catalog, "catalog_age", lambda: real(as_of + datetime.timedelta(days=30)))
    with pytest.warns(SftctlWarning, match="30 days old"):
        api.catalog("L4")
    monkeypatch.setattr(catalog, "catalog_age", lambda: real(as_of))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SftctlWarning)
        api.catalog("L4")


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
