"""GPU samples as Prometheus text exposition, under dcgm-exporter's metric names.

Dashboards and alerts written for NVIDIA's dcgm-exporter work on these series unchanged:
same metric names, types, units (power in W) and the labels ``gpu``, ``UUID`` and ``Hostname``.
Only the fields the samples carry are exported (no ``modelName``, ``pci_bus_id``, profiling
metrics).

The text is written by ``prometheus-client`` (:func:`prometheus_client.generate_latest` over a
collector of this module's families), not by hand. One difference from dcgm-exporter follows
from it: the client's text format names a counter's family ``<name>_total``, and dcgm's two
counters (``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``, ``DCGM_FI_DEV_PCIE_REPLAY_COUNTER``) do not end in
``_total``, so they are typed ``untyped`` to keep their names (queries, ``rate()`` and alerts on
them work the same; only the ``# TYPE`` line differs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# (metric, type, help, sample key, conversion); help texts as in dcgm-exporter's counters CSV
_METRICS: tuple[tuple[str, str, str, str, Callable[[Any], float]], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "clock_sm_mhz", float),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "temperature_gpu_c", float),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "power_usage_mw",
     lambda mw: float(mw) / 1000.0),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "utilization_gpu_pct", float),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", "_last_xid",
     float),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors.",
     "ecc_uncorrected_volatile", float),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge",
     "Current clock throttle reasons (bitmask of clocks event reasons).", "clocks_event_reasons",
     float),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
     "pcie_replay_counter", float),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending.",
     "remapped_rows_pending", lambda b: 1.0 if b else 0.0),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed.",
     "remapped_rows_failure", lambda b: 1.0 if b else 0.0),
)


def _latest_per_gpu(samples: Iterable[dict]) -> dict[int, dict]:
    """Per GPU: its latest sample's fields, ``_last_xid`` = last XID in any of its samples (0 if
    none, as dcgm-exporter reports). Samples without ``gpu`` and lost GPUs' samples are skipped
    for the gauges (a lost GPU still exports its last XID)."""
    by_gpu: dict[int, list[dict]] = {}
    for s in samples:
        if s.get("gpu") is not None:
            by_gpu.setdefault(int(s["gpu"]), []).append(s)
    out = {}
    for gpu, lst in sorted(by_gpu.items()):
        lst = sorted(lst, key=lambda s: float(s.get("ts", 0.0)))
        last_xid = 0
        for s in lst:
            if s.get("xids"):
                last_xid = int(s["xids"][-1])
        healthy = [s for s in lst if not s.get("gpu_is_lost")]
        rec = dict(healthy[-1]) if healthy else {"uuid": lst[-1].get("uuid")}
        rec["uuid"] = rec.get("uuid") or next((s["uuid"] for s in lst if s.get("uuid")), "")
        rec["_last_xid"] = last_xid
        out[gpu] = rec
    return out


def render(samples: list[dict], node: str) -> str:
    """Prometheus text exposition (format 0.0.4, by ``prometheus-client``) of the latest sample
    of each GPU.

    Args:
        samples: GPU samples (telemetry format), any number per GPU; the latest (by ``ts``)
            gives each GPU's values, and ``DCGM_FI_DEV_XID_ERRORS`` is the last XID in all of
            them (0 when none).
        node: the ``Hostname`` label.

    Returns:
        ``# HELP``/``# TYPE`` lines and one series per GPU for each metric with data; a metric
        no GPU has a value for is left out. Empty string when there is no GPU sample.
    """
    from prometheus_client.core import Metric

    per_gpu = _latest_per_gpu(samples)
    families = []
    for name, kind, help_text, key, convert in _METRICS:
        family = Metric(name, help_text, "unknown" if kind == "counter" else kind)  # see the module's note
        for gpu, rec in per_gpu.items():
            if rec.get(key) is not None:
                family.add_sample(name, {"gpu": str(gpu), "UUID": str(rec["uuid"]), "Hostname": node},
                                  convert(rec[key]))
        if family.samples:
            families.append(family)
    return expose(families)


def expose(families: list) -> str:
    """``families`` (:class:`prometheus_client.core.Metric`) as Prometheus text (format 0.0.4),
    written by ``prometheus-client``; empty string when there are none."""
    from prometheus_client import CollectorRegistry, generate_latest

    class _Families:
        def collect(self):
            return iter(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    return generate_latest(registry).decode()
