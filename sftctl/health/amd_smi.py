"""AMD GPU samples from ``amd-smi metric --json`` (ROCm's AMD SMI CLI), as NVML's on NVIDIA.

:class:`AmdSmiSource` runs ``amd-smi metric --json`` once per tick and turns each GPU's record
into a sample of :mod:`sftctl.health.telemetry`'s format (:func:`parse_amd_smi_metric`, pure),
so the same detectors judge AMD nodes:

=====================================  =========================================================
sample key                             amd-smi metric --json
=====================================  =========================================================
``gpu``                                ``gpu``
``utilization_gpu_pct``                ``usage.gfx_activity.value`` (%)
``power_usage_mw``                     ``power.socket_power.value`` (W) x 1000
``clock_sm_mhz`` / ``max_clock_sm_mhz``  ``clock.gfx_0.clk`` / ``clock.gfx_0.max_clk`` (MHz)
``temperature_gpu_c``                  ``temperature.hotspot`` (junction; ``edge`` if none)
``memory_used_mib``                    ``mem_usage.used_vram`` (MB)
``ecc_uncorrected_volatile``           ``ecc.total_uncorrectable_count`` (else the sum of
                                       ``ecc_blocks.*.uncorrectable_count`` but XGMI_WAFL's)
``pcie_replay_counter``                ``pcie.replay_count``
``clocks_event_reasons``               ``throttle.*_violation_status`` ACTIVE (MI300 firmware's
                                       violation flags): PROCHOT -> HW slowdown, socket / VR / HBM
                                       thermal -> HW thermal, PPT (package power) -> SW power cap;
                                       else ``power.throttle_status`` THROTTLED -> HW slowdown
``xgmi_error``                         ``xgmi_err`` other than NO_ERROR (MI2xx: the xGMI links'
                                       error status), or ``ecc_blocks.XGMI_WAFL.
                                       uncorrectable_count`` above 0 (MI300 and later, whose
                                       ``xgmi_err`` is always N/A: ROCm/rocm-systems#11468):
                                       the ``xgmi`` detector replaces the node
=====================================  =========================================================

``N/A`` leaves the key out (not available on that device or firmware), as a missing NVML call
does. Versions differ, and all of these are read: ROCm 6.0 prints bare values, 6.1 and later
``{"value": v, "unit": u}`` leaves (CHANGELOG "Added units of measure to JSON output"); ROCm 6
prints a list of GPUs, ROCm 7 ``{"gpu_data": [...]}`` (ROCm/amdsmi#134); the human-readable
output (``GPU: 0`` / indented ``KEY: value unit``, what amd-smi prints without ``--json`` and
what most published MI300X recordings are) is the same tree upper-cased, read by
:func:`parse_amd_smi_text`. The recordings the tests parse are in tests/fixtures/amd_smi/. A run that
fails saying the GPU is lost (amd-smi's ``AMDSMI_STATUS_NOT_FOUND`` / ``No GPU`` after it saw
GPUs) marks those GPUs ``gpu_is_lost``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from typing import Any

from sftctl.health.cli_source import CliSource
from sftctl.health.telemetry import HW_SLOWDOWN, HW_THERMAL_SLOWDOWN, SW_POWER_CAP

#: ``throttle.<name>_violation_status`` -> the NVML clocks-event reason it means.
VIOLATION_REASONS = {
    "prochot": HW_SLOWDOWN, "socket_thermal": HW_THERMAL_SLOWDOWN, "vr_thermal": HW_THERMAL_SLOWDOWN,
    "hbm_thermal": HW_THERMAL_SLOWDOWN, "ppt": SW_POWER_CAP,
}
LOST_WORDS = ("gpu is lost", "amdsmi_status_not_found", "no gpu", "device not found")


def _value(node: Any) -> float | None:
    """``{"value": v, "unit": u}`` or a bare number -> v; ``N/A`` and anything else -> None."""
    if isinstance(node, dict):
        node = node.get("value")
    if isinstance(node, bool) or node is None:
        return None
    if isinstance(node, (int, float)):
        return float(node)
    try:
        return float(str(node).split()[0])
    except (ValueError, IndexError):
        return None


def _get(record: dict, *path: str) -> Any:
    for key in path:
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record


def _number(v: float | None) -> int | float | None:
    return None if v is None else (int(v) if float(v).is_integer() else v)


def sample_of(record: dict) -> dict:
    """One GPU's ``amd-smi metric`` record as a telemetry sample (no ``ts``: the caller's clock)."""
    out: dict[str, Any] = {"gpu": int(record["gpu"])}
    fields = {
        "utilization_gpu_pct": _get(record, "usage", "gfx_activity"),
        "clock_sm_mhz": _get(record, "clock", "gfx_0", "clk"),
        "max_clock_sm_mhz": _get(record, "clock", "gfx_0", "max_clk"),
        "temperature_gpu_c": _get(record, "temperature", "hotspot"),
        "memory_used_mib": _get(record, "mem_usage", "used_vram"),
        "ecc_uncorrected_volatile": _get(record, "ecc", "total_uncorrectable_count"),
        "pcie_replay_counter": _get(record, "pcie", "replay_count"),
    }
    if _value(fields["temperature_gpu_c"]) is None:
        fields["temperature_gpu_c"] = _get(record, "temperature", "edge")
    for key, node in fields.items():
        v = _number(_value(node))
        if v is not None:
            out[key] = int(v) if key in ("ecc_uncorrected_volatile", "pcie_replay_counter") else v
    blocks = record.get("ecc_blocks") if isinstance(record.get("ecc_blocks"), dict) else {}
    if "ecc_uncorrected_volatile" not in out:
        counts = [_value(_get(b, "uncorrectable_count")) for name, b in blocks.items()
                  if isinstance(b, dict) and name.upper() != "XGMI_WAFL"]  # that block is the xgmi detector's
        if any(c is not None for c in counts):
            out["ecc_uncorrected_volatile"] = int(sum(c for c in counts if c is not None))
    power = _value(_get(record, "power", "socket_power"))
    if power is not None:
        out["power_usage_mw"] = int(round(power * 1000))
    throttle = record.get("throttle") if isinstance(record.get("throttle"), dict) else {}
    flags = {name: str(throttle.get(f"{name}_violation_status", "N/A")).upper() for name in VIOLATION_REASONS}
    if any(f in ("ACTIVE", "NOT ACTIVE") for f in flags.values()):
        mask = 0
        for name, f in flags.items():
            if f == "ACTIVE":
                mask |= VIOLATION_REASONS[name]
        out["clocks_event_reasons"] = mask
    else:
        status = str(_get(record, "power", "throttle_status") or "N/A").upper()
        if status in ("THROTTLED", "UNTHROTTLED"):
            out["clocks_event_reasons"] = HW_SLOWDOWN if status == "THROTTLED" else 0
    xgmi = record.get("xgmi_err")
    wafl = _value(_get(blocks, "XGMI_WAFL", "uncorrectable_count"))
    if wafl is None:
        wafl = _value(_get(blocks, "xgmi_wafl", "uncorrectable_count"))  # the human-readable form, lower-cased
    known = []
    if xgmi is not None and str(xgmi).upper() != "N/A":
        known.append(str(xgmi).upper() not in ("NO_ERROR", "NO ERROR"))
    if wafl is not None:
        known.append(wafl > 0)
    if known:
        out["xgmi_error"] = any(known)
    return out


_TEXT_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_]+):(?: (?P<value>.*))?$")


def parse_amd_smi_text(text: str) -> list[dict]:
    """amd-smi's human-readable output (``amd-smi metric`` without ``--json``) -> GPU records in
    the JSON's shape (pure).

    ``GPU: 0`` opens a record; each deeper-indented ``KEY:`` opens a section, ``KEY: value``
    sets a leaf; keys are lower-cased (``SOCKET_POWER: 234 W`` -> ``{"socket_power": "234 W"}``,
    read by the same :func:`sample_of`). Lines that are not ``KEY: ...`` (wrapped list
    continuations, ``[output truncated]``, ``...``) are skipped. Returns [] when no ``GPU:``
    line is found.
    """
    records: list[dict] = []
    stack: list[tuple[int, dict]] = []
    for raw in text.splitlines():
        m = _TEXT_LINE.match(raw.rstrip())
        if not m:
            continue
        indent, key, value = len(m["indent"]), m["key"].lower(), m["value"]
        if key == "gpu" and indent == 0 and value is not None:
            try:
                records.append({"gpu": int(value)})
            except ValueError:
                continue
            stack = [(-1, records[-1])]
            continue
        if not stack:
            continue
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        if value is None or value == "":
            child: dict = {}
            parent[key] = child
            stack.append((indent, child))
        else:
            parent[key] = value.strip()
    return records


def parse_amd_smi_metric(text: str) -> list[dict]:
    """``amd-smi metric --json`` output (or its human-readable form, see
    :func:`parse_amd_smi_text`) -> one sample per GPU, sorted by ``gpu`` (pure).

    Raises:
        ValueError: the text is neither amd-smi's JSON (a list of GPU records or
            ``{"gpu_data": [...]}``) nor its human-readable output.
    """
    if text.lstrip()[:1] in ("[", "{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not amd-smi metric --json output: {e}") from None
        records = doc.get("gpu_data") if isinstance(doc, dict) else doc
    else:
        records = parse_amd_smi_text(text) or None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "gpu" in r for r in records):
        raise ValueError("not amd-smi metric output: expected a list of GPU records, {'gpu_data': [...]} "
                         "or 'GPU: N' sections")
    return sorted((sample_of(r) for r in records), key=lambda s: s["gpu"])


class AmdSmiSource(CliSource):
    """Samples AMD GPUs by running ``amd-smi metric --json`` (see the module docstring; the
    loop is :class:`sftctl.health.cli_source.CliSource`'s).

    Args:
        executable: the amd-smi to run.
        run: ``subprocess.run`` or a stand-in (tests).
        clock: time source for ``ts``.
        timeout_s: limit for one amd-smi run.

    Raises:
        RuntimeError: amd-smi does not work here or lists no GPU.
        OSError: it cannot be started.
    """

    tool = "amd-smi"
    lost_words = LOST_WORDS

    def __init__(self, executable: str = "amd-smi", *, run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                 clock: Callable[[], float] = time.time, timeout_s: float = 20.0) -> None:
        super().__init__(executable, run=run, clock=clock, timeout_s=timeout_s)
        proc = self._query()
        if proc.returncode != 0:
            raise RuntimeError(f"amd-smi failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[:300]}")
        try:
            rows = parse_amd_smi_metric(proc.stdout)
        except ValueError as e:
            raise RuntimeError(f"amd-smi: {e}") from None
        if not rows:
            raise RuntimeError("amd-smi lists no GPU")
        self._remember(rows)
        self.description = f"amd-smi ({len(rows)} GPU{'s' if len(rows) != 1 else ''})"

    def _query(self) -> subprocess.CompletedProcess:
        return self._run([self._exe, "metric", "--json"], capture_output=True, text=True, timeout=self._timeout_s,
                         check=False)

    def _parse(self, stdout: str) -> list[dict]:
        return parse_amd_smi_metric(stdout)
