"""Build the shipped price snapshot (``snapshot.csv``) from SkyPilot-format catalog CSVs.

    python -m sftctl.catalog.build [--aws vms.csv --aws-source TEXT --aws-date DATE]
                                   [--gcp vms.csv --gcp-source TEXT --gcp-date DATE]
                                   [--keep] [--out snapshot.csv]

Inputs are files in the format of SkyPilot's ``catalogs/v7/{aws,gcp}/vms.csv`` (the
``skypilot-org/skypilot-catalog`` repository, rebuilt from the clouds' APIs), whole or excerpts
with the same header; the inputs of the shipped snapshot are in ``tests/fixtures/catalog/``
(see ``SOURCES`` there and :data:`SHIPPED`). Only the figures are taken.

* AWS rows: one per instance type and availability zone, ``InstanceType, AcceleratorName,
  AcceleratorCount, vCPUs, MemoryGiB, GpuInfo, Price, SpotPrice, Region, AvailabilityZone``
  (USD per hour per instance; ``SpotPrice`` empty where AWS reported none; ``Price`` empty for
  types sold only as capacity blocks, which are skipped).
* GCP rows: a host row per machine type and zone (``InstanceType`` set, no accelerator; A2, A3,
  A4 and G2 hosts are priced *without* their GPUs) and a GPU row per accelerator, count and zone
  (``InstanceType`` empty). An offering's price is host + GPUs in the same zone
  (:func:`build_gcp`); N1 hosts take T4/V100 GPUs attached (``n1-standard-8+T4``, see
  :data:`GCP_N1_HOSTS`). Rows priced 0 are SKUs the source did not find (the A4 hosts: SkyPilot's
  fetch_gcp notes "GCP does not have A4 instance in SKUs API yet"), left out with what they would
  have joined: a host priced 0 would rank its B200s below every honest offering. GPU rows whose
  price is another SKU's (:func:`mismatched_gpu_prices`) are left out too. TPU rows
  (``AcceleratorName`` ``tpu-<version>-<size>``, no ``InstanceType``) are whole slices priced
  per hour: each is an offering of its own (:func:`gcp_tpu_slice`), its vCPUs and memory from
  ``offerings.csv``'s hand-sourced row of the same slice; prices of 700.0 are the source's
  placeholder for a region that does not sell the type (:data:`GCP_TPU_PLACEHOLDER`), left out.

Output: one row per (instance type, region) whose accelerator sftctl knows, in ``offerings.csv``'s
columns plus ``zone``: ``usd_per_hour`` the region's on-demand price (its cheapest zone's),
``spot_usd_per_hour`` the cheapest zone's spot price (only below on-demand) and ``zone`` that
zone (empty when no zone has spot), ``spot_zones`` every zone's spot price, cheapest first. ``as_of`` is the date of the figures (``--*-date``: the
source commit's date where known), ``source`` names the file, commit and date.
Bandwidths come from ``offerings.csv``'s hand-sourced row of the same instance type (the same
hardware in every region), else from :data:`NETWORK` (the clouds' published figures); an
instance type with neither is left out (every offering carries sourced bandwidths).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

from sftctl.catalog import COLUMNS, _CSV, SNAPSHOT, zone_prices_text

#: SkyPilot's accelerator names that differ from sftctl's (AWS p4d's and GCP A2's A100 are
#: the 40 GB part; GCP's A3 Mega prices its H100s under their own name).
SKYPILOT_NAMES = {"A100": "A100-40GB", "H100-MEGA": "H100"}

#: The inputs of the shipped snapshot (paths relative to the repository root): file, source, date.
SHIPPED = {
    "aws": ("tests/fixtures/catalog/aws_gpu_excerpt.csv",
            "SkyPilot catalog skypilot-org/skypilot-catalog@001367d22a00 catalogs/v7/aws/vms.csv "
            "(rebuilt by SkyPilot from the AWS APIs; the commit's date is not recorded in the copy it was "
            "read from: its P4/P5 on-demand prices predate AWS's June 2025 cut, so it is dated 2025-05, "
            "the newest it can be)", "2025-05"),
    "gcp": ("tests/fixtures/catalog/gcp_gpu_excerpt.csv",
            "SkyPilot-format catalog anycloud-sh/catalog@62ff0a987e0c (2026-05-20) gcp/vms.csv, columns "
            "of skypilot-catalog catalogs/v7/gcp/vms.csv (rebuilt from the Compute Engine and Cloud "
            "Billing APIs): host + GPU rows joined", "2026-05-20"),
}

_PCIE4 = "GPUs on PCIe 4.0 x16 (~25 GB/s, no NVLink)"
_PCIE3 = "GPUs on PCIe 3.0 x16 (~12.5 GB/s, no NVLink)"
_AWS = "AWS EC2 accelerated computing instance specifications"
_GCP = "GCP 'GPU machine types' and 'Network bandwidth' pages"
_NVL3 = "NVLink 3 via NVSwitch: 600 GB/s bidirectional per A100 = 300 GB/s each way (NVIDIA A100 datasheet)"
_NVL4 = "NVLink 4 via NVSwitch: 900 GB/s bidirectional per H100 = 450 GB/s each way (NVIDIA H100 datasheet)"


def _one(gbps: float, doc: str) -> tuple[str, str, str]:
    return "", repr(gbps * 1e9 / 8), f"One GPU per node; {gbps:g} Gbps network ({doc})"


def _multi(n: int, intra: float, link: str, gbps: float, doc: str) -> tuple[str, str, str]:
    return repr(intra), repr(gbps * 1e9 / 8), f"{n} {link}; {gbps:g} Gbps network ({doc})"


#: Bandwidths (bytes/s: intra-node per GPU each way, inter-node per node) of instance types that
#: ``offerings.csv`` has no hand-sourced row for, from the clouds' published network figures
#: (Gbps / 8) and the GPUs' datasheets.
NETWORK: dict[str, tuple[str, str, str]] = {
    "g4dn.16xlarge": _one(50, f"{_AWS}, G4dn"),
    "g5.2xlarge": ("", "1.25e9", f"One GPU per node; up to 10 Gbps network ({_AWS}, G5)"),
    "g5.24xlarge": _multi(4, 2.5e10, _PCIE4, 50, f"{_AWS}, G5"),
    "g6.2xlarge": ("", "1.25e9", f"One GPU per node; up to 10 Gbps network ({_AWS}, G6)"),
    "g6.24xlarge": _multi(4, 2.5e10, _PCIE4, 50, f"{_AWS}, G6"),
    "g6.48xlarge": _multi(8, 2.5e10, _PCIE4, 100, f"{_AWS}, G6"),
    "p3.8xlarge": _multi(4, 1.5e11, "V100 SXM2 on NVLink 2: 300 GB/s bidirectional per GPU = 150 GB/s each way "
                         "(NVIDIA V100 datasheet)", 10, f"{_AWS}, P3"),
    "p3dn.24xlarge": _multi(8, 1.5e11, "V100 SXM2 32GB in NVLink 2 hybrid cube-mesh: 300 GB/s bidirectional per GPU "
                            "= 150 GB/s each way (NVIDIA V100 datasheet)", 100, f"{_AWS}, P3dn"),
    # GCP A2: 24/32/50/100 Gbps for 1/2/4/8+ GPUs
    "a2-highgpu-2g": _multi(2, 3.0e11, _NVL3, 32, f"{_GCP}, A2"),
    "a2-highgpu-4g": _multi(4, 3.0e11, _NVL3, 50, f"{_GCP}, A2"),
    "a2-highgpu-8g": _multi(8, 3.0e11, _NVL3, 100, f"{_GCP}, A2"),
    "a2-megagpu-16g": _multi(16, 3.0e11, _NVL3, 100, f"{_GCP}, A2"),
    "a2-ultragpu-2g": _multi(2, 3.0e11, _NVL3, 32, f"{_GCP}, A2"),
    "a2-ultragpu-4g": _multi(4, 3.0e11, _NVL3, 50, f"{_GCP}, A2"),
    "a2-ultragpu-8g": _multi(8, 3.0e11, _NVL3, 100, f"{_GCP}, A2"),
    # GCP A3 High: 25/50/100 Gbps for 1/2/4 GPUs; A3 Edge 8 GPUs: 4 x 200 Gbps GPUDirect-TCPX;
    # A3 Mega: 8 x 200 Gbps GPUDirect-TCPXO; A4: 8 x 400 Gbps ConnectX-7 RDMA
    "a3-highgpu-2g": _multi(2, 4.5e11, _NVL4, 50, f"{_GCP}, A3 High"),
    "a3-highgpu-4g": _multi(4, 4.5e11, _NVL4, 100, f"{_GCP}, A3 High"),
    "a3-edgegpu-8g": _multi(8, 4.5e11, _NVL4, 800, f"{_GCP}, A3 Edge: 4 x 200 Gbps GPUDirect-TCPX NICs for GPU traffic"),
    "a3-megagpu-8g": _multi(8, 4.5e11, _NVL4, 1600, f"{_GCP}, A3 Mega: 8 x 200 Gbps GPUDirect-TCPXO NICs for GPU traffic"),
    "a4-highgpu-8g": _multi(8, 9.0e11, "NVLink 5 via NVSwitch: 1.8 TB/s bidirectional per B200 = 900 GB/s each way "
                            "(NVIDIA HGX B200 datasheet)", 3200, f"{_GCP}, A4: 8 x 400 Gbps ConnectX-7 RDMA NICs"),
    # GCP G2 (L4): 10/16/16/32/32/32/50/100 Gbps for g2-standard-4/8/12/16/24/32/48/96
    "g2-standard-8": _one(16, f"{_GCP}, G2"),
    "g2-standard-12": _one(16, f"{_GCP}, G2"),
    "g2-standard-16": _one(32, f"{_GCP}, G2"),
    "g2-standard-32": _one(32, f"{_GCP}, G2"),
    "g2-standard-24": _multi(2, 2.5e10, _PCIE4, 32, f"{_GCP}, G2"),
    "g2-standard-48": _multi(4, 2.5e10, _PCIE4, 50, f"{_GCP}, G2"),
    "g2-standard-96": _multi(8, 2.5e10, _PCIE4, 100, f"{_GCP}, G2"),
    # N1: 2 Gbps per vCPU, at most 32 Gbps without the GPU tiers
    "n1-standard-8+T4": _multi(2, 1.25e10, _PCIE3, 16, f"{_GCP}, N1: 2 Gbps per vCPU"),
    "n1-standard-16+T4": _multi(4, 1.25e10, _PCIE3, 32, f"{_GCP}, N1: 2 Gbps per vCPU"),
    "n1-standard-8+V100": _one(16, f"{_GCP}, N1: 2 Gbps per vCPU"),
    "n1-standard-16+V100": _multi(2, 1.25e10, _PCIE3 + "; GCP links V100s by NVLink only in some shapes: "
                                  "assumed PCIe", 32, f"{_GCP}, N1: 2 Gbps per vCPU"),
    "n1-standard-32+V100": _multi(4, 1.25e10, _PCIE3 + "; GCP links V100s by NVLink only in some shapes: "
                                  "assumed PCIe", 32, f"{_GCP}, N1: 2 Gbps per vCPU"),
    "n1-standard-64+V100": _multi(8, 1.5e11, "V100 SXM2 in NVLink 2 hybrid cube-mesh: 150 GB/s each way per GPU "
                                  "(NVIDIA V100 datasheet; GCP 'GPU machine types', 8 x V100)", 32,
                                  f"{_GCP}, N1: 2 Gbps per vCPU"),
}

#: GCP machine types that carry their GPUs: (SkyPilot's GPU name in the GPU rows, count).
_GCP_HOSTS = [
    (r"a2-highgpu-(\d+)g", "A100"), (r"a2-megagpu-(\d+)g", "A100"), (r"a2-ultragpu-(\d+)g", "A100-80GB"),
    (r"a3-highgpu-(\d+)g", "H100"), (r"a3-edgegpu-(\d+)g", "H100"), (r"a3-megagpu-(\d+)g", "H100-MEGA"),
    (r"a3-ultragpu-(\d+)g", "H200"), (r"a4-highgpu-(\d+)g", "B200"),
]
#: G2 sizes and their L4 counts (GCP 'GPU machine types', G2).
_G2_L4 = {"g2-standard-4": 1, "g2-standard-8": 1, "g2-standard-12": 1, "g2-standard-16": 1,
          "g2-standard-32": 1, "g2-standard-24": 2, "g2-standard-48": 4, "g2-standard-96": 8}
#: The N1 host sftctl pairs with attached T4/V100 GPUs: (GPU, count) -> machine type (4 vCPUs per
#: T4, 8 per V100, within GCP's per-GPU vCPU limits).
GCP_N1_HOSTS = {("T4", 1): "n1-standard-4", ("T4", 2): "n1-standard-8", ("T4", 4): "n1-standard-16",
                ("V100", 1): "n1-standard-8", ("V100", 2): "n1-standard-16", ("V100", 4): "n1-standard-32",
                ("V100", 8): "n1-standard-64"}


def gcp_host_gpus(machine_type: str) -> tuple[str, int] | None:
    """``(SkyPilot GPU name, count)`` a GCP machine type carries, or None (N1, CPU-only types)."""
    if machine_type in _G2_L4:
        return "L4", _G2_L4[machine_type]
    for pattern, gpu in _GCP_HOSTS:
        m = re.fullmatch(pattern, machine_type)
        if m:
            return gpu, int(m.group(1))
    return None


#: SkyPilot's TPU version names -> (sftctl accelerator, TensorCores per chip): the size in a
#: v5p slice's name counts TensorCores (v5p-8 is 4 chips), v5e's and v6e's count chips (Cloud TPU
#: docs "TPU v5p", "TPU v5e", "TPU v6e").
GCP_TPU_VERSIONS = {"v5litepod": ("TPU-v5e", 1), "v5p": ("TPU-v5p", 2), "v6e": ("TPU-v6e", 1)}

#: The price SkyPilot's GCP catalog gives a TPU in a region whose SKU it did not find
#: (anycloud-sh/catalog@62ff0a987e0c gcp/vms.csv: tpu-v6e-1 at 700.0 USD/h on-demand in
#: asia-east1, us-central2, southamerica-east1 and as spot in southamerica-west1, against 2.70
#: in us-central1): not a price.
GCP_TPU_PLACEHOLDER = 700.0


def gcp_tpu_slice(accelerator_name: str) -> tuple[str, str, int] | None:
    """``tpu-v5litepod-8`` -> ``("v5litepod-8", "TPU-v5e", 8 chips)``; None for TPU versions
    sftctl has no accelerator for (v2, v3, v4) and for anything else."""
    m = re.fullmatch(r"tpu-(v5litepod|v5p|v6e)-(\d+)", accelerator_name or "")
    if not m:
        return None
    name, cores = GCP_TPU_VERSIONS[m.group(1)]
    size = int(m.group(2))
    return f"{m.group(1)}-{size}", name, max(1, size // cores)


def _price(text: str, what: str) -> float | None:
    text = (text or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what}: price {text!r} is not a number") from None


def _rows_out(by_key: dict, provider: str, source: str, date: str,
              bandwidths: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    out = []
    for (itype, region), v in sorted(by_key.items()):
        bw = bandwidths.get(itype)
        if bw is None:
            continue
        spot = v["spot"] if v["spot"] is not None and v["spot"] < v["price"] else None
        out.append({
            "provider": provider, "instance_type": itype, "accelerator": v["name"], "count": str(v["count"]),
            "vcpus": str(int(v["vcpus"])), "memory_gib": f"{v['memory']:g}", "region": region,
            "usd_per_hour": repr(round(v["price"], 6)),
            "spot_usd_per_hour": "" if spot is None else repr(round(spot, 6)),
            "intra_node_bytes_per_s": bw.get("intra_node_bytes_per_s", ""),
            "inter_node_bytes_per_s": bw.get("inter_node_bytes_per_s", ""), "as_of": date,
            "source": f"{source}: on-demand list price; spot is the cheapest zone's, spot prices move hourly",
            "bandwidth_source": bw.get("bandwidth_source", ""), "zone": v["zone"] if spot is not None else "",
            "spot_zones": zone_prices_text(sorted(((z, round(p, 6)) for z, p in v["zones"].items() if p < v["price"]),
                                                  key=lambda zp: (zp[1], zp[0]))),
        })
    return out


def _offer(by_key: dict, key: tuple[str, str], name: str, count: int, vcpus: float, memory: float,
           price: float, spot: float | None, zone: str) -> None:
    cur = by_key.setdefault(key, {"name": name, "count": count, "vcpus": vcpus, "memory": memory,
                                  "price": price, "spot": None, "zone": "", "zones": {}})
    cur["price"] = min(cur["price"], price)
    if spot is not None and (cur["spot"] is None or spot < cur["spot"]):
        cur["spot"], cur["zone"] = spot, zone
    if spot is not None and zone:
        cur["zones"][zone] = min(spot, cur["zones"].get(zone, spot))


def build_aws(rows: list[dict[str, str]], known: set[str], source: str, date: str,
              bandwidths: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """Snapshot rows (``COLUMNS``) from SkyPilot AWS ``vms.csv`` rows; rows of unknown
    accelerators, without one, or without an on-demand price are skipped.

    Raises:
        ValueError: a price that is not a number (names the instance type and zone).
    """
    by_key: dict[tuple[str, str], dict] = {}
    for r in rows:
        name = SKYPILOT_NAMES.get(r["AcceleratorName"], r["AcceleratorName"])
        if not name or name not in known or not r["AcceleratorCount"]:
            continue
        what = f"{r['InstanceType']} {r['AvailabilityZone']}"
        price, spot = _price(r["Price"], what), _price(r["SpotPrice"], what)
        if price is None:
            continue
        _offer(by_key, (r["InstanceType"], r["Region"]), name, int(float(r["AcceleratorCount"])),
               float(r["vCPUs"]), float(r["MemoryGiB"]), price, spot, r["AvailabilityZone"])
    return _rows_out(by_key, "aws", source, date, bandwidths)


def build_gcp(rows: list[dict[str, str]], known: set[str], source: str, date: str,
              bandwidths: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """Snapshot rows (``COLUMNS``) from SkyPilot GCP ``vms.csv`` rows: each GPU host's price is
    its host row plus the GPU row (same accelerator and count) of the same zone, on-demand and
    spot alike (spot only where both have one); N1 hosts (:data:`GCP_N1_HOSTS`) are joined with
    each T4/V100 GPU row. A host with no GPU row in its zone is skipped (not sold there). A TPU
    slice row is an offering by itself (:func:`gcp_tpu_slice`), for the slice types
    ``offerings.csv`` has a hand-sourced row of (its host's vCPUs, memory and ICI bandwidths).

    Raises:
        ValueError: a price that is not a number (names the row's type and zone).
    """
    gpus: dict[tuple[str, int, str], tuple[float, float | None]] = {}
    hosts = []
    tpu_rows: dict[tuple[str, str], dict] = {}
    for r in rows:
        what = f"{r['InstanceType'] or r['AcceleratorName']} {r['AvailabilityZone']}"
        price, spot = _price(r["Price"], what), _price(r["SpotPrice"], what)
        if price is None or price <= 0:
            continue  # a host or GPU priced 0 is a SKU the source did not find, not a free machine
        spot = spot if spot is not None and spot > 0 else None
        tpu = None if r["InstanceType"] else gcp_tpu_slice(r["AcceleratorName"])
        if tpu is not None:
            itype, name, chips = tpu
            host = bandwidths.get(itype, {})
            if name in known and price != GCP_TPU_PLACEHOLDER and host.get("vcpus"):
                _offer(tpu_rows, (itype, r["Region"]), name, chips, float(host["vcpus"]), float(host["memory_gib"]),
                       price, spot if spot != GCP_TPU_PLACEHOLDER else None, r["AvailabilityZone"])
            continue
        if not r["InstanceType"]:
            gpus[(r["AcceleratorName"], int(float(r["AcceleratorCount"])), r["AvailabilityZone"])] = (price, spot)
        else:
            hosts.append((r, price, spot))
    for key in mismatched_gpu_prices(gpus):
        del gpus[key]
    n1 = {machine: [] for machine in GCP_N1_HOSTS.values()}
    for (gpu, count), machine in GCP_N1_HOSTS.items():
        n1[machine].append((gpu, count))
    by_key: dict[tuple[str, str], dict] = {}
    for r, price, spot in hosts:
        machine, zone = r["InstanceType"], r["AvailabilityZone"]
        carried = gcp_host_gpus(machine)
        pairs = [(carried, machine)] if carried else [((g, c), f"{machine}+{g}") for g, c in n1.get(machine, [])]
        for (gpu, count), itype in pairs:
            name = SKYPILOT_NAMES.get(gpu, gpu)
            g = gpus.get((gpu, count, zone))
            if name not in known or g is None:
                continue
            total_spot = spot + g[1] if spot is not None and g[1] is not None else None
            _offer(by_key, (itype, r["Region"]), name, count, float(r["vCPUs"]), float(r["MemoryGiB"]),
                   price + g[0], total_spot, zone)
    by_key.update(tpu_rows)
    return _rows_out(by_key, "gcp", source, date, bandwidths)


#: A GPU row whose on-demand price is below this fraction of the dearest region's price for the
#: same GPU and count is a SKU mismatch in the source, not a regional price (GCP's regional GPU
#: prices differ by at most ~1.6x in the shipped data: L4 0.56-0.90, T4 0.35-0.48 USD/h).
GCP_GPU_PRICE_FLOOR = 0.5


def mismatched_gpu_prices(gpus: dict[tuple[str, int, str], tuple[float, float | None]]) -> list[tuple[str, int, str]]:
    """The GCP GPU rows (``(gpu, count, zone) -> (on-demand, spot)``) whose on-demand price is not
    the GPU's on-demand list price: below :data:`GCP_GPU_PRICE_FLOOR` of the dearest region's
    for the same GPU and count, or not above the same zone's spot price.

    Why: SkyPilot's ``fetch_gcp.py`` (``get_gpu_price``) prices a GPU with the first OnDemand SKU
    whose description *contains* e.g. ``H100 80GB GPU``, and other SKUs (DWS / flex-start
    capacity) contain it too; the copy the snapshot is built from has H100 at 4.20076 USD/h per
    GPU in 7 regions as different as us-central1 and asia-northeast1 (the same figure is in
    skypilot-catalog@017e2502 catalogs/v7/gcp/vms.csv), while us-east4, with the same host
    price (9.46006), has 9.79655, and GCP's list price for a3-highgpu-8g in us-central1 is
    88.49 USD/h (offerings.csv), i.e. ~9.9 per GPU. Likewise H100-MEGA 35.39 (vs 82.75-107.58),
    H200 36.60 (vs 74.49; spot above it in 4 regions), A100-80GB 1.85-2.08 (vs 4.42-4.85;
    spot above it in us-central1; list price 5.07 for a2-ultragpu-1g). Such a row would make its
    region the cheapest by a factor of two: it is left out (the region keeps offerings.csv's
    hand-sourced row where there is one)."""
    dearest: dict[tuple[str, int], float] = {}
    for (gpu, count, _zone), (price, _spot) in gpus.items():
        dearest[(gpu, count)] = max(price, dearest.get((gpu, count), 0.0))
    return [key for key, (price, spot) in gpus.items()
            if price < GCP_GPU_PRICE_FLOOR * dearest[key[:2]] or (spot is not None and spot >= price)]


def bandwidth_table() -> dict[str, dict[str, str]]:
    """Instance type -> bandwidth columns: :data:`NETWORK`, then ``offerings.csv``'s rows (win)."""
    out = {itype: {"intra_node_bytes_per_s": intra, "inter_node_bytes_per_s": inter, "bandwidth_source": src}
           for itype, (intra, inter, src) in NETWORK.items()}
    with _CSV.open(newline="") as f:
        out.update({r["instance_type"]: r for r in csv.DictReader(f)})
    return out


def main(argv: list[str] | None = None) -> int:
    from sftctl.catalog.accelerators import load_accelerators

    p = argparse.ArgumentParser(prog="python -m sftctl.catalog.build", description=__doc__.split("\n\n")[0])
    for cloud in ("aws", "gcp"):
        p.add_argument(f"--{cloud}", type=Path, help=f"a {cloud.upper()} vms.csv in SkyPilot's v7 format (or an excerpt)")
        p.add_argument(f"--{cloud}-source", help="where the file is from: repository@commit path (and date)")
        p.add_argument(f"--{cloud}-date", help="the date of the figures (the commit's), YYYY-MM[-DD]: each row's as_of")
    p.add_argument("--shipped", action="store_true", help="rebuild the shipped snapshot from its inputs (SHIPPED)")
    p.add_argument("--keep", action="store_true",
                   help="keep the output's existing rows of instance types this run does not produce")
    p.add_argument("--out", type=Path, default=SNAPSHOT)
    a = p.parse_args(argv)
    known, bandwidths = set(load_accelerators()), bandwidth_table()
    root = Path(__file__).resolve().parents[2]
    rows: list[dict[str, str]] = []
    for cloud, build in (("aws", build_aws), ("gcp", build_gcp)):
        path, source, date = getattr(a, cloud), getattr(a, f"{cloud}_source"), getattr(a, f"{cloud}_date")
        if a.shipped:
            path, source, date = root / SHIPPED[cloud][0], SHIPPED[cloud][1], SHIPPED[cloud][2]
        if path is None:
            continue
        if not (source and date):
            p.error(f"--{cloud} needs --{cloud}-source and --{cloud}-date")
        with path.open(newline="") as f:
            rows += build(list(csv.DictReader(f)), known, source, date, bandwidths)
    if a.keep and a.out.is_file():
        made = {(r["provider"], r["instance_type"]) for r in rows}
        with a.out.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if (r["provider"], r["instance_type"]) not in made] + rows
    rows.sort(key=lambda r: (r["provider"], r["instance_type"], r["region"]))
    with a.out.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    for cloud in ("aws", "gcp"):
        mine = [r for r in rows if r["provider"] == cloud]
        print(f"{a.out}: {cloud}: {len(mine)} offerings in {len({r['region'] for r in mine})} regions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
