"""Accelerator offerings: what each provider sells, where, and for how much.

Cloud offerings come from ``offerings.csv`` (one row per instance type and region, with the source
of its price, the date of the price (``as_of``) and the source of its bandwidths). The local
machine's offering is built from the machine itself: ``cpu`` with one process per node per
requested count, priced at $0/h. Prices are USD per hour per node.

Bandwidths are unidirectional bytes/s: ``intra_node_bytes_per_s`` per accelerator between the
accelerators of one node (NVLink/NVSwitch, Infinity Fabric or PCIe; empty for single-accelerator
nodes), ``inter_node_bytes_per_s`` per node to the other nodes (EFA, GPUDirect NICs, or the
instance's documented "up to" network figure).

Accelerator hardware facts (``accelerators.yaml``: FLOP/s, bandwidths, SM resources, each with
its source) are owned by :mod:`sftctl.catalog.accelerators`; the compiler reads them through
``sftctl.compiler.hardware``, which re-exports that module. How an accelerator is recognized (a
CUDA device, Kubernetes node labels, a GCE accelerator type, a Slurm GPU type, the calibration it
shares) is the ``identity:`` column of the same table, read by :mod:`sftctl.catalog.identity`
(``catalog.identify(device)``). The catalog imports no compiler code.
"""

from __future__ import annotations

import csv
import functools
import datetime
import os
from pathlib import Path

from sftctl.catalog.identity import identify  # noqa: F401 - catalog.identify(device)
from sftctl.types import Offering  # the vocabulary; re-exported here

_CSV = Path(__file__).with_name("offerings.csv")


@functools.lru_cache(maxsize=1)
def _cloud_offerings() -> tuple[Offering, ...]:
    return tuple(_read_offerings())


def cloud_offerings() -> list[Offering]:
    """The cloud offerings from ``offerings.csv`` (read once per process)."""
    return list(_cloud_offerings())


def _read_offerings() -> list[Offering]:
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
                intra_node_bytes_per_s=_opt_float(r.get("intra_node_bytes_per_s")),
                inter_node_bytes_per_s=_opt_float(r.get("inter_node_bytes_per_s")),
                as_of=(r.get("as_of") or "").strip(),
                bandwidth_source=(r.get("bandwidth_source") or "").strip(),
            )
            for r in csv.DictReader(f)
        ]


def _opt_float(text: str | None) -> float | None:
    text = (text or "").strip()
    return float(text) if text else None


# Worker processes on one machine exchange tensors through shared memory (torch.distributed gloo over
# loopback / shm). ASSUMPTION: ~10 GB/s each way, a memcpy-class figure well below DRAM bandwidth.
LOCAL_INTRA_NODE_BYTES_PER_S = 10e9


def local_offering(count: int) -> Offering:
    """This machine as one offering: ``count`` CPU worker processes per node, free.

    Intra-node bandwidth is an assumption (shared memory, ``LOCAL_INTRA_NODE_BYTES_PER_S``); there is
    no inter-node network. ``as_of`` is today: the price ($0) is always current.
    """
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
        intra_node_bytes_per_s=LOCAL_INTRA_NODE_BYTES_PER_S,
        inter_node_bytes_per_s=None,
        as_of=datetime.date.today().isoformat(),
        bandwidth_source="assumption: worker processes share memory, ~10 GB/s each way",
    )


def accelerator_names() -> list[str]:
    """Every accelerator name sftctl knows: those offered, and those in the hardware table
    (``sftctl/catalog/accelerators.yaml``, which the compiler can target even unoffered)."""
    from sftctl.catalog.accelerators import load_accelerators

    return sorted({o.accelerator for o in cloud_offerings()} | set(load_accelerators()) | {"cpu"})
