"""AMD GPU health through amd-smi, driven by published recordings of real devices
(tests/fixtures/amd_smi/, each file's source in its README): parsed into the NVML-named samples,
and the same detectors' verdicts from them; the source runs a real `amd-smi` executable on PATH
(a script printing a recording), as the agent would on a ROCm node. Where no recording shows the
fault, one field of a real recording is edited, and the edit is named where it is made."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from sftctl.health import detectors as d
from sftctl.health.amd_smi import AmdSmiSource, parse_amd_smi_metric, parse_amd_smi_text
from sftctl.health.detectors.xgmi import xgmi_verdicts
from sftctl.health.sources import open_source
from sftctl.health.telemetry import HW_THERMAL_SLOWDOWN, REPLACE, SW_POWER_CAP, Thresholds

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "amd_smi"
TH = Thresholds()


def rec(name: str) -> str:
    return (FIXTURES / name).read_text()


def blog_with_ecc_blocks() -> str:
    """The blog's MI300X `amd-smi metric` (GPU 0; its "[output truncated]" line dropped) with the
    CHANGELOG's `--ecc-block` section appended under the same GPU (its `GPU: 0` line dropped)."""
    metric = [ln for ln in rec("mi300x_metric_rocm62_blog.txt").splitlines() if ln.startswith(("GPU", " "))]
    blocks = rec("metric_ecc_blocks_rocm62_changelog.txt").splitlines()[1:]
    return "\n".join(metric + blocks) + "\n"


def edit(text: str, section: str, key: str, old: str, new: str) -> str:
    """``text`` with the first ``key: old`` after the line ``section:`` changed to ``key: new``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == f"{section}:")
    i = next(j for j in range(start, len(lines)) if lines[j].strip() == f"{key}: {old}")
    lines[i] = lines[i].replace(f"{key}: {old}", f"{key}: {new}")
    return "\n".join(lines) + "\n"


def fake_amd_smi(tmp_path: Path) -> tuple[Path, Path]:
    """An `amd-smi` on PATH that prints ``out`` for `metric --json` (exit code in ``rc``)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "amd-smi"
    exe.write_text(f'#!/bin/sh\n[ "$1 $2" = "metric --json" ] || exit 2\ncat {tmp_path}/out\n'
                   f'exit $(cat {tmp_path}/rc 2>/dev/null || echo 0)\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, tmp_path / "out"


def test_recorded_mi300x_outputs_of_each_version_become_nvml_named_samples():
    # MI300X under load, ROCm 6.2, human-readable (ROCm blog, 2024-09-17)
    (s,) = parse_amd_smi_metric(rec("mi300x_metric_rocm62_blog.txt"))
    assert s == {"gpu": 0, "utilization_gpu_pct": 100, "clock_sm_mhz": 2102, "max_clock_sm_mhz": 2102,
                 "power_usage_mw": 234000, "clocks_event_reasons": 0}  # THROTTLE_STATUS: UNTHROTTLED
    tree = parse_amd_smi_text(rec("mi300x_metric_rocm62_blog.txt"))[0]
    assert tree["power"]["gfx_voltage"] == "N/A mV" and tree["clock"]["gfx_2"]["clk"] == "2107 MHz"
    # ROCm 6.1 JSON: a list of GPUs, {"value", "unit"} leaves (amdsmi CHANGELOG)
    (s,) = parse_amd_smi_metric(rec("metric_power_units_rocm61_changelog.json"))
    assert s == {"gpu": 0, "power_usage_mw": 10000, "clocks_event_reasons": 0}
    # ROCm 7.0.2 JSON: {"gpu_data": [...]}, MI300X in DPX (ROCm/amdsmi#134)
    (s,) = parse_amd_smi_metric(rec("mi300x_metric_usage_rocm702_dpx_amdsmi134.json"))
    assert s == {"gpu": 0, "utilization_gpu_pct": 0}
    # bare values (ROCm 6.0, before units) read the same; N/A leaves the key out
    (s,) = parse_amd_smi_metric(json.dumps([{"gpu": 3, "power": {"socket_power": 717, "throttle_status": "N/A"},
                                             "temperature": {"hotspot": "N/A", "edge": 41}}]))
    assert s == {"gpu": 3, "power_usage_mw": 717000, "temperature_gpu_c": 41}
    with pytest.raises(ValueError, match="not amd-smi metric"):
        parse_amd_smi_metric('{"error": "no"}')
    with pytest.raises(ValueError, match="not amd-smi metric"):
        parse_amd_smi_metric("AMDSMI_STATUS_NOT_FOUND - Device Not found")


def test_the_catalogs_mi300x_memory_is_what_amd_smi_reports_on_one():
    from sftctl.catalog.accelerators import get_accelerator

    vram = json.loads(rec("mi300x_static_vram_rocm62_blog.json"))  # amd-smi static --json, .[0]["vram"]
    assert (vram["type"], vram["size"]["unit"]) == ("HBM", "MB")
    reported = vram["size"]["value"] * 2**20  # amd-smi's "MB" are MiB: 196592 MiB = 191.98 GiB
    catalog = get_accelerator("MI300X").memory_bytes
    assert reported <= catalog and reported / catalog == pytest.approx(1.0, abs=0.001)  # 16 MiB reserved


def test_recorded_violation_ecc_and_xgmi_fields():
    # MI300 violation flags, 2 GPUs, all NOT ACTIVE (amdsmi CHANGELOG, ROCm 6.3)
    throttle = rec("mi300_metric_throttle_rocm63_changelog.txt")
    assert [(s["gpu"], s["clocks_event_reasons"]) for s in parse_amd_smi_metric(throttle)] == [(0, 0), (1, 0)]
    hot = edit(throttle, "THROTTLE", "SOCKET_THERMAL_VIOLATION_STATUS", "NOT ACTIVE", "ACTIVE")  # edit: GPU 0
    capped = edit(throttle, "THROTTLE", "PPT_VIOLATION_STATUS", "NOT ACTIVE", "ACTIVE")  # edit: GPU 0
    assert [s["clocks_event_reasons"] for s in parse_amd_smi_metric(hot)] == [HW_THERMAL_SLOWDOWN, 0]
    assert parse_amd_smi_metric(capped)[0]["clocks_event_reasons"] == SW_POWER_CAP
    # ECC totals with deferred counts (ROCm 6.1.1) and per-block counts with XGMI_WAFL (ROCm 6.2)
    (s,) = parse_amd_smi_metric(rec("metric_ecc_deferred_rocm611_changelog.txt"))
    assert s == {"gpu": 0, "ecc_uncorrected_volatile": 0}
    (s,) = parse_amd_smi_metric(rec("metric_ecc_blocks_rocm62_changelog.txt"))
    assert s == {"gpu": 0, "ecc_uncorrected_volatile": 0, "xgmi_error": False}
    # a real MI300X with 2 correctable UMC errors (ROCm/device-metrics-exporter#368): no fault
    (s,) = parse_amd_smi_metric("GPU: 0\n    ECC_BLOCKS:\n" + rec("mi300x_ecc_umc_correctable_dme368.txt"))
    assert s == {"gpu": 0, "ecc_uncorrected_volatile": 0}
    # MI300X's XGMI_ERR is N/A (ROCm/rocm-systems#11468): unknown, not healthy, not broken
    (s,) = parse_amd_smi_metric("GPU: 0\n" + rec("mi300x_xgmi_err_rocm_systems11468.txt"))
    assert s == {"gpu": 0}
    # ... so an xGMI fault shows as an uncorrectable XGMI_WAFL count (edit: 0 -> 1)
    broken = edit(rec("metric_ecc_blocks_rocm62_changelog.txt"), "XGMI_WAFL", "UNCORRECTABLE_COUNT", "0", "1")
    (s,) = parse_amd_smi_metric(broken)
    assert s["xgmi_error"] is True and s["ecc_uncorrected_volatile"] == 0
    (v,) = xgmi_verdicts([dict(s, ts=4.0)], 0, TH)
    assert (v.kind, v.action, v.gpu) == ("xgmi", REPLACE, 0)
    # MI2xx's own xgmi_err status still counts
    assert parse_amd_smi_metric(json.dumps([{"gpu": 1, "xgmi_err": "ERROR"}]))[0]["xgmi_error"] is True


def test_ecc_thermal_xgmi_and_lost_gpu_verdicts_from_amd_smi(tmp_path):
    exe, out = fake_amd_smi(tmp_path)
    healthy_text = blog_with_ecc_blocks()
    out.write_text(healthy_text)
    clock = iter(range(0, 1000, 2))
    src = AmdSmiSource(str(exe), clock=lambda: float(next(clock)))
    assert src.description == "amd-smi (1 GPU)"
    healthy = src.sample() + src.sample()
    assert healthy[0]["utilization_gpu_pct"] == 100 and healthy[0]["xgmi_error"] is False
    assert d.evaluate({0: healthy}, {}, {}, {}, 10.0, TH) == []

    # edit: UMC's uncorrectable count 0 -> 1: replace the node
    out.write_text(edit(healthy_text, "UMC", "UNCORRECTABLE_COUNT", "0", "1"))
    (v,) = d.evaluate({0: healthy + src.sample()}, {}, {}, {}, 10.0, TH)
    assert (v.kind, v.action, v.gpu) == ("ecc", REPLACE, 0) and "0 -> 1" in v.evidence

    # edit: XGMI_WAFL's uncorrectable count 0 -> 1: replace (the NVLink-error analogue)
    out.write_text(edit(healthy_text, "XGMI_WAFL", "UNCORRECTABLE_COUNT", "0", "1"))
    (v,) = d.evaluate({0: healthy + src.sample()}, {}, {}, {}, 10.0, TH)
    assert (v.kind, v.action, v.gpu) == ("xgmi", REPLACE, 0) and "xGMI link error" in v.evidence

    # edit: the MI300 violation recording's socket thermal flag ACTIVE on GPU 0, held a window
    out.write_text(edit(rec("mi300_metric_throttle_rocm63_changelog.txt"), "THROTTLE",
                        "SOCKET_THERMAL_VIOLATION_STATUS", "NOT ACTIVE", "ACTIVE"))
    ticks = [src.sample() for _ in range(int(TH.throttle_window_s / 2) + 3)]
    samples = [s for tick in ticks for s in tick]
    (v,) = d.evaluate({0: samples}, {}, {}, {}, samples[-1]["ts"], TH)
    assert (v.kind, v.action, v.gpu) == ("throttle", REPLACE, 0)

    # amd-smi no longer finds the GPUs: each one it saw (GPU 1 came with the violation recording) is lost
    (tmp_path / "rc").write_text("1\n")
    out.write_text("AMDSMI_STATUS_NOT_FOUND - Device Not found\n")
    lost = src.sample()
    assert [(s["gpu"], s["gpu_is_lost"]) for s in lost] == [(0, True), (1, True)] and "exit 1" in src.last_error
    (v,) = d.evaluate({0: lost}, {}, {}, {}, lost[0]["ts"], TH)
    assert (v.kind, v.action) == ("gpu_lost", REPLACE)


def test_the_agent_opens_amd_smi_where_it_is_the_gpu_tool(tmp_path, monkeypatch):
    exe, out = fake_amd_smi(tmp_path)
    out.write_text(rec("mi300_metric_throttle_rocm63_changelog.txt"))
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    src = open_source()
    assert isinstance(src, AmdSmiSource) and src.description == "amd-smi (2 GPUs)"
    out.write_text("not json")
    monkeypatch.setenv("PATH", f"{exe.parent}")
    assert "amd-smi: " in open_source().description  # a broken amd-smi is a reason, not a crash
