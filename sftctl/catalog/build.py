"""Build the shipped price snapshot (``snapshot.csv``) from SkyPilot's public catalog CSVs.

    python -m sftctl.catalog.build --aws vms.csv --commit SHA --date YYYY-MM-DD [--out snapshot.csv]

Input: ``catalogs/v7/aws/vms.csv`` of ``skypilot-org/skypilot-catalog`` (or an excerpt of it with the
same header), which SkyPilot rebuilds from the AWS APIs: one row per instance type and availability
zone, columns ``InstanceType, AcceleratorName, AcceleratorCount, vCPUs, MemoryGiB, GpuInfo, Price,
SpotPrice, Region, AvailabilityZone`` (USD per hour per instance; SpotPrice empty where AWS reported
none). Only the figures are taken.

Output: one row per (instance type, region) whose accelerator sftctl knows, in ``offerings.csv``'s
columns plus ``zone``: ``usd_per_hour`` is the region's on-demand price (the same in every zone),
``spot_usd_per_hour`` the cheapest zone's spot price and ``zone`` that zone (empty when no zone has
spot). ``as_of`` is ``--date`` (when the file was read), ``source`` names the file and commit.
Bandwidths are copied from ``offerings.csv``'s hand-sourced row of the same instance type (the same
hardware in every region), else from :data:`NETWORK` (AWS's published figures), else left empty.

GCP's vms.csv prices the host and its GPUs in separate rows; joining them is not built yet.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from sftctl.catalog import COLUMNS, _CSV, SNAPSHOT

#: SkyPilot's accelerator names that differ from sftctl's (AWS p4d's A100 is the 40 GB part).
SKYPILOT_NAMES = {"A100": "A100-40GB"}

_PCIE4 = "GPUs on PCIe 4.0 x16 (~25 GB/s, no NVLink)"
#: Bandwidths (bytes/s) of instance types that ``offerings.csv`` has no hand-sourced row for:
#: network performance from the AWS EC2 accelerated computing instance specifications (G4dn, G5,
#: G6 tables; Gbps / 8), the GPUs' link as for the hand-typed G5/G6 rows.
NETWORK = {
    "g4dn.16xlarge": ("", "6.25e9", "One GPU per node; 50 Gbps network (AWS EC2 accelerated computing instance specifications, G4dn)"),
    "g5.2xlarge": ("", "1.25e9", "One GPU per node; up to 10 Gbps network (AWS EC2 accelerated computing instance specifications, G5)"),
    "g5.24xlarge": ("2.5e10", "6.25e9", f"4 {_PCIE4}; 50 Gbps network (AWS EC2 accelerated computing instance specifications, G5)"),
    "g6.2xlarge": ("", "1.25e9", "One GPU per node; up to 10 Gbps network (AWS EC2 accelerated computing instance specifications, G6)"),
    "g6.24xlarge": ("2.5e10", "6.25e9", f"4 {_PCIE4}; 50 Gbps network (AWS EC2 accelerated computing instance specifications, G6)"),
    "g6.48xlarge": ("2.5e10", "1.25e10", f"8 {_PCIE4}; 100 Gbps network (AWS EC2 accelerated computing instance specifications, G6)"),
}


def build_aws(rows: list[dict[str, str]], known: set[str], commit: str, date: str,
              bandwidths: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """Snapshot rows (``COLUMNS``) from SkyPilot AWS ``vms.csv`` rows; rows of unknown
    accelerators or without one are skipped.

    Raises:
        ValueError: a price that is not a number (names the instance type and zone).
    """
    by_key: dict[tuple[str, str], dict] = {}
    for r in rows:
        name = SKYPILOT_NAMES.get(r["AcceleratorName"], r["AcceleratorName"])
        if not name or name not in known or not r["AcceleratorCount"]:
            continue
        try:
            price = float(r["Price"])
            spot = float(r["SpotPrice"]) if r["SpotPrice"].strip() else None
        except ValueError:
            raise ValueError(f"{r['InstanceType']} {r['AvailabilityZone']}: price {r['Price']!r} / "
                             f"spot {r['SpotPrice']!r} is not a number") from None
        key = (r["InstanceType"], r["Region"])
        cur = by_key.setdefault(key, {"row": r, "name": name, "price": price, "spot": None, "zone": ""})
        if spot is not None and (cur["spot"] is None or spot < cur["spot"]):
            cur["spot"], cur["zone"] = spot, r["AvailabilityZone"]
    out = []
    for (itype, region), v in sorted(by_key.items()):
        r, bw = v["row"], bandwidths.get(itype, {})
        out.append({
            "provider": "aws", "instance_type": itype, "accelerator": v["name"],
            "count": str(int(float(r["AcceleratorCount"]))), "vcpus": str(int(float(r["vCPUs"]))),
            "memory_gib": f"{float(r['MemoryGiB']):g}", "region": region, "usd_per_hour": repr(v["price"]),
            "spot_usd_per_hour": "" if v["spot"] is None else repr(v["spot"]),
            "intra_node_bytes_per_s": bw.get("intra_node_bytes_per_s", ""),
            "inter_node_bytes_per_s": bw.get("inter_node_bytes_per_s", ""), "as_of": date,
            "source": (f"SkyPilot catalog skypilot-org/skypilot-catalog@{commit[:12]} catalogs/v7/aws/vms.csv "
                       f"(read {date}; rebuilt by SkyPilot from the AWS APIs): on-demand list price; spot is the "
                       "cheapest zone's, spot prices move hourly"),
            "bandwidth_source": bw.get("bandwidth_source", ""), "zone": v["zone"],
        })
    return out


def main(argv: list[str] | None = None) -> int:
    from sftctl.catalog.accelerators import load_accelerators

    p = argparse.ArgumentParser(prog="python -m sftctl.catalog.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--aws", type=Path, required=True, help="SkyPilot catalogs/v7/aws/vms.csv (or an excerpt)")
    p.add_argument("--commit", required=True, help="the skypilot-catalog commit the file is from")
    p.add_argument("--date", required=True, help="the date the file was read (its commit's date where known), YYYY-MM-DD: each row's as_of")
    p.add_argument("--out", type=Path, default=SNAPSHOT)
    a = p.parse_args(argv)
    bandwidths = {itype: {"intra_node_bytes_per_s": intra, "inter_node_bytes_per_s": inter, "bandwidth_source": src}
                  for itype, (intra, inter, src) in NETWORK.items()}
    with _CSV.open(newline="") as f:
        bandwidths.update({r["instance_type"]: r for r in csv.DictReader(f)})
    with a.aws.open(newline="") as f:
        rows = build_aws(list(csv.DictReader(f)), set(load_accelerators()), a.commit, a.date, bandwidths)
    with a.out.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"{a.out}: {len(rows)} offerings in {len({r['region'] for r in rows})} regions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
