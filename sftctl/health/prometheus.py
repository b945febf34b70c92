"""GPU samples as Prometheus text exposition, under dcgm-exporter's metric names.

Dashboards and alerts written for NVIDIA's dcgm-exporter work on these series unchanged:
same metric names, types, units (power in W) and the labels ``gpu``, ``UUID`` and ``Hostname``.
Only the fields the samples carry are exported (no ``modelName``, ``pci_bus_id``, profiling
metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# (metric, type, help, sample key, conversion); help texts as in dcgm-exporter's counters CSV
_METRICS: tuple[tuple[str, str, str, str, Callable[[object], float]], ...] = (
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


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


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
    """Prometheus text exposition (format 0.0.4) of the latest sample of each GPU.

    Args:
        samples: GPU samples (telemetry format), any number per GPU; the latest (by ``ts``)
            gives each GPU's values, and ``DCGM_FI_DEV_XID_ERRORS`` is the last XID in all of
            them (0 when none).
        node: the ``Hostname`` label.

    Returns:
        ``# HELP``/``# TYPE`` lines and one series per GPU for each metric with data; a metric
        no GPU has a value for is left out. Empty string when there is no GPU sample.
    """
    per_gpu = _latest_per_gpu(samples)
    lines: list[str] = []
    for name, kind, help_text, key, convert in _METRICS:
        series = []
        for gpu, rec in per_gpu.items():
            if rec.get(key) is None:
                continue
            labels = (f'gpu="{gpu}",UUID="{_escape(str(rec["uuid"]))}",'
                      f'Hostname="{_escape(node)}"')
            series.append(f"{name}{{{labels}}} {_fmt(convert(rec[key]))}")
        if series:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(series)
    return "\n".join(lines) + "\n" if lines else ""
