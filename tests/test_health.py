"""GPU and training health: detectors on recorded (synthetic) streams, sources, Prometheus output."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftctl.health import detectors as d
from sftctl.health import sources
from sftctl.health.prometheus import render
from sftctl.health.telemetry import (
    APPLICATIONS_CLOCKS_SETTING,
    DISPLAY_CLOCK_SETTING,
    GPU_IDLE,
    HW_POWER_BRAKE_SLOWDOWN,
    HW_SLOWDOWN,
    REPLACE,
    RESTART,
    SW_POWER_CAP,
    SW_THERMAL_SLOWDOWN,
    SYNC_BOOST,
    Thresholds,
)

FIXTURES = Path(__file__).parent / "fixtures"
TH = Thresholds()
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def load(name: str, *, start: float = 0.0, step_s: float = 2.0) -> list[dict]:
    """A fixture's records with ts = start, start+2, start+4, ... (replay control keys dropped)."""
    out = []
    with open(FIXTURES / name) as f:
        for i, line in enumerate(x for x in f if x.strip()):
            rec = {k: v for k, v in json.loads(line).items() if k not in ("after_s", "at_step", "repeat")}
            rec["ts"] = start + i * step_s
            out.append(rec)
    return out


def gpu_detectors(samples, node=0, th=TH, peers=None):
    return (d.gpu_lost_verdicts(samples, node, th) + d.xid_verdicts(samples, node, th)
            + d.ecc_verdicts(samples, node, th) + d.throttle_verdicts(samples, node, th, peers))


def healthy(gpu=0, ts=0.0, **kw):
    rec = {"ts": ts, "gpu": gpu, "uuid": f"GPU-{gpu}", "clocks_event_reasons": 0, "clock_sm_mhz": 1980,
           "max_clock_sm_mhz": 1980, "temperature_gpu_c": 65, "power_usage_mw": 650000,
           "enforced_power_limit_mw": 700000, "utilization_gpu_pct": 99, "ecc_uncorrected_volatile": 0,
           "remapped_rows_pending": False, "remapped_rows_failure": False, "pcie_replay_counter": 0}
    rec.update(kw)
    return rec


# ---------------------------------------------------------------------------------------------
# fixtures through the detectors


@pytest.mark.parametrize("name", ["healthy_h200_load.jsonl", "transient_slowdown.jsonl"])
def test_healthy_and_transient_streams_give_no_verdict(name):
    samples = load(name)
    assert gpu_detectors(samples) == []
    assert gpu_detectors(samples, peers=1980.0) == []  # no low-clock false alarm either
    # every trailing window along the stream, not only the last one
    for end in range(1, len(samples) + 1):
        assert d.throttle_verdicts(samples[:end], 0, TH, 1980.0) == []
    assert d.evaluate({0: samples, 1: load("healthy_h200_load.jsonl")}, {}, {}, {}, 60.0, TH) == []


def test_healthy_fixture_looks_like_an_h200_under_load():
    samples = load("healthy_h200_load.jsonl")
    assert len(samples) == 30 and samples[-1]["ts"] == 58.0
    assert all(1800 <= s["clock_sm_mhz"] <= 1980 and 98 <= s["utilization_gpu_pct"] <= 100
               and 60 <= s["temperature_gpu_c"] <= 70 for s in samples)
    assert any(s["clocks_event_reasons"] & SW_POWER_CAP for s in samples)
    assert not any(s["clocks_event_reasons"] & ~SW_POWER_CAP for s in samples)


def test_transient_fixture_has_exactly_one_hw_slowdown_sample():
    assert sum(1 for s in load("transient_slowdown.jsonl") if s["clocks_event_reasons"] & HW_SLOWDOWN) == 1


def test_sustained_slowdown_is_replaced_with_evidence():
    samples = load("sustained_slowdown.jsonl")
    (v,) = gpu_detectors(samples)
    assert (v.kind, v.action, v.node_rank, v.gpu, v.ts) == ("throttle", REPLACE, 0, 0, 58.0)
    assert v.evidence.startswith("GPU 0: HW slowdown in 6/6 samples over 10.0 s, SM clock ")
    assert v.evidence.endswith("MHz of max 1980")
    # the slowdown starts at sample 10 (ts 20): 4/6 of the window at ts 26, 5/6 (>= 0.8) at ts 28
    assert d.throttle_verdicts(samples[:14], 0, TH) == []
    (v,) = d.throttle_verdicts(samples[:15], 0, TH)
    assert "5/6 samples over 10.0 s" in v.evidence and v.ts == 28.0


def test_xid79_replaces_at_once():
    samples = load("xid79.jsonl")[:6]  # up to and including the sample with the XID
    (v,) = d.xid_verdicts(samples, 3, TH)
    assert (v.kind, v.action, v.node_rank, v.gpu, v.ts) == ("xid", REPLACE, 3, 0, 10.0)
    assert "XID 79 (GPU has fallen off the bus) seen 1x" in v.evidence
    (lost,) = d.gpu_lost_verdicts(load("xid79.jsonl"), 3, TH)
    assert lost.action == REPLACE and "4/9 samples" in lost.evidence
    (best,) = d.evaluate({3: load("xid79.jsonl")}, {}, {}, {}, 100.0, TH)
    assert best.kind == "gpu_lost"  # same action: gpu_lost wins the tie over xid


def test_xid13_once_restarts_and_twice_on_one_gpu_replaces():
    samples = load("xid13_once.jsonl")
    (v,) = gpu_detectors(samples)
    assert (v.kind, v.action) == ("xid", RESTART) and "XID 13" in v.evidence and "1x" in v.evidence
    samples[8]["xids"] = [13]
    (v,) = d.xid_verdicts(samples, 0, TH)
    assert v.action == REPLACE and "seen 2x on this GPU" in v.evidence and v.ts == 16.0
    # the same XID twice, but on two different GPUs: still an application fault
    two_gpus = [healthy(0, 0, xids=[13]), healthy(1, 2, xids=[13])]
    assert [v.action for v in d.xid_verdicts(two_gpus, 0, TH)] == [RESTART, RESTART]
    # two different application XIDs once each (13 then the 43 that often follows): restart
    (v,) = d.xid_verdicts([healthy(0, 0, xids=[13]), healthy(0, 2, xids=[43])], 0, TH)
    assert v.action == RESTART and "XID 43 x1" in v.evidence


@pytest.mark.parametrize("xid", [48, 61, 62, 64, 74, 79, 92, 95, 119, 120])
def test_hardware_xids_replace(xid):
    (v,) = d.xid_verdicts([healthy(2, 5.0, xids=[xid])], 1, TH)
    assert (v.action, v.gpu, v.node_rank, v.ts) == (REPLACE, 2, 1, 5.0)


def test_xid_table_edges():
    assert d.xid_verdicts([healthy(0, 0, xids=[63])], 0, TH) == []  # row remap recorded: informational
    (v,) = d.xid_verdicts([healthy(0, 0, xids=[94])], 0, TH)  # contained ECC: the app is killed
    assert v.action == RESTART
    (v,) = d.xid_verdicts([healthy(0, 0, xids=[999])], 0, TH)
    assert v.action == RESTART and "unknown" in v.evidence
    (v,) = d.xid_verdicts([healthy(0, 0, xids=[13, 63]), healthy(0, 2, xids=[79])], 0, TH)
    assert v.action == REPLACE and "XID 79" in v.evidence and "also XID 13 x1, XID 63 x1" in v.evidence


def test_double_bit_ecc_replaces():
    samples = load("dbe_ecc.jsonl")
    (v,) = d.ecc_verdicts(samples, 0, TH)
    assert (v.action, v.ts) == (REPLACE, 10.0)
    assert v.evidence == "GPU 0: volatile uncorrected ECC errors 0 -> 1 over 10.0 s"
    (best,) = d.evaluate({0: samples}, {}, {}, {}, 30.0, TH)
    assert best.action == REPLACE and best.kind == "xid"  # XID 48 came with it; xid before ecc
    # > 0 at first sight; a failed row remap; a pending remap alone is no fault
    (v,) = d.ecc_verdicts([healthy(ecc_uncorrected_volatile=2)], 0, TH)
    assert "2 at first sample" in v.evidence
    (v,) = d.ecc_verdicts([healthy(remapped_rows_failure=True)], 0, TH)
    assert "row remapping failure" in v.evidence
    assert d.ecc_verdicts([healthy(ts=t, remapped_rows_pending=True) for t in range(10)], 0, TH) == []


def test_gpu_lost_replaces():
    samples = [healthy(0, 0), healthy(1, 0), healthy(0, 2), {"ts": 2.0, "gpu": 1, "gpu_is_lost": True}]
    (v,) = d.gpu_lost_verdicts(samples, 4, TH)
    assert (v.kind, v.action, v.gpu, v.node_rank) == ("gpu_lost", REPLACE, 1, 4)
    assert "NVML_ERROR_GPU_IS_LOST" in v.evidence


@pytest.mark.parametrize("mask", [SW_POWER_CAP, GPU_IDLE, APPLICATIONS_CLOCKS_SETTING, SYNC_BOOST,
                                  DISPLAY_CLOCK_SETTING, SW_POWER_CAP | SYNC_BOOST | APPLICATIONS_CLOCKS_SETTING])
def test_benign_reasons_never_trigger(mask):
    samples = [healthy(ts=2.0 * i, clocks_event_reasons=mask, clock_sm_mhz=1500) for i in range(30)]
    assert d.throttle_verdicts(samples, 0, TH) == []


@pytest.mark.parametrize("mask,name", [(SW_THERMAL_SLOWDOWN, "SW thermal"),
                                       (HW_POWER_BRAKE_SLOWDOWN, "HW power brake"),
                                       (HW_SLOWDOWN | SW_POWER_CAP, "HW slowdown")])
def test_sustained_throttle_reasons_trigger(mask, name):
    samples = [healthy(ts=2.0 * i, clocks_event_reasons=mask, clock_sm_mhz=1200) for i in range(6)]
    (v,) = d.throttle_verdicts(samples, 0, TH)
    assert v.evidence == f"GPU 0: {name} in 6/6 samples over 10.0 s, SM clock 1200 MHz of max 1980"


def test_throttle_fraction_and_sampling_jitter():
    # 5 of 6 samples (0.83 >= 0.8) over a window that jitter stretched to 10.5 s
    ts = [0.0, 2.1, 4.2, 6.3, 8.4, 10.5]
    samples = [healthy(ts=t, clocks_event_reasons=HW_SLOWDOWN if i else 0) for i, t in enumerate(ts)]
    (v,) = d.throttle_verdicts(samples, 0, TH)
    assert "5/6 samples over 10.5 s" in v.evidence
    samples[2]["clocks_event_reasons"] = 0  # 4/6 < 0.8
    assert d.throttle_verdicts(samples, 0, TH) == []
    # samples around a sampling gap longer than the window do not cover it
    gap = [healthy(ts=t, clocks_event_reasons=HW_SLOWDOWN) for t in (0, 30, 31, 32)]
    assert d.throttle_verdicts(gap, 0, TH) == []
    assert len(d.throttle_verdicts(gap + [healthy(ts=40, clocks_event_reasons=HW_SLOWDOWN)], 0, TH)) == 1
    # a single transient never triggers, even with a permissive fraction
    lax = Thresholds(throttle_min_fraction=0.1)
    one = [healthy(ts=2.0 * i, clocks_event_reasons=HW_SLOWDOWN if i == 3 else 0) for i in range(6)]
    assert d.throttle_verdicts(one, 0, lax) == []


def test_low_clock_against_peers_replaces():
    slow = [healthy(0, 2.0 * i, clock_sm_mhz=1100) for i in range(8)]
    (v,) = d.throttle_verdicts(slow, 1, TH, peers_sm_clock_mhz=1980.0)
    assert v.kind == "throttle" and v.action == REPLACE
    assert v.evidence == ("GPU 0: SM clock 1100 MHz < 0.7 x peers' median 1980 MHz in 6/6 samples over 10.0 s "
                          "at utilization >= 99%")
    assert d.throttle_verdicts(slow, 1, TH, peers_sm_clock_mhz=None) == []
    assert d.throttle_verdicts(slow, 1, TH, peers_sm_clock_mhz=1500.0) == []  # 1100 >= 0.7 x 1500
    idle = [dict(s, utilization_gpu_pct=20) for s in slow]  # a low clock while idle is fine
    assert d.throttle_verdicts(idle, 1, TH, peers_sm_clock_mhz=1980.0) == []
    # through evaluate: the peers are the other nodes' busy GPUs
    fast = [healthy(g, 2.0 * i) for i in range(8) for g in range(2)]
    slow_node = fast[:-2] + [healthy(0, 14.0), healthy(1, 14.0, clock_sm_mhz=900)]
    slow_node = [dict(s, clock_sm_mhz=900) if s["gpu"] == 1 else s for s in slow_node]
    (v,) = d.evaluate({0: fast, 1: slow_node}, {}, {}, {}, 20.0, TH)
    assert (v.node_rank, v.gpu, v.kind) == (1, 1, "throttle") and "peers' median 1980 MHz" in v.evidence


# ---------------------------------------------------------------------------------------------
# training detectors


def step_series(n_steps: int, base: float, slow_from: int | None = None, factor: float = 1.5,
                noise: float = 0.0, seed: int = 0) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    out = []
    for s in range(n_steps):
        t = base * (factor if slow_from is not None and s >= slow_from else 1.0)
        out.append((s, t * (1 + rng.uniform(-noise, noise))))
    return out


RANKS = {r: r // 2 for r in range(4)}  # 4 ranks, 2 per node


def test_straggler_three_slow_windows_is_replaced():
    steps = {r: step_series(40, 1.0, noise=0.05, seed=r) for r in range(4)}
    steps[3] = step_series(40, 1.0, slow_from=10, noise=0.05, seed=3)  # windows 1, 2, 3 slow
    (v,) = d.straggler_verdicts(steps, RANKS, TH, now=99.0)
    assert (v.kind, v.action, v.node_rank, v.gpu, v.ts) == ("straggler", REPLACE, 1, None, 99.0)
    assert v.evidence.startswith("rank 3: median step time 1.5") and "3 consecutive windows of 10 steps" in v.evidence
    assert "(steps 10-39)" in v.evidence


def test_straggler_two_slow_windows_is_not_enough():
    steps = {r: step_series(40, 1.0, seed=r) for r in range(4)}
    steps[3] = step_series(40, 1.0, slow_from=20)  # windows 2, 3 only
    assert d.straggler_verdicts(steps, RANKS, TH) == []
    # an incomplete 4th window does not count: 45 steps, still only windows 2, 3 complete and slow
    steps = {r: step_series(45, 1.0) for r in range(4)}
    steps[3] = step_series(45, 1.0, slow_from=20)
    assert d.straggler_verdicts(steps, RANKS, TH) == []


def test_straggler_two_ranks_and_one_rank():
    steps = {0: step_series(30, 1.0), 1: step_series(30, 1.0, slow_from=0)}
    (v,) = d.straggler_verdicts(steps, {0: 0, 1: 1}, TH)
    assert v.node_rank == 1
    assert d.straggler_verdicts({0: step_series(30, 1.0)}, {0: 0}, TH) == []


def test_noisy_but_equal_ranks_are_no_stragglers():
    steps = {r: step_series(200, 1.0, noise=0.15, seed=r) for r in range(8)}
    assert d.straggler_verdicts(steps, {r: r for r in range(8)}, TH) == []


@settings(max_examples=40, **SETTINGS)
@given(times=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=60), n_ranks=st.integers(2, 6))
def test_identical_ranks_never_straggle(times, n_ranks):
    series = list(enumerate(times))
    steps = {r: list(series) for r in range(n_ranks)}
    assert d.straggler_verdicts(steps, {r: r for r in range(n_ranks)}, TH) == []


def test_hang():
    (v,) = d.hang_verdicts({0: 100.0, 1: 39.0, 2: 100.0}, {0: 0, 1: 0, 2: 1}, 100.0, TH)
    assert (v.kind, v.action, v.node_rank, v.gpu) == ("hang", REPLACE, 0, None)
    assert v.evidence == "rank 1: no step report for 61.0 s (timeout 60 s)"
    (v,) = d.hang_verdicts({1: (39.0, 120)}, {1: 0}, 100.0, TH)
    assert v.evidence.endswith(", last step 120")
    assert d.hang_verdicts({1: 41.0}, {1: 0}, 100.0, TH) == []  # 59 s
    assert d.hang_verdicts({1: 39.0}, {1: 0}, 100.0, TH, finished_ranks=frozenset({1})) == []


def test_evaluate_one_verdict_per_node_most_severe_first():
    th = TH
    node0 = load("xid13_once.jsonl")  # restart
    node1 = load("xid13_once.jsonl")
    node1 += [dict({k: v for k, v in s.items() if k != "xids"}, ts=s["ts"] + 20.0,
                   clocks_event_reasons=HW_SLOWDOWN, clock_sm_mhz=700) for s in node1]  # + throttle
    node2 = load("healthy_h200_load.jsonl")
    node3 = load("xid79.jsonl")
    rank_to_node = {0: 0, 1: 1, 2: 2, 3: 3, 4: 2}
    last = {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0, 4: (30.0, 55)}  # rank 4 (node 2) is hung
    steps = {r: step_series(30, 1.0) for r in rank_to_node}
    steps[1] = step_series(30, 1.0, slow_from=0)  # node 1 also straggles
    verdicts = d.evaluate({3: node3, 1: node1, 0: node0, 2: node2}, steps, last, rank_to_node, 100.0, th)
    assert [(v.node_rank, v.kind, v.action) for v in verdicts] == [
        (0, "xid", RESTART), (1, "throttle", REPLACE), (2, "hang", REPLACE), (3, "gpu_lost", REPLACE)]
    reordered = {0: list(reversed(node0))}
    assert d.evaluate({0: node0}, {}, {}, {}, 100.0, th) == d.evaluate(reordered, {}, {}, {}, 100.0, th)


def test_detectors_ignore_node_records():
    recs = [{"ts": 0.0, "no_gpu": True}, {"ts": 1.0, "agent_error": "boom"}]
    assert d.evaluate({0: recs}, {}, {}, {}, 10.0, TH) == []


# ---------------------------------------------------------------------------------------------
# nvidia-smi

SMI_CSV = """\
0, GPU-aaaa, 0x0000000000000004, 1980, 1980, 64, 652.31, 700.00, 99, 0, No, No
1, GPU-bbbb, 0x0000000000000008, 705, 1980, 71, 301.00, 700.00, 100, [N/A], [N/A], [N/A]
2, GPU-cccc, [Not Supported], [N/A], 1980, 40, [Unknown Error], 700.00, 0, 3, Yes, Yes
3, GPU-dddd, [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost]
"""


def test_parse_nvidia_smi_csv():
    rows = sources.parse_nvidia_smi_csv(SMI_CSV, sources.SMI_FIELDS)
    assert rows[0] == {"gpu": 0, "uuid": "GPU-aaaa", "clocks_event_reasons": 4, "clock_sm_mhz": 1980,
                       "max_clock_sm_mhz": 1980, "temperature_gpu_c": 64, "power_usage_mw": 652310,
                       "enforced_power_limit_mw": 700000, "utilization_gpu_pct": 99,
                       "ecc_uncorrected_volatile": 0, "remapped_rows_pending": False,
                       "remapped_rows_failure": False}
    assert rows[1]["clocks_event_reasons"] == HW_SLOWDOWN and rows[1]["power_usage_mw"] == 301000
    assert not {"ecc_uncorrected_volatile", "remapped_rows_pending", "remapped_rows_failure"} & rows[1].keys()
    assert "clocks_event_reasons" not in rows[2] and "clock_sm_mhz" not in rows[2]
    assert "power_usage_mw" not in rows[2] and rows[2]["remapped_rows_failure"] is True
    assert rows[3] == {"gpu": 3, "uuid": "GPU-dddd", "gpu_is_lost": True}
    # a header line, a short line and units (without nounits) are tolerated
    text = "index, clocks.sm [MHz], power.draw [W]\n0, 1980 MHz, 650.5 W\n1, 2\n"
    assert sources.parse_nvidia_smi_csv(text, ["index", "clocks.sm", "power.draw"]) == [
        {"gpu": 0, "clock_sm_mhz": 1980, "power_usage_mw": 650500}]
    # older driver names map to the same keys
    assert sources.parse_nvidia_smi_csv("0, 0x40, 300.0, Yes", ["index", "clocks_throttle_reasons.active",
                                                              "power.limit", "retired_pages.pending"]) == [
        {"gpu": 0, "clocks_event_reasons": 0x40, "enforced_power_limit_mw": 300000, "remapped_rows_pending": True}]


def test_nvidia_smi_source_swaps_rejected_fields():
    calls = []

    def run(cmd, **kw):
        fields = cmd[1].split("=", 1)[1].split(",")
        calls.append(fields)
        for old in ("clocks_event_reasons.active", "remapped_rows.failure"):
            if old in fields:
                return subprocess.CompletedProcess(cmd, 2, "", f'Field "{old}" is not a valid field to query.\n')
        values = {"index": "0", "uuid": "GPU-x", "clocks_throttle_reasons.active": "0x0000000000000008"}
        return subprocess.CompletedProcess(cmd, 0, ", ".join(values.get(f, "[N/A]") for f in fields) + "\n", "")

    src = sources.NvidiaSmiSource("nvidia-smi", run=run, clock=lambda: 5.0)
    assert "clocks_throttle_reasons.active" in src.fields and "remapped_rows.failure" not in src.fields
    assert src.sample() == [{"gpu": 0, "uuid": "GPU-x", "clocks_event_reasons": 8, "ts": 5.0}]
    assert len(calls) == 4  # two rejected, the accepted probe, one sample

    def broken(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 9, "NVIDIA-SMI has failed because it couldn't communicate "
                                                   "with the NVIDIA driver.\n", "")

    with pytest.raises(RuntimeError, match="couldn't communicate"):
        sources.NvidiaSmiSource("nvidia-smi", run=broken)


def test_nvidia_smi_source_reports_a_lost_gpu():
    state = {"lost": False}

    def run(cmd, **kw):
        if state["lost"]:
            return subprocess.CompletedProcess(cmd, 15, "Unable to determine the device handle for GPU "
                                                        "0000:1B:00.0: GPU is lost.  Reboot the system.\n", "")
        return subprocess.CompletedProcess(cmd, 0, "0, GPU-a" + ", 1" * 10 + "\n1, GPU-b" + ", 1" * 10 + "\n", "")

    src = sources.NvidiaSmiSource("nvidia-smi", run=run, clock=lambda: 1.0)
    assert [s["gpu"] for s in src.sample()] == [0, 1]
    state["lost"] = True
    assert src.sample() == [{"gpu": 0, "gpu_is_lost": True, "uuid": "GPU-a", "ts": 1.0},
                            {"gpu": 1, "gpu_is_lost": True, "uuid": "GPU-b", "ts": 1.0}]
    assert "GPU is lost" in src.last_error


# ---------------------------------------------------------------------------------------------
# NVML, against a stand-in for pynvml


class FakeNvmlError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value


def fake_nvml(n_gpus=2):
    m = types.SimpleNamespace(
        NVMLError=FakeNvmlError, NVML_ERROR_NOT_SUPPORTED=3, NVML_ERROR_TIMEOUT=10, NVML_ERROR_GPU_IS_LOST=15,
        NVML_ERROR_FUNCTION_NOT_FOUND=13, NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, nvmlEventTypeXidCriticalError=8,
        lost=set(), events=[], calls=[],
    )

    def guard(h):
        if h in m.lost:
            raise FakeNvmlError(15)

    def not_supported(*a):
        raise FakeNvmlError(3)

    m.nvmlInit = lambda: m.calls.append("init")
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}".encode()
    m.nvmlDeviceGetIndex = lambda h: h

    def event_reasons(h):  # an old driver: the new symbol is missing from libnvidia-ml
        raise FakeNvmlError(13)

    def throttle_reasons(h):
        guard(h)
        return SW_POWER_CAP

    m.nvmlDeviceGetCurrentClocksEventReasons = event_reasons
    m.nvmlDeviceGetCurrentClocksThrottleReasons = throttle_reasons

    def clock(h, kind):
        guard(h)
        return 1980

    m.nvmlDeviceGetClockInfo = clock
    m.nvmlDeviceGetMaxClockInfo = clock
    m.nvmlDeviceGetTemperature = lambda h, k: guard(h) or 65
    m.nvmlDeviceGetPowerUsage = lambda h: guard(h) or 650000
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: guard(h) or 700000
    m.nvmlDeviceGetUtilizationRates = lambda h: guard(h) or types.SimpleNamespace(gpu=99, memory=40)
    m.nvmlDeviceGetMemoryInfo = lambda h: guard(h) or types.SimpleNamespace(used=70_000 * 2**20 + 5, total=143_771 * 2**20)

    def ecc(h, kind, counter):
        guard(h)
        if h == 1:
            raise FakeNvmlError(3)  # no ECC on this one
        return 0

    m.nvmlDeviceGetTotalEccErrors = ecc
    m.nvmlDeviceGetRemappedRows = lambda h: guard(h) or (0, 0, 1, 0)
    m.nvmlDeviceGetPcieReplayCounter = not_supported
    m.nvmlEventSetCreate = lambda: "set"
    m.nvmlDeviceRegisterEvents = lambda h, types_, s: m.calls.append(("register", h, types_))

    def wait(s, timeout_ms):
        assert timeout_ms == 0
        if not m.events:
            raise FakeNvmlError(10)
        return m.events.pop(0)

    m.nvmlEventSetWait = wait
    m.nvmlEventSetFree = lambda s: m.calls.append("free")
    return m


def test_nvml_source_reads_every_gpu():
    nvml = fake_nvml()
    src = sources.NvmlSource(nvml=nvml, clock=lambda: 7.0)
    assert src.gpu_count == 2 and ("register", 1, 8) in nvml.calls
    nvml.events += [types.SimpleNamespace(device=1, eventType=8, eventData=79),
                    types.SimpleNamespace(device=0, eventType=8, eventData=13)]
    s0, s1 = src.sample()
    assert s0 == {"ts": 7.0, "gpu": 0, "uuid": "GPU-0", "clocks_event_reasons": SW_POWER_CAP, "clock_sm_mhz": 1980,
                  "max_clock_sm_mhz": 1980, "temperature_gpu_c": 65, "power_usage_mw": 650000,
                  "enforced_power_limit_mw": 700000, "utilization_gpu_pct": 99, "memory_used_mib": 70_000,
                  "ecc_uncorrected_volatile": 0, "remapped_rows_pending": True, "remapped_rows_failure": False,
                  "xids": [13]}
    assert "ecc_uncorrected_volatile" not in s1 and "pcie_replay_counter" not in s1 and s1["xids"] == [79]
    nvml.lost.add(1)
    s0, s1 = src.sample()
    assert "xids" not in s0 and s1 == {"ts": 7.0, "gpu": 1, "uuid": "GPU-1", "gpu_is_lost": True}
    src.close()
    assert nvml.calls[-2:] == ["free", "shutdown"]


# ---------------------------------------------------------------------------------------------
# replay, no GPU, open_source


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_replay_at_step_waits_for_training_then_repeats(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    clock = Clock()
    src = sources.ReplaySource(FIXTURES / "throttle_at_step.jsonl", metrics_dir=metrics, clock=clock)
    got = []
    for _ in range(5):
        clock.t += 1
        got.append(src.sample())
    assert [len(x) for x in got] == [1, 1, 1, 0, 0]  # three healthy records, then waiting for step 40
    assert got[0][0]["ts"] == 1001.0 and got[0][0]["clocks_event_reasons"] in (0, SW_POWER_CAP)
    (metrics / "rank-0.jsonl").write_text(json.dumps({"rank": 0, "step": 39}) + "\n")
    (metrics / "rank-1.jsonl").write_text(json.dumps({"rank": 1, "step": 38}) + "\n" + '{"rank": 1, "st')
    assert src.sample() == []
    with open(metrics / "rank-1.jsonl", "a") as f:
        f.write('ep": 40}\n')  # the half-written line completes
    clock.t += 1
    (s,) = src.sample()
    assert s["clocks_event_reasons"] == HW_SLOWDOWN and s["clock_sm_mhz"] == 705 and s["ts"] == clock.t
    assert not {"at_step", "repeat", "after_s"} & s.keys()
    samples = [s]
    for _ in range(6):
        clock.t += 2
        (s,) = src.sample()
        assert s["ts"] == clock.t
        samples.append(s)
    (v,) = d.throttle_verdicts(samples, 0, TH)  # the injected fault is caught
    assert v.kind == "throttle" and "HW slowdown in 6/6" in v.evidence


def test_replay_after_s_multi_gpu_and_repeat_until_superseded(tmp_path):
    path = tmp_path / "stream.jsonl"
    recs = [{"gpu": 0, "clock_sm_mhz": 1}, {"gpu": 1, "clock_sm_mhz": 1},
            {"gpu": 0, "clock_sm_mhz": 2}, {"gpu": 1, "clock_sm_mhz": 2},
            {"gpu": 1, "after_s": 10, "repeat": True, "clock_sm_mhz": 3, "xids": [79]},
            {"gpu": 1, "after_s": 20, "clock_sm_mhz": 4}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    clock = Clock(0.0)
    src = sources.ReplaySource(path, clock=clock)

    def tick(t):
        clock.t = t
        return [(s["gpu"], s["clock_sm_mhz"], s.get("xids")) for s in src.sample()]

    assert tick(1) == [(0, 1, None), (1, 1, None)]
    assert tick(2) == [(0, 2, None), (1, 2, None)]
    assert tick(9.9) == []
    assert tick(10) == [(1, 3, [79])]
    assert tick(12) == [(1, 3, None)]  # repeated, its XID not again
    assert tick(15) == [(1, 3, None)]
    assert tick(20) == [(1, 4, None)]  # superseded
    assert tick(22) == []


def test_replay_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"gpu": 0}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        sources.ReplaySource(bad)
    with pytest.raises(ValueError, match="metrics_dir"):
        sources.ReplaySource(FIXTURES / "throttle_at_step.jsonl")


def test_no_gpu_source():
    src = sources.NoGpuSource(clock=lambda: 3.0)
    assert src.sample() == [{"ts": 3.0, "no_gpu": True}]
    assert src.sample() == []


def test_open_source_without_gpus_is_no_gpu(monkeypatch, tmp_path):
    broken = types.ModuleType("pynvml")
    broken.NVMLError = FakeNvmlError

    def init():
        raise FakeNvmlError(12)  # NVML_ERROR_LIBRARY_NOT_FOUND

    broken.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    src = sources.open_source()
    assert isinstance(src, sources.NoGpuSource)
    assert "nvml" in src.description and "nvidia-smi not on PATH" in src.description
    assert src.sample()[0]["no_gpu"] is True
    replay = sources.open_source(replay_path=FIXTURES / "healthy_h200_load.jsonl")
    assert isinstance(replay, sources.ReplaySource) and len(replay.sample()) == 1


def test_open_source_here_never_raises():
    src = sources.open_source()  # whatever this machine has
    try:
        assert isinstance(src.sample(), list)
    finally:
        src.close()


# ---------------------------------------------------------------------------------------------
# Prometheus


def test_prometheus_render_parses_with_dcgm_names():
    parser = pytest.importorskip("prometheus_client.parser")
    samples = load("sustained_slowdown.jsonl") + [healthy(1, 100.0, xids=[13]), healthy(1, 0.0, xids=[31])]
    text = render(samples, "node-1")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert {"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL",
            "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
            "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_ROW_REMAP_PENDING",
            "DCGM_FI_DEV_ROW_REMAP_FAILURE"} <= families.keys()
    assert "# HELP DCGM_FI_DEV_SM_CLOCK " in text and "# TYPE DCGM_FI_DEV_SM_CLOCK gauge" in text
    # written by prometheus-client, whose text names a counter family <name>_total: dcgm's two
    # counters keep their names, typed untyped (no DCGM_FI_DEV_PCIE_REPLAY_COUNTER_total)
    assert "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER untyped" in text and "_total" not in text
    assert families["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"].type == "unknown"

    def value(name, gpu):
        (s,) = [s for s in families[name].samples if s.labels["gpu"] == str(gpu)]
        assert s.labels["Hostname"] == "node-1" and s.labels["UUID"]
        return s.value

    last = load("sustained_slowdown.jsonl")[-1]
    assert value("DCGM_FI_DEV_SM_CLOCK", 0) == last["clock_sm_mhz"]
    assert value("DCGM_FI_DEV_POWER_USAGE", 0) == pytest.approx(last["power_usage_mw"] / 1000)
    assert value("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 0) == HW_SLOWDOWN
    assert value("DCGM_FI_DEV_XID_ERRORS", 0) == 0 and value("DCGM_FI_DEV_XID_ERRORS", 1) == 13
    lost = render([{"ts": 1.0, "gpu": 0, "uuid": "GPU-x", "gpu_is_lost": True, "xids": [79]}], 'a"b')
    families = list(parser.text_string_to_metric_families(lost))
    assert [f.name for f in families] == ["DCGM_FI_DEV_XID_ERRORS"]
    assert families[0].samples[0].labels["Hostname"] == 'a"b' and families[0].samples[0].value == 79
    assert render([{"ts": 0.0, "no_gpu": True}], "n") == ""


# ---------------------------------------------------------------- stall (every process alive, no progress)


def test_stall_when_no_rank_progresses_for_the_timeout():
    from sftctl.health.detectors import stall_verdicts

    th = Thresholds(hang_timeout_s=30)
    ranks = {0: 0, 1: 1}
    (v,) = stall_verdicts({0: (100.0, 41), 1: (99.0, 41)}, ranks, now=161.0, th=th)
    assert (v.kind, v.action, v.node_rank) == ("stall", "restart", 0)
    assert "no rank finished a step for 61 s (last step 41)" in v.evidence
    assert stall_verdicts({0: (100.0, 41), 1: (99.0, 41)}, ranks, now=159.0, th=th) == []  # 2 x timeout
    # one rank still progressing: not a stall
    assert stall_verdicts({0: (100.0, 41), 1: (155.0, 42)}, ranks, now=161.0, th=th) == []
    # finished ranks do not count
    assert stall_verdicts({0: (10.0, 90), 1: (10.0, 90)}, ranks, now=161.0, th=th, finished_ranks={0, 1}) == []


def test_a_hung_rank_explains_the_stall():
    th = Thresholds(hang_timeout_s=30)
    # rank 1 stopped beating (hung); rank 0 beats but waits for it: only rank 1's node is blamed
    verdicts = d.evaluate({}, {}, {0: 131.0, 1: 90.0}, {0: 0, 1: 1}, 131.0, th,
                          last_steps={0: (95.0, 10), 1: (90.0, 10)})
    assert [(v.node_rank, v.kind, v.action) for v in verdicts] == [(1, "hang", "replace")]
    # every rank beats, none steps: a stall, restarted in place
    verdicts = d.evaluate({}, {}, {0: 161.0, 1: 160.0}, {0: 0, 1: 1}, 161.0, th,
                          last_steps={0: (95.0, 10), 1: (90.0, 10)})
    assert [(v.node_rank, v.kind, v.action) for v in verdicts] == [(0, "stall", "restart")]
