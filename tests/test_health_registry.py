"""The detectors' registry: each detector declared once (kind, failure code, order, summary,
thresholds, function), and VerdictKind, KIND_ORDER, Thresholds and the spec's health keys derived
from it. A detector that lives in this test (written to a temporary module, registered by
importing it: nothing in sftctl names it) is evaluated, ordered, reported with its failure code,
and its threshold is set from a spec."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys

import pytest

from conftest import REPO, deadline, sftctl

from sftctl.health import registry
from sftctl.health import detectors as d
from sftctl.health.telemetry import Thresholds, VerdictKind
from sftctl.types import FailureCode

#: A detector of hot GPUs, one file: every sample of a GPU's last three at or above
#: ``hot_gpu_c`` degrees -> replace the node. Ranked between throttle (40) and hang (50).
HOT_DETECTOR = '''
from sftctl.health.detectors.common import _by_gpu, _ts
from sftctl.health.registry import Detector, Threshold, register
from sftctl.health.telemetry import REPLACE, Verdict
from sftctl.types import FailureCode


def _run(history, th):
    out = []
    for node in sorted(history.gpu_samples_by_node):
        for gpu, samples in _by_gpu(history.gpu_samples_by_node[node]).items():
            last = [s for s in samples if "temperature_gpu_c" in s][-3:]
            if len(last) == 3 and all(s["temperature_gpu_c"] >= th.hot_gpu_c for s in last):
                out.append(Verdict("hot", REPLACE, node, gpu, f"GPU {gpu}: "
                                   f"{last[-1]['temperature_gpu_c']} C >= {th.hot_gpu_c:g} C", _ts(last[-1])))
    return out


DETECTOR = register(Detector(
    kind="hot", code=FailureCode.THROTTLED, order=45, run=_run,
    summary="a GPU at or above hot_gpu_c for its last three samples: replace its node",
    thresholds=(Threshold("hot_gpu_c", 90.0, "C", "GPU temperature that counts as too hot",
                          spec_key="hot_gpu_c", gt=0, le=120),),
))
'''

#: What the fixture's process reports, after importing the fixture before anything else of sftctl.
PROBE = '''
import json, sys
import hot_detector  # registers "hot": the only place that names it
from sftctl.errors import SpecError
from sftctl.health import detectors as d
from sftctl.health.monitor import HealthMonitor
from sftctl.health.telemetry import Thresholds, VerdictKind
from sftctl.spec import load_spec
from sftctl.types import FailureReason

out = {"kind_order": list(d.KIND_ORDER), "code": VerdictKind.HOT.code.value,
       "member": VerdictKind("hot") is VerdictKind.HOT, "default": Thresholds().hot_gpu_c}
head = "name: a\\nrun: echo\\nresources: {accelerators: ['cpu:1']}\\n"
spec = load_spec("job.yaml", text=head + "health: {hot_gpu_c: 70, hang_timeout_s: 30}\\n")
out["spec_keys"] = list(spec.health.model_dump())
out["spec_value"] = spec.health.hot_gpu_c
th = spec.health.thresholds()
out["threshold"] = th.hot_gpu_c
try:
    load_spec("job.yaml", text=head + "health: {hot_gpu_c: 500}\\n")
except SpecError as e:
    out["bad"] = str(e)

def gpu(ts, temp, **kw):
    return {"ts": ts, "gpu": 0, "temperature_gpu_c": temp, "clock_sm_mhz": 1980, "utilization_gpu_pct": 99, **kw}

warm = [gpu(float(t), 80) for t in range(0, 8, 2)]
# the controller's path: the monitor runs evaluate, the verdict's kind names its failure code
for name, thresholds in (("default_run", Thresholds()), ("spec_run", th)):
    m = HealthMonitor(thresholds, total_steps=100)
    m.add_gpu(0, warm)
    out[name] = [v.to_dict() for v in m.verdicts(now=8.0)]
v = HealthMonitor(th, 100)
v.add_gpu(0, warm)
(verdict,) = v.verdicts(now=8.0)
why = FailureReason(verdict.kind.code, f"node 0 {verdict.kind}: {verdict.evidence}")
out["reason"] = [why.code.value, why.message]
# ordered: hot (45) wins over hang (50) on node 0; throttle (40) wins over hot on node 1
hw = 0x8  # HW slowdown
throttled = [gpu(float(t), 80, clocks_event_reasons=hw) for t in range(0, 16, 2)]
both = d.evaluate({0: warm, 1: throttled}, {}, {0: 0.0}, {0: 0}, 100.0, th)
out["ordered"] = [(x.node_rank, x.kind.value) for x in both]
json.dump(out, sys.stdout)
'''


def _fixture(tmp_path) -> dict:
    """The environment of a process that imports the fixture detector first."""
    (tmp_path / "hot_detector.py").write_text(HOT_DETECTOR)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


def test_the_builtin_detectors_declare_what_was_written_in_six_places():
    assert d.KIND_ORDER == ("gpu_lost", "xid", "ecc", "xgmi", "throttle", "hang", "straggler", "stall",
                            "preflight_failed", "preflight_slow")
    assert [k.value for k in VerdictKind] == list(d.KIND_ORDER)
    assert {k.value: k.code for k in VerdictKind} == {
        "gpu_lost": FailureCode.GPU_FAILED, "xid": FailureCode.GPU_FAILED, "ecc": FailureCode.GPU_FAILED,
        "xgmi": FailureCode.GPU_FAILED, "throttle": FailureCode.THROTTLED, "hang": FailureCode.NODE_LOST,
        "straggler": FailureCode.STRAGGLER,
        "stall": FailureCode.STALLED, "preflight_failed": FailureCode.PREFLIGHT_FAILED,
        "preflight_slow": FailureCode.PREFLIGHT_SLOW}
    th = Thresholds()
    assert {n: getattr(th, n) for n in registry.thresholds()} == {
        "app_xid_repeats": 2, "throttle_window_s": 10.0, "throttle_min_fraction": 0.8, "low_clock_ratio": 0.7,
        "busy_util_pct": 50.0, "straggler_ratio": 1.3, "straggler_window_steps": 10, "straggler_windows": 3,
        "hang_timeout_s": 60.0, "preflight_min_fraction": 0.6, "preflight_long_job_h": 4.0}
    assert registry.get_detector("stall").explained_by == ("hang",)
    assert all(det.summary and det.summary == det.summary.strip() for det in registry.detectors())


def test_the_spec_keys_and_defaults_come_from_the_registry():
    from sftctl.spec import HealthSpec

    # the same keys in the same order as before the registry (stored specs, status --json)
    assert list(HealthSpec.model_fields) == [
        "enabled", "interval_s", "preflight", "throttle_window_s", "throttle_min_fraction", "low_clock_ratio",
        "straggler_ratio", "straggler_window_steps", "straggler_windows", "hang_timeout_s", "preflight_min_fraction",
        "preflight_long_job_h", "metrics_address"]
    spec_th = HealthSpec().thresholds()
    assert spec_th == Thresholds()  # one default per threshold, written once
    assert HealthSpec(hang_timeout_s=5).thresholds() == Thresholds(hang_timeout_s=5)
    for t in registry.spec_thresholds():
        assert HealthSpec.model_fields[t.spec_key].default == t.default


def test_thresholds_refuse_unknown_names_and_assignment():
    with pytest.raises(TypeError, match="hang_timout_s"):
        Thresholds(hang_timout_s=3)
    th = Thresholds(hang_timeout_s=3)
    with pytest.raises(AttributeError):
        th.hang_timeout_s = 4
    assert th.replace(hang_timeout_s=4).hang_timeout_s == 4 and th.hang_timeout_s == 3
    assert th == Thresholds(hang_timeout_s=3) and hash(th) == hash(Thresholds(hang_timeout_s=3))
    assert pickle.loads(pickle.dumps(th)) == th and copy.deepcopy(th).hang_timeout_s == 3


def test_a_detector_is_refused_when_it_clashes():
    stall = registry.get_detector("stall")
    with pytest.raises(ValueError, match="'stall' is registered already"):
        registry.register(registry.Detector("stall", FailureCode.STALLED, 1, "x", stall.run))
    other = registry.Threshold("hang_timeout_s", 5.0, "s", "another")
    with pytest.raises(ValueError, match="threshold 'hang_timeout_s' differs"):
        registry.register(registry.Detector("other", FailureCode.UNKNOWN, 1, "x", stall.run, (other,)))
    with pytest.raises(ValueError, match="detector kind 'Bad kind'"):
        registry.Detector("Bad kind", FailureCode.UNKNOWN, 1, "x", stall.run)
    import sftctl.spec  # noqa: F401  (HealthSpec is built: a new spec key cannot join it now)

    late = registry.Threshold("late_s", 1.0, "s", "late", spec_key="late_s")
    with pytest.raises(RuntimeError, match="health.late_s comes after sftctl.spec was imported"):
        registry.register(registry.Detector("late", FailureCode.UNKNOWN, 1, "x", stall.run, (late,)))
    assert "other" not in d.KIND_ORDER and "late" not in d.KIND_ORDER  # nothing half-registered


def test_a_detector_in_one_file_is_evaluated_ordered_reported_and_set_from_a_spec(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path,
                          env=_fixture(tmp_path), timeout=deadline(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["kind_order"] == ["gpu_lost", "xid", "ecc", "xgmi", "throttle", "hot", "hang", "straggler", "stall",
                                 "preflight_failed", "preflight_slow"]
    assert out["code"] == "throttled" and out["member"] is True and out["default"] == 90.0
    assert out["spec_keys"] == [  # by the detectors that read them: hot (45) before straggler (60)
        "enabled", "interval_s", "preflight", "throttle_window_s", "throttle_min_fraction", "low_clock_ratio",
        "hot_gpu_c", "straggler_ratio", "straggler_window_steps", "straggler_windows", "hang_timeout_s",
        "preflight_min_fraction", "preflight_long_job_h", "metrics_address"]
    assert out["spec_value"] == 70.0 and out["threshold"] == 70.0
    assert out["bad"] == "job.yaml:4: health.hot_gpu_c: Input should be less than or equal to 120 (got 500)"
    assert out["default_run"] == []  # 80 C is not hot at the default 90 C
    assert out["spec_run"] == [
        {"kind": "hot", "action": "replace", "node_rank": 0, "gpu": 0, "evidence": "GPU 0: 80 C >= 70 C", "ts": 6.0}]
    assert out["reason"] == ["throttled", "node 0 hot: GPU 0: 80 C >= 70 C"]
    assert out["ordered"] == [[0, "hot"], [1, "throttle"]]
    # and in this process, which never imported it, no such detector exists
    assert "hot" not in d.KIND_ORDER


STILL_HOT = '''\
import time
from sftctl.train import report

for step in range(1, 1000):
    report(step=step, loss=1.0 / step)
    time.sleep(0.2)
'''


def test_a_job_fails_with_the_fixture_detectors_code(home, tmp_path):
    """End to end on the local provider: the CLI, the controller and the agent all import the
    fixture (a sitecustomize on PYTHONPATH, as a site would install a detector package);
    ``--set health.hot_gpu_c=60`` makes the replayed 66-68 C samples hot; the verdict ends the
    attempt with the fixture's failure code."""
    env = _fixture(tmp_path)
    (tmp_path / "sitecustomize.py").write_text("import hot_detector  # noqa: F401\n")
    (tmp_path / "job.py").write_text(STILL_HOT)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: hot\nworkdir: {tmp_path}\ntrain: {{steps: 1000}}\nresources: {{accelerators: ['cpu:1']}}\n"
                    "recovery: {max_restarts: 0}\nhealth: {interval_s: 1}\nrun: python job.py\n")
    proc = sftctl("run", str(spec), "--set", "health.hot_gpu_c=60",
                  "--set", f"env.SFTCTL_TELEMETRY_REPLAY={REPO}/tests/fixtures/healthy_h200_load.jsonl",
                  "--json", timeout=240, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "FAILED" and doc["failure_code"] == "throttled", doc
    assert "hot" in doc["failure_reason"] and ">= 60 C" in doc["failure_reason"]
    events = json.loads(sftctl("events", doc["id"], "--json", check=True, env=env).stdout)["events"]
    health = [e for e in events if e["kind"] == "health"]
    assert [(e["data"]["kind"], e["data"]["action"]) for e in health] == [("hot", "replace")]
