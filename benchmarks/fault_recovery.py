"""Time from an injected fault to its verdict and to resumed training, on the local provider.

Two faults on the quickstart (2 nodes, 1 process each), each in its own run:
* throttle: node 1's agent replays sustained HW slowdown from step 40 on
  (tests/fixtures/throttle_at_step.jsonl), sampled every second, 3 s window;
* hang: node 1's training process is frozen with SIGSTOP at step 20 (no steps, no heartbeat),
  hang timeout 6 s.
For each: fault -> verdict (the health event) and fault -> resumed (the first step report of
the next attempt). Aims: verdict within 10 s, training resumed within 60 s. The peer in the
same run is a clean run of the same job: its wall time, so the cost of the recovery shows.

    python benchmarks/fault_recovery.py     # prints a table, writes results/fault_recovery.json
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "fault_recovery.json"
BASE = ["--set", "train.steps=90", "--set", "train.checkpoint_interval=15",
        "--set", "health.interval_s=1", "--set", "health.throttle_window_s=3", "--set", "health.hang_timeout_s=6"]


def sftctl(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "sftctl.cli", *args], capture_output=True, text=True,
                          cwd=REPO, check=True).stdout


def events(job: str) -> list[dict]:
    return json.loads(sftctl("events", job, "--json"))["events"]


def wait_done(job: str) -> dict:
    while True:
        doc = json.loads(sftctl("status", job, "--json"))
        if doc["status"] in ("SUCCEEDED", "FAILED", "CANCELLED", "FAILED_CONTROLLER"):
            return doc
        time.sleep(0.5)


def timings(job: str, fault_ts: float) -> dict:
    evs = events(job)
    verdict = next(e for e in evs if e["kind"] == "health")
    resumed = next(e for e in evs if e["kind"] == "progress" and e["message"].startswith("attempt 2"))
    return {"verdict": verdict["message"], "fault_to_verdict_s": verdict["ts"] - fault_ts,
            "fault_to_resumed_s": resumed["ts"] - fault_ts}


def run_clean() -> dict:
    t0 = time.time()
    job = json.loads(sftctl("run", "examples/quickstart.yaml", *BASE, "--detach", "--json"))["job_id"]
    doc = wait_done(job)
    return {"status": doc["status"], "wall_s": time.time() - t0}


def run_throttle(home: Path) -> dict:
    t0 = time.time()
    job = json.loads(sftctl("run", "examples/quickstart.yaml", *BASE,
                            "--set", "env.SFTCTL_TELEMETRY_REPLAY=tests/fixtures/throttle_at_step.jsonl",
                            "--set", "env.SFTCTL_TELEMETRY_REPLAY_RANK=1", "--detach", "--json"))["job_id"]
    doc = wait_done(job)
    node1 = next(n for n in doc["nodes"] if n["rank"] == 1)  # the first node of rank 1
    fault_ts = None
    for line in (home / "jobs" / job / "nodes" / node1["id"] / "health.jsonl").read_text().splitlines():
        s = json.loads(line)
        if s.get("clocks_event_reasons", 0) & 0x8:
            fault_ts = s["ts"]
            break
    return {"status": doc["status"], "wall_s": time.time() - t0, **timings(job, fault_ts)}


def run_hang() -> dict:
    from sftctl import procs

    t0 = time.time()
    job = json.loads(sftctl("run", "examples/quickstart.yaml", *BASE, "--detach", "--json"))["job_id"]
    while not any(r["step"] >= 20 for r in json.loads(sftctl("status", job, "--json")).get("ranks", [])):
        time.sleep(0.3)
    node1 = next(n["id"] for n in json.loads(sftctl("status", job, "--json"))["nodes"] if n["rank"] == 1)
    pid = next(p for p in procs.tagged("SFTCTL_NODE_ID", node1)
               if b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes()
               and b"torchrun" not in Path(f"/proc/{p}/cmdline").read_bytes())
    os.kill(pid, signal.SIGSTOP)
    fault_ts = time.time()
    doc = wait_done(job)
    return {"status": doc["status"], "wall_s": time.time() - t0, **timings(job, fault_ts)}


def main() -> None:
    home = Path(tempfile.mkdtemp(prefix="sftctl-bench-"))
    os.environ["SFTCTL_HOME"] = str(home)
    rows = {"clean": run_clean(), "throttle": run_throttle(home), "hang": run_hang()}
    print(f"\nfault injection on the quickstart (90 steps, checkpoint every 15, 2 local nodes, {os.cpu_count()} cores)")
    print(f"{'run':9s} {'status':10s} {'wall s':>7s} {'fault->verdict s':>17s} {'fault->resumed s':>17s}")
    for name, r in rows.items():
        print(f"{name:9s} {r['status']:10s} {r['wall_s']:7.1f} {r.get('fault_to_verdict_s', float('nan')):17.1f} "
              f"{r.get('fault_to_resumed_s', float('nan')):17.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "runs": rows,
                                   "aims_s": {"verdict": 10, "resumed": 60}}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
