"""Accelerator offerings: what each provider sells, where, and for how much.

Cloud offerings come from ``offerings.csv`` (one row per instance type and region, with the source
of its price). The local machine's offering is built from the machine itself: ``cpu`` with one
process per node per requested count, priced at $0/h. Prices are USD per hour per node.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path

_CSV = Path(__file__).with_name("offerings.csv")


@dataclasses.dataclass(frozen=True)
class Offering:
    """One way to buy nodes: ``count`` x ``accelerator`` per node of ``instance_type``.

    ``usd_per_hour`` is the on-demand price of one node; ``spot_usd_per_hour`` the spot price or
    None where the catalog has none. ``source`` says where the price comes from.
    """

    provider: str
    instance_type: str
    accelerator: str
    count: int
    region: str
    usd_per_hour: float
    spot_usd_per_hour: float | None = None
    vcpus: int | None = None
    memory_gib: float | None = None
    source: str = ""

    def price(self, spot: bool) -> float | None:
        """USD per hour per node, or None when the offering has no spot price and spot is asked."""
        return self.spot_usd_per_hour if spot else self.usd_per_hour

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cloud_offerings() -> list[Offering]:
    """The cloud offerings from ``offerings.csv``."""
    with _CSV.open(newline="") as f:
        return [
            Offering(
                provider=r["provider"],
                instance_type=r["instance_type"],
                accelerator=r["accelerator"],
                count=int(r["count"]),
                region=r["region"],
                usd_per_hour=float(r["usd_per_hour"]),
                spot_usd_per_hour=float(r["spot_usd_per_hour"]) if r["spot_usd_per_hour"] else None,
                vcpus=int(r["vcpus"]),
                memory_gib=float(r["memory_gib"]),
                source=r["source"],
            )
            for r in csv.DictReader(f)
        ]


def local_offering(count: int) -> Offering:
    """This machine as one offering: ``count`` CPU worker processes per node, free."""
    return Offering(
        provider="local",
        instance_type="localhost",
        accelerator="cpu",
        count=count,
        region="local",
        usd_per_hour=0.0,
        spot_usd_per_hour=0.0,
        vcpus=os.cpu_count(),
        source="this machine",
    )


def accelerator_names() -> list[str]:
    """Every accelerator name the catalog knows (``cpu`` included)."""
    return sorted({o.accelerator for o in cloud_offerings()} | {"cpu"})
