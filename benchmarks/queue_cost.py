"""What queued local jobs cost: N PENDING controllers behind a job that holds every CPU.

Starts one detached local job that takes all of this machine's CPUs (``sleep``), then N small
detached jobs that queue behind it (PENDING), lets them wait ``--window`` seconds and reads, from
/proc, the resident memory (VmRSS) of the waiting controllers and the CPU time (utime + stime)
they spent in the window. Everything is taken down after. Writes
benchmarks/results/queue_cost.json.

    python benchmarks/queue_cost.py [--jobs 15] [--window 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "queue_cost.json"


def sftctl(*args: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "sftctl.cli", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"sftctl {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=15)
    ap.add_argument("--window", type=float, default=30.0)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="sftctl-queue-"))
    env = {**os.environ, "SFTCTL_HOME": str(home)}
    cpus = os.cpu_count() or 1
    (home / "hog.yaml").write_text(f"name: hog\nresources: {{nodes: {cpus}}}\nrun: sleep 900\n")
    (home / "small.yaml").write_text("name: small\nrun: echo ran\n")
    ids = []
    try:
        ids.append(json.loads(sftctl("run", str(home / "hog.yaml"), "--detach", "--json", env=env))["job_id"])
        for _ in range(args.jobs):
            ids.append(json.loads(sftctl("run", str(home / "small.yaml"), "--detach", "--json", env=env))["job_id"])
        end = time.monotonic() + 300
        while time.monotonic() < end:
            docs = json.loads(sftctl("status", "--json", env=env))["jobs"]
            pending = [d for d in docs if d["status"] == "PENDING" and d["pending_reason"]]
            if len(pending) == args.jobs:
                break
            time.sleep(1)
        else:
            raise SystemExit("the small jobs did not all queue")
        time.sleep(5)  # past their start
        pids = [d["controller_pid"] for d in pending]
        cpu0 = sum(cpu_s(p) for p in pids)
        t0 = time.monotonic()
        time.sleep(args.window)
        cpu = sum(cpu_s(p) for p in pids) - cpu0
        wall = time.monotonic() - t0
        rss = [rss_kib(p) for p in pids]
    finally:
        for j in ids:
            subprocess.run([sys.executable, "-m", "sftctl.cli", "down", j], capture_output=True, env=env)
        shutil.rmtree(home, ignore_errors=True)
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "cores": cpus,
        "pending_jobs": args.jobs,
        "window_s": round(wall, 1),
        "rss_mib_total": round(sum(rss) / 1024, 1),
        "rss_mib_each": round(sum(rss) / 1024 / len(rss), 1),
        "cpu_s_in_window": round(cpu, 2),
        "cores_used": round(cpu / wall, 3),
    }
    print(json.dumps(doc, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
